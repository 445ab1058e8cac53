"""Adapters: PEFT folders in and out (`io`) and the slot bank that holds them (`bank`)."""

from molora.adapters.bank import AdapterBank, LoRASlots
from molora.adapters.io import LoRAAdapter, ModuleLoRA, read_adapter, read_adapter_config, save_adapter

__all__ = [
    "AdapterBank",
    "LoRASlots",
    "LoRAAdapter",
    "ModuleLoRA",
    "read_adapter",
    "read_adapter_config",
    "save_adapter",
]

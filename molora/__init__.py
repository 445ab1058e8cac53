"""molora: one base LLM, many LoRA adapters, and each token routed to the adapter that fits it.

    import molora
    mm = molora.attach(model, {"math": "path/to/peft_folder", "code": "..."})
    logits = mm(input_ids, adapter_ids=per_token_indices).logits

Public names are imported lazily so `import molora` stays cheap and has no side effects.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from molora.errors import AdapterError, BankFullError, BundleError, MoLoRAError, RoutingError

__version__ = "0.1.0"

_LAZY = {
    "attach": "molora.model.attach",
    "MoLoRAModel": "molora.model.attach",
    "load_default_base": "molora.model.base",
    "load_base": "molora.model.base",
    "VocabRouter": "molora.routing",
    "SequenceRouter": "molora.routing",
    "OracleRouter": "molora.routing",
    "Router": "molora.routing",
    "Routing": "molora.routing",
    "LearnedRouter": "molora.routing.learned",
    "load": "molora.bundle",
    "read_adapter": "molora.adapters",
    "save_adapter": "molora.adapters",
}

__all__ = ["AdapterError", "BankFullError", "BundleError", "MoLoRAError", "RoutingError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'molora' has no attribute {name!r}")

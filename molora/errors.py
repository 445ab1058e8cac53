"""The exception hierarchy: every error molora raises on bad input is a `MoLoRAError`.

Messages name what was wrong, where (adapter, file, module) and how to fix it.
"""

from __future__ import annotations


class MoLoRAError(Exception):
    """Base class of every error molora raises for bad input or state."""


class AdapterError(MoLoRAError):
    """An adapter folder cannot be read or does not fit the base model."""


class AdapterNotFound(AdapterError):
    """No adapter of that name is registered."""


class AdapterDraining(AdapterError):
    """The adapter is being unloaded (draining): new requests may not use it, it cannot be loaded again yet."""


class BankFullError(MoLoRAError):
    """No free slot is left in the adapter bank."""


class RoutingError(MoLoRAError):
    """A routing request is malformed (wrong shape, unknown adapter, bad range). `field`: which part of a request's
    routing (molora.engine.admission.RoutingRequest: "mode", "adapter", "allowed") is at fault, when one is; a
    server names its own parameter for it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class BundleError(MoLoRAError):
    """A bundle folder (molora.json) is missing, malformed or inconsistent."""


class CalibrationError(MoLoRAError):
    """A per-request chooser (`--router hybrid`) could not be calibrated on the adapters at run time (not the
    adapter's fault: the model failed while scoring it)."""

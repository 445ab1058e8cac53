"""Routers: which adapter each token uses. See `molora.routing.base` for the interface."""

from molora.routing.arrow import ArrowConfig, ArrowRouter
from molora.routing.base import OracleRouter, Router, Routing, SequenceRouter, VocabRouter, adapter_index
from molora.routing.confidence import ConfidenceChooser
from molora.routing.gates import Gate, GateConfig, GateRouter
from molora.routing.hybrid import HybridChooser
from molora.routing.merge import UniformMergeRouter

__all__ = [
    "ArrowConfig",
    "ArrowRouter",
    "ConfidenceChooser",
    "Gate",
    "GateConfig",
    "GateRouter",
    "HybridChooser",
    "OracleRouter",
    "Router",
    "Routing",
    "SequenceRouter",
    "UniformMergeRouter",
    "VocabRouter",
    "adapter_index",
]

"""Routers: which adapter each token uses. See `molora.routing.base` for the interface."""

from molora.routing.base import OracleRouter, Router, Routing, SequenceRouter, VocabRouter, adapter_index

__all__ = ["OracleRouter", "Router", "Routing", "SequenceRouter", "VocabRouter", "adapter_index"]

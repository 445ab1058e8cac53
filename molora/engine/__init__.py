"""Serving engine: continuous batching, paged KV cache, per-token routing in the batch, hot-set adapters."""

from molora.engine.engine import Engine, EngineConfig
from molora.engine.request import RequestOutput

__all__ = ["Engine", "EngineConfig", "RequestOutput"]

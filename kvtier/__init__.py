"""kvtier: hierarchical KV-cache offloading for LLM serving.

Public names are imported lazily, so ``import kvtier`` stays cheap and never pulls in torch,
zmq or aiobotocore until they are used. Pluggable classes that a configuration names stay in
their modules: cache policies in ``kvtier.policies``, back-pressure detectors and policies in
``kvtier.backpressure``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "ConfigError": "kvtier.errors",
    "RequestError": "kvtier.errors",
    "EngineClosedError": "kvtier.errors",
    "LayerwiseLoadError": "kvtier.engine.layerwise",
    "LayerGroup": "kvtier.engine.layerwise",
    "RequestExtraKeys": "kvtier.keys",
    "MultimodalItem": "kvtier.keys",
    "EngineConfig": "kvtier.config",
    "TierConfig": "kvtier.config",
    "RequestParams": "kvtier.config",
    "TierFilter": "kvtier.config",
    "KVGeometry": "kvtier.layout",
    "KVModel": "kvtier.model",
    "KVCacheGroup": "kvtier.model",
    "LookupResult": "kvtier.types",
    "Medium": "kvtier.types",
    "Locality": "kvtier.types",
    "OffloadingEvent": "kvtier.types",
    "RequestContext": "kvtier.context",
    "TieringManager": "kvtier.manager",
    "Engine": "kvtier.engine.engine",
    "open": "kvtier.engine.engine",
    "start_in_thread": "kvtier.engine.threaded",
    "LoadOutcome": "kvtier.engine.engine",
    "PrefetchOutcome": "kvtier.engine.prefetch",
    "EngineMetrics": "kvtier.metrics",
    "serve_metrics": "kvtier.metrics",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from kvtier.config import EngineConfig, RequestParams, TierConfig, TierFilter
    from kvtier.context import RequestContext
    from kvtier.engine.engine import Engine, LoadOutcome, open
    from kvtier.engine.layerwise import LayerGroup, LayerwiseLoadError
    from kvtier.engine.prefetch import PrefetchOutcome
    from kvtier.engine.threaded import start_in_thread
    from kvtier.errors import ConfigError, EngineClosedError, RequestError
    from kvtier.keys import MultimodalItem, RequestExtraKeys
    from kvtier.layout import KVGeometry
    from kvtier.manager import TieringManager
    from kvtier.metrics import EngineMetrics, serve_metrics
    from kvtier.model import KVCacheGroup, KVModel
    from kvtier.types import Locality, LookupResult, Medium, OffloadingEvent

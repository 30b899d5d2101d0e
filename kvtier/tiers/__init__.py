"""Tiers: the host tier (``HostTier``) and the secondary tiers (``fs``, ``obj``, ``memory``, …).

Names are imported lazily so that using one tier never imports another tier's dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "SecondaryTier": "kvtier.tiers.base",
    "TransferJob": "kvtier.tiers.base",
    "JobResult": "kvtier.tiers.base",
    "TierContext": "kvtier.tiers.base",
    "TierStatistics": "kvtier.tiers.base",
    "TierError": "kvtier.tiers.base",
    "ChunkNotFound": "kvtier.tiers.base",
    "ChunkCorrupt": "kvtier.tiers.base",
    "TierIOError": "kvtier.tiers.base",
    "SlotBuffer": "kvtier.tiers.slots",
    "HostTier": "kvtier.tiers.cpu",
    "PrepareStoreOutput": "kvtier.tiers.cpu",
    "CopyEngine": "kvtier.tiers.copy_engine",
    "CpuCopyEngine": "kvtier.tiers.copy_engine",
    "CudaCopyEngine": "kvtier.tiers.copy_engine",
    "HostStatistics": "kvtier.tiers.cpu",
    "MemoryTier": "kvtier.tiers.memory",
    "FaultyTier": "kvtier.tiers.faulty",
    "FileSystemTier": "kvtier.tiers.fs",
    "ObjectStoreTier": "kvtier.tiers.obj",
    "SecondaryTierFactory": "kvtier.tiers.factory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

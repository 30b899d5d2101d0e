"""The secondary tiers (``fs``, ``obj``, ``memory``, ``p2p``) and the contract they share.

The host tier's names (``HostTier``, ``SlotBuffer``, the copy engines) live in :mod:`kvtier.host`
and are exported here too, as they always were. Names are imported lazily so that using one tier
never imports another tier's dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "SecondaryTier": "kvtier.tiers.base",
    "TransferJob": "kvtier.tiers.jobs",
    "JobResult": "kvtier.tiers.jobs",
    "TierContext": "kvtier.tiers.base",
    "TierStatistics": "kvtier.tiers.base",
    "TierError": "kvtier.tiers.errors",
    "ChunkNotFound": "kvtier.tiers.errors",
    "ChunkCorrupt": "kvtier.tiers.errors",
    "TierIOError": "kvtier.tiers.errors",
    "SlotBuffer": "kvtier.host.slots",
    "HostTier": "kvtier.host.tier",
    "PrepareStoreOutput": "kvtier.host.tier",
    "CopyEngine": "kvtier.host.copy_engine",
    "CpuCopyEngine": "kvtier.host.copy_engine",
    "CudaCopyEngine": "kvtier.host.copy_engine",
    "HostStatistics": "kvtier.host.tier",
    "MemoryTier": "kvtier.tiers.memory",
    "FaultyTier": "kvtier.tiers.faulty",
    "FileSystemTier": "kvtier.tiers.fs.tier",
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

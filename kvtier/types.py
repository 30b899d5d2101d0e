"""Small value types shared by the tiers, the manager and the embedding API.

Nothing here imports another kvtier module, so every layer can use these names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "OffloadKey",
    "LookupResult",
    "OffloadPolicy",
    "Medium",
    "Locality",
    "CacheHitSource",
    "OffloadingEvent",
    "ChunkStatus",
]

#: An offload key: a chained block hash followed by the 4-byte big-endian KV-cache group index.
OffloadKey = bytes


class LookupResult(enum.Enum):
    """Answer of a single-key lookup.

    ``HIT``: present and readable now. ``HIT_PENDING``: present, but a write into the host tier is
    still in flight (counts as a hit; ask again next step). ``RETRY``: not known yet (an
    asynchronous probe is outstanding); ask again next step. ``MISS``: absent or unusable.
    """

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class OffloadPolicy(str, enum.Enum):
    """Which chunks of a request are offered to a tier.

    ``CHUNK_LEVEL``: only chunks the request computed and stored. ``REQUEST_LEVEL``: every chunk
    of the request, prefix hits included (a P/D producer: the peer fetches the whole prefix).
    """

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


class Medium(str, enum.Enum):
    """Where a tier keeps its bytes, as published in KV events."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, enum.Enum):
    """Where a tier is relative to the publishing instance (``None`` = unspecified)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class CacheHitSource(str, enum.Enum):
    """Which kind of tier supplied a loaded chunk (vLLM's ``prompt_tokens_cached_by_source``)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


@dataclass(slots=True)
class OffloadingEvent:
    """A residency change of some chunks in one tier (translated into KV events by ``events``).

    ``ownership`` is the secondary tier's label (``"1:fs"``) or ``None`` for the host tier.
    ``metadata_only`` marks a removal that only releases a failed allocation: it is published only
    for keys the tier no longer holds.
    """

    keys: list[bytes]
    medium: str
    removed: bool
    locality: str | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False
    reason: str | None = None  # kvtier extension: "evicted", "corrupt", "deleted", "failed_store"


@dataclass(slots=True)
class ChunkStatus:
    """Host-tier bookkeeping of one chunk, held by the cache policy.

    ``ref_cnt`` is ``-1`` while the write into the slot is pending, ``0`` when the chunk is ready
    and evictable, and ``n > 0`` while ``n`` readers pin it. ``slot_id`` is the host slot index.
    ``stored_at`` is a ``time.monotonic()`` stamp used for the age of evicted chunks.
    """

    ref_cnt: int
    slot_id: int
    stored_at: float = field(default=0.0)

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        return self.ref_cnt == 0

"""``MemoryTier``: a real, in-process secondary tier keeping chunk bytes in a bounded LRU.

It is the "mock backend" the tests and examples lean on, and a usable tier in its own right (a
second, larger in-process cache behind the host tier). It moves real bytes: ``write`` copies the
slot into an immutable ``bytes`` object, ``read`` copies it back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.errors import ChunkCorrupt, ChunkNotFound, TierIOError
from kvtier.types import Medium

if TYPE_CHECKING:
    from kvtier.config import TierConfig

__all__ = ["MemoryTier"]


@dataclass(slots=True)
class _StoredChunk:
    data: bytes
    stored_at: float  # time.monotonic() of the write, for the eviction-age histogram


class MemoryTier(SecondaryTier):
    """Chunks kept as ``bytes`` in an ``OrderedDict`` bounded by ``capacity_bytes`` (option).

    Writes evict least-recently-used chunks until the new one fits (each eviction is published as
    a removal with reason ``"evicted"`` and recorded in the eviction-age histogram); reads and
    :meth:`touch` refresh recency. A chunk larger than the whole capacity fails with
    ``"no_space"``. :meth:`known` answers every lookup synchronously, so this tier never RETRYs.

    The copies run on the event loop (no thread): they are memcpy-speed and keeping them on the
    loop makes every primitive atomic with respect to the others, so no lock is needed.
    """

    tier_type: ClassVar[str] = "memory"
    medium: ClassVar[Medium | None] = Medium.CPU
    supports_delete: ClassVar[bool] = True
    supports_touch: ClassVar[bool] = True
    #: Used when the options omit ``capacity_bytes`` (None: the option is required).
    default_capacity_bytes: ClassVar[int | None] = None

    def __init__(self, config: TierConfig, context: TierContext, **tunables: Any) -> None:
        super().__init__(config, context, **tunables)
        capacity = config.options.get("capacity_bytes", self.default_capacity_bytes)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigError(
                f"secondary_tiers[{config.index}].capacity_bytes: must be a positive int, got {capacity!r}"
            )
        self.capacity_bytes = capacity
        self._chunks: OrderedDict[bytes, _StoredChunk] = OrderedDict()
        self._used = 0
        self.set_usage(0, capacity)

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def bytes_used(self) -> int:
        return self._used

    def known(self, key: bytes) -> bool | None:
        return key in self._chunks

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        return [key in self._chunks for key in keys]

    async def write(self, key: bytes, src: memoryview) -> None:
        size = src.nbytes
        if size > self.capacity_bytes:
            raise TierIOError("no_space", f"chunk of {size} bytes exceeds capacity {self.capacity_bytes}")
        data = bytes(src)  # the copy: the host slot is reused once the job is reported
        old = self._chunks.pop(key, None)
        if old is not None:
            self._used -= len(old.data)
        self._evict_for(size)
        self._chunks[key] = _StoredChunk(data, time.monotonic())
        self._used += size
        self.set_usage(self._used, self.capacity_bytes)

    def _evict_for(self, size: int) -> None:
        evicted: list[bytes] = []
        now = time.monotonic()
        while self._chunks and self._used + size > self.capacity_bytes:
            key, chunk = self._chunks.popitem(last=False)
            self._used -= len(chunk.data)
            self.record_eviction(now - chunk.stored_at)
            evicted.append(key)
        self.emit_removed(evicted, "evicted")

    async def read(self, key: bytes, dst: memoryview) -> None:
        chunk = self._chunks.get(key)
        if chunk is None:
            raise ChunkNotFound(f"chunk {key.hex()[:16]} not held")
        if len(chunk.data) != dst.nbytes:
            self._drop(key)
            raise ChunkCorrupt(f"chunk {key.hex()[:16]} has {len(chunk.data)} bytes, slot has {dst.nbytes}")
        dst[:] = chunk.data
        self._chunks.move_to_end(key)

    async def delete(self, key: bytes) -> None:
        if self._drop(key):
            self.emit_removed([key], "deleted")

    def _drop(self, key: bytes) -> bool:
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            return False
        self._used -= len(chunk.data)
        self.set_usage(self._used, self.capacity_bytes)
        return True

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        for key in keys:
            if key in self._chunks:
                self._chunks.move_to_end(key)

    async def close(self) -> None:
        self._chunks.clear()
        self._used = 0
        self.set_usage(0, self.capacity_bytes)

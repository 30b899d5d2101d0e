"""An out-of-tree secondary tier: chunks kept zlib-compressed in process memory.

``ZlibMemoryTier`` shows everything a tier author writes (see docs/tiers.md, "Your own tier"): four
primitives (``write``, ``read``, ``delete``, ``known``), option validation, capacity eviction
reported through ``emit_removed``/``record_eviction``/``set_usage``, and a tier-specific metric.
The framework supplies the rest: job channels, concurrency limits, lookup verdicts, statistics
and exactly-once job reporting.

kvtier loads it from the configuration, no registration needed::

    {"type": "ZlibMemoryTier", "module_path": "custom_tier", "capacity_bytes": 8388608, "level": 6}

(``type`` is the class name, ``module_path`` a module on ``sys.path``; running this file puts
``examples/`` there. Keys besides ``type``/``module_path``/``locality``/``enable_kv_events``
reach the tier unvalidated in ``config.options``, so the tier validates them itself.)

The demonstration stores more chunks than host memory holds, so the host tier evicts the early
ones; loading them again promotes them from this tier. ::

    python examples/custom_tier.py
"""

from __future__ import annotations

import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kvtier.context import RequestContext  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.tiers.base import ChunkCorrupt, ChunkNotFound, SecondaryTier, TierContext, TierIOError  # noqa: E402
from kvtier.types import Medium  # noqa: E402

if TYPE_CHECKING:
    from kvtier.config import TierConfig

_OPTIONS = frozenset({"capacity_bytes", "level", "codec_threads"})
_MAX_CAPACITY = 1 << 40


@dataclass(slots=True)
class _Compressed:
    data: bytes
    stored_at: float  # time.monotonic() of the write, for the eviction-age histogram


class ZlibMemoryTier(SecondaryTier):
    """Chunks as zlib streams in an LRU bounded by ``capacity_bytes`` of *compressed* data.

    Options: ``capacity_bytes`` (required, positive int), ``level`` (zlib level 0-9, default 6),
    ``codec_threads`` (1-16, default 2). Compression and decompression run in worker threads
    under the tier's own ``CapacityLimiter`` so the event loop never stalls on them; they are not
    abandoned on cancellation, so no thread touches a host slot after its job was reported.

    A read checks the stream ends exactly at ``slot_bytes`` (zlib itself checks its Adler-32);
    anything else drops the chunk and raises :class:`ChunkCorrupt`, so a damaged chunk is never
    mistaken for KV and is not found again.
    """

    tier_type: ClassVar[str] = "zlib-memory"
    medium: ClassVar[Medium | None] = Medium.CPU
    # Capabilities are declared: this tier deletes chunks and takes recency hints.
    supports_delete: ClassVar[bool] = True
    supports_touch: ClassVar[bool] = True

    def __init__(self, config: TierConfig, context: TierContext, **tunables: Any) -> None:
        super().__init__(config, context, **tunables)
        where = f"secondary_tiers[{config.index}]"
        unknown = sorted(set(config.options) - _OPTIONS)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key for ZlibMemoryTier; "
                              f"allowed: {', '.join(sorted(_OPTIONS))}")
        self.capacity_bytes = _int_option(config.options, "capacity_bytes", where, 1, _MAX_CAPACITY, None)
        self.level = _int_option(config.options, "level", where, 0, 9, 6)
        threads = _int_option(config.options, "codec_threads", where, 1, 16, 2)
        self._codec_limiter = anyio.CapacityLimiter(threads)
        self._chunks: OrderedDict[bytes, _Compressed] = OrderedDict()  # least recently used first
        self._used = 0
        self.set_usage(0, self.capacity_bytes)
        self._raw_written = self.add_metric("zlib_raw_bytes", "counter", "Slot bytes given to zlib.")
        self._compressed_written = self.add_metric(
            "zlib_compressed_bytes", "counter", "Compressed bytes kept for those slot bytes.")

    # --- primitives -------------------------------------------------------------------------------
    def known(self, key: bytes) -> bool | None:
        # Everything is in this process, so every lookup is answered at once (never RETRY).
        return key in self._chunks

    async def write(self, key: bytes, src: memoryview) -> None:
        # src stays pinned for the whole job, so the thread may read it without a copy.
        data = await anyio.to_thread.run_sync(zlib.compress, src, self.level, limiter=self._codec_limiter)
        if len(data) > self.capacity_bytes:
            raise TierIOError("no_space", f"{len(data)} compressed bytes exceed capacity {self.capacity_bytes}")
        self._drop(key)
        self._evict_for(len(data))
        self._chunks[key] = _Compressed(data, time.monotonic())
        self._used += len(data)
        self.set_usage(self._used, self.capacity_bytes)
        self._raw_written.inc(src.nbytes)
        self._compressed_written.inc(len(data))

    async def read(self, key: bytes, dst: memoryview) -> None:
        chunk = self._chunks.get(key)
        if chunk is None:
            raise ChunkNotFound(f"chunk {key.hex()[:16]} not held")
        self._chunks.move_to_end(key)
        # Decompress into a private buffer and copy into dst only once it is known to be whole.
        ok = await anyio.to_thread.run_sync(_inflate_into, chunk.data, dst, limiter=self._codec_limiter)
        if not ok:
            self._drop(key)
            raise ChunkCorrupt(f"chunk {key.hex()[:16]} does not inflate to {dst.nbytes} bytes")

    async def delete(self, key: bytes) -> None:
        if self._drop(key):
            self.emit_removed([key], "deleted")

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        for key in keys:
            if key in self._chunks:
                self._chunks.move_to_end(key)

    async def close(self) -> None:
        self._chunks.clear()
        self._used = 0
        self.set_usage(0, self.capacity_bytes)

    # --- capacity -------------------------------------------------------------------------------
    def _evict_for(self, size: int) -> None:
        evicted: list[bytes] = []
        now = time.monotonic()
        while self._chunks and self._used + size > self.capacity_bytes:
            key, chunk = self._chunks.popitem(last=False)
            self._used -= len(chunk.data)
            self.record_eviction(now - chunk.stored_at)
            evicted.append(key)
        self.emit_removed(evicted, "evicted")  # invalidates their HIT verdicts, publishes events

    def _drop(self, key: bytes) -> bool:
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            return False
        self._used -= len(chunk.data)
        self.set_usage(self._used, self.capacity_bytes)
        return True


def _int_option(options: Any, name: str, where: str, low: int, high: int, default: int | None) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where}.{name}: {value!r} is invalid; expected an int in [{low}, {high}]")
    return value


def _inflate_into(data: bytes, dst: memoryview) -> bool:
    """Inflate ``data`` into ``dst``; False (``dst`` untouched) unless it is exactly ``dst``'s size."""
    inflater = zlib.decompressobj()
    try:
        # max_length bounds the output: a corrupt or hostile stream cannot balloon in memory.
        raw = inflater.decompress(data, dst.nbytes)
    except zlib.error:
        return False
    if len(raw) != dst.nbytes or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        return False
    dst[:] = raw
    return True


# --- the demonstration -----------------------------------------------------------------------------
BLOCK = 16
NUM_PROMPTS = 12
HOST_SLOTS = 4


async def demo() -> bool:
    import kvtier
    from kvtier.layout import KVGeometry

    geometry = KVGeometry("example/tiny", num_layers=2, num_kv_heads=2, head_dim=64,
                          dtype="float16", block_size=BLOCK)
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": HOST_SLOTS * geometry.slot_bytes(1),
        "secondary_tiers": [{"type": "ZlibMemoryTier", "module_path": "custom_tier",
                             "capacity_bytes": 8 << 20, "level": 6}],
    }
    shape = (32, 2, BLOCK, geometry.num_kv_heads, geometry.head_dim)
    kv = [torch.zeros(shape, dtype=torch.float16) for _ in range(geometry.num_layers)]
    gen = torch.Generator().manual_seed(0)
    for layer in kv:
        # Few distinct values so that zlib has something to do (real KV compresses far less).
        layer[:NUM_PROMPTS].copy_(torch.randint(0, 8, shape, generator=gen)[:NUM_PROMPTS].to(torch.float16))
    prompts = [[100 * i + t for t in range(BLOCK)] for i in range(NUM_PROMPTS)]

    async with kvtier.open(config, geometry, kv) as engine:
        label = engine.tiers[0].label
        print(f"tier {label}: {type(engine.tiers[0]).__name__} from {type(engine.tiers[0]).__module__}")
        for i, tokens in enumerate(prompts):
            await engine.store(tokens, [i])
        await engine.drain()  # every chunk has been cascaded to the zlib tier
        host = engine.statistics()["0:primary"]
        print(f"stored {NUM_PROMPTS} chunks; host tier holds {host.used_slots}/{host.num_slots}, "
              f"evicted {host.evictions}")
        by_tier: dict[str, int] = {}
        same = True
        # Newest first: the last HOST_SLOTS prompts are still in host memory, the rest are promoted.
        for i, tokens in reversed(list(enumerate(prompts))):
            target = 16 + i
            outcome = await engine.load_with_sources(tokens, [target])
            for source, count in outcome.tokens_by_tier.items():
                by_tier[source] = by_tier.get(source, 0) + count
            same &= outcome.tokens == BLOCK and all(torch.equal(layer[i], layer[target]) for layer in kv)
        stats = engine.statistics()[label]
    print(f"loaded all {NUM_PROMPTS} prompts back, tokens by source {by_tier}; bytes identical: {same}")
    custom = {family.name: sum(family.values.values()) for family in stats.custom_metrics}
    ratio = custom["zlib_raw_bytes"] / max(1.0, custom["zlib_compressed_bytes"])
    print(f"tier statistics: stores_completed={stats.stores_completed} loads_completed={stats.loads_completed} "
          f"bytes_written={stats.bytes_written} bytes_read={stats.bytes_read} "
          f"bytes_used={stats.bytes_used}/{stats.capacity_bytes} compression_ratio={ratio:.1f}")
    promoted = by_tier.get(label, 0)
    return same and promoted >= (NUM_PROMPTS - HOST_SLOTS) * BLOCK and stats.loads_completed > 0


def main() -> None:
    if not anyio.run(demo):
        print("custom_tier: FAILED")
        raise SystemExit(1)
    print("custom_tier: promotions from the out-of-tree tier were byte-identical")


if __name__ == "__main__":
    main()

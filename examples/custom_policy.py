"""An out-of-tree host-tier cache policy: first-in, first-out.

``FIFOPolicy`` evicts the chunk that entered host memory first, whatever happened to it since:
reading a chunk does not save it (unlike ``lru``). It is a complete :class:`CachePolicy`:

* it owns the key → ``ChunkStatus`` map and never changes ``ref_cnt`` (the host tier does);
* ``evict(n, protected)`` is atomic: it returns exactly ``n`` victims, all with ``ref_cnt == 0``
  and none in ``protected``, or ``None`` and changes nothing.

kvtier finds an out-of-tree policy in one of two ways, both shown here:

1. ``CachePolicyFactory.register_cache_policy("fifo", "custom_policy", "FIFOPolicy")`` and then
   ``"eviction_policy": "fifo"`` in the configuration (the module is imported on first use);
2. no registration, the configuration names the class and its module:
   ``"eviction_policy": "FIFOPolicy", "cache_policy_module_path": "custom_policy"``.

The module must be importable: running this file puts ``examples/`` first on ``sys.path``.
The same workload runs under ``lru`` for contrast; the lines starting with ``evicted`` come from
the policy itself. ::

    python examples/custom_policy.py
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kvtier.context import RequestContext  # noqa: E402
from kvtier.policies import CachePolicy  # noqa: E402
from kvtier.types import ChunkStatus  # noqa: E402

logger = logging.getLogger("custom_policy")


class FIFOPolicy(CachePolicy):
    """Evict in insertion order among ready, unpinned, unprotected chunks.

    Recency hooks (``touch``, ``on_request_finished``, ...) are deliberately ignored: that is what
    makes it FIFO. ``evict`` scans from the oldest chunk, so it costs O(resident chunks) in the
    worst case (every old chunk pinned); fine for an example, a production policy would keep a
    separate queue of evictable chunks as ``LRUPolicy`` does.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._chunks: OrderedDict[bytes, ChunkStatus] = OrderedDict()  # oldest first

    def get(self, key: bytes) -> ChunkStatus | None:
        return self._chunks.get(key)

    def __len__(self) -> int:
        return len(self._chunks)

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        # Stored by reference: the host tier's later ref_cnt updates show through get().
        self._chunks[key] = chunk

    def remove(self, key: bytes) -> None:
        self._chunks.pop(key, None)

    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """Accesses do not change FIFO order."""

    def on_request_finished(self, key_groups: Sequence[Sequence[bytes]], insertion_only_keys: Collection[bytes],
                            reused_keys: Collection[bytes], req_context: RequestContext | None) -> None:
        """Nor do finished requests (the base class would touch their keys)."""

    def mark_evictable(self, key: bytes) -> None:
        """Nothing to track: ``evict`` reads ``ref_cnt`` directly."""

    def mark_non_evictable(self, key: bytes) -> None:
        """Nothing to track: ``evict`` reads ``ref_cnt`` directly."""

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        if n <= 0:
            return []
        victims: list[bytes] = []
        for key, chunk in self._chunks.items():
            if chunk.ref_cnt == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None  # atomic: nothing was removed
        evicted = [(key, self._chunks.pop(key)) for key in victims]
        for key, chunk in evicted:
            logger.info("evicted chunk %s from slot %d (FIFO)", key[:4].hex(), chunk.slot_id)
        return evicted

    def clear(self) -> None:
        self._chunks.clear()


# --- the demonstration -----------------------------------------------------------------------------
BLOCK = 16
HOST_SLOTS = 4


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(BLOCK)]  # one chunk per prompt


async def run_workload(config: dict[str, object]) -> dict[str, bool]:
    """Fill the host tier with prompts A-D, read A, add E: which prompts survive?"""
    import kvtier
    from kvtier.layout import KVGeometry

    geometry = KVGeometry("example/tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                          dtype="float16", block_size=BLOCK)
    kv = [torch.zeros((8, 2, BLOCK, 2, 16), dtype=torch.float16) for _ in range(geometry.num_layers)]
    names = "ABCDE"
    engine_config = {"cpu_bytes_to_use": HOST_SLOTS * geometry.slot_bytes(1), **config}
    async with kvtier.open(engine_config, geometry, kv) as engine:
        print(f"policy in use: {type(engine.host.policy).__name__} "
              f"(from {type(engine.host.policy).__module__})")
        for i in range(4):
            await engine.store(prompt(i), [i])
        await engine.load(prompt(0), [7])  # a reader uses A: LRU now keeps it, FIFO does not care
        await engine.store(prompt(4), [4])  # the host tier is full: one chunk must go
        survivors = {names[i]: engine.cached_prefix_tokens(prompt(i)) > 0 for i in range(5)}
        evictions = engine.statistics()["0:primary"].evictions
    print(f"evictions={evictions}; still cached: {' '.join(n for n, ok in survivors.items() if ok)}")
    return survivors


async def demo() -> bool:
    from kvtier.policies import CachePolicyFactory

    ok = True
    # Way 1: a registered name. Registration is process-wide and may happen only once per name.
    if "fifo" not in CachePolicyFactory.registered_names():
        CachePolicyFactory.register_cache_policy("fifo", "custom_policy", "FIFOPolicy")
    print("== eviction_policy 'fifo' (registered name)")
    survivors = await run_workload({"eviction_policy": "fifo"})
    ok &= not survivors["A"] and survivors["B"] and survivors["E"]

    # Way 2: the class name plus the module that holds it; no registration needed.
    print("== eviction_policy 'FIFOPolicy' with cache_policy_module_path 'custom_policy'")
    survivors = await run_workload({"eviction_policy": "FIFOPolicy", "cache_policy_module_path": "custom_policy"})
    ok &= not survivors["A"] and survivors["B"] and survivors["E"]

    print("== eviction_policy 'lru' (built in, for contrast)")
    survivors = await run_workload({"eviction_policy": "lru"})
    ok &= survivors["A"] and not survivors["B"] and survivors["E"]
    return ok


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logger.setLevel(logging.INFO)
    if not anyio.run(demo):
        print("custom_policy: unexpected survivors")
        raise SystemExit(1)
    print("custom_policy: FIFO evicted the oldest chunk although it was just read; LRU kept it")


if __name__ == "__main__":
    main()

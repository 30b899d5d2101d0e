"""TieringManager semantics (lookup, promotion, store, eviction, completion), driven step by step with real tiers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from kvtier.config import EngineConfig
from kvtier.context import RequestContext
from kvtier.host.tier import HostTier
from kvtier.keys import make_offload_key
from kvtier.manager import TieringManager
from kvtier.tiers.base import TierContext
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.types import LookupResult

SLOT = 4096


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), 0)


@contextlib.asynccontextmanager
async def stack(tiers: list[dict], slots: int = 8) -> AsyncIterator[TieringManager]:
    """A host tier of ``slots`` slots plus running secondary tiers, wired to a manager."""
    config = EngineConfig.from_dict(
        {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * SLOT, "secondary_tiers": tiers}
    )
    host = HostTier(slots, SLOT)
    built = []
    for tier_cfg in config.secondary_tiers:
        context = TierContext(index=tier_cfg.index, label=tier_cfg.label, slot_bytes=SLOT, host=host.buffer,
                              geometry=None, blocks_per_chunk=1, run_fields={})
        built.append(SecondaryTierFactory.create(tier_cfg, context))
    async with anyio.create_task_group() as tg:
        for tier in built:
            await tg.start(tier.run)
        try:
            yield TieringManager(host, built)
        finally:
            for tier in built:
                await tier.aclose()
            host.close()


async def settle(manager: TieringManager) -> None:
    """Let tier workers run until every submitted job has been processed."""
    with anyio.fail_after(5):
        while True:
            manager.on_schedule_end()
            if not manager.jobs_in_flight:
                return
            await anyio.sleep(0.001)


async def store(manager: TieringManager, keys: list[bytes], fill: int = 1) -> None:
    ctx = RequestContext(f"store-{keys[0].hex()[:8]}")
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    for slot in out.slot_ids:
        manager.host.slot_view(slot)[:] = bytes([fill]) * SLOT
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    await settle(manager)


async def evict_all(manager: TieringManager, slots: int = 8) -> None:
    """Push the host tier's content out by storing other keys."""
    await store(manager, [key(10_000 + i) for i in range(slots)], fill=9)


@pytest.mark.anyio
async def test_store_cascades_to_every_tier_and_unpins_after_reports() -> None:
    tiers = [{"type": "memory", "capacity_bytes": 1 << 20}, {"type": "memory", "capacity_bytes": 1 << 20}]
    async with stack(tiers) as manager:
        await store(manager, [key(1), key(2)])
        assert manager.host.statistics().pinned_slots == 0
        ctx = RequestContext("probe")
        for tier in manager.tiers:
            assert tier.lookup(key(1), ctx) is LookupResult.HIT
            assert tier.statistics().bytes_written == 2 * SLOT


@pytest.mark.anyio
async def test_secondary_hit_promotes_once_and_answers_hit_pending() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}]) as manager:
        await store(manager, [key(1)], fill=7)
        await evict_all(manager)
        assert manager.host.lookup(key(1)) is LookupResult.MISS
        a, b = RequestContext("a"), RequestContext("b")
        assert manager.lookup(key(1), a) is LookupResult.HIT_PENDING
        # a second request in the same step sees the pending write, no duplicate promotion
        assert manager.lookup(key(1), b) is LookupResult.HIT_PENDING
        loads_before = manager.tiers[0].statistics().loads_completed
        await settle(manager)
        assert manager.tiers[0].statistics().loads_completed == loads_before + 1
        assert manager.lookup(key(1), a) is LookupResult.HIT
        slot = manager.prepare_load([key(1)], a)[0]
        assert bytes(manager.host.slot_view(slot)) == bytes([7]) * SLOT
        manager.complete_load([key(1)], a)
        assert manager.get_load_source(key(1), a) == "1:memory"
        assert manager.get_load_source(key(1), b) == "0:primary"


@pytest.mark.anyio
async def test_promotions_of_one_request_are_one_job_per_tier() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}], slots=8) as manager:
        keys = [key(i) for i in range(3)]
        await store(manager, keys)
        await evict_all(manager)
        ctx = RequestContext("r")
        assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
        assert manager.statistics().active_promotion_jobs["1:memory"] == 0  # not submitted before step end
        manager.on_schedule_end()
        assert manager.statistics().active_promotion_jobs["1:memory"] == 1
        await settle(manager)
        assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in keys)


@pytest.mark.anyio
async def test_partial_promotion_failure_keeps_the_loaded_chunks() -> None:
    async with stack([{"type": "faulty", "capacity_bytes": 1 << 20}]) as manager:
        keys = [key(i) for i in range(3)]
        await store(manager, keys)
        await evict_all(manager)
        manager.tiers[0].fail_reads_of([keys[1]])
        ctx = RequestContext("r")
        for k in keys:
            manager.lookup(k, ctx)
        await settle(manager)
        assert manager.lookup(keys[0], ctx) is LookupResult.HIT
        assert manager.lookup(keys[2], ctx) is LookupResult.HIT
        # the failed key is a miss now and is not promoted again from a stale verdict
        assert manager.lookup(keys[1], ctx) in (LookupResult.MISS, LookupResult.RETRY)
        assert manager.statistics().promotion_job_failures["1:faulty"] == 1
        assert manager.host.statistics().pinned_slots == 0


@pytest.mark.anyio
async def test_kv_load_tiers_restricts_which_tiers_are_consulted() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}]) as manager:
        await store(manager, [key(1)])
        await evict_all(manager)
        host_only = RequestContext("h", {"kv_load_tiers": []})
        assert manager.lookup(key(1), host_only) is LookupResult.MISS
        by_name = RequestContext("n", {"kv_load_tiers": ["memory"]})
        assert manager.lookup(key(1), by_name) is LookupResult.HIT_PENDING


@pytest.mark.anyio
async def test_reset_cache_holds_promotions_until_flushed() -> None:
    async with stack([{"type": "memory", "capacity_bytes": 1 << 20}]) as manager:
        await store(manager, [key(1)])
        manager.reset_cache()
        ctx = RequestContext("r")
        assert manager.host.lookup(key(1)) is LookupResult.MISS
        assert manager.lookup(key(1), ctx) is LookupResult.MISS
        manager.on_reset_flushed()
        assert manager.lookup(key(1), ctx) is LookupResult.HIT_PENDING
        await settle(manager)


@pytest.mark.anyio
async def test_reset_cache_refuses_while_jobs_are_in_flight() -> None:
    async with stack([{"type": "faulty", "capacity_bytes": 1 << 20, "latency_s": 60.0}]) as manager:
        ctx = RequestContext("s")
        out = manager.prepare_store([key(1)], ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        with pytest.raises(RuntimeError, match="in flight"):
            manager.reset_cache()


@pytest.mark.anyio
async def test_failed_cascade_is_counted_and_unpins() -> None:
    async with stack([{"type": "faulty", "capacity_bytes": 1 << 20, "fail_write_fraction": 1.0}]) as manager:
        await store(manager, [key(1), key(2)])
        assert manager.statistics().cascade_job_failures["1:faulty"] == 1
        assert manager.host.statistics().pinned_slots == 0
        assert manager.host.lookup(key(1)) is LookupResult.HIT


def test_spec_name_selects_builtin_and_out_of_tree_specs(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from kvtier.errors import ConfigError
    from kvtier.specs import CPUOffloadingSpec, TieringOffloadingSpec, load_spec

    assert isinstance(load_spec(EngineConfig.from_dict({"cpu_bytes_to_use": SLOT})), CPUOffloadingSpec)
    tiering = EngineConfig.from_dict({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": SLOT})
    assert isinstance(load_spec(tiering), TieringOffloadingSpec)
    (tmp_path / "my_specs.py").write_text(
        "from kvtier.manager import TieringManager\n"
        "from kvtier.specs import TieringOffloadingSpec\n"
        "class CountingManager(TieringManager):\n"
        "    pass\n"
        "class MySpec(TieringOffloadingSpec):\n"
        "    def create_manager(self, host, tiers):\n"
        "        return CountingManager(host, tiers)\n"
        "NotASpec = object\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = EngineConfig.from_dict({"spec_name": "MySpec", "spec_module_path": "my_specs", "cpu_bytes_to_use": SLOT})
    spec = load_spec(custom)
    host = HostTier(1, SLOT)
    assert type(spec.create_manager(host, [])).__name__ == "CountingManager"
    with pytest.raises(ConfigError, match="not an OffloadingSpec"):
        load_spec(EngineConfig.from_dict({"spec_name": "NotASpec", "spec_module_path": "my_specs",
                                          "cpu_bytes_to_use": SLOT}))
    with pytest.raises(ConfigError, match="cannot import"):
        load_spec(EngineConfig.from_dict({"spec_name": "X", "spec_module_path": "no_such_module_kv",
                                          "cpu_bytes_to_use": SLOT}))

"""Write policies in the manager (write_back, selective), driven step by step with real tiers.

The write-through behaviour is specified by ``tests/test_manager.py``, unchanged.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import anyio
import pytest
from test_manager import SLOT, key, settle, stack

from kvtier.backpressure import BackpressureDetector, BackpressureStatistics, DropStorePolicy
from kvtier.context import RequestContext
from kvtier.host.tier import PrepareStoreOutput
from kvtier.manager import TieringManager
from kvtier.policies.write import WriteLedger, WritePolicy, WriteTierStatistics
from kvtier.types import LookupResult


def tier(write_policy: str = "write_back", type_: str = "memory", **kw: Any) -> dict[str, Any]:
    return {"type": type_, "capacity_bytes": 1 << 22, "write_policy": write_policy, **kw}


def payload(k: bytes) -> bytes:
    return hashlib.sha256(k).digest() * (SLOT // 32)


def stats(manager: TieringManager, label: str = "1:memory") -> WriteTierStatistics:
    return manager.statistics().write_policies[label]


async def put(manager: TieringManager, keys: list[bytes], name: str = "store") -> PrepareStoreOutput:
    """Store ``keys`` as the engine does: while the host tier has no room, wait for the tier jobs
    in flight (the write-backs the manager started) and ask again."""
    ctx = RequestContext(f"{name}-{keys[0].hex()[:8]}")
    with anyio.fail_after(5):
        while (out := manager.prepare_store(keys, ctx)) is None:
            assert manager.jobs_in_flight, "no room and no write-back in flight"
            await settle(manager)
    for k, slot in zip(out.keys_to_store, out.slot_ids):
        manager.host.slot_view(slot)[:] = payload(k)
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return out


def hit(manager: TieringManager, keys: list[bytes], req: str) -> None:
    """A request loads ``keys`` from host memory, as the engine does (pin, copy, unpin, touch)."""
    ctx = RequestContext(req)
    manager.prepare_load(keys, ctx)
    manager.complete_load(keys, ctx)
    manager.touch(keys, ctx)
    manager.on_request_finished(ctx)


async def read_back(manager: TieringManager, k: bytes) -> bytes | None:
    """The chunk's bytes as a load sees them (promoted first when needed); ``None``: a miss."""
    ctx = RequestContext(f"read-{k.hex()[:8]}")
    with anyio.fail_after(5):
        while True:
            verdict = manager.lookup(k, ctx)
            if verdict is LookupResult.HIT:
                break
            if verdict is LookupResult.MISS:
                manager.on_request_finished(ctx)
                return None
            await settle(manager)
    slot = manager.prepare_load([k], ctx)[0]
    data = bytes(manager.host.slot_view(slot))
    manager.complete_load([k], ctx)
    manager.on_request_finished(ctx)
    return data


def in_tier(manager: TieringManager, k: bytes, idx: int = 0) -> bool:
    return manager.tiers[idx].lookup(k, RequestContext("probe")) is LookupResult.HIT


def chunks_written(manager: TieringManager, idx: int = 0) -> int:
    return manager.tiers[idx].statistics().bytes_written // SLOT


# --- write_back -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_write_back_writes_nothing_at_store_and_holds_the_chunks() -> None:
    async with stack([tier("write_through"), tier()]) as manager:
        await put(manager, [key(1), key(2)])
        await settle(manager)
        assert chunks_written(manager, 0) == 2
        assert chunks_written(manager, 1) == 0
        assert manager.host.statistics().pinned_slots == 2  # dirty: not evictable
        assert manager.dirty_chunks_by_tier() == {"2:memory": 2}
        through, back = stats(manager, "1:memory"), stats(manager, "2:memory")
        assert (through.policy, through.chunks_written_through) == ("write_through", 2)
        assert (back.policy, back.dirty_chunks, back.chunks_written_back) == ("write_back", 2, 0)


@pytest.mark.anyio
async def test_write_back_writes_exactly_the_evicted_chunks_least_recently_hit_first() -> None:
    async with stack([tier()], slots=4) as manager:
        for i in range(4):
            await put(manager, [key(i)])
        hit(manager, [key(0)], "reader")  # key(0) is now the most recently hit
        ctx = RequestContext("big")
        assert manager.prepare_store([key(10), key(11)], ctx) is None
        assert stats(manager).write_backs_evict == 2
        assert manager.jobs_in_flight == 1
        assert stats(manager).dirty_chunks == 4  # not written yet: the write-backs in flight too
        assert manager.dirty_chunks_by_tier() == {"1:memory": 2}  # not started: key(0), key(3)
        await settle(manager)
        out = manager.prepare_store([key(10), key(11)], ctx)
        assert out is not None
        assert sorted(out.evicted_keys) == sorted([key(1), key(2)])
        manager.complete_store(out.keys_to_store, ctx)
        assert [i for i in range(4) if in_tier(manager, key(i))] == [1, 2]
        assert stats(manager).chunks_written_back == 2
        assert stats(manager).dirty_chunks == 4  # key(0), key(3), key(10), key(11)


@pytest.mark.anyio
async def test_eviction_storm_loses_no_chunk_and_writes_each_evicted_chunk_once() -> None:
    async with stack([tier()], slots=4) as manager:
        stored: list[bytes] = []
        evicted: list[bytes] = []
        for i in range(40):
            keys = [key(2 * i)] if i % 3 else [key(2 * i), key(2 * i + 1)]
            out = await put(manager, keys)
            stored.extend(out.keys_to_store)
            evicted.extend(out.evicted_keys)
        await settle(manager)
        assert chunks_written(manager) == len(evicted)
        assert sorted(k for k in stored if in_tier(manager, k)) == sorted(evicted)
        for k in stored:
            assert manager.host.lookup(k) is LookupResult.HIT or in_tier(manager, k)
        for k in stored:
            assert await read_back(manager, k) == payload(k)
        manager.flush_write_back()
        await settle(manager)
        # every chunk written once: promoted chunks are not written again
        assert chunks_written(manager) == len(stored)
        assert manager.host.statistics().pinned_slots == 0
        assert stats(manager).write_backs_evict + stats(manager).write_backs_flush == len(stored)


@pytest.mark.anyio
async def test_flush_write_back_writes_every_dirty_chunk_to_every_write_back_tier() -> None:
    async with stack([tier(), tier()]) as manager:
        keys = [key(i) for i in range(3)]
        await put(manager, keys)
        assert manager.flush_write_back() == 3
        assert manager.flush_write_back() == 0  # nothing dirty left to start
        await settle(manager)
        for idx, label in enumerate(("1:memory", "2:memory")):
            assert all(in_tier(manager, k, idx) for k in keys)
            s = stats(manager, label)
            assert (s.write_backs_flush, s.chunks_written_back, s.dirty_chunks) == (3, 3, 0)
        assert manager.host.statistics().pinned_slots == 0
        assert manager.host.statistics().evictable == 3


@pytest.mark.anyio
async def test_a_failed_write_back_loses_only_that_chunk() -> None:
    async with stack([tier(type_="faulty")], slots=4) as manager:
        label = "1:faulty"
        for i in range(4):
            await put(manager, [key(i)])
        manager.tiers[0].fail_writes_of([key(0)])
        out = await put(manager, [key(4)])  # writes key(0) back: it fails, key(0) is clean anyway
        assert out.evicted_keys == [key(0)]
        out = await put(manager, [key(5)])
        assert out.evicted_keys == [key(1)]
        s = stats(manager, label)
        assert (s.write_backs_failed, s.chunks_written_back, s.dirty_chunks) == (1, 1, 4)
        assert manager.statistics().cascade_job_failures[label] == 1
        assert await read_back(manager, key(0)) is None  # a miss, never other bytes
        assert await read_back(manager, key(1)) == payload(key(1))
        for i in range(2, 6):
            assert await read_back(manager, key(i)) == payload(key(i))


class AlwaysShedding(BackpressureDetector):
    """A detector under pressure for good: with ``DropStorePolicy`` every store is shed."""

    def __init__(self) -> None:
        super().__init__(DropStorePolicy())

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None: ...

    def is_under_pressure(self) -> bool:
        return True

    def reset(self) -> None: ...

    def statistics(self) -> BackpressureStatistics:
        return BackpressureStatistics(True, False, None, 0)


@pytest.mark.anyio
async def test_a_shed_write_back_makes_the_chunk_clean_unwritten() -> None:
    async with stack([tier()], slots=2) as built:
        manager = TieringManager(built.host, built.tiers, backpressure=[AlwaysShedding()])
        await put(manager, [key(0)])
        await put(manager, [key(1)])
        out = manager.prepare_store([key(2)], RequestContext("s"))  # room at once: no job to wait for
        assert out is not None and out.evicted_keys == [key(0)]
        s = stats(manager)
        assert (s.write_backs_evict, s.write_backs_skipped, s.chunks_written_back) == (1, 1, 0)
        assert manager.statistics().backpressure_stores_dropped["1:memory"] == 1
        assert manager.jobs_in_flight == 0
        assert chunks_written(manager) == 0


@pytest.mark.anyio
async def test_a_promotion_waits_for_write_backs_and_a_promoted_chunk_is_clean() -> None:
    async with stack([tier("write_through"), tier()], slots=2) as manager:
        for i in range(3):
            await put(manager, [key(i)])  # the third writes key(0) back to tier 2 and evicts it
        assert manager.host.lookup(key(0)) is LookupResult.MISS
        ctx = RequestContext("load")
        # host memory holds two dirty chunks: the promotion from tier 1 starts a write-back first
        assert manager.lookup(key(0), ctx) is LookupResult.RETRY
        await settle(manager)
        assert manager.lookup(key(0), ctx) is LookupResult.HIT_PENDING
        await settle(manager)
        assert manager.lookup(key(0), ctx) is LookupResult.HIT
        manager.on_request_finished(ctx)
        assert manager.dirty_chunks_by_tier() == {"2:memory": 1}  # key(2): the promoted chunk is clean
        assert manager.host.statistics().pinned_slots == 1
        assert manager.flush_write_back() == 1


@pytest.mark.anyio
async def test_reset_cache_drops_dirty_chunks_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    async with stack([tier()]) as manager:
        await put(manager, [key(0), key(1)])
        with caplog.at_level(logging.WARNING, logger="kvtier.manager"):
            manager.reset_cache()
        assert "2 chunks not yet written to write-back tier 1:memory are dropped" in caplog.text
        s = stats(manager)
        assert (s.write_backs_dropped, s.dirty_chunks) == (2, 0)
        assert manager.host.statistics().pinned_slots == 0
        manager.on_reset_flushed()
        assert manager.flush_write_back() == 0
        assert chunks_written(manager) == 0


# --- selective ----------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_selective_writes_only_chunks_hit_min_hits_times() -> None:
    async with stack([tier("selective", min_hits=2)], slots=4) as manager:
        await put(manager, [key(0), key(1), key(2)])
        assert manager.jobs_in_flight == 0 and chunks_written(manager) == 0
        assert manager.host.statistics().pinned_slots == 0  # nothing held: evictable as usual
        hit(manager, [key(0)], "a")
        hit(manager, [key(1)], "a")
        assert manager.jobs_in_flight == 0
        hit(manager, [key(0), key(1)], "b")  # key(0)'s second hit; key(1)'s too
        twice = RequestContext("c")  # one request hitting key(2) twice is one hit
        manager.prepare_load([key(2)], twice)
        manager.complete_load([key(2)], twice)
        manager.touch([key(2)], twice)
        manager.prepare_load([key(2)], twice)
        manager.complete_load([key(2)], twice)
        manager.on_request_finished(twice)
        await settle(manager)
        assert [in_tier(manager, key(i)) for i in range(3)] == [True, True, False]
        hit(manager, [key(0)], "d")  # a third hit writes nothing again
        await settle(manager)
        assert chunks_written(manager) == 2
        s = stats(manager)
        assert (s.policy, s.chunks_written_selective, s.selective_unwritten) == ("selective", 2, 1)
        await put(manager, [key(10 + i) for i in range(4)])  # evicts all three
        s = stats(manager)
        assert (s.selective_evicted_unwritten, s.selective_unwritten) == (1, 4)
        assert not in_tier(manager, key(2))
        assert await read_back(manager, key(2)) is None
        assert await read_back(manager, key(0)) == payload(key(0))


@pytest.mark.anyio
async def test_tiers_with_different_policies_each_get_what_theirs_says() -> None:
    tiers = [tier("write_through"), tier("write_back"), tier("selective", min_hits=1)]
    async with stack(tiers) as manager:
        await put(manager, [key(0), key(1)])
        hit(manager, [key(1)], "r")
        await settle(manager)
        assert [chunks_written(manager, i) for i in range(3)] == [2, 0, 1]
        manager.flush_write_back()
        await settle(manager)
        assert [chunks_written(manager, i) for i in range(3)] == [2, 2, 1]
        written = {label: (s.chunks_written_through, s.chunks_written_back, s.chunks_written_selective)
                   for label, s in manager.statistics().write_policies.items()}
        assert written == {"1:memory": (2, 0, 0), "2:memory": (0, 2, 0), "3:memory": (0, 0, 1)}


# --- the ledger on its own --------------------------------------------------------------------------


def test_ledger_settles_a_chunk_once_every_write_back_tier_is_done() -> None:
    ledger = WriteLedger([WritePolicy("write_back"), WritePolicy("write_back"), WritePolicy("write_through")])
    assert ledger.stored([b"a", b"b"], [0, 1]) == [b"a", b"b"]
    assert ledger.stored([b"a"], [0, 1]) == []  # a duplicate completion changes nothing
    ledger.hit([b"a"], None)
    assert ledger.take_dirty(1, reason="evict") == {0: [b"b"], 1: [b"b"]}
    assert (ledger.num_dirty, ledger.num_cleaning) == (1, 1)
    assert ledger.settled(0, [b"b"], "written") == []
    assert ledger.settled(0, [b"b"], "written") == []  # settled twice for one tier: once
    assert ledger.settled(1, [b"b"], "failed") == [b"b"]
    assert ledger.unstarted_by_tier() == {0: 1, 1: 1}
    assert ledger.clear() == {0: 1, 1: 1}
    s0, s1 = ledger.statistics(0), ledger.statistics(1)
    assert (s0.chunks_written_back, s0.write_backs_evict, s0.write_backs_dropped, s0.dirty_chunks) == (1, 1, 1, 0)
    assert (s1.write_backs_failed, s1.dirty_chunks) == (1, 0)


def test_ledger_counts_one_hit_per_request_and_forgets_evicted_chunks() -> None:
    ledger = WriteLedger([WritePolicy("selective", 2), WritePolicy("selective", 3)])
    assert ledger.stored([b"a", b"b"], [0, 1]) == []
    a, b, c = RequestContext("a"), RequestContext("b"), RequestContext("c")
    assert ledger.hit([b"a", b"a"], a) == {}
    assert ledger.hit([b"a"], a) == {}
    assert ledger.hit([b"a"], b) == {0: [b"a"]}
    assert ledger.hit([b"a"], c) == {1: [b"a"]}
    assert ledger.hit([b"a"], RequestContext("d")) == {}
    ledger.evicted([b"a", b"b"])
    assert [ledger.statistics(t).selective_evicted_unwritten for t in (0, 1)] == [1, 1]
    assert [ledger.statistics(t).selective_unwritten for t in (0, 1)] == [0, 0]

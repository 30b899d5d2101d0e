"""Specification of ``MemoryTier`` (real bytes, bounded LRU) and of the test-only ``FaultyTier``."""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest

from kvtier.config import TierConfig
from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.memory import MemoryTier
from kvtier.types import LookupResult

SLOT = 4096


def make_tier(cls: type[MemoryTier] = MemoryTier, *, slots: int = 8, events: bool = False,
              **options: Any) -> MemoryTier:
    type_ = cls.tier_type
    context = TierContext(
        index=1, label=f"2:{type_}", slot_bytes=SLOT, host=SlotBuffer(slots, SLOT), geometry=None,
        blocks_per_chunk=1, run_fields={}, kv_events_enabled=events,
    )
    config = TierConfig(index=1, type=type_, enable_kv_events=events, options=options)
    return cls(config, context)


def host(tier: MemoryTier) -> SlotBuffer:
    assert tier.context.host is not None
    return tier.context.host


async def run_job(tier: MemoryTier, job: TransferJob) -> JobResult:
    if job.is_promotion:
        tier.submit_load(job)
    else:
        tier.submit_store(job)
    await tier.drain()
    [result] = tier.get_finished_jobs()
    return result


@pytest.mark.anyio
async def test_bytes_round_trip_through_the_tier() -> None:
    tier = make_tier(capacity_bytes=4 * SLOT)
    payload = os.urandom(SLOT)
    host(tier).view(0)[:] = payload
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert (await run_job(tier, TransferJob(1, [b"k"], [0], False))).success
        host(tier).view(0)[:] = bytes(SLOT)  # the tier kept its own copy
        assert (await run_job(tier, TransferJob(2, [b"k"], [3], True))).success
        assert bytes(host(tier).view(3)) == payload
        await tier.aclose()


@pytest.mark.anyio
async def test_least_recently_used_chunk_is_evicted_when_full() -> None:
    tier = make_tier(capacity_bytes=2 * SLOT, events=True)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        await run_job(tier, TransferJob(1, [b"a", b"b"], [0, 1], False))
        await run_job(tier, TransferJob(2, [b"a"], [2], True))  # reading refreshes a
        await run_job(tier, TransferJob(3, [b"c"], [3], False))
        assert tier.lookup(b"b", None) is LookupResult.MISS
        assert tier.lookup(b"a", None) is LookupResult.HIT
        assert tier.lookup(b"c", None) is LookupResult.HIT
        stats = tier.statistics()
        await tier.aclose()
    assert stats.evictions == 1 and stats.eviction_age.count == 1
    assert (stats.bytes_used, stats.capacity_bytes) == (2 * SLOT, 2 * SLOT)
    assert tier.statistics().bytes_used == 0  # close() released the chunks
    removed = [e for e in tier.take_events() if e.removed]
    assert [(e.keys, e.reason, e.medium, e.ownership) for e in removed] == [([b"b"], "evicted", "CPU", "2:memory")]


@pytest.mark.anyio
async def test_touch_refreshes_recency() -> None:
    tier = make_tier(capacity_bytes=2 * SLOT)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        await run_job(tier, TransferJob(1, [b"a", b"b"], [0, 1], False))
        tier.touch([b"a"], None)
        await run_job(tier, TransferJob(2, [b"c"], [2], False))
        assert tier.known(b"a") and not tier.known(b"b")
        await tier.aclose()


@pytest.mark.anyio
async def test_chunk_larger_than_capacity_fails_with_no_space() -> None:
    tier = make_tier(capacity_bytes=SLOT // 2)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        result = await run_job(tier, TransferJob(1, [b"a"], [0], False))
        await tier.aclose()
    assert (result.success, result.failure_reason) == (False, "no_space")
    assert tier.num_chunks == 0


@pytest.mark.anyio
async def test_overwriting_a_key_does_not_double_count_usage() -> None:
    tier = make_tier(capacity_bytes=4 * SLOT)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        await run_job(tier, TransferJob(1, [b"a"], [0], False))
        await run_job(tier, TransferJob(2, [b"a"], [1], False))
        await tier.aclose()
    assert tier.statistics().evictions == 0


@pytest.mark.anyio
async def test_delete_removes_the_chunk_and_publishes_a_removal() -> None:
    tier = make_tier(capacity_bytes=4 * SLOT, events=True)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        await run_job(tier, TransferJob(1, [b"a"], [0], False))
        await tier.delete(b"a")
        assert tier.lookup(b"a", None) is LookupResult.MISS
        await tier.aclose()
    events = tier.take_events()
    assert [(e.removed, e.reason) for e in events] == [(False, None), (True, "deleted")]
    assert tier.bytes_used == 0


def test_lookups_answer_synchronously_without_retry() -> None:
    tier = make_tier(capacity_bytes=SLOT)
    assert tier.lookup(b"nothing", None) is LookupResult.MISS
    assert not tier.has_pending_work()


@pytest.mark.parametrize("capacity", [None, 0, -1, "1GB", True])
def test_capacity_bytes_must_be_a_positive_int(capacity: Any) -> None:
    options = {} if capacity is None else {"capacity_bytes": capacity}
    with pytest.raises(ConfigError, match="capacity_bytes"):
        make_tier(**options)


# --- FaultyTier ------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_faulty_tier_fails_the_keys_it_is_told_to() -> None:
    tier = make_tier(FaultyTier)
    assert isinstance(tier, FaultyTier)
    tier.fail_writes_of([b"b"], reason="no_space")
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        result = await run_job(tier, TransferJob(1, [b"a", b"b"], [0, 1], False))
        assert (result.success, result.failure_reason) == (False, "no_space")
        tier.fail_reads_of([b"a"])
        result = await run_job(tier, TransferJob(2, [b"a"], [2], True))
        assert (result.success, result.failure_reason) == (False, "io_error")
        tier.heal()
        result = await run_job(tier, TransferJob(3, [b"a"], [2], True))
        assert result.success
        await tier.aclose()


@pytest.mark.anyio
async def test_faulty_tier_random_failures_follow_the_seed() -> None:
    outcomes = []
    for _ in range(2):
        tier = make_tier(FaultyTier, fail_write_fraction=0.5, seed=3)
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            run = [(await run_job(tier, TransferJob(j, [bytes([j])], [0], False))).success for j in range(20)]
            await tier.aclose()
        outcomes.append(run)
    assert outcomes[0] == outcomes[1]
    assert True in outcomes[0] and False in outcomes[0]


@pytest.mark.parametrize(
    "options",
    [{"fail_read_fraction": 1.5}, {"fail_write_fraction": -0.1}, {"latency_s": -1}, {"seed": "x"}],
)
def test_faulty_tier_rejects_bad_options(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        make_tier(FaultyTier, **options)

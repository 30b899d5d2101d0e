"""Specification of the tier framework (``kvtier/tiers/base.py``): channels, exactly-once results,
failure mapping, the asynchronous lookup front-end, lifecycle, events and statistics."""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from kvtier.config import TierConfig
from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.tiers.base import (
    ChunkCorrupt,
    ChunkNotFound,
    JobResult,
    SecondaryTier,
    TierContext,
    TierIOError,
    TransferJob,
    failure_reason,
)
from kvtier.tiers.faulty import FaultyTier
from kvtier.types import CacheHitSource, Locality, LookupResult, Medium

SLOT = 4096


def make_context(num_slots: int = 16, *, events: bool = False, index: int = 0, type_: str = "t") -> TierContext:
    return TierContext(
        index=index, label=f"{index + 1}:{type_}", slot_bytes=SLOT, host=SlotBuffer(num_slots, SLOT),
        geometry=None, blocks_per_chunk=1, run_fields={}, kv_events_enabled=events,
    )


def make_config(type_: str = "t", *, events: bool = False, locality: Locality | None = None,
                **options: Any) -> TierConfig:
    return TierConfig(index=0, type=type_, locality=locality, enable_kv_events=events, options=options)


class DictTier(SecondaryTier):
    """A probe-only tier (no ``known`` fast path): every lookup goes through ``contains``."""

    tier_type = "dict"
    medium = Medium.STORAGE

    def __init__(self, config: TierConfig, context: TierContext, **tunables: Any) -> None:
        super().__init__(config, context, **tunables)
        self.data: dict[bytes, bytes] = {}
        self.probes: list[list[bytes]] = []
        self.probe_delay_s = 0.0
        self.probe_error: Exception | None = None
        self.read_errors: dict[bytes, Exception] = {}
        self.write_errors: dict[bytes, Exception] = {}
        self.closed = 0

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        self.probes.append(list(keys))
        if self.probe_delay_s:
            await anyio.sleep(self.probe_delay_s)
        if self.probe_error is not None:
            raise self.probe_error
        return [key in self.data for key in keys]

    async def write(self, key: bytes, src: memoryview) -> None:
        if key in self.write_errors:
            raise self.write_errors[key]
        self.data[key] = bytes(src)

    async def read(self, key: bytes, dst: memoryview) -> None:
        if key in self.read_errors:
            raise self.read_errors[key]
        if key not in self.data:
            raise ChunkNotFound()
        dst[:] = self.data[key]

    async def close(self) -> None:
        self.closed += 1


def store(job_id: int, keys: list[bytes], slots: list[int] | None = None) -> TransferJob:
    return TransferJob(job_id, keys, slots if slots is not None else list(range(len(keys))), False)


def load(job_id: int, keys: list[bytes], slots: list[int] | None = None) -> TransferJob:
    return TransferJob(job_id, keys, slots if slots is not None else list(range(len(keys))), True)


class Woken:
    """Counts wakeup callbacks and lets a test wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self.event = anyio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    async def wait(self) -> None:
        with anyio.fail_after(5):  # hang guard only
            await self.event.wait()
        self.event = anyio.Event()


async def resolve(tier: SecondaryTier, key: bytes, woken: Woken) -> LookupResult:
    """Ask until the answer is not RETRY, ending the step each time like the manager does."""
    for _ in range(100):
        result = tier.lookup(key, None)
        if result is not LookupResult.RETRY:
            return result
        tier.on_schedule_end()
        await woken.wait()
    raise AssertionError(f"{key!r} never resolved")


# --- failure mapping -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (ChunkNotFound(), "missing"),
        (ChunkCorrupt(), "corrupt"),
        (TierIOError("throttled"), "throttled"),
        (OSError(errno.ENOSPC, "full"), "no_space"),
        (OSError(errno.EDQUOT, "quota"), "no_space"),
        (OSError(errno.EACCES, "denied"), "permission"),
        (OSError(errno.EPERM, "denied"), "permission"),
        (OSError(errno.EROFS, "ro"), "permission"),
        (OSError(errno.ENOENT, "gone"), "missing"),
        (OSError(errno.EIO, "eio"), "io_error"),
        (OSError(errno.EBADF, "other"), "io_error"),
        (TimeoutError(), "timeout"),
        (KeyError("bug"), "internal"),
    ],
)
def test_failure_reason_maps_exceptions_to_labels(exc: BaseException, reason: str) -> None:
    assert failure_reason(exc) == reason


def test_transfer_job_chunk_ids_alias_slot_ids() -> None:
    job = TransferJob(1, [b"a", b"b"], [3, 4], False)
    assert job.chunk_ids == [3, 4]


def test_cache_hit_source_derives_from_medium() -> None:
    assert DictTier.cache_hit_source is CacheHitSource.DISK
    assert FaultyTier.cache_hit_source is CacheHitSource.HOST

    class Peer(DictTier):
        medium = None
        cache_hit_source = CacheHitSource.P2P

    assert Peer.cache_hit_source is CacheHitSource.P2P


# --- jobs ------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_every_job_reported_exactly_once_under_random_failures() -> None:
    tier = FaultyTier(make_config("faulty", fail_read_fraction=0.3, fail_write_fraction=0.3, seed=7),
                      make_context(32, type_="faulty"), max_concurrent_loads=4, max_concurrent_stores=4)
    keys = [i.to_bytes(4, "big") for i in range(96)]
    submitted: list[int] = []
    results: list[JobResult] = []
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for j in range(32):
            tier.submit_store(store(j, keys[3 * j:3 * j + 3], [j % 32, (j + 1) % 32, (j + 2) % 32]))
            submitted.append(j)
        await tier.drain()
        results += tier.get_finished_jobs()
        for j in range(32):
            tier.submit_load(load(100 + j, keys[3 * j:3 * j + 3], [j % 32, (j + 1) % 32, (j + 2) % 32]))
            submitted.append(100 + j)
        await tier.drain()
        results += tier.get_finished_jobs()
        assert tier.get_finished_jobs() == []
        await tier.aclose()
    assert Counter(r.job_id for r in results) == Counter(submitted)
    outcomes = Counter(r.success for r in results)
    assert outcomes[True] and outcomes[False]  # the seed makes both happen
    for r in results:
        assert r.success == (r.failure_reason is None)
        if r.is_promotion and not r.success:
            assert r.successful_keys is not None
            assert set(r.successful_keys) <= set(keys[3 * (r.job_id - 100):3 * (r.job_id - 100) + 3])
            assert r.transfer_bytes == len(r.successful_keys) * SLOT
    stats = tier.statistics()
    assert stats.failures.get(("store", "io_error"), 0) + stats.stores_completed == 32
    assert stats.failures.get(("load", "io_error"), 0) + stats.failures.get(("load", "missing"), 0) \
        + stats.loads_completed == 32


@pytest.mark.anyio
async def test_partial_promotion_failure_reports_the_keys_that_loaded() -> None:
    tier = DictTier(make_config(), make_context())
    tier.data = {b"a": b"A" * SLOT, b"c": b"C" * SLOT}
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_load(load(1, [b"a", b"b", b"c"]))
        await tier.drain()
        [result] = tier.get_finished_jobs()
        await tier.aclose()
    assert not result.success and result.is_promotion
    assert result.successful_keys == [b"a", b"c"]
    assert result.failure_reason == "missing"
    assert result.transfer_bytes == 2 * SLOT


@pytest.mark.anyio
async def test_failed_store_reports_no_successful_keys_and_counts_reason() -> None:
    tier = DictTier(make_config(), make_context())
    tier.write_errors[b"b"] = OSError(errno.ENOSPC, "disk full")
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a", b"b"]))
        await tier.drain()
        [result] = tier.get_finished_jobs()
        await tier.aclose()
    assert (result.success, result.successful_keys, result.failure_reason) == (False, None, "no_space")
    assert tier.statistics().failures == {("store", "no_space"): 1}


@pytest.mark.anyio
async def test_unexpected_exception_is_internal_logged_and_tier_survives(caplog: pytest.LogCaptureFixture) -> None:
    tier = DictTier(make_config(), make_context())
    tier.write_errors[b"bug"] = ZeroDivisionError("oops")
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.base"):
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            tier.submit_store(store(1, [b"bug"]))
            tier.submit_store(store(2, [b"fine"]))
            await tier.drain()
            results = {r.job_id: r for r in tier.get_finished_jobs()}
            await tier.aclose()
    assert results[1].failure_reason == "internal" and results[2].success
    assert any(rec.exc_info and rec.exc_info[0] is ZeroDivisionError for rec in caplog.records)


@pytest.mark.anyio
async def test_store_moves_the_slot_bytes_and_load_fills_the_slot() -> None:
    ctx = make_context()
    tier = DictTier(make_config(), ctx)
    assert ctx.host is not None
    ctx.host.view(2)[:] = bytes(range(256)) * (SLOT // 256)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"k"], [2]))
        await tier.drain()
        tier.submit_load(load(2, [b"k"], [5]))
        await tier.drain()
        assert [r.success for r in tier.get_finished_jobs()] == [True, True]
        await tier.aclose()
    assert bytes(ctx.host.view(5)) == bytes(range(256)) * (SLOT // 256)


@pytest.mark.anyio
async def test_full_queue_rejects_at_once_with_queue_full() -> None:
    tier = DictTier(make_config(), make_context(), queue_size=1)
    # Not running: the first job waits in the queue, the second finds it full.
    tier.submit_store(store(1, [b"a"]))
    tier.submit_store(store(2, [b"b"]))
    [rejected] = tier.get_finished_jobs()
    assert (rejected.job_id, rejected.success, rejected.failure_reason) == (2, False, "queue_full")
    assert tier.statistics().rejected_jobs == 1
    assert tier.statistics().queued_jobs == 1
    await tier.aclose()
    [cancelled] = tier.get_finished_jobs()
    assert (cancelled.job_id, cancelled.failure_reason) == (1, "cancelled")


@pytest.mark.anyio
async def test_wakeup_is_called_when_a_result_is_posted() -> None:
    tier = DictTier(make_config(), make_context())
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a"]))
        await woken.wait()
        assert [r.job_id for r in tier.get_finished_jobs()] == [1]
        await tier.aclose()


# --- lifecycle -------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_aclose_cancels_stuck_io_and_reports_every_job_once() -> None:
    tier = FaultyTier(make_config("faulty", latency_s=3600.0), make_context(8, type_="faulty"),
                      max_concurrent_stores=2, max_concurrent_loads=2)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for j in range(6):
            tier.submit_store(store(j, [bytes([j])], [j]))
        tier.submit_load(load(10, [b"x", b"y"], [6, 7]))
        await anyio.wait_all_tasks_blocked()
        stats = tier.statistics()
        assert stats.stores_in_flight == 2 and stats.loads_in_flight == 1 and stats.queued_jobs == 4
        assert tier.has_pending_work()
        with anyio.fail_after(5):  # hang guard: the stuck writes are cancelled, not awaited
            await tier.aclose()
    results = tier.get_finished_jobs()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3, 4, 5, 10]
    assert {r.failure_reason for r in results} == {"cancelled"}
    assert not tier.has_pending_work()
    tier.submit_store(store(99, [b"late"]))
    assert [(r.job_id, r.failure_reason) for r in tier.get_finished_jobs()] == [(99, "closed")]
    await tier.aclose()  # idempotent
    assert tier.get_finished_jobs() == []


@pytest.mark.anyio
async def test_close_runs_once_and_run_returns_after_aclose() -> None:
    tier = DictTier(make_config(), make_context())
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        await tier.aclose()
        await tier.aclose()
    assert tier.closed == 1


@pytest.mark.anyio
async def test_open_error_propagates_before_started() -> None:
    class Broken(DictTier):
        async def open(self) -> None:
            raise ConfigError("secondary_tiers[0].root_dir: not writable")

    class Status:
        def __init__(self) -> None:
            self.started_calls = 0

        def started(self, value: object = None) -> None:
            self.started_calls += 1

    tier = Broken(make_config(), make_context())
    status = Status()
    with pytest.raises(ConfigError, match="root_dir"):
        await tier.run(task_status=status)  # type: ignore[arg-type]
    assert status.started_calls == 0
    assert tier.closed == 0  # close() releases what open() acquired; open never finished
    await tier.aclose()  # still safe


@pytest.mark.anyio
async def test_drain_waits_for_queued_and_running_jobs() -> None:
    tier = FaultyTier(make_config("faulty", latency_s=0.001), make_context(type_="faulty"),
                      max_concurrent_stores=1)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for j in range(5):
            tier.submit_store(store(j, [bytes([j])], [j]))
        await tier.drain()
        assert not tier.has_pending_work()
        assert len(tier.get_finished_jobs()) == 5
        await tier.aclose()


# --- lookups ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_unknown_key_is_retry_until_the_step_probe_resolves_it() -> None:
    tier = DictTier(make_config(), make_context())
    tier.data[b"a"] = b"A" * SLOT
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert tier.lookup(b"a", None) is LookupResult.RETRY
        assert tier.lookup(b"b", None) is LookupResult.RETRY
        assert tier.lookup(b"a", None) is LookupResult.RETRY  # same step: batched once
        assert tier.probes == []  # nothing sent before the step ends
        tier.on_schedule_end()
        assert tier.lookup(b"a", None) is LookupResult.RETRY  # in flight: not probed again
        tier.on_schedule_end()
        await woken.wait()
        assert tier.lookup(b"a", None) is LookupResult.HIT
        assert tier.lookup(b"b", None) is LookupResult.MISS
        await tier.aclose()
    assert tier.probes == [[b"a", b"b"]]
    stats = tier.statistics()
    assert (stats.lookups, stats.hits) == (2, 1)  # only resolved lookups count


@pytest.mark.anyio
async def test_failed_load_invalidates_the_positive_verdict() -> None:
    # A cached HIT for a chunk that cannot be read must not be promoted again.
    tier = DictTier(make_config(), make_context(), negative_ttl_s=60.0)
    tier.data[b"a"] = b"A" * SLOT
    tier.read_errors[b"a"] = OSError(errno.EIO, "bad sector")
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert await resolve(tier, b"a", woken) is LookupResult.HIT
        tier.submit_load(load(1, [b"a"]))
        await tier.drain()
        [result] = tier.get_finished_jobs()
        assert (result.success, result.failure_reason) == (False, "io_error")
        for _ in range(3):
            assert tier.lookup(b"a", None) is not LookupResult.HIT
        await tier.aclose()


@pytest.mark.anyio
async def test_failed_load_on_a_known_tier_is_not_a_hit_either() -> None:
    tier = FaultyTier(make_config("faulty"), make_context(type_="faulty"), negative_ttl_s=60.0)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a"]))
        await tier.drain()
        assert tier.lookup(b"a", None) is LookupResult.HIT
        tier.fail_reads_of([b"a"])
        tier.submit_load(load(2, [b"a"]))
        await tier.drain()
        assert [r.success for r in tier.get_finished_jobs()] == [True, False]
        assert tier.lookup(b"a", None) is LookupResult.MISS
        await tier.aclose()


@pytest.mark.anyio
async def test_successful_store_makes_lookups_hit_without_probing() -> None:
    tier = DictTier(make_config(), make_context())
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a"]))
        await tier.drain()
        assert tier.lookup(b"a", None) is LookupResult.HIT
        await tier.aclose()
    assert tier.probes == []


@pytest.mark.anyio
async def test_probe_timeout_answers_miss_and_is_counted() -> None:
    tier = DictTier(make_config(), make_context(), lookup_timeout_s=0.01)
    tier.data[b"a"] = b"A" * SLOT
    tier.probe_delay_s = 3600.0
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert await resolve(tier, b"a", woken) is LookupResult.MISS
        await tier.aclose()
    assert tier.statistics().failures == {("lookup", "timeout"): 1}


@pytest.mark.anyio
async def test_probe_exception_answers_miss_and_is_counted() -> None:
    tier = DictTier(make_config(), make_context())
    tier.probe_error = TierIOError("throttled")
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert await resolve(tier, b"a", woken) is LookupResult.MISS
        await tier.aclose()
    assert tier.statistics().failures == {("lookup", "throttled"): 1}


@pytest.mark.anyio
async def test_negative_verdict_expires_so_later_chunks_are_found() -> None:
    tier = DictTier(make_config(), make_context(), negative_ttl_s=1.0)
    now = [1000.0]
    tier._verdicts.clock = lambda: now[0]
    woken = Woken()
    tier.set_wakeup(woken)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        assert await resolve(tier, b"a", woken) is LookupResult.MISS
        tier.data[b"a"] = b"A" * SLOT  # written by another process meanwhile
        now[0] += 0.5
        assert tier.lookup(b"a", None) is LookupResult.MISS  # still trusted
        now[0] += 0.6
        assert await resolve(tier, b"a", woken) is LookupResult.HIT
        await tier.aclose()
    assert tier.probes == [[b"a"], [b"a"]]


@pytest.mark.anyio
async def test_mark_miss_overrides_a_cached_hit() -> None:
    tier = DictTier(make_config(), make_context(), negative_ttl_s=60.0)
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a"]))
        await tier.drain()
        tier.mark_miss([b"a"])
        assert tier.lookup(b"a", None) is LookupResult.MISS
        await tier.aclose()


def test_lookup_after_close_is_a_miss_not_a_retry() -> None:
    async def main() -> None:
        tier = DictTier(make_config(), make_context())
        await tier.aclose()
        assert tier.lookup(b"a", None) is LookupResult.MISS

    anyio.run(main)


# --- events ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("global_switch", "tier_switch", "expected"),
    [(False, False, 0), (True, False, 0), (False, True, 0), (True, True, 1)],
)
@pytest.mark.anyio
async def test_stored_events_need_both_switches(global_switch: bool, tier_switch: bool, expected: int) -> None:
    tier = DictTier(make_config(events=tier_switch, locality=Locality.REMOTE), make_context(events=global_switch))
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a", b"b"]))
        await tier.drain()
        events = tier.take_events()
        await tier.aclose()
    assert len(events) == expected
    if expected:
        [event] = events
        assert (event.keys, event.medium, event.removed) == ([b"a", b"b"], "STORAGE", False)
        assert (event.locality, event.ownership) == ("REMOTE", "1:t")
        assert tier.take_events() == []


def test_removed_events_carry_the_reason_and_invalidate_verdicts() -> None:
    tier = DictTier(make_config(events=True), make_context(events=True))
    tier._verdicts.set([b"a"], True)
    tier.emit_removed([b"a"], "deleted")
    [event] = tier.take_events()
    assert (event.keys, event.removed, event.reason, event.locality) == ([b"a"], True, "deleted", None)
    assert tier.lookup(b"a", None) is LookupResult.MISS


# --- statistics ------------------------------------------------------------------------------
def test_custom_metric_appears_in_statistics_snapshot() -> None:
    tier = DictTier(make_config(), make_context())
    family = tier.add_metric("kvtier_dict_widgets", "counter", "Widgets seen.", labels=("color",))
    family.inc(2, "red")
    snapshot = tier.statistics()
    family.inc(1, "red")
    [exported] = snapshot.custom_metrics
    assert (exported.name, exported.kind, exported.labels) == ("kvtier_dict_widgets", "counter", ("color",))
    assert exported.values == {("red",): 2.0}  # a snapshot: later increments do not leak in
    with pytest.raises(ValueError):
        tier.add_metric("kvtier_dict_widgets", "counter", "again")
    with pytest.raises(ValueError):
        tier.add_metric("bad name", "counter", "x")
    with pytest.raises(ValueError):
        tier.add_metric("kvtier_x", "summary", "x")


def test_eviction_and_usage_helpers_feed_statistics() -> None:
    tier = DictTier(make_config(), make_context())
    tier.record_eviction(5.0)
    tier.record_eviction(120.0)
    tier.set_usage(10, 100)
    stats = tier.statistics()
    assert stats.evictions == 2 and stats.eviction_age.count == 2
    assert (stats.bytes_used, stats.capacity_bytes) == (10, 100)
    assert (stats.label, stats.tier_type) == ("1:t", "dict")


@pytest.mark.anyio
async def test_job_latency_and_byte_counters_by_outcome() -> None:
    tier = DictTier(make_config(), make_context())
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a", b"b"]))
        await tier.drain()
        tier.submit_load(load(2, [b"a", b"zz"]))
        await tier.drain()
        await tier.aclose()
    stats = tier.statistics()
    assert (stats.bytes_written, stats.bytes_read) == (2 * SLOT, SLOT)
    assert stats.store_latency["success"].count == 1 and stats.store_latency["failure"].count == 0
    assert stats.load_latency["failure"].count == 1 and stats.load_latency["success"].count == 0


@pytest.mark.anyio
async def test_concurrent_stores_of_one_key_never_overlap_in_write() -> None:
    class Watched(DictTier):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.writers: Counter[bytes] = Counter()
            self.max_writers = 0
            self.gate = anyio.Event()

        async def write(self, key: bytes, src: memoryview) -> None:
            self.writers[key] += 1
            self.max_writers = max(self.max_writers, self.writers[key])
            await self.gate.wait()
            await super().write(key, src)
            self.writers[key] -= 1

    tier = Watched(make_config(), make_context())
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for j in range(4):
            tier.submit_store(store(j, [b"same", bytes([j])], [0, j + 1]))
        await anyio.wait_all_tasks_blocked()  # every job has reached its writes
        tier.gate.set()
        await tier.drain()
        assert all(r.success for r in tier.get_finished_jobs())
        await tier.aclose()
    assert tier.max_writers == 1


# --- batch hooks (write_many / read_many) ----------------------------------------------------
class BatchTier(DictTier):
    """Takes whole jobs through the batch hooks; per-key primitives must not be used."""

    batched_writes = True
    batched_reads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[str, list[bytes]]] = []
        self.gate: anyio.Event | None = None
        self.in_batch: Counter[bytes] = Counter()
        self.max_concurrent_writes_of_a_key = 0
        self.batch_error: Exception | None = None
        self.short_answer = False

    async def write(self, key: bytes, src: memoryview) -> None:
        raise AssertionError("the framework must call write_many")

    async def read(self, key: bytes, dst: memoryview) -> None:
        raise AssertionError("the framework must call read_many")

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        self.batches.append(("write", [key for key, _ in items]))
        for key, _ in items:
            self.in_batch[key] += 1
            self.max_concurrent_writes_of_a_key = max(self.max_concurrent_writes_of_a_key, self.in_batch[key])
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.batch_error is not None:
                raise self.batch_error
            outcomes: list[BaseException | None] = []
            for key, src in items:
                try:
                    await DictTier.write(self, key, src)
                    outcomes.append(None)
                except Exception as exc:
                    outcomes.append(exc)
            return outcomes[:-1] if self.short_answer else outcomes
        finally:
            for key, _ in items:
                self.in_batch[key] -= 1

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        self.batches.append(("read", [key for key, _ in items]))
        outcomes: list[BaseException | None] = []
        for key, dst in items:
            try:
                await DictTier.read(self, key, dst)
                outcomes.append(None)
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


async def run_jobs(tier: SecondaryTier, *jobs: TransferJob) -> list[JobResult]:
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for job in jobs:
            (tier.submit_load if job.is_promotion else tier.submit_store)(job)
        await tier.drain()
        results = tier.get_finished_jobs()
        await tier.aclose()
    return sorted(results, key=lambda r: r.job_id)


@pytest.mark.anyio
async def test_a_tier_with_batch_hooks_gets_each_job_in_one_call() -> None:
    tier = BatchTier(make_config(), make_context())
    keys = [bytes([i]) for i in range(8)]
    for i in range(8):
        tier.context.host.view(i)[:] = bytes([i]) * SLOT  # type: ignore[union-attr]
    [stored] = await run_jobs(tier, store(1, keys))
    loaded = await run_jobs(BatchTier(make_config(), make_context()), load(2, keys))
    assert stored.success and stored.transfer_bytes == 8 * SLOT
    assert tier.batches == [("write", keys)]
    assert tier.data == {bytes([i]): bytes([i]) * SLOT for i in range(8)}
    assert tier.statistics().bytes_written == 8 * SLOT and tier.statistics().stores_completed == 1
    assert loaded[0].failure_reason == "missing"  # a fresh tier holds nothing


@pytest.mark.anyio
async def test_batch_read_outcomes_drive_partial_promotion_and_reasons() -> None:
    tier = BatchTier(make_config(), make_context())
    tier.data = {b"a": b"A" * SLOT, b"c": b"C" * SLOT}
    tier.read_errors = {b"c": ChunkCorrupt()}
    [result] = await run_jobs(tier, load(1, [b"a", b"b", b"c", b"d"]))
    assert tier.batches == [("read", [b"a", b"b", b"c", b"d"])]
    assert not result.success and result.successful_keys == [b"a"]
    assert result.failure_reason == "missing"  # the first failing chunk's reason
    assert result.transfer_bytes == SLOT
    assert tier.statistics().failures == {("load", "missing"): 1}
    assert tier.lookup(b"c") is LookupResult.MISS  # corrupt: removed, verdict invalidated


@pytest.mark.anyio
async def test_a_bad_slot_id_in_a_batched_job_fails_only_its_chunk(caplog: pytest.LogCaptureFixture) -> None:
    tier = BatchTier(make_config(), make_context(4))
    for i in range(4):
        tier.context.host.view(i)[:] = bytes([i]) * SLOT  # type: ignore[union-attr]
    [result] = await run_jobs(tier, store(1, [b"a", b"b", b"c"], [0, 99, 2]))
    assert not result.success and result.failure_reason == "internal"
    assert tier.batches == [("write", [b"a", b"c"])]
    assert tier.data == {b"a": bytes([0]) * SLOT, b"c": bytes([2]) * SLOT}


def test_slot_views_are_the_slots_in_the_order_asked_and_range_checked() -> None:
    buffer = SlotBuffer(4, SLOT, pin_memory=False)
    for i in range(4):
        buffer.view(i)[:] = bytes([i]) * SLOT
    assert [bytes(v) for v in buffer.views([3, 0, 3])] == [bytes(buffer.view(i)) for i in (3, 0, 3)]
    assert buffer.views([]) == []
    for bad in ([0, 4], [-1]):
        with pytest.raises(IndexError, match="out of range"):
            buffer.views(bad)
    buffer.views([1])[0][:1] = b"z"  # writable, zero-copy
    assert bytes(buffer.view(1)[:1]) == b"z"


@pytest.mark.anyio
async def test_a_failing_batch_fails_every_chunk_with_its_reason() -> None:
    tier = BatchTier(make_config(), make_context())
    tier.batch_error = TierIOError("throttled")
    [result] = await run_jobs(tier, store(1, [b"a", b"b"]))
    assert not result.success and result.failure_reason == "throttled" and result.transfer_bytes == 0


@pytest.mark.anyio
async def test_a_batch_answer_of_the_wrong_length_is_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    tier = BatchTier(make_config(), make_context())
    tier.short_answer = True
    [result] = await run_jobs(tier, store(1, [b"a", b"b"]))
    assert not result.success and result.failure_reason == "internal"
    assert any(r.exc_info and "2 chunks" in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.anyio
async def test_batched_stores_never_write_one_key_twice_at_once() -> None:
    tier = BatchTier(make_config(), make_context())
    tier.gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for j in range(4):  # every job holds "same"; job 3 holds it twice
            keys = [b"same", bytes([j])] + ([b"same"] if j == 3 else [])
            tier.submit_store(store(j, keys, list(range(len(keys)))))
        await anyio.wait_all_tasks_blocked()
        tier.gate.set()
        await tier.drain()
        results = tier.get_finished_jobs()
        await tier.aclose()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3] and all(r.success for r in results)
    assert tier.max_concurrent_writes_of_a_key == 1
    assert sum(keys.count(b"same") for _, keys in tier.batches) == 5  # each occurrence written once


@pytest.mark.anyio
async def test_aclose_cancels_a_running_batch_and_reports_the_job_once() -> None:
    tier = BatchTier(make_config(), make_context())
    tier.gate = anyio.Event()  # never set: the batch hangs until cancelled
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        tier.submit_store(store(1, [b"a", b"b"]))
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):
            await tier.aclose()
    assert [(r.job_id, r.failure_reason) for r in tier.get_finished_jobs()] == [(1, "cancelled")]
    assert not tier.in_batch or max(tier.in_batch.values()) == 0


@pytest.mark.anyio
async def test_the_default_batch_hooks_fan_out_to_the_per_key_primitives() -> None:
    tier = DictTier(make_config(), make_context())
    tier.data = {b"a": b"A" * SLOT}
    tier.write_errors = {b"bad": TierIOError("no_space")}
    src = tier.context.host.view(0)  # type: ignore[union-attr]
    outcomes = await tier.write_many([(b"x", src), (b"bad", src)])
    assert outcomes[0] is None and isinstance(outcomes[1], TierIOError)
    reads = await tier.read_many([(b"a", tier.context.host.view(1)), (b"zz", tier.context.host.view(2))])  # type: ignore[union-attr]
    assert reads[0] is None and isinstance(reads[1], ChunkNotFound)
    assert bytes(tier.context.host.view(1)) == b"A" * SLOT  # type: ignore[union-attr]

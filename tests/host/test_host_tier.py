"""Specification of the host tier's bookkeeping (``kvtier/host/tier.py``): chunk states, pins,
eviction, the store threshold's reuse tracker, events and statistics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.context import RequestContext
from kvtier.host.tier import HostTier, PrepareStoreOutput
from kvtier.keys import make_offload_key
from kvtier.types import LookupResult, OffloadingEvent

SLOT = 4096


def k(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def stored(tier: HostTier, *ids: int, ctx: RequestContext | None = None) -> list[int]:
    """Store and complete chunks ``ids``; returns their slots."""
    out = tier.prepare_store([k(i) for i in ids], ctx)
    assert out is not None
    tier.complete_store(out.keys_to_store)
    return out.slot_ids


def spy(tier: HostTier, *names: str) -> list[tuple[str, Any]]:
    """Record calls of the policy's hooks ``names`` (still calling through)."""
    calls: list[tuple[str, Any]] = []
    policy = tier.policy
    for name in names:
        original = getattr(policy, name)

        def wrapper(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append((_name, args))
            return _original(*args)

        setattr(policy, name, wrapper)
    return calls


# --- state machine -----------------------------------------------------------------------------


def test_chunk_goes_miss_then_pending_then_hit() -> None:
    tier = HostTier(4, SLOT)
    assert tier.lookup(k(1)) is LookupResult.MISS
    out = tier.prepare_store([k(1)])
    assert out == PrepareStoreOutput([k(1)], [0], [])
    assert tier.lookup(k(1)) is LookupResult.HIT_PENDING
    tier.complete_store([k(1)])
    assert tier.lookup(k(1)) is LookupResult.HIT


def test_prepare_store_skips_present_keys_and_returns_empty_output_not_none() -> None:
    tier = HostTier(4, SLOT)
    stored(tier, 1)
    tier.prepare_store([k(2)])  # pending
    assert tier.prepare_store([k(1), k(2)]) == PrepareStoreOutput([], [], [])
    out = tier.prepare_store([k(1), k(3), k(2)])
    assert out is not None and out.keys_to_store == [k(3)]


def test_pinned_chunks_are_not_evicted_until_released() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1, 2)
    assert tier.prepare_load([k(1), k(2)]) == [0, 1]
    assert tier.prepare_load([k(1)]) == [0]  # a second reader
    assert tier.prepare_store([k(3)]) is None
    tier.complete_load([k(1), k(2)])
    out = tier.prepare_store([k(3)])
    assert out is not None and out.evicted_keys == [k(2)]  # k(1) still has a reader
    tier.complete_load([k(1)])
    assert tier.statistics().evictable == 1


def test_prepare_load_of_absent_or_pending_key_raises_and_pins_nothing() -> None:
    tier = HostTier(4, SLOT)
    stored(tier, 1)
    tier.prepare_store([k(2)])
    with pytest.raises(KeyError):
        tier.prepare_load([k(1), k(2)])
    with pytest.raises(KeyError):
        tier.prepare_load([k(1), k(9)])
    assert tier.statistics().evictable == 1
    with pytest.raises(KeyError):
        tier.complete_load([k(1)])  # never pinned


def test_failed_store_frees_the_slot_and_ignores_ready_keys() -> None:
    tier = HostTier(4, SLOT, enable_events=True)
    stored(tier, 1)
    out = tier.prepare_store([k(2), k(3)])
    assert out is not None and out.slot_ids == [1, 2]
    tier.complete_store([k(1), k(2), k(3)], success=False)
    assert tier.lookup(k(1)) is LookupResult.HIT
    assert tier.lookup(k(2)) is LookupResult.MISS
    # Freed slots are reused last-freed first, after the never-used slot 3.
    again = tier.prepare_store([k(4), k(5), k(6)])
    assert again is not None and again.slot_ids == [3, 2, 1]


def test_late_or_duplicate_completions_are_ignored() -> None:
    tier = HostTier(4, SLOT)
    stored(tier, 1)
    tier.complete_store([k(1)])
    tier.complete_store([k(7)])
    tier.complete_store([k(7)], success=False)
    stats = tier.statistics()
    assert (stats.used_slots, stats.evictable, stats.write_pending) == (1, 1, 0)


# --- allocation and eviction -------------------------------------------------------------------


def test_fresh_slot_ids_are_used_before_freed_ones() -> None:
    tier = HostTier(4, SLOT)
    assert stored(tier, 1, 2) == [0, 1]
    tier.prepare_store([k(3)])  # slot 2
    tier.complete_store([k(3)], success=False)  # slot 2 back on the free list
    out = tier.prepare_store([k(4), k(5)])
    assert out is not None and out.slot_ids == [3, 2]


def test_eviction_frees_victims_in_policy_order_and_reuses_the_last_freed_slot_first() -> None:
    tier = HostTier(3, SLOT, enable_events=True)
    stored(tier, 1, 2, 3)  # LRU order 1 < 2 < 3 (slots 0, 1, 2)
    tier.take_events()
    out = tier.prepare_store([k(4), k(5)])
    assert out is not None
    assert out.evicted_keys == [k(1), k(2)]
    assert out.slot_ids == [1, 0]  # free list [0, 1] popped from its end
    assert tier.take_events() == [OffloadingEvent([k(1), k(2)], "CPU", removed=True, reason="evicted")]
    assert tier.lookup(k(1)) is LookupResult.MISS


def test_eviction_never_takes_an_offered_key_and_is_atomic() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1, 2)
    calls = spy(tier, "insert")
    # One slot needed; the only evictable chunks are both offered again → cannot store.
    assert tier.prepare_store([k(1), k(2), k(3)]) is None
    assert calls == []
    assert tier.lookup(k(1)) is LookupResult.HIT and tier.lookup(k(2)) is LookupResult.HIT
    assert tier.statistics().allocation_failures == 1
    # Offering only one of them lets the other go.
    out = tier.prepare_store([k(2), k(3)])
    assert out is not None and out.evicted_keys == [k(1)]


def test_prepare_store_returns_none_when_more_room_is_needed_than_is_evictable() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1)
    tier.prepare_store([k(2)])  # pending, not evictable
    assert tier.prepare_store([k(3), k(4)]) is None
    assert tier.lookup(k(1)) is LookupResult.HIT
    stats = tier.statistics()
    assert stats.allocation_failures == 1
    assert stats.allocation_sizes.count == 3  # the failed request's size is observed too


def test_lookup_has_no_side_effect_on_eviction_order() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1, 2)
    for _ in range(3):
        tier.lookup(k(1))
    out = tier.prepare_store([k(3)])
    assert out is not None and out.evicted_keys == [k(1)]


def test_touch_makes_a_chunk_most_recent() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1, 2)
    tier.touch([k(1)])
    out = tier.prepare_store([k(3)])
    assert out is not None and out.evicted_keys == [k(2)]


def test_arc_policy_is_selectable() -> None:
    tier = HostTier(2, SLOT, eviction_policy="arc")
    stored(tier, 1, 2)
    out = tier.prepare_store([k(3)])
    assert out is not None and len(out.evicted_keys) == 1


# --- per-request accounting --------------------------------------------------------------------


def test_request_finished_reports_inserted_and_reused_keys_once_per_generation() -> None:
    tier = HostTier(8, SLOT)
    stored(tier, 1)
    calls = spy(tier, "on_request_finished")
    ctx = RequestContext("r1")
    out = tier.prepare_store([k(1), k(2), k(3, group=1)], ctx)
    assert out is not None
    tier.complete_store(out.keys_to_store)
    tier.on_request_finished(ctx)
    tier.on_request_finished(ctx)
    [(_, (groups, inserted_only, reused, got_ctx))] = calls
    assert groups == [[k(1), k(2)], [k(3, group=1)]]
    assert set(inserted_only) == {k(2), k(3, group=1)}
    assert set(reused) == {k(1)}
    assert got_ctx is ctx


def test_rereading_a_chunk_inserted_by_the_same_request_is_not_a_reuse() -> None:
    tier = HostTier(8, SLOT)
    calls = spy(tier, "on_request_finished")
    ctx = RequestContext("r1")
    stored(tier, 1, ctx=ctx)
    tier.prepare_load([k(1)], ctx)
    tier.complete_load([k(1)])
    tier.on_request_finished(ctx)
    [(_, (_groups, inserted_only, reused, _))] = calls
    assert set(inserted_only) == {k(1)} and not reused


def test_request_keys_are_ordered_by_recorded_position() -> None:
    tier = HostTier(8, SLOT)
    calls = spy(tier, "on_request_finished")
    ctx = RequestContext("r1")
    for pos, i in ((32, 3), (16, 2), (48, 4)):
        ctx.set_offload_key_position(k(i), pos)
    stored(tier, 3, 2, 4, ctx=ctx)
    tier.on_request_finished(ctx)
    assert calls[0][1][0] == [[k(2), k(3), k(4)]]


def test_store_miss_is_reported_once_per_request_and_key() -> None:
    tier = HostTier(1, SLOT)
    stored(tier, 1)
    tier.prepare_load([k(1)])  # pinned: nothing can be evicted
    calls = spy(tier, "on_store_miss")
    ctx = RequestContext("r1")
    assert tier.prepare_store([k(2)], ctx) is None
    assert tier.prepare_store([k(2)], ctx) is None
    assert [args[0] for _, args in calls] == [[k(2)]]


def test_load_records_a_request_access_but_cascade_read_does_not() -> None:
    tier = HostTier(4, SLOT)
    stored(tier, 1, 2)
    calls = spy(tier, "on_request_access")
    ctx = RequestContext("r1")
    tier.prepare_read([k(1)])
    tier.complete_read([k(1)])
    assert calls == []
    tier.prepare_load([k(2)], ctx)
    tier.complete_load([k(2)])
    assert [args[0] for _, args in calls] == [[k(2)]]


def test_cascade_read_pins_without_changing_recency() -> None:
    tier = HostTier(2, SLOT)
    stored(tier, 1, 2)
    assert tier.prepare_read([k(1)]) == [0]
    assert tier.prepare_store([k(3)]).evicted_keys == [k(2)]  # type: ignore[union-attr]
    tier.complete_read([k(1)])
    assert tier.statistics().evictable == 1


# --- store threshold ---------------------------------------------------------------------------


def test_store_threshold_stores_a_chunk_only_on_its_nth_offer() -> None:
    tier = HostTier(8, SLOT, store_threshold=2)
    assert tier.prepare_store([k(1), k(2)]) == PrepareStoreOutput([], [], [])
    assert tier.statistics().stores_skipped == 2
    out = tier.prepare_store([k(1)])
    assert out is not None and out.keys_to_store == [k(1)]
    assert tier.get_stats()["stores_skipped"] == 2
    # Lookups do not count as offers.
    tier.lookup(k(3))
    assert tier.prepare_store([k(3)]) == PrepareStoreOutput([], [], [])


def test_resident_chunks_are_never_filtered_by_the_threshold() -> None:
    tier = HostTier(8, SLOT, store_threshold=3)
    out = tier.prepare_write([k(1)])  # promotions bypass the threshold
    assert out is not None and out.keys_to_store == [k(1)]
    tier.complete_write([k(1)])
    calls = spy(tier, "on_request_finished")
    ctx = RequestContext("r")
    assert tier.prepare_store([k(1)], ctx) == PrepareStoreOutput([], [], [])
    tier.on_request_finished(ctx)
    assert set(calls[0][1][2]) == {k(1)}  # counted as a reuse
    assert tier.statistics().stores_skipped == 0


def test_tracker_forgets_its_least_recent_key_when_full() -> None:
    tier = HostTier(8, SLOT, store_threshold=2, max_tracker_size=2)
    tier.prepare_store([k(1)])
    tier.prepare_store([k(2)])
    tier.prepare_store([k(3)])  # k(1) forgotten
    out = tier.prepare_store([k(1), k(2)])
    assert out is not None and out.keys_to_store == [k(2)]


def test_tracker_does_not_drop_keys_of_the_current_offer() -> None:
    tier = HostTier(8, SLOT, store_threshold=2, max_tracker_size=2)
    tier.prepare_store([k(1), k(2), k(3)])  # k(3) cannot be tracked: k(1), k(2) are protected
    out = tier.prepare_store([k(1), k(2), k(3)])
    assert out is not None and out.keys_to_store == [k(1), k(2)]


def test_threshold_below_two_disables_the_tracker() -> None:
    tier = HostTier(8, SLOT, store_threshold=1)
    out = tier.prepare_store([k(1)])
    assert out is not None and out.keys_to_store == [k(1)]
    assert "stores_skipped" not in tier.get_stats()


# --- events ------------------------------------------------------------------------------------


def test_events_report_stores_evictions_and_failed_stores() -> None:
    tier = HostTier(2, SLOT, enable_events=True)
    stored(tier, 1)
    stored(tier, 2)
    tier.prepare_store([k(3), k(4)])  # evicts 1, 2
    tier.complete_store([k(3)])
    tier.complete_store([k(4)], success=False)
    assert tier.take_events() == [
        OffloadingEvent([k(1)], "CPU", removed=False),
        OffloadingEvent([k(2)], "CPU", removed=False),
        OffloadingEvent([k(1), k(2)], "CPU", removed=True, reason="evicted"),
        OffloadingEvent([k(3)], "CPU", removed=False),
        OffloadingEvent([k(4)], "CPU", removed=True, metadata_only=True, reason="failed_store"),
    ]
    assert tier.take_events() == []


def test_metadata_only_removal_is_dropped_for_keys_allocated_again() -> None:
    tier = HostTier(4, SLOT, enable_events=True)
    tier.prepare_store([k(1), k(2)])
    tier.complete_store([k(1), k(2)], success=False)
    tier.prepare_store([k(1)])  # a retry re-allocated k(1)
    assert tier.take_events() == [
        OffloadingEvent([k(2)], "CPU", removed=True, metadata_only=True, reason="failed_store")
    ]


def test_no_events_when_disabled() -> None:
    tier = HostTier(1, SLOT)
    stored(tier, 1)
    stored(tier, 2)
    assert tier.take_events() == []


# --- statistics, reset, buffer -----------------------------------------------------------------


def test_statistics_count_pins_pending_writes_and_evictions() -> None:
    tier = HostTier(4, SLOT)
    stored(tier, 1, 2)
    tier.prepare_load([k(1)])
    tier.prepare_store([k(3)])
    stats = tier.statistics()
    assert (stats.num_slots, stats.slot_bytes) == (4, SLOT)
    assert (stats.used_slots, stats.pinned_slots, stats.write_pending, stats.evictable) == (3, 2, 1, 1)
    assert tier.get_stats() == {"cpu_cache_usage_perc": 0.5, "write_usage": 0.25, "read_usage": 0.25}
    tier.complete_store([k(3)])
    stored(tier, 4)
    tier.prepare_store([k(5), k(6)])  # evicts 2 chunks
    stats = tier.statistics()
    assert stats.evictions == 2 and stats.eviction_age.count == 2
    assert stats.allocation_sizes.count == 4 and stats.allocation_sizes.total == 6


def test_reset_forgets_everything_and_restarts_allocation() -> None:
    tier = HostTier(4, SLOT)
    calls = spy(tier, "on_request_finished")
    ctx = RequestContext("r1")
    stored(tier, 1, 2, ctx=ctx)
    tier.complete_store([k(1)], success=False)
    generation = tier.generation
    tier.reset_cache()
    assert tier.generation == generation + 1
    assert tier.lookup(k(1)) is LookupResult.MISS and tier.lookup(k(2)) is LookupResult.MISS
    stats = tier.statistics()
    assert (stats.used_slots, stats.evictable, stats.write_pending) == (0, 0, 0)
    assert stored(tier, 3) == [0]
    tier.on_request_finished(ctx)  # accesses of the old generation are not reported
    assert calls == []


def test_buffer_is_allocated_lazily_and_released_by_close() -> None:
    tier = HostTier(3, SLOT, pin_memory=False)
    stored(tier, 1)
    assert tier._buffer is None  # bookkeeping alone never allocates
    view = tier.slot_view(2)
    assert len(view) == SLOT
    view[:4] = b"abcd"
    assert bytes(tier.buffer.view(2)[:4]) == b"abcd"
    del view
    tier.close()
    assert tier._buffer is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_buffer_without_cuda_is_refused() -> None:
    tier = HostTier(1, SLOT, pin_memory=True)
    with pytest.raises(RuntimeError):
        tier.buffer

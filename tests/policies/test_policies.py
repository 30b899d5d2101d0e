"""Specification of the host-tier cache policies (the interface, LRU, ARC) and their factory."""

from __future__ import annotations

import copy
import logging
import random
import sys
import textwrap
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.policies import (
    ARCPolicy,
    CachePolicy,
    CachePolicyFactory,
    LRUPolicy,
    order_request_keys,
)
from kvtier.types import ChunkStatus


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\x00\x00\x00\x00"


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def store_ready(policy: CachePolicy, ids: Sequence[int], ctx: RequestContext | None = None) -> None:
    """Insert as the host tier does (write pending), then complete the store."""
    for i in ids:
        policy.insert(key(i), ChunkStatus(ref_cnt=-1, slot_id=i), ctx)
    for i in ids:
        complete(policy, i)


def complete(policy: CachePolicy, i: int) -> None:
    chunk = policy.get(key(i))
    assert chunk is not None and chunk.ref_cnt == -1
    chunk.ref_cnt = 0
    policy.mark_evictable(key(i))


def pin(policy: CachePolicy, i: int) -> None:
    chunk = policy.get(key(i))
    assert chunk is not None and chunk.ref_cnt >= 0
    chunk.ref_cnt += 1
    if chunk.ref_cnt == 1:
        policy.mark_non_evictable(key(i))


def unpin(policy: CachePolicy, i: int) -> None:
    chunk = policy.get(key(i))
    assert chunk is not None and chunk.ref_cnt >= 1
    chunk.ref_cnt -= 1
    if chunk.ref_cnt == 0:
        policy.mark_evictable(key(i))


def evicted_ids(policy: CachePolicy, n: int, protected: Collection[bytes] = ()) -> list[int]:
    victims = policy.evict(n, protected)
    assert victims is not None
    return [int.from_bytes(k[:4], "big") for k, _ in victims]


def positioned_ctx(req_id: str, positions: dict[int, int]) -> RequestContext:
    ctx = RequestContext(req_id)
    for i, position in positions.items():
        ctx.set_offload_key_position(key(i), position)
    return ctx


class CountingSet(set):  # type: ignore[type-arg]
    """A protected set that counts membership tests (how many candidates evict looked at)."""

    lookups = 0

    def __contains__(self, item: object) -> bool:
        self.lookups += 1
        return super().__contains__(item)


# --- the interface ---------------------------------------------------------------------------------


class RecordingPolicy(CachePolicy):
    """Minimal concrete policy that records touches, to observe the default hooks."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.touches: list[list[bytes]] = []

    def get(self, key: bytes) -> ChunkStatus | None:
        return None

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        pass

    def remove(self, key: bytes) -> None:
        pass

    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        self.touches.append(list(keys))

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        return None

    def clear(self) -> None:
        pass

    def mark_evictable(self, key: bytes) -> None:
        pass

    def mark_non_evictable(self, key: bytes) -> None:
        pass

    def __len__(self) -> int:
        return 0


def test_default_store_miss_hook_touches_the_keys() -> None:
    policy = RecordingPolicy(4)
    policy.on_store_miss(keys(1, 2), None)
    assert policy.touches == [keys(1, 2)]


def test_default_request_access_hook_does_nothing() -> None:
    policy = RecordingPolicy(4)
    policy.on_request_access(keys(1, 2), None)
    assert policy.touches == []


def test_default_request_finished_hook_touches_each_group() -> None:
    policy = RecordingPolicy(4)
    policy.on_request_finished([keys(1, 2), keys(3)], set(), set(), None)
    assert policy.touches == [keys(1, 2), keys(3)]


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_rejected(capacity: int) -> None:
    with pytest.raises(ValueError):
        LRUPolicy(capacity)


def test_non_integer_capacity_is_rejected() -> None:
    with pytest.raises(TypeError):
        ARCPolicy(2.5)  # type: ignore[arg-type]


def test_order_request_keys_sorts_by_position_when_every_key_has_one() -> None:
    ctx = positioned_ctx("r", {1: 48, 2: 16, 3: 32})
    assert order_request_keys([keys(1), keys(2, 3)], ctx) == keys(2, 3, 1)


def test_order_request_keys_keeps_group_order_when_a_position_is_missing() -> None:
    ctx = positioned_ctx("r", {1: 48, 2: 16})
    assert CachePolicy.order_request_keys([keys(1), keys(2, 3)], ctx) == keys(1, 2, 3)


def test_order_request_keys_sort_is_stable_for_equal_positions() -> None:
    # Two KV groups end a chunk at the same token: group order decides.
    ctx = positioned_ctx("r", {1: 16, 2: 16, 3: 0})
    assert order_request_keys([keys(1), keys(2, 3)], ctx) == keys(3, 1, 2)


def test_contains_reports_resident_keys() -> None:
    policy = LRUPolicy(4)
    store_ready(policy, [1])
    assert key(1) in policy and key(2) not in policy


# --- LRU ----------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_inserted_first() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3])
    assert evicted_ids(policy, 2) == [1, 2]
    assert len(policy) == 1 and policy.get(key(1)) is None


def test_lru_touch_makes_the_first_key_most_recent() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    policy.touch(keys(1, 2, 3), None)
    assert evicted_ids(policy, 4) == [4, 3, 2, 1]


def test_lru_positioned_inserts_of_one_request_evict_tail_before_head() -> None:
    policy = LRUPolicy(8)
    ctx = positioned_ctx("r", {1: 16, 2: 32, 3: 48})
    store_ready(policy, [1, 2, 3], ctx)
    assert evicted_ids(policy, 3) == [3, 2, 1]


def test_lru_request_rank_is_drawn_at_the_requests_first_insert() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [10])  # older than the request
    ctx = positioned_ctx("r", {1: 16, 2: 32})
    store_ready(policy, [1], ctx)
    store_ready(policy, [20])  # newer than the request's rank
    store_ready(policy, [2], ctx)  # shares the request's (older) rank
    assert evicted_ids(policy, 4) == [10, 2, 1, 20]


def test_lru_each_request_draws_its_own_rank() -> None:
    policy = LRUPolicy(8)
    first = positioned_ctx("a", {1: 16, 2: 32})
    second = positioned_ctx("b", {3: 16})
    store_ready(policy, [1], first)
    store_ready(policy, [3], second)
    store_ready(policy, [2], first)
    assert evicted_ids(policy, 3) == [2, 1, 3]


def test_lru_two_policies_sharing_a_request_do_not_share_its_rank() -> None:
    host, other = LRUPolicy(8), LRUPolicy(8)
    ctx = positioned_ctx("r", {1: 16})
    store_ready(other, [99])
    store_ready(other, [98])
    store_ready(host, [1], ctx)  # draws host's rank 0
    store_ready(other, [1], ctx)  # must draw a rank of its own (2), newer than 99 and 98
    assert evicted_ids(other, 3) == [99, 98, 1]


def test_lru_request_access_raises_a_key_into_the_requests_rank_group() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [5])  # inserted by an earlier request
    store_ready(policy, [6])
    ctx = positioned_ctx("r", {5: 16, 1: 32})
    store_ready(policy, [1], ctx)  # draws the request rank after 6's
    policy.on_request_access(keys(5), ctx)
    assert evicted_ids(policy, 3) == [6, 1, 5]


def test_lru_request_access_never_lowers_a_rank() -> None:
    policy = LRUPolicy(8)
    ctx = positioned_ctx("r", {1: 16, 5: 32})
    store_ready(policy, [1], ctx)
    store_ready(policy, [5])  # fresh rank, newer than the request rank
    policy.on_request_access(keys(5), ctx)
    assert evicted_ids(policy, 2) == [1, 5]


def test_lru_request_access_ignores_unpositioned_keys_and_missing_context() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2])
    before = policy.snapshot()
    policy.on_request_access(keys(1, 2), RequestContext("r"))
    policy.on_request_access(keys(1, 2), None)
    assert policy.snapshot() == before


def test_lru_request_finished_leaves_the_head_most_recent() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    ctx = positioned_ctx("r", {1: 48, 2: 16, 3: 32})
    # Recorded out of prefix order; insertion vs reuse does not matter for LRU.
    policy.on_request_finished([keys(1, 2, 3)], {key(1)}, {key(2)}, ctx)
    assert evicted_ids(policy, 4) == [4, 1, 3, 2]


def test_lru_recency_of_a_pinned_chunk_applies_once_it_is_unpinned() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3])
    pin(policy, 1)
    policy.touch(keys(1), None)
    assert evicted_ids(policy, 1) == [2]
    unpin(policy, 1)
    assert evicted_ids(policy, 2) == [3, 1]


def test_lru_unpinning_does_not_refresh_recency() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2])
    pin(policy, 1)
    unpin(policy, 1)
    assert evicted_ids(policy, 1) == [1]


def test_lru_completion_order_of_stores_does_not_change_request_order() -> None:
    policy = LRUPolicy(8)
    ctx = positioned_ctx("r", {1: 16, 2: 32, 3: 48})
    for i in (1, 2, 3):
        policy.insert(key(i), ChunkStatus(-1, i), ctx)
    for i in (1, 3, 2):  # transfers complete out of order
        complete(policy, i)
    assert evicted_ids(policy, 3) == [3, 2, 1]


def test_lru_evict_skips_protected_pinned_and_write_pending_chunks() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    policy.insert(key(0), ChunkStatus(-1, 0), None)
    pin(policy, 2)
    assert evicted_ids(policy, 1, protected=keys(1)) == [3]
    assert policy.get(key(1)) is not None and policy.get(key(2)) is not None
    assert evicted_ids(policy, 2) == [1, 4]  # the protected chunk kept its place


def test_lru_repinned_chunk_is_evicted_once() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2])
    pin(policy, 1)
    unpin(policy, 1)
    assert evicted_ids(policy, 2) == [1, 2]


def test_lru_evict_without_enough_eligible_returns_none_and_changes_nothing() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2, 3])
    pin(policy, 2)
    before = policy.snapshot()
    assert policy.evict(2, protected={key(1)}) is None
    assert policy.snapshot() == before
    assert evicted_ids(policy, 2) == [1, 3]  # the heap still holds everything set aside


def test_lru_evict_of_zero_returns_an_empty_list() -> None:
    policy = LRUPolicy(2)
    assert policy.evict(0, ()) == []


def test_lru_remove_forgets_the_chunk() -> None:
    policy = LRUPolicy(8)
    store_ready(policy, [1, 2])
    policy.remove(key(1))
    policy.remove(key(9))  # absent: ignored
    assert policy.get(key(1)) is None and len(policy) == 1
    assert evicted_ids(policy, 1) == [2]
    assert policy.evict(1, ()) is None


def test_lru_clear_draws_request_ranks_again() -> None:
    policy = LRUPolicy(8)
    ctx = positioned_ctx("r", {1: 16, 2: 32})
    store_ready(policy, [1], ctx)
    policy.clear()
    assert len(policy) == 0 and policy.evict(1, ()) is None
    store_ready(policy, [5])
    store_ready(policy, [2], ctx)  # a stale pre-clear rank would put 2 before 5
    assert evicted_ids(policy, 2) == [5, 2]


def test_lru_eviction_and_touch_do_not_scan_the_cache() -> None:
    policy = LRUPolicy(20_000)
    store_ready(policy, range(20_000))
    protected = CountingSet(keys(0, 1))
    assert evicted_ids(policy, 3, protected) == [2, 3, 4]
    assert protected.lookups <= 5  # two set aside, three taken: nothing else inspected
    for i in range(5, 5_000):
        policy.touch(keys(i), None)
    # Lazy invalidation keeps the heap within a constant factor of the evictable chunks.
    assert len(policy._heap) <= 2 * 19_997 + 1


def test_lru_order_survives_heap_compaction_and_bulk_touches() -> None:
    rng = random.Random(7)
    policy = LRUPolicy(100)
    store_ready(policy, range(100))
    recency = list(range(100))  # model: least recent first
    for step in range(3_000):
        if step % 500 == 0:  # a bulk touch (>= 64 keys) takes the rebuild path
            batch = rng.sample(range(100), 70)
        else:
            batch = [rng.randrange(100)]
        if step % 7 == 0:
            pin(policy, batch[0])
        policy.touch(keys(*batch), None)
        for i in reversed(batch):
            recency.remove(i)
            recency.append(i)
        if step % 7 == 0:
            unpin(policy, batch[0])
        if step % 50 == 49:  # drain a copy: the order must match the model at every point
            assert evicted_ids(copy.deepcopy(policy), 100) == recency
    assert len(policy._heap) <= 2 * 100
    assert evicted_ids(policy, 100) == recency


# --- ARC ----------------------------------------------------------------------------------------


def lists(policy: ARCPolicy) -> tuple[list[int], list[int], list[int], list[int]]:
    """The ids in T1, T2, B1 and B2, each LRU first."""
    snap = policy.snapshot()

    def ids(entries: list[bytes]) -> list[int]:
        return [int.from_bytes(k[:4], "big") for k in entries]

    return (
        ids([k for k, *_ in snap["t1"]]),
        ids([k for k, *_ in snap["t2"]]),
        ids(snap["b1"]),
        ids(snap["b2"]),
    )


def test_arc_insert_puts_the_key_at_t1_mru_and_forgets_its_ghost() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2])
    evicted_ids(policy, 1)
    assert lists(policy) == ([2], [], [1], [])
    store_ready(policy, [1])
    assert lists(policy) == ([2, 1], [], [], [])


def test_arc_touch_promotes_a_ready_t1_chunk_to_t2() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2])
    pin(policy, 2)  # pinned chunks are ready: a read counts as an access
    policy.touch(keys(1, 2), None)
    assert lists(policy)[:2] == ([], [2, 1])


def test_arc_touch_keeps_a_write_pending_chunk_in_t1_at_mru() -> None:
    policy = ARCPolicy(4)
    policy.insert(key(1), ChunkStatus(-1, 1), None)
    store_ready(policy, [2])
    policy.touch(keys(1), None)
    assert lists(policy)[:2] == ([2, 1], [])


def test_arc_touch_moves_t2_chunks_to_mru_in_reverse_order() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(1, 2, 3), None)
    assert lists(policy)[1] == [3, 2, 1]
    policy.touch(keys(3), None)
    assert lists(policy)[1] == [2, 1, 3]


def test_arc_store_miss_on_a_b1_ghost_grows_the_t1_target() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(3), None)  # 3 -> T2
    evicted_ids(policy, 3)  # 1, 2 -> B1 ; 3 -> B2
    assert lists(policy)[2:] == ([1, 2], [3])
    policy.on_store_miss(keys(1), None)
    assert policy.target_t1_size == 1.0  # max(1, |B2|/|B1| = 0.5)
    assert lists(policy)[2] == [2, 1]  # ghost kept, moved to MRU


def test_arc_store_miss_step_is_the_ghost_size_ratio() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    policy.touch(keys(2, 3, 4), None)
    evicted_ids(policy, 4)  # T1 = [1] -> B1 ; T2 = [4, 3, 2] -> B2
    assert lists(policy)[2:] == ([1], [4, 3, 2])
    policy.on_store_miss(keys(1), None)
    assert policy.target_t1_size == 3.0
    policy.on_store_miss(keys(4), None)
    assert policy.target_t1_size == 2.0  # max(1, |B1|/|B2| = 1/3)
    assert lists(policy)[3] == [3, 2, 4]


def test_arc_target_is_clamped_to_capacity_and_zero() -> None:
    policy = ARCPolicy(2)
    store_ready(policy, [1, 2])
    evicted_ids(policy, 1)  # B1 = [1]
    for _ in range(5):
        policy.on_store_miss(keys(1), None)
    assert policy.target_t1_size == 2.0
    policy.touch(keys(2), None)
    evicted_ids(policy, 1)  # 2 -> B2
    for _ in range(5):
        policy.on_store_miss(keys(2), None)
    assert policy.target_t1_size == 0.0


def test_arc_store_miss_ignores_resident_and_unknown_keys() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1])
    before = policy.snapshot()
    policy.on_store_miss(keys(1, 7), None)
    assert policy.snapshot() == before


def test_arc_touch_of_a_ghost_adapts_the_target() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2])
    evicted_ids(policy, 1)
    policy.touch(keys(1), None)
    assert policy.target_t1_size == 1.0


def test_arc_store_miss_adapts_in_reverse_order() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    evicted_ids(policy, 3)  # B1 = [1, 2, 3]
    policy.on_store_miss(keys(1, 2), None)
    assert lists(policy)[2] == [3, 2, 1]


def test_arc_request_finished_promotes_only_reused_keys() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    ctx = positioned_ctx("r", {1: 16, 2: 32, 3: 48})
    policy.on_request_finished([keys(1, 2, 3)], {key(3), key(1)}, {key(2)}, ctx)
    # 4 untouched at LRU; insertion-only 3, 1 move to T1 MRU (head last = most recent).
    assert lists(policy)[:2] == ([4, 3, 1], [2])


def test_arc_request_finished_never_promotes_a_write_pending_chunk() -> None:
    policy = ARCPolicy(8)
    policy.insert(key(1), ChunkStatus(-1, 1), None)
    store_ready(policy, [2])
    policy.on_request_finished([keys(1)], set(), {key(1)}, None)
    assert lists(policy)[:2] == ([2, 1], [])


def test_arc_request_finished_moves_t2_keys_to_mru_in_reverse_prefix_order() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(3, 2, 1), None)  # T2 = [1, 2, 3]
    ctx = positioned_ctx("r", {2: 16, 1: 32})
    policy.on_request_finished([keys(1, 2)], {key(1)}, {key(2)}, ctx)
    assert lists(policy)[1] == [3, 1, 2]


def test_arc_evict_takes_from_t1_while_it_is_at_or_above_target() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    policy.touch(keys(4), None)  # T1 = [1, 2, 3], T2 = [4]
    assert evicted_ids(policy, 2) == [1, 2]
    assert lists(policy)[2:] == ([1, 2], [])


def test_arc_evict_uses_a_virtual_t1_size_within_one_call() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3, 4, 5])
    policy.touch(keys(5, 4), None)  # T1 = [1, 2, 3], T2 = [4, 5]
    evicted_ids(policy, 1)  # 1 -> B1
    store_ready(policy, [6])  # T1 = [2, 3, 6]
    policy.on_store_miss(keys(1), None)
    policy.on_store_miss(keys(1), None)
    assert policy.target_t1_size == 2.0
    # |T1| 3 >= 2 -> T1 ; 2 >= 2 -> T1 ; 1 < 2 -> T2
    assert evicted_ids(policy, 3) == [2, 3, 4]


def test_arc_evict_prefers_t2_below_target_and_falls_back_to_t1() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(3), None)  # T1 = [1, 2], T2 = [3]
    evicted_ids(policy, 1)
    store_ready(policy, [4])  # T1 = [2, 4]
    for _ in range(4):
        policy.on_store_miss(keys(1), None)
    assert policy.target_t1_size >= 3
    assert evicted_ids(policy, 2) == [3, 2]


def test_arc_evict_takes_t2_when_t1_has_no_eligible_entry() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(3), None)  # T1 = [1, 2], T2 = [3]
    pin(policy, 1)
    assert evicted_ids(policy, 2, protected=keys(9)) == [2, 3]


def test_arc_evict_skips_protected_pinned_and_write_pending_chunks() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3, 4])
    policy.insert(key(0), ChunkStatus(-1, 0), None)
    pin(policy, 2)
    assert evicted_ids(policy, 1, protected={key(1)}) == [3]


def test_arc_evict_without_enough_eligible_returns_none_and_changes_nothing() -> None:
    policy = ARCPolicy(8)
    store_ready(policy, [1, 2, 3])
    policy.touch(keys(3), None)
    pin(policy, 3)
    evicted_ids(policy, 1)
    before = policy.snapshot()
    assert policy.evict(2, protected=keys(2)) is None
    assert policy.snapshot() == before


def test_arc_evicted_ghosts_are_trimmed_from_their_lru_end() -> None:
    policy = ARCPolicy(2)
    for i in range(5):
        store_ready(policy, [i])
        if len(policy) == 2:
            evicted_ids(policy, 1)
    assert lists(policy)[2] == [2, 3]


def test_arc_remove_does_not_leave_a_ghost() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2])
    policy.touch(keys(2), None)
    policy.remove(key(1))
    policy.remove(key(2))
    assert lists(policy) == ([], [], [], []) and len(policy) == 0


def test_arc_clear_resets_lists_and_target() -> None:
    policy = ARCPolicy(4)
    store_ready(policy, [1, 2])
    evicted_ids(policy, 1)
    policy.on_store_miss(keys(1), None)
    policy.clear()
    assert lists(policy) == ([], [], [], []) and policy.target_t1_size == 0.0


def test_arc_evict_looks_at_few_candidates_in_a_large_cache() -> None:
    policy = ARCPolicy(20_000)
    store_ready(policy, range(20_000))
    protected = CountingSet(keys(0, 1))
    assert evicted_ids(policy, 3, protected) == [2, 3, 4]
    assert protected.lookups <= 5


# --- factory ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "cls"), [("lru", LRUPolicy), ("arc", ARCPolicy)])
def test_factory_creates_builtin_policies(name: str, cls: type) -> None:
    policy = CachePolicyFactory.create(name, 16)
    assert type(policy) is cls and policy.cache_capacity == 16


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_factory_rejects_registering_an_existing_name(name: str) -> None:
    with pytest.raises(ValueError, match="already registered"):
        CachePolicyFactory.register_cache_policy(name, "kvtier.policies.lru", "LRUPolicy")


def test_factory_unknown_name_without_module_path_lists_registered_names() -> None:
    with pytest.raises(ConfigError, match=r"registered: .*arc.*lru"):
        CachePolicyFactory.create("fifo", 4)


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"kvtier_test_plugin_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from kvtier.policies import LRUPolicy

            class FifoPolicy(LRUPolicy):
                pass

            class NotAPolicy:
                def __init__(self, capacity):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_factory_registered_policy_is_imported_on_first_create(plugin_module: str) -> None:
    name = f"fifo_{uuid.uuid4().hex}"
    CachePolicyFactory.register_cache_policy(name, plugin_module, "FifoPolicy")
    assert plugin_module not in sys.modules
    policy = CachePolicyFactory.create(name, 8)
    assert type(policy).__name__ == "FifoPolicy" and policy.cache_capacity == 8


def test_factory_loads_the_class_named_like_the_policy_from_module_path(
    plugin_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.policies.factory"):
        first = CachePolicyFactory.create("FifoPolicy", 4, module_path=plugin_module)
        second = CachePolicyFactory.create("FifoPolicy", 4, module_path=plugin_module)
    assert isinstance(first, LRUPolicy) and first is not second
    warnings = [r for r in caplog.records if "out-of-tree" in r.getMessage()]
    assert len(warnings) == 1


def test_factory_prefers_the_registry_over_module_path(plugin_module: str) -> None:
    assert type(CachePolicyFactory.create("arc", 4, module_path=plugin_module)) is ARCPolicy


def test_factory_rejects_a_class_that_is_not_a_cache_policy(plugin_module: str) -> None:
    with pytest.raises(ConfigError, match="not a subclass"):
        CachePolicyFactory.create("NotAPolicy", 4, module_path=plugin_module)


def test_factory_rejects_a_missing_attribute(plugin_module: str) -> None:
    with pytest.raises(ConfigError, match="no attribute"):
        CachePolicyFactory.create("Missing", 4, module_path=plugin_module)


def test_factory_import_failure_names_the_module() -> None:
    with pytest.raises(ConfigError, match="kvtier_no_such_module_xyz"):
        CachePolicyFactory.create("X", 4, module_path="kvtier_no_such_module_xyz")


def test_factory_registered_import_failure_is_a_config_error() -> None:
    name = f"broken_{uuid.uuid4().hex}"
    CachePolicyFactory.register_cache_policy(name, "kvtier_missing_mod_abc", "Cls")
    with pytest.raises(ConfigError, match="kvtier_missing_mod_abc"):
        CachePolicyFactory.create(name, 4)


@pytest.mark.parametrize("bad_path", ["../evil", "/etc/passwd", ".relative", "a..b", ""])
def test_factory_rejects_module_paths_that_are_not_dotted_names(bad_path: str) -> None:
    with pytest.raises(ConfigError, match="dotted module path"):
        CachePolicyFactory.create("X", 4, module_path=bad_path)


# --- properties: driven the way the host tier drives a policy ----------------------------------------

UNIVERSE = 16  # keys come back after eviction, so ARC sees ghost hits
CAPACITY = 5


class HostDriver(RuleBasedStateMachine):
    """A miniature host tier driving a policy, checking the policy contract."""

    policy_cls: type[CachePolicy] = LRUPolicy

    @initialize()
    def setup(self) -> None:
        self.policy = self.policy_cls(CAPACITY)
        self.chunks: dict[bytes, ChunkStatus] = {}  # the host's view: what it inserted
        self.contexts = [self._new_request(i) for i in range(3)]
        self.records: list[tuple[list[bytes], set[bytes], set[bytes]]] = [
            ([], set(), set()) for _ in range(3)
        ]
        self.next_request = 3

    def _new_request(self, i: int) -> RequestContext:
        ctx = RequestContext(f"req-{i}")
        for k in range(UNIVERSE):
            ctx.set_offload_key_position(key(k), 16 * (k + 1))
        return ctx

    # --- checking evict -------------------------------------------------------------------------
    def _checked_evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        eligible = [
            k for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected
        ]
        expected_lru_order = None
        if isinstance(self.policy, LRUPolicy):
            expected_lru_order = sorted(eligible, key=lambda k: (self.policy.rank_of(k), k))[:n]
        before = self._snapshot()
        victims = self.policy.evict(n, protected)
        if victims is None:
            assert len(eligible) < n, "evict refused although enough chunks were eligible"
            assert self._snapshot() == before, "a refused eviction changed the policy's state"
            return None
        assert len(victims) == max(n, 0)
        victim_keys = [k for k, _ in victims]
        assert len(set(victim_keys)) == len(victim_keys)
        for k, chunk in victims:
            assert k not in protected
            assert chunk is self.chunks[k] and chunk.ref_cnt == 0
            assert self.policy.get(k) is None
            del self.chunks[k]
        if expected_lru_order is not None:
            assert victim_keys == expected_lru_order
        return victims

    def _snapshot(self) -> object:
        return self.policy.snapshot()  # type: ignore[attr-defined]

    # --- rules ------------------------------------------------------------------------------------
    @rule(
        offer=st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=4, unique=True),
        req=st.integers(0, 2),
        complete_now=st.booleans(),
    )
    def prepare_store(self, offer: list[int], req: int, complete_now: bool) -> None:
        ctx = self.contexts[req]
        accessed, inserted, reused = self.records[req]
        offered = keys(*offer)
        candidates = [k for k in offered if k not in self.chunks]
        ready_existing = [k for k in offered if k in self.chunks and self.chunks[k].ref_cnt >= 0]
        self.policy.on_store_miss(candidates, ctx)
        new_access = [k for k in candidates + ready_existing if k not in accessed]
        accessed.extend(new_access)
        reused.update(k for k in ready_existing if k not in inserted)
        need = len(candidates) - (CAPACITY - len(self.chunks))
        if need > 0 and self._checked_evict(need, set(offered)) is None:
            return
        for k in candidates:
            chunk = ChunkStatus(ref_cnt=-1, slot_id=int.from_bytes(k[:4], "big"))
            self.chunks[k] = chunk
            self.policy.insert(k, chunk, ctx)
            inserted.add(k)
        if new_access:
            self.policy.on_request_access(new_access, ctx)
        if complete_now:  # the copy finished before the next scheduler step
            for k in candidates:
                self.chunks[k].ref_cnt = 0
                self.policy.mark_evictable(k)

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        pending = sorted(k for k, c in self.chunks.items() if c.ref_cnt == -1)
        if not pending:
            return
        k = data.draw(st.sampled_from(pending))
        if success:
            self.chunks[k].ref_cnt = 0
            self.policy.mark_evictable(k)
        else:
            del self.chunks[k]
            self.policy.remove(k)

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ready = sorted(k for k, c in self.chunks.items() if c.ref_cnt >= 0)
        if not ready:
            return
        k = data.draw(st.sampled_from(ready))
        self.chunks[k].ref_cnt += 1
        if self.chunks[k].ref_cnt == 1:
            self.policy.mark_non_evictable(k)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, c in self.chunks.items() if c.ref_cnt >= 1)
        if not pinned:
            return
        k = data.draw(st.sampled_from(pinned))
        self.chunks[k].ref_cnt -= 1
        if self.chunks[k].ref_cnt == 0:
            self.policy.mark_evictable(k)

    @rule(ids=st.lists(st.integers(0, UNIVERSE - 1), max_size=5), req=st.integers(0, 2))
    def touch(self, ids: list[int], req: int) -> None:
        self.policy.touch(keys(*ids), self.contexts[req])

    @rule(req=st.integers(0, 2))
    def finish_request(self, req: int) -> None:
        accessed, inserted, reused = self.records[req]
        self.policy.on_request_finished(
            [accessed], inserted - reused, reused, self.contexts[req]
        )
        self.contexts[req] = self._new_request(self.next_request)
        self.records[req] = ([], set(), set())
        self.next_request += 1

    @rule(n=st.integers(0, 4), data=st.data())
    def evict(self, n: int, data: st.DataObject) -> None:
        resident = sorted(self.chunks)
        protected = data.draw(st.sets(st.sampled_from(resident), max_size=3)) if resident else set()
        self._checked_evict(n, protected)

    @rule(roll=st.integers(0, 3))
    def reset_cache(self, roll: int) -> None:
        if roll == 0:  # only sometimes, so long histories still happen
            self.policy.clear()
            self.chunks.clear()

    # --- invariants -----------------------------------------------------------------------------
    @invariant()
    def resident_set_matches_the_host_and_fits(self) -> None:
        assert len(self.policy) == len(self.chunks) <= CAPACITY
        for k, chunk in self.chunks.items():
            assert self.policy.get(k) is chunk

    @invariant()
    def every_eligible_chunk_can_be_evicted(self) -> None:
        # Drain a copy: evicting all eligible chunks at once must succeed (nothing is lost from,
        # or duplicated in, the policy's internal order) and, for LRU, follow rank order.
        eligible = sorted(k for k, c in self.chunks.items() if c.ref_cnt == 0)
        drained = copy.deepcopy(self.policy)
        victims = drained.evict(len(eligible), frozenset())
        assert victims is not None
        victim_keys = [k for k, _ in victims]
        assert sorted(victim_keys) == eligible
        if isinstance(self.policy, LRUPolicy):
            assert victim_keys == sorted(eligible, key=lambda k: (self.policy.rank_of(k), k))
        assert drained.evict(1, frozenset()) is None

    @invariant()
    def ghost_lists_are_bounded(self) -> None:
        if isinstance(self.policy, ARCPolicy):
            snap = self.policy.snapshot()
            assert len(snap["b1"]) <= CAPACITY and len(snap["b2"]) <= CAPACITY
            assert 0.0 <= snap["p"] <= CAPACITY
            resident = set(self.chunks)
            assert resident.isdisjoint(snap["b1"]) and resident.isdisjoint(snap["b2"])


_STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LRUHostDriver(HostDriver):
    policy_cls = LRUPolicy


class ARCHostDriver(HostDriver):
    policy_cls = ARCPolicy


TestLRUPolicyUnderHostTier = LRUHostDriver.TestCase
TestLRUPolicyUnderHostTier.settings = _STATEFUL_SETTINGS
TestARCPolicyUnderHostTier = ARCHostDriver.TestCase
TestARCPolicyUnderHostTier.settings = _STATEFUL_SETTINGS

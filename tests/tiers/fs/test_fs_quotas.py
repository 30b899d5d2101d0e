"""Tenant quotas on the fs tier (``tenant_bytes``): :class:`TenantChunkIndex` and the tier's store jobs."""

from __future__ import annotations

import time

import pytest
from fs_tiers import SLOT, bin_files, finish, job_ids, key_of, make_tier, metric, running

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.policies.quotas import TenantQuotas
from kvtier.tiers.base import TransferJob
from kvtier.tiers.errors import TierIOError
from kvtier.tiers.fs.index import TenantChunkIndex

S = 1000  # bytes of one chunk in the index tests
#: A's hit rate with B present stays at least this close to A's hit rate alone (documented bound).
BOUND = 0.05


def k(name: str, i: int) -> bytes:
    return f"{name}-{i:04d}".encode() + (0).to_bytes(4, "big")


def index(budgets: dict[str, int], capacity: int | None = None) -> TenantChunkIndex:
    return TenantChunkIndex(capacity, TenantQuotas(budgets))


def put(ix: TenantChunkIndex, name: str, i: int, pool: int) -> list[bytes]:
    """Reserve one chunk for ``pool`` (its store job's tenant) and finish its write."""
    ix.note_writers([k(name, i)], pool)
    outcomes, victims = ix.reserve_all([k(name, i)], S)
    if isinstance(outcomes[0], TierIOError):
        raise outcomes[0]
    ix.unpin_all([k(name, i)])
    return [key for key, _ in victims]


def test_a_pool_at_its_budget_evicts_its_own_least_recent_chunks_and_nobody_else_s() -> None:
    ix = index({"a": 3 * S, "b": 2 * S})
    a, b = ix.quotas.pool_of("a"), ix.quotas.pool_of("b")
    for i in range(3):
        assert put(ix, "a", i, a) == []
    put(ix, "b", 0, b)
    put(ix, "b", 1, b)
    ix.touch(k("b", 0))
    assert put(ix, "b", 2, b) == [k("b", 1)]
    assert ix.pool_keys(a) == [k("a", 0), k("a", 1), k("a", 2)]
    assert ix.quotas.used[a] == 3 * S and ix.quotas.used[b] == 2 * S
    assert ix.quotas.evictions[b] == 1 and ix.quotas.evictions[a] == 0


def test_a_loaded_chunk_becomes_its_pool_s_most_recent() -> None:
    # A load job's end (unpin_all with touch_or_add) moves each chunk in its pool's list too, so a
    # pool at its budget evicts what it used least recently, not what it just loaded.
    ix = index({"a": 3 * S})
    a = ix.quotas.pool_of("a")
    for i in range(3):
        put(ix, "a", i, a)
    job = [k("a", 0), k("a", 1)]
    ix.pin_all(job)
    ix.unpin_all(job, touch_or_add=S)
    assert ix.pool_keys(a) == [k("a", 2), k("a", 0), k("a", 1)]
    assert put(ix, "a", 3, a) == [k("a", 2)]


def test_a_cold_chunk_a_load_used_stays_evictable() -> None:
    # A chunk the start-up scan found joins "default"'s list when a load uses it: it is still
    # found (and evicted, least recent first) when room is needed.
    ix = index({"a": 3 * S}, capacity=3 * S)
    default, a = ix.quotas.pool_of("default"), ix.quotas.pool_of("a")
    ix.add_cold([(k("c", i), S, time.time() - 100) for i in range(3)])
    ix.pin_all([k("c", 0)])
    ix.unpin_all([k("c", 0)], touch_or_add=S)
    assert ix.pool_keys(default) == [k("c", 1), k("c", 2), k("c", 0)]
    assert put(ix, "a", 0, a) == [k("c", 1)]
    assert put(ix, "a", 1, a) == [k("c", 2)]
    assert put(ix, "a", 2, a) == [k("c", 0)]


def test_a_chunk_its_pool_cannot_make_room_for_is_refused() -> None:
    ix = index({"a": 2 * S})
    a = ix.quotas.pool_of("a")
    put(ix, "a", 0, a)
    put(ix, "a", 1, a)
    ix.pin_all([k("a", 0), k("a", 1)])  # being read
    with pytest.raises(TierIOError) as refused:
        put(ix, "a", 2, a)
    assert refused.value.reason == "tenant_quota"
    assert ix.quotas.refused[a] == 1 and k("a", 2) not in ix
    assert put(ix, "d", 0, 0) == []  # the unlimited default pool is not affected


def test_first_writer_wins_and_unknown_origin_is_default() -> None:
    ix = index({"a": 5 * S})
    a = ix.quotas.pool_of("a")
    put(ix, "x", 0, a)
    put(ix, "x", 0, 0)  # the same chunk stored again for another pool: still A's
    assert ix.pool_of(k("x", 0)) == a
    ix.add(k("found", 0), S)  # probed or loaded: nobody's store
    ix.add_cold([(k("scanned", 0), S, time.time() - 100)])
    assert ix.pool_of(k("found", 0)) == 0 and ix.pool_of(k("scanned", 0)) == 0
    assert ix.quotas.used == [2 * S, S]


def test_a_full_tier_takes_room_from_pools_over_budget_then_unlimited_ones() -> None:
    ix = index({"a": 4 * S, "default": 2 * S}, capacity=6 * S)
    a = ix.quotas.pool_of("a")
    # Found at start-up: 5 chunks of unknown origin, more than "default"'s budget.
    ix.add_cold([(k("old", i), S, time.time() - 1000 * (5 - i)) for i in range(5)])
    assert ix.quotas.over_budget(0)
    for i in range(3):
        put(ix, "a", i, a)
    assert ix.quotas.used == [3 * S, 3 * S]  # the two oldest of the scanned chunks made room
    assert k("old", 0) not in ix and k("old", 1) not in ix
    # Within budgets that fit the tier, nobody under budget loses a chunk to anyone.
    put(ix, "a", 3, a)
    assert ix.quotas.used == [2 * S, 4 * S]
    assert put(ix, "d", 0, 0) == [k("old", 3)]  # default evicts its own
    assert ix.quotas.used == [2 * S, 4 * S]


def test_over_capacity_victims_bring_pools_back_to_their_budget() -> None:
    ix = index({"default": 2 * S})
    ix.add_cold([(k("old", i), S, time.time() - 1000 * (5 - i)) for i in range(5)])
    victims = ix.over_capacity_victims(limit=2)
    assert [key for key, _ in victims] == [k("old", 0), k("old", 1)]
    victims = ix.over_capacity_victims()
    assert [key for key, _ in victims] == [k("old", 2)]
    assert ix.quotas.used == [2 * S] and ix.over_capacity_victims() == []


def a_hit_rate(budgets: dict[str, int] | None, *, with_b: bool, rounds: int = 400) -> float:
    """A replays 8 chunks, B cycles through 40 (10x its budget of 4), 3 per A request, on a tier
    of 16 chunks; a hit is a chunk in the index."""
    ix = TenantChunkIndex(16 * S, TenantQuotas(budgets or {"default": 10**12}))
    a, b = ix.quotas.pool_of("a"), ix.quotas.pool_of("b")

    def access(name: str, i: int, pool: int) -> bool:
        if k(name, i) in ix:
            ix.touch(k(name, i))
            return True
        put(ix, name, i, pool)
        return False

    hits, j = 0, 0
    for i in range(rounds):
        hits += access("a", i % 8, a)
        for _ in range(3 if with_b else 0):
            access("b", j % 40, b)
            j += 1
    return hits / rounds


def test_a_tenant_within_budget_keeps_its_hit_rate_beside_one_ten_times_over() -> None:
    budgets = {"a": 8 * S, "b": 4 * S}
    alone = a_hit_rate(budgets, with_b=False)
    assert alone > 0.9
    assert a_hit_rate(budgets, with_b=True) >= alone - BOUND
    assert a_hit_rate(None, with_b=True) < alone - 0.5  # without budgets B flushes A out


@pytest.mark.anyio
async def test_store_jobs_are_charged_to_their_request_s_tenant(tmp_path) -> None:
    host = SlotBuffer(8, SLOT, pin_memory=False)
    try:
        tier = make_tier(tmp_path, host, tenant_bytes={"a": 2 * (SLOT + 4096)})
        async with running(tier):
            a = RequestContext("r1", {"tenant": "a", "cache_salt": "not-a-label"})
            for i in range(3):
                job = TransferJob(next(job_ids), [key_of(i)], [i], is_promotion=False, ctx=a)
                assert (await finish(tier, [job]))[job.job_id].success
            job = TransferJob(next(job_ids), [key_of(10)], [3], is_promotion=False, ctx=RequestContext("r2"))
            assert (await finish(tier, [job]))[job.job_id].success
            assert len(bin_files(tmp_path)) == 3  # A's oldest went to make room for its third
            assert key_of(0) not in tier.index
            used = metric(tier, "tenant_bytes_used")
            assert used == {("a",): 2.0 * (SLOT + 4096), ("default",): float(SLOT + 4096)}
            assert metric(tier, "tenant_evictions") == {("a",): 1.0, ("default",): 0.0}
            assert metric(tier, "tenant_budget_bytes") == {("a",): 2.0 * (SLOT + 4096)}
            labels = {v for name in ("tenant_bytes_used", "tenant_evictions", "tenant_refused_stores")
                      for v, in metric(tier, name)}
            assert labels == {"a", "default"}
    finally:
        host.close()


def test_a_budget_below_one_chunk_file_is_a_config_error(tmp_path) -> None:
    host = SlotBuffer(8, SLOT, pin_memory=False)
    try:
        with pytest.raises(ConfigError, match=r"tenant_bytes\.a = \d+: less than one chunk"):
            make_tier(tmp_path, host, tenant_bytes={"a": SLOT})  # a chunk file is the slot and its trailer page
    finally:
        host.close()

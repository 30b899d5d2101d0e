"""The fs tier's chunk index (kvtier.tiers.fs.index.ChunkIndex) against a plain model: a dict of
sizes, an OrderedDict for the hot list and (age bucket, arrival) for cold chunks. Small initial
sizes make every run go through slot-array growth, lookup-table doubling, incremental migration
and backward-shift deletion in both tables."""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.tiers.base import TierIOError
from kvtier.tiers.fs.index import ChunkIndex
from kvtier.tiers.fs.tree import MAX_KEY_BYTES, leaf_of

# Few leaf prefixes and groups: leaf chains hold several keys; two key lengths.
_PREFIXES = [bytes.fromhex(p) for p in ("abcde0", "abcde7", "abc010", "fff000")]
KEYS = [p + bytes([i]) * n + bytes([0, 0, 0, g]) for p in _PREFIXES for i in range(12) for n in (1, 29)
        for g in (0, 3)]
assert all(len(k) <= MAX_KEY_BYTES for k in KEYS)
#: Ages (seconds) of cold chunks: each falls in its own age bucket, oldest evicted first.
AGES = (0.0, 100.0, 1e4, 1e7)


def table_entries(index: ChunkIndex) -> int:
    """Occupied buckets of the lookup table(s): one per entry, or an entry was lost or doubled."""
    tables = [index._table] + ([index._old] if index._old is not None else [])
    return sum(1 for table in tables for slot in table if slot != -1)


class IndexModel(RuleBasedStateMachine):
    """Every operation of the index, checked against the model after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[bytes, int] = {}
        self.hot: OrderedDict[bytes, None] = OrderedDict()
        self.cold: dict[bytes, tuple[float, int]] = {}  # key -> (age, arrival)
        self.arrivals = 0
        self.busy: Counter[bytes] = Counter()

    @initialize(capacity=st.sampled_from([None, 100, 400]), expected=st.sampled_from([0, 10]))
    def create(self, capacity: int | None, expected: int) -> None:
        self.index = ChunkIndex(capacity, expected_entries=expected)
        self.now = time.time()  # cold chunks' mtimes are relative to the index's creation

    # ------------------------------------------------------------------ model helpers
    def order(self) -> list[bytes]:
        cold = sorted(self.cold, key=lambda k: (-self.cold[k][0], self.cold[k][1]))
        return cold + list(self.hot)

    def forget(self, key: bytes) -> None:
        self.sizes.pop(key, None)
        self.hot.pop(key, None)
        self.cold.pop(key, None)

    def make_hot(self, key: bytes) -> None:
        self.cold.pop(key, None)
        self.hot.pop(key, None)
        self.hot[key] = None

    def expected_victims(self, excess: int, exclude: bytes | None, limit: int | None) -> tuple[list[bytes], int]:
        chosen, freed = [], 0
        for key in self.order():
            if freed >= excess or (limit is not None and len(chosen) >= limit):
                break
            if key == exclude or self.busy[key]:
                continue
            chosen.append(key)
            freed += self.sizes[key]
        return chosen, freed

    # ------------------------------------------------------------------ rules
    @rule(key=st.sampled_from(KEYS), size=st.integers(1, 60))
    def add(self, key: bytes, size: int) -> None:
        self.index.add(key, size)
        self.sizes[key] = size
        self.make_hot(key)

    @rule(chunks=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 60), st.sampled_from(AGES)),
                          max_size=12))
    def add_cold(self, chunks: list[tuple[bytes, int, float]]) -> None:
        self.index.add_cold((key, size, self.now - age) for key, size, age in chunks)
        for key, size, age in chunks:
            if key not in self.sizes:  # known keys are kept as they are
                self.sizes[key] = size
                self.arrivals += 1
                self.cold[key] = (age, self.arrivals)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        before = time.monotonic()
        assert self.index.remove(key) == (key in self.sizes)
        if key in self.sizes:
            assert self.index.removed_since(key, before)
        self.forget(key)

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        self.index.touch(key)
        if key in self.sizes:
            self.make_hot(key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5), size=st.integers(1, 60))
    def touch_or_add(self, keys: list[bytes], size: int) -> None:
        self.index.touch_or_add(keys, size)
        for key in keys:
            self.sizes.setdefault(key, size)
            self.make_hot(key)

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: bytes) -> None:
        self.index.pin(key)
        self.busy[key] += 1

    @precondition(lambda self: +self.busy)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(+self.busy)))
        self.index.unpin(key)
        self.busy[key] -= 1

    @precondition(lambda self: +self.busy)
    @rule(data=st.data(), size=st.integers(1, 60))
    def finish_load(self, data: st.DataObject, size: int) -> None:
        # A load job's end: its keys unpinned and made the most recent in one pass (a key pinned
        # twice may come twice).
        drawn = data.draw(st.lists(st.sampled_from(sorted(+self.busy)), max_size=6))
        keys = [key for i, key in enumerate(drawn) if drawn[: i + 1].count(key) <= self.busy[key]]
        self.index.unpin_all(keys, touch_or_add=size)
        for key in keys:
            self.busy[key] -= 1
            self.sizes.setdefault(key, size)
            self.make_hot(key)

    @rule(data=st.data(), size=st.integers(1, 60))
    def load_neighbours(self, data: st.DataObject, size: int) -> None:
        # A job of chunks that follow one another in the recency order (stored or loaded together,
        # what unpin_all moves in runs), perhaps with another key (held elsewhere, repeated, or
        # not held at all) cutting it: pinned, then finished in one pass.
        order = self.order()
        start = data.draw(st.integers(0, len(order)))
        job = order[start : data.draw(st.integers(start, min(len(order), start + 8)))]
        if data.draw(st.booleans()):
            job.insert(data.draw(st.integers(0, len(job))), data.draw(st.sampled_from(KEYS + job)))
        self.index.pin_all(job)
        self.index.unpin_all(job, touch_or_add=size)
        for key in job:
            self.sizes.setdefault(key, size)
            self.make_hot(key)

    @rule(complete=st.booleans())
    def set_complete(self, complete: bool) -> None:
        self.index.complete = complete

    @rule(key=st.sampled_from(KEYS), size=st.integers(1, 60))
    def reserve(self, key: bytes, size: int) -> None:
        capacity = self.index.capacity
        current = self.sizes.get(key, 0)
        used = sum(self.sizes.values())
        excess = 0 if capacity is None else used + size - current - capacity
        if capacity is not None and not self.index.complete:
            excess = max(excess, size - current)
        chosen, freed = self.expected_victims(excess, key, None) if excess > 0 else ([], 0)
        if freed < excess:
            with pytest.raises(TierIOError) as failed:
                self.index.reserve(key, size)
            assert failed.value.reason == "no_space"
            return  # nothing reserved, nothing removed: the invariants compare with the model
        victims = self.index.reserve(key, size)
        assert [k for k, _ in victims] == chosen
        for victim in chosen:
            self.forget(victim)
        self.sizes[key] = size
        self.make_hot(key)
        if capacity is not None:
            assert self.index.used <= capacity or not chosen and excess <= 0

    @rule(limit=st.sampled_from([None, 1, 3]))
    def over_capacity(self, limit: int | None) -> None:
        capacity = self.index.capacity
        used = sum(self.sizes.values())
        if capacity is None or used <= capacity:
            assert self.index.over_capacity_victims(limit) == []
            return
        chosen, _ = self.expected_victims(used - capacity, None, limit)
        assert [k for k, _ in self.index.over_capacity_victims(limit)] == chosen
        for victim in chosen:
            self.forget(victim)

    @rule(capacity=st.sampled_from([None, 50, 200, 1000]))
    def change_capacity(self, capacity: int | None) -> None:
        self.index.capacity = capacity  # a smaller cap than last run: over_capacity trims

    # ------------------------------------------------------------------ invariants
    @invariant()
    def agrees_with_the_model(self) -> None:
        index = self.index
        assert len(index) == len(self.sizes)
        assert index.used == sum(self.sizes.values())
        assert table_entries(index) == len(self.sizes)
        for key in KEYS:
            assert index.size_of(key) == self.sizes.get(key)
            assert (key in index) == (key in self.sizes)
            assert index.is_busy(key) == (self.busy[key] > 0)
        assert index.keys() == self.order()

    @invariant()
    def leaf_chains_agree(self) -> None:
        index = self.index
        by_leaf: dict[tuple[int, int], set[bytes]] = {}
        for key in self.sizes:
            by_leaf.setdefault(leaf_of(key), set()).add(key)
        for (group, leaf), keys in by_leaf.items():
            assert sorted(index.leaf_keys(group, leaf)) == sorted(keys)
            assert leaf in index.leaves_in_top(group, leaf >> 8)
        for group in index.groups:
            for top in {leaf_of(k)[1] >> 8 for k in KEYS}:
                assert set(index.leaves_in_top(group, top)) == {
                    leaf for (g, leaf) in by_leaf if g == group and leaf >> 8 == top}


IndexModel.TestCase.settings = settings(max_examples=60, stateful_step_count=120, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_the_index_agrees_with_a_dict_model = IndexModel.TestCase


@pytest.mark.parametrize("seed", range(4))
def test_many_inserts_and_removes_through_growth_and_migration(seed: int) -> None:
    """Thousands of keys from a tiny table: several doublings, each migrated incrementally while
    keys are removed from both the old and the new table."""
    rng = random.Random(seed)
    index = ChunkIndex(None)
    live: dict[bytes, int] = {}
    removed_during_migration = 0
    for step in range(6000):
        if live and rng.random() < 0.35:
            key = rng.choice(list(live)) if step % 7 else next(iter(live))
            removed_during_migration += index._old is not None
            assert index.remove(key)
            del live[key]
        else:
            key = rng.randbytes(rng.choice((3, 32))) + rng.randrange(4).to_bytes(4, "big")
            live[key] = rng.randrange(1, 1000)
            index.add(key, live[key])
        if step % 500 == 0:
            assert all(index.size_of(k) == s for k, s in live.items())
    assert removed_during_migration > 0
    assert len(index) == len(live) == table_entries(index)
    assert all(index.size_of(k) == s for k, s in live.items())
    assert index.used == sum(live.values())
    assert set(index.keys()) == set(live)


def test_a_finished_load_adds_what_the_index_lost_through_growth_and_keeps_the_job_order() -> None:
    index = ChunkIndex(None)
    held = KEYS[:30]
    for key in held:
        index.add(key, 7)
    job = KEYS[20:120]  # ten held, then ninety the index lost (another process listed them gone)
    index.pin_all(job)
    index.unpin_all(job, touch_or_add=9)  # the table doubles, and migrates, while this runs
    assert not any(index.is_busy(key) for key in KEYS)
    assert index.keys() == held[:20] + job
    assert [index.size_of(key) for key in job] == [7] * 10 + [9] * 90
    assert index.used == 30 * 7 + 90 * 9


def test_reserve_that_cannot_make_room_removes_nothing() -> None:
    index = ChunkIndex(100)
    a, b, c = (bytes([i]) * 32 + bytes(4) for i in (1, 2, 3))
    index.add(a, 40)
    index.add(b, 40)
    index.pin(b)
    with pytest.raises(TierIOError):
        index.reserve(c, 70)  # needs 50 freed: only a (40) is idle
    assert index.keys() == [a, b] and index.used == 80
    assert [k for k, _ in index.reserve(c, 50)] == [a]  # 30 needed: a suffices, b stays pinned
    assert index.keys() == [b, c] and index.used == 90


def test_while_incomplete_a_reservation_frees_what_it_takes() -> None:
    index = ChunkIndex(1000)
    index.complete = False
    a, b = (bytes([i]) * 32 + bytes(4) for i in (1, 2))
    with pytest.raises(TierIOError):
        index.reserve(a, 10)  # nothing known to evict: the unscanned tree may fill the cap
    index.add_cold([(a, 10, time.time() - 60)])
    assert [k for k, _ in index.reserve(b, 10)] == [a]
    index.complete = True
    assert index.reserve(a, 10) == []


def test_nbytes_counts_the_removal_records() -> None:
    index = ChunkIndex(None, expected_entries=2000)
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(2000)]
    for key in keys:
        index.add(key, 1)
    before = index.nbytes()
    for key in keys:
        index.remove(key)  # the arrays stay; each removal is remembered for the scans in flight
    remembering = index.nbytes()
    assert remembering - before >= 2000 * (MAX_KEY_BYTES + 24)
    index.forget_removals_before(time.monotonic() + 1)
    assert index.nbytes() <= remembering - 2000 * (MAX_KEY_BYTES + 24)

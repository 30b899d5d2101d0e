"""kvtier's policies inside vLLM's real CPU offloading manager behave like vLLM's own.

Every test drives two real ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` objects through
the same manager calls: one with vLLM's built-in policy (``"lru"`` / ``"arc"``), one with the
kvtier adapter from :mod:`kvtier.integrations.vllm.policies`, loaded the way a vLLM config loads
it (``cache_policy_module_path``). Every observable result must match: ``lookup``, the
``prepare_store`` output (stored keys, evicted keys, slot ids, or ``None``), the ``prepare_load``
slot ids and ``take_events()``.

Each manager gets its own ``ReqContext`` per request (a manager keeps per-request state in the
context), with the same request id and the same recorded token positions.
"""

from __future__ import annotations

import mmap
import uuid
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from kvtier.integrations.vllm.policies import KvtierARCPolicy, KvtierLRUPolicy

MODULE = "kvtier.integrations.vllm.policies"
PAIRS = {"lru": "KvtierLRUPolicy", "arc": "KvtierARCPolicy"}
UNIVERSE = 10  # block hashes; keys come back after eviction, so ARC sees ghost hits
GROUPS = 2  # KV cache groups; a key is (hash, group)
NUM_CHUNKS = 4


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


ALL_KEYS = [key(i, g) for i in range(UNIVERSE) for g in range(GROUPS)]


def chunk_ids(spec: object) -> list[int]:
    return [int(i) for i in spec.chunk_ids]  # type: ignore[attr-defined]


@dataclass
class Request:
    """One request as both managers see it: a ``ReqContext`` each, identical contents."""

    contexts: tuple[ReqContext, ReqContext]
    reused: set[bytes] = field(default_factory=set)  # ready keys it offered or loaded


class Pair:
    """The reference manager (vLLM's policy) and the manager under test (kvtier's), in lockstep."""

    def __init__(self, builtin: str, num_chunks: int = NUM_CHUNKS) -> None:
        self.builtin = builtin
        self.ref = CPUOffloadingManager(num_chunks, cache_policy=builtin, enable_events=True)
        self.sut = CPUOffloadingManager(
            num_chunks,
            cache_policy=PAIRS[builtin],
            cache_policy_module_path=MODULE,
            enable_events=True,
        )
        self.managers = (self.ref, self.sut)
        self.next_req = 0

    def new_request(self, positioned: bool = True) -> Request:
        """A request; with ``positioned`` every key has a token position (by hash, per group)."""
        req_id = f"req-{self.next_req}"
        self.next_req += 1
        contexts = (ReqContext(req_id), ReqContext(req_id))
        if positioned:
            for ctx in contexts:
                for i in range(UNIVERSE):
                    for g in range(GROUPS):
                        ctx.set_offload_key_position(key(i, g), 16 * (i + 1))
        for manager, ctx in zip(self.managers, contexts):
            manager.on_new_request(ctx)
        return Request(contexts)

    # --- lockstep calls, each comparing what both managers return ----------------------------------
    def store(self, req: Request, keys: list[bytes]) -> list[bytes] | None:
        for k in keys:
            if self.ref.lookup(k, req.contexts[0]) is LookupResult.HIT:
                req.reused.add(k)
        outs = [m.prepare_store(keys, ctx) for m, ctx in zip(self.managers, req.contexts)]
        ref, sut = outs
        if ref is None or sut is None:
            assert ref is None and sut is None, (ref, sut)
            return None
        assert sut.keys_to_store == ref.keys_to_store
        assert sut.evicted_keys == ref.evicted_keys
        assert chunk_ids(sut.store_spec) == chunk_ids(ref.store_spec)
        return list(ref.keys_to_store)

    def complete_store(self, req: Request, keys: list[bytes], success: bool = True) -> None:
        for m, ctx in zip(self.managers, req.contexts):
            m.complete_store(keys, ctx, success=success)

    def load(self, req: Request, keys: list[bytes]) -> list[int]:
        req.reused.update(keys)
        specs = [m.prepare_load(keys, ctx) for m, ctx in zip(self.managers, req.contexts)]
        assert chunk_ids(specs[1]) == chunk_ids(specs[0])
        return chunk_ids(specs[0])

    def complete_load(self, req: Request, keys: list[bytes]) -> None:
        for m, ctx in zip(self.managers, req.contexts):
            m.complete_load(keys, ctx)

    def touch(self, req: Request, keys: list[bytes]) -> None:
        for m, ctx in zip(self.managers, req.contexts):
            m.touch(keys, ctx)

    def finish(self, req: Request) -> None:
        for m, ctx in zip(self.managers, req.contexts):
            m.on_request_finished(ctx)

    def reset(self) -> None:
        for m in self.managers:
            m.reset_cache()

    def lookups(self, req: Request) -> dict[bytes, LookupResult]:
        ref = {k: self.ref.lookup(k, req.contexts[0]) for k in ALL_KEYS}
        sut = {k: self.sut.lookup(k, req.contexts[1]) for k in ALL_KEYS}
        assert sut == ref
        return ref

    def events(self) -> list[tuple[list[bytes], bool, bool]]:
        def simple(manager: CPUOffloadingManager) -> list[tuple[list[bytes], bool, bool]]:
            return [(list(e.keys), e.removed, e.metadata_only) for e in manager.take_events()]

        ref, sut = simple(self.ref), simple(self.sut)
        assert sut == ref
        return ref

    def check(self, req: Request) -> None:
        self.lookups(req)
        self.events()


both = pytest.mark.parametrize("builtin", ["lru", "arc"])


# --- selection through vLLM's factory -----------------------------------------------------------
@both
def test_vllm_factory_loads_the_policy_from_the_module_path(builtin: str) -> None:
    cls = CachePolicyFactory.get_cache_policy_cls(PAIRS[builtin], MODULE)
    assert cls is {"lru": KvtierLRUPolicy, "arc": KvtierARCPolicy}[builtin]
    assert issubclass(cls, CachePolicy)
    manager = CPUOffloadingManager(3, cache_policy=PAIRS[builtin], cache_policy_module_path=MODULE)
    assert isinstance(manager._policy, cls)
    assert manager._policy.cache_capacity == 3


def test_primary_tier_manager_runs_on_a_kvtier_policy() -> None:
    """The tiering CPU primary tier builds its policy the same way."""
    tiering = pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
    region_mod = pytest.importorskip("vllm.v1.kv_offload.cpu.shared_offload_region")
    page = mmap.PAGESIZE
    try:
        region = region_mod.SharedOffloadRegion(f"kvtier-test-{uuid.uuid4().hex}", 2, None, page, page)
    except OSError as exc:  # no usable /dev/shm here
        pytest.skip(f"cannot create a shared offload region: {exc!r}")
    manager = tiering.CPUPrimaryTierOffloadingManager(
        2, region, cache_policy="KvtierLRUPolicy", cache_policy_module_path=MODULE
    )
    try:
        assert isinstance(manager._policy, KvtierLRUPolicy)
        ctx = ReqContext("r")
        out = manager.prepare_write([key(1), key(2)], ctx)
        assert out is not None and out.keys_to_store == [key(1), key(2)]
        manager.complete_write([key(1), key(2)], ctx)
        assert manager.lookup(key(1), ctx) is LookupResult.HIT
        manager.prepare_read([key(1)], ctx)
        out = manager.prepare_write([key(3), key(4)], ReqContext("s"))
        assert out is None  # key(1) is pinned by the read: only one evictable chunk
        manager.complete_read([key(1)], ctx)
    finally:
        manager.shutdown()


# --- hand-written cases -------------------------------------------------------------------------
@both
def test_eviction_within_one_request_takes_the_tail_first(builtin: str) -> None:
    pair = Pair(builtin)
    req = pair.new_request()
    stored = pair.store(req, [key(2), key(0), key(3), key(1)])  # offered out of prefix order
    assert stored is not None
    pair.complete_store(req, stored)
    pair.finish(req)
    other = pair.new_request()
    assert pair.store(other, [key(7), key(8)]) == [key(7), key(8)]
    removed = [keys for keys, is_removal, _ in pair.events() if is_removal]
    # Request end made the head most recent (LRU) / the T1 MRU (ARC): the tail goes first.
    assert removed == [[key(3), key(2)]]
    pair.check(other)


@both
def test_lru_rank_order_of_positioned_inserts(builtin: str) -> None:
    pair = Pair(builtin)
    req = pair.new_request()
    stored = pair.store(req, [key(2), key(0), key(3), key(1)])
    pair.complete_store(req, stored)
    evicting = pair.new_request()
    outs = [m.prepare_store([key(9), key(8)], c) for m, c in zip(pair.managers, evicting.contexts)]
    assert outs[0] is not None and outs[1] is not None
    assert outs[1].evicted_keys == outs[0].evicted_keys
    if builtin == "lru":
        assert outs[0].evicted_keys == [key(3), key(2)]  # largest positions of the request first
    pair.check(evicting)


@both
def test_touch_order(builtin: str) -> None:
    pair = Pair(builtin)
    req = pair.new_request(positioned=False)
    for i in range(4):
        pair.complete_store(req, pair.store(req, [key(i)]))
    pair.touch(req, [key(0), key(2), key(1)])  # first key becomes the most recent
    other = pair.new_request(positioned=False)
    for i in (5, 6, 7):
        out = pair.store(other, [key(i)])
        pair.complete_store(other, out)
    pair.check(other)
    if builtin == "lru":
        assert pair.lookups(other)[key(0)] is LookupResult.HIT


def test_arc_ghost_hit_adapts_the_t1_target() -> None:
    pair = Pair("arc")
    a = pair.new_request()
    pair.complete_store(a, pair.store(a, [key(0), key(1), key(2), key(3)]))
    pair.finish(a)
    b = pair.new_request()
    pair.complete_store(b, pair.store(b, [key(4), key(5)]))  # evicts two T1 chunks into B1
    pair.finish(b)
    c = pair.new_request()
    # The request's head (0) ended up most recent, so its tail (3, 2) went to B1.
    pair.complete_store(c, pair.store(c, [key(2), key(3)]))  # B1 ghost hits grow the target
    ref_policy, sut_policy = pair.ref._policy, pair.sut._policy
    assert ref_policy.target_t1_size > 0
    assert sut_policy.kvtier_policy.target_t1_size == ref_policy.target_t1_size
    pair.finish(c)
    d = pair.new_request()
    pair.load(d, [key(2)])  # reuse: T1 -> T2
    pair.complete_load(d, [key(2)])
    pair.finish(d)
    e = pair.new_request()
    pair.complete_store(e, pair.store(e, [key(6), key(7), key(8)]))
    pair.check(e)
    assert sut_policy.kvtier_policy.target_t1_size == ref_policy.target_t1_size


@both
def test_pinned_chunks_are_never_evicted(builtin: str) -> None:
    pair = Pair(builtin)
    a = pair.new_request()
    pair.complete_store(a, pair.store(a, [key(0), key(1), key(2), key(3)]))
    pair.load(a, [key(3), key(1)])
    b = pair.new_request()
    stored = pair.store(b, [key(4), key(5)])
    assert stored == [key(4), key(5)]
    assert set(pair.events()[-1][0]) == {key(0), key(2)}
    assert pair.store(b, [key(6)]) is None  # 1, 3 pinned; 4, 5 write-pending
    pair.complete_load(a, [key(3), key(1)])
    assert pair.store(b, [key(6)]) is not None
    pair.check(b)


@both
def test_offered_keys_are_protected_from_eviction(builtin: str) -> None:
    pair = Pair(builtin)
    a = pair.new_request(positioned=False)
    for i in range(4):
        pair.complete_store(a, pair.store(a, [key(i)]))
    b = pair.new_request(positioned=False)
    stored = pair.store(b, [key(0), key(1), key(5)])  # 0 is the LRU victim but is offered
    assert stored == [key(5)]
    removed = [keys for keys, is_removal, _ in pair.events() if is_removal]
    assert key(0) not in removed[-1] and key(1) not in removed[-1]
    pair.check(b)


@both
def test_failed_eviction_changes_nothing(builtin: str) -> None:
    pair = Pair(builtin)
    a = pair.new_request()
    pair.complete_store(a, pair.store(a, [key(0), key(1), key(2)]))
    pending = pair.store(a, [key(3)])  # write-pending, not evictable
    b = pair.new_request()
    # Three evictions needed, two chunks evictable once 0 is protected: None, nothing changes.
    assert pair.store(b, [key(0), key(6), key(7), key(8)]) is None
    pair.complete_store(a, pending)
    pair.finish(a)
    pair.finish(b)
    c = pair.new_request()
    for i in (6, 7, 8, 9):
        pair.complete_store(c, pair.store(c, [key(i)]))
    pair.check(c)


def test_lru_request_rank_is_drawn_when_the_request_first_offers_keys() -> None:
    """vLLM draws a request's LRU rank at its first access, even if that store then fails."""
    pair = Pair("lru")
    x = pair.new_request(positioned=False)
    pair.complete_store(x, pair.store(x, [key(0), key(1), key(2), key(3)]))
    pinned = [key(0), key(1), key(2), key(3)]
    pair.load(x, pinned)
    a = pair.new_request()
    assert pair.store(a, [key(4)]) is None  # everything pinned; a's rank is drawn anyway
    pair.complete_load(x, pinned)
    b = pair.new_request()
    pair.complete_store(b, pair.store(b, [key(5)]))  # b's rank is newer than a's
    pair.complete_store(a, pair.store(a, [key(4)]))  # inserted with a's older rank
    c = pair.new_request()
    assert pair.store(c, [key(6), key(7), key(8)]) is not None
    assert pair.events()[-1][0] == [key(2), key(3), key(4)]
    pair.check(c)


def test_arc_reused_key_rewritten_before_finish_matches_vllm() -> None:
    """A key a request reused, evicted and re-stored (write-pending) before the request ends."""
    pair = Pair("arc")
    a = pair.new_request()
    pair.complete_store(a, pair.store(a, [key(0), key(1), key(2), key(3)]))
    b = pair.new_request()
    pair.load(b, [key(0)])
    pair.complete_load(b, [key(0)])
    c = pair.new_request()
    pair.complete_store(c, pair.store(c, [key(4), key(5), key(6), key(7)]))  # evicts 0..3
    pending = pair.store(c, [key(0)])  # 0 is back, write-pending
    pair.finish(b)  # b reused 0
    pair.complete_store(c, pending)
    d = pair.new_request()
    for i in (8, 9, 1, 2):
        pair.complete_store(d, pair.store(d, [key(i)]))
    pair.check(d)


# --- random sequences -----------------------------------------------------------------------------
_key_lists = st.lists(st.sampled_from(ALL_KEYS), min_size=1, max_size=4, unique=True)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 2), _key_lists),
        st.tuples(st.just("complete_store"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("load"), st.integers(0, 2), _key_lists),
        st.tuples(st.just("complete_load"), st.integers(0, 7)),
        st.tuples(st.just("touch"), st.integers(0, 2), st.lists(st.sampled_from(ALL_KEYS), max_size=4)),
        st.tuples(st.just("finish"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("reset"), st.integers(0, 9)),
    ),
    max_size=40,
)


def run_sequence(builtin: str, ops: list[tuple]) -> None:
    pair = Pair(builtin)
    requests = [pair.new_request() for _ in range(3)]
    stores: list[tuple[Request, list[bytes]]] = []  # in-flight store jobs
    loads: list[tuple[Request, list[bytes]]] = []  # in-flight load jobs
    for op in ops:
        kind = op[0]
        if kind == "store":
            req = requests[op[1]]
            stored = pair.store(req, op[2])
            if stored:
                stores.append((req, stored))
        elif kind == "complete_store" and stores:
            req, keys = stores.pop(op[1] % len(stores))
            pair.complete_store(req, keys, success=op[2])
        elif kind == "load":
            req = requests[op[1]]
            ready = [k for k, r in pair.lookups(req).items() if r is LookupResult.HIT]
            keys = [k for k in op[2] if k in ready]
            if keys:
                pair.load(req, keys)
                loads.append((req, keys))
        elif kind == "complete_load" and loads:
            req, keys = loads.pop(op[1] % len(loads))
            pair.complete_load(req, keys)
        elif kind == "touch":
            pair.touch(requests[op[1]], op[2])
        elif kind == "finish":
            pair.finish(requests[op[1]])
            requests[op[1]] = pair.new_request(positioned=op[2])
        elif kind == "reset" and op[1] == 0:
            # vLLM never completes a transfer started before a reset.
            pair.reset()
            stores.clear()
            loads.clear()
        pair.check(requests[0])


_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(ops=_ops)
def test_random_sequences_match_vllm_lru(ops: list[tuple]) -> None:
    run_sequence("lru", ops)


@_SETTINGS
@given(ops=_ops)
def test_random_sequences_match_vllm_arc(ops: list[tuple]) -> None:
    run_sequence("arc", ops)

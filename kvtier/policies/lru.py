"""Least-recently-used eviction with request-aware ranks.

Every resident chunk has a rank ``(r, s)``; :meth:`LRUPolicy.evict` takes the smallest ranks
first among evictable, unprotected chunks. A global counter hands out fresh ``r`` values:

* an unpositioned insert, and every touched key, gets a fresh rank ``(next, 0)`` (most recent);
* an insert whose request recorded a token position ``p`` for the key gets
  ``(request_rank, -p)``: all chunks of a request share one rank drawn at the request's first
  access (:meth:`~LRUPolicy.on_request_access`) or insert, whichever comes first, and within a
  request the tail (large ``p``) is evicted before the head, so a cache under pressure keeps
  usable prefixes instead of useless suffixes;
* :meth:`~LRUPolicy.touch` and :meth:`~LRUPolicy.on_request_finished` assign fresh ranks in
  **reverse** of the given (prefix) order, so the head of the prefix ends up most recent.

Ranks of pinned or write-pending chunks change immediately but only matter once the chunk is
evictable again, so the order in which transfers complete never rewrites request order.

Cost: a lazy-invalidation min-heap over the evictable chunks. Changing a rank pushes a new heap
entry and leaves the old one behind (it is recognised as stale by identity); the heap is rebuilt
when stale entries outnumber live ones, so every operation is O(log n) amortized and
:meth:`~LRUPolicy.evict` pops only the entries it returns, sets aside or finds stale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvtier.context import RequestContext
from kvtier.policies.base import CachePolicy
from kvtier.types import ChunkStatus

__all__ = ["LRUPolicy"]

# A heap entry and the current rank of a key are the same tuple object: (r, s, key). An entry in
# the heap is live iff the key is evictable and its current rank *is* that tuple; every rank
# change or re-marking as evictable creates a new tuple, which retires older copies in O(1).
_Rank = tuple[int, int, bytes]

# Below this size the rebuild thresholds would fire on nearly every call.
_MIN_REBUILD = 64

_policy_ids = itertools.count()


class _RequestRanks:
    """Per-request state (in the ``RequestContext`` state bag): the rank each LRU drew for it.

    Keyed by policy instance id so that two LRU policies sharing a request never share a rank;
    the value remembers the policy's cache generation so a rank drawn before ``clear()`` is
    drawn again afterwards.
    """

    __slots__ = ("ranks",)

    def __init__(self) -> None:
        self.ranks: dict[int, tuple[int, int]] = {}  # policy id -> (generation, request rank)


class LRUPolicy(CachePolicy):
    """Request-aware LRU (see the module docstring for the ordering rules)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._id = next(_policy_ids)
        self._generation = 0
        self._next_rank = 0
        self._chunks: dict[bytes, ChunkStatus] = {}
        self._rank: dict[bytes, _Rank] = {}
        self._evictable: set[bytes] = set()
        self._heap: list[_Rank] = []

    # --- map ---------------------------------------------------------------------------------------
    def get(self, key: bytes) -> ChunkStatus | None:
        return self._chunks.get(key)

    def __len__(self) -> int:
        return len(self._chunks)

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        position = None if req_context is None else req_context.get_offload_key_position(key)
        if req_context is None or position is None:
            rank = (self._fresh_rank(), 0, key)
        else:
            rank = (self._request_rank(req_context), -position, key)
        self._evictable.discard(key)  # precondition says absent; a re-insert replaces cleanly
        self._chunks[key] = chunk
        self._rank[key] = rank
        if chunk.ref_cnt == 0:
            self._push_evictable(key, rank)

    def remove(self, key: bytes) -> None:
        if self._chunks.pop(key, None) is None:
            return
        del self._rank[key]
        self._evictable.discard(key)  # its heap entries are now stale

    def clear(self) -> None:
        self._chunks.clear()
        self._rank.clear()
        self._evictable.clear()
        self._heap.clear()
        self._generation += 1  # request ranks drawn before the reset are drawn again

    # --- evictability ------------------------------------------------------------------------------
    def mark_evictable(self, key: bytes) -> None:
        rank = self._rank.get(key)
        if rank is None or key in self._evictable:
            return
        # A new tuple identity retires any entry left in the heap from an earlier evictable spell.
        self._push_evictable(key, (rank[0], rank[1], key))

    def mark_non_evictable(self, key: bytes) -> None:
        self._evictable.discard(key)

    # --- recency -------------------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        self._refresh(keys)

    def on_request_access(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """Raise each positioned key's rank to ``(request_rank, -position)`` if that is higher.

        A chunk another request inserted earlier joins this request's rank group, so it is not
        evicted ahead of the request's own (later-inserted) chunks. Keys without a position, and
        calls without a context, are ignored.

        The request rank is drawn here if the request has none yet, even when no key is resident:
        the host tier reports a request's first accesses before it allocates, so a request whose
        first store fails (no room) keeps the rank of that first access, as in vLLM.
        """
        if req_context is None:
            return
        request_rank = self._request_rank(req_context)
        for key in keys:
            rank = self._rank.get(key)
            position = req_context.get_offload_key_position(key)
            if rank is None or position is None:
                continue
            if (request_rank, -position) > (rank[0], rank[1]):
                self._set_rank(key, (request_rank, -position, key))
        self._maybe_compact()

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: Collection[bytes],
        reused_keys: Collection[bytes],
        req_context: RequestContext | None,
    ) -> None:
        """Fresh ranks in reverse prefix order: the head becomes most recent, the tail least.

        Insertion and reuse are not distinguished (LRU has no frequency).
        """
        self._refresh(self.order_request_keys(key_groups, req_context))

    # --- eviction --------------------------------------------------------------------------------------
    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        if n <= 0:
            return []
        if n > len(self._evictable):
            return None
        protected_set = protected if isinstance(protected, AbstractSet) else frozenset(protected)
        heap = self._heap
        victims: list[_Rank] = []
        set_aside: list[_Rank] = []
        while len(victims) < n and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if key not in self._evictable or self._rank[key] is not entry:
                continue  # stale: dropping it changes nothing observable
            if key in protected_set or self._chunks[key].ref_cnt != 0:
                set_aside.append(entry)
            else:
                victims.append(entry)
        if len(victims) < n:
            for entry in itertools.chain(victims, set_aside):
                heapq.heappush(heap, entry)
            return None
        for entry in set_aside:
            heapq.heappush(heap, entry)
        evicted: list[tuple[bytes, ChunkStatus]] = []
        for _, _, key in victims:
            self._evictable.discard(key)
            del self._rank[key]
            evicted.append((key, self._chunks.pop(key)))
        return evicted

    # --- introspection ---------------------------------------------------------------------------------
    def rank_of(self, key: bytes) -> tuple[int, int] | None:
        """The current rank ``(r, s)`` of a resident key (smaller is evicted first), or ``None``."""
        rank = self._rank.get(key)
        return None if rank is None else (rank[0], rank[1])

    def snapshot(self) -> dict[str, Any]:
        """A comparable copy of the observable state (O(n); for tests and debugging)."""
        return {
            "chunks": {
                key: (chunk.ref_cnt, chunk.slot_id, self._rank[key][:2])
                for key, chunk in self._chunks.items()
            },
            "evictable": frozenset(self._evictable),
        }

    # --- internals -------------------------------------------------------------------------------------
    def _fresh_rank(self) -> int:
        rank = self._next_rank
        self._next_rank += 1
        return rank

    def _request_rank(self, req_context: RequestContext) -> int:
        state = req_context.get_state(_RequestRanks)
        if state is None:
            state = _RequestRanks()
            req_context.set_state(state)
        drawn = state.ranks.get(self._id)
        if drawn is not None and drawn[0] == self._generation:
            return drawn[1]
        rank = self._fresh_rank()
        state.ranks[self._id] = (self._generation, rank)
        return rank

    def _push_evictable(self, key: bytes, rank: _Rank) -> None:
        self._rank[key] = rank
        self._evictable.add(key)
        heapq.heappush(self._heap, rank)

    def _set_rank(self, key: bytes, rank: _Rank) -> None:
        self._rank[key] = rank
        if key in self._evictable:
            heapq.heappush(self._heap, rank)

    def _refresh(self, keys: Sequence[bytes]) -> None:
        """Fresh ranks in reverse order of ``keys`` (the first key ends up most recent)."""
        ranks = self._rank
        if len(keys) >= max(_MIN_REBUILD, len(self._evictable) // 4):
            # Many keys at once: k pushes would cost more than one O(n) heapify.
            for key in reversed(keys):
                if key in ranks:
                    ranks[key] = (self._fresh_rank(), 0, key)
            self._rebuild()
            return
        for key in reversed(keys):
            if key in ranks:
                self._set_rank(key, (self._fresh_rank(), 0, key))
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if len(self._heap) > max(_MIN_REBUILD, 2 * len(self._evictable)):
            self._rebuild()

    def _rebuild(self) -> None:
        """Replace the heap by exactly the live entries (drops every stale one)."""
        ranks = self._rank
        self._heap = [ranks[key] for key in self._evictable]
        heapq.heapify(self._heap)

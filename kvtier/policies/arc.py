"""Adaptive replacement cache, adapted to request-driven offloading.

Resident chunks live in ``T1`` (seen by one request) or ``T2`` (reused by a later request); the
ghost lists ``B1``/``B2`` remember keys recently evicted from each. All four are ordered LRU → MRU.
The target size of ``T1``, ``p``, moves towards whichever list's ghosts are being asked for again:
a store miss on a ``B1`` ghost means ``T1`` was too small (``p`` grows), on a ``B2`` ghost that
``T2`` was (``p`` shrinks).

Differences from textbook ARC, all deliberate:

* ghost hits are learned on **store misses** (:meth:`ARCPolicy.on_store_miss`), not on lookups,
  because a lookup that misses the host tier may still hit a secondary tier;
* frequency promotion (``T1`` → ``T2``) is deferred to :meth:`ARCPolicy.on_request_finished`
  for the keys a request actually *reused*; a chunk the request only inserted moves to its
  list's MRU end without promotion, and a write-pending chunk never counts as a second access;
* ``B1`` and ``B2`` are each bounded by the capacity ``c`` (not ``|T1| + |B1| <= c``).

Cost: every hook is O(1) per key (``OrderedDict`` moves). :meth:`ARCPolicy.evict` walks each
list at most once, from its LRU end, skipping pinned, write-pending and protected entries; in
a cache where most chunks are evictable it touches O(n + skipped) entries, independent of size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from kvtier.context import RequestContext
from kvtier.policies.base import CachePolicy
from kvtier.types import ChunkStatus

__all__ = ["ARCPolicy"]


class ARCPolicy(CachePolicy):
    """ARC with request-level frequency (see the module docstring).

    Evictability is read from ``ChunkStatus.ref_cnt`` directly (the host tier keeps it current),
    so :meth:`mark_evictable` and :meth:`mark_non_evictable` have nothing to do.
    """

    #: When true, :meth:`on_request_finished` promotes a reused key found in ``T1`` even if its
    #: chunk is write-pending (the key was evicted and stored again after the reuse). vLLM 0.33's
    #: built-in ARC does so; kvtier's default never counts a pending chunk as an access. Set by
    #: the vLLM adapter (``kvtier.integrations.vllm.policies``) to match vLLM exactly.
    promote_pending_reused_on_finish: ClassVar[bool] = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._t1: OrderedDict[bytes, ChunkStatus] = OrderedDict()
        self._t2: OrderedDict[bytes, ChunkStatus] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1_size = 0.0

    @property
    def target_t1_size(self) -> float:
        """``p``: how many chunks ``T1`` should hold before ``T2`` gives way (0 ≤ p ≤ c)."""
        return self._target_t1_size

    # --- map ---------------------------------------------------------------------------------------
    def get(self, key: bytes) -> ChunkStatus | None:
        chunk = self._t1.get(key)
        return chunk if chunk is not None else self._t2.get(key)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        """Put ``key`` at ``T1``'s MRU end and forget its ghost (the ghost hit was already learned)."""
        self._t2.pop(key, None)  # precondition says absent; a re-insert replaces cleanly
        self._t1[key] = chunk
        self._t1.move_to_end(key)
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target_t1_size = 0.0

    def mark_evictable(self, key: bytes) -> None:
        pass

    def mark_non_evictable(self, key: bytes) -> None:
        pass

    # --- recency and frequency ----------------------------------------------------------------------
    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """Learn from ghost hits among ``keys`` (in reverse order); resident keys are ignored."""
        for key in reversed(keys):
            if key not in self._t1 and key not in self._t2:
                self._adapt_to_ghost(key)

    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        """In reverse order: a ready ``T1`` chunk is promoted to ``T2``'s MRU end; a write-pending
        ``T1`` chunk only moves to ``T1``'s MRU end (a just-prepared store is not a second
        access); a ``T2`` chunk moves to ``T2``'s MRU end; a non-resident key feeds ghost
        adaptation."""
        for key in reversed(keys):
            if key in self._t1:
                self._reaccess_t1(key)
            elif key in self._t2:
                self._t2.move_to_end(key)
            else:
                self._adapt_to_ghost(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: Collection[bytes],
        reused_keys: Collection[bytes],
        req_context: RequestContext | None,
    ) -> None:
        """In reverse prefix order: reused keys count one access (``T1`` → ``T2`` MRU if ready,
        ``T2`` → MRU); insertion-only keys move to the MRU end of the list holding them; other
        keys, and keys no longer resident, are left alone. (See
        :attr:`promote_pending_reused_on_finish` for write-pending reused chunks.)"""
        for key in reversed(self.order_request_keys(key_groups, req_context)):
            if key in reused_keys:
                if key in self._t1:
                    if self.promote_pending_reused_on_finish:
                        self._t2[key] = self._t1.pop(key)
                    else:
                        self._reaccess_t1(key)
                elif key in self._t2:
                    self._t2.move_to_end(key)
            elif key in insertion_only_keys:
                if key in self._t1:
                    self._t1.move_to_end(key)
                elif key in self._t2:
                    self._t2.move_to_end(key)

    # --- eviction --------------------------------------------------------------------------------------
    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Choose ``n`` victims as ARC's REPLACE would, then commit them all or nothing.

        For each victim: while the (virtual, shrinking) ``|T1|`` is at least ``int(p)`` take the
        next eligible ``T1`` entry, otherwise (or if ``T1`` has none left) the next eligible
        ``T2`` entry, falling back to ``T1``. Each list is scanned by one forward iterator, so it
        is walked at most once per call. On commit ``T1`` victims become ``B1`` ghosts and ``T2``
        victims ``B2`` ghosts (at the MRU end), and each ghost list is trimmed to ``c`` entries.
        """
        if n <= 0:
            return []
        if n > len(self._t1) + len(self._t2):
            return None
        protected_set = protected if isinstance(protected, AbstractSet) else frozenset(protected)
        t1_scan = _eligible(self._t1, protected_set)
        t2_scan = _eligible(self._t2, protected_set)
        target = int(self._target_t1_size)
        virtual_t1 = len(self._t1)
        victims: list[tuple[bytes, ChunkStatus, bool]] = []  # (key, chunk, came from T1)
        for _ in range(n):
            victim = next(t1_scan, None) if virtual_t1 >= target else None
            from_t1 = victim is not None
            if victim is None:
                victim = next(t2_scan, None)
            if victim is None:
                victim = next(t1_scan, None)
                from_t1 = victim is not None
            if victim is None:
                return None  # nothing has been modified yet
            if from_t1:
                virtual_t1 -= 1
            victims.append((victim[0], victim[1], from_t1))

        for key, _, from_t1 in victims:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return [(key, chunk) for key, chunk, _ in victims]

    # --- introspection ---------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A comparable copy of the observable state (O(n); for tests and debugging)."""
        return {
            "t1": [(k, c.ref_cnt, c.slot_id) for k, c in self._t1.items()],
            "t2": [(k, c.ref_cnt, c.slot_id) for k, c in self._t2.items()],
            "b1": list(self._b1),
            "b2": list(self._b2),
            "p": self._target_t1_size,
        }

    # --- internals -------------------------------------------------------------------------------------
    def _reaccess_t1(self, key: bytes) -> None:
        chunk = self._t1[key]
        if chunk.ref_cnt >= 0:
            del self._t1[key]
            self._t2[key] = chunk
        else:
            self._t1.move_to_end(key)

    def _adapt_to_ghost(self, key: bytes) -> None:
        # The ghost entry stays (refreshed to MRU) until the key is re-inserted.
        b1, b2 = self._b1, self._b2
        capacity = float(self.cache_capacity)
        if key in b1:
            step = max(1.0, len(b2) / len(b1))
            self._target_t1_size = min(self._target_t1_size + step, capacity)
            b1.move_to_end(key)
        elif key in b2:
            step = max(1.0, len(b1) / len(b2))
            self._target_t1_size = max(self._target_t1_size - step, 0.0)
            b2.move_to_end(key)


def _eligible(
    entries: OrderedDict[bytes, ChunkStatus], protected: Collection[bytes]
) -> Iterator[tuple[bytes, ChunkStatus]]:
    """Entries of one list, LRU first, that may be evicted now (ready, unpinned, unprotected)."""
    for key, chunk in entries.items():
        if chunk.ref_cnt == 0 and key not in protected:
            yield key, chunk

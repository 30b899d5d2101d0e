"""The host tier's cache policy when tenant budgets are configured: one policy per tenant pool.

:class:`TenantPolicy` is a :class:`~kvtier.policies.base.CachePolicy` made of one inner policy per
pool of a :class:`~kvtier.policies.quotas.TenantQuotas` (each the configured ``eviction_policy``,
created when its pool first stores). A chunk belongs to the pool of the request that inserted it
(first writer wins) and is ordered by that pool's policy only, so a pool's least recently used
chunks are found without walking anyone else's: evicting for one tenant costs what evicting from
a cache of that tenant's size costs.

Hooks are routed by owner: recency and frequency hooks reach the policy of each key's pool (keys
not resident, which feed adaptive ghost state, go to the requesting pool). :meth:`TenantPolicy.evict`
keeps the base contract (atomic, any pool, the donor order of
:meth:`~kvtier.policies.quotas.TenantQuotas.donors`); the host tier asks for victims per pool
with :meth:`TenantPolicy.plan` and :meth:`TenantPolicy.evict_planned`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvtier.context import RequestContext
from kvtier.policies.base import CachePolicy
from kvtier.policies.quotas import TenantQuotas
from kvtier.types import ChunkStatus

__all__ = ["TenantPolicy"]


class TenantPolicy(CachePolicy):
    """Per-pool policies behind one :class:`CachePolicy` (see the module docstring).

    ``chunk_bytes`` is what one chunk is charged (a host slot); ``make(capacity)`` creates a
    pool's inner policy. A pool with a budget holds at most ``budget // chunk_bytes`` chunks,
    which is its inner policy's capacity.
    """

    def __init__(self, cache_capacity: int, quotas: TenantQuotas, chunk_bytes: int,
                 make: Callable[[int], CachePolicy]) -> None:
        super().__init__(cache_capacity)
        self.quotas = quotas
        self.chunk_bytes = chunk_bytes
        self._make = make
        self._pools: list[CachePolicy | None] = [None] * len(quotas)
        self._owner: dict[bytes, int] = {}
        self._evictable = [0] * len(quotas)  # ready, unpinned chunks per pool

    # --- pools -------------------------------------------------------------------------------------
    def _pool(self, pool: int) -> CachePolicy:
        policy = self._pools[pool]
        if policy is None:
            budget = self.quotas.budgets[pool]
            capacity = self.cache_capacity if budget is None else min(self.cache_capacity, budget // self.chunk_bytes)
            policy = self._pools[pool] = self._make(max(1, capacity))
        return policy

    def owner(self, key: bytes) -> int | None:
        """The pool a resident chunk is charged to, or None."""
        return self._owner.get(key)

    def _split(self, keys: Sequence[bytes], ctx: RequestContext | None) -> dict[int, list[bytes]]:
        """``keys`` by pool, in their order; keys not resident go to the requesting pool."""
        owner = self._owner
        out: dict[int, list[bytes]] = {}
        requester: int | None = None
        for key in keys:
            pool = owner.get(key)
            if pool is None:
                if requester is None:
                    requester = self.quotas.pool_of_request(ctx)
                pool = requester
            group = out.get(pool)
            if group is None:
                out[pool] = [key]
            else:
                group.append(key)
        return out

    # --- the key -> ChunkStatus map ----------------------------------------------------------------
    def get(self, key: bytes) -> ChunkStatus | None:
        pool = self._owner.get(key)
        if pool is None:
            return None
        policy = self._pools[pool]
        return None if policy is None else policy.get(key)

    def __len__(self) -> int:
        return len(self._owner)

    def insert(self, key: bytes, chunk: ChunkStatus, req_context: RequestContext | None) -> None:
        if key in self._owner:  # precondition says absent; a re-insert replaces cleanly
            self.remove(key)
        pool = self.quotas.pool_of_request(req_context)
        self._pool(pool).insert(key, chunk, req_context)
        self._owner[key] = pool
        self.quotas.charge(pool, self.chunk_bytes)
        if chunk.ref_cnt == 0:
            self._evictable[pool] += 1

    def remove(self, key: bytes) -> None:
        pool = self._owner.pop(key, None)
        if pool is None:
            return
        policy = self._pool(pool)
        chunk = policy.get(key)
        if chunk is not None and chunk.ref_cnt == 0:
            self._evictable[pool] -= 1
        policy.remove(key)
        self.quotas.discharge(pool, self.chunk_bytes)

    def clear(self) -> None:
        for policy in self._pools:
            if policy is not None:
                policy.clear()
        self._owner.clear()
        self._evictable = [0] * len(self.quotas)
        self.quotas.reset()

    # --- evictability ------------------------------------------------------------------------------
    def mark_evictable(self, key: bytes) -> None:
        pool = self._owner.get(key)
        if pool is not None:
            self._evictable[pool] += 1
            self._pool(pool).mark_evictable(key)

    def mark_non_evictable(self, key: bytes) -> None:
        pool = self._owner.get(key)
        if pool is not None:
            self._evictable[pool] -= 1
            self._pool(pool).mark_non_evictable(key)

    # --- recency -----------------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        for pool, group in self._split(keys, req_context).items():
            self._pool(pool).touch(group, req_context)

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        for pool, group in self._split(keys, req_context).items():
            self._pool(pool).on_store_miss(group, req_context)

    def on_request_access(self, keys: Sequence[bytes], req_context: RequestContext | None) -> None:
        for pool, group in self._split(keys, req_context).items():
            self._pool(pool).on_request_access(group, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: Collection[bytes],
        reused_keys: Collection[bytes],
        req_context: RequestContext | None,
    ) -> None:
        """Each pool hears about its resident keys only (the request's other keys are gone)."""
        by_pool: dict[int, list[list[bytes]]] = {}
        owner = self._owner
        for group_index, group in enumerate(key_groups):
            for key in group:
                pool = owner.get(key)
                if pool is None:
                    continue
                groups = by_pool.get(pool)
                if groups is None:
                    groups = by_pool[pool] = [[] for _ in key_groups]
                groups[group_index].append(key)
        for pool, groups in by_pool.items():
            self._pool(pool).on_request_finished([g for g in groups if g], insertion_only_keys, reused_keys,
                                                  req_context)

    # --- eviction ----------------------------------------------------------------------------------
    def eligible(self, protected: Collection[bytes]) -> list[int]:
        """Per pool: chunks that may be evicted now (ready, unpinned, not in ``protected``)."""
        counts = list(self._evictable)
        owner = self._owner
        for key in protected:
            pool = owner.get(key)
            if pool is not None:
                chunk = self._pool(pool).get(key)
                if chunk is not None and chunk.ref_cnt == 0:
                    counts[pool] -= 1
        return counts

    def plan(self, n: int, donors: Sequence[tuple[int, int | None]], eligible: list[int]) -> list[tuple[int, int]] | None:
        """``(pool, chunks)`` to evict, ``n`` in all, following ``donors`` (pool, at most this many
        bytes or None) over the ``eligible`` counts; None when they cannot supply ``n``."""
        left = n
        taken = [0] * len(eligible)
        out: list[tuple[int, int]] = []
        for pool, cap in donors:
            if left <= 0:
                break
            available = eligible[pool] - taken[pool]
            if cap is not None:
                available = min(available, -(-cap // self.chunk_bytes) - taken[pool])
            k = min(available, left)
            if k > 0:
                out.append((pool, k))
                taken[pool] += k
                left -= k
        return out if left <= 0 else None

    def evict_planned(self, plan: Sequence[tuple[int, int]],
                      protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]]:
        """Evict what :meth:`plan` chose, each pool its least recently used first; the victims.

        Fewer victims than planned only if an inner policy refuses a count its own bookkeeping
        promised (a custom policy's inconsistency); every victim returned has left the cache.
        """
        victims: list[tuple[bytes, ChunkStatus]] = []
        quotas, owner = self.quotas, self._owner
        for pool, k in plan:
            chosen = self._pool(pool).evict(k, protected)
            if chosen is None:
                break
            for key, _ in chosen:
                del owner[key]
            self._evictable[pool] -= len(chosen)
            quotas.discharge(pool, len(chosen) * self.chunk_bytes)
            quotas.count_evictions(pool, len(chosen))
            victims.extend(chosen)
        return victims

    def evict(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """The base contract over all pools: atomic, in the donor order of
        :meth:`TenantQuotas.donors` (over-budget pools, unlimited pools, the fullest)."""
        if n <= 0:
            return []
        plan = self.plan(n, self.quotas.donors(-1), self.eligible(protected))
        if plan is None:
            return None
        return self.evict_planned(plan, protected)

"""Tenant byte budgets on one tier: how many bytes each tenant holds, and whose chunks make room.

A tier with tenant budgets (host memory: ``tenant_cpu_bytes``; an fs tier: ``tenant_bytes``)
charges every resident chunk to one *pool*: the tenant label of the request that stored it when
the budget map names that label, else the shared ``"default"`` pool (requests without a tenant,
and every label the map does not name). A chunk two requests store is charged to the first; a
chunk a tier finds without a request (an fs start-up scan, another process's file) is charged to
``"default"``.

The rules every tier with budgets applies through :class:`TenantQuotas`:

* **A budget is a cap.** Storing for pool ``T`` bytes that would take ``T`` past its budget first
  evicts ``T``'s own least recently used idle chunks (:meth:`TenantQuotas.own_excess` bytes of
  them), never anyone else's; what ``T`` cannot make room for is refused (not an error; counted
  per pool; host memory refuses only what exceeds the whole budget and otherwise waits for ``T``'s
  busy chunks, as a full tier waits). A pool the map gives no budget (``"default"`` unless
  named) has no cap.
* **A full tier takes room from** the pools :meth:`TenantQuotas.donors` lists, in order: pools
  over their budget (a tier can find more than a budget at start-up), down to their budget; then
  pools without a budget; then — only when the budgets add up to more than the tier holds — the
  budgeted pools, fullest relative to its budget first, each its least recently used first.

So a pool under its budget never loses a chunk to make room for one over its budget, and while
the budgets fit in the tier, it never loses one to another pool at all.

Metric label values are the configured labels plus ``"default"`` (:data:`MAX_TENANTS` + 1 at
most), whatever labels requests send. A ``cache_salt`` is a secret, never a tenant label: nothing
here ever sees one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.config.schema import DEFAULT_TENANT, MAX_TENANTS, TENANT_LABEL_RE

if TYPE_CHECKING:
    from kvtier.context import RequestContext
    from kvtier.stats import MetricFamily

__all__ = ["TenantQuotas", "TenantStatistics", "TenantFamilies", "TENANT_METRICS", "DEFAULT_POOL"]

#: The pool index of ``"default"``.
DEFAULT_POOL = 0

#: The per-tenant metrics, ``name -> (kind, documentation)``; exported as ``kvtier_tier_<name>``
#: with the labels ``tier`` and ``tenant``, for the host tier (``tier="0:primary"``) and each fs tier.
TENANT_METRICS: Mapping[str, tuple[str, str]] = {
    "tenant_bytes_used": ("gauge", "Bytes of resident chunks charged to each tenant pool (tiers with tenant budgets)."),
    "tenant_budget_bytes": ("gauge", "Byte budget of each tenant pool (absent: the pool is unlimited)."),
    "tenant_evictions": ("counter", "Chunks of each tenant pool evicted from the tier."),
    "tenant_refused_stores": ("counter", "Chunks not stored because their tenant pool was at its budget "
                                         "and could not evict enough of its own chunks."),
}


@dataclass(frozen=True, slots=True)
class TenantStatistics:
    """A snapshot of one tier's pools, co-indexed with ``labels`` (``"default"`` first)."""

    labels: tuple[str, ...]
    budget_bytes: tuple[int | None, ...]
    bytes_used: tuple[int, ...]
    evictions: tuple[int, ...]
    refused_stores: tuple[int, ...]


class TenantFamilies:
    """The per-tenant metric families of a secondary tier, declared through its ``add_metric``
    (label ``tenant``); :class:`TenantQuotas` keeps them current as it counts."""

    def __init__(self, add_metric: Callable[[str, str, str, Sequence[str]], MetricFamily]) -> None:
        def declare(name: str) -> MetricFamily:
            kind, doc = TENANT_METRICS[name]
            return add_metric(name, kind, doc, ("tenant",))

        self.bytes_used = declare("tenant_bytes_used")
        self.budget_bytes = declare("tenant_budget_bytes")
        self.evictions = declare("tenant_evictions")
        self.refused_stores = declare("tenant_refused_stores")


class TenantQuotas:
    """The pools of one tier: budget, bytes charged and counters per pool (see the module docstring).

    ``budgets`` maps tenant labels (and optionally ``"default"``) to byte budgets > 0. Pools are
    numbered: ``"default"`` is :data:`DEFAULT_POOL`, the other labels follow in sorted order. The
    tier does the evicting; this class says how much and from whom, and counts. Not thread-safe:
    used from the tier's own (event-loop) thread.
    """

    def __init__(self, budgets: Mapping[str, int], families: TenantFamilies | None = None) -> None:
        if len(budgets) > MAX_TENANTS:
            raise ValueError(f"at most {MAX_TENANTS} tenant labels per budget map, got {len(budgets)}")
        for label, budget in budgets.items():
            if not isinstance(label, str) or not TENANT_LABEL_RE.match(label):
                raise ValueError("a tenant label is 1 to 32 lower-case letters, digits, '_', '.' or '-'")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                raise ValueError(f"the budget of tenant {label!r} must be an integer > 0, got {budget!r}")
        self.labels: tuple[str, ...] = (DEFAULT_TENANT, *sorted(k for k in budgets if k != DEFAULT_TENANT))
        self._pools = {label: i for i, label in enumerate(self.labels)}
        self.budgets: tuple[int | None, ...] = tuple(budgets.get(label) for label in self.labels)
        self.used = [0] * len(self.labels)
        self.evictions = [0] * len(self.labels)
        self.refused = [0] * len(self.labels)
        self._families = families
        if families is not None:
            for label, limit in zip(self.labels, self.budgets):
                families.bytes_used.set(0, label)
                families.evictions.values[(label,)] = 0.0
                families.refused_stores.values[(label,)] = 0.0
                if limit is not None:
                    families.budget_bytes.set(limit, label)

    def __len__(self) -> int:
        return len(self.labels)

    # --- pools -----------------------------------------------------------------------------------
    def pool_of(self, tenant: str | None) -> int:
        """The pool of a tenant label: its own when the budget map names it, else ``"default"``."""
        return DEFAULT_POOL if tenant is None else self._pools.get(tenant, DEFAULT_POOL)

    def pool_of_request(self, ctx: RequestContext | None) -> int:
        """The pool a request's stores are charged to (no request: ``"default"``)."""
        return DEFAULT_POOL if ctx is None else self.pool_of(ctx.tenant)

    # --- accounting ------------------------------------------------------------------------------
    def charge(self, pool: int, nbytes: int) -> None:
        self.used[pool] += nbytes
        if self._families is not None:
            self._families.bytes_used.set(self.used[pool], self.labels[pool])

    def discharge(self, pool: int, nbytes: int) -> None:
        self.charge(pool, -nbytes)

    def reset(self) -> None:
        """Every pool holds nothing (the tier dropped all its chunks); counters are kept."""
        for pool in range(len(self.labels)):
            if self.used[pool]:
                self.charge(pool, -self.used[pool])

    def count_evictions(self, pool: int, chunks: int = 1) -> None:
        self.evictions[pool] += chunks
        if self._families is not None:
            self._families.evictions.inc(chunks, self.labels[pool])

    def count_refused(self, pool: int, chunks: int = 1) -> None:
        self.refused[pool] += chunks
        if self._families is not None:
            self._families.refused_stores.inc(chunks, self.labels[pool])

    # --- decisions -------------------------------------------------------------------------------
    def over_budget(self, pool: int) -> bool:
        """Whether ``pool`` holds more than its budget (never true of a pool without one)."""
        budget = self.budgets[pool]
        return budget is not None and self.used[pool] > budget

    def own_excess(self, pool: int, nbytes: int) -> int:
        """Bytes ``pool`` must evict of its own chunks before it may add ``nbytes`` (0: it fits)."""
        budget = self.budgets[pool]
        return 0 if budget is None else max(0, self.used[pool] + nbytes - budget)

    def donors(self, pool: int) -> list[tuple[int, int | None]]:
        """Where a full tier takes room for ``pool`` (once ``pool`` fits its own budget), in order:
        ``(pool, at most this many bytes)``, ``None`` meaning all its idle chunks.

        Pools over their budget (most over first, down to their budget), then pools without a
        budget, then every budgeted pool, the fullest relative to its budget first. A tier takes
        each entry's least recently used idle chunks until it has the room; a pool may appear
        twice (first capped, then not).
        """
        used, budgets = self.used, self.budgets
        over = [(used[p] - b, p) for p, b in enumerate(budgets) if b is not None and used[p] > b and p != pool]
        out: list[tuple[int, int | None]] = [(p, excess) for excess, p in sorted(over, reverse=True)]
        out.extend((p, None) for p, b in enumerate(budgets) if b is None)
        fullness = sorted(((used[p] / b, p) for p, b in enumerate(budgets) if b is not None), reverse=True)
        out.extend((p, None) for _, p in fullness)
        return out

    def statistics(self) -> TenantStatistics:
        return TenantStatistics(self.labels, self.budgets, tuple(self.used), tuple(self.evictions), tuple(self.refused))

    def __repr__(self) -> str:
        return f"TenantQuotas(pools={list(self.labels)!r})"

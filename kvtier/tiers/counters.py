"""The counters behind a secondary tier's statistics.

Every ``SecondaryTier`` owns one :class:`TierCounters`: the framework counts lookups, jobs,
failures and transferred bytes into it, the tier's own code counts evictions, usage and the
metrics it declares, and :meth:`TierCounters.snapshot` freezes all of it into a
:class:`TierStatistics` for ``kvtier.metrics``. Counters are only touched from the tier's
event-loop thread, so nothing here locks.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.stats import Histogram, HistogramSnapshot, MetricFamily

__all__ = ["EVICTION_AGE_BUCKETS", "TierCounters", "TierStatistics"]

#: Age of evicted chunks (seconds): from a minute to a day.
EVICTION_AGE_BUCKETS: tuple[float, ...] = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_METRIC_KINDS = frozenset({"counter", "gauge", "histogram"})
_DIRECTIONS = ("load", "store")
_OUTCOMES = ("success", "failure")


@dataclass(frozen=True)
class TierStatistics:
    """A consistent snapshot of one tier's counters (read by ``kvtier.metrics``)."""

    label: str
    tier_type: str
    lookups: int  # resolved lookups (HIT or MISS), as vLLM's chunk_queries
    hits: int
    bytes_read: int  # tier → host (promotions)
    bytes_written: int  # host → tier (cascades)
    seconds_read: float
    seconds_written: float
    loads_in_flight: int
    stores_in_flight: int
    queued_jobs: int
    loads_completed: int
    stores_completed: int
    failures: Mapping[tuple[str, str], int]  # (direction "load"|"store"|"lookup", reason) -> count
    rejected_jobs: int  # rejected at submit because the queue was full
    evictions: int
    eviction_age: HistogramSnapshot
    load_latency: Mapping[str, HistogramSnapshot]  # "success"/"failure" -> job creation → completion
    store_latency: Mapping[str, HistogramSnapshot]
    bytes_used: int | None
    capacity_bytes: int | None
    custom_metrics: tuple[MetricFamily, ...]


class TierCounters:
    """What one tier has done so far; ``direction`` is ``"load"`` (tier → host) or ``"store"``."""

    def __init__(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.seconds_read = 0.0
        self.seconds_written = 0.0
        self.jobs_running = {direction: 0 for direction in _DIRECTIONS}
        self.jobs_completed = {direction: 0 for direction in _DIRECTIONS}
        self.failures: dict[tuple[str, str], int] = {}
        self.rejected_jobs = 0
        self.evictions = 0
        self.eviction_age = Histogram(EVICTION_AGE_BUCKETS)
        #: (direction, "success"|"failure") -> seconds from job creation to its report.
        self.job_latency = {(direction, outcome): Histogram() for direction in _DIRECTIONS for outcome in _OUTCOMES}
        self.bytes_used: int | None = None
        self.capacity_bytes: int | None = None
        #: The tier-specific metric families, by name, in declaration order.
        self.metric_families: dict[str, MetricFamily] = {}

    def count_lookup(self, present: bool) -> None:
        """One resolved lookup (HIT when ``present``)."""
        self.lookups += 1
        self.hits += present

    def count_failure(self, direction: str, reason: str) -> None:
        """One failure of ``direction`` (``"load"``, ``"store"`` or ``"lookup"``) for ``reason``."""
        self.failures[(direction, reason)] = self.failures.get((direction, reason), 0) + 1

    def count_rejected(self) -> None:
        """One job rejected at submit because its queue was full."""
        self.rejected_jobs += 1

    def job_reported(self, direction: str, success: bool, reason: str | None, latency_s: float) -> None:
        """A job was reported ``latency_s`` after its creation; a failure counts under ``reason``
        (``"internal"`` when it has none)."""
        self.job_latency[(direction, "success" if success else "failure")].observe(max(0.0, latency_s))
        if success:
            self.jobs_completed[direction] += 1
        else:
            self.count_failure(direction, reason or "internal")

    def record_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """``nbytes`` moved in ``seconds``; anything but ``"load"`` counts as written."""
        if direction == "load":
            self.bytes_read += nbytes
            self.seconds_read += seconds
        else:
            self.bytes_written += nbytes
            self.seconds_written += seconds

    def record_eviction(self, age_s: float) -> None:
        """One chunk evicted ``age_s`` seconds after it was stored."""
        self.evictions += 1
        self.eviction_age.observe(max(0.0, age_s))

    def set_usage(self, bytes_used: int | None, capacity_bytes: int | None) -> None:
        """The tier's occupancy (None = not accounted)."""
        self.bytes_used = bytes_used
        self.capacity_bytes = capacity_bytes

    def add_metric(self, name: str, kind: str, documentation: str, labels: Sequence[str], owner: str) -> MetricFamily:
        """Declare the metric family ``name`` of the tier labelled ``owner`` and return it.

        ``ValueError`` for a name that is not a Prometheus metric name, a kind other than
        counter/gauge/histogram, or a name already declared here.
        """
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        if kind not in _METRIC_KINDS:
            raise ValueError(f"metric kind must be one of {sorted(_METRIC_KINDS)}, got {kind!r}")
        if name in self.metric_families:
            raise ValueError(f"metric {name!r} is already declared by tier {owner}")
        family = MetricFamily(name, kind, documentation, tuple(labels))
        self.metric_families[name] = family
        return family

    def move_metrics_to(self, outer: TierCounters, outer_label: str) -> None:
        """Hand every declared metric family to ``outer`` (the tier labelled ``outer_label``).

        Families move one by one in declaration order; ``ValueError`` at the first name ``outer``
        already declares, and then this tier still declares all of its families (the ones before
        that name are declared by both).
        """
        for family in self.metric_families.values():
            if family.name in outer.metric_families:
                raise ValueError(f"metric {family.name!r} is already declared by tier {outer_label}")
            outer.metric_families[family.name] = family
        self.metric_families = {}

    def snapshot(self, label: str, tier_type: str, queued_jobs: int) -> TierStatistics:
        """A frozen copy of the counters; later activity does not change it."""
        return TierStatistics(
            label=label,
            tier_type=tier_type,
            lookups=self.lookups,
            hits=self.hits,
            bytes_read=self.bytes_read,
            bytes_written=self.bytes_written,
            seconds_read=self.seconds_read,
            seconds_written=self.seconds_written,
            loads_in_flight=self.jobs_running["load"],
            stores_in_flight=self.jobs_running["store"],
            queued_jobs=queued_jobs,
            loads_completed=self.jobs_completed["load"],
            stores_completed=self.jobs_completed["store"],
            failures=types.MappingProxyType(dict(self.failures)),
            rejected_jobs=self.rejected_jobs,
            evictions=self.evictions,
            eviction_age=self.eviction_age.snapshot(),
            load_latency=types.MappingProxyType({
                outcome: self.job_latency[("load", outcome)].snapshot() for outcome in _OUTCOMES
            }),
            store_latency=types.MappingProxyType({
                outcome: self.job_latency[("store", outcome)].snapshot() for outcome in _OUTCOMES
            }),
            bytes_used=self.bytes_used,
            capacity_bytes=self.capacity_bytes,
            custom_metrics=tuple(copy.deepcopy(list(self.metric_families.values()))),
        )

"""Plain, dependency-free statistics primitives.

Tiers, the host tier and the manager count what happens with these; ``kvtier.metrics`` reads
them at scrape time and exports them to Prometheus. Keeping the counting side free of
prometheus-client means a component can be tested (and used) without any registry, and two
engines in one process never share a counter.

All methods are called from the engine's event-loop thread except where noted; the values are
plain Python numbers, so a scrape from another thread reads a consistent-enough snapshot (a
torn read of two counters is acceptable for monitoring).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Histogram", "HistogramSnapshot", "MetricFamily", "LATENCY_BUCKETS", "SIZE_BUCKETS"]

#: Job latency buckets (seconds), as vLLM's promotion latency histogram.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
#: Transfer size buckets (bytes), as vLLM's ``kv_offload_load_size``.
SIZE_BUCKETS: tuple[float, ...] = (1e6, 5e6, 1e7, 2e7, 4e7, 6e7, 8e7, 1e8, 1.5e8, 2e8)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    buckets: tuple[float, ...]
    counts: tuple[int, ...]  # non-cumulative, one per bucket plus the +Inf overflow
    total: float
    count: int


class Histogram:
    """A fixed-bucket histogram (``le`` upper bounds, +Inf implied)."""

    __slots__ = ("buckets", "_counts", "_sum", "_count")

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, tuple(self._counts), self._sum, self._count)


@dataclass(slots=True)
class MetricFamily:
    """A metric a component declares for itself (exported automatically by ``kvtier.metrics``).

    ``kind`` is ``"counter"``, ``"gauge"`` or ``"histogram"``. ``values`` maps a tuple of label
    values (co-indexed with ``labels``) to a number (counter/gauge) or a :class:`Histogram`.
    Counters only ever grow.
    """

    name: str
    kind: str
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    values: dict[tuple[str, ...], object] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, *label_values: str) -> None:
        assert self.kind == "counter" and amount >= 0
        self.values[label_values] = float(self.values.get(label_values, 0.0)) + amount  # type: ignore[arg-type]

    def set(self, value: float, *label_values: str) -> None:
        assert self.kind == "gauge"
        self.values[label_values] = float(value)

    def observe(self, value: float, *label_values: str) -> None:
        assert self.kind == "histogram"
        hist = self.values.get(label_values)
        if not isinstance(hist, Histogram):
            hist = self.values[label_values] = Histogram(self.buckets)
        hist.observe(value)

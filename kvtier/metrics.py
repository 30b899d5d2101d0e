"""Prometheus export of kvtier's statistics snapshots; one registry per engine.

Components count with plain numbers (``kvtier.stats``) and expose ``statistics()`` snapshots;
nothing on the serving path touches prometheus-client. At scrape time a custom collector calls
every registered source's ``statistics()`` and yields metric families, so a scrape costs the
engine nothing between scrapes and two engines in one process never share a series (each
:class:`EngineMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`).

Naming: a metric vLLM also has keeps vLLM's name with ``vllm:`` replaced by ``kvtier_``
(``vllm:kv_offload_tiering_chunk_queries`` ↦ ``kvtier_kv_offload_tiering_chunk_queries``), so
dashboards port with a prefix change. kvtier-only metrics are ``kvtier_tier_*`` (per tier, label
``tier``), ``kvtier_host_*``, ``kvtier_events_*`` and the warm-up's ``kvtier_prefetch*``.
Counters are exported from cumulative values (``_total`` suffix on the wire). The ``tier`` label
is ``0:primary`` for the host tier and the tier's label (``1:fs``) for secondary tiers. ``docs/metrics.md`` lists every metric.

Sources are duck-typed: the collector reads snapshot attributes by name, so the snapshot classes
(``HostStatistics``, ``TierStatistics``, ``ManagerStatistics``, ``CopyStatistics``,
``PublisherStatistics``, ``PrefetchStatistics``) stay owned by their modules.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from kvtier.policies.quotas import TENANT_METRICS
from kvtier.stats import Histogram, HistogramSnapshot, MetricFamily

__all__ = ["EngineMetrics", "MetricsServer", "serve_metrics", "PRIMARY_TIER_LABEL"]

logger = logging.getLogger(__name__)

#: The ``tier`` label of the host (primary) tier, as in vLLM.
PRIMARY_TIER_LABEL = "0:primary"

_VALID_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: Built-in per-tier families; a tier-declared metric may not reuse these names.
_BUILTIN_TIER_NAMES = frozenset(
    f"kvtier_tier_{n}"
    for n in (
        "info", "loads_in_flight", "stores_in_flight", "queued_jobs", "failures", "rejected", "evictions",
        "loads_completed", "stores_completed", "eviction_age_seconds", "load_latency_seconds", "store_latency_seconds",
        "bytes_used",
        "capacity_bytes", "fill_ratio", "backpressure_active",
    )
)


class StatisticsSource(Protocol):
    def statistics(self) -> Any: ...


_MISSING = object()


def _field(snapshot: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first attribute of ``names`` the snapshot has (the brief's name, then the module's)."""
    for name in names:
        value = getattr(snapshot, name, _MISSING)
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise AttributeError(f"{type(snapshot).__name__} has none of {names}")
    return default


def _histogram_buckets(snap: HistogramSnapshot) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``le`` buckets from a snapshot's per-bucket counts."""
    out: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(snap.buckets, snap.counts):
        cumulative += count
        out.append((floatToGoString(bound), cumulative))
    # The last count is the +Inf overflow; +Inf equals the total count by definition.
    out.append(("+Inf", snap.count))
    return out


class _Families:
    """Families of one scrape, created on first use so that each name appears exactly once."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = CounterMetricFamily(name, doc, labels=list(labels))
        return fam  # type: ignore[return-value]

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        return fam  # type: ignore[return-value]

    def histogram(self, name: str, doc: str, labels: Iterable[str] = ()) -> HistogramMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = HistogramMetricFamily(name, doc, labels=list(labels))
        return fam  # type: ignore[return-value]

    def add_histogram(self, name: str, doc: str, labels: list[str], values: list[str], snap: Any) -> None:
        if snap is None:
            return
        self.histogram(name, doc, labels).add_metric(values, _histogram_buckets(snap), snap.total)

    def get(self, name: str) -> Metric | None:
        return self._families.get(name)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


# Doc strings shared by the host tier and the secondary tiers (same family, different label value).
_DOC = {
    "queries": "Resolved chunk lookups per tier.",
    "hits": "Chunk lookups that hit, per tier.",
    "evictions": "Chunks evicted from a tier.",
    "eviction_age": "Seconds between storing a chunk and evicting it.",
}


class _Collector:
    """Reads the sources of one :class:`EngineMetrics` at scrape time."""

    def __init__(self, owner: EngineMetrics) -> None:
        self._owner = owner
        self._warned: set[str] = set()

    def describe(self) -> list[Metric]:
        # Nothing to pre-declare: names depend on the sources present at scrape time.
        return []

    def collect(self) -> Iterator[Metric]:
        fams = _Families()
        o = self._owner
        for kind, sources, export in (
            ("host", o._hosts, self._host),
            ("manager", o._managers, self._manager),
            ("copies", o._copies, self._copy),
            ("tier", o._tiers, self._tier),
            ("publisher", o._publishers, self._publisher),
            ("prefetch", o._prefetches, self._prefetch),
            ("warmup", o._warmups, self._warmup),
            ("loads", o._loads, self._loads),
        ):
            for source in list(sources):
                try:
                    export(fams, source.statistics())
                except Exception:
                    # One broken source must not take the whole scrape down; say so once.
                    if kind not in self._warned:
                        self._warned.add(kind)
                        logger.exception("kvtier metrics: reading %s statistics failed", kind)
        yield from fams

    # -- host tier --------------------------------------------------------------------------

    def _host(self, f: _Families, s: Any) -> None:
        t = [PRIMARY_TIER_LABEL]
        num_slots = int(s.num_slots)
        f.gauge("kvtier_host_slots", "Host slots (chunks) in the primary tier.").add_metric([], num_slots)
        f.gauge("kvtier_host_slot_bytes", "Bytes of one host slot.").add_metric([], s.slot_bytes)
        f.gauge("kvtier_host_used_slots", "Host slots holding a chunk (ready or being written).").add_metric(
            [], s.used_slots
        )
        f.gauge("kvtier_host_pinned_slots", "Host slots that cannot be evicted now.").add_metric([], s.pinned_slots)
        f.gauge("kvtier_host_evictable_slots", "Host slots holding an evictable chunk.").add_metric([], s.evictable)
        f.gauge("kvtier_host_write_pending_slots", "Host slots whose write is in flight.").add_metric(
            [], s.write_pending
        )
        denom = max(num_slots, 1)
        f.gauge("kvtier_host_fill_ratio", "Used host slots / host slots.").add_metric([], s.used_slots / denom)
        f.gauge("kvtier_host_pinned_ratio", "Pinned host slots / host slots.").add_metric([], s.pinned_slots / denom)
        # vLLM's CPU usage gauges: pinned = pending writes + in-flight reads.
        f.gauge(
            "kvtier_kv_offload_cpu_cache_usage_perc", "Fraction of host slots pinned (pending writes + reads)."
        ).add_metric([], s.pinned_slots / denom)
        f.gauge("kvtier_kv_offload_cpu_cache_write_usage_perc", "Fraction of host slots with a pending write.").add_metric(
            [], s.write_pending / denom
        )
        f.gauge("kvtier_kv_offload_cpu_cache_read_usage_perc", "Fraction of host slots pinned by readers.").add_metric(
            [], max(s.pinned_slots - s.write_pending, 0) / denom
        )
        f.counter("kvtier_kv_offload_stores_skipped", "Stores skipped by the store threshold.").add_metric(
            [], s.stores_skipped
        )
        f.counter("kvtier_host_allocation_failures", "Host prepare_store calls that could not allocate.").add_metric(
            [], s.allocation_failures
        )
        f.add_histogram(
            "kvtier_kv_offload_cpu_allocation_size", "Chunks requested per host prepare_store.", [], [],
            s.allocation_sizes,
        )
        f.counter("kvtier_tier_evictions", _DOC["evictions"], ["tier"]).add_metric(t, s.evictions)
        f.add_histogram("kvtier_tier_eviction_age_seconds", _DOC["eviction_age"], ["tier"], t, s.eviction_age)
        tenants = _field(s, "tenants", default=None)
        if tenants is not None:
            self._tenants(f, PRIMARY_TIER_LABEL, tenants)

    def _tenants(self, f: _Families, tier: str, s: Any) -> None:
        """Per tenant pool (``TenantStatistics``): the same families an fs tier declares itself, so
        both tiers' series share ``kvtier_tier_tenant_*`` with labels ``tier`` and ``tenant``."""
        labels = ["tier", "tenant"]
        for name, attr in (("tenant_bytes_used", "bytes_used"), ("tenant_budget_bytes", "budget_bytes"),
                           ("tenant_evictions", "evictions"), ("tenant_refused_stores", "refused_stores")):
            kind, doc = TENANT_METRICS[name]
            family = (f.counter if kind == "counter" else f.gauge)(f"kvtier_tier_{name}", doc, labels)
            for tenant, value in zip(s.labels, getattr(s, attr)):
                if value is not None:
                    family.add_metric([tier, tenant], value)

    # -- manager ----------------------------------------------------------------------------

    def _manager(self, f: _Families, s: Any) -> None:
        t = [PRIMARY_TIER_LABEL]
        f.counter("kvtier_kv_offload_tiering_chunk_queries", _DOC["queries"], ["tier"]).add_metric(t, s.primary_lookups)
        f.counter("kvtier_kv_offload_tiering_chunk_hits", _DOC["hits"], ["tier"]).add_metric(t, s.primary_hits)
        f.counter(
            "kvtier_kv_offload_tiering_promotion_allocation_failures",
            "Promotions that could not allocate a primary slot.",
        ).add_metric([], s.promotion_allocation_failures)
        f.counter("kvtier_kv_offload_allocation_failure", "Manager prepare_store calls that returned None.").add_metric(
            [], s.store_allocation_failures
        )
        for name, doc, attr, make in (
            ("kvtier_kv_offload_tiering_active_promotion_jobs", "Promotion jobs in flight.", "active_promotion_jobs", f.gauge),
            ("kvtier_kv_offload_tiering_active_cascade_jobs", "Cascade jobs in flight.", "active_cascade_jobs", f.gauge),
            ("kvtier_kv_offload_tiering_promotion_job_failures", "Failed promotion jobs.", "promotion_job_failures", f.counter),
            ("kvtier_kv_offload_tiering_cascade_job_failures", "Failed cascade jobs.", "cascade_job_failures", f.counter),
        ):
            fam = make(name, doc, ["tier"])
            for label, value in sorted(dict(getattr(s, attr)).items()):
                fam.add_metric([label], value)
        latency = "kvtier_kv_offload_tiering_promotion_latency_seconds"
        f.histogram(latency, "Promotion job creation to completion, by result.", ["tier", "result"])
        for label, by_result in sorted(dict(s.promotion_latency).items()):
            for result, snap in sorted(dict(by_result).items()):
                f.add_histogram(latency, "", ["tier", "result"], [label, result], snap)
        cascades = _field(s, "cascade_latency", default=None)
        if cascades is not None:  # kvtier extension: the same measure for cascades
            latency = "kvtier_kv_offload_tiering_cascade_latency_seconds"
            f.histogram(latency, "Cascade job creation to completion, by result.", ["tier", "result"])
            for label, by_result in sorted(dict(cascades).items()):
                for result, snap in sorted(dict(by_result).items()):
                    f.add_histogram(latency, "", ["tier", "result"], [label, result], snap)
        # Back-pressure: series only for tiers that have a detector.
        for name, doc, attr, make in (
            ("kvtier_kv_offload_tiering_backpressure_stores_dropped", "Store jobs shed by back-pressure.",
             "backpressure_stores_dropped", f.counter),
            ("kvtier_kv_offload_tiering_backpressure_blocks_dropped", "Chunks of the store jobs shed by back-pressure.",
             "backpressure_blocks_dropped", f.counter),
            ("kvtier_kv_offload_tiering_backpressure_store_latency_ema",
             "Back-pressure store latency EMA (seconds per MiB).", "backpressure_store_latency_ema", f.gauge),
            ("kvtier_tier_backpressure_active", "1 while back-pressure sheds stores to the tier, else 0.",
             "backpressure_active", f.gauge),
        ):
            values = _field(s, attr, default=None)
            if not values:
                continue
            fam = make(name, doc, ["tier"])
            for label, value in sorted(dict(values).items()):
                fam.add_metric([label], float(value))
        policies = _field(s, "write_policies", default=None)
        if policies:
            self._write_policies(f, dict(policies))

    def _write_policies(self, f: _Families, policies: dict[str, Any]) -> None:
        info = f.gauge("kvtier_tier_write_policy_info", "1 for the write policy of each secondary tier.",
                       ["tier", "policy"])
        written = f.counter("kvtier_tier_write_policy_chunks_written",
                            "Chunks written to the tier, by the policy that wrote them.", ["tier", "policy"])
        dirty = f.gauge("kvtier_tier_write_back_dirty_chunks",
                        "Chunks in host memory not yet written to a write-back tier.", ["tier"])
        started = f.counter("kvtier_tier_write_backs_started", "Write-backs started, by cause.", ["tier", "cause"])
        unwritten = f.counter("kvtier_tier_write_backs_unwritten",
                              "Write-backs that left the chunk out of the tier, by reason.", ["tier", "reason"])
        waiting = f.gauge("kvtier_tier_selective_unwritten_chunks",
                          "Chunks in host memory hit fewer than min_hits times (not yet written to a selective tier).",
                          ["tier"])
        evicted = f.counter("kvtier_tier_selective_evicted_unwritten",
                            "Chunks that left host memory before a selective tier received them.", ["tier"])
        for label, w in sorted(policies.items()):
            info.add_metric([label, w.policy], 1)
            for policy, count in (("write_through", w.chunks_written_through), ("write_back", w.chunks_written_back),
                                  ("selective", w.chunks_written_selective)):
                written.add_metric([label, policy], count)
            if w.policy == "write_back":
                dirty.add_metric([label], w.dirty_chunks)
                started.add_metric([label, "evict"], w.write_backs_evict)
                started.add_metric([label, "flush"], w.write_backs_flush)
                for reason in ("failed", "skipped", "dropped"):
                    unwritten.add_metric([label, reason], getattr(w, f"write_backs_{reason}"))
            if w.policy == "selective":
                waiting.add_metric([label], w.selective_unwritten)
                evicted.add_metric([label], w.selective_evicted_unwritten)

    # -- device copies ----------------------------------------------------------------------

    def _copy(self, f: _Families, s: Any) -> None:
        f.counter("kvtier_kv_offload_load_bytes", "Bytes copied host → device.").add_metric([], s.bytes_to_device)
        f.counter("kvtier_kv_offload_store_bytes", "Bytes copied device → host.").add_metric([], s.bytes_to_host)
        f.counter("kvtier_kv_offload_load_time", "Seconds spent copying host → device.").add_metric(
            [], s.seconds_to_device
        )
        f.counter("kvtier_kv_offload_store_time", "Seconds spent copying device → host.").add_metric(
            [], s.seconds_to_host
        )
        f.add_histogram("kvtier_kv_offload_load_size", "Bytes per host → device copy job.", [], [], s.load_size)
        f.add_histogram("kvtier_kv_offload_store_size", "Bytes per device → host copy job.", [], [], s.store_size)
        failures = _field(s, "failures", default=None)
        if failures is not None:
            f.counter("kvtier_copy_failures", "Device ↔ host copy jobs that failed.").add_metric([], failures)

    # -- secondary tiers --------------------------------------------------------------------

    def _tier(self, f: _Families, s: Any) -> None:
        label = str(s.label)
        t = [label]
        f.gauge("kvtier_tier_info", "Secondary tier present (value 1), with its type.", ["tier", "type"]).add_metric(
            [label, str(s.tier_type)], 1
        )
        f.counter("kvtier_kv_offload_tiering_chunk_queries", _DOC["queries"], ["tier"]).add_metric(t, s.lookups)
        f.counter("kvtier_kv_offload_tiering_chunk_hits", _DOC["hits"], ["tier"]).add_metric(t, s.hits)
        f.counter("kvtier_kv_offload_tiering_read_bytes", "Bytes read from the tier (promotions).", ["tier"]).add_metric(
            t, s.bytes_read
        )
        f.counter("kvtier_kv_offload_tiering_read_time", "Seconds reading from the tier.", ["tier"]).add_metric(
            t, s.seconds_read
        )
        f.counter(
            "kvtier_kv_offload_tiering_write_bytes", "Bytes written to the tier (cascades).", ["tier"]
        ).add_metric(t, s.bytes_written)
        f.counter("kvtier_kv_offload_tiering_write_time", "Seconds writing to the tier.", ["tier"]).add_metric(
            t, s.seconds_written
        )
        f.gauge("kvtier_tier_loads_in_flight", "Load jobs the tier is running.", ["tier"]).add_metric(
            t, s.loads_in_flight
        )
        f.gauge("kvtier_tier_stores_in_flight", "Store jobs the tier is running.", ["tier"]).add_metric(
            t, s.stores_in_flight
        )
        f.gauge("kvtier_tier_queued_jobs", "Jobs submitted to the tier and not started.", ["tier"]).add_metric(
            t, _field(s, "queued_jobs", "queued")
        )
        for direction in ("load", "store"):
            completed = _field(s, f"{direction}s_completed", default=None)
            if completed is not None:
                f.counter(f"kvtier_tier_{direction}s_completed", f"{direction.capitalize()} jobs the tier finished.",
                          ["tier"]).add_metric(t, completed)
        failures = f.counter("kvtier_tier_failures", "Failed jobs (and failed lookups) by direction and reason.",
                             ["tier", "direction", "reason"])
        for (direction, reason), count in sorted(dict(s.failures).items()):
            failures.add_metric([label, str(direction), str(reason)], count)
        f.counter("kvtier_tier_rejected",
                  "Jobs the tier refused without trying because its queue was full (also failures, reason queue_full).",
                  ["tier"]).add_metric(t, _field(s, "rejected_jobs", "rejected"))
        f.counter("kvtier_tier_evictions", _DOC["evictions"], ["tier"]).add_metric(t, s.evictions)
        f.add_histogram("kvtier_tier_eviction_age_seconds", _DOC["eviction_age"], ["tier"], t, s.eviction_age)
        for direction, attr in (("load", "load_latency"), ("store", "store_latency")):
            name = f"kvtier_tier_{direction}_latency_seconds"
            f.histogram(name, f"{direction.capitalize()} job latency inside the tier, by result.", ["tier", "result"])
            for result, snap in sorted(dict(getattr(s, attr)).items()):
                f.add_histogram(name, "", ["tier", "result"], [label, str(result)], snap)
        if s.bytes_used is not None:
            f.gauge("kvtier_tier_bytes_used", "Bytes the tier holds (tiers that account usage).",
                    ["tier"]).add_metric(t, s.bytes_used)
        if s.capacity_bytes is not None and s.bytes_used is not None:
            f.gauge("kvtier_tier_capacity_bytes", "Bytes the tier may hold (bounded tiers only).",
                    ["tier"]).add_metric(t, s.capacity_bytes)
            f.gauge("kvtier_tier_fill_ratio", "Bytes used / capacity (bounded tiers only).", ["tier"]).add_metric(
                t, s.bytes_used / s.capacity_bytes if s.capacity_bytes > 0 else 0.0
            )
        for family in _field(s, "custom_metrics", "custom", default=()) or ():
            self._custom(f, label, family)

    def _custom(self, f: _Families, label: str, family: MetricFamily) -> None:
        """A tier-declared family, exported as ``kvtier_tier_<name>`` with ``tier`` prepended."""
        name = f"kvtier_tier_{family.name}"
        labels = ["tier", *family.labels]
        # Same-named families of two tiers merge; a clash with a different shape is skipped.
        if not _VALID_NAME.match(family.name) or family.kind not in ("counter", "gauge", "histogram"):
            self._warn_once(name, "invalid name or kind")
            return
        if name in _BUILTIN_TIER_NAMES:
            self._warn_once(name, "reuses a built-in metric name")
            return
        existing = f.get(name)
        if existing is not None and (existing.type != family.kind or _labels_of(existing) != labels):
            self._warn_once(name, "clashes with another metric of that name")
            return
        values = dict(family.values)  # one C-level copy: the loop thread may be adding labels
        for label_values, value in sorted(values.items()):
            full = [label, *map(str, label_values)]
            if family.kind == "counter":
                f.counter(name, family.documentation, labels).add_metric(full, float(value))  # type: ignore[arg-type]
            elif family.kind == "gauge":
                f.gauge(name, family.documentation, labels).add_metric(full, float(value))  # type: ignore[arg-type]
            else:
                snap = value.snapshot() if isinstance(value, Histogram) else value
                f.histogram(name, family.documentation, labels)
                f.add_histogram(name, family.documentation, labels, full, snap)
        if not values:  # declared but nothing recorded yet: still announce the family
            {"counter": f.counter, "gauge": f.gauge, "histogram": f.histogram}[family.kind](
                name, family.documentation, labels
            )

    def _warn_once(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("kvtier metrics: not exporting %s: %s", name, why)

    # -- event publisher --------------------------------------------------------------------

    def _publisher(self, f: _Families, s: Any) -> None:
        f.gauge("kvtier_events_queue_depth", "KV event batches waiting to be sent.").add_metric([], s.queue_depth)
        f.counter("kvtier_events_published_batches", "KV event batches sent.").add_metric([], s.published_batches)
        f.counter("kvtier_events_dropped_batches", "KV event batches dropped (queue full or closed).").add_metric(
            [], s.dropped_batches
        )
        f.gauge("kvtier_events_sequence", "Sequence number of the next KV event batch.").add_metric([], s.sequence)
        replays = f.counter("kvtier_events_replay_requests", "KV event replay requests, by outcome.", ["outcome"])
        replays.add_metric(["answered"], s.replay_requests)
        replays.add_metric(["refused"], s.replay_requests_refused)
        replays.add_metric(["malformed"], s.replay_requests_malformed)


    # -- warm-up (Engine.prefetch) -----------------------------------------------------------

    def _prefetch(self, f: _Families, s: Any) -> None:
        f.counter("kvtier_prefetch_requests", "Engine.prefetch calls.").add_metric([], s.requests)
        chunks = f.counter("kvtier_prefetched_chunks",
                           "Chunks prefetches promoted into host memory, by source tier.", ["tier"])
        for label, count in sorted(dict(s.chunks).items()):
            chunks.add_metric([label], count)
        f.counter("kvtier_prefetched_tokens",
                  "Prompt tokens prefetches made loadable from host memory.").add_metric([], s.tokens)
        f.counter("kvtier_prefetch_hits",
                  "Prefetched chunks a load then placed on the device.").add_metric([], s.hits)
        f.counter("kvtier_prefetch_wasted",
                  "Prefetched chunks evicted from host memory before any load used them.").add_metric([], s.wasted)


    # -- loads ------------------------------------------------------------------------------

    def _loads(self, f: _Families, s: Any) -> None:
        f.counter("kvtier_load_wait_timeouts",
                  "Loads whose promotions or probes were still pending at wait_timeout_s (the prefix ended there)."
                  ).add_metric([], s.wait_timeouts)

    # -- warm-up endpoint ---------------------------------------------------------------------

    def _warmup(self, f: _Families, s: Any) -> None:
        requests = f.counter("kvtier_warmup_requests", "Warm-up endpoint requests, by outcome (ok or the error code).",
                             ["outcome"])
        requests.add_metric(["ok"], s.ok)
        for code, count in sorted(dict(s.refused).items()):
            requests.add_metric([code], count)
        f.gauge("kvtier_warmup_in_flight", "Warm-up requests being served.").add_metric([], s.in_flight)
        refused = f.counter("kvtier_warmup_connections_refused",
                            "Warm-up connections refused by CurveZMQ, by reason.", ["reason"])
        for reason, count in sorted(dict(s.connections_refused).items()):
            refused.add_metric([reason], count)


def _labels_of(family: Metric) -> list[str]:
    # prometheus_client keeps a family's label names privately; compare through what it exposes.
    return list(getattr(family, "_labelnames", ()))


class EngineMetrics:
    """The Prometheus view of one engine.

    ``registry`` is this engine's own :class:`~prometheus_client.CollectorRegistry` (a new one
    unless given). Register sources with ``add_*``; each must have ``statistics()``, which is
    called on the scraping thread at every scrape, so it must be cheap and must tolerate being
    called from another thread (plain-number snapshots do). Sources may be added at any time.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False) if registry is None else registry
        self._hosts: list[StatisticsSource] = []
        self._tiers: list[StatisticsSource] = []
        self._managers: list[StatisticsSource] = []
        self._copies: list[StatisticsSource] = []
        self._publishers: list[StatisticsSource] = []
        self._prefetches: list[StatisticsSource] = []
        self._warmups: list[StatisticsSource] = []
        self._loads: list[StatisticsSource] = []
        self.registry.register(_Collector(self))  # type: ignore[arg-type]

    def add_host(self, source: StatisticsSource) -> None:
        self._hosts.append(source)

    def add_tier(self, source: StatisticsSource) -> None:
        self._tiers.append(source)

    def add_manager(self, source: StatisticsSource) -> None:
        self._managers.append(source)

    def add_copies(self, source: StatisticsSource) -> None:
        self._copies.append(source)

    def add_publisher(self, source: StatisticsSource) -> None:
        self._publishers.append(source)

    def add_prefetch(self, source: StatisticsSource) -> None:
        """The engine's prefetch counters (``kvtier.engine.prefetch_tracker.PrefetchStatistics``)."""
        self._prefetches.append(source)

    def add_loads(self, source: StatisticsSource) -> None:
        """The engine's load counters (``kvtier.engine.staging.LoadStatistics``)."""
        self._loads.append(source)

    def add_warmup(self, source: StatisticsSource) -> None:
        """The warm-up endpoint's counters (``kvtier.engine.warm_server.WarmupStatistics``)."""
        self._warmups.append(source)

    def render(self) -> bytes:
        """The text exposition format of this engine's registry."""
        return generate_latest(self.registry)


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; :meth:`close` stops it and joins its thread."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host: str = server.server_address[0]
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer(http://{self.host}:{self.port}/metrics)"


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 9464) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; port 0 = any free port.

    Binds to loopback by default: exposing metrics beyond the host is an explicit choice.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)

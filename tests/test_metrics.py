"""Specification of kvtier.metrics: snapshot sources exported to Prometheus, one registry per engine.

The sources are small fakes with ``statistics()`` returning the snapshot shapes the host tier,
the secondary tiers, the manager, the copy engine and the event publisher provide.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.events import PublisherStatistics
from kvtier.metrics import EngineMetrics, serve_metrics
from kvtier.stats import Histogram, HistogramSnapshot, MetricFamily


@dataclass
class Source:
    """A component whose snapshot the test mutates between scrapes."""

    snapshot: Any

    def statistics(self) -> Any:
        return self.snapshot


def hist(values: list[float], buckets: tuple[float, ...] = (0.1, 1.0)) -> HistogramSnapshot:
    h = Histogram(buckets)
    for v in values:
        h.observe(v)
    return h.snapshot()


def host_stats(**over: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        num_slots=100, slot_bytes=4096, used_slots=40, pinned_slots=10, write_pending=4, evictable=30,
        stores_skipped=7, evictions=12, eviction_age=hist([0.05, 2.0]), allocation_failures=3,
        allocation_sizes=hist([1, 4, 16], (1, 4, 16, 64)),
    )
    base.update(over)
    return SimpleNamespace(**base)


def tier_stats(label: str = "1:fs", **over: Any) -> SimpleNamespace:
    """Field names of kvtier.tiers.base.TierStatistics."""
    base: dict[str, Any] = dict(
        label=label, tier_type=label.split(":")[1], lookups=50, hits=20, bytes_read=8192, bytes_written=16384,
        seconds_read=0.5, seconds_written=1.25, loads_in_flight=2, stores_in_flight=3, queued_jobs=4,
        loads_completed=10, stores_completed=11,
        failures={("load", "corrupt"): 2, ("store", "no_space"): 5}, rejected_jobs=1, evictions=6,
        eviction_age=hist([3.0]), load_latency={"success": hist([0.01, 0.5]), "failure": hist([2.0])},
        store_latency={"success": hist([0.2])}, bytes_used=1000, capacity_bytes=4000, custom_metrics=(),
    )
    base.update(over)
    return SimpleNamespace(**base)


def manager_stats() -> SimpleNamespace:
    return SimpleNamespace(
        primary_lookups=200, primary_hits=150, promotion_allocation_failures=9,
        active_promotion_jobs={"1:fs": 2}, active_cascade_jobs={"1:fs": 1, "2:obj": 4},
        promotion_job_failures={"1:fs": 3}, cascade_job_failures={"2:obj": 1},
        promotion_latency={"1:fs": {"success": hist([0.05, 0.5, 5.0]), "failure": hist([0.2])}},
        store_allocation_failures=11,
        cascade_latency={"2:obj": {"success": hist([0.3])}}, jobs_in_flight=7, promotions_held=False,
    )


def copy_stats() -> SimpleNamespace:
    return SimpleNamespace(
        bytes_to_host=1_000_000, bytes_to_device=2_000_000, seconds_to_host=0.25, seconds_to_device=0.75,
        store_size=hist([1e6], (1e6, 5e6)), load_size=hist([2e6], (1e6, 5e6)), failures=1,
    )


def samples(text: bytes | str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, frozenset(labels.items()))]


@pytest.fixture
def engine_metrics() -> EngineMetrics:
    m = EngineMetrics()
    m.add_host(Source(host_stats()))
    m.add_manager(Source(manager_stats()))
    m.add_copies(Source(copy_stats()))
    m.add_tier(Source(tier_stats("1:fs")))
    m.add_tier(Source(tier_stats("2:obj", lookups=70, hits=35, capacity_bytes=None)))
    # The brief's spelling of three fields is accepted too (queued, rejected, custom).
    brief = tier_stats("3:memory", bytes_used=None, capacity_bytes=None)
    for new, old in (("queued_jobs", "queued"), ("rejected_jobs", "rejected"), ("custom_metrics", "custom")):
        setattr(brief, old, getattr(brief, new))
        delattr(brief, new)
    m.add_tier(Source(brief))
    m.add_publisher(Source(PublisherStatistics(queue_depth=5, published_batches=90, dropped_batches=2, sequence=90,
                                               replay_requests=0)))
    return m


def test_lookups_and_hits_are_counters_per_tier_including_the_primary(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    q, h = "kvtier_kv_offload_tiering_chunk_queries_total", "kvtier_kv_offload_tiering_chunk_hits_total"
    assert value(p, q, tier="0:primary") == 200 and value(p, h, tier="0:primary") == 150
    assert value(p, q, tier="1:fs") == 50 and value(p, h, tier="1:fs") == 20
    assert value(p, q, tier="2:obj") == 70 and value(p, h, tier="2:obj") == 35


def test_bytes_and_seconds_per_direction(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    assert value(p, "kvtier_kv_offload_tiering_read_bytes_total", tier="1:fs") == 8192
    assert value(p, "kvtier_kv_offload_tiering_write_bytes_total", tier="1:fs") == 16384
    assert value(p, "kvtier_kv_offload_tiering_read_time_total", tier="1:fs") == 0.5
    assert value(p, "kvtier_kv_offload_tiering_write_time_total", tier="1:fs") == 1.25
    assert value(p, "kvtier_kv_offload_load_bytes_total") == 2_000_000
    assert value(p, "kvtier_kv_offload_store_bytes_total") == 1_000_000
    assert value(p, "kvtier_kv_offload_load_time_total") == 0.75
    assert value(p, "kvtier_kv_offload_store_time_total") == 0.25
    assert value(p, "kvtier_kv_offload_store_size_bucket", le="1e+06") == 1


def test_histograms_are_cumulative_with_inf_equal_to_count(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    name = "kvtier_kv_offload_tiering_promotion_latency_seconds"
    labels = {"tier": "1:fs", "result": "success"}
    assert value(p, f"{name}_bucket", le="0.1", **labels) == 1
    assert value(p, f"{name}_bucket", le="1.0", **labels) == 2
    assert value(p, f"{name}_bucket", le="+Inf", **labels) == 3
    assert value(p, f"{name}_count", **labels) == 3
    assert value(p, f"{name}_sum", **labels) == pytest.approx(5.55)
    assert value(p, f"{name}_count", tier="1:fs", result="failure") == 1
    assert value(p, "kvtier_tier_load_latency_seconds_count", tier="1:fs", result="failure") == 1
    assert value(p, "kvtier_tier_store_latency_seconds_bucket", tier="2:obj", result="success", le="1.0") == 1


def test_jobs_failures_and_evictions_per_tier(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    assert value(p, "kvtier_kv_offload_tiering_active_promotion_jobs", tier="1:fs") == 2
    assert value(p, "kvtier_kv_offload_tiering_active_cascade_jobs", tier="2:obj") == 4
    assert value(p, "kvtier_kv_offload_tiering_promotion_job_failures_total", tier="1:fs") == 3
    assert value(p, "kvtier_kv_offload_tiering_cascade_job_failures_total", tier="2:obj") == 1
    assert value(p, "kvtier_kv_offload_tiering_promotion_allocation_failures_total") == 9
    assert value(p, "kvtier_kv_offload_allocation_failure_total") == 11
    assert value(p, "kvtier_tier_failures_total", tier="1:fs", direction="load", reason="corrupt") == 2
    assert value(p, "kvtier_tier_failures_total", tier="1:fs", direction="store", reason="no_space") == 5
    assert value(p, "kvtier_tier_loads_in_flight", tier="1:fs") == 2
    assert value(p, "kvtier_tier_stores_in_flight", tier="1:fs") == 3
    assert value(p, "kvtier_tier_queued_jobs", tier="1:fs") == 4
    assert value(p, "kvtier_tier_rejected_total", tier="1:fs") == 1
    assert value(p, "kvtier_tier_evictions_total", tier="0:primary") == 12
    assert value(p, "kvtier_tier_evictions_total", tier="1:fs") == 6
    assert value(p, "kvtier_tier_eviction_age_seconds_count", tier="0:primary") == 2
    assert value(p, "kvtier_tier_eviction_age_seconds_sum", tier="1:fs") == 3.0
    assert value(p, "kvtier_tier_info", tier="2:obj", type="obj") == 1
    assert value(p, "kvtier_tier_loads_completed_total", tier="1:fs") == 10
    assert value(p, "kvtier_tier_stores_completed_total", tier="1:fs") == 11
    assert value(p, "kvtier_tier_queued_jobs", tier="3:memory") == 4
    assert value(p, "kvtier_tier_rejected_total", tier="3:memory") == 1
    assert value(p, "kvtier_kv_offload_tiering_cascade_latency_seconds_count", tier="2:obj", result="success") == 1
    assert value(p, "kvtier_copy_failures_total") == 1


def test_host_fill_and_pinned_ratios_and_store_threshold_skips(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    assert value(p, "kvtier_host_fill_ratio") == 0.4
    assert value(p, "kvtier_host_pinned_ratio") == 0.1
    assert value(p, "kvtier_kv_offload_cpu_cache_usage_perc") == 0.1
    assert value(p, "kvtier_kv_offload_cpu_cache_write_usage_perc") == 0.04
    assert value(p, "kvtier_kv_offload_cpu_cache_read_usage_perc") == pytest.approx(0.06)
    assert value(p, "kvtier_kv_offload_stores_skipped_total") == 7
    assert value(p, "kvtier_host_allocation_failures_total") == 3
    assert value(p, "kvtier_kv_offload_cpu_allocation_size_bucket", le="4.0") == 2


def test_capacity_and_fill_are_exported_only_for_bounded_tiers(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    assert value(p, "kvtier_tier_capacity_bytes", tier="1:fs") == 4000
    assert value(p, "kvtier_tier_fill_ratio", tier="1:fs") == 0.25
    assert value(p, "kvtier_tier_bytes_used", tier="2:obj") == 1000
    assert ("kvtier_tier_capacity_bytes", frozenset({("tier", "2:obj")})) not in p
    # A tier that does not account usage (bytes_used None) exports neither.
    assert ("kvtier_tier_bytes_used", frozenset({("tier", "3:memory")})) not in p


def test_publisher_queue_depth_and_drops(engine_metrics: EngineMetrics) -> None:
    p = samples(engine_metrics.render())
    assert value(p, "kvtier_events_queue_depth") == 5
    assert value(p, "kvtier_events_published_batches_total") == 90
    assert value(p, "kvtier_events_dropped_batches_total") == 2


def test_values_are_read_at_scrape_time() -> None:
    source = Source(tier_stats(lookups=1))
    m = EngineMetrics()
    m.add_tier(source)
    assert value(samples(m.render()), "kvtier_kv_offload_tiering_chunk_queries_total", tier="1:fs") == 1
    source.snapshot = tier_stats(lookups=42)
    assert value(samples(m.render()), "kvtier_kv_offload_tiering_chunk_queries_total", tier="1:fs") == 42


def test_tier_declared_metrics_get_the_tier_label_and_merge_across_tiers() -> None:
    def families(n: float) -> tuple[MetricFamily, ...]:
        files = MetricFamily("files", "gauge", "Files on disk.", labels=("root",))
        files.set(n, "/a")
        scans = MetricFamily("scan_seconds", "histogram", "Scan time.", buckets=(1.0,))
        scans.observe(0.5)
        clash = MetricFamily("evictions", "counter", "Clashes with a built-in.")
        clash.inc(100)
        return (files, scans, clash)

    m = EngineMetrics()
    m.add_tier(Source(tier_stats("1:fs", custom_metrics=families(3))))
    m.add_tier(Source(tier_stats("2:fs", custom_metrics=families(8))))
    p = samples(m.render())
    assert value(p, "kvtier_tier_files", tier="1:fs", root="/a") == 3
    assert value(p, "kvtier_tier_files", tier="2:fs", root="/a") == 8
    assert value(p, "kvtier_tier_scan_seconds_bucket", tier="2:fs", le="1.0") == 1
    assert value(p, "kvtier_tier_evictions_total", tier="1:fs") == 6  # the built-in, not the clash


def test_a_failing_source_does_not_break_the_scrape() -> None:
    class Broken:
        def statistics(self) -> Any:
            raise RuntimeError("boom")

    m = EngineMetrics()
    m.add_tier(Broken())
    m.add_copies(Source(copy_stats()))
    assert value(samples(m.render()), "kvtier_kv_offload_load_bytes_total") == 2_000_000


def test_two_engines_in_one_process_have_separate_registries() -> None:
    a, b = EngineMetrics(), EngineMetrics()
    a.add_tier(Source(tier_stats(lookups=1)))
    b.add_tier(Source(tier_stats(lookups=2)))
    assert a.registry is not b.registry
    assert value(samples(a.render()), "kvtier_kv_offload_tiering_chunk_queries_total", tier="1:fs") == 1
    assert value(samples(b.render()), "kvtier_kv_offload_tiering_chunk_queries_total", tier="1:fs") == 2


def test_metrics_are_served_over_http_and_the_server_closes(engine_metrics: EngineMetrics) -> None:
    server = serve_metrics(engine_metrics.registry, host="127.0.0.1", port=0)
    try:
        assert server.port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            body = response.read()
    finally:
        server.close()
    p = samples(body)
    assert value(p, "kvtier_kv_offload_tiering_chunk_hits_total", tier="1:fs") == 20
    assert value(p, "kvtier_kv_offload_tiering_chunk_queries_total", tier="0:primary") == 200
    assert not server._thread.is_alive()


def test_prefetch_counters_are_exported_with_the_source_tier_label() -> None:
    from kvtier.engine.prefetch_tracker import PrefetchStatistics

    m = EngineMetrics()
    m.add_prefetch(Source(PrefetchStatistics(requests=5, chunks={"1:fs": 12, "2:obj": 3}, tokens=240, hits=9,
                                             wasted=2)))
    p = samples(m.render())
    assert value(p, "kvtier_prefetch_requests_total") == 5
    assert value(p, "kvtier_prefetched_chunks_total", tier="1:fs") == 12
    assert value(p, "kvtier_prefetched_chunks_total", tier="2:obj") == 3
    assert value(p, "kvtier_prefetched_tokens_total") == 240
    assert value(p, "kvtier_prefetch_hits_total") == 9
    assert value(p, "kvtier_prefetch_wasted_total") == 2

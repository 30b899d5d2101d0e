"""Scheduler-thread cost of kvtier's vLLM adapter against vLLM's own fs tier, per chunk.

vLLM calls a secondary tier from its scheduler thread, under the manager lock; every
microsecond spent there is a microsecond the scheduler does not schedule. This script measures
only that time — the time spent inside the tier's own methods on the calling thread — for
``"type": "kvtier_fs"`` (kvtier's adapter, after ``kvtier.integrations.vllm.register()``) and
``"type": "fs"`` (vLLM's ``FileSystemTierManager``), on the same workload, in the same process,
under the same temporary root directory (one sub-directory each), with the same I/O thread
counts, alternating which goes first each repeat.

**How it is measured.** The workload is driven through vLLM's real ``TieringOffloadingManager``
(built on CPU from a real ``TieringOffloadingSpec``, exactly as the connector's scheduler side
builds it), making the calls the connector makes: ``prepare_store``/``complete_store`` (the
cascade: one ``submit_store`` per request), ``lookup`` rounds, ``on_schedule_end`` once per step
(the probe flush, and the batched ``submit_load`` of the promotions the lookups started). The
tier object ``manager.secondary_tiers[0]`` has its scheduler-side methods (``lookup``,
``submit_store``, ``submit_load``, ``get_finished_jobs``, ``on_schedule_end``,
``on_new_request``, ``on_request_finished``, ``has_pending_work``) wrapped on the instance, and
each call is timed with ``time.perf_counter_ns`` around the call alone (the clock's own cost,
calibrated in the same process, is subtracted). Driving the real manager, rather than calling
the tiers directly with hand-built ``TransferJob``s, keeps the call pattern, job sizes and
interleaving (lookups that drain results, polls between steps) exactly vLLM's; wrapping the tier
instance keeps the manager's and the primary tier's own work out of the figures. The figures are
wall time on the scheduler thread, so they include waiting for the GIL while the tier's
background threads (vLLM's I/O pool and lookup thread; kvtier's event loop and I/O pool) run:
that wait is part of what a tier costs the scheduler.

**Attribution.** Per chunk: a lookup is one call per chunk; ``submit_store``/``submit_load``
divide each call by the job's chunks; ``get_finished_jobs`` calls that returned results divide by
the chunks of the jobs they returned; ``on_schedule_end`` calls that flushed a probe batch divide
by the keys first looked up in that step; ``on_new_request``/``on_request_finished`` divide by the
request's chunks; an ``on_schedule_end`` that flushed no probe but followed submits divides by
those jobs' chunks (kvtier hands a step's jobs to its event loop there, in one wake-up). The two
implementations do some work in different calls (kvtier applies
verdicts and job results on whichever call finds its inbox non-empty; vLLM drains probe results
in the first lookup after a flush and in ``on_schedule_end``), so the per-phase totals — every
productive call of the phase over its chunks — are the fair comparison. Idle polls (a
``get_finished_jobs`` that returned nothing, an ``on_schedule_end`` with nothing to flush) depend
on how often the manager polls, not on the chunks, so they are reported per call and left out of
the totals. The run waits ``--probe-wait-ms`` after the flush before resolving lookups, so a
second RETRY is rare (its count is printed; such calls are in the lookup phase's total).

Workload per repeat and implementation: a writer manager stores ``--requests`` requests of
``--job-chunks`` chunks (``--requests-per-step`` requests per step) and waits for the cascades; a
fresh reader manager (same root, same model: another vLLM instance) looks each request's chunks
up, plus ``--miss-fraction`` as many keys never stored, resolves them, promotes the hits and
checks that every promoted row holds the stored bytes. Each figure is the median over
``--repeats`` repeats; the ratio is kvtier/vLLM of the medians, with the range of the per-repeat
(paired) ratios. Target: ≤ 1.2x vLLM's own cost ("the adapter never slows vLLM's scheduler").
Timings are never asserted.

    /work/vllm-venv/bin/python benchmarks/vllm_adapter.py            # 256 KiB chunks (~30 s)
    /work/vllm-venv/bin/python benchmarks/vllm_adapter.py --tiny     # a few seconds
    /work/vllm-venv/bin/python benchmarks/vllm_adapter.py --chunk-kib 2048 --job-chunks 4
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

try:
    import numpy as np
    import vllm
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError as exc:  # pragma: no cover - the main virtualenv has no vLLM
    print(f"vLLM is not importable here ({exc}); run with the side virtualenv's python "
          "(e.g. /work/vllm-venv/bin/python): the vLLM adapter benchmark was skipped")
    sys.exit(0)

from kvtier.integrations.vllm import register

IMPLS = {"vLLM": "fs", "kvtier": "kvtier_fs"}
TARGET = 1.2
MODEL = "/models/kvtier-bench"
BLOCKS_PER_CHUNK = 4

# (category, unit, label): the table's rows, in order. "chunk" rows are per chunk, "call" rows
# per call; the *_total rows are computed from the other categories.
ROWS: list[tuple[str, str, str]] = [
    ("lookup_first", "chunk", "lookup, first (RETRY)"),
    ("lookup_hit", "chunk", "lookup, resolved HIT"),
    ("lookup_miss", "chunk", "lookup, resolved MISS"),
    ("submit_store", "chunk", "submit_store"),
    ("submit_load", "chunk", "submit_load"),
    ("finished_store", "chunk", "get_finished_jobs (stores)"),
    ("finished_load", "chunk", "get_finished_jobs (loads)"),
    ("end_flush", "chunk", "on_schedule_end (probe flush)"),
    ("end_handoff_store", "chunk", "on_schedule_end (store jobs handed over)"),
    ("end_handoff", "chunk", "on_schedule_end (load jobs handed over)"),
    ("request_store", "chunk", "on_new/finished_request (stores)"),
    ("request_load", "chunk", "on_new/finished_request (lookups)"),
    ("store_total", "chunk", "STORE PHASE, all productive calls"),
    ("load_total", "chunk", "LOOKUP+LOAD PHASE, all productive calls"),
    ("all_total", "chunk", "BOTH PHASES, per chunk stored+looked up"),
    ("finished_idle", "call", "get_finished_jobs, idle poll"),
    ("end_idle", "call", "on_schedule_end, idle"),
]
# The categories each phase total sums (productive calls only).
STORE_PARTS = ("submit_store", "finished_store", "end_flush_store", "end_handoff_store", "request_store")
LOAD_PARTS = ("lookup_first", "lookup_hit", "lookup_miss", "lookup_retry_again", "submit_load",
              "finished_load", "end_flush", "end_handoff", "request_load")


def clock_overhead_ns() -> tuple[int, int]:
    """What the wrappers' wall and CPU deltas read around an empty call (medians)."""
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    walls, cpus = [], []
    for _ in range(20001):
        c0 = cpu()
        t0 = clock()
        t1 = clock()
        c1 = cpu()
        walls.append(t1 - t0)
        cpus.append(c1 - c0)
    return int(statistics.median(walls)), int(statistics.median(cpus))


class TimedTier:
    """Wraps one tier instance's scheduler-side methods; sums ns and chunks per category."""

    def __init__(self, tier: Any, overhead_ns: tuple[int, int]) -> None:
        self.tier = tier
        self.overhead = overhead_ns
        self.ns: dict[str, int] = defaultdict(int)  # wall time on the calling thread
        self.cpu_ns: dict[str, int] = defaultdict(int)  # its CPU time (no GIL waits)
        self.units: dict[str, int] = defaultdict(int)
        self.phase = "store"
        self.asked: set[bytes] = set()  # keys looked up at least once
        self.new_in_step = 0  # keys first looked up since the last on_schedule_end
        self.submitted_in_step = 0  # chunks of the jobs submitted since the last on_schedule_end
        self.job_chunks: dict[int, tuple[int, bool]] = {}  # job id -> (chunks, is_promotion)
        self.request_chunks: dict[str, int] = {}
        self.retry_again = 0
        for name in ("lookup", "submit_store", "submit_load", "get_finished_jobs", "on_schedule_end",
                     "on_new_request", "on_request_finished", "has_pending_work"):
            setattr(tier, name, getattr(self, f"_{name}")(getattr(tier, name)))

    def add(self, category: str, ns: int, units: int, cpu_ns: int) -> None:
        self.ns[category] += max(ns - self.overhead[0], 0)
        self.cpu_ns[category] += max(cpu_ns - self.overhead[1], 0)
        self.units[category] += units

    def _lookup(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def lookup(key: bytes, req_context: Any) -> Any:
            c0 = cpu()
            t0 = clock()
            result = fn(key, req_context)
            t1 = clock()
            c1 = cpu()
            if key not in self.asked:
                self.asked.add(key)
                self.new_in_step += 1
                category = "lookup_first"
            elif result is LookupResult.RETRY:
                category = "lookup_retry_again"
                self.retry_again += 1
            else:
                category = "lookup_hit" if result is LookupResult.HIT else "lookup_miss"
            self.add(category, t1 - t0, 1, c1 - c0)
            return result
        return lookup

    def _submit(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def submit(job: Any) -> None:
            c0 = cpu()
            t0 = clock()
            fn(job)
            t1 = clock()
            c1 = cpu()
            n = len(job.keys)
            self.submitted_in_step += n
            self.job_chunks[job.job_id] = (n, job.is_promotion)
            self.add(category, t1 - t0, n, c1 - c0)
        return submit

    def _submit_store(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self._submit(fn, "submit_store")

    def _submit_load(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self._submit(fn, "submit_load")

    def _get_finished_jobs(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def get_finished_jobs() -> list[Any]:
            c0 = cpu()
            t0 = clock()
            results = list(fn())  # materialised inside the timing: a generator does its work here
            t1 = clock()
            c1 = cpu()
            if not results:
                self.add("finished_idle", t1 - t0, 1, c1 - c0)
                return results
            chunks = {True: 0, False: 0}
            for r in results:
                n, is_promotion = self.job_chunks.pop(r.job_id)
                chunks[is_promotion] += n
            # A call that returned both kinds is split by chunks (it happens rarely, if ever).
            total = chunks[True] + chunks[False]
            for is_promotion, n in chunks.items():
                if n:
                    self.add("finished_load" if is_promotion else "finished_store", (t1 - t0) * n // total, n,
                             (c1 - c0) * n // total)
            return results
        return get_finished_jobs

    def _on_schedule_end(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def on_schedule_end(context: Any) -> None:
            c0 = cpu()
            t0 = clock()
            fn(context)
            t1 = clock()
            c1 = cpu()
            submitted, self.submitted_in_step = self.submitted_in_step, 0
            if self.new_in_step:
                self.add("end_flush", t1 - t0, self.new_in_step, c1 - c0)
                self.new_in_step = 0
            elif submitted:  # kvtier hands a step's jobs to its loop here, not in submit_*
                self.add("end_handoff", t1 - t0, submitted, c1 - c0)
            else:
                self.add("end_idle", t1 - t0, 1, c1 - c0)
        return on_schedule_end

    def _on_new_request(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def on_new_request(req_context: Any) -> Any:
            c0 = cpu()
            t0 = clock()
            result = fn(req_context)
            t1 = clock()
            c1 = cpu()
            self.add(f"request_{self.phase}", t1 - t0, 0, c1 - c0)
            return result
        return on_new_request

    def _on_request_finished(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def on_request_finished(req_context: Any) -> None:
            c0 = cpu()
            t0 = clock()
            fn(req_context)
            t1 = clock()
            c1 = cpu()
            self.add(f"request_{self.phase}", t1 - t0, self.request_chunks.pop(req_context.req_id, 0), c1 - c0)
        return on_request_finished

    def _has_pending_work(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns

        def has_pending_work() -> bool:
            c0 = cpu()
            t0 = clock()
            result = fn()
            t1 = clock()
            c1 = cpu()
            self.add("pending_poll", t1 - t0, 1, c1 - c0)
            return result
        return has_pending_work

    @property
    def open_jobs(self) -> int:
        return len(self.job_chunks)


_engines = itertools.count()


def make_spec(tier: dict[str, Any], num_chunks: int, row_bytes: int) -> TieringOffloadingSpec:
    """A TieringOffloadingSpec as vLLM's connector builds it for a 1-GPU run (2 layers, fp16)."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * row_bytes,
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "secondary_tiers": [dict(tier)],
    }
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0),),
        worker_kv_bytes_per_block=row_bytes // BLOCKS_PER_CHUNK,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvtier-bench-{next(_engines)}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(name=MODEL, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(config)


def keys_for(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


class Engine:
    """A real TieringOffloadingManager with one timed secondary tier, driven as the connector does."""

    def __init__(self, tier: dict[str, Any], num_chunks: int, row_bytes: int, overhead_ns: tuple[int, int]) -> None:
        spec = make_spec(tier, num_chunks, row_bytes)
        self.manager = spec.get_manager()
        self.rows = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
            spec.num_chunks, -1)
        assert self.rows.shape[1] == row_bytes, (self.rows.shape, row_bytes)
        self.timed = TimedTier(self.manager.secondary_tiers[0], overhead_ns)
        self._req = itertools.count()

    def context(self, chunks: int) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(self._req)}", kv_transfer_params=None)
        self.timed.request_chunks[ctx.req_id] = chunks
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))

    def wait_jobs(self, timeout: float = 120.0) -> None:
        """Step (a poll every millisecond) until every job the tier was handed has finished."""
        deadline = time.monotonic() + timeout
        while self.timed.open_jobs:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.timed.open_jobs} jobs unfinished after {timeout} s")
            time.sleep(0.001)
            self.step()

    def store(self, requests: list[list[bytes]], per_step: int) -> None:
        m = self.manager
        for first in range(0, len(requests), per_step):
            for keys in requests[first:first + per_step]:
                ctx = self.context(len(keys))
                with m.lock:
                    m.on_new_request(ctx)
                    out = m.prepare_store(keys, ctx)
                    assert out is not None, "the primary tier could not allocate"
                    for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                        self.rows[slot, :len(key)] = np.frombuffer(key, dtype=np.uint8)  # the "GPU" writes
                    m.complete_store(keys, ctx)
                    m.on_request_finished(ctx)
            self.step()
        self.wait_jobs()

    def lookup_and_load(self, requests: list[list[bytes]], stored: set[bytes], probe_wait_s: float) -> None:
        m = self.manager
        contexts = [self.context(len(keys)) for keys in requests]
        with m.lock:
            for ctx in contexts:
                m.on_new_request(ctx)
        pending = [list(keys) for keys in requests]
        answers: dict[bytes, LookupResult] = {}
        deadline = time.monotonic() + 60.0
        while any(pending):
            with m.lock:
                for ctx, keys in zip(contexts, pending, strict=True):
                    still = []
                    for key in keys:
                        result = m.lookup(key, ctx)
                        if result is LookupResult.RETRY:
                            still.append(key)
                        else:
                            answers[key] = result
                    keys[:] = still
            self.step()  # flushes the probe batch; submits the promotions this round started
            if any(pending):
                if time.monotonic() > deadline:
                    raise RuntimeError("lookups unresolved after 60 s")
                time.sleep(probe_wait_s)
        self.wait_jobs()
        # The worker's side (untimed: primary-tier calls only): read the promoted rows and check them.
        with m.lock:
            for ctx, keys in zip(contexts, requests, strict=True):
                hits = [k for k in keys if k in stored]
                for k in keys:
                    want = LookupResult.HIT_PENDING if k in stored else LookupResult.MISS
                    if answers[k] is not want:
                        raise RuntimeError(f"{k.hex()[:16]}: {answers[k]} instead of {want}")
                if hits:
                    spec = m.prepare_load(hits, ctx)
                    for key, slot in zip(hits, spec.chunk_ids, strict=True):
                        if self.rows[slot, :len(key)].tobytes() != key:
                            raise RuntimeError(f"promoted row for {key.hex()[:16]} holds other bytes")
                    m.complete_load(hits, ctx)
                m.on_request_finished(ctx)

    def shutdown(self) -> None:
        self.rows = None  # type: ignore[assignment]  # drop our window on the shared mapping first
        self.manager.shutdown()


def one_run(name: str, root: Path, args: argparse.Namespace, row_bytes: int, overhead_ns: tuple[int, int],
            tag: str) -> dict[str, float]:
    """One repeat of one implementation; µs per chunk (or per call) per category."""
    tier = {"type": IMPLS[name], "root_dir": str(root / name),
            "n_read_threads": args.threads, "n_write_threads": args.threads}
    n_stored = args.requests * args.job_chunks
    n_absent = round(args.job_chunks * args.miss_fraction)
    stored = keys_for(f"{tag}/stored", n_stored)
    absent = keys_for(f"{tag}/absent", args.requests * n_absent)
    store_requests = [stored[i:i + args.job_chunks] for i in range(0, n_stored, args.job_chunks)]
    load_requests = [store_requests[r] + absent[r * n_absent:(r + 1) * n_absent] for r in range(args.requests)]
    num_chunks = n_stored + 8

    gc.collect()
    gc.disable()
    try:
        writer = Engine(tier, num_chunks, row_bytes, overhead_ns)
        try:
            writer.store(store_requests, args.requests_per_step)
        finally:
            writer.shutdown()
        reader = Engine(tier, num_chunks, row_bytes, overhead_ns)
        reader.timed.phase = "load"
        try:
            reader.lookup_and_load(load_requests, set(stored), args.probe_wait_ms / 1000)
        finally:
            reader.shutdown()
    finally:
        gc.enable()
    shutil.rmtree(root / name, ignore_errors=True)

    out: dict[str, float] = {"retry_again": reader.timed.retry_again}
    for clock, prefix in (("ns", ""), ("cpu_ns", "cpu:")):
        ns: dict[str, int] = defaultdict(int)
        units: dict[str, int] = defaultdict(int)
        for timed, suffix in ((writer.timed, "_store"), (reader.timed, "")):
            for category, value in getattr(timed, clock).items():
                units_of = timed.units[category]
                if category in ("end_flush", "end_handoff") and suffix:  # the writer never looks up; keep it apart anyway
                    category += suffix
                ns[category] += value
                units[category] += units_of
        out.update({prefix + c: ns[c] / units[c] / 1000 for c in ns if units[c]})
        looked_up = n_stored + len(absent)
        store, load = sum(ns[c] for c in STORE_PARTS), sum(ns[c] for c in LOAD_PARTS)
        out[prefix + "store_total"] = store / n_stored / 1000
        out[prefix + "load_total"] = load / looked_up / 1000
        out[prefix + "all_total"] = (store + load) / (n_stored + looked_up) / 1000
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="directory to write in (default: a temp dir)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="chunk (primary row) size in KiB")
    parser.add_argument("--requests", type=int, default=32, help="requests stored, then looked up, per repeat")
    parser.add_argument("--job-chunks", type=int, default=16, help="chunks per request (one job each)")
    parser.add_argument("--requests-per-step", type=int, default=4, help="requests completing their store per step")
    parser.add_argument("--miss-fraction", type=float, default=0.25,
                        help="keys never stored looked up per request, as a fraction of its chunks")
    parser.add_argument("--threads", type=int, default=4, help="n_read_threads and n_write_threads, both tiers")
    parser.add_argument("--probe-wait-ms", type=float, default=50.0, help="wait between lookup rounds")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per implementation (median)")
    parser.add_argument("--tiny", action="store_true", help="a run of a few seconds (smoke test)")
    args = parser.parse_args()
    if args.tiny:
        args.chunk_kib, args.requests, args.job_chunks, args.requests_per_step = 64, 4, 4, 2
        args.threads, args.probe_wait_ms, args.repeats = 2, 20.0, 1
    if args.chunk_kib * 1024 % BLOCKS_PER_CHUNK:
        parser.error(f"--chunk-kib must make a row divisible into {BLOCKS_PER_CHUNK} blocks")

    for quiet in ("kvtier", "vllm"):
        logging.getLogger(quiet).setLevel(logging.ERROR)
    register()
    row_bytes = args.chunk_kib * 1024
    overhead_ns = clock_overhead_ns()
    # As vLLM's engine core does once started: keep the import graph out of the collector's reach.
    gc.collect()
    gc.freeze()

    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-vllm-bench-"))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in IMPLS}
    started = time.monotonic()
    try:
        order = list(IMPLS)
        for repeat in range(args.repeats):
            for name in order:
                runs[name].append(one_run(name, root, args, row_bytes, overhead_ns, f"r{repeat}"))
            order.reverse()  # alternate which goes first
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started

    n_absent = round(args.job_chunks * args.miss_fraction)
    print(f"vLLM adapter, scheduler-thread cost: vLLM {vllm.__version__} 'fs' vs kvtier 'kvtier_fs'; "
          f"{args.chunk_kib} KiB chunks; {args.requests} requests x {args.job_chunks} chunks stored "
          f"({args.requests_per_step} per step), then looked up with {n_absent} absent keys each and "
          f"promoted; {args.threads}+{args.threads} I/O threads; median of {args.repeats} repeats; "
          f"clock overhead {overhead_ns[0]}/{overhead_ns[1]} ns (wall/cpu) per call subtracted; root {root}; {elapsed:.1f} s")
    header = (f"{'call':<42} {'per':>5} {'vLLM us':>8} {'kvtier us':>9} {'kvtier/vLLM':>11} "
              f"{'repeat ratios':>13} {'target':>6} | {'vLLM cpu':>8} {'kvtier cpu':>10} {'cpu ratio':>9}")
    print(header)
    print("-" * len(header))

    def figures(category: str) -> tuple[float, float, list[float]] | None:
        theirs = [r[category] for r in runs["vLLM"] if category in r]
        ours = [r[category] for r in runs["kvtier"] if category in r]
        if not theirs or not ours:
            return None
        paired = [o / t for o, t in zip(ours, theirs, strict=False) if t > 0]
        return statistics.median(theirs), statistics.median(ours), paired

    for category, unit, label in ROWS:
        wall, cpu = figures(category), figures("cpu:" + category)
        if wall is None or cpu is None:
            print(f"{label:<42} {unit:>5} {'-':>8} {'-':>9} {'-':>11}")
            continue
        a, b, paired = wall
        ratio = f"{b / a:.2f}" if a > 0 else "-"
        spread = f"{min(paired):.2f}-{max(paired):.2f}" if paired else "-"
        target = f"<={TARGET:.1f}" if unit == "chunk" else ""
        ca, cb, _ = cpu
        cratio = f"{cb / ca:.2f}" if ca > 0 else "-"
        print(f"{label:<42} {unit:>5} {a:>8.2f} {b:>9.2f} {ratio:>11} {spread:>13} {target:>6} | "
              f"{ca:>8.2f} {cb:>10.2f} {cratio:>9}")
    retries = {name: sum(int(r["retry_again"]) for r in runs[name]) for name in IMPLS}
    print(f"second RETRYs (lookups asked again before their probe answered), all repeats: "
          f"vLLM {retries['vLLM']}, kvtier {retries['kvtier']}")
    print(f"target: kvtier/vLLM <= {TARGET} per chunk (the adapter never slows vLLM's scheduler); "
          "the phase totals are the fair comparison (the two do some work in different calls)")
    print("us: wall time on the scheduler thread (GIL waits included: what the scheduler loses); "
          "cpu: that thread's CPU time in the same calls (thread_time; excludes waiting for the GIL)")


if __name__ == "__main__":
    main()

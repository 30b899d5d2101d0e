"""Throughput of the filesystem tier against raw file I/O, in the same process and directory.

For each chunk size (256 KiB and 2 MiB, 64 chunks per job) it measures, interleaved trial by
trial (the order alternates each repeat, and dirty pages are flushed with ``os.sync()`` outside
the timed regions, so writeback of one trial does not land in the next):

* **raw**: the same number of threads as the tier's pool doing plain ``open``/``os.pwrite``/
  ``os.replace`` (store) and ``open``/``os.preadv`` (load) of the same bytes to the same file
  paths (the tier's ``<hhh>/<hh>_g0/<hash>.bin`` tree, parent directories created with
  ``os.makedirs(exist_ok=True)``), with the SAME I/O mode as the tier (``O_DIRECT`` or buffered);
  plain threads, each over a contiguous share, started before the clock and released together
  (no executor: its per-chunk future would handicap the baseline at page-cache speeds);
* **kvtier**: ``FileSystemTier`` store and load jobs (atomic publish, trailer, xxh3 checksum,
  dual-queue pool, batch hand-off).

Modes: ``auto`` lets the tier probe (``O_DIRECT`` when the filesystem allows it) and runs raw in
the mode it chose; ``buffered`` forces page-cache I/O on both sides; ``both`` (default) runs
the two. Each figure is the median of ``--repeats`` trials with the spread (min–max) of the
per-trial ratios; every trial writes fresh keys, so no store is skipped as already present.

**vLLM** (only if ``vllm`` is importable, e.g. ``vllm==0.33.0`` installed with ``--no-deps`` in a side
virtualenv that also has kvtier): its ``FileSystemTierManager`` is driven directly, without an engine,
on the same workload: the same host buffer (page-aligned, as its O_DIRECT path needs), the same root
directory, the same thread split (``n_read_threads``/``n_write_threads``), ``--jobs`` jobs of 64
chunks submitted with ``submit_store``/``submit_load`` and awaited with ``drain_jobs`` (its pool's
condition wait), then checked with ``get_finished_jobs``. It probes ``O_DIRECT`` itself; in buffered
mode its probe is forced to "no" the same way as the tier's. Its lookups (RETRY until the scheduler
flushes) are not involved, since transfers are submitted directly. Its trials are interleaved with
the other two (the order rotates each repeat) and the table gains its throughput, the I/O mode it
chose, and the kvtier/vLLM ratio. Without vLLM that comparison is reported skipped.

``--vllm-xxh3`` adds a fourth contender, vLLM with kvtier's checksum (xxh3-64) added to its
per-block store and load, and a table comparing kvtier with it: what kvtier costs beyond the
verification itself, each in its own structure.

A second table gives the CPU each contender spends per GiB moved (process user + system time, all
threads), with two parts of kvtier's: its event-loop thread and the xxh3-64 checksum (measured
alone, on cache-hot and cold slots); with vLLM, also the CPU of the thread that submits vLLM's
jobs and waits for them (what kvtier's loop stands in for). Where every core is busy — page-cache I/O on a small machine —
throughput is this figure turned upside down, so it tells what an unfavourable ratio is made of.
The collector's heap is frozen after start-up (``gc.freeze()``), as vLLM's engine core does.

**--profile**: where each microsecond of a chunk goes, a per-stage profile of the store and load
paths instead of the comparison. Drives a real :class:`~kvtier.tiers.fs.tier.FileSystemTier` (jobs of 64 chunks through
``submit_store``/``submit_load``, as ``benchmarks/fs_tier.py`` does) with its blocking calls timed
where the chunk code makes them: the module attributes the fs tier's chunk code calls through
(``os`` and ``beneath`` of :mod:`kvtier.tiers.fs.chunks`, the trailer and identity helpers of
:mod:`kvtier.tiers.fs.tier`) are swapped for timing wrappers for the run (one process, nothing
else changes). Per chunk, in µs of CPU time of the thread that ran it (medians of ``--repeats``):

* **containment/open**: opening the shard directory beneath the tree, the existence check, and
  the create (store) or ``openat2`` open (load) of the chunk file;
* **write** / **read**: the ``pwritev``/``preadv`` (the kernel's copy, or the device with ``O_DIRECT``);
* **close**: closing the file (and the shard directory);
* **trailer**: the identity and the trailer page, less its checksum;
* **checksum**: xxh3-64 of the payload, timed where the trailer code computes it (the cache
  state and the contention for the cores are the path's own: cold host slots for a store or an
  ``O_DIRECT`` load, just copied bytes for a page-cache load);
* **rename/publish**: the ``renameat`` that publishes a stored chunk;
* **worker glue**: the rest of the worker's time per chunk (Python between the calls above);
* **index+accounting**, **metrics**, **loop other**: the event loop's CPU per chunk in the tier's
  index, in its metrics (usage, transfer counters, events), and the rest of the loop's share
  (the job runner, the hand-off from the pool, the job's completion);
* **hand-off**: the workers' CPU per chunk beyond the stages above (waking, queues, slices).

**--loop**: the event loop's own CPU per load job, taken apart by what it waits for. One tier's
load jobs (``--jobs`` at a time, 64 chunks each, the same chunks again and again) run three ways
in rotation: with real reads; with the pool's workers answering each slice at once (the loop's
hand-off to the pool and back, without I/O); and with the pool call answering on the loop itself
(no threads at all). Per job it prints the loop thread's CPU and how many times the loop polled its
selector (each wake-up of the loop is one) with the loop's CPU inside those polls (the system
call, and taking the interpreter lock back), and the whole process's CPU per chunk beside it. The
gap between the first two rows is what real I/O adds to the loop's work: wake-ups that come one
job at a time, the interpreter lock taken back from busy workers, and the same Python run slower
beside workers that copy and hash on the other cores.

**--worker**: a worker's chunk read taken apart, outside the tier. The tier stores
``min(--jobs × 64, 256)`` chunks, then threads that live through the run (one, then ``--threads``)
read those files back four ways, in rotation, each one step closer to what the tier's workers do:
``open+read`` (vLLM's way: open the path, ``preadv`` the payload, close); ``+xxh3-64`` (and the
checksum of the slot); ``+trailer, openat2`` (the system calls a verified read makes, with no
Python around them: ``openat2`` beneath the tree, one ``preadv`` of payload, trailer page and a
spare page, close, the checksum); ``slice loader`` (the tier's own
:func:`~kvtier.tiers.fs.chunks.slice_loader` over slices of 64, paths and trailer checks
included). Per way the process's CPU µs per chunk (and wall µs), and the three differences: what
the checksum costs, what the verification asks of the kernel beyond vLLM's read, and the Python
the loader runs per chunk beyond both.

A stage timer costs ~0.6 µs a call (calibrated and subtracted). Contention for the cores shows up in the
stages where it lands (a shard directory's lock spun on counts in containment/open). Run it on a quiet machine:

    python benchmarks/fs_tier.py [--root DIR] [--jobs 4] [--threads 4] [--repeats 7] [--mode both]
                                 [--sizes 256,2048] [--no-vllm] [--vllm-xxh3] [--profile | --loop | --worker]
    /tmp/vllm-venv/bin/python benchmarks/fs_tier.py      # with vLLM in a side virtualenv
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import importlib.util
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.config import TierConfig
from kvtier.host.slots import SlotBuffer
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry, Namespace, namespace
from kvtier.tiers import integrity
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.fs import tier as fs_tier_module
from kvtier.tiers.fs.pool import usable_cpus
from kvtier.tiers.fs.tier import FileSystemTier
from kvtier.tiers.integrity import checksum

CHUNKS_PER_JOB = 64
GiB = float(1 << 30)


@dataclass(frozen=True)
class Timing:
    """One timed region: wall seconds, the process's CPU seconds (all threads, user + system) and
    the CPU seconds of the thread that started and stopped the watch (kvtier: its event loop)."""

    wall: float
    cpu: float
    thread_cpu: float


class Stopwatch:
    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._thread_cpu = time.thread_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu,
                      time.thread_time() - self._thread_cpu)


def geometry_for(slot_bytes: int) -> KVGeometry:
    # page = 2 * 16 tokens * 8 heads * 128 dim * 2 bytes = 64 KiB; layers set the chunk size.
    return KVGeometry("bench/model", num_layers=slot_bytes // 65536, num_kv_heads=8, head_dim=128,
                      dtype="float16", block_size=16)


def trial_keys(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def raw_round(root: Path, host: SlotBuffer, geometry: KVGeometry, n_chunks: int, threads: int, tag: str,
              o_direct: bool) -> tuple[Timing, Timing]:
    """Plain store and load of ``n_chunks`` slots with ``threads`` threads."""
    ns = namespace(str(root / f"raw_{tag}"), geometry.run_fields(1), 0)
    paths = [ns.chunk_path(key) for key in trial_keys(tag, n_chunks)]
    flag = getattr(os, "O_DIRECT", 0) if o_direct else 0

    def put(i: int) -> None:
        os.makedirs(os.path.dirname(paths[i]), exist_ok=True)
        tmp = paths[i] + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | flag, 0o644)
        try:
            os.pwrite(fd, host.view(i % host.num_slots), 0)
        finally:
            os.close(fd)
        os.replace(tmp, paths[i])

    def get(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | flag)
        try:
            os.preadv(fd, [host.view(i % host.num_slots)], 0)
        finally:
            os.close(fd)

    def in_threads(op: Callable[[int], None]) -> Timing:
        # Plain threads over contiguous shares, started before the clock and released together
        # (as the tiers' pools are idle threads woken by a submit). No executor: a future per
        # chunk costs ~10 µs of CPU, which at page-cache speeds would handicap the baseline.
        go = threading.Barrier(threads + 1)

        def share(t: int) -> None:
            go.wait()
            for i in range(t * n_chunks // threads, (t + 1) * n_chunks // threads):
                op(i)

        workers = [threading.Thread(target=share, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        watch = Stopwatch()
        go.wait()
        for worker in workers:
            worker.join()
        return watch.stop()

    os.sync()
    store = in_threads(put)
    os.sync()
    load = in_threads(get)
    shutil.rmtree(root / f"raw_{tag}")
    return store, load


@contextlib.contextmanager
def forced_buffered(enabled: bool) -> Iterator[None]:
    """Make the tier's O_DIRECT probe answer "no" (page-cache I/O) while enabled."""
    if not enabled:
        yield
        return
    probe = chunks.probe_o_direct
    chunks.probe_o_direct = lambda directory: False  # type: ignore[assignment]
    try:
        yield
    finally:
        chunks.probe_o_direct = probe  # type: ignore[assignment]


class VllmFs:
    """vLLM's fs tier modules, imported only when ``vllm`` is present (nothing else here needs it)."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.tiering import base as tiering_base
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs import manager

        self.base: ModuleType = base
        self.io: ModuleType = fs_io
        self.tiering: ModuleType = tiering_base
        self.manager: ModuleType = manager
        self.version: str = importlib.import_module("vllm").__version__


def load_vllm() -> tuple[VllmFs | None, str]:
    """vLLM's fs tier if importable, else ``None`` and why (the comparison is then skipped)."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not importable"
    try:
        return VllmFs(), ""
    except Exception as exc:  # noqa: BLE001 - an incomplete --no-deps install fails on any transitive import
        return None, f"vllm is present but its fs tier does not import ({type(exc).__name__}: {exc})"


def vllm_spec(geometry: KVGeometry) -> SimpleNamespace:
    """A stand-in for vLLM's OffloadingSpec carrying only the attributes its fs tier reads.

    One full-attention group and parallelism-agnostic, so its file tree is ``<root>/<model>_<digest>_r0/…``
    — the same depth and fan-out as kvtier's.
    """
    config = SimpleNamespace(
        groups=[SimpleNamespace(tokens_per_block=geometry.block_size,
                                layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(geometry.num_layers)])],
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                 is_parallelism_agnostic=True),
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False,
        model=SimpleNamespace(name=geometry.model_name, dtype=geometry.dtype),
        cache=SimpleNamespace(tokens_per_hash=geometry.block_size),
    )
    return SimpleNamespace(config=config, kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
                           blocks_per_chunk=1)


@contextlib.contextmanager
def vllm_checksummed(vllm: VllmFs) -> Iterator[None]:
    """vLLM's per-block store and load with kvtier's checksum added where kvtier computes it:
    xxh3-64 of the host bytes before a block is written, of the bytes read after a block is
    loaded (the digest itself is kept nowhere: this prices the work, in vLLM's own structure)."""
    io: Any = vllm.io  # its private per-block functions, looked up by batch_*_block at each call
    store, load = io._store_block, io._load_block

    def store_block(dest_path: str, buffer: memoryview, offset: int, block_size: int, *args: Any) -> None:
        checksum(buffer.cast("B")[offset : offset + block_size])
        store(dest_path, buffer, offset, block_size, *args)

    def load_block(source_path: str, view: memoryview, offset: int, block_size: int, *args: Any) -> None:
        load(source_path, view, offset, block_size, *args)
        checksum(view.cast("B")[offset : offset + block_size])

    io._store_block, io._load_block = store_block, load_block
    try:
        yield
    finally:
        io._store_block, io._load_block = store, load


def vllm_round(vllm: VllmFs, root: Path, host: SlotBuffer, geometry: KVGeometry, jobs: int, threads: int,
               tag: str, buffered: bool, checksummed: bool = False) -> tuple[Timing, Timing, bool]:
    """``jobs`` store jobs then ``jobs`` load jobs of 64 chunks through vLLM's fs tier (with
    ``checksummed``, under :func:`vllm_checksummed`)."""
    if checksummed:
        with vllm_checksummed(vllm):
            return vllm_round(vllm, root, host, geometry, jobs, threads, tag + "_x", buffered)
    half = max(1, threads // 2)
    # Rows of the shared host buffer; vLLM takes the chunk size from strides[0].
    primary = host.array.data
    # Its manager module calls the probe by its imported name, so that name is the one to swap.
    probe: Callable[[str], bool] = vllm.manager.probe_o_direct
    if buffered:
        setattr(vllm.manager, "probe_o_direct", lambda directory: False)  # noqa: B010 (module attribute)
    try:
        tier = vllm.manager.FileSystemTierManager(
            vllm_spec(geometry), primary, "fs", root_dir=str(root / f"vllm_{tag}"),
            n_read_threads=half, n_write_threads=max(1, threads - half))
    finally:
        setattr(vllm.manager, "probe_o_direct", probe)  # noqa: B010
    keys = [vllm.base.make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0)
            for i in range(jobs * CHUNKS_PER_JOB)]
    req = vllm.base.ReqContext(req_id="bench")

    def run_jobs(is_promotion: bool) -> Timing:
        os.sync()
        watch = Stopwatch()
        for j in range(jobs):
            slots = [(j * CHUNKS_PER_JOB + i) % host.num_slots for i in range(CHUNKS_PER_JOB)]
            job = vllm.tiering.TransferJob(
                job_id=j + (1000 if is_promotion else 0), keys=keys[j * CHUNKS_PER_JOB:(j + 1) * CHUNKS_PER_JOB],
                chunk_ids=np.asarray(slots, dtype=np.int32), is_promotion=is_promotion, req_context=req)
            (tier.submit_load if is_promotion else tier.submit_store)(job)
        tier.drain_jobs()  # blocks on its pool's condition until every job's task has finished
        elapsed = watch.stop()
        results = list(tier.get_finished_jobs())
        if len(results) != jobs or not all(r.success for r in results):
            raise RuntimeError(f"vLLM benchmark job failed: {results}")
        return elapsed

    try:
        store = run_jobs(False)
        load = run_jobs(True)
    finally:
        tier.shutdown()
    o_direct = bool(tier._use_o_direct)  # no public accessor; it logs its choice only on fallback
    shutil.rmtree(root / f"vllm_{tag}")
    return store, load, o_direct


async def run_tier_jobs(tier: FileSystemTier, host: SlotBuffer, keys: list[bytes], jobs: int,
                        is_promotion: bool) -> None:
    """Submit ``jobs`` jobs of 64 chunks of ``keys`` (stores, or loads with ``is_promotion``) and
    wait, woken by the tier, until every one is reported; RuntimeError when one failed."""
    wake = anyio.Event()

    def wakeup() -> None:
        wake.set()

    tier.set_wakeup(wakeup)
    for j in range(jobs):
        slots = [(j * CHUNKS_PER_JOB + i) % host.num_slots for i in range(CHUNKS_PER_JOB)]
        job = TransferJob(j + (1000 if is_promotion else 0), keys[j * CHUNKS_PER_JOB:(j + 1) * CHUNKS_PER_JOB],
                          slots, is_promotion)
        (tier.submit_load if is_promotion else tier.submit_store)(job)
    done = 0
    while done < jobs:
        await wake.wait()
        wake = anyio.Event()
        results = tier.get_finished_jobs()
        if not all(r.success for r in results):
            raise RuntimeError(f"benchmark job failed: {[r.failure_reason for r in results]}")
        done += len(results)


async def tier_round(root: Path, host: SlotBuffer, geometry: KVGeometry, jobs: int, threads: int,
                     tag: str, buffered: bool) -> tuple[Timing, Timing, bool]:
    """``jobs`` store jobs then ``jobs`` load jobs of 64 chunks through the tier."""
    half = max(1, threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root / f"tier_{tag}"), "n_read_threads": half, "n_write_threads": max(1, threads - half),
    })
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    keys = trial_keys(tag, jobs * CHUNKS_PER_JOB)

    async def run_jobs(is_promotion: bool) -> Timing:
        os.sync()
        watch = Stopwatch()
        await run_tier_jobs(tier, host, keys, jobs, is_promotion)
        return watch.stop()

    with forced_buffered(buffered):
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            try:
                store = await run_jobs(False)
                load = await run_jobs(True)
            finally:
                await tier.aclose()
    o_direct = tier.o_direct
    shutil.rmtree(root / f"tier_{tag}")
    return store, load, o_direct


@dataclass(frozen=True)
class Figures:
    """One contender's trials of one operation: median throughput and CPU cost, per-trial rates."""

    rates: list[float]  # GiB/s per trial
    gib_per_s: float  # median
    cpu_ms_per_gib: float  # median process CPU (all threads) per GiB moved
    thread_cpu_ms_per_gib: float  # the same for the timing thread alone

    @classmethod
    def of(cls, gib: float, timings: list[Timing]) -> Figures:
        rates = [gib / t.wall for t in timings]
        return cls(rates, statistics.median(rates), statistics.median(1000 * t.cpu / gib for t in timings),
                   statistics.median(1000 * t.thread_cpu / gib for t in timings))

    def versus(self, other: Figures) -> tuple[float, float, float]:
        """Ratio of the medians, then the min and max of the per-trial (paired) ratios."""
        paired = [ours / theirs for ours, theirs in zip(self.rates, other.rates)]
        return self.gib_per_s / other.gib_per_s, min(paired), max(paired)


@dataclass(frozen=True)
class Row:
    chunk_kib: int
    op: str
    mode: str
    raw: Figures
    kvtier: Figures
    vllm: Figures | None
    vllm_mode: str | None
    xxh3_ms_per_gib: tuple[float, float]  # (cache-hot, cold)
    vllm_xxh3: Figures | None = None  # vLLM with kvtier's checksum added (--vllm-xxh3)


def measure(root: Path, slot_bytes: int, args: argparse.Namespace, buffered: bool,
            vllm: VllmFs | None) -> list[Row]:
    """Interleaved raw/tier(/vLLM) trials for one chunk size and mode; one row per operation."""
    geometry = geometry_for(slot_bytes)
    assert geometry.slot_bytes(1) == slot_bytes
    n_chunks = args.jobs * CHUNKS_PER_JOB
    host = SlotBuffer(min(n_chunks, 256), slot_bytes, pin_memory=False)
    try:
        host.array[:] = 0x5A  # touch every page before timing
        for i in range(host.num_slots):
            host.view(i)[:8] = i.to_bytes(8, "little")
        # Warm-up (directories, code paths), not timed; it also tells which mode each tier picks.
        *_, o_direct = anyio.run(tier_round, root, host, geometry, 1, args.threads, f"{slot_bytes}_w", buffered)
        vllm_o_direct: bool | None = None
        if vllm is not None:
            *_, vllm_o_direct = vllm_round(vllm, root, host, geometry, 1, args.threads, f"{slot_bytes}_w", buffered)
        raw_t: list[tuple[Timing, Timing]] = []
        tier_t: list[tuple[Timing, Timing]] = []
        vllm_t: list[tuple[Timing, Timing]] = []
        vllm_x_t: list[tuple[Timing, Timing]] = []
        for r in range(args.repeats):
            tag = f"{slot_bytes}_{int(buffered)}_{r}"

            def raw(tag: str = tag) -> None:
                raw_t.append(raw_round(root, host, geometry, n_chunks, args.threads, tag, o_direct))

            def tier(tag: str = tag) -> None:
                store, load, chosen = anyio.run(tier_round, root, host, geometry, args.jobs, args.threads, tag,
                                                buffered)
                assert chosen == o_direct
                tier_t.append((store, load))

            def theirs(tag: str = tag) -> None:
                assert vllm is not None
                store, load, chosen = vllm_round(vllm, root, host, geometry, args.jobs, args.threads, tag, buffered)
                assert chosen == vllm_o_direct
                vllm_t.append((store, load))

            def theirs_checksummed(tag: str = tag) -> None:
                assert vllm is not None
                store, load, _ = vllm_round(vllm, root, host, geometry, args.jobs, args.threads, tag, buffered,
                                            checksummed=True)
                vllm_x_t.append((store, load))

            # Rotate the order each repeat so no contender always runs first (cold) or after a given one.
            trials: list[Callable[..., None]] = [raw, tier] + ([theirs] if vllm is not None else [])
            if vllm is not None and args.vllm_xxh3:
                trials.append(theirs_checksummed)
            shift = r % len(trials)
            for trial in trials[shift:] + trials[:shift]:
                trial()
        xxh3 = checksum_cpu_ms_per_gib(host)
    finally:
        host.close()
    gib = n_chunks * slot_bytes / GiB
    return [
        Row(slot_bytes // 1024, op, "O_DIRECT" if o_direct else "buffered",
            Figures.of(gib, [t[idx] for t in raw_t]), Figures.of(gib, [t[idx] for t in tier_t]),
            Figures.of(gib, [t[idx] for t in vllm_t]) if vllm is not None else None,
            None if vllm is None else ("O_DIRECT" if vllm_o_direct else "buffered"), xxh3,
            Figures.of(gib, [t[idx] for t in vllm_x_t]) if vllm_x_t else None)
        for idx, op in ((0, "store"), (1, "load"))
    ]


def checksum_cpu_ms_per_gib(host: SlotBuffer) -> tuple[float, float]:
    """CPU ms per GiB of xxh3-64 over one slot, one thread: cache-hot (one slot again and again,
    as right after a page-cache copy) and cold (each slot once, as after a DMA or O_DIRECT read)."""
    gib = host.nbytes / GiB
    start = time.process_time()
    for _ in range(host.num_slots):
        checksum(host.view(0))
    hot = time.process_time() - start
    start = time.process_time()
    for i in range(host.num_slots):
        checksum(host.view(i))
    cold = time.process_time() - start
    return 1000 * hot / gib, 1000 * cold / gib


def print_tables(rows: list[Row], with_vllm: bool) -> None:
    header = (f"{'chunk':>8} {'op':>6} {'I/O mode':>9} {'raw GiB/s':>10} {'kvtier GiB/s':>13} {'ratio':>6} "
              f"{'trial ratios':>13}")
    if with_vllm:
        header += f" | {'vLLM mode':>9} {'vLLM GiB/s':>11} {'kvtier/vLLM':>12} {'trial ratios':>13}"
    print(header)
    for row in rows:
        ratio, low, high = row.kvtier.versus(row.raw)
        line = (f"{row.chunk_kib:>4} KiB {row.op:>6} {row.mode:>9} {row.raw.gib_per_s:>10.2f} "
                f"{row.kvtier.gib_per_s:>13.2f} {ratio:>6.2f} {low:>6.2f}–{high:<6.2f}")
        if row.vllm is not None:
            vratio, vlow, vhigh = row.kvtier.versus(row.vllm)
            line += (f" | {row.vllm_mode:>9} {row.vllm.gib_per_s:>11.2f} {vratio:>12.2f} "
                     f"{vlow:>6.2f}–{vhigh:<6.2f}")
        print(line)
    # Where the cores are all busy (page-cache I/O on a small machine) throughput is CPU per byte
    # turned upside down: this table shows what each contender spends, and two parts of kvtier's
    # figure — its event-loop thread, and the xxh3 checksum that raw and vLLM do not compute.
    print()
    print("CPU per GiB moved, ms (the whole process, user + system, all threads; median of the trials)")
    header = f"{'chunk':>8} {'op':>6} {'I/O mode':>9} {'raw':>7}" + (f" {'vLLM':>7}" if with_vllm else "")
    header += f" {'kvtier':>7} {'kvtier/raw':>11}" + (f" {'kvtier/vLLM':>12}" if with_vllm else "")
    header += f" | {'kvtier loop':>11}" + (f" {'vLLM submit':>11}" if with_vllm else "")
    header += f" {'xxh3 hot':>9} {'xxh3 cold':>10}"
    print(header)
    for row in rows:
        ours = row.kvtier.cpu_ms_per_gib
        line = f"{row.chunk_kib:>4} KiB {row.op:>6} {row.mode:>9} {row.raw.cpu_ms_per_gib:>7.0f}"
        if with_vllm:
            line += f" {row.vllm.cpu_ms_per_gib:>7.0f}" if row.vllm is not None else f" {'-':>7}"
        line += f" {ours:>7.0f} {ours / row.raw.cpu_ms_per_gib:>11.2f}"
        if with_vllm:
            line += f" {ours / row.vllm.cpu_ms_per_gib:>12.2f}" if row.vllm is not None else f" {'-':>12}"
        hot, cold = row.xxh3_ms_per_gib
        line += f" | {row.kvtier.thread_cpu_ms_per_gib:>11.0f}"
        if with_vllm:  # the thread that submits vLLM's jobs and waits in drain_jobs
            line += f" {row.vllm.thread_cpu_ms_per_gib:>11.0f}" if row.vllm is not None else f" {'-':>11}"
        line += f" {hot:>9.0f} {cold:>10.0f}"
        print(line)
    print("xxh3: a load verifies each chunk after reading it (cache-hot after a page-cache copy, cold after "
          "O_DIRECT); a store computes it for the trailer from the host slot (cold)")
    if with_vllm:
        print("kvtier loop / vLLM submit: the CPU of kvtier's event-loop thread, and of the thread that submits "
              "vLLM's jobs and waits for them")


def print_checksummed_table(rows: list[Row]) -> None:
    """kvtier against vLLM with kvtier's checksum added (``--vllm-xxh3``): what kvtier costs
    beyond verifying, each in its own structure."""
    print()
    print("kvtier vs vLLM with xxh3-64 added to its stores and loads (vLLM+xxh3); CPU per GiB in ms")
    print(f"{'chunk':>8} {'op':>6} {'I/O mode':>9} {'vLLM+xxh3 GiB/s':>16} {'kvtier/(vLLM+xxh3)':>19} "
          f"{'trial ratios':>13} | {'vLLM':>6} {'vLLM+xxh3':>10} {'kvtier':>7} {'kvtier/(vLLM+xxh3)':>19}")
    for row in rows:
        if row.vllm_xxh3 is None or row.vllm is None:
            continue
        ratio, low, high = row.kvtier.versus(row.vllm_xxh3)
        print(f"{row.chunk_kib:>4} KiB {row.op:>6} {row.mode:>9} {row.vllm_xxh3.gib_per_s:>16.2f} {ratio:>19.2f} "
              f"{low:>6.2f}–{high:<6.2f} | {row.vllm.cpu_ms_per_gib:>6.0f} {row.vllm_xxh3.cpu_ms_per_gib:>10.0f} "
              f"{row.kvtier.cpu_ms_per_gib:>7.0f} {row.kvtier.cpu_ms_per_gib / row.vllm_xxh3.cpu_ms_per_gib:>19.2f}")


STORE_STAGES = ("containment/open", "write", "close", "trailer", "checksum", "rename/publish", "worker glue",
                "hand-off", "index+accounting", "metrics", "loop other")
LOAD_STAGES = ("containment/open", "read", "close", "trailer", "checksum", "worker glue",
               "hand-off", "index+accounting", "metrics", "loop other")

_os_stage = {"open": "containment/open", "stat": "containment/open", "fstat": "containment/open",
             "pwritev": "io", "pwrite": "io", "preadv": "io", "close": "close", "replace": "rename/publish",
             "rename": "rename/publish", "unlink": "rename/publish", "lseek": "io"}
_beneath_stage = {"open_dir": "containment/open", "open_or_make_dir": "containment/open",
                  "open_file": "containment/open", "lstat": "containment/open",
                  "remove_entry": "rename/publish"}


class Clock:
    """Per-thread accumulators of CPU time by stage, and of the calls made."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[dict[str, list[float]]] = []
        self._lock = threading.Lock()
        self.overhead = 0.0

    def table(self) -> dict[str, list[float]]:
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = defaultdict(lambda: [0.0, 0])
            with self._lock:
                self._all.append(table)
        return table

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            entry = self.table()[stage]
            start = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                entry[0] += perf() - start
                entry[1] += 1
        return timed

    def reset(self) -> None:
        with self._lock:
            for table in self._all:
                table.clear()

    def totals(self) -> dict[str, float]:
        """Seconds by stage, less the timer's own cost."""
        out: dict[str, float] = defaultdict(float)
        with self._lock:
            for table in self._all:
                for stage, (seconds, calls) in table.items():
                    out[stage] += max(0.0, seconds - calls * self.overhead)
        return out


def calibrate(clock: Clock) -> float:
    noop = clock.wrap("calibration", lambda: None)
    n = 100_000
    start = time.thread_time()
    for _ in range(n):
        noop()
    timed = time.thread_time() - start
    start = time.thread_time()
    for _ in range(n):
        (lambda: None)()
    bare = time.thread_time() - start
    return max(0.0, (timed - bare) / n)


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    """Swap the chunk code's ``os``/``beneath`` and trailer helpers for timing wrappers."""
    swaps: list[tuple[Any, str, Any]] = []

    def proxy(module: ModuleType, stages: dict[str, str]) -> SimpleNamespace:
        ns = SimpleNamespace(**{name: getattr(module, name) for name in dir(module) if not name.startswith("__")})
        for name, stage in stages.items():
            if hasattr(module, name):
                setattr(ns, name, clock.wrap(stage, getattr(module, name)))
        return ns

    swaps.append((chunks, "os", proxy(os, _os_stage)))
    beneath_proxy = proxy(chunks.beneath, _beneath_stage)
    # The load fast path's opener is prepared once per job (beneath.raw_opener): time its call.
    raw_opener = chunks.beneath.raw_opener

    def timed_raw_opener(flags: int) -> Any:
        raw = raw_opener(flags)
        return None if raw is None else raw._replace(call=clock.wrap("containment/open", raw.call))
    beneath_proxy.raw_opener = timed_raw_opener
    swaps.append((chunks, "beneath", beneath_proxy))
    for name in ("make_trailer_page", "identity", "trailer_page_for", "write_trailer"):
        if hasattr(fs_tier_module, name):
            swaps.append((fs_tier_module, name, clock.wrap("trailer", getattr(fs_tier_module, name))))
    swaps.append((chunks, "verify", clock.wrap("trailer", chunks.verify)))
    # A load slice's trailers are checked against these together (made once per slice).
    swaps.append((chunks, "expected_heads", clock.wrap("trailer", chunks.expected_heads)))
    # The checksum, timed inside the trailer code that computes it (verify, write_trailer).
    swaps.append((integrity, "_xxh3_64", clock.wrap("checksum", integrity._xxh3_64)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    for obj, name, value in swaps:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def wrap_loop_side(tier: FileSystemTier, clock: Clock) -> None:
    """Time the loop's index and metrics calls (instance attributes: this tier only)."""
    for name in ("reserve", "pin", "unpin", "pin_all", "unpin_all", "touch", "touch_or_add", "size_of",
                 "remove", "add", "pin_batch", "settle_batch", "reserve_all"):
        if hasattr(tier.index, name):
            setattr(tier.index, name, clock.wrap("index+accounting", getattr(tier.index, name)))
    for name in ("record_transfer", "set_usage", "emit_stored", "emit_removed", "_publish_usage"):
        if hasattr(tier, name):
            setattr(tier, name, clock.wrap("metrics", getattr(tier, name)))


async def profile_round(root: Path, host: SlotBuffer, geometry: Any, args: argparse.Namespace, tag: str,
                        buffered: bool, clock: Clock) -> dict[str, dict[str, float]]:
    """One tier, ``jobs`` store jobs then ``jobs`` load jobs, one at a time; µs per chunk by stage."""
    half = max(1, args.threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root / f"tier_{tag}"), "n_read_threads": half, "n_write_threads": max(1, args.threads - half)})
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    n = args.jobs * CHUNKS_PER_JOB
    keys = trial_keys(tag, n)
    out: dict[str, dict[str, float]] = {}

    async def run(is_promotion: bool) -> dict[str, float]:
        os.sync()
        clock.reset()
        loop0, cpu0 = time.thread_time(), time.process_time()
        await run_tier_jobs(tier, host, keys, args.jobs, is_promotion)
        loop_cpu, cpu = time.thread_time() - loop0, time.process_time() - cpu0
        totals = clock.totals()
        us = {stage: 1e6 * seconds / n for stage, seconds in totals.items()}
        loop_us = 1e6 * loop_cpu / n
        worker_cpu_us = 1e6 * (cpu - loop_cpu) / n
        row = {stage: us.get(stage, 0.0) for stage in ("containment/open", "close", "trailer", "rename/publish")}
        row["write" if not is_promotion else "read"] = us.get("io", 0.0)
        row["checksum"] = us.get("checksum", 0.0)
        # The trailer wrappers time the checksum of a store (and verify's of a load) too.
        row["trailer"] = max(0.0, row["trailer"] - row["checksum"])
        row["worker glue"] = max(0.0, us.get("worker", 0.0) - sum(row.values()))
        row["hand-off"] = max(0.0, worker_cpu_us - us.get("worker", 0.0))
        row["index+accounting"] = us.get("index+accounting", 0.0)
        row["metrics"] = us.get("metrics", 0.0)
        row["loop other"] = max(0.0, loop_us - row["index+accounting"] - row["metrics"])
        row["total CPU"] = 1e6 * cpu / n
        return row

    with forced_buffered(buffered), instrumented(clock):
        # The tier's per-chunk worker functions, timed whole (the glue is what the stages leave).
        worker_fns = {name: getattr(fs_tier_module, name) for name in ("_store", "_load_slice")}
        for name, fn in worker_fns.items():
            setattr(fs_tier_module, name, clock.wrap("worker", fn))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(tier.run)
                wrap_loop_side(tier, clock)
                try:
                    out["store"] = await run(False)
                    out["load"] = await run(True)
                    out["mode"] = {"o_direct": float(tier.o_direct)}
                finally:
                    await tier.aclose()
        finally:
            for name, fn in worker_fns.items():
                setattr(fs_tier_module, name, fn)
    return out


def profile_main(args: argparse.Namespace) -> None:
    """``--profile``: the per-stage table (see :func:`profile_round`) instead of the comparison."""
    clock = Clock()
    clock.overhead = calibrate(clock)
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-profile-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    print(f"fs tier per-chunk profile: CPU µs per chunk (median of {args.repeats}), {args.jobs} jobs x 64 chunks, "
          f"{args.threads} threads; stage timer {1e6 * clock.overhead:.2f} µs/call subtracted")
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                slot_bytes = kib * 1024
                geometry = geometry_for(slot_bytes)
                host = SlotBuffer(min(args.jobs * 64, 256), slot_bytes, pin_memory=False)
                try:
                    host.array[:] = 0x5A
                    anyio.run(profile_round, root, host, geometry, args, f"{kib}_{int(buffered)}_w", buffered, clock)
                    rounds = [anyio.run(profile_round, root, host, geometry, args, f"{kib}_{int(buffered)}_{r}",
                                        buffered, clock) for r in range(args.repeats)]
                finally:
                    host.close()
                mode = "O_DIRECT" if rounds[0]["mode"]["o_direct"] else "buffered"
                for op, stages in (("store", STORE_STAGES), ("load", LOAD_STAGES)):
                    cells = [f"{stage} {statistics.median(r[op][stage] for r in rounds):.1f}"
                             for stage in stages + ("total CPU",)]
                    print(f"{kib:>5} KiB {mode:>8} {op:>5}: " + " | ".join(cells))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def loop_round(root: Path, host: SlotBuffer, geometry: KVGeometry, args: argparse.Namespace,
                     buffered: bool) -> tuple[dict[str, list[tuple[float, float, float]]], bool]:
    """``--loop``: per way of answering the pool (see the module docstring), per trial: the loop's
    CPU µs per job, its selector polls per job, and the process's CPU µs per chunk; and whether
    the tier chose ``O_DIRECT``."""
    half = max(1, args.threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root / "tier_loop"), "n_read_threads": half, "n_write_threads": max(1, args.threads - half)})
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    keys = trial_keys("loop", args.jobs * CHUNKS_PER_JOB)
    pool = tier._pool  # the tier's I/O pool: its run_slices is what the three ways replace
    real = pool.run_slices

    async def workers_only(queue: Any, fn: Any, items: Any) -> Any:
        return await real(queue, lambda part: [integrity.ACCEPTED_VERIFIED] * len(part), items)

    async def no_threads(queue: Any, fn: Any, items: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        return [integrity.ACCEPTED_VERIFIED] * len(items)

    ways: dict[str, Any] = {"real reads": real, "pool, no I/O": workers_only, "no pool": no_threads}
    out: dict[str, list[tuple[float, float, float, float]]] = {way: [] for way in ways}
    polls, in_select = [0], [0.0]
    with forced_buffered(buffered):
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            try:
                await run_tier_jobs(tier, host, keys, args.jobs, False)
                selector = getattr(asyncio_loop_or_none(), "_selector", None)  # asyncio's: count its polls
                if selector is not None:
                    select = selector.select

                    def counted(timeout: float | None = None) -> Any:
                        polls[0] += 1
                        before = time.thread_time()
                        try:
                            return select(timeout)
                        finally:
                            in_select[0] += time.thread_time() - before
                    selector.select = counted
                for _ in range(3):  # warm-up
                    await run_tier_jobs(tier, host, keys, args.jobs, True)
                for r in range(args.repeats * 8):
                    for way, call in ways.items():
                        pool.run_slices = call  # type: ignore[method-assign]
                        polls[0], in_select[0] = 0, 0.0
                        loop0, cpu0 = time.thread_time(), time.process_time()
                        await run_tier_jobs(tier, host, keys, args.jobs, True)
                        loop_cpu, cpu = time.thread_time() - loop0, time.process_time() - cpu0
                        out[way].append((1e6 * loop_cpu / args.jobs, polls[0] / args.jobs,
                                         1e6 * cpu / (args.jobs * CHUNKS_PER_JOB), 1e6 * in_select[0] / args.jobs))
            finally:
                pool.run_slices = real  # type: ignore[method-assign]
                await tier.aclose()
    shutil.rmtree(root / "tier_loop")
    return out, tier.o_direct


def asyncio_loop_or_none() -> asyncio.AbstractEventLoop | None:
    """The running asyncio event loop, or None on another backend."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def loop_main(args: argparse.Namespace) -> None:
    """``--loop``: the loop's CPU per load job three ways (see :func:`loop_round`)."""
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-loop-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    print(f"fs tier, the event loop per load job: {args.jobs} jobs x 64 chunks at a time, {args.threads} threads, "
          f"median of {args.repeats * 8} rotations")
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                slot_bytes = kib * 1024
                host = SlotBuffer(min(args.jobs * 64, 256), slot_bytes, pin_memory=False)
                try:
                    host.array[:] = 0x5A
                    rows, o_direct = anyio.run(loop_round, root, host, geometry_for(slot_bytes), args, buffered)
                finally:
                    host.close()
                for way, trials in rows.items():
                    loop_us, polls, cpu_us, select_us = (statistics.median(t[i] for t in trials) for i in range(4))
                    print(f"{kib:>5} KiB {'O_DIRECT' if o_direct else 'buffered':>8} {way:>13}: loop {loop_us:5.0f} µs/job "
                          f"({loop_us / CHUNKS_PER_JOB:4.1f} µs/chunk), {polls:.1f} selector polls/job "
                          f"({select_us:3.0f} µs in them); process {cpu_us:5.1f} µs/chunk")
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Crew:
    """``n`` threads that live as long as the crew and run ``fn(t, lo, hi)`` over contiguous shares
    of ``range(total)`` (thread ``t`` gets the ``t``-th), released together: a worker's per-thread
    state (the slice loader's scratch rows, a trailer page) is made once, as in the tier's pool,
    not in every timed run."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._job: tuple[Callable[[int, int, int], None], int] | None = None
        self._start = threading.Barrier(n + 1)
        self._end = threading.Barrier(n + 1)
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._serve, args=(t,), daemon=True) for t in range(n)]
        for thread in self._threads:
            thread.start()

    def _serve(self, t: int) -> None:
        while True:
            self._start.wait()
            job = self._job
            if job is None:
                return
            fn, total = job
            try:
                fn(t, t * total // self._n, (t + 1) * total // self._n)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                self._errors.append(exc)
            self._end.wait()

    def run(self, fn: Callable[[int, int, int], None], total: int) -> Timing:
        self._job = (fn, total)
        watch = Stopwatch()
        self._start.wait()
        self._end.wait()
        timing = watch.stop()
        if self._errors:
            raise self._errors.pop()
        return timing

    def close(self) -> None:
        self._job = None
        self._start.wait()
        for thread in self._threads:
            thread.join()


#: ``--worker``'s ways of reading a chunk, each one step closer to the tier's slice loader.
WORKER_WAYS = ("open+read", "+xxh3-64", "+trailer, openat2", "slice loader")


async def stored_tier_files(root: Path, host: SlotBuffer, geometry: KVGeometry, args: argparse.Namespace,
                            keys: list[bytes], buffered: bool) -> tuple[str, bool, bytes]:
    """Store ``keys`` (from the host's slots) through a real fs tier under ``root``; its blocks
    directory, whether it chose ``O_DIRECT``, and its run fingerprint."""
    half = max(1, args.threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root), "n_read_threads": half, "n_write_threads": max(1, args.threads - half)})
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    with forced_buffered(buffered):
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            try:
                await run_tier_jobs(tier, host, keys, len(keys) // CHUNKS_PER_JOB, False)
            finally:
                await tier.aclose()
    return tier.namespace.blocks_dir, tier.o_direct, tier.namespace.fingerprint


def worker_round(root: Path, host: SlotBuffer, geometry: KVGeometry, args: argparse.Namespace, buffered: bool,
                 threads: int) -> tuple[dict[str, list[Timing]], bool, int]:
    """``--worker``: the tier's chunk files read :data:`WORKER_WAYS` in ``threads`` threads, in
    rotation; per way its timings, whether the files are read with ``O_DIRECT``, and the chunk count."""
    n = host.num_slots - host.num_slots % CHUNKS_PER_JOB
    keys = trial_keys("worker", n)
    blocks_dir, o_direct, fingerprint = anyio.run(stored_tier_files, root / "tier_worker", host, geometry, args,
                                                   keys, buffered)
    views = [host.view(i) for i in range(n)]
    relpaths = Namespace.chunk_relpaths(keys)  # made before the clock: the loader makes its own
    paths = [os.path.join(os.fsencode(blocks_dir), relpath) for relpath in relpaths]
    plain_flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if o_direct else 0)  # as vLLM opens
    raw = beneath.raw_opener(plain_flags | getattr(os, "O_NOATIME", 0))  # as the loader opens
    if raw is None:
        raise SystemExit("--worker needs openat2 (Linux 5.6 or later): the slice loader declines every chunk without it")
    openat2, nr, how, how_size = raw
    loader = chunks.slice_loader(o_direct, fingerprint)
    # Per thread: a page for the trailer and a spare one after it (page aligned, as O_DIRECT needs).
    scratch = [mmap.mmap(-1, 2 * chunks.TRAILER_PAGE) for _ in range(threads)]
    pages = [(memoryview(m)[: chunks.TRAILER_PAGE], memoryview(m)[chunks.TRAILER_PAGE :]) for m in scratch]
    dir_fd = os.open(blocks_dir, os.O_RDONLY | os.O_DIRECTORY)
    preadv, close = os.preadv, os.close

    def plain(t: int, lo: int, hi: int) -> None:  # vLLM's way: open the path, read the payload
        for i in range(lo, hi):
            fd = os.open(paths[i], plain_flags)
            try:
                preadv(fd, [views[i]], 0)
            finally:
                close(fd)

    def hashed(t: int, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            fd = os.open(paths[i], plain_flags)
            try:
                preadv(fd, [views[i]], 0)
            finally:
                close(fd)
            checksum(views[i])

    def verifying_calls(t: int, lo: int, hi: int) -> None:  # what the loader asks of the kernel, no more
        page, spare = pages[t]
        for i in range(lo, hi):
            fd = openat2(nr, dir_fd, relpaths[i], how, how_size)
            try:
                preadv(fd, [views[i], page, spare], 0)
            finally:
                close(fd)
            checksum(views[i])

    def sliced(t: int, lo: int, hi: int) -> None:
        for start in range(lo, hi, CHUNKS_PER_JOB):
            end = min(hi, start + CHUNKS_PER_JOB)
            if not all(loader(dir_fd, keys[start:end], views[start:end])):
                raise RuntimeError("the slice loader refused a chunk the tier had just stored")

    ways = dict(zip(WORKER_WAYS, (plain, hashed, verifying_calls, sliced)))
    out: dict[str, list[Timing]] = {way: [] for way in ways}
    crew = Crew(threads)
    try:
        for fn in ways.values():  # warm-up: every thread's scratch made, the tree's dentries cached
            crew.run(fn, n)
        names = list(ways)
        for r in range(args.repeats * 8):
            for way in names[r % len(names):] + names[: r % len(names)]:
                out[way].append(crew.run(ways[way], n))
    finally:
        crew.close()
        os.close(dir_fd)
        shutil.rmtree(root / "tier_worker")
    return out, o_direct, n


def worker_main(args: argparse.Namespace) -> None:
    """``--worker``: a worker's chunk read taken apart (see :func:`worker_round`)."""
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-worker-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    print(f"fs tier, a worker's chunk read taken apart: the tier's own files, CPU µs per chunk (wall µs per chunk "
          f"in brackets), median of {args.repeats * 8} rotations")
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                slot_bytes = kib * 1024
                for threads in sorted({1, args.threads}):
                    host = SlotBuffer(min(args.jobs * 64, 256), slot_bytes, pin_memory=False)
                    try:
                        host.array[:] = 0x5A
                        rows, o_direct, n = worker_round(root, host, geometry_for(slot_bytes), args, buffered, threads)
                    finally:
                        host.close()
                    cpu = {way: 1e6 * statistics.median(t.cpu for t in trials) / n for way, trials in rows.items()}
                    wall = {way: 1e6 * statistics.median(t.wall for t in trials) / n for way, trials in rows.items()}
                    mode = "O_DIRECT" if o_direct else "buffered"
                    cells = "  ".join(f"{way} {cpu[way]:5.1f} ({wall[way]:5.1f})" for way in WORKER_WAYS)
                    print(f"{kib:>5} KiB {mode:>8} {threads} thread{'s' if threads > 1 else ' '}: {cells}")
                    checksum_us, calls_us, python_us = (cpu[b] - cpu[a] for a, b in zip(WORKER_WAYS, WORKER_WAYS[1:]))
                    print(f"{'':>28}checksum {checksum_us:5.1f}, the verification's system calls {calls_us:5.1f}, "
                          f"the loader's Python {python_us:5.1f} µs/chunk")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    logging.getLogger("kvtier.tiers.fs.tier").setLevel(logging.ERROR)  # the unbounded-tier warning
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="directory to write in (default: a temp dir under /tmp)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs of 64 chunks per trial")
    parser.add_argument("--threads", type=int, default=4, help="total I/O threads (raw, kvtier and vLLM alike)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved trials per figure")
    parser.add_argument("--mode", choices=("auto", "buffered", "both"), default="both",
                        help="auto: each tier probes O_DIRECT and raw uses kvtier's choice; buffered: page cache")
    parser.add_argument("--sizes", default="256,2048", help="chunk sizes in KiB, comma separated")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison even if importable")
    parser.add_argument("--vllm-xxh3", action="store_true",
                        help="also run vLLM with kvtier's checksum added to its stores and loads (what verifying "
                             "costs in vLLM's own structure), and compare kvtier with that")
    parser.add_argument("--profile", action="store_true",
                        help="print the per-stage profile of kvtier's store and load paths instead of the comparison")
    parser.add_argument("--loop", action="store_true",
                        help="print the event loop's CPU per load job with real reads, with the pool answering "
                             "at once, and with no pool, instead of the comparison")
    parser.add_argument("--worker", action="store_true",
                        help="print a worker's chunk read taken apart (plain read, checksum, the verification's "
                             "system calls, the slice loader), in one thread and in --threads, instead of the "
                             "comparison")
    args = parser.parse_args()
    reports = [name for name in ("--profile", "--loop", "--worker") if getattr(args, name[2:])]
    if len(reports) > 1:
        parser.error(f"{' and '.join(reports)} are separate reports: give one")
    if args.worker:
        gc.collect()
        gc.freeze()
        worker_main(args)
        return
    if args.loop:
        gc.collect()
        gc.freeze()
        loop_main(args)
        return
    if args.profile:
        gc.collect()
        gc.freeze()
        profile_main(args)
        return

    vllm, why_not = (None, "--no-vllm given") if args.no_vllm else load_vllm()
    if args.vllm_xxh3 and vllm is None:
        parser.error(f"--vllm-xxh3 runs vLLM with kvtier's checksum, but {why_not}")
    if vllm is not None:
        # Its O_DIRECT fallback warning is reported in the table instead.
        logging.getLogger("vllm.v1.kv_offload.tiering.fs.manager").setLevel(logging.ERROR)
    # As vLLM's engine core does once it has started (``freeze_gc_heap``): move everything alive now
    # (torch, vLLM, numpy: ~170k objects) out of the collector's reach. Otherwise a full collection
    # (~70 ms here) lands inside whichever trial happens to trigger it — most often kvtier's, which
    # allocates the most small objects — and measures the import graph rather than the tier.
    gc.collect()
    gc.freeze()
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-bench-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    rows: list[Row] = []
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                rows += measure(root, kib * 1024, args, buffered, vllm)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    contenders = "raw, kvtier" + (f" and vLLM {vllm.version}" if vllm is not None else "")
    print(f"fs tier: {contenders}, {args.jobs} jobs x {CHUNKS_PER_JOB} chunks, {args.threads} threads, "
          f"median of {args.repeats} interleaved trials, {usable_cpus()} usable cores, root {root}")
    print_tables(rows, vllm is not None)
    if any(row.vllm_xxh3 is not None for row in rows):
        print_checksummed_table(rows)
    if vllm is None:
        print(f"{why_not}: the comparison with vLLM's fs tier was skipped")


if __name__ == "__main__":
    main()

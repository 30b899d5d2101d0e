"""Throughput of the filesystem tier against raw file I/O, in the same process and directory.

For each chunk size (256 KiB and 2 MiB, 64 chunks per job) it measures, interleaved trial by
trial (the order alternates each repeat, and dirty pages are flushed with ``os.sync()`` outside
the timed regions, so writeback of one trial does not land in the next):

* **raw**: the same number of threads as the tier's pool doing plain ``open``/``os.pwrite``/
  ``os.replace`` (store) and ``open``/``os.preadv`` (load) of the same bytes to the same file
  paths (the tier's ``<hhh>/<hh>_g0/<hash>.bin`` tree, parent directories created with
  ``os.makedirs(exist_ok=True)``), with the SAME I/O mode as the tier (``O_DIRECT`` or buffered);
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

    python benchmarks/fs_tier.py [--root DIR] [--jobs 4] [--threads 4] [--repeats 7] [--mode both]
                                 [--sizes 256,2048] [--no-vllm]
    /tmp/vllm-venv/bin/python benchmarks/fs_tier.py      # with vLLM in a side virtualenv
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.config import TierConfig
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry, namespace
from kvtier.tiers import fs_io
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.fs import FileSystemTier
from kvtier.tiers.slots import SlotBuffer

CHUNKS_PER_JOB = 64
GiB = float(1 << 30)


def geometry_for(slot_bytes: int) -> KVGeometry:
    # page = 2 * 16 tokens * 8 heads * 128 dim * 2 bytes = 64 KiB; layers set the chunk size.
    return KVGeometry("bench/model", num_layers=slot_bytes // 65536, num_kv_heads=8, head_dim=128,
                      dtype="float16", block_size=16)


def trial_keys(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def raw_round(root: Path, host: SlotBuffer, geometry: KVGeometry, n_chunks: int, threads: int, tag: str,
              o_direct: bool) -> tuple[float, float]:
    """Seconds for plain store and load of ``n_chunks`` slots with ``threads`` threads."""
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

    with ThreadPoolExecutor(threads) as pool:
        os.sync()
        t0 = time.perf_counter()
        list(pool.map(put, range(n_chunks)))
        t1 = time.perf_counter()
        os.sync()
        t2 = time.perf_counter()
        list(pool.map(get, range(n_chunks)))
        t3 = time.perf_counter()
    shutil.rmtree(root / f"raw_{tag}")
    return t1 - t0, t3 - t2


@contextlib.contextmanager
def forced_buffered(enabled: bool) -> Iterator[None]:
    """Make the tier's O_DIRECT probe answer "no" (page-cache I/O) while enabled."""
    if not enabled:
        yield
        return
    probe = fs_io.probe_o_direct
    fs_io.probe_o_direct = lambda directory: False  # type: ignore[assignment]
    try:
        yield
    finally:
        fs_io.probe_o_direct = probe  # type: ignore[assignment]


class VllmFs:
    """vLLM's fs tier modules, imported only when ``vllm`` is present (nothing else here needs it)."""

    def __init__(self) -> None:
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.tiering import base as tiering_base
        from vllm.v1.kv_offload.tiering.fs import manager

        self.base: ModuleType = base
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


def vllm_round(vllm: VllmFs, root: Path, host: SlotBuffer, geometry: KVGeometry, jobs: int, threads: int,
               tag: str, buffered: bool) -> tuple[float, float, bool]:
    """Seconds for ``jobs`` store jobs then ``jobs`` load jobs of 64 chunks through vLLM's fs tier."""
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

    def run_jobs(is_promotion: bool) -> float:
        os.sync()
        t0 = time.perf_counter()
        for j in range(jobs):
            slots = [(j * CHUNKS_PER_JOB + i) % host.num_slots for i in range(CHUNKS_PER_JOB)]
            job = vllm.tiering.TransferJob(
                job_id=j + (1000 if is_promotion else 0), keys=keys[j * CHUNKS_PER_JOB:(j + 1) * CHUNKS_PER_JOB],
                chunk_ids=np.asarray(slots, dtype=np.int32), is_promotion=is_promotion, req_context=req)
            (tier.submit_load if is_promotion else tier.submit_store)(job)
        tier.drain_jobs()  # blocks on its pool's condition until every job's task has finished
        elapsed = time.perf_counter() - t0
        results = list(tier.get_finished_jobs())
        if len(results) != jobs or not all(r.success for r in results):
            raise RuntimeError(f"vLLM benchmark job failed: {results}")
        return elapsed

    try:
        store_s = run_jobs(False)
        load_s = run_jobs(True)
    finally:
        tier.shutdown()
    o_direct = bool(tier._use_o_direct)  # no public accessor; it logs its choice only on fallback
    shutil.rmtree(root / f"vllm_{tag}")
    return store_s, load_s, o_direct


async def tier_round(root: Path, host: SlotBuffer, geometry: KVGeometry, jobs: int, threads: int,
                     tag: str, buffered: bool) -> tuple[float, float, bool]:
    """Seconds for ``jobs`` store jobs then ``jobs`` load jobs of 64 chunks through the tier."""
    half = max(1, threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root / f"tier_{tag}"), "n_read_threads": half, "n_write_threads": max(1, threads - half),
    })
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    keys = trial_keys(tag, jobs * CHUNKS_PER_JOB)

    async def run_jobs(is_promotion: bool) -> float:
        wake = anyio.Event()

        def wakeup() -> None:
            wake.set()

        tier.set_wakeup(wakeup)
        os.sync()
        t0 = time.perf_counter()
        for j in range(jobs):
            job_keys = keys[j * CHUNKS_PER_JOB:(j + 1) * CHUNKS_PER_JOB]
            slots = [(j * CHUNKS_PER_JOB + i) % host.num_slots for i in range(CHUNKS_PER_JOB)]
            job = TransferJob(j + (1000 if is_promotion else 0), job_keys, slots, is_promotion)
            (tier.submit_load if is_promotion else tier.submit_store)(job)
        results: list[JobResult] = []
        while len(results) < jobs:
            await wake.wait()
            wake = anyio.Event()
            results += tier.get_finished_jobs()
        elapsed = time.perf_counter() - t0
        if not all(r.success for r in results):
            raise RuntimeError(f"benchmark job failed: {[r.failure_reason for r in results]}")
        return elapsed

    with forced_buffered(buffered):
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            try:
                store_s = await run_jobs(False)
                load_s = await run_jobs(True)
            finally:
                await tier.aclose()
    o_direct = tier.o_direct
    shutil.rmtree(root / f"tier_{tag}")
    return store_s, load_s, o_direct


def median_rate(total: float, seconds: list[tuple[float, float]], idx: int) -> tuple[float, list[float]]:
    rates = [total / t[idx] for t in seconds]
    return statistics.median(rates), rates


def measure(root: Path, slot_bytes: int, args: argparse.Namespace, buffered: bool,
            vllm: VllmFs | None) -> list[tuple[Any, ...]]:
    """Interleaved raw/tier(/vLLM) trials for one chunk size and mode; one table row per operation."""
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
        raw_s: list[tuple[float, float]] = []
        tier_s: list[tuple[float, float]] = []
        vllm_s: list[tuple[float, float]] = []
        for r in range(args.repeats):
            tag = f"{slot_bytes}_{int(buffered)}_{r}"

            def raw(tag: str = tag) -> None:
                raw_s.append(raw_round(root, host, geometry, n_chunks, args.threads, tag, o_direct))

            def tier(tag: str = tag) -> None:
                *times, chosen = anyio.run(tier_round, root, host, geometry, args.jobs, args.threads, tag, buffered)
                assert chosen == o_direct
                tier_s.append(tuple(times))  # type: ignore[arg-type]

            def theirs(tag: str = tag) -> None:
                assert vllm is not None
                *times, chosen = vllm_round(vllm, root, host, geometry, args.jobs, args.threads, tag, buffered)
                assert chosen == vllm_o_direct
                vllm_s.append(tuple(times))  # type: ignore[arg-type]

            # Rotate the order each repeat so no contender always runs first (cold) or after a given one.
            trials: list[Callable[..., None]] = [raw, tier] + ([theirs] if vllm is not None else [])
            shift = r % len(trials)
            for trial in trials[shift:] + trials[:shift]:
                trial()
    finally:
        host.close()
    total = n_chunks * slot_bytes / GiB
    rows = []
    for idx, op in ((0, "store"), (1, "load")):
        raw_med, raw_rates = median_rate(total, raw_s, idx)
        tier_med, tier_rates = median_rate(total, tier_s, idx)
        paired = [ours / base for ours, base in zip(tier_rates, raw_rates)]
        row: tuple[Any, ...] = (f"{slot_bytes // 1024} KiB", op, "O_DIRECT" if o_direct else "buffered",
                                raw_med, tier_med, tier_med / raw_med, min(paired), max(paired))
        if vllm is not None:
            vllm_med, vllm_rates = median_rate(total, vllm_s, idx)
            versus = [ours / theirs for ours, theirs in zip(tier_rates, vllm_rates)]
            row += ("O_DIRECT" if vllm_o_direct else "buffered", vllm_med, tier_med / vllm_med,
                    min(versus), max(versus))
        rows.append(row)
    return rows


def main() -> None:
    logging.getLogger("kvtier.tiers.fs").setLevel(logging.ERROR)  # the unbounded-tier warning
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="directory to write in (default: a temp dir under /tmp)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs of 64 chunks per trial")
    parser.add_argument("--threads", type=int, default=4, help="total I/O threads (raw, kvtier and vLLM alike)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved trials per figure")
    parser.add_argument("--mode", choices=("auto", "buffered", "both"), default="both",
                        help="auto: each tier probes O_DIRECT and raw uses kvtier's choice; buffered: page cache")
    parser.add_argument("--sizes", default="256,2048", help="chunk sizes in KiB, comma separated")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison even if importable")
    args = parser.parse_args()

    vllm, why_not = (None, "--no-vllm given") if args.no_vllm else load_vllm()
    if vllm is not None:
        # Its O_DIRECT fallback warning is reported in the table instead.
        logging.getLogger("vllm.v1.kv_offload.tiering.fs.manager").setLevel(logging.ERROR)
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-bench-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    rows: list[tuple[Any, ...]] = []
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                rows += measure(root, kib * 1024, args, buffered, vllm)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    contenders = "raw, kvtier" + (f" and vLLM {vllm.version}" if vllm is not None else "")
    print(f"fs tier: {contenders}, {args.jobs} jobs x {CHUNKS_PER_JOB} chunks, {args.threads} threads, "
          f"median of {args.repeats} interleaved trials, root {root}")
    header = (f"{'chunk':>8} {'op':>6} {'I/O mode':>9} {'raw GiB/s':>10} {'kvtier GiB/s':>13} {'ratio':>6} "
              f"{'trial ratios':>13}")
    if vllm is not None:
        header += f" | {'vLLM mode':>9} {'vLLM GiB/s':>11} {'kvtier/vLLM':>12} {'trial ratios':>13}"
    print(header)
    for chunk, op, mode, raw, ours, ratio, low, high, *theirs in rows:
        line = f"{chunk:>8} {op:>6} {mode:>9} {raw:>10.2f} {ours:>13.2f} {ratio:>6.2f} {low:>6.2f}–{high:<6.2f}"
        if theirs:
            vmode, vrate, vratio, vlow, vhigh = theirs
            line += f" | {vmode:>9} {vrate:>11.2f} {vratio:>12.2f} {vlow:>6.2f}–{vhigh:<6.2f}"
        print(line)
    if vllm is None:
        print(f"{why_not}: the comparison with vLLM's fs tier was skipped")


if __name__ == "__main__":
    main()

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
If ``vllm`` is importable its fs tier would be measured too; otherwise that is reported skipped.

    python benchmarks/fs_tier.py [--root DIR] [--jobs 4] [--threads 4] [--repeats 7] [--mode both]
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvtier.tiers.fs_io as fs_io  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.keys import make_offload_key  # noqa: E402
from kvtier.layout import KVGeometry, namespace  # noqa: E402
from kvtier.tiers.base import JobResult, TierContext, TransferJob  # noqa: E402
from kvtier.tiers.fs import FileSystemTier  # noqa: E402
from kvtier.tiers.slots import SlotBuffer  # noqa: E402

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


def measure(root: Path, slot_bytes: int, args: argparse.Namespace, buffered: bool) -> list[tuple[Any, ...]]:
    """Interleaved raw/tier trials for one chunk size and mode; one table row per operation."""
    geometry = geometry_for(slot_bytes)
    assert geometry.slot_bytes(1) == slot_bytes
    n_chunks = args.jobs * CHUNKS_PER_JOB
    host = SlotBuffer(min(n_chunks, 256), slot_bytes, pin_memory=False)
    try:
        host.array[:] = 0x5A  # touch every page before timing
        for i in range(host.num_slots):
            host.view(i)[:8] = i.to_bytes(8, "little")
        # Warm-up (directories, code paths), not timed; it also tells which mode the tier picks.
        *_, o_direct = anyio.run(tier_round, root, host, geometry, 1, args.threads, f"{slot_bytes}_w", buffered)
        raw_s: list[tuple[float, float]] = []
        tier_s: list[tuple[float, float]] = []
        for r in range(args.repeats):
            tag = f"{slot_bytes}_{int(buffered)}_{r}"

            def raw() -> None:
                raw_s.append(raw_round(root, host, geometry, n_chunks, args.threads, tag, o_direct))

            def tier() -> None:
                *times, chosen = anyio.run(tier_round, root, host, geometry, args.jobs, args.threads, tag, buffered)
                assert chosen == o_direct
                tier_s.append(tuple(times))  # type: ignore[arg-type]

            for trial in ((raw, tier) if r % 2 == 0 else (tier, raw)):
                trial()
    finally:
        host.close()
    total = n_chunks * slot_bytes / GiB
    rows = []
    for idx, op in ((0, "store"), (1, "load")):
        raw_rates = [total / t[idx] for t in raw_s]
        tier_rates = [total / t[idx] for t in tier_s]
        paired = [ours / base for ours, base in zip(tier_rates, raw_rates)]
        rows.append((f"{slot_bytes // 1024} KiB", op, "O_DIRECT" if o_direct else "buffered",
                     statistics.median(raw_rates), statistics.median(tier_rates),
                     statistics.median(tier_rates) / statistics.median(raw_rates), min(paired), max(paired)))
    return rows


def main() -> None:
    logging.getLogger("kvtier.tiers.fs").setLevel(logging.ERROR)  # the unbounded-tier warning
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="directory to write in (default: a temp dir under /tmp)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs of 64 chunks per trial")
    parser.add_argument("--threads", type=int, default=4, help="total I/O threads (raw and tier alike)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved raw/tier trials per figure")
    parser.add_argument("--mode", choices=("auto", "buffered", "both"), default="both",
                        help="auto: the tier probes O_DIRECT and raw uses its choice; buffered: page cache")
    parser.add_argument("--sizes", default="256,2048", help="chunk sizes in KiB, comma separated")
    args = parser.parse_args()

    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-bench-"))
    modes = {"auto": [False], "buffered": [True], "both": [False, True]}[args.mode]
    rows: list[tuple[Any, ...]] = []
    try:
        for buffered in modes:
            for kib in (int(x) for x in args.sizes.split(",")):
                rows += measure(root, kib * 1024, args, buffered)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"fs tier vs raw, {args.jobs} jobs x {CHUNKS_PER_JOB} chunks, {args.threads} threads, "
          f"median of {args.repeats} interleaved trials, root {root}")
    print(f"{'chunk':>8} {'op':>6} {'I/O mode':>9} {'raw GiB/s':>10} {'kvtier GiB/s':>13} {'ratio':>6} "
          f"{'trial ratios':>13}")
    for chunk, op, mode, raw, ours, ratio, low, high in rows:
        print(f"{chunk:>8} {op:>6} {mode:>9} {raw:>10.2f} {ours:>13.2f} {ratio:>6.2f} {low:>6.2f}–{high:<6.2f}")
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not importable: the comparison with vLLM's fs tier was skipped")
    else:
        print("vllm is importable, but driving its fs tier needs a full vLLM config; comparison not run")


if __name__ == "__main__":
    main()

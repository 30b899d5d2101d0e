"""Throughput of the filesystem tier against raw file I/O, in the same process and directory.

For each chunk size (256 KiB and 2 MiB, 64 chunks per job) it measures:

* **raw**: the same number of threads as the tier's pool doing plain ``open``/``os.pwrite``/
  ``os.replace`` (store) and ``open``/``os.preadv`` (load) of the same bytes;
* **kvtier**: ``FileSystemTier`` store and load jobs (atomic publish, trailer, xxh3 checksum,
  dual-queue pool, O_DIRECT when the filesystem allows it unless ``--buffered``),

and prints GiB/s and the ratio kvtier / raw (target ≥ 0.85). Each figure is the median of
``--repeats`` rounds; every round writes fresh keys, so no store is skipped as already present.
If ``vllm`` is importable its fs tier would be measured too; otherwise that is reported skipped.

    python benchmarks/fs_tier.py [--root DIR] [--jobs 4] [--threads 4] [--repeats 3] [--buffered]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.config import TierConfig  # noqa: E402
from kvtier.keys import make_offload_key  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402
from kvtier.tiers.base import JobResult, TierContext, TransferJob  # noqa: E402
from kvtier.tiers.fs import FileSystemTier  # noqa: E402
from kvtier.tiers.slots import SlotBuffer  # noqa: E402

CHUNKS_PER_JOB = 64
GiB = float(1 << 30)


def geometry_for(slot_bytes: int) -> KVGeometry:
    # page = 2 * 16 tokens * 8 heads * 128 dim * 2 bytes = 64 KiB; layers set the chunk size.
    return KVGeometry("bench/model", num_layers=slot_bytes // 65536, num_kv_heads=8, head_dim=128,
                      dtype="float16", block_size=16)


def raw_round(root: Path, host: SlotBuffer, n_chunks: int, threads: int, tag: str) -> tuple[float, float]:
    """Seconds for plain store and load of ``n_chunks`` slots with ``threads`` threads."""
    d = root / f"raw_{tag}"
    d.mkdir(parents=True)
    paths = [str(d / f"{i:06d}.bin") for i in range(n_chunks)]

    def put(i: int) -> None:
        tmp = paths[i] + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.pwrite(fd, host.view(i % host.num_slots), 0)
        finally:
            os.close(fd)
        os.replace(tmp, paths[i])

    def get(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [host.view(i % host.num_slots)], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(n_chunks)))
        t1 = time.perf_counter()
        list(pool.map(get, range(n_chunks)))
        t2 = time.perf_counter()
    shutil.rmtree(d)
    return t1 - t0, t2 - t1


async def tier_round(root: Path, host: SlotBuffer, geometry: KVGeometry, jobs: int, threads: int,
                     tag: str, buffered: bool) -> tuple[float, float, bool]:
    """Seconds for ``jobs`` store jobs then ``jobs`` load jobs of 64 chunks through the tier."""
    half = max(1, threads // 2)
    config = TierConfig(index=0, type="fs", options={
        "root_dir": str(root / f"tier_{tag}"), "n_read_threads": half, "n_write_threads": threads - half,
    })
    context = TierContext(index=0, label="1:fs", slot_bytes=host.slot_bytes, host=host, geometry=geometry,
                          blocks_per_chunk=1, run_fields=geometry.run_fields(1))
    tier = FileSystemTier(config, context)
    if buffered:
        import kvtier.tiers.fs_io as fs_io

        fs_io_probe = fs_io.probe_o_direct
        fs_io.probe_o_direct = lambda directory: False  # type: ignore[assignment]
    keys = [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest())
            for i in range(jobs * CHUNKS_PER_JOB)]

    async def run_jobs(is_promotion: bool) -> float:
        wake = anyio.Event()

        def wakeup() -> None:
            wake.set()

        tier.set_wakeup(wakeup)
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

    try:
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            try:
                store_s = await run_jobs(False)
                load_s = await run_jobs(True)
            finally:
                await tier.aclose()
    finally:
        if buffered:
            fs_io.probe_o_direct = fs_io_probe  # type: ignore[assignment]
    o_direct = tier.o_direct
    shutil.rmtree(root / f"tier_{tag}")
    return store_s, load_s, o_direct


def main() -> None:
    import logging

    logging.getLogger("kvtier.tiers.fs").setLevel(logging.ERROR)  # the unbounded-tier warning
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="directory to write in (default: a temp dir under /tmp)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs of 64 chunks per round")
    parser.add_argument("--threads", type=int, default=4, help="total I/O threads (raw and tier alike)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffered", action="store_true", help="disable O_DIRECT in the tier")
    args = parser.parse_args()

    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-bench-"))
    rows: list[tuple[Any, ...]] = []
    try:
        for slot_bytes in (256 * 1024, 2 * 1024 * 1024):
            geometry = geometry_for(slot_bytes)
            assert geometry.slot_bytes(1) == slot_bytes
            n_chunks = args.jobs * CHUNKS_PER_JOB
            host = SlotBuffer(min(n_chunks, 256), slot_bytes, pin_memory=False)
            host.array[:] = 0x5A  # touch every page before timing
            for i in range(host.num_slots):
                host.view(i)[:8] = i.to_bytes(8, "little")
            raw_s: list[tuple[float, float]] = []
            tier_s: list[tuple[float, float]] = []
            o_direct = False
            for r in range(args.repeats):
                raw_s.append(raw_round(root, host, n_chunks, args.threads, f"{slot_bytes}_{r}"))
                *times, o_direct = anyio.run(tier_round, root, host, geometry, args.jobs, args.threads,
                                             f"{slot_bytes}_{r}", args.buffered)
                tier_s.append(tuple(times))  # type: ignore[arg-type]
            total = n_chunks * slot_bytes / GiB
            for idx, op in ((0, "store"), (1, "load")):
                raw = total / statistics.median(t[idx] for t in raw_s)
                ours = total / statistics.median(t[idx] for t in tier_s)
                rows.append((f"{slot_bytes // 1024} KiB", op, raw, ours, ours / raw, o_direct))
            host.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"fs tier vs raw, {args.jobs} jobs x {CHUNKS_PER_JOB} chunks, {args.threads} threads, "
          f"median of {args.repeats}, root {root}")
    print(f"{'chunk':>8} {'op':>6} {'raw GiB/s':>10} {'kvtier GiB/s':>13} {'ratio':>6} {'O_DIRECT':>9}")
    for chunk, op, raw, ours, ratio, od in rows:
        print(f"{chunk:>8} {op:>6} {raw:>10.2f} {ours:>13.2f} {ratio:>6.2f} {str(od):>9}")
    if importlib.util.find_spec("vllm") is None:
        print("vllm is not importable: the comparison with vLLM's fs tier was skipped")
    else:
        print("vllm is importable, but driving its fs tier needs a full vLLM config; comparison not run")


if __name__ == "__main__":
    main()

"""``kvtier verify`` throughput vs a raw parallel read of the same files.

Writes ``--chunks`` chunk files of ``--chunk-kib`` KiB with the fs tier itself into a temporary
root, then alternates (interleaved trials, order flipped each trial) a raw read — plain threads,
each ``os.preadv`` of whole files into its own page-aligned buffer, batches of 32 files per task —
and ``kvtier verify`` (:func:`kvtier.ops.verify.verify_root`: the same files read and checked with
the tier's ``load_chunk``, trailer and xxh3 checksum included), both with ``--threads`` threads in
this process. Files are in the page cache after the first pass, so this measures the CPU cost of
verifying (open, read, checksum), not the disk. Prints GiB/s per trial, the medians and the
verify/raw ratio (target ≥ 0.8). ``verify`` GiB/s is the read-and-check phase the command
reports; ``verify+list`` includes listing the tree first.

    python benchmarks/verify.py [--chunks 256] [--chunk-kib 256] [--threads 2*cores] [--trials 5] [--passes 3]
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

import anyio  # noqa: E402

from kvtier.keys import make_offload_key  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402
from kvtier.ops.runs import discover, list_tree, open_root  # noqa: E402
from kvtier.ops.verify import verify_root  # noqa: E402
from kvtier.tiers import fs_io  # noqa: E402
from kvtier.tiers.base import TransferJob  # noqa: E402
from kvtier.tiers.slots import SlotBuffer  # noqa: E402

GIB = 1 << 30
_BATCH = 32
_job_ids = itertools.count(1)


def write_tree(root: Path, chunks: int, chunk_kib: int) -> KVGeometry:
    """``chunks`` chunk files of ``chunk_kib`` KiB (payload) written by the fs tier under ``root``."""
    from test_fs_tier import finish, make_tier, running

    # One 16-token block of 8 heads x 128 dims in fp16 is 64 KiB per layer.
    layers = max(1, chunk_kib // 64)
    geometry = KVGeometry("bench/verify", num_layers=layers, num_kv_heads=8, head_dim=128, dtype="float16",
                          block_size=16)
    slot = geometry.slot_bytes(1)
    per_job = 64

    async def main() -> None:
        host = SlotBuffer(per_job, slot, pin_memory=False)
        try:
            tier = make_tier(root, host, geometry=geometry, n_read_threads=4, n_write_threads=4, max_bytes=1 << 40)
            async with running(tier):
                for start in range(0, chunks, per_job):
                    ids = list(range(start, min(chunks, start + per_job)))
                    for s, i in enumerate(ids):
                        host.view(s)[:] = os.urandom(64) * (slot // 64)
                    keys = [make_offload_key(i.to_bytes(8, "big") + os.urandom(24), 0) for i in ids]
                    await finish(tier, [TransferJob(next(_job_ids), keys, list(range(len(ids))), is_promotion=False)])
        finally:
            host.close()

    anyio.run(main)
    return geometry


def raw_read(files: list[tuple[int, str, int]], threads: int) -> tuple[int, float]:
    """Read every file whole with ``preadv`` on ``threads`` threads; (bytes, seconds)."""
    import threading

    local = threading.local()

    def read(batch: list[tuple[int, str, int]]) -> int:
        total = 0
        for dir_fd, relpath, size in batch:
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) != size:
                buf = local.buf = memoryview(mmap.mmap(-1, size))
            fd = os.open(relpath, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                total += os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
        return total

    batches = [files[i : i + _BATCH] for i in range(0, len(files), _BATCH)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(read, batches))
    return total, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, default=256, help="chunk files")
    parser.add_argument("--chunk-kib", type=int, default=256, help="payload KiB per chunk (multiple of 64)")
    parser.add_argument("--threads", type=int, default=fs_io.usable_cpus() * 2, help="threads of both readers")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials")
    parser.add_argument("--passes", type=int, default=3, help="reads of the whole tree per trial and reader")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-verify-") as tmp:
        root = Path(tmp)
        geometry = write_tree(root, args.chunks, args.chunk_kib)
        root_fd = open_root(str(root))
        tree_fds: list[int] = []
        try:
            files: list[tuple[int, str, int]] = []
            for run in discover(root_fd).runs:
                for tree in run.trees:
                    fd = os.open(tree.name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
                    tree_fds.append(fd)
                    files += [(fd, c.relpath, c.size) for c in list_tree(root_fd, tree.name).chunks]
            total_bytes = sum(f[2] for f in files)
            print(f"{len(files)} chunk files x {geometry.slot_bytes(1) // 1024} KiB + trailer page "
                  f"({total_bytes / (1 << 20):.1f} MiB), threads {args.threads}, {fs_io.usable_cpus()} usable cores, "
                  f"page cache warm")
            raw_read(files, args.threads)  # warm the page cache
            print(f"{'trial':>5}  {'raw GiB/s':>10}  {'verify GiB/s':>12}  {'verify+list':>11}  {'ratio':>6}")
            raws, verifies, fulls = [], [], []
            for trial in range(1, args.trials + 1):
                order = ("raw", "verify") if trial % 2 else ("verify", "raw")
                for what in order:
                    if what == "raw":
                        n = secs = 0.0
                        for _ in range(args.passes):
                            bytes_read, seconds = raw_read(files, args.threads)
                            n, secs = n + bytes_read, secs + seconds
                        raws.append(n / secs / GIB)
                    else:
                        n = secs = full = 0.0
                        for _ in range(args.passes):
                            started = time.perf_counter()
                            report = verify_root(root_fd, str(root), threads=args.threads)
                            full += time.perf_counter() - started
                            assert report["ok"] == len(files) and report["problems_left"] == 0, report["counts"]
                            n, secs = n + report["bytes_read"], secs + report["elapsed_s"]
                        verifies.append(n / secs / GIB)
                        fulls.append(n / full / GIB)
                print(f"{trial:>5}  {raws[-1]:>10.2f}  {verifies[-1]:>12.2f}  {fulls[-1]:>11.2f}  "
                      f"{verifies[-1] / raws[-1]:>6.2f}")
            raw_m, ver_m, full_m = (statistics.median(v) for v in (raws, verifies, fulls))
            print(f"{'median':>5}  {raw_m:>10.2f}  {ver_m:>12.2f}  {full_m:>11.2f}  {ver_m / raw_m:>6.2f}"
                  f"   (target ratio >= 0.8)")
        finally:
            for fd in tree_fds:
                os.close(fd)
            os.close(root_fd)


if __name__ == "__main__":
    main()

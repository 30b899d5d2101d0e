"""``kvtier verify`` throughput vs a raw parallel read of the same files.

Writes ``--chunks`` chunk files of ``--chunk-kib`` KiB with the fs tier itself into a temporary
root (``--dir``), then alternates raw reads and ``kvtier verify``
(:func:`kvtier.ops.verify.verify_root`: the same files read and checked with the tier's
``load_chunk``, trailer and xxh3 checksum included, by ``--readers`` worker processes; one: this
process alone). The raw reads read every file whole with ``os.preadv`` into a page-aligned buffer
per reader, batches of 32 files per task, started (threads, buffers) before timing:

* ``raw``: ``--readers`` threads; ``raw 2x``: twice as many (on 2 cores either may be faster);
* ``raw deep``: ``--io-depth`` threads, as many reads in flight as verify keeps for files not in
  the page cache (what a disk or NFS needs);
* ``raw procs``: ``--readers`` forked processes each reading a fixed share (no interpreter lock
  shared, no work handed out: the strongest raw read of a page-cache tree).

Each trial is ``--passes`` rounds of the six reads, the order rotated every round. By default
(``--page-cache cold``) every file is evicted from the page cache before every read
(``POSIX_FADV_DONTNEED``), so this measures reading a tree from the storage: the case ``verify``
is for, since an fs tier holds what does not fit in memory (a filesystem that keeps its pages,
tmpfs, is measured warm, and says so). ``--page-cache warm`` reads a tree the page cache holds:
the CPU cost of verifying (open, copy, checksum) against the CPU cost of copying, where the
xxh3 checksum alone (``+xxh3``) costs 10-20% of the strongest raw read. Prints GiB/s per trial
and the medians; the ratio that carries the
target (>= 0.8) pairs each verify read with the read, in the same pass, of the raw method that
is fastest by median. ``verify`` GiB/s is the read-and-check phase the command reports (its
workers' start-up excluded, like the listing); ``whole`` is the whole ``verify_root`` call
(discovery, listing, starting and ending the workers): on a small tree the ~0.1 s start-up
dominates it.

    python benchmarks/verify.py [--chunks 1024] [--chunk-kib 256] [--readers cores] [--io-depth 32]
                                [--trials 5] [--passes 3] [--page-cache cold|warm] [--dir DIR]
"""
from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "support")]

import anyio  # noqa: E402
import xxhash  # noqa: E402

from kvtier.host.slots import SlotBuffer  # noqa: E402
from kvtier.keys import make_offload_key  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402
from kvtier.ops.runs import discover, list_tree, open_root  # noqa: E402
from kvtier.ops.verify import IO_DEPTH, verify_root  # noqa: E402
from kvtier.tiers.base import TransferJob  # noqa: E402
from kvtier.tiers.fs.chunks import in_memory_fs  # noqa: E402
from kvtier.tiers.fs.pool import usable_cpus  # noqa: E402
from kvtier.tiers.integrity import TRAILER_PAGE  # noqa: E402

GIB = 1 << 30
_BATCH = 32
_RAW = ("raw", "raw 2x", "raw deep", "raw procs")
_job_ids = itertools.count(1)


def write_tree(root: Path, chunks: int, chunk_kib: int) -> KVGeometry:
    """``chunks`` chunk files of ``chunk_kib`` KiB (payload) written by the fs tier under ``root``."""
    from fs_tiers import finish, make_tier, running

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


class RawReader:
    """Read every file whole with ``preadv`` on ``threads`` threads, started (and their buffers
    made) before the first timed read: like verify's workers, whose start-up its GiB/s excludes."""

    def __init__(self, threads: int) -> None:
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads)

    def close(self) -> None:
        self._pool.shutdown()

    def read(self, files: list[tuple[int, str, int]]) -> tuple[int, float]:
        """(bytes, seconds) of one read of ``files``."""
        batches = [files[i : i + _BATCH] for i in range(0, len(files), _BATCH)]
        started = time.perf_counter()
        total = sum(self._pool.map(self._read, batches))
        return total, time.perf_counter() - started

    def _read(self, batch: list[tuple[int, str, int]]) -> int:
        total = 0
        for dir_fd, relpath, size in batch:
            buf = getattr(self._local, "buf", None)
            if buf is None or len(buf) != size:
                buf = self._local.buf = memoryview(mmap.mmap(-1, size))
            fd = os.open(relpath, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                total += os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
        return total


class ForkedRawReader:
    """The raw read in ``processes`` forked processes, each reading its fixed share of the files
    (every ``processes``-th) whole with ``preadv`` into its own buffer when told to: no
    interpreter lock shared, no work handed out. Forked before any thread is started. With
    ``checksum`` each file's payload is also hashed (xxh3-64, as the trailer's checksum): the
    least any checker of these files does, and nothing else verify does (no trailer, no
    contained open, no work handed out)."""

    _parent_ends: list[int] = []  # every reader's ends of its children's pipes: no other child may hold them

    def __init__(self, files: list[tuple[int, str, int]], processes: int, *, checksum: bool = False) -> None:
        self._total = sum(size for _, _, size in files)
        self._children: list[tuple[int, int, int]] = []  # pid, its "go" pipe, its "done" pipe
        for i in range(processes):
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: read its share at each byte on its "go" pipe, until its end
                for fd in ForkedRawReader._parent_ends:  # its siblings' and other readers': their ends stay theirs
                    os.close(fd)
                os.close(go_w)
                os.close(done_r)
                share = files[i::processes]
                buf = memoryview(mmap.mmap(-1, max(size for _, _, size in share)))
                while os.read(go_r, 1):
                    for dir_fd, relpath, size in share:
                        fd = os.open(relpath, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
                        try:
                            os.preadv(fd, [buf[:size]], 0)
                        finally:
                            os.close(fd)
                        if checksum:
                            xxhash.xxh3_64_intdigest(buf[: size - TRAILER_PAGE])
                    os.write(done_w, b"d")
                os._exit(0)
            os.close(go_r)
            os.close(done_w)
            self._children.append((pid, go_w, done_r))
            ForkedRawReader._parent_ends += [go_w, done_r]

    def read(self, files: list[tuple[int, str, int]]) -> tuple[int, float]:
        """(bytes, seconds) of one read of the files given at start (``files`` is ignored)."""
        started = time.perf_counter()
        for _, go, _ in self._children:
            os.write(go, b"g")
        for _, _, done in self._children:
            os.read(done, 1)
        return self._total, time.perf_counter() - started

    def close(self) -> None:
        for pid, go, done in self._children:
            ForkedRawReader._parent_ends = [fd for fd in ForkedRawReader._parent_ends if fd not in (go, done)]
            os.close(go)  # the end of its "go" pipe: it exits
            os.close(done)
            os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, default=1024, help="chunk files")
    parser.add_argument("--chunk-kib", type=int, default=256, help="payload KiB per chunk (multiple of 64)")
    parser.add_argument("--readers", type=int, default=usable_cpus(),
                        help="readers of both: raw threads, verify workers")
    parser.add_argument("--io-depth", type=int, default=IO_DEPTH,
                        help="verify's reads in flight for files not in the page cache, and raw deep's threads")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials")
    parser.add_argument("--passes", type=int, default=3, help="reads of the whole tree per trial and reader")
    parser.add_argument("--page-cache", choices=("cold", "warm"), default="cold",
                        help="cold: every file evicted before every read (from the storage, as for a tree larger "
                             "than memory); warm: the tree in the page cache (the CPU cost of verifying)")
    parser.add_argument("--dir", default=None, help="where to make the tree (default: the temporary directory)")
    args = parser.parse_args()
    for name in ("chunks", "readers", "io_depth", "trials", "passes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.chunk_kib < 64 or args.chunk_kib % 64:
        parser.error("--chunk-kib must be a positive multiple of 64")

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-verify-", dir=args.dir) as tmp:
        root = Path(tmp)
        geometry = write_tree(root, args.chunks, args.chunk_kib)
        root_fd = open_root(str(root))
        tree_fds: list[int] = []
        readers: list[RawReader | ForkedRawReader] = []
        try:
            files: list[tuple[int, str, int]] = []
            for run in discover(root_fd).runs:
                for tree in run.trees:
                    fd = os.open(tree.name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
                    tree_fds.append(fd)
                    files += [(fd, c.relpath, c.size) for c in list_tree(root_fd, tree.name).chunks]
            total_bytes = sum(f[2] for f in files)
            cold = args.page_cache == "cold" and evictable(files)
            print(f"{len(files)} chunk files x {geometry.slot_bytes(1) // 1024} KiB + trailer page "
                  f"({total_bytes / (1 << 20):.1f} MiB), {args.readers} readers, {usable_cpus()} usable cores, "
                  f"page cache {'cold (evicted before every read)' if cold else 'warm'}")
            forked = ForkedRawReader(files, args.readers)
            hashing = ForkedRawReader(files, args.readers, checksum=True)
            raw, double, deep = RawReader(args.readers), RawReader(2 * args.readers), RawReader(args.io_depth)
            readers.extend((forked, hashing, raw, double, deep))
            for reader in readers:  # warm the page cache, start every thread with its buffer
                for _ in range(1 if cold else 3):
                    reader.read(files)
            names = ("raw", "raw 2x", "raw deep", "raw procs", "+xxh3", "verify")
            by_name: dict[str, RawReader | ForkedRawReader] = {"raw": raw, "raw 2x": double, "raw deep": deep,
                                                                "raw procs": forked, "+xxh3": hashing}
            print(f"{'trial':>5}  {'raw GiB/s':>10}  {'raw 2x':>7}  {'raw deep':>8}  {'raw procs':>9}  {'+xxh3':>6}  "
                  f"{'verify GiB/s':>12}  {'ratio':>6}  {'whole':>6}")
            rates: dict[str, list[float]] = {name: [] for name in (*names, "whole")}
            per_pass: dict[str, list[float]] = {name: [] for name in names}  # GiB/s of each read
            for trial in range(1, args.trials + 1):
                took = {name: [0.0, 0.0] for name in rates}
                for p in range(args.passes):
                    turn = (trial + p) % len(names)
                    for what in names[turn:] + names[:turn]:
                        if cold:
                            evict(files)
                        if what == "verify":
                            started = time.perf_counter()
                            report = verify_root(root_fd, str(root), workers=args.readers,
                                                 io_depth=args.io_depth)
                            whole = time.perf_counter() - started
                            assert report["ok"] == len(files) and report["problems_left"] == 0, report["counts"]
                            bytes_read, seconds = report["bytes_read"], report["elapsed_s"]
                            took["whole"][0] += bytes_read
                            took["whole"][1] += whole
                        else:
                            bytes_read, seconds = by_name[what].read(files)
                        took[what][0] += bytes_read
                        took[what][1] += seconds
                        per_pass[what].append(bytes_read / seconds / GIB)
                for name, (n, secs) in took.items():
                    rates[name].append(n / secs / GIB)
                print(_row(str(trial), {name: values[-1] for name, values in rates.items()}))
            print(_row("median", {name: statistics.median(values) for name, values in rates.items()}))
            print(_paired(per_pass))
        finally:
            for reader in readers:
                reader.close()
            for fd in tree_fds:
                os.close(fd)
            os.close(root_fd)


def evict(files: list[tuple[int, str, int]]) -> None:
    """Drop ``files`` from the page cache (their pages are clean: written and synced long ago)."""
    for dir_fd, relpath, _ in files:
        fd = os.open(relpath, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def evictable(files: list[tuple[int, str, int]]) -> bool:
    """Whether evicting works here: after it, a read that may not wait finds the first file not
    cached (tmpfs keeps it: its pages are the file). Says so when it does not."""
    evict(files[:1])
    dir_fd, relpath, _ = files[0]
    if not in_memory_fs(dir_fd):
        fd = os.open(relpath, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        except OSError:  # not cached (EAGAIN), or this filesystem cannot tell: trust the eviction
            return True
        finally:
            os.close(fd)
    print("this filesystem keeps its files in memory (tmpfs): measuring the page cache warm; use --dir on a disk")
    return False


def _paired(per_pass: dict[str, list[float]]) -> str:
    """The ratio that carries the target: verify over the raw read that is fastest by median, read
    by read. Each pass reads with every reader back to back, so each verify read is paired with
    the raw read made a few hundred milliseconds from it, and a machine that slows down or speeds
    up between passes moves both. Against one raw method, chosen once: the best of three raw reads
    per pass would be biased upward by noise alone."""
    fastest = max(_RAW, key=lambda name: statistics.median(per_pass[name]))
    return "\n".join((
        f"verify / {fastest} (the fastest raw read), {_spread(per_pass['verify'], per_pass[fastest])}"
        "   (target ratio >= 0.8)",
        f"verify / raw procs +xxh3 (reading and hashing only: the floor of any checker), "
        f"{_spread(per_pass['verify'], per_pass['+xxh3'])}"))


def _spread(rates: list[float], baseline: list[float]) -> str:
    ratios = sorted(r / b for r, b in zip(rates, baseline))
    low, high = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]) if len(ratios) >= 4 else (ratios[0], ratios[-1])
    return (f"paired read by read over {len(ratios)} passes: median {statistics.median(ratios):.2f}, "
            f"quartiles {low:.2f}-{high:.2f}")


def _row(label: str, rate: dict[str, float]) -> str:
    """A table row; its ratio is verify over the best raw read of the row."""
    best_raw = max(rate[name] for name in _RAW)
    return (f"{label:>5}  {rate['raw']:>10.2f}  {rate['raw 2x']:>7.2f}  {rate['raw deep']:>8.2f}  "
            f"{rate['raw procs']:>9.2f}  {rate['+xxh3']:>6.2f}  {rate['verify']:>12.2f}  {rate['verify'] / best_raw:>6.2f}  "
            f"{rate['whole']:>6.2f}")


if __name__ == "__main__":
    main()

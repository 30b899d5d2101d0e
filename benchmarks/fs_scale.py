"""The fs tier at real cache sizes: start-up, rescans, loop stalls and index size on trees of
10^5 and 10^6 chunk files, against a raw walk of the same tree in the same run.

For each ``--files`` count it builds (once; reused with ``--dir``) a tree of that many sparse chunk
files of the real layout (``<hhh>/<hh>_g0/<hash>.bin``, each ``slot_bytes + 4096`` bytes long but
holding no data blocks: little disk is used), then measures:

* **raw walk**: ``os.scandir`` + ``stat`` of every entry of the tree, one thread (the baseline);
* **time to serve**: ``kvtier.open`` with one fs tier (``max_bytes`` set) until the engine is usable;
* **start-up scan**: until the tier's background scan is over (``wait_scanned``), and its ratio
  to the raw walk (target ≤ 1.5×);
* **rescan**: one full-speed re-sync of the unchanged tree (``tier.rescan()``): wall and CPU;
* **changed**: a rescan after another writer added and deleted ``--changes`` files each: its cost,
  and whether the index then agrees with the disk;
* **periodic**: a second engine with ``rescan_interval_s = --interval`` (default: unset, the
  tier's default of 30 s stretched so a re-sync costs ≤ 5% of a core): the interval it settles
  on, the process CPU over one interval of re-syncing at that pace, as a share of one core
  (target ≤ 5%), then the worst stall over the next interval;
* **longest loop step**: the longest any step of the event loop held it (the loop thread's CPU
  time per asyncio handle: kvtier's scanning, reconciling and evicting, and everything else),
  per phase (target ≤ 5 ms), and how many steps held it longer;
* **worst loop stall**: the longest a 1 ms ticker task on the event loop waited past its wake-up
  time during each phase, and how many wake-ups were more than 5 ms late; first over 5 s with
  nothing running, the machine's own noise (a VM's host takes its cores away too). It adds to
  the steps above the time the kernel gave the loop's core to another task. The collector's heap
  is frozen after start-up (``gc.freeze()``), as vLLM's engine core does: a full collection of a
  heap holding torch takes ~100 ms whoever triggers it;
* **index**: bytes per chunk (the chunk index plus the rescans' directory records; target ≤ 100),
  lookup and evict-and-insert µs;
* **operator commands**: ``kvtier inspect`` and ``kvtier gc --dry-run`` (to half the bytes) of the
  same tree, wall time and its ratio to a raw walk run just before them (target ≤ 1.5, as the
  start-up scan).

    python benchmarks/fs_scale.py [--files 100000,1000000] [--dir DIR] [--changes 1000]
                                  [--interval SECONDS] [--no-periodic] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT]

import anyio  # noqa: E402

import kvtier  # noqa: E402
from kvtier.tiers.fs.index import ChunkIndex  # noqa: E402
from kvtier.tiers.fs.tier import FileSystemTier  # noqa: E402
from kvtier.tiers.integrity import stored_size  # noqa: E402

GEOMETRY = kvtier.KVGeometry("bench/fs-scale", num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16",
                             block_size=16)  # 256 KiB chunks
FILE_BYTES = stored_size(GEOMETRY.slot_bytes(1))


def config(root: Path, files: int, interval: float | None) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 16 * GEOMETRY.slot_bytes(1),
        "blocks_per_chunk": 1,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "max_bytes": int(files * FILE_BYTES * 1.05),
                             "rescan_interval_s": interval}],
    }


def fs_tier(engine: Any) -> FileSystemTier:
    [tier] = [t for t in engine.tiers if isinstance(t, FileSystemTier)]
    return tier


def blocks_dir(root: Path) -> Path:
    """The run's block tree, as the engine names it (opening an engine on ``root`` once)."""
    async def main() -> Path:
        async with kvtier.open(config(root, 1, 3600), GEOMETRY) as engine:
            return Path(fs_tier(engine).namespace.blocks_dir)
    return anyio.run(main)


def build(tree: Path, files: int) -> float:
    """Sparse chunk files under ``tree`` until it holds ``files``; seconds taken."""
    marker = tree / ".bench-files"
    have = int(marker.read_text()) if marker.exists() else 0
    if have == files:
        return 0.0
    started = time.perf_counter()
    rng = random.Random(files)
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    made: set[str] = set()
    try:
        for i in range(have, files):
            h = rng.randbytes(32).hex()
            leaf = f"{h[:3]}/{h[3:5]}_g0"
            if leaf not in made:
                os.makedirs(tree / leaf, exist_ok=True)
                made.add(leaf)
            f = os.open(f"{leaf}/{h}.bin", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=fd)
            os.ftruncate(f, FILE_BYTES)
            os.close(f)
            if i % 100_000 == 99_999:
                print(f"  built {i + 1} files", flush=True)
    finally:
        os.close(fd)
    marker.write_text(str(files))
    return time.perf_counter() - started


def raw_walk(tree: Path) -> tuple[int, float, float]:
    """(files, wall s, CPU s) of a single-threaded scandir + stat of the whole tree."""
    wall, cpu, n = time.perf_counter(), time.thread_time(), 0
    for top in os.scandir(tree):
        if not top.is_dir(follow_symlinks=False):
            continue
        for leaf in os.scandir(top.path):
            leaf.stat(follow_symlinks=False)
            for entry in os.scandir(leaf.path):
                entry.stat(follow_symlinks=False)
                n += 1
    return n, time.perf_counter() - wall, time.thread_time() - cpu


def cpu_now(tier: FileSystemTier | None = None) -> float:
    """CPU seconds of this process, its finished children and ``tier``'s live scan workers."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for pid in tier.sync.workers.pids if tier is not None else ():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


class Ticker:
    """A task that sleeps 1 ms at a time and records how late it woke up (the loop's stalls): the
    worst, and how many wake-ups were more than 5 ms late."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.late = 0

    def reset(self) -> tuple[float, int]:
        out = self.worst, self.late
        self.worst, self.late = 0.0, 0
        return out

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(0.001)
            stall = time.perf_counter() - started - 0.001
            self.worst = max(self.worst, stall)
            self.late += stall > 0.005


class Steps:
    """Every step the event loop runs (an asyncio handle), timed by the loop thread's CPU clock:
    the longest is how long any code held the loop. A ticker's lateness adds the time the kernel
    gave the loop's core to other tasks (the workers, other processes, the VM's host). Wraps
    asyncio's ``Handle._run`` (this benchmark runs on asyncio)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.over = 0  # steps that held the loop more than 5 ms
        original = asyncio.events.Handle._run

        def run(handle: asyncio.events.Handle) -> None:
            started = time.thread_time()
            original(handle)
            held = time.thread_time() - started
            self.longest = max(self.longest, held)
            self.over += held > 0.005

        asyncio.events.Handle._run = run  # type: ignore[method-assign]

    def reset(self) -> tuple[float, int]:
        out = self.longest, self.over
        self.longest, self.over = 0.0, 0
        return out


STEPS = Steps()


def record_stall(out: dict[str, Any], phase: str, ticker: Ticker) -> None:
    worst, late = ticker.reset()
    out[f"{phase}_stall_ms"] = worst * 1e3
    out[f"{phase}_late_wakeups"] = late
    longest, over = STEPS.reset()
    out[f"{phase}_step_ms"] = longest * 1e3
    out[f"{phase}_steps_over_5ms"] = over


def change_tree(tree: Path, changes: int, rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    """Another writer: ``changes`` new chunk files and ``changes`` deleted ones; (added, deleted) keys."""
    added, deleted = [], []
    for _ in range(changes):
        h = rng.randbytes(32).hex()
        (tree / h[:3] / f"{h[3:5]}_g0").mkdir(parents=True, exist_ok=True)
        path = tree / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"
        with open(path, "wb") as f:
            f.truncate(FILE_BYTES)
        added.append(bytes.fromhex(h) + bytes(4))
    tops = [p for p in tree.iterdir() if p.is_dir()]
    while len(deleted) < changes:
        files = list(rng.choice(list(rng.choice(tops).iterdir())).iterdir())
        victim = next((f for f in files if f.name.endswith(".bin")), None)
        if victim is not None and bytes.fromhex(victim.name[:-4]) + bytes(4) not in added:
            victim.unlink()
            deleted.append(bytes.fromhex(victim.name[:-4]) + bytes(4))
    return added, deleted


def measure(root: Path, files: int, args: argparse.Namespace) -> dict[str, Any]:
    tree = blocks_dir(root)
    built = build(tree, files)
    if built:
        print(f"  built {files} files in {built:.0f} s")
    # Directory mtimes older than the racy window, as on a cache that was not written this second.
    time.sleep(2.1)
    raw_walk(tree)  # once to bring the tree's metadata into memory, as kvtier's scan finds it below
    n, raw_wall, raw_cpu = raw_walk(tree)
    out: dict[str, Any] = {"files": n, "raw_walk_s": raw_wall, "raw_walk_cpu_s": raw_cpu}

    async def main() -> None:
        ticker = Ticker()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            await anyio.sleep(0.05)
            ticker.reset()
            STEPS.reset()
            await anyio.sleep(5.0)  # the machine's own noise: the same ticker, nothing else running
            record_stall(out, "idle", ticker)
            started, cpu = time.perf_counter(), cpu_now()
            async with kvtier.open(config(root, files, 3600), GEOMETRY) as engine:
                out["serve_s"] = time.perf_counter() - started
                gc.freeze()  # start-up is over (see the module docstring)
                ticker.reset()  # what opening an engine costs (imports, host memory) is not the scan's
                STEPS.reset()
                tier = fs_tier(engine)
                await tier.wait_scanned()
                out["startup_scan_s"] = time.perf_counter() - started
                out["startup_scan_cpu_s"] = cpu_now(tier) - cpu
                record_stall(out, "startup", ticker)
                out["indexed"] = len(tier.index)
                out["index_bytes_per_chunk"] = tier.index_bytes() / max(1, len(tier.index))

                started, cpu = time.perf_counter(), cpu_now(tier)
                await tier.rescan()
                out["rescan_s"] = time.perf_counter() - started
                out["rescan_cpu_s"] = cpu_now(tier) - cpu
                record_stall(out, "rescan", ticker)

                rng = random.Random(time.time_ns())  # new names on every run of a kept tree
                added, deleted = await anyio.to_thread.run_sync(change_tree, tree, args.changes, rng)
                started, cpu = time.perf_counter(), cpu_now(tier)
                await tier.rescan()
                out["changed_rescan_s"] = time.perf_counter() - started
                out["changed_rescan_cpu_s"] = cpu_now(tier) - cpu
                record_stall(out, "changed", ticker)
                out["changes_seen"] = (all(k in tier.index for k in added)
                                       and not any(k in tier.index for k in deleted))

                keys = random.Random(3).sample(tier.index.keys(), min(100_000, len(tier.index)))
                started = time.perf_counter()
                for key in keys:
                    tier.known(key)
                out["lookup_us"] = (time.perf_counter() - started) / len(keys) * 1e6
            tg.cancel_scope.cancel()
        # Eviction on an index of the same size, full, outside the tier (whose background pass
        # would evict files for real if its index were made to look over the cap).
        index = ChunkIndex(None, expected_entries=out["indexed"])
        rng = random.Random(5)
        now = time.time()
        index.add_cold((rng.randbytes(32) + bytes(4), FILE_BYTES, now - i) for i in range(out["indexed"]))
        index.capacity = index.used
        fresh = [rng.randbytes(32) + bytes(4) for _ in range(10_000)]
        started = time.perf_counter()
        for key in fresh:
            index.reserve(key, FILE_BYTES)
        out["evict_insert_us"] = (time.perf_counter() - started) / len(fresh) * 1e6

    async def periodic() -> None:
        """The tier's own re-sync at its pace (``--interval``, default: the tier's default): the
        process CPU over the second interval (the first paces itself on the cost of a pass; no
        ticker running, it costs CPU too), then the worst stall over the third."""
        async with kvtier.open(config(root, files, args.interval), GEOMETRY) as engine:
            tier = fs_tier(engine)
            await tier.wait_scanned()
            gc.freeze()
            await anyio.sleep(tier.rescan_interval + 1.0)  # the first re-sync: it sets the pace
            interval = out["periodic_interval_s"] = tier.rescan_interval
            cpu = cpu_now(tier)
            await anyio.sleep(interval)
            out["periodic_cpu_share"] = (cpu_now(tier) - cpu) / interval
            ticker = Ticker()
            STEPS.reset()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker.run)
                await anyio.sleep(interval)
                record_stall(out, "periodic", ticker)
                tg.cancel_scope.cancel()

    anyio.run(main)
    if not args.no_periodic:
        anyio.run(periodic)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    operator_commands(root, tree, out)
    return out


def operator_commands(root: Path, tree: Path, out: dict[str, Any]) -> None:
    """``kvtier inspect`` and ``kvtier gc --dry-run`` (to half the bytes) of the same tree, as the
    commands run them (their worker processes included), against a raw walk just before them."""
    from kvtier.ops.gc import gc_root
    from kvtier.ops.inspect import inspect_root
    from kvtier.ops.runs import open_root

    raw_walk(tree)  # the machine may have dropped the tree's metadata meanwhile: bring it back
    _, out["ops_raw_walk_s"], _ = raw_walk(tree)
    fd = open_root(str(root))
    try:
        started = time.perf_counter()
        totals = inspect_root(fd, str(root))["totals"]
        out["inspect_s"] = time.perf_counter() - started
        out["inspect_files"] = totals["chunk_files"]
        started = time.perf_counter()
        collected = gc_root(fd, str(root), max_bytes=totals["chunk_bytes"] // 2, dry_run=True)
        out["gc_dry_run_s"] = time.perf_counter() - started
        out["gc_would_remove"] = len(collected["removed"])
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--files", default="100000,1000000", help="tree sizes, comma-separated")
    parser.add_argument("--dir", help="where to build (and keep) the trees; default: a temporary directory")
    parser.add_argument("--changes", type=int, default=1000, help="files another writer adds and deletes")
    parser.add_argument("--interval", type=float, default=None,
                        help="rescan_interval_s of the periodic measurement (default: the tier's own default)")
    parser.add_argument("--no-periodic", action="store_true", help="skip the one-interval periodic measurement")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    sizes = [int(x) for x in args.files.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-fs-scale-") as tmp:
        base = Path(args.dir) if args.dir else Path(tmp)
        for files in sizes:
            print(f"tree of {files} chunk files of {FILE_BYTES // 1024} KiB (sparse) under {base}", flush=True)
            results.append(measure(base / f"tree-{files}", files, args))
    rows = [
        ("chunk files found (raw walk / indexed)", lambda r: f"{r['files']} / {r['indexed']}"),
        ("raw walk: scandir + stat, 1 thread (s)", lambda r: f"{r['raw_walk_s']:.2f}"),
        ("time to serve: kvtier.open returns (s)", lambda r: f"{r['serve_s']:.3f}"),
        ("start-up scan in the background (s)", lambda r: f"{r['startup_scan_s']:.2f}"),
        ("  ratio to the raw walk (target <= 1.5)", lambda r: f"{r['startup_scan_s'] / r['raw_walk_s']:.2f}"),
        ("rescan, tree unchanged: wall / CPU (s)", lambda r: f"{r['rescan_s']:.2f} / {r['rescan_cpu_s']:.2f}"),
        ("  as a share of one core at one pass per 30 s", lambda r: f"{r['rescan_cpu_s'] / 30:.1%}"),
        (f"rescan after {args.changes}+{args.changes} changes: wall / CPU (s)",
         lambda r: f"{r['changed_rescan_s']:.2f} / {r['changed_rescan_cpu_s']:.2f}"),
        ("  changes seen by that rescan", lambda r: "yes" if r["changes_seen"] else "NO"),
        ("periodic re-sync: interval (s)",
         lambda r: "skipped" if "periodic_interval_s" not in r else f"{r['periodic_interval_s']:.0f}"),
        ("periodic re-sync, CPU share of one core (target <= 5%)",
         lambda r: "skipped" if "periodic_cpu_share" not in r else f"{r['periodic_cpu_share']:.1%}"),
        ("worst loop stall, idle loop (ms: this machine's noise)",
         lambda r: f"{r['idle_stall_ms']:.1f} ({r['idle_late_wakeups']} late)"),
        ("worst loop stall: start-up / rescan / changed (ms)",
         lambda r: f"{r['startup_stall_ms']:.1f} / {r['rescan_stall_ms']:.1f} / {r['changed_stall_ms']:.1f}"),
        ("  wake-ups > 5 ms late: start-up / rescan / changed",
         lambda r: f"{r['startup_late_wakeups']} / {r['rescan_late_wakeups']} / {r['changed_late_wakeups']}"),
        ("longest loop step, CPU held (ms): idle / start-up / rescan / changed",
         lambda r: " / ".join(f"{r[f'{p}_step_ms']:.1f}" for p in ("idle", "startup", "rescan", "changed"))),
        ("  steps holding the loop > 5 ms: start-up / rescan / changed",
         lambda r: " / ".join(str(r[f"{p}_steps_over_5ms"]) for p in ("startup", "rescan", "changed"))),
        ("longest loop step, periodic (ms, target <= 5)",
         lambda r: "skipped" if "periodic_step_ms" not in r
         else f"{r['periodic_step_ms']:.1f} ({r['periodic_steps_over_5ms']} over 5 ms)"),
        ("worst loop stall: periodic (ms)",
         lambda r: "skipped" if "periodic_stall_ms" not in r
         else f"{r['periodic_stall_ms']:.1f} ({r['periodic_late_wakeups']} late)"),
        ("index bytes per chunk (target <= 100)", lambda r: f"{r['index_bytes_per_chunk']:.0f}"),
        ("lookup / evict+insert (us)", lambda r: f"{r['lookup_us']:.2f} / {r['evict_insert_us']:.1f}"),
        ("peak RSS of the process (MiB)", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("kvtier inspect: files / wall (s)", lambda r: f"{r['inspect_files']} / {r['inspect_s']:.2f}"),
        ("raw walk again, before the commands (s)", lambda r: f"{r['ops_raw_walk_s']:.2f}"),
        ("  inspect: ratio to that raw walk (target <= 1.5)", lambda r: f"{r['inspect_s'] / r['ops_raw_walk_s']:.2f}"),
        ("kvtier gc --dry-run to half: files / wall (s)", lambda r: f"{r['gc_would_remove']} / {r['gc_dry_run_s']:.2f}"),
        ("  gc: ratio to that raw walk (target <= 1.5)", lambda r: f"{r['gc_dry_run_s'] / r['ops_raw_walk_s']:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    print(f"{'':<{width}}  " + "  ".join(f"{r['files']:>14}" for r in results))
    for name, cell in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{cell(r):>14}" for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

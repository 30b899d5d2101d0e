"""``kvtier verify ROOT [--run DIGEST] [--repair] [--json] [--threads N]``: read and check every chunk.

Every chunk file of every rank tree (:mod:`kvtier.ops.runs`) is read in full and checked with
:func:`kvtier.tiers.fs_io.load_chunk` — the tier's own load path — against its identity: the
offload key its path names (:meth:`kvtier.layout.Namespace.key_from_relpath`) and the fingerprint
of its run *and rank* (:attr:`kvtier.layout.Namespace.fingerprint` of the tree's namespace), so a
chunk copied over another's name, or into another run's or rank's tree, fails ``wrong_chunk``.
Reads never follow a link and never open a special file (:mod:`kvtier.tiers.fs_beneath`); nothing
outside ROOT is reached.

Reasons reported (per file): the trailer's ``short``, ``long``, ``bad_trailer``, ``old_version``,
``checksum``, ``wrong_chunk``; ``unverified`` (a trailer-less file of exactly ``slot_bytes``,
written by vLLM: reported, never a problem, never removed); ``not_regular`` (a link, special file
or directory where a chunk or shard directory belongs; never followed); ``stray`` (a name not of
the layout inside a rank tree, and ``.tmp``/probe files older than ``--tmp-grace``: younger ones
may belong to a live writer and are only counted). Files that vanish while being verified (an
engine evicted them) are counted, not problems. Directly under ROOT, invalid run directories,
orphan trees and links bearing run or tree names are reported as problems and never repaired.

``--repair`` removes every problem file (:func:`kvtier.tiers.fs_io.remove_file`: a link is
removed itself, never its target; a directory only when empty). It is safe next to running
engines: their loads verify every file, and a file removed under them is a miss.

``slot_bytes`` (the run fields do not record the KV geometry) is read from the trailers: the
length field of a file of one of the most common sizes; ``--slot-bytes`` overrides it. When no
trailer is valid, the most common size is taken as the trailer-less (vLLM) slot size — the guess
under which no file is removed for its size alone; a tree where even that fails (no size a
multiple of 4096) is not checked: its files count as ``unchecked`` problems, never removed.

Threads: ``--threads`` (default: twice the usable cores), each with its own page-aligned buffer
(an anonymous ``mmap`` of one slot). The GiB/s printed is file bytes read over the time of the
read-and-check phase (listing excluded); progress (chunks, GiB/s) goes to stderr when it is a
terminal.

Exit status: 0 no problems (or all repaired), 1 problems found and not repaired, 2 usage errors.

``--json`` prints one document::

    {"root": str, "threads": int, "repair": bool,
     "files_checked": int, "bytes_read": int, "elapsed_s": float, "gib_per_s": float,
     "ok": int, "vanished": int, "tmp_in_progress": int,
     "unchecked": int,                        # chunk files of trees with no usable slot size
     "counts": {reason: int},                 # every reason above, zero included
     "trees": [{"name": str, "run": str, "rank": int, "slot_bytes": int | null,
                "slot_bytes_source": "option" | "trailer" | "guessed" | null, "chunk_files": int}],
     "problems": [{"path": str (relative to ROOT), "reason": str, "bytes": int, "repaired": bool}],
     "unverified": [str],                     # trailer-less files (paths relative to ROOT)
     "invalid_runs": [{"name": str, "reason": str}], "orphan_trees": [str], "unsafe_entries": [str],
     "problems_left": int}
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from kvtier.layout import Namespace
from kvtier.ops import runs as _runs
from kvtier.ops.runs import Progress, discover, format_bytes, list_tree, run_on_root
from kvtier.tiers import fs_beneath, fs_io
from kvtier.tiers.integrity import MAGIC, TRAILER_PAGE, identity

__all__ = ["run_verify_cli", "build_parser", "verify_root", "REASONS"]

#: Every reason a file can be reported for.
REASONS: tuple[str, ...] = (
    "short", "long", "bad_trailer", "old_version", "checksum", "wrong_chunk", "unverified", "not_regular", "stray",
)
_NOT_PROBLEMS = frozenset({"unverified"})
_TAIL = struct.Struct("<4sHHQQ8x")
_BATCH = 32

_EPILOG = """\
exit status:
  0  no problems found (or every one repaired with --repair)
  1  problems found and not repaired
  2  usage error (bad arguments, ROOT missing or not a directory, no run matches --run)
"""


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli import CliParser  # one-line usage errors, exit 2

    parser = CliParser(
        prog="kvtier verify",
        description="Read every chunk file under ROOT and check it against its key, run and rank.",
        epilog=_EPILOG,
        formatter_class=_runs.HelpFormatter,
    )
    parser.add_argument("root", metavar="ROOT", help="the fs tier's root_dir")
    parser.add_argument("--run", metavar="DIGEST", default=None,
                        help="only the run with this digest (or directory name); all runs when not given")
    parser.add_argument("--repair", action="store_true",
                        help="remove corrupt, misplaced and stray files (never trailer-less vLLM files)")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema: module docstring)")
    parser.add_argument("--threads", type=_threads_arg, default=fs_io.usable_cpus() * 2, metavar="N",
                        help="reader threads (twice the usable cores)")
    parser.add_argument("--slot-bytes", type=_runs.size_arg, default=None, metavar="BYTES",
                        help="slot size of every run (e.g. 256KiB); read from the trailers when not given")
    parser.add_argument("--tmp-grace", type=float, default=3600.0, metavar="SECONDS",
                        help="temporary files older than this are stray (the tier's stale_tmp_grace_s)")
    return parser


def _threads_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"threads must be in 1..1024, got {value}")
    return value


@dataclass(slots=True)
class _Tree:
    name: str
    run: str
    rank: int
    fd: int
    namespace: Namespace
    slot: int | None
    slot_source: str | None
    listing: _runs.TreeListing


def _slot_from_trailers(tree_fd: int, listing: _runs.TreeListing) -> int | None:
    """``slot_bytes`` from the trailer length of a file of one of the most common sizes."""
    by_size: dict[int, list[str]] = collections.defaultdict(list)
    for entry in listing.chunks:
        if len(by_size[entry.size]) < 3:
            by_size[entry.size].append(entry.relpath)
    counts = collections.Counter(e.size for e in listing.chunks)
    for size, _ in counts.most_common(3):
        if size < 2 * TRAILER_PAGE or size % TRAILER_PAGE:
            continue
        for relpath in by_size[size]:
            try:
                fd = fs_beneath.open_file(tree_fd, relpath, os.O_RDONLY)
            except OSError:
                continue
            try:
                tail = os.pread(fd, _TAIL.size, size - _TAIL.size)
            except OSError:
                continue
            finally:
                os.close(fd)
            if len(tail) == _TAIL.size:
                magic, _version, _flags, length, _digest = _TAIL.unpack(tail)
                if magic == MAGIC and length == size - TRAILER_PAGE:
                    return length
    return None


def _raw_slot_guess(sizes: list[int]) -> int | None:
    if not sizes:
        return None
    top, _ = collections.Counter(sizes).most_common(1)[0]
    return top if top > 0 and top % TRAILER_PAGE == 0 else None


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.by_size: dict[int, memoryview] = {}

    def get(self, size: int) -> memoryview:
        buf = self.by_size.get(size)
        if buf is None:
            # Page aligned (an anonymous mapping), as the tier's slots are; kept for the thread's life.
            buf = self.by_size[size] = memoryview(mmap.mmap(-1, size))
        return buf


def verify_root(root_fd: int, root: str, *, threads: int, run_filter: str | None = None, repair: bool = False,
                slot_bytes: int | None = None, tmp_grace_s: float = 3600.0,
                progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Verify (and with ``repair`` clean) ROOT open as ``root_fd``; the ``--json`` document.

    ``ValueError`` when ``run_filter`` matches no run."""
    found = discover(root_fd)
    selected = [r for r in found.runs if run_filter is None or run_filter in (r.digest, r.name)]
    if run_filter is not None and not selected:
        raise ValueError(f"no run with digest or name {run_filter!r} under {root}")
    trees: list[_Tree] = []
    now = time.time()
    problems: list[dict[str, Any]] = []
    counts = dict.fromkeys(REASONS, 0)
    unverified: list[str] = []
    tmp_in_progress = 0
    try:
        for run in selected:
            for tree in run.trees:
                try:
                    tree_fd = fs_beneath.open_dir(root_fd, tree.name)
                except (FileNotFoundError, fs_beneath.UnsafeEntry):
                    continue
                listing = list_tree(root_fd, tree.name)
                slot, source = slot_bytes, "option"
                if slot is None:
                    slot, source = _slot_from_trailers(tree_fd, listing), "trailer"
                if slot is None:
                    # No trailer vouches for a size: take the most common size as trailer-less
                    # (vLLM) slots, the guess under which no file is removed for its size alone.
                    slot, source = _raw_slot_guess([c.size for c in listing.chunks]), "guessed"
                trees.append(_Tree(tree.name, run.name, tree.rank, tree_fd, tree.namespace, slot,
                                   source if slot is not None else None, listing))
        for t in trees:
            for entry in t.listing.unsafe:
                problems.append(_problem(t, entry.relpath, "not_regular", entry.size, entry.is_dir))
            for entry in t.listing.stray:
                problems.append(_problem(t, entry.relpath, "stray", entry.size, entry.is_dir))
            for entry in t.listing.tmp:
                if now - entry.mtime > tmp_grace_s:
                    problems.append(_problem(t, entry.relpath, "stray", entry.size, False))
                else:
                    tmp_in_progress += 1
        checked = _check_chunks(trees, threads, progress_stream)
        ok = 0
        vanished = 0
        bytes_read = 0
        unchecked = 0
        for t, entry, verdict in checked["results"]:
            if verdict == "vanished":
                vanished += 1
                continue
            if verdict == "unchecked":
                unchecked += 1
                continue
            bytes_read += entry.size
            if verdict is None:
                ok += 1
            elif verdict == "unverified":
                counts["unverified"] += 1
                unverified.append(f"{t.name}/{entry.relpath}")
            else:
                problems.append(_problem(t, entry.relpath, verdict, entry.size, False))
        for p in problems:
            counts[p["reason"]] += 1
        if repair:
            by_name = {t.name: t for t in trees}
            for p in problems:
                p["repaired"] = _remove(by_name[p["tree"]].fd, p["relpath"])
        left = sum(1 for p in problems if not p["repaired"]) + unchecked
        left += len(found.invalid_runs) + len(found.orphan_trees) + len(found.unsafe_entries) \
            if run_filter is None else 0
        elapsed = checked["elapsed"]
        return {
            "root": root,
            "threads": threads,
            "repair": repair,
            "files_checked": len(checked["results"]) - vanished - unchecked,
            "unchecked": unchecked,
            "bytes_read": bytes_read,
            "elapsed_s": elapsed,
            "gib_per_s": bytes_read / elapsed / 2**30 if elapsed > 0 else 0.0,
            "ok": ok,
            "vanished": vanished,
            "tmp_in_progress": tmp_in_progress,
            "counts": counts,
            "trees": [{"name": t.name, "run": t.run, "rank": t.rank, "slot_bytes": t.slot,
                       "slot_bytes_source": t.slot_source, "chunk_files": len(t.listing.chunks)} for t in trees],
            "problems": [{"path": f"{p['tree']}/{p['relpath']}", "reason": p["reason"], "bytes": p["bytes"],
                          "repaired": p["repaired"]} for p in problems],
            "unverified": unverified,
            "invalid_runs": [{"name": n, "reason": r} for n, r in found.invalid_runs] if run_filter is None else [],
            "orphan_trees": found.orphan_trees if run_filter is None else [],
            "unsafe_entries": found.unsafe_entries if run_filter is None else [],
            "problems_left": left,
        }
    finally:
        for t in trees:
            os.close(t.fd)


def _problem(tree: _Tree, relpath: str, reason: str, size: int, is_dir: bool) -> dict[str, Any]:
    return {"tree": tree.name, "relpath": relpath, "reason": reason, "bytes": 0 if is_dir else size,
            "repaired": False}


def _remove(tree_fd: int, relpath: str) -> bool:
    """Remove ``relpath`` beneath the tree without following links; True when it is gone."""
    try:
        fs_io.remove_file(tree_fd, relpath)
        return True
    except OSError:  # a non-empty directory, permissions: left for the operator
        return False


def _check_chunks(trees: list[_Tree], threads: int, progress_stream: TextIO | None) -> dict[str, Any]:
    """Read and check every chunk file of ``trees`` on ``threads`` threads."""
    work: list[tuple[_Tree, _runs.FileEntry, bytes]] = []
    results: list[tuple[_Tree, _runs.FileEntry, str | None]] = []
    for t in trees:
        for entry in t.listing.chunks:
            key = Namespace.key_from_relpath(entry.relpath)
            if key is None or t.slot is None:  # no slot size could be found: nothing to check against
                results.append((t, entry, "unchecked"))
                continue
            work.append((t, entry, identity(key, t.namespace.fingerprint)))
    batches = [work[i : i + _BATCH] for i in range(0, len(work), _BATCH)]
    lock = threading.Lock()
    done = {"files": 0, "bytes": 0}
    buffers = _Buffers()
    started = time.monotonic()

    def check(batch: list[tuple[_Tree, _runs.FileEntry, bytes]]) -> list[tuple[_Tree, _runs.FileEntry, str | None]]:
        out: list[tuple[_Tree, _runs.FileEntry, str | None]] = []
        nbytes = 0
        slot = 0
        buf = memoryview(b"")
        load = fs_io.load_chunk
        for t, entry, chunk_identity in batch:
            if t.slot != slot:
                assert t.slot is not None
                slot, buf = t.slot, buffers.get(t.slot)
            try:
                reason = load(t.fd, entry.relpath, buf, chunk_identity, o_direct=False).reason
            except FileNotFoundError:
                reason = "vanished"
            except OSError:
                reason = "short"  # unreadable (EIO): as good as truncated
            out.append((t, entry, reason))
            nbytes += entry.size
        with lock:
            done["files"] += len(batch)
            done["bytes"] += nbytes
        return out

    def render() -> str:
        elapsed = max(time.monotonic() - started, 1e-9)
        return (f"kvtier verify: {done['files']}/{len(work)} chunks, "
                f"{done['bytes'] / elapsed / 2**30:.2f} GiB/s")

    with Progress(render, stream=progress_stream):
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-verify") as pool:
            for part in pool.map(check, batches):
                results.extend(part)
        elapsed = time.monotonic() - started
    return {"results": results, "elapsed": elapsed}


def _print_text(report: dict[str, Any], out: TextIO) -> None:
    print(f"root {report['root']}: {len(report['trees'])} rank tree(s), {report['threads']} threads", file=out)
    for t in report["trees"]:
        slot = "unknown" if t["slot_bytes"] is None else f"{t['slot_bytes']} ({t['slot_bytes_source']})"
        print(f"  tree {t['name']}: {t['chunk_files']} chunk files, slot bytes {slot}", file=out)
    shown: collections.Counter[str] = collections.Counter()
    for p in report["problems"]:
        shown[p["reason"]] += 1
        if shown[p["reason"]] <= 20:
            state = " (removed)" if p["repaired"] else (" (NOT removed)" if report["repair"] else "")
            print(f"  {p['reason']:<12} {p['path']}{state}", file=out)
    for reason, n in shown.items():
        if n > 20:
            print(f"  {reason:<12} ... {n - 20} more", file=out)
    for path in report["unverified"][:20]:
        print(f"  {'unverified':<12} {path} (trailer-less, vLLM's format: kept)", file=out)
    if len(report["unverified"]) > 20:
        print(f"  {'unverified':<12} ... {len(report['unverified']) - 20} more", file=out)
    for item in report["invalid_runs"]:
        print(f"  invalid run directory {item['name']}: {item['reason']}", file=out)
    for name in report["orphan_trees"]:
        print(f"  orphan tree {name} (no valid run config.json)", file=out)
    for name in report["unsafe_entries"]:
        print(f"  unsafe entry {name} (link or special file under ROOT, not followed)", file=out)
    counts = "  ".join(f"{r}={n}" for r, n in report["counts"].items() if n)
    print(f"checked {report['files_checked']} files: ok {report['ok']}"
          f"{'  ' + counts if counts else ''}"
          f"{'  vanished=' + str(report['vanished']) if report['vanished'] else ''}"
          f"{'  unchecked (slot size unknown: use --slot-bytes)=' + str(report['unchecked']) if report['unchecked'] else ''}"
          f"{'  tmp in progress=' + str(report['tmp_in_progress']) if report['tmp_in_progress'] else ''}",
          file=out)
    if report["repair"]:
        removed = sum(1 for p in report["problems"] if p["repaired"])
        print(f"repaired: removed {removed} of {len(report['problems'])} problem entries", file=out)
    print(f"problems left: {report['problems_left']}", file=out)
    print(f"read {format_bytes(report['bytes_read'])} in {report['elapsed_s']:.3f} s: "
          f"{report['gib_per_s']:.2f} GiB/s", file=out)


def run_verify_cli(argv: Sequence[str], *, out: TextIO | None = None) -> int:
    """Entry point of ``kvtier verify`` (exit status: see the module docstring)."""
    stream = out if out is not None else sys.stdout
    return run_on_root("verify", build_parser(), argv, lambda args, root_fd: _verify(args, root_fd, stream))


def _verify(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    report = verify_root(root_fd, args.root, threads=args.threads, run_filter=args.run, repair=args.repair,
                         slot_bytes=args.slot_bytes, tmp_grace_s=args.tmp_grace)
    if args.json:
        _runs.write_json(report, out)
        print(f"kvtier verify: {report['gib_per_s']:.2f} GiB/s", file=sys.stderr)
    else:
        _print_text(report, out)
    return 1 if report["problems_left"] else 0

"""``kvtier gc ROOT --max-bytes N [--dry-run] [--json]``: evict least recently used chunk files.

Scope: the cap is for the **whole ROOT** — the chunk files of every rank tree of every valid run
(:mod:`kvtier.ops.runs`) together — because that is what fills the disk, and one global order
lets dead runs' chunks age out first. (The fs tier's own ``max_bytes`` bounds one rank tree per
process; run gc with ``--max-bytes`` at or above the sum of those to leave the engines alone.)
Only regular files of the layout's chunk names count and are removed; temporary, stray and unsafe
entries, orphan trees and anything else under ROOT are neither counted nor touched (``kvtier
verify --repair`` deals with them). Trailer-less (vLLM) chunk files count and are evicted like
any other: gc frees space, it does not judge content.

Order: oldest mtime first — the recency the fs tier seeds its index from at start-up (a chunk's
mtime is when it was written). The tier's in-memory recency (loads since) is not visible to gc,
so a chunk that is old on disk but hot in an engine can be evicted; the engine then misses once
and stores it again.

Safe with running engines: files are removed with :func:`kvtier.tiers.fs.chunks.remove_file` (never
following a link). A load that opened the file before the unlink reads the whole, intact file; a
load after it misses; the tier verifies every load, so a removed chunk is at worst a miss, never
wrong bytes. The engines notice the freed space at their next rescan.

Each file to remove is written (``to be removed PATH ...``; with ``--json`` on stderr, as the
document records the outcome) and flushed before it is removed: an output that fails removes
nothing unreported (exit 1). Names are printed escaped (:func:`kvtier.ops.runs.printable`).

Sizes: ``10G``, ``512MiB``, ``1.5GiB`` (powers of 1024), ``20GB`` (powers of 1000), plain bytes.

Exit status: 0 when the chunk files are (or, with ``--dry-run``, would be) at or under the cap;
1 when removals failed and ROOT is still over it, or the output could not be written; 2 on
usage errors.

``--json`` prints one document::

    {"root": str, "max_bytes": int, "dry_run": bool,
     "bytes_before": int, "bytes_after": int, "files_before": int, "files_after": int,
     "removed": [{"path": str (relative to ROOT), "bytes": int, "mtime": float}],   # or would remove
     "failed": [{"path": str, "error": str}]}
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvtier.ops import runs as _runs
from kvtier.ops.cli_args import CliParser
from kvtier.ops.runs import discover, format_bytes, list_tree, printable_report, run_on_root
from kvtier.tiers.fs import beneath, chunks

__all__ = ["run_gc_cli", "build_parser", "gc_root"]

_EPILOG = """\
exit status:
  0  the chunk files under ROOT are (or would be, with --dry-run) at or under --max-bytes
  1  some removals failed and ROOT is still over --max-bytes, or the output could not be written
  2  usage error (bad arguments or size, ROOT missing or not a directory)

sizes: 10G, 512MiB, 1.5GiB (powers of 1024), 20GB (powers of 1000), or plain bytes
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="kvtier gc",
        description="Remove the least recently written chunk files until those under ROOT take at most "
                    "--max-bytes.",
        epilog=_EPILOG,
        formatter_class=_runs.HelpFormatter,
    )
    parser.add_argument("root", metavar="ROOT", help="the fs tier's root_dir")
    parser.add_argument("--max-bytes", type=_size_arg, required=True, metavar="N",
                        help="cap for all chunk files under ROOT together (e.g. 10G, 512MiB)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON document (schema: module docstring)")
    return parser


def _size_arg(text: str) -> int:
    try:
        value = _runs.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 0:  # pragma: no cover - the pattern has no sign
        raise argparse.ArgumentTypeError(f"expected a size >= 0, got {text!r}")
    return value


def gc_root(root_fd: int, root: str, *, max_bytes: int, dry_run: bool = False,
            before_removing: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Evict oldest chunk files under ROOT (open as ``root_fd``) until at most ``max_bytes``.

    ``before_removing(entries)``: called with the ``removed`` entries (path, bytes, mtime) that
    are about to be removed, before any of them is: first the oldest files that bring ROOT under
    the cap, then, after removals that failed, the next ones needed. The command writes them
    there, and what it raises (an output that fails) stops gc before it removes them."""
    found = discover(root_fd)
    candidates: list[tuple[float, str, str, int]] = []  # (mtime, tree, relpath, size)
    for run in found.runs:
        for rank_tree in run.trees:
            for chunk in list_tree(root_fd, rank_tree.name).chunks:
                candidates.append((chunk.mtime, rank_tree.name, chunk.relpath, chunk.size))
    candidates.sort()
    total = sum(c[3] for c in candidates)
    before, files = total, len(candidates)
    removed: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    tree_fds: dict[str, int] = {}
    following = iter(candidates)
    try:
        while total > max_bytes:
            # The oldest files that bring ROOT under the cap if every removal succeeds.
            batch, projected = [], total
            for candidate in following:
                batch.append(candidate)
                projected -= candidate[3]
                if projected <= max_bytes:
                    break
            if not batch:
                break
            entries = [{"path": f"{tree}/{relpath}", "bytes": size, "mtime": mtime}
                       for mtime, tree, relpath, size in batch]
            if not dry_run and before_removing is not None:
                before_removing(entries)
            for (_, tree, relpath, size), entry in zip(batch, entries):
                if not dry_run:
                    try:
                        fd = tree_fds.get(tree)
                        if fd is None:
                            fd = tree_fds[tree] = beneath.open_dir(root_fd, tree)
                        chunks.remove_file(fd, relpath)  # False: already gone (an engine evicted it): freed all the same
                    except OSError as exc:
                        failed.append({"path": entry["path"], "error": str(exc)})
                        continue
                removed.append(entry)
                total -= size
    finally:
        for fd in tree_fds.values():
            os.close(fd)
    return {
        "root": root, "max_bytes": max_bytes, "dry_run": dry_run,
        "bytes_before": before, "bytes_after": total,
        "files_before": files, "files_after": files - len(removed),
        "removed": removed, "failed": failed,
    }


def run_gc_cli(argv: Sequence[str], *, out: TextIO | None = None) -> int:
    """Entry point of ``kvtier gc`` (exit status: see the module docstring)."""
    stream = out if out is not None else sys.stdout
    return run_on_root("gc", build_parser(), argv, lambda args, root_fd: _gc(args, root_fd, stream))


def _entry_line(verb: str, item: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item["mtime"]))
    return f"{verb} {item['path']}  {item['bytes']} bytes  mtime {when}"


def _gc(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    # Each file is written (flushed) before it is removed: an output that fails removes nothing
    # unreported. With --json the document records what was removed: the entries go to stderr.
    listing = sys.stderr if args.json else out
    batches = [0]

    def report_before_removing(entries: list[dict[str, Any]]) -> None:
        shown = printable_report(entries, listing)
        for item in shown:
            print(_entry_line("to be removed", item), file=listing)
        more = " more" if batches[0] else ""  # after removals that failed
        batches[0] += 1
        print(f"removing {len(entries)}{more} files ({format_bytes(sum(i['bytes'] for i in entries))})", file=listing)
        listing.flush()

    report = gc_root(root_fd, args.root, max_bytes=args.max_bytes, dry_run=args.dry_run,
                     before_removing=report_before_removing)
    if args.json:
        _runs.write_json(report, out)
    else:
        shown = printable_report(report, out)
        verb = "would remove" if args.dry_run else "removed"
        if args.dry_run:
            for item in shown["removed"]:
                print(_entry_line(verb, item), file=out)
        for item in shown["failed"]:
            print(f"FAILED {item['path']}: {item['error']}", file=out)
        print(f"{verb} {len(report['removed'])} files ({format_bytes(sum(i['bytes'] for i in report['removed']))}); "
              f"chunk files under ROOT: {format_bytes(report['bytes_before'])} -> "
              f"{format_bytes(report['bytes_after'])} (cap {format_bytes(report['max_bytes'])})", file=out)
    return 1 if report["bytes_after"] > report["max_bytes"] else 0

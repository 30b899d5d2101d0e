"""``kvtier gc ROOT (--max-bytes N | --run DIGEST) [--dry-run] [--json]``: evict least recently
used chunk files, or remove a whole stale run.

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

**A whole run** (``--run``, the run's digest or directory name, as ``kvtier verify --run``): every
rank tree of the run (``<model>_<digest>_r<rank>``, also one its fields do not produce), then the
run's own directory with its ``config.json``, are removed with everything in them — chunk,
temporary, stray and unsafe entries alike (a link is removed itself, never followed). The run
directory goes last, so an interrupted removal leaves a run that ``--run`` still finds. Every
directory is opened ``O_NOFOLLOW`` beneath its parent's descriptor, from ROOT's down: nothing
outside ROOT is reached. It is meant for a run no engine uses any more (an old model revision, see
:mod:`kvtier.layout`, "Compatibility manifest"); an engine still running on it misses every load
and fails its stores until it restarts, and never reads wrong bytes. Each directory is written
(``to be removed DIR``) before its removal starts; ``--dry-run`` counts what would be removed and
removes nothing. Progress (entries removed) goes to stderr when it is a terminal.

Exit status: 0 when the chunk files are (or, with ``--dry-run``, would be) at or under the cap,
or the run is (would be) removed entirely; 1 when removals failed and ROOT is still over the cap,
or some entry of the run could not be removed, or the output could not be written; 2 on usage
errors (a ``--run`` that matches no run among them).

``--json`` prints one document::

    {"root": str, "max_bytes": int, "dry_run": bool,
     "bytes_before": int, "bytes_after": int, "files_before": int, "files_after": int,
     "removed": [{"path": str (relative to ROOT), "bytes": int, "mtime": float}],   # or would remove
     "failed": [{"path": str, "error": str}]}

and with ``--run``::

    {"root": str, "run": "<model>_<digest>", "digest": str, "dry_run": bool,
     "manifest": {"model": str, "model_revision": str | null, "namespace_tag": str | null},
     "directories": [{"path": str (directly under ROOT), "files": int, "bytes": int, "removed": bool}],
     "files": int, "bytes": int,                      # entries other than directories, and their bytes
     "failed": [{"path": str, "error": str}]}         # path relative to ROOT
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvtier.ops import runs as _runs
from kvtier.ops.cli_args import CliParser
from kvtier.ops.runs import Progress, discover, format_bytes, list_tree, printable_report, run_on_root
from kvtier.tiers.fs import beneath, chunks, tree

__all__ = ["run_gc_cli", "build_parser", "gc_root", "gc_run"]

_EPILOG = """\
exit status:
  0  the chunk files under ROOT are (or would be, with --dry-run) at or under --max-bytes;
     with --run: the run is (or would be) removed entirely
  1  some removals failed and ROOT is still over --max-bytes, or some entry of the run could not
     be removed, or the output could not be written
  2  usage error (bad arguments or size, ROOT missing or not a directory, no run matches --run)

sizes: 10G, 512MiB, 1.5GiB (powers of 1024), 20GB (powers of 1000), or plain bytes
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="kvtier gc",
        description="Remove the least recently written chunk files until those under ROOT take at most "
                    "--max-bytes, or remove one whole run (--run).",
        epilog=_EPILOG,
        formatter_class=_runs.HelpFormatter,
    )
    parser.add_argument("root", metavar="ROOT", help="the fs tier's root_dir")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--max-bytes", type=_size_arg, default=None, metavar="N",
                      help="cap for all chunk files under ROOT together (e.g. 10G, 512MiB)")
    what.add_argument("--run", metavar="DIGEST", default=None,
                      help="remove this run (its digest or directory name) and all its rank trees; "
                           "meant for a run no engine uses any more ('kvtier inspect' lists the runs)")
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


class _Tally:
    """What a run removal has removed (or counted, in a dry run); read by the progress thread."""

    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self.failed: list[dict[str, Any]] = []


def _select_run(found: _runs.Discovery, root: str, run: str) -> _runs.Run:
    matches = [r for r in found.runs if run in (r.digest, r.name)]
    if not matches:
        raise ValueError(f"no run with digest or name {run!r} under {_runs.printable(root)}")
    if len(matches) > 1:
        names = ", ".join(_runs.printable(r.name) for r in matches)
        raise ValueError(f"{len(matches)} runs have digest {run!r} ({names}); give the directory name")
    return matches[0]


def _run_directories(found: _runs.Discovery, run: _runs.Run) -> list[str]:
    """The run's rank trees (and any other ``<run>_r<rank>`` directory), then the run directory."""
    trees = {t.name for t in run.trees}
    for name in found.orphan_trees:
        match = tree.TREE_DIR.fullmatch(name)
        if match is not None and match.group(1) == run.name:
            trees.add(name)
    return sorted(trees, key=lambda n: int(n.rsplit("_r", 1)[1])) + [run.name]


def gc_run(root_fd: int, root: str, *, run: str, dry_run: bool = False,
           before_removing: Callable[[str], None] | None = None,
           progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Remove run ``run`` (digest or directory name) under ROOT, open as ``root_fd``: every rank
    tree, then the run directory (module docstring); with ``dry_run`` only count what would go.

    ``before_removing(name)`` is called before each directory's removal starts (the command
    writes it there; what it raises stops gc before that directory is touched). ``ValueError``
    when no run, or more than one, matches ``run``."""
    found = discover(root_fd)
    selected = _select_run(found, root, run)
    tally = _Tally()
    started = time.monotonic()
    verb = "counted" if dry_run else "removed"

    def render() -> str:
        return f"kvtier gc: {tally.files} files {verb} ({time.monotonic() - started:.1f} s)"

    directories = []
    with Progress(render, stream=progress_stream):
        for name in _run_directories(found, selected):
            if not dry_run and before_removing is not None:
                before_removing(name)
            files, size, failures = tally.files, tally.bytes, len(tally.failed)
            _clear_directory(root_fd, name, tally, remove=not dry_run)
            directories.append({"path": name, "files": tally.files - files, "bytes": tally.bytes - size,
                                "removed": not dry_run and len(tally.failed) == failures})
    return {
        "root": root, "run": selected.name, "digest": selected.digest, "dry_run": dry_run,
        "manifest": selected.manifest, "directories": directories,
        "files": tally.files, "bytes": tally.bytes, "failed": tally.failed,
    }


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: A directory that became something else between its listing and its opening.
_NOT_A_DIRECTORY = frozenset({errno.ELOOP, errno.ENOTDIR})


def _listing(dir_fd: int) -> list[tuple[str, bool, int]]:
    """``(name, is a directory, bytes of a regular file)`` of each entry, nothing followed."""
    out = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append((entry.name, stat.S_ISDIR(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0))
    return out


def _clear_directory(root_fd: int, name: str, tally: _Tally, *, remove: bool) -> None:
    """Remove (or count) directory ``name`` under ROOT and everything in it, deepest first.

    An explicit stack of open directories (a hostile tree may be deeper than Python's recursion
    limit); each is opened ``O_NOFOLLOW`` beneath its parent, so a link is removed, not followed.
    What cannot be removed is recorded in ``tally.failed`` and the rest goes on."""
    try:
        top = beneath.open_dir(root_fd, name)
    except FileNotFoundError:
        return
    except OSError as exc:  # became a link or a file since it was listed: not this run's any more
        tally.failed.append({"path": name, "error": exc.strerror or str(exc)})
        return
    # Frames: [parent fd, name in parent, fd, entries left, path relative to ROOT].
    stack: list[tuple[int, str, int, list[tuple[str, bool, int]], str]] = [(root_fd, name, top, [], name)]
    try:
        stack[0][3].extend(reversed(_listing(top)))
        while stack:
            parent, dname, fd, entries, path = stack[-1]
            if not entries:
                stack.pop()
                os.close(fd)
                if remove:
                    try:
                        os.rmdir(dname, dir_fd=parent)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:  # not empty (an engine still writes there), permissions
                        tally.failed.append({"path": path, "error": exc.strerror or str(exc)})
                continue
            ename, is_dir, size = entries.pop()
            epath = f"{path}/{ename}"
            if is_dir:
                try:
                    child = os.open(ename, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno not in _NOT_A_DIRECTORY:
                        tally.failed.append({"path": epath, "error": exc.strerror or str(exc)})
                        continue
                    # Replaced by a link or a file since the listing: removed as one, below.
                else:
                    try:
                        listing = _listing(child)
                    except OSError as exc:
                        os.close(child)
                        tally.failed.append({"path": epath, "error": exc.strerror or str(exc)})
                        continue
                    stack.append((fd, ename, child, listing[::-1], epath))
                    continue
            if remove:
                try:
                    os.unlink(ename, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    tally.failed.append({"path": epath, "error": exc.strerror or str(exc)})
                    continue
            tally.files += 1
            tally.bytes += size
    finally:
        for frame in stack:
            os.close(frame[2])


def run_gc_cli(argv: Sequence[str], *, out: TextIO | None = None) -> int:
    """Entry point of ``kvtier gc`` (exit status: see the module docstring)."""
    stream = out if out is not None else sys.stdout
    return run_on_root("gc", build_parser(), argv, lambda args, root_fd: _gc(args, root_fd, stream))


def _entry_line(verb: str, item: dict[str, Any]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item["mtime"]))
    return f"{verb} {item['path']}  {item['bytes']} bytes  mtime {when}"


def _gc(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    if args.run is not None:
        return _gc_run(args, root_fd, out)
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


def _gc_run(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    # Each directory is written (flushed) before its removal starts, as for single files above.
    listing = sys.stderr if args.json else out

    def report_before_removing(name: str) -> None:
        print(f"to be removed {printable_report(name, listing)}/", file=listing)
        listing.flush()

    report = gc_run(root_fd, args.root, run=args.run, dry_run=args.dry_run, before_removing=report_before_removing)
    if args.json:
        _runs.write_json(report, out)
    else:
        shown = printable_report(report, out)
        verb = "would remove" if args.dry_run else "removed"
        for item in shown["directories"]:
            if args.dry_run or item["removed"]:
                print(f"{verb} {item['path']}/  {item['files']} files  {format_bytes(item['bytes'])}", file=out)
        for item in shown["failed"]:
            print(f"FAILED {item['path']}: {item['error']}", file=out)
        state = "" if args.dry_run or not report["failed"] else f"; {len(report['failed'])} entries could not be removed"
        print(f"run {shown['run']}: {verb} {report['files']} files ({format_bytes(report['bytes'])}) in "
              f"{len(report['directories'])} directories{state}", file=out)
    return 1 if report["failed"] else 0

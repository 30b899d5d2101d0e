"""``kvtier verify ROOT [--run DIGEST] [--repair] [--json] [--workers N] [--key-file PATH]``: read and check every chunk.

Every chunk file of every rank tree (:mod:`kvtier.ops.runs`) is read in full and checked with
:func:`kvtier.tiers.fs.chunks.load_chunk` — the tier's own load path — against its identity: the
offload key its path names (:func:`kvtier.tiers.fs.tree.key_from_relpath`) and the fingerprint
of its run *and rank* (:attr:`kvtier.layout.Namespace.fingerprint` of the tree's namespace), so a
chunk copied over another's name, or into another run's or rank's tree, fails ``wrong_chunk``.
Reads never follow a link and never open a special file (:mod:`kvtier.tiers.fs.beneath`); nothing
outside ROOT is reached.

Coded chunks (compressed and/or encrypted, :mod:`kvtier.tiers.codec`) are decoded as a load does:
compressed ones always; encrypted ones with ``--key-file`` (the tier's key file: every key in it
decrypts), whose tag then proves them authentic. Without ``--key-file`` an encrypted chunk is
checked up to its checksum and reported ``encrypted`` (authenticity unchecked): never a problem,
never removed.

Reasons reported (per file): the trailer's ``short``, ``long``, ``bad_trailer``, ``old_version``,
``checksum``, ``wrong_chunk``; the codecs' ``codec`` (compressed bytes that do not decode to one
slot), ``undecryptable`` (with ``--key-file``: the tag does not verify, tampered or encrypted with
another key of the same id) and ``no_key`` (with ``--key-file``: its key id is not in the file;
never removed, the key may be elsewhere); ``unreadable`` (the file could not be read: ``EIO``, ``EACCES``;
never removed, as nothing is known of its bytes); ``unverified`` (a trailer-less file of exactly ``slot_bytes``,
written by vLLM: reported, never a problem, never removed); ``not_regular`` (a link, special file
or directory where a chunk or shard directory belongs; never followed); ``stray`` (a name not of
the layout inside a rank tree, and ``.tmp``/probe files older than ``--tmp-grace``: younger ones
may belong to a live writer and are only counted). Files that vanish while being verified (an
engine evicted them) are counted, not problems. Directly under ROOT, invalid run directories,
orphan trees and links bearing run or tree names are reported as problems and never repaired.

``--repair`` removes every problem file but the unreadable and ``no_key`` ones
(:func:`kvtier.tiers.fs.chunks.remove_file`: a link is removed itself, never its target; a directory
only when empty). It is safe next to running engines: their loads verify every file, and a file
removed under them is a miss. The report — every entry to remove, and the summary — is written
and flushed before anything is removed (with ``--json``, that listing goes to stderr: the
document records the outcome); an output that fails removes nothing (exit 1). Names are printed
escaped (:func:`kvtier.ops.runs.printable`), in the text and the JSON alike.

``slot_bytes`` (the run fields do not record the KV geometry) is read from the trailers: the
length field (a coded file: its slot length field) of a file of one of the most common sizes;
``--slot-bytes`` overrides it. When no trailer is valid, the most common size is taken as the
trailer-less (vLLM) slot size — the guess under which no file is removed for its size alone; a
tree where even that fails (no size a multiple of 4096) is not checked: its files count as ``unchecked`` problems, never removed.

Readers: ``--workers N`` (default: the usable cores). With N > 1 the files are checked by N worker
processes (:mod:`kvtier.ops.verify_workers`), each with its own interpreter lock: the checksum and
the per-file Python hold that lock, so threads of one process would queue for it. With N = 1 this
process checks every file itself and starts no process. Either way each reader checks a file the
page cache holds at once, into its own page-aligned buffer of one slot, with a read that may not
wait (``RWF_NOWAIT``), and hands a file that would wait for the storage to its threads:
``--io-depth`` (default 32, at most 256) reads in flight, shared among the readers (at least one
each), what a disk or NFS needs to deliver its bandwidth; the kernel's readahead, started for each
file found not cached, adds up to as many again (:class:`kvtier.ops.verify_workers.Checker`). Each
reading thread holds a buffer of one slot. The verdicts are the same whichever reads a file.
Workers start while the trees are listed; the GiB/s printed is file bytes read over the time of
the read-and-check phase (listing and worker start-up excluded); progress (chunks, GiB/s) goes to
stderr when it is a terminal. ``--repair`` removes files in this process, after every file was
checked: a check that fails (a worker died) removes nothing. ``benchmarks/verify.py`` compares the
read-and-check phase with raw reads of the same files (see its docstring and ``docs/operators.md``
for what it measured).

Exit status: 0 no problems (or all repaired), 1 problems found and not repaired (or the check
could not finish: a worker died or broke protocol, the error line says which; or the output
could not be written), 2 usage errors.

``--json`` prints one document::

    {"root": str, "workers": int, "io_depth": int, "repair": bool,  # --workers, --io-depth
     "files_checked": int, "bytes_read": int, "elapsed_s": float, "gib_per_s": float,
     "ok": int, "vanished": int, "tmp_in_progress": int,
     "unchecked": int,                        # chunk files of trees with no usable slot size
     "counts": {reason: int},                 # every reason above, zero included
     "trees": [{"name": str, "run": str, "rank": int, "slot_bytes": int | null,
                "slot_bytes_source": "option" | "trailer" | "guessed" | null, "chunk_files": int}],
     "problems": [{"path": str (relative to ROOT), "reason": str, "bytes": int, "repaired": bool}],
     "unverified": [str],                     # trailer-less files (paths relative to ROOT)
     "encrypted": [str],                      # encrypted files not decrypted (no --key-file)
     "invalid_runs": [{"name": str, "reason": str}], "orphan_trees": [str], "unsafe_entries": [str],
     "problems_left": int}
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from kvtier.layout import Namespace
from kvtier.ops import runs as _runs
from kvtier.ops.cli_args import CliParser
from kvtier.ops.runs import (
    Progress,
    discover,
    format_bytes,
    list_tree,
    printable_report,
    run_on_root,
)
from kvtier.ops.verify_workers import VERDICTS, Checker, CheckRequest, VerifyWorkers, reader_codec
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.fs.pool import usable_cpus
from kvtier.tiers.fs.tree import key_from_relpath
from kvtier.tiers.integrity import TRAILER_PAGE, identity

__all__ = ["run_verify_cli", "build_parser", "verify_root", "REASONS", "IO_DEPTH"]

#: Every reason a file can be reported for.
REASONS: tuple[str, ...] = (
    "short", "long", "bad_trailer", "old_version", "checksum", "wrong_chunk", "unverified", "not_regular", "stray",
    "unreadable", "codec", "no_codec", "undecryptable", "no_key", "encrypted",
)
# Problems --repair never removes: nothing is known of the bytes, or their key may be elsewhere.
_KEPT = frozenset({"unreadable", "no_key", "no_codec"})
# Files per batch at most: a request of 256 layout paths and identities is ~56 KB, within a pipe's
# 64 KiB, so the parent's send to a worker busy with its other request never waits for it.
_BATCH = 256
#: Default ``--io-depth``: reads in flight (all readers) for files not in the page cache: NVMe and NFS want many
IO_DEPTH = 32

_EPILOG = """\
exit status:
  0  no problems found (or every one repaired with --repair)
  1  problems found and not repaired, the check could not finish (a worker failed), or the
     output could not be written
  2  usage error (bad arguments, ROOT missing or not a directory, no run matches --run)
"""


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--workers", type=functools.partial(_runs.count_arg, most=1024), default=usable_cpus(), metavar="N",
                        help="readers: N worker processes, 1 = this process alone (the usable cores)")
    parser.add_argument("--io-depth", type=functools.partial(_runs.count_arg, most=256), default=IO_DEPTH, metavar="N",
                        help="reads in flight for files not in the page cache, shared among the readers (at "
                             "least one each; each holds a buffer of one slot); cached files are checked at once")
    parser.add_argument("--slot-bytes", type=_runs.size_arg, default=None, metavar="BYTES",
                        help="slot size of every run (e.g. 256KiB); read from the trailers when not given")
    parser.add_argument("--tmp-grace", type=float, default=3600.0, metavar="SECONDS",
                        help="temporary files older than this are stray (the tier's stale_tmp_grace_s)")
    parser.add_argument("--key-file", default=None, metavar="PATH",
                        help="the tiers' encryption key file: encrypted chunks are decrypted and so proven "
                             "authentic (without it they are reported 'encrypted', unchecked)")
    return parser


@dataclass(slots=True)
class _Tree:
    index: int  # of its descriptor among those the workers hold
    name: str
    run: str
    rank: int
    fd: int
    namespace: Namespace
    slot: int | None
    slot_source: str | None
    listing: _runs.TreeListing


_Work = tuple[_Tree, _runs.FileEntry, bytes]  # a chunk file to check, with its identity


def _raw_slot_guess(sizes: list[int]) -> int | None:
    if not sizes:
        return None
    top, _ = collections.Counter(sizes).most_common(1)[0]
    return top if top > 0 and top % TRAILER_PAGE == 0 else None


def verify_root(root_fd: int, root: str, *, workers: int, io_depth: int = IO_DEPTH, run_filter: str | None = None,
                repair: bool = False, slot_bytes: int | None = None, tmp_grace_s: float = 3600.0,
                progress_stream: TextIO | None = None,
                before_repair: Callable[[dict[str, Any]], None] | None = None,
                key_file: str | None = None) -> dict[str, Any]:
    """Verify (and with ``repair`` clean) ROOT open as ``root_fd``; the ``--json`` document.
    ``workers``: readers (more than one: worker processes, see the module docstring);
    ``io_depth``: reads in flight over all of them for files not in the page cache.
    ``before_repair(report)``: with ``repair``, called once every file is checked and before
    anything is removed, with the report as found (no problem ``repaired`` yet): the command
    writes its report there, and what it raises (an output that fails) stops the repair with
    nothing removed.

    ``key_file``: the encryption key file that decrypts encrypted chunks (checked here first).

    ``ValueError`` when ``run_filter`` matches no run or ``workers``/``io_depth`` is below 1, or
    the key file is unusable (:class:`~kvtier.errors.ConfigError`); ``OSError`` when a worker
    fails or this process runs out of descriptors or memory."""
    if workers < 1 or io_depth < 1:
        raise ValueError(f"workers and io_depth must be at least 1, got {workers} and {io_depth}")
    if key_file:
        key_file = os.path.abspath(key_file)  # workers are told the path
        reader_codec(TRAILER_PAGE, key_file)  # an unusable key file fails before any work
    found = discover(root_fd)
    selected = [r for r in found.runs if run_filter is None or run_filter in (r.digest, r.name)]
    if run_filter is not None and not selected:
        raise ValueError(f"no run with digest or name {run_filter!r} under {_runs.printable(root)}")
    trees: list[_Tree] = []
    tree_fds: list[int] = []
    now = time.time()
    problems: list[dict[str, Any]] = []
    counts = dict.fromkeys(REASONS, 0)
    unverified: list[str] = []
    encrypted: list[str] = []
    tmp_in_progress = 0
    try:
        opened = []
        for run in selected:
            for tree in run.trees:
                try:
                    tree_fds.append(beneath.open_dir(root_fd, tree.name))
                except (FileNotFoundError, beneath.UnsafeEntry):
                    continue
                opened.append((run, tree))
        with contextlib.ExitStack() as stack:
            pool = None
            if workers > 1 and tree_fds:
                # Started first: they boot (~0.1 s) while the trees are listed.
                pool = stack.enter_context(VerifyWorkers(tree_fds, workers, _depth_per_reader(io_depth, workers),
                                                         key_file))
            for index, (run, tree) in enumerate(opened):
                tree_fd = tree_fds[index]
                listing = list_tree(root_fd, tree.name)
                slot, source = slot_bytes, "option"
                if slot is None:
                    slot, source = _runs.slot_from_trailers(tree_fd, listing), "trailer"
                if slot is None:
                    # No trailer vouches for a size: take the most common size as trailer-less
                    # (vLLM) slots, the guess under which no file is removed for its size alone.
                    slot, source = _raw_slot_guess([c.size for c in listing.chunks]), "guessed"
                trees.append(_Tree(index, tree.name, run.name, tree.rank, tree_fd, tree.namespace, slot,
                                   source if slot is not None else None, listing))
            checked = _check_chunks(trees, pool, io_depth, progress_stream, key_file)
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
            elif verdict == "no_key" and not key_file:  # not decrypted: nothing known against it
                counts["encrypted"] += 1
                encrypted.append(f"{t.name}/{entry.relpath}")
            else:
                problems.append(_problem(t, entry.relpath, verdict, entry.size, False))
        for p in problems:
            counts[p["reason"]] += 1
        # Problems --repair never touches: unchecked files and those directly under ROOT.
        left_alone = unchecked + (len(found.invalid_runs) + len(found.orphan_trees) + len(found.unsafe_entries)
                                  if run_filter is None else 0)
        elapsed = checked["elapsed"]
        report = {
            "root": root,
            "workers": workers,
            "io_depth": io_depth,
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
                          "repaired": False} for p in problems],
            "unverified": unverified,
            "encrypted": encrypted,
            "invalid_runs": [{"name": n, "reason": r} for n, r in found.invalid_runs] if run_filter is None else [],
            "orphan_trees": found.orphan_trees if run_filter is None else [],
            "unsafe_entries": found.unsafe_entries if run_filter is None else [],
            "problems_left": len(problems) + left_alone,
        }
        if repair:
            if before_repair is not None:
                before_repair(report)
            by_name = {t.name: t for t in trees}
            for p, shown in zip(problems, report["problems"]):
                shown["repaired"] = p["reason"] not in _KEPT and _remove(by_name[p["tree"]].fd, p["relpath"])
            report["problems_left"] = sum(1 for p in report["problems"] if not p["repaired"]) + left_alone
        return report
    finally:
        for fd in tree_fds:
            os.close(fd)


def _problem(tree: _Tree, relpath: str, reason: str, size: int, is_dir: bool) -> dict[str, Any]:
    return {"tree": tree.name, "relpath": relpath, "reason": reason, "bytes": 0 if is_dir else size}


def _remove(tree_fd: int, relpath: str) -> bool:
    """Remove ``relpath`` beneath the tree without following links; True when it is gone."""
    try:
        chunks.remove_file(tree_fd, relpath)
        return True
    except OSError:  # a non-empty directory, permissions: left for the operator
        return False


def _depth_per_reader(io_depth: int, readers: int) -> int:
    """Each reader's share of ``io_depth`` reads in flight (rounded up: at least one)."""
    return -(-io_depth // readers)


def _check_chunks(trees: list[_Tree], workers: VerifyWorkers | None, io_depth: int,
                  progress_stream: TextIO | None, key_file: str | None = None) -> dict[str, Any]:
    """Read and check every chunk file of ``trees``: on ``workers``, or in this process when None
    (with ``io_depth`` reads in flight for files not in the page cache). ``results`` keep the
    trees' and listings' order whichever reads them."""
    work: list[_Work] = []
    results: list[tuple[_Tree, _runs.FileEntry, str | None]] = []
    for t in trees:
        for entry in t.listing.chunks:
            key = key_from_relpath(entry.relpath)
            if key is None or t.slot is None:  # no slot size could be found: nothing to check against
                results.append((t, entry, "unchecked"))
                continue
            work.append((t, entry, identity(key, t.namespace.fingerprint)))
    batches = _batches(work, workers.size if workers is not None else 0)
    batch_bytes = [sum(entry.size for _, entry, _ in batch) for batch in batches]
    verdicts: list[list[str | None]] = [[] for _ in batches]
    done = {"files": 0, "bytes": 0}

    def finished(number: int, found: list[str | None]) -> None:
        verdicts[number] = found
        done["files"] += len(found)
        done["bytes"] += batch_bytes[number]

    def render() -> str:
        elapsed = max(time.monotonic() - started, 1e-9)
        return (f"kvtier verify: {done['files']}/{len(work)} chunks, "
                f"{done['bytes'] / elapsed / 2**30:.2f} GiB/s")

    requests = []
    if workers is not None:
        requests = workers.prepare([
            CheckRequest(number, batch[0][0].index, _slot_of(batch[0][0]),
                         [(entry.relpath, chunk_identity) for _, entry, chunk_identity in batch])
            for number, batch in enumerate(batches)])
        # Their start-up is not part of the read-and-check phase.
        workers.wait_ready(sorted({_slot_of(batch[0][0]) for batch in batches}))
    started = time.monotonic()
    with Progress(render, stream=progress_stream):
        started = time.monotonic()
        if workers is None:
            checker = Checker(io_depth, key_file=key_file)
            try:
                for number, batch in enumerate(batches):
                    checker.submit(batch[0][0].fd, _slot_of(batch[0][0]),
                                   [(entry.relpath, chunk_identity) for _, entry, chunk_identity in batch],
                                   functools.partial(_codes_done, finished, number))
            finally:
                checker.close()
        else:
            workers.run(requests, lambda request, found: finished(request.id, found))
        elapsed = time.monotonic() - started
    for batch, found in zip(batches, verdicts):
        results.extend((t, entry, verdict) for (t, entry, _), verdict in zip(batch, found))
    return {"results": results, "elapsed": elapsed}


def _codes_done(finished: Callable[[int, list[str | None]], None], number: int, codes: list[int]) -> None:
    finished(number, [VERDICTS[code] for code in codes])


def _batches(work: list[_Work], workers: int) -> list[list[_Work]]:
    """``work`` cut into batches of one tree each (a request names one tree and its slot size).

    For ``workers`` processes the sizes shrink as the work runs out (guided scheduling): a batch
    holds a (2 x ``workers``)-th of what is left, at most :data:`_BATCH` files, so the parent is
    woken (each answer takes some of its CPU from the workers' cores) a few dozen times for a
    whole tree, and when the queue empties, what a worker still holds (two batches in flight) is
    a few files, not milliseconds of them that the others wait out idle. In this process
    (``workers`` 0) batches only pace the progress display.
    """
    batches: list[list[_Work]] = []
    left, size = len(work), 0
    for item in work:
        if not batches or len(batches[-1]) == size or batches[-1][0][0] is not item[0]:
            size = max(1, min(_BATCH, left // (2 * workers))) if workers else _BATCH
            batches.append([])
        batches[-1].append(item)
        left -= 1
    return batches


def _slot_of(tree: _Tree) -> int:
    assert tree.slot is not None  # trees without one have no work
    return tree.slot


def _removing(report: dict[str, Any], problem: dict[str, Any]) -> bool:
    """Whether ``--repair`` removes (or removed) this problem entry."""
    return bool(report["repair"]) and problem["reason"] not in _KEPT


def _problem_line(report: dict[str, Any], problem: dict[str, Any]) -> str:
    state = (" (to remove)" if _removing(report, problem) else " (kept)") if report["repair"] else ""
    return f"  {problem['reason']:<12} {problem['path']}{state}"


def _repair_line(report: dict[str, Any]) -> str:
    removing = sum(1 for p in report["problems"] if _removing(report, p))
    return f"repair: removing {removing} of {len(report['problems'])} problem entries"


def _print_check(report: dict[str, Any], out: TextIO) -> None:
    """What the check found (``report`` already :func:`~kvtier.ops.runs.printable_report`):
    with ``--repair``, written before anything is removed, naming every entry it will remove."""
    readers = f"{report['workers']} worker processes" if report["workers"] > 1 else "read in this process"
    print(f"root {report['root']}: {len(report['trees'])} rank tree(s), {readers}", file=out)
    for t in report["trees"]:
        slot = "unknown" if t["slot_bytes"] is None else f"{t['slot_bytes']} ({t['slot_bytes_source']})"
        print(f"  tree {t['name']}: {t['chunk_files']} chunk files, slot bytes {slot}", file=out)
    listed: collections.Counter[str] = collections.Counter()
    hidden: collections.Counter[str] = collections.Counter()
    for p in report["problems"]:
        if _removing(report, p) or listed[p["reason"]] < 20:  # what is removed is always named
            listed[p["reason"]] += 1
            print(_problem_line(report, p), file=out)
        else:
            hidden[p["reason"]] += 1
    for reason, n in hidden.items():
        print(f"  {reason:<12} ... {n} more", file=out)
    for path in report["unverified"][:20]:
        print(f"  {'unverified':<12} {path} (trailer-less, vLLM's format: kept)", file=out)
    if len(report["unverified"]) > 20:
        print(f"  {'unverified':<12} ... {len(report['unverified']) - 20} more", file=out)
    for path in report["encrypted"][:20]:
        print(f"  {'encrypted':<12} {path} (authenticity not checked: give --key-file)", file=out)
    if len(report["encrypted"]) > 20:
        print(f"  {'encrypted':<12} ... {len(report['encrypted']) - 20} more", file=out)
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
    print(f"read {format_bytes(report['bytes_read'])} in {report['elapsed_s']:.3f} s: "
          f"{report['gib_per_s']:.2f} GiB/s", file=out)
    if report["repair"]:
        print(_repair_line(report), file=out)


def _print_outcome(report: dict[str, Any], out: TextIO) -> None:
    """What is left (and with ``--repair``, what could not be removed), after the check's report."""
    if report["repair"]:
        for p in report["problems"]:
            if _removing(report, p) and not p["repaired"]:
                print(f"  NOT removed  {p['path']}", file=out)
        removed = sum(1 for p in report["problems"] if p["repaired"])
        print(f"repaired: removed {removed} of {len(report['problems'])} problem entries", file=out)
    print(f"problems left: {report['problems_left']}", file=out)


def run_verify_cli(argv: Sequence[str], *, out: TextIO | None = None) -> int:
    """Entry point of ``kvtier verify`` (exit status: see the module docstring)."""
    stream = out if out is not None else sys.stdout
    return run_on_root("verify", build_parser(), argv, lambda args, root_fd: _verify(args, root_fd, stream))


def _verify(args: argparse.Namespace, root_fd: int, out: TextIO) -> int:
    def report_before_repair(report: dict[str, Any]) -> None:
        # Everything it will remove is written (flushed) first: an output that fails removes nothing.
        if args.json:  # the document records what was removed: the entries go to stderr now
            shown = printable_report(report, sys.stderr)
            for p in shown["problems"]:
                if _removing(shown, p):
                    print(_problem_line(shown, p), file=sys.stderr)
            print(_repair_line(shown), file=sys.stderr)
            sys.stderr.flush()
        else:
            _print_check(printable_report(report, out), out)
            out.flush()

    report = verify_root(root_fd, args.root, workers=args.workers, io_depth=args.io_depth, run_filter=args.run,
                         repair=args.repair, slot_bytes=args.slot_bytes, tmp_grace_s=args.tmp_grace,
                         before_repair=report_before_repair, key_file=args.key_file)
    if args.json:
        _runs.write_json(report, out)
        print(f"kvtier verify: {report['gib_per_s']:.2f} GiB/s", file=sys.stderr)
    else:
        shown = printable_report(report, out)
        if not args.repair:  # with --repair, written before removing
            _print_check(shown, out)
        _print_outcome(shown, out)
    return 1 if report["problems_left"] else 0

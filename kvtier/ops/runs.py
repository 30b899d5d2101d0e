"""What the operator commands share: finding the run namespaces under a root and listing their trees.

A *run* is a directory ``<model>_<digest>`` under ROOT holding a ``config.json`` whose run fields
hash to ``<digest>`` (:func:`kvtier.layout.namespace`); its *rank trees* are the sibling
directories ``<model>_<digest>_r<rank>`` that :func:`~kvtier.layout.namespace` gives for that rank
(a parallelism-agnostic run has only ``_r0``). Everything else directly under ROOT is reported,
never touched:

* ``invalid_runs``: a ``<model>_<digest>`` directory whose ``config.json`` is missing, a link or
  special file, too large, not a JSON object, or describes another digest;
* ``orphan_trees``: a ``..._r<rank>`` directory with no valid run, or one that its run's fields
  never produce (a rank other than 0 for a parallelism-agnostic run);
* ``unsafe_entries``: a symbolic link or special file bearing a run or tree name (never followed);
* ``other_entries``: anything else.

Containment: ROOT is opened once (ROOT itself may be a link, like the tier's ``root_dir``); every
directory below it is opened ``O_NOFOLLOW`` relative to its parent's descriptor
(:mod:`kvtier.tiers.fs.beneath`), files are only ``lstat``-ed here, and nothing is modified.

:func:`list_tree` walks one rank tree with the fs tier's own walk (:mod:`kvtier.tiers.fs.scan`,
in scan worker processes on a big tree) and sorts what it finds into chunk files (regular files
of the layout's names), unsafe entries (links, special files or directories where a chunk or
shard directory belongs, reason ``not_regular``), temporary files (``<hash>.bin_<n>.tmp`` and
O_DIRECT probe files) and stray entries (any other name).
"""

from __future__ import annotations

import argparse
import collections
import json
import operator
import os
import re
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TextIO

import anyio

from kvtier.errors import ConfigError
from kvtier.layout import Namespace, manifest_of, namespace
from kvtier.tiers.fs import beneath, scan, tree
from kvtier.tiers.fs.pool import usable_cpus
from kvtier.tiers.fs.scan_workers import ScanWorkers
from kvtier.tiers.integrity import TRAILER_PAGE, TRAILER_SIZE, recorded_slot_bytes

__all__ = [
    "RootError",
    "RankTree",
    "Run",
    "Discovery",
    "TreeListing",
    "FileEntry",
    "open_root",
    "discover",
    "list_tree",
    "guess_slot_bytes",
    "slot_from_trailers",
    "parse_size",
    "format_bytes",
    "Progress",
    "SCAN_WORKERS",
    "IN_PROCESS_TOPS",
    "run_on_root",
    "count_arg",
    "printable",
    "printable_report",
    "write_json",
]

#: Scan worker processes of a tree listing: every usable core (an operator command has no event
#: loop to keep responsive; the workers run at the lowest CPU priority). ``--scan-workers``.
SCAN_WORKERS = usable_cpus()
#: Trees with at most this many top-level shard directories are listed in this thread (a worker
#: costs ~0.1 s to start), as the fs tier does.
IN_PROCESS_TOPS = 512
_TOPS_PER_REQUEST = 8
_BATCH_ENTRIES = 4096


class RootError(Exception):
    """ROOT does not exist, is not a directory, or cannot be opened (a usage error: exit 2)."""


@dataclass(slots=True)
class RankTree:
    name: str  # <model>_<digest>_r<rank>
    rank: int
    namespace: Namespace  # built with root "" (paths relative to ROOT)


@dataclass(slots=True)
class Run:
    name: str  # <model>_<digest>
    model: str
    digest: str
    fields: dict[str, Any]
    trees: list[RankTree] = field(default_factory=list)

    @property
    def manifest(self) -> dict[str, Any]:
        """The run's compatibility manifest, from its ``config.json`` (:func:`kvtier.layout.manifest_of`)."""
        return manifest_of(self.fields)


@dataclass(slots=True)
class Discovery:
    runs: list[Run] = field(default_factory=list)
    invalid_runs: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    orphan_trees: list[str] = field(default_factory=list)
    unsafe_entries: list[str] = field(default_factory=list)
    other_entries: list[str] = field(default_factory=list)


class FileEntry(NamedTuple):
    """One entry of a rank tree (a named tuple: a tree of 10^6 chunk files makes 10^6 of them)."""

    relpath: str  # relative to the rank tree
    size: int
    mtime: float
    is_dir: bool = False


@dataclass(slots=True)
class TreeListing:
    chunks: list[FileEntry] = field(default_factory=list)
    unsafe: list[FileEntry] = field(default_factory=list)  # reason not_regular
    tmp: list[FileEntry] = field(default_factory=list)
    stray: list[FileEntry] = field(default_factory=list)


def printable(text: str, encoding: str | None = None) -> str:
    """``text`` (a file name, or any string from disk or the command line) as operator output.

    File names are bytes: one that is not UTF-8 reaches Python with its bytes as lone surrogates
    (``os.fsdecode``), which no UTF-8 stream can write, and any name may hold control characters
    (a terminal escape sequence, a newline that forges a line of the report). Shown escaped:

    * a byte that is not UTF-8, and an ASCII control character (0x00-0x1f, 0x7f): ``\\xNN``,
      the byte as it is on disk;
    * another character that is not printable (C1 controls, bidirectional overrides, zero-width
      characters: ``str.isprintable``) or that ``encoding`` (the output's) cannot encode:
      ``\\uNNNN`` or ``\\UNNNNNNNN``, the code point (UTF-8 on disk);
    * a backslash: ``\\\\``, so that every escape reads one way.

    Any other character is shown as it is."""
    if text.isprintable() and "\\" not in text and _encodes(text, encoding):
        return text
    shown = []
    for char in text:
        code = ord(char)
        if char == "\\":
            shown.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's surrogate escape of byte (code - 0xDC00)
            shown.append(f"\\x{code - 0xDC00:02x}")
        elif char.isprintable() and _encodes(char, encoding):
            shown.append(char)
        elif code < 0x80:
            shown.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            shown.append(f"\\u{code:04x}")
        else:
            shown.append(f"\\U{code:08x}")
    return "".join(shown)


def _encodes(text: str, encoding: str | None) -> bool:
    if encoding is None:
        return True
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    except LookupError:  # an encoding Python does not know: keep to ASCII
        return text.isascii()
    return True


def printable_report(report: Any, out: TextIO | None = None) -> Any:
    """``report`` (a command's ``--json`` document) with every string, keys included, made
    :func:`printable` for ``out`` (its encoding): what its text and JSON output are written from."""
    encoding = getattr(out, "encoding", None) if out is not None else None
    return _printable_document(report, encoding if isinstance(encoding, str) else None)


def _printable_document(document: Any, encoding: str | None) -> Any:
    if isinstance(document, str):
        return printable(document, encoding)
    if isinstance(document, dict):
        return {printable(str(k), encoding): _printable_document(v, encoding) for k, v in document.items()}
    if isinstance(document, (list, tuple)):
        return [_printable_document(v, encoding) for v in document]
    return document


def write_json(report: dict[str, Any], out: TextIO) -> None:
    """An operator command's ``--json`` output: one indented document with sorted keys, every
    string :func:`printable` (so the document is ASCII: valid UTF-8, nothing a terminal acts on)."""
    json.dump(printable_report(report), out, indent=2, sort_keys=True)
    out.write("\n")


def open_root(path: str) -> int:
    """A directory descriptor of ROOT (which may itself be a link); :class:`RootError` otherwise."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RootError(f"{printable(path)}: no such directory") from None
    except NotADirectoryError:
        raise RootError(f"{printable(path)}: not a directory") from None
    except OSError as exc:
        raise RootError(f"{printable(path)}: cannot open ({exc.strerror or exc})") from None


def _read_config(root_fd: int, name: str) -> dict[str, Any]:
    """The parsed ``<name>/config.json``; ``ValueError`` with a short reason when unusable."""
    try:
        cfg_fd = beneath.open_dir(root_fd, name)
    except (beneath.UnsafeEntry, FileNotFoundError):
        raise ValueError("directory vanished or is a link") from None
    try:
        try:
            fd = tree.open_config_json(cfg_fd)
        except beneath.UnsafeEntry:
            raise ValueError("config.json is a symbolic link or special file") from None
        except OSError as exc:
            raise ValueError(f"config.json cannot be read ({exc.strerror or exc})") from None
        if fd is None:
            raise ValueError("no config.json")
        raw = tree.read_config_bytes(fd)
    finally:
        os.close(cfg_fd)
    try:
        return tree.decode_config_json(raw)
    except tree.ConfigJsonTooLarge:
        raise ValueError("config.json is too large") from None
    except tree.ConfigJsonNotObject:
        raise ValueError("config.json is not a JSON object") from None
    except ValueError:
        raise ValueError("config.json is not valid JSON") from None


def discover(root_fd: int) -> Discovery:
    """Sort the entries directly under ROOT into runs, their rank trees and the rest (no changes)."""
    found = Discovery()
    with os.scandir(root_fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    kinds: dict[str, int] = {}
    for entry in entries:
        try:
            kinds[entry.name] = entry.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
    runs: dict[str, Run] = {}
    for name, mode in kinds.items():
        match = tree.RUN_DIR.fullmatch(name)
        if match is None or tree.TREE_DIR.fullmatch(name):
            continue
        if not stat.S_ISDIR(mode):
            (found.unsafe_entries if stat.S_ISLNK(mode) else found.other_entries).append(name)
            continue
        try:
            fields = _read_config(root_fd, name)
            ns = namespace("", fields, 0)
        except ValueError as exc:
            found.invalid_runs.append((name, str(exc)))
            continue
        except ConfigError as exc:
            found.invalid_runs.append((name, f"config.json: {exc}"))
            continue
        if ns.leaf != name:
            found.invalid_runs.append((name, f"config.json describes run {ns.leaf}, not {name}"))
            continue
        runs[name] = Run(name, str(fields["model_name"]), ns.digest, fields)
    for name, mode in kinds.items():
        match = tree.TREE_DIR.fullmatch(name)
        if match is None:
            if tree.RUN_DIR.fullmatch(name) is None:
                found.other_entries.append(name)
            continue
        if not stat.S_ISDIR(mode):
            (found.unsafe_entries if stat.S_ISLNK(mode) else found.other_entries).append(name)
            continue
        run = runs.get(match.group(1))
        rank = int(match.group(2))
        tree_ns = namespace("", run.fields, rank) if run is not None else None
        if run is None or tree_ns is None or tree_ns.blocks_leaf != name:
            found.orphan_trees.append(name)
            continue
        run.trees.append(RankTree(name, rank, tree_ns))
    found.runs = sorted(runs.values(), key=lambda r: r.name)
    for run in found.runs:
        run.trees.sort(key=lambda t: t.rank)
    return found


def _lstat(entry: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


def _entry(relpath: str, st: os.stat_result) -> FileEntry:
    return FileEntry(relpath, st.st_size, st.st_mtime, stat.S_ISDIR(st.st_mode))


def list_tree(root_fd: int, tree_name: str, *, workers: int = SCAN_WORKERS,
              on_shard: Callable[[], None] | None = None) -> TreeListing:
    """Everything under rank tree ``tree_name`` (stat only, nothing followed, nothing changed).

    The top-level shard directories are walked by :mod:`kvtier.tiers.fs.scan`'s reporting walk:
    by ``workers`` scan worker processes (:mod:`kvtier.tiers.fs.scan_workers`) on a tree of more
    than :data:`IN_PROCESS_TOPS` of them, in this thread otherwise. Chunks are sorted oldest first
    (by mtime). ``on_shard`` is called after each top-level shard directory (progress)."""
    out = TreeListing()
    tree_fd = scan.open_dir(root_fd, tree_name)
    if tree_fd is None:
        return out
    try:
        for top in scan.scandir(tree_fd):
            if tree.TOP_DIR.fullmatch(top.name):
                continue  # the walk's: a link or file under a shard name is found unsafe there
            st = _lstat(top)
            if st is None:
                continue
            if tree.PROBE_NAME.fullmatch(top.name) and not stat.S_ISDIR(st.st_mode):
                out.tmp.append(_entry(top.name, st))
            else:
                out.stray.append(_entry(top.name, st))
        plan = scan.PassPlan(scan.list_root(tree_fd, None), scan.LeafMtimes(), tmp_grace_s=None,
                                tops_per_request=_TOPS_PER_REQUEST, budget=_BATCH_ENTRIES, report=True)

        def collect(batch: scan.ScanBatch) -> None:
            for leaf in batch.leaves:
                leaf_dir = tree.leaf_relpath(leaf.group, leaf.leaf)
                out.chunks += [FileEntry(f"{leaf_dir}/{tree.chunk_name(key)}", size, mtime)
                               for key, size, mtime in leaf.chunks]
            for other in batch.others:
                getattr(out, other.kind).append(FileEntry(os.fsdecode(other.relpath), other.size, other.mtime,
                                                          other.is_dir))
            if on_shard is not None and batch.end and batch.request >= 0:  # a request's top directories are done
                for _ in plan.root.tops[batch.request * _TOPS_PER_REQUEST:(batch.request + 1) * _TOPS_PER_REQUEST]:
                    on_shard()

        if len(plan.root.tops) <= IN_PROCESS_TOPS:
            for i in range(len(plan)):
                for batch in scan.walk_tops(tree_fd, plan.request(i)):
                    collect(batch)
        else:
            anyio.run(_walk_in_workers, tree_fd, plan, workers, collect)
    finally:
        os.close(tree_fd)
    out.chunks.sort(key=operator.attrgetter("mtime", "relpath"))
    return out


async def _walk_in_workers(tree_fd: int, plan: scan.PassPlan, workers: int,
                           collect: Callable[[scan.ScanBatch], None]) -> None:
    async def apply(batch: scan.ScanBatch) -> None:
        collect(batch)

    pool = ScanWorkers(workers)
    try:
        await pool.walk(tree_fd, plan, due=None, apply=apply, turns=False)
    finally:
        await pool.aclose()


def guess_slot_bytes(sizes: list[int]) -> int | None:
    """``slot_bytes`` of a tree from its chunk file sizes alone (config.json does not record the
    KV geometry — head count and head size — so it cannot be computed from the run fields).

    The most common size ``M`` is taken to be the trailered size, so ``slot_bytes = M - 4096``;
    except when files of ``M + 4096`` bytes exist as well, in which case ``M`` is the
    trailer-less (vLLM) size of a tree mostly written by vLLM. ``None`` for an empty tree or a
    most common size that cannot be a kvtier chunk (not a positive multiple of 4096)."""
    if not sizes:
        return None
    counts = collections.Counter(sizes)
    top, _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if top % TRAILER_PAGE or top < 2 * TRAILER_PAGE:
        return top if top % TRAILER_PAGE == 0 and top > 0 else None
    if counts.get(top + TRAILER_PAGE):
        return top
    return top - TRAILER_PAGE


def slot_from_trailers(tree_fd: int, listing: TreeListing) -> int | None:
    """``slot_bytes`` as the trailer of a file of one of the three most common sizes records it
    (at most three files read per size); None when none of them records one."""
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
                fd = beneath.open_file(tree_fd, relpath, os.O_RDONLY)
            except OSError:
                continue
            try:
                trailer = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE)
            except OSError:
                continue
            finally:
                os.close(fd)
            slot = recorded_slot_bytes(trailer, size)
            if slot is not None:
                return slot
    return None


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"1048576"``, ``"512MiB"``, ``"10G"``, ``"1.5GiB"``, ``"20GB"``.

    ``K/M/G/T/P`` alone and ``KiB/MiB/...`` are powers of 1024 (as ``du``/``df`` print them);
    ``KB/MB/GB/...`` are powers of 1000. ``ValueError`` otherwise."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 1048576, 512MiB, 10G, 20GB)")
    number, unit, binary, b = match.groups()
    power = "kmgtp".find(unit.lower()) + 1 if unit else 0
    if binary and not unit:
        raise ValueError(f"not a size: {text!r}")
    base = 1000 if (unit and b and not binary) else 1024
    value = float(number) * base**power
    if value >= 2**63:
        raise ValueError(f"size too large: {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """``"1.5 GiB"``-style text."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with defaults shown and the epilog (exit statuses) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help  # nothing worth showing: the help text says what happens
        return super()._get_help_string(action)


def run_on_root(name: str, parser: argparse.ArgumentParser, argv: Sequence[str],
                body: Callable[[argparse.Namespace, int], int]) -> int:
    """The frame of every operator command: parse ``argv``, open ROOT, return ``body(args, root_fd)``.

    Usage errors, an unusable ROOT and a ``ValueError`` from ``body`` (a bad combination of
    arguments) print one line and give status 2; an ``OSError`` while working, or an output that
    cannot be written (a closed pipe, a full disk, a character its encoding lacks), gives 1.
    ROOT's descriptor is closed whatever happens.
    """
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # the parser printed the usage error (or --help)
        return int(exc.code or 0)
    try:
        root_fd = open_root(args.root)
    except RootError as exc:
        _error(name, str(exc))
        return 2
    try:
        return body(args, root_fd)
    except UnicodeError as exc:  # a ValueError, but the output's trouble, not the arguments'
        _error(name, f"cannot write the report: {exc}")
        return 1
    except ValueError as exc:
        _error(name, str(exc))
        return 2
    except OSError as exc:
        text = exc.strerror if exc.strerror is not None else str(exc)  # not "[Errno 32] ..."
        where = exc.filename
        _error(name, text if where is None
               else f"{printable(os.fsdecode(where) if isinstance(where, (str, bytes)) else str(where))}: {text}")
        return 1
    finally:
        os.close(root_fd)


def _error(command: str, text: str) -> None:
    """One error line on stderr; nothing when stderr itself cannot be written (the status says it)."""
    try:
        print(f"kvtier {command}: error: {text}", file=sys.stderr)
        sys.stderr.flush()
    except OSError:
        pass


def count_arg(text: str, *, most: int | None = None) -> int:
    """argparse type: an int >= 1 (a count of workers or threads), at most ``most`` if given
    (bind it with :func:`functools.partial`)."""
    allowed = ">= 1" if most is None else f"in 1..{most}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer {allowed}, got {text!r}") from None
    if value < 1 or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"expected an integer {allowed}, got {value}")
    return value


def size_arg(text: str) -> int:
    """argparse type: a positive :func:`parse_size` size."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


class Progress:
    """A one-line progress display on stderr, only when stderr is a terminal; thread safe."""

    def __init__(self, render: Callable[[], str], *, stream: TextIO | None = None, interval_s: float = 0.25) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._render = render
        self._interval = interval_s
        self._enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    def __enter__(self) -> Progress:
        if self._enabled:
            self._thread = threading.Thread(target=self._loop, name="kvtier-ops-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._stream.write("\r\x1b[K")
            self._stream.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._stream.write("\r\x1b[K" + self._render())
            self._stream.flush()

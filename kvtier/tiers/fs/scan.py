"""Listing a run's block tree, ``<hhh>/<hh>_g<group>/<hash>.bin``: the one scanning code of the fs
tier's scans and of ``kvtier inspect``/``kvtier gc``.

Nothing is followed: every directory is opened ``O_NOFOLLOW`` beneath its parent's descriptor, so
a listing never leaves the tree. Functions here only list and classify (the tier's walk also
removes stale temporaries and links under layout names: its own tree is its to clean).

At 10^6 chunk files a tree has ~650,000 leaf directories (``<hhh>/<hh>_g<group>``; up to 2^20 per
group). The fs tier's periodic re-sync therefore costs what changed, not what exists: each leaf
directory is ``stat``ed and only those whose mtime differs from the one recorded when last listed
are listed (adding or removing a file changes its directory's mtime). A listing's mtime is
recorded only once the caller applied it (:meth:`LeafMtimes.commit`); a leaf whose mtime is too
recent to be trusted (a change within the same timestamp tick would not show) is not recorded, so
the next pass lists it again.

A pass is :func:`list_root` (names only), then :class:`WalkRequest` s of a few top directories
each, answered by :func:`walk_tops` with :class:`ScanBatch` es. Requests and batches are msgspec
structs so that a scan worker process (:func:`worker_main`, driven by
:mod:`kvtier.tiers.fs.scan_workers`) can walk a big tree off the event loop's interpreter. This
module imports nothing of kvtier's but the tree's names (:mod:`kvtier.tiers.fs.tree`) and
:mod:`kvtier.worker_io`, so that a worker starts fast.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from kvtier.tiers.fs import tree
from kvtier.tiers.fs.tree import LEAVES_PER_TOP, MAX_KEY_BYTES, TOPS
from kvtier.worker_io import die_with_parent, requests, write_all

__all__ = [
    "DIR_FLAGS", "RACY_MTIME_S",
    "Leaf", "RootListing", "WalkRequest", "LeafListing", "TopListing", "Other", "ScanBatch", "ScanStopped",
    "LeafMtimes", "PassPlan", "open_dir", "scandir", "list_leaf", "list_root", "walk_tops", "walk_tree",
    "worker_main", "BATCH_HEADER",
]

DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC
#: A leaf whose mtime is younger than this (seconds) when listed is listed again by the next pass:
#: timestamps are coarse (and on NFS set by another clock), so a change right after the listing
#: might not move it.
RACY_MTIME_S = 2.0


class ScanStopped(Exception):
    """A scan gave up because its ``stop`` event was set (the tier is closing)."""


def open_dir(parent_fd: int, name: str) -> int | None:
    """Open directory ``name`` beneath ``parent_fd`` without following a link; None when it is
    gone, a link or not a directory (the caller tells those apart by its own ``lstat``)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return None
        raise


def scandir(fd: int) -> list[os.DirEntry[str]]:
    """Entries of the directory open at ``fd``; [] if it is gone. The entries' ``stat()`` works
    while ``fd`` stays open. A listing moves the position of ``fd`` (shared by its duplicates):
    two listings of one descriptor at once would split its entries between them."""
    try:
        with os.scandir(fd) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


@dataclass(slots=True)
class Leaf:
    """One leaf directory's entries, classified (nothing removed)."""

    chunks: list[tuple[bytes, int, float]] = field(default_factory=list)  # key, size, mtime
    tmp: list[tuple[str, os.stat_result]] = field(default_factory=list)
    unsafe: list[tuple[str, os.stat_result]] = field(default_factory=list)  # links, special files
    stray: list[tuple[str, os.stat_result]] = field(default_factory=list)  # other names


def list_leaf(leaf_fd: int, top: str, leaf_hex: str, group: int) -> Leaf:
    """Classify every entry of leaf directory ``<top>/<leaf_hex>_g<group>`` open at ``leaf_fd``."""
    out = Leaf()
    chunks = out.chunks
    group_bytes = group.to_bytes(4, "big")
    for entry in scandir(leaf_fd):
        name = entry.name
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile by another process
            continue
        key = tree.chunk_key(name, top, leaf_hex, group_bytes)
        if key is not None:
            if stat.S_ISREG(st.st_mode):
                chunks.append((key, st.st_size, st.st_mtime))
            else:
                out.unsafe.append((name, st))
        elif tree.CHUNK_TMP.fullmatch(name) and not stat.S_ISDIR(st.st_mode):
            out.tmp.append((name, st))
        else:
            out.stray.append((name, st))
    return out


# ------------------------------------------------------------------------------------------------
# What a pass asks and what it gets back (msgspec structs: they cross a pipe from a worker)
# ------------------------------------------------------------------------------------------------

_Group = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_Top = Annotated[int, msgspec.Meta(ge=0, lt=TOPS)]
_LeafNo = Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]
_GroupLeaf = Annotated[int, msgspec.Meta(ge=0, lt=1 << 52)]
_Key = Annotated[bytes, msgspec.Meta(min_length=5, max_length=MAX_KEY_BYTES)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class WalkRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Walk these top directories (each whole), in batches of about ``budget`` entries. With
    ``report`` the walk removes nothing, reports every entry that is not a chunk file
    (:attr:`ScanBatch.others`) and no :class:`TopListing`: the operator commands' listing."""

    id: int
    tops: list[tuple[_Top, int]]  # (top, its mtime (ns) when last listed and applied; 0: unknown)
    #: Per group: the recorded mtime (ns) of each of the 256 leaves of each top above, in order.
    leaf_mtimes: dict[_Group, bytes]
    tmp_grace_s: float | None  # stale temporaries older than this are removed; None keeps them
    budget: _Count
    report: bool = False


class LeafListing(msgspec.Struct, array_like=True):
    """The chunk files one leaf directory held when it was listed."""

    group: _Group
    leaf: _LeafNo  # the first 20 bits of the hash: top << 8 | second-level shard
    listed_at: float  # monotonic, taken before the listing started
    chunks: list[tuple[_Key, _Count, float]]  # key, size, mtime
    mtime_ns: int = 0  # the directory's mtime, stat'ed before the listing (0: not to be trusted)


class TopListing(msgspec.Struct, array_like=True):
    """Which leaf directories one top-level directory held (``group << 20 | leaf`` each); ``present``
    None: it is gone. A pass reports a top directory only when its mtime moved (or it is gone)."""

    top: _Top
    listed_at: float
    present: frozenset[_GroupLeaf] | None
    mtime_ns: int = 0  # its mtime before it was listed (0: gone, or not to be trusted)


_OtherKind = Literal["tmp", "unsafe", "stray"]


class Other(msgspec.Struct, array_like=True):
    """An entry that is not a chunk file, as a reporting walk finds it (nothing removed):
    ``tmp`` (a temporary file), ``unsafe`` (a link, special file or directory where a chunk or a
    shard directory belongs), ``stray`` (any other name)."""

    kind: _OtherKind
    relpath: Annotated[bytes, msgspec.Meta(max_length=1024)]  # relative to the tree (os.fsencode)
    size: _Count
    mtime: float
    is_dir: bool


class ScanBatch(msgspec.Struct, array_like=True):
    request: int = 0  # the WalkRequest's id
    leaves: list[LeafListing] = []
    tops: list[TopListing] = []
    others: list[Other] = []  # a reporting walk's
    removed_tmp: _Count = 0
    kept_tmp: _Count = 0
    removed_unsafe: _Count = 0
    leaves_checked: _Count = 0
    leaves_listed: _Count = 0
    files: _Count = 0
    unreadable: _Count = 0  # directories that could not be read (permission denied), skipped
    cpu_s: float = 0.0  # CPU time the walk took for this batch
    end: bool = False  # the last batch of its request
    error: str = ""  # the request failed (an OSError): what the walker saw
    errno: int = 0


@dataclass(slots=True)
class RootListing:
    """The top directories a tree holds (by name: a link under a top name is found by the walk),
    and the stale probe files removed."""

    tops: list[int]
    listed_at: float
    removed_tmp: int = 0
    kept_tmp: int = 0


def list_root(dir_fd: int, tmp_grace_s: float | None) -> RootListing:
    """List the tree's root: top directory names (no ``stat`` each: 4096 of them on a big tree)
    and stale probe files, removed when older than ``tmp_grace_s`` (None keeps them)."""
    listed_at = time.monotonic()
    # A descriptor of our own for the listing: the tree's is shared with other users.
    own = os.open(".", DIR_FLAGS, dir_fd=dir_fd)
    out = RootListing([], listed_at)
    try:
        now = time.time()
        for name in os.listdir(own):
            if tree.TOP_DIR.fullmatch(name):
                out.tops.append(int(name, 16))
            elif tree.PROBE_NAME.fullmatch(name):
                try:
                    st = os.stat(name, dir_fd=own, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if tmp_grace_s is not None and now - st.st_mtime > tmp_grace_s and not stat.S_ISDIR(st.st_mode):
                    out.removed_tmp += _unlink_quietly(name, own)
                else:
                    out.kept_tmp += 1
    finally:
        os.close(own)
    out.tops.sort()
    return out


# ------------------------------------------------------------------------------------------------
# The walk
# ------------------------------------------------------------------------------------------------


def walk_tops(dir_fd: int, request: WalkRequest, *, clock: Callable[[], float] = time.thread_time,
              stop: threading.Event | None = None) -> Iterator[ScanBatch]:
    """Answer ``request``: stat every leaf directory of its top directories, list those whose
    mtime differs from the one recorded, report top directories whose own mtime moved (a leaf
    directory was created or removed) or that are gone. Batches of about ``request.budget``
    entries (a top directory is never split); the last one has ``end`` set. ``clock`` measures
    the CPU taken. Raises :class:`ScanStopped` at the next top directory once ``stop`` is set."""
    now = time.time()
    racy_ns = int((now - RACY_MTIME_S) * 1e9)
    recorded: dict[int, array[int]] = {}
    for group, blob in request.leaf_mtimes.items():
        arr = recorded[group] = array("q")
        arr.frombytes(blob)
        if len(arr) != LEAVES_PER_TOP * len(request.tops):
            raise ValueError(f"leaf_mtimes[{group}] holds {len(arr)} mtimes for {len(request.tops)} top directories")
    walker = _TopWalker(dir_fd, recorded, racy_ns, now, request.tmp_grace_s, request.report)
    out, handled, cpu = ScanBatch(request.id), 0, clock()
    last = len(request.tops) - 1
    for i, (top, top_mtime) in enumerate(request.tops):
        if stop is not None and stop.is_set():
            raise ScanStopped("scan stopped")
        handled += walker.walk(top, top_mtime, i * LEAVES_PER_TOP, out)
        if handled >= request.budget and i < last:
            out.cpu_s, cpu = clock() - cpu, clock()
            yield out
            out, handled = ScanBatch(request.id), 0
    out.end = True
    out.cpu_s = clock() - cpu
    yield out


class _TopWalker:
    """The per-directory work of :func:`walk_tops`."""

    __slots__ = ("_fd", "_recorded", "_racy_ns", "_now", "_grace", "_report")

    def __init__(self, dir_fd: int, recorded: dict[int, array[int]], racy_ns: int, now: float,
                 tmp_grace_s: float | None, report: bool) -> None:
        self._fd, self._recorded, self._racy_ns, self._now, self._grace = dir_fd, recorded, racy_ns, now, tmp_grace_s
        self._report = report

    def _unreadable(self, exc: PermissionError, out: ScanBatch) -> None:
        """A directory that cannot be read: a reporting walk fails (an operator command says
        so); the tier's walk counts it and goes on, so one bad directory does not fail every
        pass (the caller logs the count; the next pass tries it again)."""
        if self._report:
            raise exc
        out.unreadable += 1

    def _not_a_directory(self, dir_fd: int, name: str, relpath: str, out: ScanBatch) -> None:
        """``name`` could not be opened as a directory: gone, or a link or file under a shard
        directory's name: removed, or reported."""
        if not self._report:
            out.removed_unsafe += _remove_non_directory(dir_fd, name)
            return
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            out.others.append(_other("unsafe", relpath, st))

    def walk(self, top: int, top_mtime: int, base: int, out: ScanBatch) -> int:
        """One top directory; the entries handled. ``base``: where its leaves' recorded mtimes
        start in the request's arrays. One ``listed_at`` serves all its leaves: taken before any
        of them is listed, it is only ever too early (the safe side: see :class:`LeafListing`)."""
        top_name = f"{top:03x}"
        listed_at = time.monotonic()
        try:
            top_fd = open_dir(self._fd, top_name)
        except PermissionError as exc:
            self._unreadable(exc, out)
            return 0  # no listing: what the index holds of it stays
        if top_fd is None:  # gone meanwhile, or a link or file under its name
            self._not_a_directory(self._fd, top_name, top_name, out)
            if not self._report:
                out.tops.append(TopListing(top, listed_at, None))
            return 0
        handled = 0
        try:
            mtime_ns = os.fstat(top_fd).st_mtime_ns
            moved = not top_mtime or mtime_ns != top_mtime
            present: set[int] | None = set() if moved and not self._report else None
            recorded = self._recorded
            names = os.listdir(top_fd)
            for name in names:
                parsed = tree.parse_leaf_name(name)
                if parsed is None:
                    if self._report:
                        self._stray(top_fd, name, f"{top_name}/{name}", out)
                    continue
                handled += 1
                low, group = parsed
                leaf = top << 8 | low
                arr = recorded.get(group)
                seen = 0 if arr is None else arr[base + low]  # 0: never listed, or not to be trusted
                if seen:  # a stat tells whether it changed; most have not
                    try:
                        st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode) and st.st_mtime_ns == seen:
                        if present is not None:
                            present.add(group << 20 | leaf)
                        continue
                # Unknown or changed: open it (without following a link) and stat what was opened.
                try:
                    leaf_fd = open_dir(top_fd, name)
                except PermissionError as exc:  # there, but unreadable: its chunks stay as indexed
                    self._unreadable(exc, out)
                    if present is not None:
                        present.add(group << 20 | leaf)
                    continue
                if leaf_fd is None:  # gone meanwhile, or a link or file under its name
                    self._not_a_directory(top_fd, name, f"{top_name}/{name}", out)
                    out.leaves.append(LeafListing(group, leaf, listed_at, []))  # holds no chunk
                    continue
                if present is not None:
                    present.add(group << 20 | leaf)
                try:
                    leaf_mtime = os.fstat(leaf_fd).st_mtime_ns
                    trusted = leaf_mtime if leaf_mtime < self._racy_ns else 0  # recorded once the caller commits
                    handled += self._list(leaf_fd, top_name, name, group, leaf, listed_at, trusted, out)
                except PermissionError as exc:  # its entries cannot be stat'ed
                    self._unreadable(exc, out)
                finally:
                    os.close(leaf_fd)
            out.leaves_checked += len(names)
        finally:
            os.close(top_fd)
        if present is not None:
            out.tops.append(TopListing(top, listed_at, frozenset(present), mtime_ns if mtime_ns < self._racy_ns else 0))
        return handled

    def _list(self, leaf_fd: int, top_name: str, name: str, group: int, leaf: int, listed_at: float,
              mtime_ns: int, out: ScanBatch) -> int:
        found = list_leaf(leaf_fd, top_name, name[:2], group)
        if self._report:
            kinds: tuple[tuple[_OtherKind, list[tuple[str, os.stat_result]]], ...] = (
                ("unsafe", found.unsafe), ("tmp", found.tmp), ("stray", found.stray))
            for kind, entries in kinds:
                out.others += [_other(kind, f"{top_name}/{name}/{entry_name}", st) for entry_name, st in entries]
        else:
            for entry_name, _ in found.unsafe:
                out.removed_unsafe += _unlink_quietly(entry_name, leaf_fd)  # a directory stays
            for entry_name, st in found.tmp:
                if self._grace is not None and self._now - st.st_mtime > self._grace:
                    out.removed_tmp += _unlink_quietly(entry_name, leaf_fd)
                else:
                    out.kept_tmp += 1
        out.leaves.append(LeafListing(group, leaf, listed_at, found.chunks, mtime_ns))
        out.leaves_listed += 1
        out.files += len(found.chunks)
        return len(found.chunks) + len(found.tmp) + len(found.unsafe) + len(found.stray)


    @staticmethod
    def _stray(dir_fd: int, name: str, relpath: str, out: ScanBatch) -> None:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        out.others.append(_other("stray", relpath, st))


def _other(kind: _OtherKind, relpath: str, st: os.stat_result) -> Other:
    return Other(kind, os.fsencode(relpath), st.st_size, st.st_mtime, stat.S_ISDIR(st.st_mode))


def _remove_non_directory(dir_fd: int, name: str) -> bool:
    """Remove ``name`` if it is there and not a directory (a link or file under a shard
    directory's name); whether it was removed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return not stat.S_ISDIR(st.st_mode) and _unlink_quietly(name, dir_fd)


def _unlink_quietly(name: str, dir_fd: int) -> bool:
    """Remove ``name`` (never a directory); whether it was removed, so counts say what happened."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# What was seen: the records that let a re-sync skip unchanged directories
# ------------------------------------------------------------------------------------------------


class LeafMtimes:
    """The mtime (ns) each shard directory had when last listed *and applied*; 0 = unknown. Leaves
    are keyed ``group << 20 | leaf``, top directories by their 12 bits (a top's mtime moves when a
    leaf directory is created or removed in it).

    Requests carry these to the walker. The caller records a batch with :meth:`commit` once it
    made its index agree with it: a batch that is lost (a walk that failed, a pass cancelled
    before its batch was applied) leaves its directories to be listed again by the next pass,
    never recorded as seen. :meth:`invalidate` makes passes list a leaf again until a listing that
    started after the invalidation is committed. Loop thread only.
    """

    def __init__(self) -> None:
        self._leaves: dict[int, array[int]] = {}
        self.tops = array("q", bytes(8 * TOPS))
        self._dirty: dict[int, float] = {}  # group << 20 | leaf -> when invalidated (monotonic)

    def group(self, group: int) -> array[int]:
        """The leaf mtimes of one group (allocated on first use: 8 MiB)."""
        arr = self._leaves.get(group)
        if arr is None:
            arr = self._leaves[group] = array("q", bytes(8 * TOPS * LEAVES_PER_TOP))
        return arr

    def invalidate(self, group: int, leaf: int) -> None:
        self._dirty[group << 20 | leaf] = time.monotonic()
        arr = self._leaves.get(group)
        if arr is not None:
            arr[leaf] = 0

    def commit(self, batch: ScanBatch) -> None:
        """Record the mtimes ``batch``'s directories had when listed: the caller applied it.
        Cheap (no work per chunk): run it on the event loop after each batch."""
        dirty = self._dirty
        for listing in batch.leaves:
            mtime_ns = listing.mtime_ns
            if dirty:
                group_leaf = listing.group << 20 | listing.leaf
                at = dirty.get(group_leaf)
                if at is not None:
                    if at <= listing.listed_at:
                        del dirty[group_leaf]
                    else:  # invalidated after this listing began: it may predate the change
                        mtime_ns = 0
            self.group(listing.group)[listing.leaf] = mtime_ns
        tops = self.tops
        for top in batch.tops:
            tops[top.top] = top.mtime_ns

    def slices(self, tops: list[int]) -> dict[int, bytes]:
        """Per group, the recorded mtimes of the leaves of ``tops`` (a request's ``leaf_mtimes``)."""
        out = {}
        for group, arr in self._leaves.items():
            view = memoryview(arr)
            out[group] = b"".join(view[t * LEAVES_PER_TOP:(t + 1) * LEAVES_PER_TOP] for t in tops)
        return out

    def nbytes(self) -> int:
        return sum(len(a) * a.itemsize for a in self._leaves.values()) + len(self.tops) * self.tops.itemsize


class PassPlan:
    """One pass over a tree: the top directories :func:`list_root` found, cut into requests of
    ``tops_per_request`` each (built when asked for, from the records as they are then); with
    ``report``, requests that remove nothing and report what is not a chunk file."""

    def __init__(self, root: RootListing, mtimes: LeafMtimes, *, tmp_grace_s: float | None,
                 tops_per_request: int, budget: int, report: bool = False) -> None:
        self.root = root
        self._report = report
        self._mtimes = mtimes
        self._grace = tmp_grace_s
        self._per = tops_per_request
        self._budget = budget
        present = set(root.tops)
        #: Top directories gone (as of the root's listing): reported so their chunks are dropped.
        self.gone = [TopListing(top, root.listed_at, None) for top in range(TOPS) if top not in present]

    def __len__(self) -> int:
        return -(-len(self.root.tops) // self._per)

    def request(self, i: int) -> WalkRequest:
        tops = self.root.tops[i * self._per:(i + 1) * self._per]
        recorded = self._mtimes.tops
        return WalkRequest(i, [(t, recorded[t]) for t in tops], self._mtimes.slices(tops), self._grace, self._budget,
                           self._report)

    def first_batch(self) -> ScanBatch:
        """What the root listing itself found: gone top directories, stale probe files."""
        return ScanBatch(-1, tops=self.gone, removed_tmp=self.root.removed_tmp, kept_tmp=self.root.kept_tmp,
                         end=True)


def walk_tree(dir_fd: int, mtimes: LeafMtimes, *, tmp_grace_s: float | None, budget: int = 2048,
              tops_per_request: int = 8) -> Iterator[ScanBatch]:
    """A whole pass in this thread (tests and small trees): the root, then every request."""
    plan = PassPlan(list_root(dir_fd, tmp_grace_s), mtimes, tmp_grace_s=tmp_grace_s,
                    tops_per_request=tops_per_request, budget=budget)
    yield plan.first_batch()
    for i in range(len(plan)):
        yield from walk_tops(dir_fd, plan.request(i))


# ------------------------------------------------------------------------------------------------
# The scan worker process
# ------------------------------------------------------------------------------------------------

#: A batch on its stdout: the payload's length and whether it ends its request (read undecoded).
BATCH_HEADER = struct.Struct(">I?")
_MAX_REQUEST_BYTES = 64 << 20


def worker_main(argv: list[str]) -> None:
    """A scan worker: ``argv`` = [tree descriptor, parent pid]. Reads :class:`WalkRequest` frames
    on stdin, answers each with :class:`ScanBatch` frames on stdout (an OSError ends the request
    with a batch saying so); exits at the end of stdin, or when its parent dies. Runs at the
    lowest CPU priority."""
    dir_fd, parent = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    _lowest_priority()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle
    decoder = msgspec.msgpack.Decoder(WalkRequest)
    encoder = msgspec.msgpack.Encoder()

    def send(batch: ScanBatch) -> None:
        payload = encoder.encode(batch)
        write_all(1, BATCH_HEADER.pack(len(payload), batch.end) + payload)

    mark = time.process_time()
    for request in requests(decoder, max_bytes=_MAX_REQUEST_BYTES):
        try:
            for batch in walk_tops(dir_fd, request, clock=time.process_time):
                # All the CPU this process took since the last batch (decoding, encoding, writing).
                batch.cpu_s, mark = time.process_time() - mark, time.process_time()
                send(batch)
        except OSError as exc:
            send(ScanBatch(request.id, end=True, error=str(exc), errno=exc.errno or 0))


def _lowest_priority() -> None:
    """Background work: the engine's threads (its event loop above all) come first. Without this,
    two busy workers on two cores keep the loop's thread waiting for a core for tens of ms. Linux:
    ``SCHED_IDLE`` (any other thread that wants the core preempts it at once); elsewhere nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        os.nice(19)


if __name__ == "__main__":  # pragma: no cover - the worker's entry point (see scan_workers)
    worker_main(sys.argv[1:])

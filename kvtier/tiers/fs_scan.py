"""Listing a run's block tree, ``<hhh>/<hh>_g<group>/<hash>.bin``: the one scanning code of the fs
tier's scans and of ``kvtier inspect``/``kvtier gc``.

Nothing is followed: every directory is opened ``O_NOFOLLOW`` beneath its parent's descriptor, so
a listing never leaves the tree. Functions here only list and classify; the callers decide what to
remove.

At 10^6 chunk files a tree has ~650,000 leaf directories (``<hhh>/<hh>_g<group>``; up to 2^20 per
group). The fs tier's periodic re-sync therefore costs what changed, not what exists:
:class:`TreeWalker` stats each leaf directory and lists only those whose mtime differs from the
one recorded when it was last listed (adding or removing a file changes its directory's mtime);
a listing's mtime is recorded only once the caller applied it (:meth:`LeafMtimes.commit`).
A leaf whose mtime is too recent to be trusted (a change within the same timestamp tick would
not show) is not recorded, so the next pass lists it again.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import time
from array import array
from dataclasses import dataclass, field

from kvtier.tiers.fs_index import MAX_KEY_BYTES
from kvtier.tiers.fs_io import PROBE_PREFIX

__all__ = [
    "DIR1", "DIR2", "TMP", "PROBE_NAME", "DIR_FLAGS",
    "Leaf", "LeafListing", "TopListing", "ScanBatch", "ScanStopped", "LeafMtimes", "TreeWalker",
    "open_dir", "scandir", "list_leaf", "chunk_key",
]

DIR1 = re.compile(r"[0-9a-f]{3}")
DIR2 = re.compile(r"([0-9a-f]{2})_g(0|[1-9][0-9]{0,9})")
TMP = re.compile(r"[0-9a-f]{6,}\.bin_[0-9]{1,20}\.tmp")
PROBE_NAME = re.compile(re.escape(PROBE_PREFIX) + r"_[0-9]{1,20}")
_CHUNK = re.compile(r"((?:[0-9a-f]{2}){3,})\.bin")
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC
#: A leaf whose mtime is younger than this (seconds) when listed is listed again by the next pass:
#: timestamps are coarse (and on NFS set by another clock), so a change right after the listing
#: might not move it.
RACY_MTIME_S = 2.0
_BREATHER_S = 50e-6  # a pause in the walker's thread ...
_BREATHE_EVERY_S = 1e-3  # ... after this much work


class ScanStopped(Exception):
    """A scan gave up because its ``stop`` event was set (the tier is closing)."""


def _parse_leaf_name(name: str) -> tuple[int, int] | None:
    """``(second-level shard, group)`` of a leaf directory name ``<hh>_g<group>``; None if it is
    not one (remembered for the next time: trees repeat the same few hundred names)."""
    match = DIR2.fullmatch(name)
    if match is None or int(match.group(2)) >= 2**32:
        return None
    parsed = int(match.group(1), 16), int(match.group(2))
    if len(_LEAF_NAMES) < 1 << 16:
        _LEAF_NAMES[name] = parsed
    return parsed


_LEAF_NAMES: dict[str, tuple[int, int]] = {}


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


def chunk_key(name: str, top: str, leaf_hex: str, group: int | bytes) -> bytes | None:
    """The offload key of chunk file ``name`` in leaf ``<top>/<leaf_hex>_g<group>`` (``group`` may
    be given as its 4 key bytes); None when the name is not a chunk of that directory (the same
    rule as :meth:`kvtier.layout.Namespace.key_from_relpath`, without rebuilding the path)."""
    match = _CHUNK.fullmatch(name)
    if match is None:
        return None
    h = match.group(1)
    if h[0:3] != top or h[3:5] != leaf_hex or len(h) // 2 + 4 > MAX_KEY_BYTES:
        return None
    return bytes.fromhex(h) + (group if isinstance(group, bytes) else group.to_bytes(4, "big"))


@dataclass(slots=True)
class Leaf:
    """One leaf directory's entries, classified (nothing removed)."""

    chunks: list[tuple[bytes, int, float, str]] = field(default_factory=list)  # key, size, mtime, name
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
        key = chunk_key(name, top, leaf_hex, group_bytes)
        if key is not None:
            if stat.S_ISREG(st.st_mode):
                chunks.append((key, st.st_size, st.st_mtime, name))
            else:
                out.unsafe.append((name, st))
        elif TMP.fullmatch(name) and not stat.S_ISDIR(st.st_mode):
            out.tmp.append((name, st))
        else:
            out.stray.append((name, st))
    return out


# ------------------------------------------------------------------------------------------------
# The fs tier's walker
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LeafListing:
    """The chunk files one leaf directory held when it was listed."""

    group: int
    leaf: int  # the first 20 bits of the hash: top << 8 | second-level shard
    listed_at: float  # monotonic, taken before the listing started
    chunks: list[tuple[bytes, int, float, str]]  # key, size, mtime, file name
    mtime_ns: int = 0  # the directory's mtime, stat'ed before the listing (0: not to be trusted)


@dataclass(slots=True)
class TopListing:
    """Which leaf directories one top-level directory held (``group << 20 | leaf`` each); ``present``
    None: it is gone. A pass reports a top directory only when its mtime moved (or it is gone)."""

    top: int
    listed_at: float
    present: frozenset[int] | None
    mtime_ns: int = 0  # its mtime when the root was listed (0: gone, or not to be trusted)


@dataclass(slots=True)
class ScanBatch:
    leaves: list[LeafListing] = field(default_factory=list)
    tops: list[TopListing] = field(default_factory=list)
    removed_tmp: int = 0
    kept_tmp: int = 0
    removed_unsafe: int = 0
    leaves_checked: int = 0
    leaves_listed: int = 0
    files: int = 0
    cpu_s: float = 0.0  # CPU time of the step's thread
    done: bool = False


class LeafMtimes:
    """The mtime (ns) each shard directory had when last listed *and applied*; 0 = unknown. Leaves
    are keyed ``group << 20 | leaf``, top directories by their 12 bits (a top's mtime moves when a
    leaf directory is created or removed in it).

    A walker only reads these. The caller records a batch with :meth:`commit` once it made its
    index agree with it: a batch that is lost (a step that raised, a pass cancelled or failed
    before its batch was applied) leaves its directories to be listed again by the next pass,
    never recorded as seen. :meth:`invalidate` (any thread) makes passes list a leaf again until
    a listing that started after the invalidation is committed.
    """

    def __init__(self) -> None:
        self._leaves: dict[int, array[int]] = {}
        self.tops = array("q", bytes(8 * 4096))
        self._dirty: dict[int, float] = {}  # group << 20 | leaf -> when invalidated (monotonic)
        self._lock = threading.Lock()  # the walker's threads, the pool's and the loop's

    def group(self, group: int) -> array[int]:
        """The leaf mtimes of one group (allocated on first use: 8 MiB)."""
        arr = self._leaves.get(group)
        if arr is None:
            with self._lock:
                arr = self._leaves.get(group)
                if arr is None:
                    arr = self._leaves[group] = array("q", bytes(8 << 20))
        return arr

    def get(self, group: int, leaf: int) -> int:
        arr = self._leaves.get(group)
        return 0 if arr is None else arr[leaf]

    def invalidate(self, group: int, leaf: int) -> None:
        with self._lock:
            self._dirty[group << 20 | leaf] = time.monotonic()

    def has_dirty(self) -> bool:
        return bool(self._dirty)

    def is_dirty(self, group_leaf: int) -> bool:
        """Whether leaf ``group << 20 | leaf`` was invalidated and not listed (and committed) since."""
        return group_leaf in self._dirty

    def commit(self, batch: ScanBatch) -> None:
        """Record the mtimes ``batch``'s directories had when listed: the caller applied it.
        Cheap (no work per chunk): run it on the event loop after each batch."""
        dirty, lock = self._dirty, self._lock
        for listing in batch.leaves:
            self.group(listing.group)[listing.leaf] = listing.mtime_ns
            if dirty:
                group_leaf = listing.group << 20 | listing.leaf
                with lock:
                    at = dirty.get(group_leaf)
                    if at is not None and at <= listing.listed_at:
                        del dirty[group_leaf]
        tops = self.tops
        for top in batch.tops:
            tops[top.top] = top.mtime_ns

    def nbytes(self) -> int:
        arrays = tuple(self._leaves.values())  # one C-level copy: a walker may add a group meanwhile
        return sum(len(a) * a.itemsize for a in arrays) + len(self.tops) * self.tops.itemsize


class TreeWalker:
    """One pass over a block tree, in steps that each run on a worker thread.

    Each :meth:`step` lists top-level directories (whole) until about ``budget`` entries were
    handled and returns what changed since ``mtimes`` was recorded (every leaf, on a first pass);
    it records nothing itself: the caller commits each batch to ``mtimes`` once applied.
    Stale temporary and probe files (older than ``tmp_grace_s``; None keeps them) and links or
    special files under layout names are removed and counted: the tier's own tree is its to
    clean. Raises :class:`ScanStopped` at the next directory once ``stop`` is set.
    """

    def __init__(self, dir_fd: int, mtimes: LeafMtimes, *, tmp_grace_s: float | None,
                 stop: threading.Event | None = None) -> None:
        self._fd = dir_fd
        self._mtimes = mtimes
        self._grace = tmp_grace_s
        self._stop = stop
        self._tops: list[int] | None = None  # 0..4095, listed first
        self._present_tops: set[int] = set()
        # Top directories whose mtime moved since last recorded -> the mtime to record once reported.
        self._changed: dict[int, int] = {}
        self._root_listed_at = 0.0
        self._breathe_at = 0.0
        self._pos = 0
        self.tops_total = 4096

    @property
    def tops_done(self) -> int:
        return self._pos

    def step(self, budget: int, max_tops: int | None = None) -> ScanBatch:
        """List top directories (each whole) until about ``budget`` entries were handled or
        ``max_tops`` top directories were visited."""
        out = ScanBatch()
        cpu = time.thread_time()
        now = time.time()
        if self._tops is None:
            self._tops = list(range(4096))
            self._root_listed_at = time.monotonic()
            self._present_tops = self._list_root(out, now)
        tops, handled = self._tops, 0
        end = len(tops) if max_tops is None else min(len(tops), self._pos + max_tops)
        while self._pos < end and handled < budget:
            if self._stop is not None and self._stop.is_set():
                raise ScanStopped("scan stopped")
            top = tops[self._pos]
            self._pos += 1
            if top not in self._present_tops:  # as of the root's listing
                out.tops.append(TopListing(top, self._root_listed_at, None))
                continue
            handled += 1 + self._walk_top(top, time.monotonic(), out, now)
        out.done = self._pos == len(tops)
        out.cpu_s = time.thread_time() - cpu
        return out

    def _list_root(self, out: ScanBatch, now: float) -> set[int]:
        """The top directories present; those whose mtime moved since recorded go to ``_changed``."""
        present: set[int] = set()
        tops, racy_ns = self._mtimes.tops, int((now - RACY_MTIME_S) * 1e9)
        # A descriptor of our own for the listing: the tree's is shared with other users.
        own = os.open(".", DIR_FLAGS, dir_fd=self._fd)
        try:
            for entry in scandir(own):
                name = entry.name
                if DIR1.fullmatch(name):
                    st = self._dir_stat_or_remove(entry, own, out)
                    if st is None:
                        continue
                    top = int(name, 16)
                    present.add(top)
                    mtime_ns = st.st_mtime_ns
                    if not tops[top] or mtime_ns != tops[top]:  # recorded by LeafMtimes.commit
                        self._changed[top] = mtime_ns if mtime_ns < racy_ns else 0
                elif PROBE_NAME.fullmatch(name):
                    self._remove_if_stale(entry, own, now, out)
        finally:
            os.close(own)
        for top in range(4096):
            if top not in present:
                tops[top] = 0  # forgetting is always safe: a reappearing top is reported
        return present

    def _walk_top(self, top: int, listed_at: float, out: ScanBatch, now: float) -> int:
        """Stat every leaf directory of one top directory; list those whose mtime moved."""
        top_name = f"{top:03x}"
        top_fd = open_dir(self._fd, top_name)
        if top_fd is None:  # gone meanwhile, or replaced by a link (removed by the next pass)
            out.tops.append(TopListing(top, listed_at, None))
            return 0
        handled = 0
        report = top in self._changed
        present: set[int] = set()
        mtimes = self._mtimes
        racy_ns = int((now - RACY_MTIME_S) * 1e9)
        group_arrays: dict[int, array[int]] = {}
        base = top << 8
        dirty = mtimes.has_dirty()
        try:
            names = os.listdir(top_fd)
            for name in names:
                parsed = _LEAF_NAMES.get(name) or _parse_leaf_name(name)
                if parsed is None:
                    continue
                handled += 1
                try:
                    st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    out.removed_unsafe += _unlink_quietly(name, top_fd)
                    continue
                low, group = parsed
                leaf = base | low
                group_leaf = group << 20 | leaf
                if report:
                    present.add(group_leaf)
                arr = group_arrays.get(group)
                if arr is None:
                    arr = group_arrays[group] = mtimes.group(group)
                if time.perf_counter() > self._breathe_at:
                    # Let the event loop's thread take the interpreter lock: a thread that runs
                    # Python between short system calls keeps winning it back, and a waiter only
                    # forces the switch after sys.getswitchinterval() (5 ms). A sleep hands it over.
                    time.sleep(_BREATHER_S)
                    self._breathe_at = time.perf_counter() + _BREATHE_EVERY_S
                mtime_ns = st.st_mtime_ns
                recorded = arr[leaf]  # 0: never listed, or not to be trusted
                if recorded and mtime_ns == recorded and not (dirty and mtimes.is_dirty(group_leaf)):
                    continue
                trusted = mtime_ns if mtime_ns < racy_ns else 0  # recorded once the caller commits
                handled += self._list(top_fd, top_name, name, name[:2], group, leaf, trusted, out, now)
            out.leaves_checked += len(names)
        finally:
            os.close(top_fd)
        if report:
            out.tops.append(TopListing(top, listed_at, frozenset(present), self._changed[top]))
        return handled

    def _list(self, top_fd: int, top_name: str, name: str, leaf_hex: str, group: int, leaf: int,
              mtime_ns: int, out: ScanBatch, now: float) -> int:
        listed_at = time.monotonic()
        leaf_fd = open_dir(top_fd, name)
        if leaf_fd is None:
            out.leaves.append(LeafListing(group, leaf, listed_at, []))
            return 0
        try:
            found = list_leaf(leaf_fd, top_name, leaf_hex, group)
            for entry_name, _ in found.unsafe:
                out.removed_unsafe += _unlink_quietly(entry_name, leaf_fd)  # a directory stays
            for entry_name, st in found.tmp:
                if self._grace is not None and now - st.st_mtime > self._grace:
                    out.removed_tmp += _unlink_quietly(entry_name, leaf_fd)
                else:
                    out.kept_tmp += 1
        finally:
            os.close(leaf_fd)
        out.leaves.append(LeafListing(group, leaf, listed_at, found.chunks, mtime_ns))
        out.leaves_listed += 1
        out.files += len(found.chunks)
        return len(found.chunks) + len(found.tmp) + len(found.unsafe) + len(found.stray)

    @staticmethod
    def _dir_stat_or_remove(entry: os.DirEntry[str], dir_fd: int, out: ScanBatch) -> os.stat_result | None:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISDIR(st.st_mode):
            return st
        out.removed_unsafe += _unlink_quietly(entry.name, dir_fd)  # a link or file under a shard directory's name
        return None

    def _remove_if_stale(self, entry: os.DirEntry[str], dir_fd: int, now: float, out: ScanBatch) -> None:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return
        if self._grace is not None and now - st.st_mtime > self._grace and not stat.S_ISDIR(st.st_mode):
            out.removed_tmp += _unlink_quietly(entry.name, dir_fd)
        else:
            out.kept_tmp += 1


def _unlink_quietly(name: str, dir_fd: int) -> bool:
    """Remove ``name`` (never a directory); whether it was removed, so counts say what happened."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True

"""The filesystem tier (``type: "fs"``): chunks as files under a shared ``root_dir``.

Layout (vLLM 0.33, reference §3.2, built by :func:`kvtier.layout.namespace`)::

    <root_dir>/<model>_<digest>/config.json                          run fields, verified at start-up
    <root_dir>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin  one file per chunk

Every process and rank using the same ``root_dir`` and run configuration shares the files.

Semantics callers rely on:

* **Atomic, content-addressed writes** (:func:`kvtier.tiers.fs_io.write_chunk`): a reader sees no
  file or a complete one; an existing final file of the trailered size is a finished chunk and is
  not rewritten (anything else under its name is replaced). Stray temporary, probe and
  ``config.json`` temporary files of crashed writers are removed at start-up once older than
  ``stale_tmp_grace_s``.
* **Containment** (:mod:`kvtier.tiers.fs_beneath`): the tier holds its block tree open and
  resolves every path beneath it without following a symbolic link at any level; only regular
  files are opened, never blocking. A link or special file where a chunk or shard directory
  belongs is never followed: it is removed and counted (reason ``not_regular``) by the load,
  store or scan that meets it. ``root_dir`` itself may be a link.
* **Integrity** (:mod:`kvtier.tiers.integrity`): files are the slot bytes plus a trailer page
  (size ``slot_bytes + 4096``) naming the chunk's key and run. Any file that is not this chunk of
  this run with intact bytes is a miss: the slot is zeroed, :class:`ChunkCorrupt` is raised (so
  the manager frees the slot and the bytes never reach a device), the file is removed and
  ``kvtier_tier_fs_rejected_chunks_total{tier, reason}`` counts why. A trailer-less file of
  exactly ``slot_bytes`` (written by vLLM) is absent to lookups and refused by loads (reason
  ``unverified``, file kept) unless ``accept_unverified_chunks`` is set; then it is loaded
  size-checked only and counted.
* **Lookups never block**: :meth:`FileSystemTier.known` answers from the in-memory index (chunks
  this process wrote, loaded, probed or scanned); unknown keys are probed off-thread by
  :meth:`FileSystemTier.contains`, so chunks written by other processes are found.
* **Capacity** (``max_bytes``, kvtier extension): space for a chunk is reserved, evicting the
  least recently stored/loaded chunks first, BEFORE the chunk is written, and the chunk is written
  only once the files of every eviction started before it are deleted — so the bytes this
  process's files take under the rank's tree never exceed ``max_bytes``, not even between jobs.
  Chunks being read or written are never evicted. Usage is rebuilt from disk at start-up (recency
  seeded from mtimes) and re-synchronised every ``rescan_interval_s`` with what other processes
  added or deleted; a rescan never drops a chunk this process confirmed after it started listing.
  Several engines (or processes) sharing a tree each hold the cap for what they know of;
  together they converge at their rescans.
* **Whole jobs per hand-off**: the tier implements the base's batch hooks
  (:meth:`FileSystemTier.write_many` / :meth:`FileSystemTier.read_many`): a job's chunks are
  queued on the dual-queue pool together — cut into one slice per CPU core for page-cache
  (buffered) I/O, which is CPU work, and one per worker for ``O_DIRECT``, which waits on the
  device — run in parallel on its workers (paths and checksums included, off the event loop),
  and wake the loop once per job — not once per chunk, which cost more CPU than the I/O itself
  at page-cache speeds. Reads open files ``O_NOATIME`` where the process owns them.
* **Faults** (ENOSPC — short writes included —, EIO, EACCES, missing directories or files) fail
  only the chunk concerned (the base class counts them by reason); a failed store leaves no file
  behind. Start-up reads an existing ``config.json`` before writing anything, so a restart on a
  full disk serves what is there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import anyio
from anyio.abc import TaskStatus

from kvtier.errors import ConfigError
from kvtier.layout import Namespace, namespace
from kvtier.tiers import fs_beneath, fs_io
from kvtier.tiers.base import ChunkCorrupt, ChunkNotFound, SecondaryTier, TierContext, TierIOError
from kvtier.tiers.fs_io import DualQueuePool, IOQueue, ScanResult
from kvtier.tiers.integrity import (
    ACCEPTED_VERIFIED,
    REJECT_REASONS,
    Verdict,
    identity,
    make_trailer_page,
    stored_size,
)
from kvtier.types import Medium

__all__ = ["FileSystemTier", "DiskIndex", "ensure_config_json", "EVICTION_POLICIES"]

logger = logging.getLogger(__name__)

#: Allowed values of the fs ``eviction_policy`` option.
EVICTION_POLICIES: tuple[str, ...] = ("lru",)
_MAX_CONFIG_JSON_BYTES = 1 << 20
#: How many recent removals the disk index remembers for its next rescan (see DiskIndex.reconcile).
_MAX_REMOVAL_RECORDS = 1 << 16


# ------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------


def ensure_config_json(root_fd: int, ns: Namespace, *, tmp_grace_s: float | None = None) -> tuple[bool, int]:
    """Create ``config.json`` in ``ns``'s config directory beneath ``root_fd`` if absent
    (atomically), else verify that it describes this run. Returns ``(created, stale_removed)``.

    An existing file is read first, so a restart on a full disk succeeds when the file matches.
    Creation writes a unique temporary file and hard-links it to the final name, so concurrent
    first starts never see a partial file and never overwrite each other; the temporary file is
    removed whatever happens, and ones left by crashed starts (``config.json_<n>.tmp``) older
    than ``tmp_grace_s`` are swept (``None`` keeps them). An existing file whose fields differ
    from ``ns.fields`` (or that is not valid JSON, is too large, or is a link or special file)
    raises :class:`ConfigError`: its chunks were written by a different geometry and must not be
    read as this run's. The config directory is reached without following links.
    """
    cfg_fd = fs_beneath.open_dir(root_fd, ns.leaf, create=True)
    try:
        stale = _sweep_config_tmp(cfg_fd, tmp_grace_s)
        existing = _read_config_json(cfg_fd, ns)
        if existing is None:
            tmp = f"{_CONFIG_JSON}_{secrets.randbits(63)}.tmp"
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=cfg_fd)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(ns.config_json())
                try:
                    os.link(tmp, _CONFIG_JSON, src_dir_fd=cfg_fd, dst_dir_fd=cfg_fd)
                    return True, stale
                except FileExistsError:
                    pass
            finally:
                try:
                    os.unlink(tmp, dir_fd=cfg_fd)
                except FileNotFoundError:
                    pass
            existing = _read_config_json(cfg_fd, ns)
    finally:
        os.close(cfg_fd)
    path = ns.config_path
    if existing != ns.fields:
        existing = existing or {}  # None: deleted by someone else between our link and our read
        differing = sorted(k for k in set(existing) | set(ns.fields) if existing.get(k) != ns.fields.get(k))
        raise ConfigError(
            f"{path} describes a different run than this engine (fields differ: {', '.join(differing)}); "
            "refusing to share its chunks"
        )
    return False, stale


_CONFIG_JSON = "config.json"
_CONFIG_TMP = re.compile(r"config\.json_[0-9]{1,20}\.tmp")


def _read_config_json(cfg_fd: int, ns: Namespace) -> Any:
    """The parsed ``config.json`` in ``cfg_fd``, or None when there is none."""
    path = ns.config_path
    try:
        fd = fs_beneath.open_file(cfg_fd, _CONFIG_JSON, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except fs_beneath.UnsafeEntry:
        raise ConfigError(f"{path} is a symbolic link or special file; kvtier never follows links below "
                          "root_dir — remove it or use another root_dir") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_CONFIG_JSON_BYTES + 1)
    try:
        if len(raw) > _MAX_CONFIG_JSON_BYTES:
            raise ValueError("file too large")
        existing = json.loads(raw)
        if not isinstance(existing, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ConfigError(f"{path} is not a valid kvtier/vLLM run config ({exc}); remove it or use another root_dir") from None
    return existing


def _sweep_config_tmp(cfg_fd: int, tmp_grace_s: float | None) -> int:
    """Remove ``config.json_<n>.tmp`` files older than ``tmp_grace_s`` (crashed first starts)."""
    if tmp_grace_s is None:
        return 0
    removed = 0
    now = time.time()
    with os.scandir(cfg_fd) as entries:
        candidates = [e for e in entries if _CONFIG_TMP.fullmatch(e.name)]
    for entry in candidates:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) or now - st.st_mtime <= tmp_grace_s:
                continue
            os.unlink(entry.name, dir_fd=cfg_fd)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


# ------------------------------------------------------------------------------------------------
# The capacity / recency index
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    size: int
    stored_at: float  # wall clock (mtime for scanned files): the age of an evicted chunk
    seen_at: float  # monotonic: when this process last confirmed it (rescans don't drop newer ones)


class DiskIndex:
    """What this process knows is on disk under its block tree, in recency order, with usage.

    Loop-thread only (no locks). Keys are in least- to most-recently-used order; :meth:`reserve`
    counts a chunk *before* it is written, so ``used`` is an upper bound of the bytes on disk
    from this process's point of view. Busy keys (being read or written) are never victims.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._busy: dict[bytes, int] = {}
        # key -> when this process dropped it (evicted, deleted, rejected); kept until a later
        # scan starts, so a scan that listed the file before it went does not bring it back.
        self._removed_at: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def size_of(self, key: bytes) -> int | None:
        """The bytes recorded for ``key``, or None when it is not in the index."""
        entry = self._entries.get(key)
        return None if entry is None else entry.size

    def touch(self, key: bytes) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def touch_or_add(self, keys: Iterable[bytes], size: int) -> None:
        """Each key becomes the most recent; one not in the index yet is added with ``size``."""
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)
            else:
                self.add(key, size)

    def add(self, key: bytes, size: int, stored_at: float | None = None) -> None:
        """Record ``key`` as present (most recent); replaces a previous size."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= old.size
        self._entries[key] = _Entry(size, time.time() if stored_at is None else stored_at, time.monotonic())
        self.used += size

    def remove(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry.size
        removed_at = self._removed_at
        removed_at.pop(key, None)  # re-inserted last: the dict stays in time order
        removed_at[key] = time.monotonic()
        if len(removed_at) > _MAX_REMOVAL_RECORDS:  # bounded between rescans; the oldest go first
            del removed_at[next(iter(removed_at))]
        return True

    def pin(self, key: bytes) -> None:
        self._busy[key] = self._busy.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        """The read or write of ``key`` is over; if the key is (still) indexed that confirms it
        now, so a rescan that started before this moment cannot drop it (its listing may predate
        the file)."""
        left = self._busy[key] - 1
        if left:
            self._busy[key] = left
        else:
            del self._busy[key]
        entry = self._entries.get(key)
        if entry is not None:
            entry.seen_at = time.monotonic()

    def pin_all(self, keys: Iterable[bytes]) -> None:
        busy = self._busy
        for key in keys:
            busy[key] = busy.get(key, 0) + 1

    def unpin_all(self, keys: Iterable[bytes]) -> None:
        """:meth:`unpin` each key (one clock read for all)."""
        busy, entries, now = self._busy, self._entries, time.monotonic()
        for key in keys:
            left = busy[key] - 1
            if left:
                busy[key] = left
            else:
                del busy[key]
            entry = entries.get(key)
            if entry is not None:
                entry.seen_at = now

    def reserve(self, key: bytes, size: int) -> list[tuple[bytes, float]]:
        """Count ``size`` bytes for ``key`` now and pick victims so that ``used ≤ capacity``.

        Victims (``(key, stored_at)``, least recent first) are already removed from the index;
        the caller deletes their files. Raises ``TierIOError("no_space")`` (reserving nothing)
        when the busy chunks alone leave no room.
        """
        victims: list[tuple[bytes, float]] = []
        if self.capacity is not None:
            need = self.used + size - (self._entries[key].size if key in self._entries else 0)
            for victim, entry in self._entries.items():
                if need <= self.capacity:
                    break
                if victim == key or victim in self._busy:
                    continue
                victims.append((victim, entry.stored_at))
                need -= entry.size
            if need > self.capacity:
                raise TierIOError("no_space", f"max_bytes={self.capacity} is held by chunks in use")
            for victim, _ in victims:
                self.remove(victim)
        self.add(key, size)
        return victims

    def over_capacity_victims(self) -> list[tuple[bytes, float]]:
        """Pick (and remove) least recent idle chunks until ``used ≤ capacity``."""
        victims: list[tuple[bytes, float]] = []
        if self.capacity is None:
            return victims
        excess = self.used - self.capacity
        for victim, entry in self._entries.items():
            if excess <= 0:
                break
            if victim in self._busy:
                continue
            victims.append((victim, entry.stored_at))
            excess -= entry.size
        for victim, _ in victims:
            self.remove(victim)
        return victims

    def reconcile(self, scan: ScanResult, scan_started: float) -> list[bytes]:
        """Make the index agree with a scan started at monotonic time ``scan_started``.

        Keys the scan did not see are dropped (another process deleted them) unless they are busy
        or were confirmed after the scan started; keys only the scan saw are added (recency by
        mtime, after the known ones) unless this process dropped them after the scan started (the
        listing predates their deletion). Returns the dropped keys.
        """
        removed_since = {k: t for k, t in self._removed_at.items() if t >= scan_started}
        self._removed_at = dict(removed_since)  # older records can mislead no later scan
        on_disk = {chunk.key: chunk for chunk in scan.chunks if chunk.key not in removed_since}
        dropped = [
            key for key, entry in self._entries.items()
            if key not in on_disk and key not in self._busy and entry.seen_at < scan_started
        ]
        for key in dropped:
            self.remove(key)
        for chunk in on_disk.values():  # oldest first
            entry = self._entries.get(chunk.key)
            if entry is None:
                self.add(chunk.key, chunk.size, chunk.mtime)
            elif entry.size != chunk.size and chunk.key not in self._busy:
                self.used += chunk.size - entry.size
                entry.size = chunk.size
        return dropped


# ------------------------------------------------------------------------------------------------
# Blocking chunk operations (run on pool threads)
# ------------------------------------------------------------------------------------------------


def _load_verified(dir_fd: int, fingerprint: bytes, o_direct: bool, accept_unverified: bool,
                   key: bytes, dst: memoryview) -> Verdict:
    """Read chunk ``key`` into ``dst`` and verify it is that chunk of this run, intact.

    On rejection ``dst`` is zeroed and the file removed — except a trailer-less file refused as
    ``unverified``, which is left alone (it may be another program's, such as vLLM's).
    """
    relpath = Namespace.chunk_relpath(key)
    verdict = fs_io.load_chunk(dir_fd, relpath, dst, identity(key, fingerprint), o_direct=o_direct,
                               accept_unverified=accept_unverified)
    if not verdict.ok:
        # Defence in depth: the manager frees the slot on failure, but never leave bytes that
        # failed verification where they could be mistaken for a chunk.
        dst[:] = bytes(len(dst))
        if verdict.reason != "unverified":
            try:
                fs_io.remove_file(dir_fd, relpath)
            except OSError as exc:
                logger.warning("could not remove rejected chunk file %s: %s", relpath, exc)
    return verdict


class _Repaired(int):
    """Bytes written by :func:`_store` after it removed a link or special file in the way."""


def _store(dir_fd: int, fingerprint: bytes, o_direct: bool, key: bytes, src: memoryview) -> int:
    """Publish ``src`` with its trailer as chunk ``key``; the bytes written (0 when present).

    A symbolic link, special file or non-directory where the layout needs a directory or the
    chunk file is removed (never followed) and the write tried once more; the count is then a
    :class:`_Repaired` so the tier can count the removal.
    """
    relpath = Namespace.chunk_relpath(key)
    page = make_trailer_page(src, identity(key, fingerprint))
    try:
        return fs_io.write_chunk(dir_fd, relpath, src, page, o_direct=o_direct)
    except fs_beneath.UnsafeEntry:
        fs_io.remove_file(dir_fd, relpath)
        return _Repaired(fs_io.write_chunk(dir_fd, relpath, src, page, o_direct=o_direct))


def _stat_sizes(dir_fd: int, keys: Sequence[bytes]) -> list[int | None]:
    """Size of each key's chunk file, None where there is no regular file reached without links."""
    sizes: list[int | None] = []
    for key in keys:
        try:
            st = fs_beneath.lstat(dir_fd, Namespace.chunk_relpath(key))
        except fs_beneath.UnsafeEntry:
            st = None
        sizes.append(st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None)
    return sizes


def _remove_all(dir_fd: int, keys: Sequence[bytes]) -> None:
    for key in keys:
        relpath = Namespace.chunk_relpath(key)
        try:
            fs_io.remove_file(dir_fd, relpath)
        except OSError as exc:
            # The chunk is already out of the index; a later rescan re-adds it if it survived.
            logger.warning("could not evict %s: %s", relpath, exc)


# ------------------------------------------------------------------------------------------------
# The tier
# ------------------------------------------------------------------------------------------------


class FileSystemTier(SecondaryTier):
    """Chunks as files (see the module docstring for the full contract).

    Options (``config.options``): ``root_dir``, ``n_read_threads`` / ``n_write_threads`` (pool
    workers, default 16 each), ``max_bytes`` (None = unlimited), ``eviction_policy`` (``"lru"``),
    ``stale_tmp_grace_s`` (3600), ``rescan_interval_s`` (30), ``accept_unverified_chunks``
    (False). ``max_bytes`` bounds this rank's block tree (all processes sharing it count; each
    evicts what it can see).
    """

    tier_type: ClassVar[str] = "fs"
    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(self, config: Any, context: TierContext, **tunables: Any) -> None:
        options = config.options
        self.root_dir: str = options["root_dir"] if "root_dir" in options else _missing("root_dir")
        self.n_read_threads = int(options.get("n_read_threads", 16))
        self.n_write_threads = int(options.get("n_write_threads", 16))
        self.max_bytes: int | None = options.get("max_bytes")
        self.eviction_policy: str = options.get("eviction_policy", "lru")
        self.stale_tmp_grace_s = float(options.get("stale_tmp_grace_s", 3600.0))
        self.rescan_interval_s = float(options.get("rescan_interval_s", 30.0))
        self.accept_unverified_chunks = bool(options.get("accept_unverified_chunks", False))
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"secondary_tiers[{context.index}].eviction_policy={self.eviction_policy!r} is not "
                f"supported by the fs tier; allowed: {', '.join(EVICTION_POLICIES)}"
            )
        if self.max_bytes is not None and self.max_bytes < stored_size(context.slot_bytes):
            raise ConfigError(
                f"secondary_tiers[{context.index}].max_bytes={self.max_bytes} cannot hold one chunk "
                f"({stored_size(context.slot_bytes)} bytes on disk)"
            )
        # The pool bounds real parallelism; let the framework keep every worker busy.
        tunables.setdefault("max_concurrent_loads", max(16, self.n_read_threads + self.n_write_threads))
        tunables.setdefault("max_concurrent_stores", max(16, self.n_read_threads + self.n_write_threads))
        super().__init__(config, context, **tunables)
        self.namespace: Namespace = namespace(self.root_dir, context.run_fields, context.rank)
        self.index = DiskIndex(self.max_bytes)
        self.o_direct = False
        self._file_bytes = stored_size(context.slot_bytes)
        self._dir_fd = -1  # the run's block tree, open from open() to close()
        self._pool = DualQueuePool(self.n_read_threads, self.n_write_threads, name=f"kvtier-fs{context.index}")
        self._deletions: list[anyio.Event] = []  # eviction deletions in flight, oldest first
        self._ready = anyio.Event()
        self._rescan_scope = anyio.CancelScope()
        self._rescan_done = anyio.Event()
        self._stop_scans = threading.Event()  # set by close: a long scan gives up
        self._rejected = self.add_metric(
            "fs_rejected_chunks", "counter",
            "Chunk files refused on load (and removed, except trailer-less ones), and links or special "
            "files removed from the tree, by reason.",
            ("reason",),
        )
        for reason in REJECT_REASONS:
            self._rejected.values[(reason,)] = 0.0
        self._unverified = self.add_metric(
            "fs_unverified_loads", "counter",
            "Chunks loaded from files without a trailer (written by vLLM; accept_unverified_chunks): "
            "size-checked only.",
        )
        self._stale_tmp = self.add_metric(
            "fs_stale_tmp_removed", "counter",
            "Temporary and probe files of crashed writers removed by start-up scans.",
        )

    # --- lifecycle ----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The base lifecycle, plus the periodic rescan task once the tier is ready.

        The rescan task lives in this method's task group; ``close`` stops it (and waits for it)
        before the I/O pool shuts down. Errors of ``open`` (``ConfigError``) propagate unwrapped.
        """
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._rescan_loop)
            try:
                await super().run(task_status=_StartedHook(task_status, self._ready.set))
            except Exception as exc:  # re-raised below, outside the group, so it is not wrapped
                error = exc
            finally:
                self._rescan_scope.cancel()
        if error is not None:
            raise error

    async def open(self) -> None:
        self._pool.start()
        try:
            stale = await self._pool.run(IOQueue.WRITE, self._open_tree)
            if stale:
                self._stale_tmp.inc(stale)
            self.o_direct = await self._pool.run(IOQueue.WRITE, fs_io.probe_o_direct, self._dir_fd)
            if self.o_direct:
                # O_DIRECT transfers wait on the device, not on a CPU: give a job to every worker
                # (the pool's default, one slice per core, suits page-cache copies).
                self._pool.batch_slices = self.n_read_threads + self.n_write_threads
            else:
                logger.warning("tier %s: O_DIRECT is not available under %s; using buffered I/O",
                               self.label, self.namespace.blocks_dir)
            scan = await self._pool.run(IOQueue.READ, self._scan, self.stale_tmp_grace_s)
            victims = self._apply_scan(scan, time.monotonic())
            if victims:  # over max_bytes at start-up (a smaller cap, or others' writes)
                await self._delete_victims([k for k, _ in victims])
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
            self._close_tree()
            if isinstance(exc, OSError):
                # An unusable root (not a directory, read-only, no permission, a link inside it) is
                # a configuration problem the operator must fix, reported before serving starts.
                raise ConfigError(
                    f"secondary_tiers[{self.config.index}].root_dir: cannot use "
                    f"{self.namespace.root!r}: {exc.strerror or exc}"
                ) from exc
            raise
        if self.max_bytes is None and _first_unbounded_open(self.namespace.blocks_dir):
            logger.warning("tier %s: no max_bytes set, %s grows without limit (as vLLM's fs tier)",
                           self.label, self.namespace.blocks_dir)

    async def close(self) -> None:
        self._stop_scans.set()  # a scan under way stops at its next directory
        self._rescan_scope.cancel()
        try:
            await self._rescan_done.wait()  # never close the pool under a running rescan
        finally:
            # Even when close itself is cut short (close_timeout_s): the threads are joined and
            # the tree's descriptor closed — a scan in progress ends within one directory.
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
            self._close_tree()

    def _open_tree(self) -> int:
        """Create and open this run's trees under ``root_dir`` (pool thread); the number of stale
        ``config.json`` temporaries removed. ``root_dir`` itself may be a link (the operator's
        choice); nothing below it is followed. The block tree's descriptor is kept on the tier
        before this returns, so a start-up cancelled meanwhile still closes it."""
        os.makedirs(self.root_dir, exist_ok=True)
        root_fd = os.open(self.root_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        try:
            _, stale = ensure_config_json(root_fd, self.namespace, tmp_grace_s=self.stale_tmp_grace_s)
            self._dir_fd = fs_beneath.open_dir(root_fd, self.namespace.blocks_leaf, create=True)
            return stale
        finally:
            os.close(root_fd)

    def _close_tree(self) -> None:
        fd, self._dir_fd = self._dir_fd, -1
        if fd >= 0:
            os.close(fd)

    # --- scanning -----------------------------------------------------------------------------
    def _scan(self, tmp_grace_s: float | None) -> ScanResult:
        return fs_io.scan_tree(self._dir_fd, tmp_grace_s=tmp_grace_s, stop=self._stop_scans)

    def _apply_scan(self, scan: ScanResult, started: float) -> list[tuple[bytes, float]]:
        dropped = self.index.reconcile(scan, started)
        if dropped:
            self.emit_removed(dropped, "deleted")
        if scan.removed_tmp:
            self._stale_tmp.inc(scan.removed_tmp)
        if scan.removed_unsafe:
            self._rejected.inc(scan.removed_unsafe, "not_regular")
            logger.warning("tier %s: removed %d links or special files from %s", self.label,
                           scan.removed_unsafe, self.namespace.blocks_dir)
        victims = self.index.over_capacity_victims()
        self._report_evictions(victims)
        self._publish_usage()
        return victims

    async def rescan(self) -> None:
        """Re-read this rank's block tree now (what the periodic task does), evicting if needed."""
        started = time.monotonic()
        scan = await self._pool.run(IOQueue.READ, self._scan, None)
        victims = self._apply_scan(scan, started)
        if victims:
            await self._delete_victims([k for k, _ in victims])

    async def _rescan_loop(self) -> None:
        """Every ``rescan_interval_s``: re-sync usage with the disk. I/O failures are logged."""
        try:
            with self._rescan_scope:
                await self._ready.wait()
                while True:
                    await anyio.sleep(self.rescan_interval_s)
                    try:
                        await self.rescan()
                    except fs_io.ScanStopped:
                        return
                    except OSError as exc:
                        logger.warning("tier %s: rescan failed: %s", self.label, exc)
        finally:
            self._rescan_done.set()

    # --- capacity -----------------------------------------------------------------------------
    async def _delete_victims(self, keys: Sequence[bytes]) -> None:
        """Delete evicted chunks' files; until done, their bytes still count as taken (see
        :meth:`_deletions_before`)."""
        done = anyio.Event()
        self._deletions.append(done)
        try:
            await self._pool.run(IOQueue.WRITE, _remove_all, self._dir_fd, keys)
        finally:
            self._deletions.remove(done)
            done.set()

    async def _room_made(self, own_victims: Sequence[bytes], earlier: Sequence[anyio.Event]) -> None:
        """Wait until the space a reservation counted as free is free on disk: this job's victims
        are deleted, and so are those of every eviction started before it (whose freed bytes the
        reservation may have counted too). Only then may the job write: ``max_bytes`` is a cap on
        the disk, not only on the index."""
        if own_victims:
            # Shielded: the victims already left the index, so a deletion withdrawn by a
            # cancellation would leave their files on disk, uncounted, beyond the cap.
            with anyio.CancelScope(shield=True):
                await self._delete_victims(own_victims)
        for deletion in earlier:
            await deletion.wait()

    # --- bookkeeping helpers ------------------------------------------------------------------
    def _report_evictions(self, victims: Iterable[tuple[bytes, float]]) -> None:
        now = time.time()
        keys = []
        for key, stored_at in victims:
            keys.append(key)
            self.record_eviction(now - stored_at)
        if keys:
            self.emit_removed(keys, "evicted")

    def _publish_usage(self) -> None:
        self.set_usage(self.index.used, self.max_bytes)

    def _usable(self, size: int | None) -> bool:
        """Whether a chunk file of ``size`` bytes can be loaded (trailered, or trailer-less when
        unverified chunks are accepted)."""
        return size == self._file_bytes or (self.accept_unverified_chunks and size == self.context.slot_bytes)

    # --- primitives ---------------------------------------------------------------------------
    def known(self, key: bytes) -> bool | None:
        # Only positive knowledge, or a file known to be unusable: another process may have
        # written what this one never saw.
        size = self.index.size_of(key)
        if size is None:
            return None
        return self._usable(size)

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        sizes = await self._pool.run(IOQueue.READ, _stat_sizes, self._dir_fd, list(keys))
        found: list[bool] = []
        for key, size in zip(keys, sizes):
            if size is not None and key not in self.index:
                self.index.add(key, size)  # on disk either way: it counts toward max_bytes
            found.append(self._usable(size))
        self._publish_usage()
        return found

    async def write(self, key: bytes, src: memoryview) -> None:
        """One chunk: the batch path with a batch of one (the framework uses :meth:`write_many`)."""
        error = (await self.write_many([(key, src)]))[0]
        if error is not None:
            raise error

    async def read(self, key: bytes, dst: memoryview) -> None:
        """One chunk: the batch path with a batch of one (the framework uses :meth:`read_many`)."""
        error = (await self.read_many([(key, dst)]))[0]
        if error is not None:
            raise error

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> list[BaseException | None]:
        """Store a whole job: chunks spread over the pool workers in slices (``run_batch``), and
        the loop is woken once, when the last one finished.

        Space is reserved (and victims chosen) for each chunk before any I/O, in job order, which
        is also the recency order; a chunk whose reservation fails (``no_space``) is not written.
        No chunk is written before the victims that made room for it are deleted. A chunk
        already on disk as a trailered file is not rewritten; anything else under its name is
        replaced. A failed chunk is dropped from the index again; cancellation waits for running
        writes.
        """
        outcomes: list[BaseException | None] = [None] * len(items)
        calls: list[tuple[bytes, memoryview]] = []
        started: list[tuple[int, bool]] = []  # (item index, newly reserved)
        victims: list[tuple[bytes, float]] = []
        earlier_deletions = list(self._deletions)
        for i, (key, src) in enumerate(items):
            already_stored = self.index.size_of(key) == self._file_bytes
            if already_stored:
                self.index.touch(key)  # recency is taken when the store starts (job order)
            else:
                try:
                    victims.extend(self.index.reserve(key, self._file_bytes))
                except TierIOError as exc:
                    outcomes[i] = exc
                    continue
            self.index.pin(key)
            calls.append((key, src))
            started.append((i, not already_stored))
        self._report_evictions(victims)
        self._publish_usage()
        results: list[int | BaseException] | None = None
        try:
            await self._room_made([k for k, _ in victims], earlier_deletions)
            results = await self._pool.run_batch(
                IOQueue.WRITE, partial(_store, self._dir_fd, self.namespace.fingerprint, self.o_direct), calls)
        finally:
            for n, (i, reserved) in enumerate(started):
                key = items[i][0]
                result = results[n] if results is not None else None
                if isinstance(result, BaseException):
                    outcomes[i] = result
                elif isinstance(result, _Repaired):
                    self._rejected.inc(1, "not_regular")
                if reserved and (results is None or outcomes[i] is not None):
                    self.index.remove(key)  # not on disk after all (or unknown, if cancelled)
                self.index.unpin(key)
            self._publish_usage()
        return outcomes

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> list[BaseException | None]:
        """Load a whole job: chunks spread over the pool workers in slices (``run_batch``), one
        wake-up of the loop per job. Each chunk is read into its slot and verified on the worker;
        per chunk the outcome is ``None``, :class:`ChunkNotFound` or :class:`ChunkCorrupt` (the
        file was removed, the slot zeroed) or the ``OSError``. Chunks being read are never evicted.

        The loop's share per chunk is kept to a few dictionary operations (paths are built on the
        workers): at page-cache speeds, Python run on the loop thread under the GIL stalls the
        workers as surely as their own.
        """
        keys = [key for key, _ in items]
        self.index.pin_all(keys)
        try:
            results = await self._pool.run_batch(
                IOQueue.READ,
                partial(_load_verified, self._dir_fd, self.namespace.fingerprint, self.o_direct,
                        self.accept_unverified_chunks),
                items)
        finally:
            self.index.unpin_all(keys)
        outcomes: list[BaseException | None]
        if all(result is ACCEPTED_VERIFIED for result in results):  # the common case, in one pass
            self.index.touch_or_add(keys, self._file_bytes)
            outcomes = [None] * len(items)
        else:
            outcomes = [self._settle_read(key, len(dst), result) for (key, dst), result in zip(items, results)]
        self._publish_usage()
        return outcomes

    def _settle_read(self, key: bytes, nbytes: int, result: Verdict | BaseException) -> BaseException | None:
        """Book one finished chunk read; the exception that chunk fails with, or None."""
        if result is ACCEPTED_VERIFIED:  # the common case first
            self.index.touch_or_add((key,), self._file_bytes)
            return None
        if isinstance(result, BaseException):
            if isinstance(result, FileNotFoundError):
                self.index.remove(key)
                return ChunkNotFound(f"chunk file {self.namespace.chunk_relpath(key)} is gone")
            return result
        if not result.ok:
            assert result.reason is not None
            self._rejected.inc(1, result.reason)
            relpath = self.namespace.chunk_relpath(key)
            if result.reason == "unverified":  # left in place: it may be another program's file
                return TierIOError("unverified", f"chunk file {relpath} has no trailer; refused "
                                   "(accept_unverified_chunks is off)")
            self.index.remove(key)
            return ChunkCorrupt(f"chunk file {relpath} rejected: {result.reason}")
        self._unverified.inc()  # a trailer-less file of exactly one slot, accepted on request
        self.index.touch_or_add((key,), nbytes)
        return None

    async def delete(self, key: bytes) -> None:
        await self._pool.run(IOQueue.WRITE, fs_io.remove_file, self._dir_fd, self.namespace.chunk_relpath(key))
        if self._forget(key):
            self.emit_removed([key], "deleted")

    def _forget(self, key: bytes) -> bool:
        removed = self.index.remove(key)
        if removed:
            self._publish_usage()
        return removed

    def touch(self, keys: Sequence[bytes], ctx: Any = None) -> None:
        """The manager used ``keys``: they become the most recently used on disk too."""
        for key in keys:
            self.index.touch(key)


class _StartedHook:
    """A ``TaskStatus`` that runs ``hook`` right before reporting readiness to ``inner``."""

    def __init__(self, inner: TaskStatus[None], hook: Callable[[], None]) -> None:
        self._inner = inner
        self._hook = hook

    def started(self, value: None = None) -> None:
        self._hook()
        self._inner.started(value)


_unbounded_dirs: set[str] = set()
_unbounded_dirs_lock = threading.Lock()  # engines may open tiers from several threads


def _first_unbounded_open(blocks_dir: str) -> bool:
    """True the first time this process opens ``blocks_dir`` without ``max_bytes``: the
    "grows without limit" warning is logged once per process and directory, not per engine."""
    real = os.path.realpath(blocks_dir)
    with _unbounded_dirs_lock:
        if real in _unbounded_dirs:
            return False
        _unbounded_dirs.add(real)
        return True


def _missing(name: str) -> Any:
    raise ConfigError(f"the fs tier needs {name!r}")


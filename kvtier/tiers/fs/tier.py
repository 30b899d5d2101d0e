"""The filesystem tier (``type: "fs"``): chunks as files under a shared ``root_dir``.

The tree (vLLM's layout, so that both read each other's chunks; every name in
:mod:`kvtier.tiers.fs.tree`)::

    <root_dir>/<model>_<digest>/config.json                             run fields, verified at start-up
    <root_dir>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin  one file per chunk

Every process and rank using the same ``root_dir`` and run configuration shares the files.

Semantics callers rely on:

* **Atomic, content-addressed writes** (:func:`kvtier.tiers.fs.chunks.write_chunk`): a reader sees no
  file or a complete one; an existing final file of the trailered size is a finished chunk and is
  not rewritten (anything else under its name is replaced). Stray temporary, probe and
  ``config.json`` temporary files of crashed writers are removed at start-up once older than
  ``stale_tmp_grace_s``.
* **Containment** (:mod:`kvtier.tiers.fs.beneath`): the tier holds its block tree open and
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
* **Private files** (``file_mode`` / ``dir_mode``, :mod:`kvtier.tiers.fs.modes`): chunk files,
  their temporaries, ``config.json`` and every directory the tier makes get exactly these modes
  (owner-only by default) whatever the umask; what exists already is left as it is.
* **Compression and encryption at rest** (``compression`` / ``encryption``,
  :mod:`kvtier.tiers.codec`): when set, chunks are stored as coded files (format version 3: a
  page-multiple of stored bytes plus the trailer page; smaller than a slot when compressed, a
  page larger than a plain file when encrypted and not compressed), encoded in a page-aligned
  per-thread buffer so ``O_DIRECT`` still applies. Loads read a file of a plain size as always
  and decode any other size through the codec, into the slot; a tier without the options still
  reads compressed chunks. A tier that encrypts refuses plain chunks (``unencrypted``: a miss,
  rewritten encrypted by the next store); a wrong or missing key is a miss (``undecryptable``,
  ``no_key``), never bytes in the slot.
* **Capacity** (``max_bytes``, kvtier extension): space for a chunk is reserved, evicting the
  least recently stored/loaded chunks first, BEFORE the chunk is written, and the chunk is written
  only once the files of every eviction started before it are deleted — so the bytes this
  process's files take under the rank's tree never exceed ``max_bytes``, not even between jobs.
  Chunks being read or written are never evicted. Every chunk counts at its file's size on disk:
  a store reserves the largest file its codec can write (a plain file's size, or a page more when
  encrypting) and, once written, counts what the file takes (compression frees what it saves).
  Usage is rebuilt from disk by a start-up scan
  that runs in the background (recency seeded from mtimes; until it is over the unscanned rest
  counts as full, so a store evicts as much as it adds), then re-synchronised every
  ``rescan_interval_s`` with what other processes added or deleted (:mod:`kvtier.tiers.fs.sync`:
  only the shard directories whose mtime moved are listed, big trees by worker processes); a
  rescan never drops a chunk this process confirmed after it started listing. The index
  (:mod:`kvtier.tiers.fs.index`) holds no Python object per chunk. Several engines (or processes)
  sharing a tree each hold the cap for what they know of; together they converge at their rescans.
* **Whole jobs per hand-off**: the tier implements the base's batch hooks
  (:meth:`FileSystemTier.write_many` / :meth:`FileSystemTier.read_many`): a job's chunks are
  queued on the dual-queue pool together — cut into one slice per CPU core for page-cache
  (buffered) I/O, which is CPU work, and one per worker for ``O_DIRECT``, which waits on the
  device — run in parallel on its workers (paths and checksums included, off the event loop),
  and wake the loop once per job — not once per chunk, which at page-cache speeds costs more CPU
  than the I/O itself (:mod:`kvtier.tiers.fs.pool`). Reads open files ``O_NOATIME`` where the process owns them.
* **Faults** (ENOSPC — short writes included —, EIO, EACCES, missing directories or files) fail
  only the chunk concerned (the base class counts them by reason); a failed store leaves no file
  behind. Start-up reads an existing ``config.json`` before writing anything, so a restart on a
  full disk serves what is there.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, ClassVar

import anyio
from anyio.abc import TaskStatus

from kvtier.config.tiers import tier_option
from kvtier.errors import ConfigError
from kvtier.layout import Namespace, namespace
from kvtier.policies.quotas import TenantFamilies, TenantQuotas
from kvtier.tiers.base import SecondaryTier, TierContext, TransferJob
from kvtier.tiers.codec import ChunkCodec, is_coded_file_size
from kvtier.tiers.errors import ChunkCorrupt, ChunkNotFound, TierIOError
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.fs.index import ChunkIndex, TenantChunkIndex
from kvtier.tiers.fs.modes import Modes
from kvtier.tiers.fs.pool import DualQueuePool, IOQueue
from kvtier.tiers.fs.sync import SyncMetrics, TreeSync
from kvtier.tiers.fs.tree import ensure_config_json
from kvtier.tiers.integrity import (
    ACCEPTED_VERIFIED,
    REJECT_REASONS,
    Verdict,
    identity,
    stored_size,
    write_trailer,
)
from kvtier.types import Medium

__all__ = ["FileSystemTier", "EVICTION_POLICIES"]

logger = logging.getLogger(__name__)

#: Allowed values of the fs ``eviction_policy`` option.
EVICTION_POLICIES: tuple[str, ...] = ("lru",)
#: ``open`` waits this long for the start-up scan (a small tree is then known before serving).
_SCAN_BEFORE_SERVING_S = 0.5
#: Evictions picked per slice when a scan finds the tree over max_bytes.
_EVICT_BATCH = 256
#: A bounded tier sizes its lookup table for max_bytes worth of chunks, up to this many.
_MAX_EXPECTED_ENTRIES = 1 << 22


# ------------------------------------------------------------------------------------------------
# Blocking chunk operations (run on pool threads)
# ------------------------------------------------------------------------------------------------


#: Rejections whose file stays where it is: not damaged, only unusable by this process.
_LEFT_IN_PLACE = frozenset({"unverified", "no_codec"})


def _load_verified(dir_fd: int, fingerprint: bytes, o_direct: bool, accept_unverified: bool, codec: ChunkCodec,
                   key: bytes, dst: memoryview) -> Verdict:
    """Read chunk ``key`` into ``dst`` and verify it is that chunk of this run, intact (a coded
    file is decoded by ``codec``: the verdict is then a :class:`~kvtier.tiers.fs.chunks.CodedVerdict`
    with the file's size).

    On rejection ``dst`` is zeroed and the file removed — except a trailer-less file refused as
    ``unverified`` (it may be another program's, such as vLLM's) and a compressed one this process
    cannot decode (``no_codec``: ``zstandard`` missing here, not in the processes that wrote it),
    which are left alone.
    """
    relpath = Namespace.chunk_relpath(key)
    verdict = chunks.load_chunk(dir_fd, relpath, dst, identity(key, fingerprint), o_direct=o_direct,
                                accept_unverified=accept_unverified, codec=codec)
    if not verdict.ok:
        # Defence in depth: the manager frees the slot on failure, but never leave bytes that
        # failed verification where they could be mistaken for a chunk.
        dst[:] = bytes(len(dst))
        if verdict.reason not in _LEFT_IN_PLACE:
            try:
                chunks.remove_file(dir_fd, relpath)
            except OSError as exc:
                logger.warning("could not remove rejected chunk file %s: %s", relpath, exc)
    return verdict


def _load_slice(dir_fd: int, fingerprint: bytes, o_direct: bool, accept_unverified: bool, codec: ChunkCodec,
                fast: chunks.SliceLoad | None, items: Sequence[tuple[bytes, memoryview]]) -> list[Verdict | Exception]:
    """:func:`_load_verified` for each ``(key, dst)`` of ``items``: its verdict, or the exception
    it raised. ``fast`` (:func:`~kvtier.tiers.fs.chunks.slice_loader`, when the tier neither
    compresses nor encrypts) takes the common case for the whole slice first; each chunk it
    does not vouch for goes the general way, and a slot whose chunk then fails holds no bytes
    from that first read."""
    verified: list[bool] | None = None
    if fast is not None:
        try:
            verified = fast(dir_fd, [key for key, _ in items], [dst for _, dst in items])
        except Exception:  # noqa: BLE001 - each chunk is judged on its own below
            # A key that is no offload key fails there with its ValueError; anything else (a
            # scratch mapping the system refused) costs only the fast path.
            verified = None
        if verified is not None and verified.count(True) == len(items):
            return [ACCEPTED_VERIFIED] * len(items)
    results: list[Verdict | Exception] = []
    for i, (key, dst) in enumerate(items):
        if verified is not None and verified[i]:
            results.append(ACCEPTED_VERIFIED)
            continue
        try:
            results.append(_load_verified(dir_fd, fingerprint, o_direct, accept_unverified, codec, key, dst))
        except Exception as exc:  # noqa: BLE001 - reported per chunk to the awaiting tier
            if fast is not None:
                dst[:] = bytes(len(dst))
            results.append(exc)
    return results


class _Repaired(int):
    """Bytes written by :func:`_store` after it removed a link or special file in the way."""


def _store(dir_fd: int, fingerprint: bytes, o_direct: bool, modes: Modes, key: bytes, src: memoryview) -> int:
    """Publish ``src`` with its trailer as chunk ``key``; the bytes written (0 when present).

    A symbolic link, special file or non-directory where the layout needs a directory or the
    chunk file is removed (never followed) and the write tried once more; the count is then a
    :class:`_Repaired` so the tier can count the removal.
    """
    relpath = Namespace.chunk_relpath(key)
    page = chunks.trailer_page()
    write_trailer(page, src, key, fingerprint)
    try:
        return chunks.write_chunk(dir_fd, relpath, src, page, o_direct=o_direct, modes=modes)
    except beneath.UnsafeEntry:
        chunks.remove_file(dir_fd, relpath)
        return _Repaired(chunks.write_chunk(dir_fd, relpath, src, page, o_direct=o_direct, modes=modes))


def _store_coded(codec: ChunkCodec, dir_fd: int, fingerprint: bytes, o_direct: bool, modes: Modes, key: bytes,
                 src: memoryview) -> int:
    """:func:`_store` for a tier whose codec encodes: ``src`` is encoded into this thread's
    page-aligned image buffer and published as it is; returns the file's size on disk (whether
    written now or found there already), a :class:`_Repaired` as :func:`_store` does."""
    relpath = Namespace.chunk_relpath(key)
    image = chunks.image_buffer(codec.max_file_bytes)
    n = codec.encode_into(src, identity(key, fingerprint), image)
    try:
        chunks.write_image(dir_fd, relpath, image[:n], o_direct=o_direct, modes=modes)
    except beneath.UnsafeEntry:
        chunks.remove_file(dir_fd, relpath)
        chunks.write_image(dir_fd, relpath, image[:n], o_direct=o_direct, modes=modes)
        return _Repaired(n)
    return n


def _stat_sizes(dir_fd: int, keys: Sequence[bytes]) -> list[int | None]:
    """Size of each key's chunk file, None where there is no regular file reached without links."""
    sizes: list[int | None] = []
    for key in keys:
        try:
            st = beneath.lstat(dir_fd, Namespace.chunk_relpath(key))
        except beneath.UnsafeEntry:
            st = None
        sizes.append(st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None)
    return sizes


def _remove_all(dir_fd: int, keys: Sequence[bytes]) -> list[bytes]:
    """Remove evicted chunks' files; the keys whose file could not be removed."""
    failed = []
    for key in keys:
        relpath = Namespace.chunk_relpath(key)
        try:
            chunks.remove_file(dir_fd, relpath)
        except OSError as exc:
            failed.append(key)
            logger.warning("could not evict %s: %s", relpath, exc)
    return failed


# ------------------------------------------------------------------------------------------------
# The tier
# ------------------------------------------------------------------------------------------------


class FileSystemTier(SecondaryTier):
    """Chunks as files (see the module docstring for the full contract).

    Options (``config.options``): ``root_dir``, ``n_read_threads`` / ``n_write_threads`` (pool
    workers, default 16 each), ``max_bytes`` (None = unlimited), ``eviction_policy`` (``"lru"``),
    ``stale_tmp_grace_s`` (3600), ``rescan_interval_s`` (30), ``accept_unverified_chunks``
    (False), ``file_mode`` / ``dir_mode`` (0o600 / 0o700), ``compression`` / ``encryption``
    (None). ``max_bytes`` bounds this rank's block tree (all processes sharing it count; each
    evicts what it can see).
    """

    tier_type: ClassVar[str] = "fs"
    medium: ClassVar[Medium | None] = Medium.STORAGE
    supports_delete: ClassVar[bool] = True
    supports_touch: ClassVar[bool] = True
    batched_writes: ClassVar[bool] = True
    batched_reads: ClassVar[bool] = True

    def __init__(self, config: Any, context: TierContext, **tunables: Any) -> None:
        self.root_dir: str = tier_option(config, "root_dir")
        self.n_read_threads = int(tier_option(config, "n_read_threads"))
        self.n_write_threads = int(tier_option(config, "n_write_threads"))
        self.max_bytes: int | None = tier_option(config, "max_bytes")
        self.eviction_policy: str = tier_option(config, "eviction_policy")
        self.stale_tmp_grace_s = float(tier_option(config, "stale_tmp_grace_s"))
        interval = tier_option(config, "rescan_interval_s")
        rescan_interval_s = None if interval is None else float(interval)
        self.accept_unverified_chunks = bool(tier_option(config, "accept_unverified_chunks"))
        #: Modes of the files and directories this tier creates (the umask is read once, here).
        self.modes = Modes.for_umask(int(tier_option(config, "file_mode")), int(tier_option(config, "dir_mode")))
        #: Encodes stored chunks when ``compression`` or ``encryption`` is set; without them it
        #: still reads compressed chunks (a cache written with compression stays readable).
        self.codec = ChunkCodec.from_options(
            tier_option(config, "compression"), tier_option(config, "encryption"),
            dtype=ChunkCodec.dtype_of(context.run_fields),
            slot_bytes=context.slot_bytes, where=f"secondary_tiers[{context.index}].")
        # What a store reserves per chunk before it knows the file's size: the largest file the
        # codec writes (an encrypted chunk takes a page more than a plain one). The index then
        # holds the size written.
        self._reserve_bytes = (self.codec.max_file_bytes if self.codec.encrypts
                               else stored_size(context.slot_bytes))
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(
                f"secondary_tiers[{context.index}].eviction_policy={self.eviction_policy!r} is not "
                f"supported by the fs tier; allowed: {', '.join(EVICTION_POLICIES)}"
            )
        if self.max_bytes is not None and self.max_bytes < self._reserve_bytes:
            raise ConfigError(
                f"secondary_tiers[{context.index}].max_bytes={self.max_bytes} cannot hold one chunk "
                f"({self._reserve_bytes} bytes on disk)"
            )
        # The pool bounds real parallelism; let the framework keep every worker busy.
        tunables.setdefault("max_concurrent_loads", max(16, self.n_read_threads + self.n_write_threads))
        tunables.setdefault("max_concurrent_stores", max(16, self.n_read_threads + self.n_write_threads))
        super().__init__(config, context, **tunables)
        self.namespace: Namespace = namespace(self.root_dir, context.run_fields, context.rank)
        expected = 0 if self.max_bytes is None else self.max_bytes // stored_size(context.slot_bytes)
        tenant_bytes = tier_option(config, "tenant_bytes")
        for label, budget in (tenant_bytes or {}).items():
            if budget < self._reserve_bytes:  # it would refuse every store of its tenant
                raise ConfigError(f"secondary_tiers[{context.index}].tenant_bytes.{label} = {budget}: less than one "
                                  f"chunk ({self._reserve_bytes} bytes on disk); give at least that, or leave the "
                                  "tenant out")
        self.index: ChunkIndex = ChunkIndex(self.max_bytes, expected_entries=min(expected, _MAX_EXPECTED_ENTRIES)) \
            if tenant_bytes is None else TenantChunkIndex(  # tenant quotas: kvtier.policies.quotas
                self.max_bytes, TenantQuotas(tenant_bytes, TenantFamilies(self.add_metric)),
                expected_entries=min(expected, _MAX_EXPECTED_ENTRIES))
        self.o_direct = False
        self._file_bytes = stored_size(context.slot_bytes)
        self._dir_fd = -1  # the run's block tree, open from open() to close()
        self._pool = DualQueuePool(self.n_read_threads, self.n_write_threads, name=f"kvtier-fs{context.index}")
        self._deletions: list[anyio.Event] = []  # eviction deletions in flight, oldest first
        self._deleting: dict[bytes, int] = {}  # keys whose files those deletions are removing
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
        scan_passes = self.add_metric(
            "fs_scan_passes", "counter",
            "Passes over the block tree completed: the start-up scan, then one re-sync per rescan_interval_s.",
        )
        interval_gauge = self.add_metric(
            "fs_rescan_interval_seconds", "gauge",
            "Seconds between re-syncs with the disk: rescan_interval_s, or by default 30 s stretched so "
            "that a re-sync takes at most 5% of a core.",
        )
        scan_listed = self.add_metric(
            "fs_scan_dirs_listed", "counter",
            "Shard directories listed by scans (a re-sync lists only those whose mtime changed).",
        )
        #: The start-up scan and the re-syncs (:class:`~kvtier.tiers.fs.sync.TreeSync`).
        self.sync = TreeSync(
            index=self.index, pool=self._pool, deleting=self._deleting, label=self.label,
            blocks_dir=self.namespace.blocks_dir, stale_tmp_grace_s=self.stale_tmp_grace_s,
            rescan_interval_s=rescan_interval_s,
            metrics=SyncMetrics(rejected=self._rejected, stale_tmp=self._stale_tmp, passes=scan_passes,
                                interval=interval_gauge, dirs_listed=scan_listed),
            removed=lambda keys: self.emit_removed(keys, "deleted"), publish_usage=self._publish_usage,
            evict_over_capacity=self._evict_over_capacity)

    # --- lifecycle ----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The base lifecycle, plus the scan task once the tier is ready: the start-up scan, in
        the background, then the periodic re-sync.

        The scan task lives in this method's task group; ``close`` stops it (and waits for it)
        before the I/O pool shuts down. Errors of ``open`` (``ConfigError``) propagate unwrapped.
        """
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sync.run)
            try:
                await super().run(task_status=task_status)
            except Exception as exc:  # re-raised below, outside the group, so it is not wrapped
                error = exc
            finally:
                self.sync.cancel()
        if error is not None:
            raise error

    async def open(self) -> None:
        self._pool.start()
        try:
            stale = await self._pool.run(IOQueue.WRITE, self._open_tree)
            if stale:
                self._stale_tmp.inc(stale)
            self.o_direct = await self._pool.run(IOQueue.WRITE, chunks.probe_o_direct, self._dir_fd)
            if self.o_direct:
                # O_DIRECT transfers wait on the device, not on a CPU: a job alone may use every
                # worker (the pool's default, one slice per core, suits page-cache copies).
                self._pool.batch_slices = self.n_read_threads + self.n_write_threads
            else:
                logger.warning("tier %s: O_DIRECT is not available under %r; using buffered I/O",
                               self.label, self.namespace.blocks_dir)
            # What is on disk is learnt by the scan task: until it is done, unknown keys are
            # probed and reservations assume the unscanned rest fills max_bytes. A small tree is
            # scanned before serving starts; a big one goes on in the background.
            self.sync.start(self._dir_fd)
            with anyio.move_on_after(_SCAN_BEFORE_SERVING_S):
                await self.sync.wait_scanned()
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
            logger.warning("tier %s: no max_bytes set, %r grows without limit (as vLLM's fs tier)",
                           self.label, self.namespace.blocks_dir)

    async def close(self) -> None:
        self.sync.stop()  # a scan under way stops at its next directory
        try:
            await self.sync.wait_stopped()  # never close the pool under a running scan
        finally:
            # Even when close itself is cut short (close_timeout_s): the workers are killed, the
            # threads joined and the tree's descriptor closed — a scan in progress ends within
            # one directory.
            with anyio.CancelScope(shield=True):
                await self.sync.aclose()
                await self._pool.aclose()
            self._close_tree()

    def _open_tree(self) -> int:
        """Create and open this run's trees under ``root_dir`` (pool thread); the number of stale
        ``config.json`` temporaries removed. ``root_dir`` itself may be a link (the operator's
        choice); nothing below it is followed. The block tree's descriptor is kept on the tier
        before this returns, so a start-up cancelled meanwhile still closes it."""
        try:
            # ``root_dir`` itself, never its parents: a mistyped mount point must not become a
            # cold cache on the root filesystem. An existing one is never created again (on a full
            # or read-only disk, mkdir may fail before it finds the directory there).
            if not os.path.isdir(self.root_dir):
                os.mkdir(self.root_dir, self.modes.dir)
                if self.modes.fix_dir:  # the directory just made, never what a link swapped in points to
                    root_fd = os.open(self.root_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC
                                      | os.O_NOFOLLOW)
                    try:
                        self.modes.settle_dir(root_fd)
                    finally:
                        os.close(root_fd)
        except FileExistsError:
            pass  # created meanwhile by another process, or not a directory: refused just below
        except FileNotFoundError:
            parent = os.path.dirname(os.path.abspath(self.root_dir))
            raise ConfigError(
                f"secondary_tiers[{self.config.index}].root_dir: cannot use {self.root_dir!r}: its parent "
                f"directory {parent!r} does not exist; create it first (or fix the path): kvtier creates "
                "root_dir itself, never its parents"
            ) from None
        root_fd = os.open(self.root_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        try:
            _, stale = ensure_config_json(root_fd, self.namespace, tmp_grace_s=self.stale_tmp_grace_s,
                                          modes=self.modes)
            self._dir_fd = beneath.open_dir(root_fd, self.namespace.blocks_leaf, create=True, modes=self.modes)
            return stale
        finally:
            os.close(root_fd)

    def _close_tree(self) -> None:
        fd, self._dir_fd = self._dir_fd, -1
        if fd >= 0:
            os.close(fd)

    # --- scanning (see :class:`~kvtier.tiers.fs.sync.TreeSync`) ----------------------------
    async def wait_scanned(self) -> None:
        """Return once the start-up scan is over: usage and recency then cover the whole tree."""
        await self.sync.wait_scanned()

    @property
    def scanned(self) -> bool:
        """Whether the start-up scan is over."""
        return self.sync.scanned

    def index_bytes(self) -> int:
        """Memory the chunk index and the rescans' directory records take."""
        return self.index.nbytes() + self.sync.mtimes.nbytes()

    @property
    def rescan_interval_s(self) -> float | None:
        """The ``rescan_interval_s`` option (None: the default, paced by cost)."""
        return self.sync.rescan_interval_s

    @property
    def rescan_interval(self) -> float:
        """Seconds between re-syncs: ``rescan_interval_s``, or by default 30 s stretched so that a
        re-sync takes at most 5% of a core (its cost grows with the shard directories to stat)."""
        return self.sync.rescan_interval

    async def rescan(self) -> None:
        """Re-sync with the disk now, at full speed (what the periodic task does over an interval)."""
        await self.sync.run_pass(None)

    async def _evict_over_capacity(self) -> None:
        """Evict least recent idle chunks while the index is over ``max_bytes`` (a smaller cap
        than last run, or other processes' writes), in bounded batches."""
        while True:
            victims = self.index.over_capacity_victims(limit=_EVICT_BATCH)
            if not victims:
                return
            self._report_evictions(victims)
            self._publish_usage()
            await self._delete_victims([k for k, _ in victims])

    # --- capacity -----------------------------------------------------------------------------
    async def _delete_victims(self, keys: Sequence[bytes]) -> None:
        """Delete evicted chunks' files; until done, their bytes still count as taken (see
        :meth:`_deletions_before`)."""
        done = anyio.Event()
        self._deletions.append(done)
        deleting = self._deleting
        for key in keys:
            deleting[key] = deleting.get(key, 0) + 1
        failed: Sequence[bytes] = keys  # unknown until the workers report
        try:
            failed = await self._pool.run(IOQueue.WRITE, _remove_all, self._dir_fd, keys)
        finally:
            for key in keys:
                left = deleting.pop(key) - 1
                if left:
                    deleting[key] = left
            # A listing taken before this moment may still show the files: it must not revive them.
            self.index.note_removed(keys)
            # Files that may have survived: passes list their directories again, and a listing
            # that starts after this point (after the records above) re-adds what is there.
            for key in failed:
                self.sync.invalidate(key)
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
        """Whether a chunk file of ``size`` bytes may be loadable: trailered, or trailer-less when
        unverified chunks are accepted (neither when the tier encrypts: plain chunks are not
        authentic there), or of a coded chunk's size (its codec decides on load)."""
        if size is None:
            return False
        if size == self._file_bytes or size == self.context.slot_bytes:
            return not self.codec.encrypts and (size == self._file_bytes or self.accept_unverified_chunks)
        return is_coded_file_size(size, self.context.slot_bytes)

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
        """Store a whole job: one pool batch (``run_batch``, cut into slices for idle workers), and
        the loop is woken once, when the last chunk finished.

        Space is reserved (and victims chosen) for each chunk before any I/O, in job order, which
        is also the recency order; a chunk whose reservation fails (``no_space``) is not written.
        No chunk is written before the victims that made room for it are deleted. A chunk
        already on disk as a trailered file is not rewritten; anything else under its name is
        replaced. A failed chunk is dropped from the index again; cancellation waits for running
        writes.
        """
        outcomes: list[BaseException | None] = [None] * len(items)
        earlier_deletions = list(self._deletions)
        # The index is asked once per job, before the I/O and after it (not per chunk).
        coded = self.codec.active
        # A chunk held already is rewritten only when the codec makes another file of it (an
        # option changed): counted at that size once written, never reserved anew for nothing.
        reservations, victims = self.index.reserve_all([key for key, _ in items], self._reserve_bytes,
                                                       held_at_any_size=coded)
        calls: list[tuple[bytes, memoryview]] = []
        started: list[tuple[int, bool]] = []  # (item index, newly reserved)
        for i, reserved in enumerate(reservations):
            if isinstance(reserved, TierIOError):
                outcomes[i] = reserved
            else:
                calls.append(items[i])
                started.append((i, reserved))
        self._report_evictions(victims)
        self._publish_usage()
        results: list[int | BaseException] | None = None
        if coded:
            store = partial(_store_coded, self.codec, self._dir_fd, self.namespace.fingerprint, self.o_direct, self.modes)
        else:
            store = partial(_store, self._dir_fd, self.namespace.fingerprint, self.o_direct, self.modes)
        try:
            await self._room_made([k for k, _ in victims], earlier_deletions)
            results = await self._pool.run_batch(IOQueue.WRITE, store, calls)
        finally:
            if results is None:  # cut short: any chunk reserved now may or may not be on disk
                for i, reserved in started:
                    if reserved:
                        self.index.remove(items[i][0])
                        self.sync.invalidate(items[i][0])  # the next pass looks
            elif not all(type(result) is int for result in results):  # the common case: all written
                for (i, reserved), result in zip(started, results):
                    if isinstance(result, BaseException):
                        outcomes[i] = result
                        if reserved:
                            self.index.remove(items[i][0])  # not on disk after all
                    elif isinstance(result, _Repaired):
                        self._rejected.inc(1, "not_regular")
            if coded and results is not None:
                self._settle_coded_sizes(calls, results)
            self.index.unpin_all([key for key, _ in calls])
            self._publish_usage()
        if coded and self.max_bytes is not None and self.index.used > self.max_bytes:
            await self._evict_over_capacity()  # a held chunk rewritten larger (an option changed)
        return outcomes

    def _settle_coded_sizes(self, calls: Sequence[tuple[bytes, memoryview]], results: Sequence[int | BaseException]) -> None:
        """Count each coded chunk stored at its file's size rather than the size reserved for it
        (compression frees what it saves)."""
        index = self.index
        for (key, _), result in zip(calls, results):
            if not isinstance(result, BaseException):
                held = index.size_of(key)
                if held is not None and held != result:
                    index.add(key, int(result))

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> list[BaseException | None]:
        """Load a whole job: one pool batch (``run_slices``, cut into slices for idle workers),
        one wake-up of the loop per job. Each chunk is read into its slot and verified on the worker;
        per chunk the outcome is ``None``, :class:`ChunkNotFound` or :class:`ChunkCorrupt` (the
        file was removed, the slot zeroed) or the ``OSError``. Chunks being read are never evicted.

        The loop's share per chunk is kept to a few dictionary operations (paths are built on the
        workers): at page-cache speeds, Python run on the loop thread under the GIL stalls the
        workers as surely as their own.
        """
        keys = [key for key, _ in items]
        self.index.pin_all(keys)
        results: list[Verdict | BaseException] | None = None
        try:
            fingerprint = self.namespace.fingerprint
            results = await self._pool.run_slices(
                IOQueue.READ,
                partial(_load_slice, self._dir_fd, fingerprint, self.o_direct, self.accept_unverified_chunks,
                        self.codec, None if self.codec.active else chunks.slice_loader(self.o_direct, fingerprint)),
                items)
        finally:
            # The common case, every chunk loaded and verified: unpinned and made the most recent
            # in one pass over the index (one lookup per chunk).
            verified = results is not None and results.count(ACCEPTED_VERIFIED) == len(results)
            self.index.unpin_all(keys, touch_or_add=self._file_bytes if verified else None)
        outcomes: list[BaseException | None]
        if verified:
            outcomes = [None] * len(items)
        else:
            assert results is not None
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
            if result.reason == "no_codec":  # left in place: whoever wrote it can read it
                return TierIOError("no_codec", f"chunk file {relpath} is compressed and zstandard is not installed "
                                   "here (pip install 'kvtier[compression]')")
            self.index.remove(key)
            self.sync.invalidate(key)  # if its removal failed, the next pass re-adds it
            return ChunkCorrupt(f"chunk file {relpath} rejected: {result.reason}")
        if isinstance(result, chunks.CodedVerdict):  # read through the codec: counted at its file's size
            if not result.verified:
                self._unverified.inc()  # a trailer-less file of exactly one slot, accepted on request
            if self.index.size_of(key) == result.file_size:
                self.index.touch(key)
            else:
                self.index.add(key, result.file_size)
            return None
        self._unverified.inc()  # a trailer-less file of exactly one slot, accepted on request
        self.index.touch_or_add((key,), nbytes)
        return None

    async def delete(self, key: bytes) -> None:
        await self._pool.run(IOQueue.WRITE, chunks.remove_file, self._dir_fd, self.namespace.chunk_relpath(key))
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

    def submit_store(self, job: TransferJob) -> None:
        """The base's, after noting the tenant pool the job's chunks are charged to (tenant quotas)."""
        index = self.index
        if isinstance(index, TenantChunkIndex):
            index.note_writers(job.keys, index.quotas.pool_of_request(job.ctx))
        super().submit_store(job)


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


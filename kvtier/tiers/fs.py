"""The filesystem tier (``type: "fs"``): chunks as files under a shared ``root_dir``.

Layout (vLLM 0.33, reference §3.2, built by :func:`kvtier.layout.namespace`)::

    <root_dir>/<model>_<digest>/config.json                          run fields, verified at start-up
    <root_dir>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin  one file per chunk

Every process and rank using the same ``root_dir`` and run configuration shares the files.

Semantics callers rely on:

* **Atomic, content-addressed writes** (:func:`kvtier.tiers.fs_io.write_chunk`): a reader sees no
  file or a complete one; an existing final file is a finished chunk and is not rewritten.
  Stray temporary files of crashed writers are removed at start-up once older than
  ``stale_tmp_grace_s``.
* **Integrity** (:mod:`kvtier.tiers.integrity`): files are the slot bytes plus a trailer page
  (size ``slot_bytes + 4096``). A trailer-less file of exactly ``slot_bytes`` (written by vLLM)
  is accepted as *unverified* and counted. Any other file is a miss: the slot is zeroed,
  :class:`ChunkCorrupt` is raised (so the manager frees the slot and the bytes never reach a
  device), the file is removed and ``kvtier_tier_fs_rejected_chunks_total{tier, reason}`` counts why.
* **Lookups never block**: :meth:`FileSystemTier.known` answers from the in-memory index (chunks
  this process wrote, loaded, probed or scanned); unknown keys are probed off-thread by
  :meth:`FileSystemTier.contains`, so chunks written by other processes are found.
* **Capacity** (``max_bytes``, kvtier extension): space for a chunk is reserved, evicting the
  least recently stored/loaded chunks first, BEFORE the chunk is written, so the bytes on disk
  under this rank's tree stay ≤ ``max_bytes`` after every job. Chunks being read or written are
  never evicted. Usage is rebuilt from disk at start-up (recency seeded from mtimes) and
  re-synchronised every ``rescan_interval_s`` with what other processes added or deleted.
* **Whole jobs per hand-off**: the tier implements the base's batch hooks
  (:meth:`FileSystemTier.write_many` / :meth:`FileSystemTier.read_many`): a job's chunks are
  queued on the dual-queue pool together — cut into one slice per CPU core for page-cache
  (buffered) I/O, which is CPU work, and one per worker for ``O_DIRECT``, which waits on the
  device — run in parallel on its workers (paths and checksums included, off the event loop),
  and wake the loop once per job — not once per chunk, which cost more CPU than the I/O itself
  at page-cache speeds. Reads open files ``O_NOATIME`` where the process owns them.
* **Faults** (ENOSPC, EIO, EACCES, missing directories or files) fail only the chunk concerned
  (the base class counts them by reason); a failed store leaves no file behind.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
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
from kvtier.tiers import fs_io
from kvtier.tiers.base import ChunkCorrupt, ChunkNotFound, SecondaryTier, TierContext, TierIOError
from kvtier.tiers.fs_io import DualQueuePool, IOQueue, ScanResult
from kvtier.tiers.integrity import (
    ACCEPTED_VERIFIED,
    REJECT_REASONS,
    SizeClass,
    Verdict,
    classify_size,
    make_trailer_page,
    stored_size,
)
from kvtier.types import Medium

__all__ = ["FileSystemTier", "DiskIndex", "ensure_config_json", "EVICTION_POLICIES"]

logger = logging.getLogger(__name__)

#: Allowed values of the fs ``eviction_policy`` option.
EVICTION_POLICIES: tuple[str, ...] = ("lru",)
_MAX_CONFIG_JSON_BYTES = 1 << 20


# ------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------


def ensure_config_json(ns: Namespace) -> bool:
    """Create ``ns.config_path`` if absent (atomically), else verify it describes this run.

    Returns True when this call created the file. Creation writes a unique temporary file and
    hard-links it to the final name, so concurrent first starts never see a partial file and
    never overwrite each other. An existing file whose fields differ from ``ns.fields`` (or
    that is not valid JSON) raises :class:`ConfigError`: its chunks were written by a different
    geometry and must not be read as this run's.
    """
    os.makedirs(ns.config_dir, exist_ok=True)
    path = ns.config_path
    tmp = f"{path}_{secrets.randbits(63)}.tmp"
    with open(tmp, "x", encoding="utf-8") as f:
        f.write(ns.config_json())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path, "rb") as f:
        raw = f.read(_MAX_CONFIG_JSON_BYTES + 1)
    try:
        if len(raw) > _MAX_CONFIG_JSON_BYTES:
            raise ValueError("file too large")
        existing = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{path} is not a valid kvtier/vLLM run config ({exc}); remove it or use another root_dir") from None
    if existing != ns.fields:
        differing = sorted(k for k in set(existing) | set(ns.fields) if existing.get(k) != ns.fields.get(k))
        raise ConfigError(
            f"{path} describes a different run than this engine (fields differ: {', '.join(differing)}); "
            "refusing to share its chunks"
        )
    return False


# ------------------------------------------------------------------------------------------------
# The capacity / recency index
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    size: int
    stored_at: float  # wall clock (mtime for scanned files): the age of an evicted chunk
    seen_at: float  # monotonic: when this process learned of it (rescans don't drop newer ones)


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

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)

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
        return True

    def pin(self, key: bytes) -> None:
        self._busy[key] = self._busy.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        left = self._busy[key] - 1
        if left:
            self._busy[key] = left
        else:
            del self._busy[key]

    def pin_all(self, keys: Iterable[bytes]) -> None:
        busy = self._busy
        for key in keys:
            busy[key] = busy.get(key, 0) + 1

    def unpin_all(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.unpin(key)

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
        or were learned after the scan started; keys only the scan saw are added (recency by
        mtime, after the known ones). Returns the dropped keys.
        """
        on_disk = {chunk.key: chunk for chunk in scan.chunks}
        dropped = [
            key for key, entry in self._entries.items()
            if key not in on_disk and key not in self._busy and entry.seen_at < scan_started
        ]
        for key in dropped:
            self.remove(key)
        for chunk in scan.chunks:  # oldest first
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


def _load_verified(ns: Namespace, o_direct: bool, key: bytes, dst: memoryview) -> Verdict:
    """Read chunk ``key`` into ``dst`` and verify it; on rejection zero ``dst`` and remove the file."""
    path = ns.chunk_path(key)
    verdict = fs_io.load_chunk(path, dst, o_direct=o_direct)
    if not verdict.ok:
        # Defence in depth: the manager frees the slot on failure, but never leave bytes that
        # failed verification where they could be mistaken for a chunk.
        dst[:] = bytes(len(dst))
        try:
            fs_io.remove_file(path)
        except OSError as exc:
            logger.warning("could not remove rejected chunk file %s: %s", path, exc)
    return verdict


def _store(ns: Namespace, o_direct: bool, key: bytes, src: memoryview, victims: Sequence[bytes] = ()) -> int:
    """Remove the eviction ``victims`` (keys), then publish ``src`` with its trailer as chunk ``key``.

    Evicting in the same pool task, before the write, keeps the on-disk cap while the chunk is
    written without a second hand-off. Returns the bytes written (0 when already present).
    """
    if victims:
        _remove_all([ns.chunk_path(victim) for victim in victims])
    return fs_io.write_chunk(ns.chunk_path(key), src, make_trailer_page(src), o_direct=o_direct)


def _stat_sizes(paths: Sequence[str]) -> list[int | None]:
    sizes: list[int | None] = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except FileNotFoundError:
            sizes.append(None)
    return sizes


def _remove_all(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            fs_io.remove_file(path)
        except OSError as exc:
            # The chunk is already out of the index; a later rescan re-adds it if it survived.
            logger.warning("could not evict %s: %s", path, exc)


# ------------------------------------------------------------------------------------------------
# The tier
# ------------------------------------------------------------------------------------------------


class FileSystemTier(SecondaryTier):
    """Chunks as files (see the module docstring for the full contract).

    Options (``config.options``): ``root_dir``, ``n_read_threads`` / ``n_write_threads`` (pool
    workers, default 16 each), ``max_bytes`` (None = unlimited), ``eviction_policy`` (``"lru"``),
    ``stale_tmp_grace_s`` (3600), ``rescan_interval_s`` (30). ``max_bytes`` bounds this rank's
    block tree (all processes sharing it count; each evicts what it can see).
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
        self._pool = DualQueuePool(self.n_read_threads, self.n_write_threads, name=f"kvtier-fs{context.index}")
        self._ready = anyio.Event()
        self._rescan_scope = anyio.CancelScope()
        self._rescan_done = anyio.Event()
        self._rejected = self.add_metric(
            "fs_rejected_chunks", "counter",
            "Chunk files rejected on load and removed, by reason (short, long, bad_trailer, checksum).",
            ("reason",),
        )
        for reason in REJECT_REASONS:
            self._rejected.values[(reason,)] = 0.0
        self._unverified = self.add_metric(
            "fs_unverified_loads", "counter",
            "Chunks loaded from files without a trailer (written by vLLM): size-checked only.",
        )
        self._stale_tmp = self.add_metric(
            "fs_stale_tmp_removed", "counter",
            "Temporary files of crashed writers removed by start-up scans.",
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
            await self._pool.run(IOQueue.WRITE, os.makedirs, self.namespace.blocks_dir, 0o755, True)
            await self._pool.run(IOQueue.WRITE, ensure_config_json, self.namespace)
            self.o_direct = await self._pool.run(IOQueue.WRITE, fs_io.probe_o_direct, self.namespace.blocks_dir)
            if self.o_direct:
                # O_DIRECT transfers wait on the device, not on a CPU: give a job to every worker
                # (the pool's default, one slice per core, suits page-cache copies).
                self._pool.batch_slices = self.n_read_threads + self.n_write_threads
            else:
                logger.warning("tier %s: O_DIRECT is not available under %s; using buffered I/O",
                               self.label, self.namespace.blocks_dir)
            scan = await self._pool.run(IOQueue.READ, self._scan, self.stale_tmp_grace_s)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
            if isinstance(exc, OSError):
                # An unusable root (not a directory, read-only, no permission) is a configuration
                # problem the operator must fix, reported before the engine starts serving.
                raise ConfigError(
                    f"secondary_tiers[{self.config.index}].root_dir: cannot use "
                    f"{self.namespace.root!r}: {exc.strerror or exc}"
                ) from exc
            raise
        self._apply_scan(scan, time.monotonic())
        if self.max_bytes is None and _first_unbounded_open(self.namespace.blocks_dir):
            logger.warning("tier %s: no max_bytes set, %s grows without limit (as vLLM's fs tier)",
                           self.label, self.namespace.blocks_dir)

    async def close(self) -> None:
        self._rescan_scope.cancel()
        await self._rescan_done.wait()  # never close the pool under a running rescan
        await self._pool.aclose()

    # --- scanning -----------------------------------------------------------------------------
    def _scan(self, tmp_grace_s: float | None) -> ScanResult:
        return fs_io.scan_tree(self.namespace.blocks_dir, tmp_grace_s=tmp_grace_s)

    def _apply_scan(self, scan: ScanResult, started: float) -> list[tuple[bytes, float]]:
        dropped = self.index.reconcile(scan, started)
        if dropped:
            self.emit_removed(dropped, "deleted")
        if scan.removed_tmp:
            self._stale_tmp.inc(scan.removed_tmp)
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
            await self._pool.run(IOQueue.WRITE, _remove_all, [self.namespace.chunk_path(k) for k, _ in victims])

    async def _rescan_loop(self) -> None:
        """Every ``rescan_interval_s``: re-sync usage with the disk. I/O failures are logged."""
        try:
            with self._rescan_scope:
                await self._ready.wait()
                while True:
                    await anyio.sleep(self.rescan_interval_s)
                    try:
                        await self.rescan()
                    except OSError as exc:
                        logger.warning("tier %s: rescan failed: %s", self.label, exc)
        finally:
            self._rescan_done.set()

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

    # --- primitives ---------------------------------------------------------------------------
    def known(self, key: bytes) -> bool | None:
        # Only positive knowledge: another process may have written what this one never saw.
        return True if key in self.index else None

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        paths = [self.namespace.chunk_path(key) for key in keys]
        sizes = await self._pool.run(IOQueue.READ, _stat_sizes, paths)
        slot = self.context.slot_bytes
        found: list[bool] = []
        for key, size in zip(keys, sizes):
            usable = size is not None and classify_size(size, slot) in (SizeClass.TRAILERED, SizeClass.RAW)
            if usable and key not in self.index:
                self.index.add(key, size)  # type: ignore[arg-type]
            found.append(usable)
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
        A failed chunk is dropped from the index again; cancellation waits for running writes.
        """
        outcomes: list[BaseException | None] = [None] * len(items)
        calls: list[tuple[bytes, memoryview, list[bytes]]] = []
        started: list[tuple[int, bool]] = []  # (item index, newly reserved)
        for i, (key, src) in enumerate(items):
            already_known = key in self.index
            if already_known:
                self.index.touch(key)  # recency is taken when the store starts (job order)
                victims: list[tuple[bytes, float]] = []
            else:
                try:
                    victims = self.index.reserve(key, self._file_bytes)
                except TierIOError as exc:
                    outcomes[i] = exc
                    continue
            self.index.pin(key)
            self._report_evictions(victims)
            calls.append((key, src, [k for k, _ in victims]))
            started.append((i, not already_known))
        self._publish_usage()
        results: list[int | BaseException] | None = None
        try:
            results = await self._pool.run_batch(IOQueue.WRITE, partial(_store, self.namespace, self.o_direct), calls)
        finally:
            for n, (i, reserved) in enumerate(started):
                key = items[i][0]
                self.index.unpin(key)
                result = results[n] if results is not None else None
                if isinstance(result, BaseException):
                    outcomes[i] = result
                if reserved and (results is None or outcomes[i] is not None):
                    self.index.remove(key)  # not on disk after all (or unknown, if cancelled)
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
            results = await self._pool.run_batch(IOQueue.READ, partial(_load_verified, self.namespace, self.o_direct),
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
            self.index.remove(key)
            return ChunkCorrupt(f"chunk file {self.namespace.chunk_relpath(key)} rejected: {result.reason}")
        self._unverified.inc()  # a trailer-less file of exactly one slot (written by vLLM)
        self.index.touch_or_add((key,), nbytes)
        return None

    async def delete(self, key: bytes) -> None:
        await self._pool.run(IOQueue.WRITE, fs_io.remove_file, self.namespace.chunk_path(key))
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


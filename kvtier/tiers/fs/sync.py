"""Keeping the fs tier's chunk index in agreement with its tree on disk.

The tier learns what is on disk from a start-up scan, run in the background, and then re-syncs
every ``rescan_interval_s`` with what other processes added or deleted: each pass lists only the
shard directories whose mtime moved (:mod:`kvtier.tiers.fs.scan`). Trees of more than a few hundred
top directories are walked by scan worker processes at the lowest CPU priority
(:mod:`kvtier.tiers.fs.scan_workers`); the event loop only applies what they found, in slices
short enough that a task's wake-up never waits long behind one.

Semantics callers rely on:

* A pass never drops a chunk that is being read or written, nor one the tier confirmed after the
  listing of its directory started; it never revives a chunk the tier removed after that listing
  started, nor one whose file an eviction is deleting.
* A directory's listing is recorded as seen only once it has been applied: a pass cut short
  (cancelled, failed) leaves its directories to the next pass.
* :meth:`TreeSync.stop` makes a pass under way give up at its next directory; :meth:`TreeSync.run`
  then returns. Directories that cannot be read are counted and kept as last seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio
import anyio.lowlevel

from kvtier.stats import MetricFamily
from kvtier.tiers.fs.index import ChunkIndex
from kvtier.tiers.fs.pool import DualQueuePool, IOQueue, usable_cpus
from kvtier.tiers.fs.scan import (
    LeafListing,
    LeafMtimes,
    PassPlan,
    ScanBatch,
    ScanStopped,
    TopListing,
    WalkRequest,
    list_root,
    walk_tops,
)
from kvtier.tiers.fs.scan_workers import ScanWorkers, ScanWorkerStartError
from kvtier.tiers.fs.tree import leaf_of

__all__ = ["TreeSync", "SyncMetrics"]

logger = logging.getLogger("kvtier.tiers.fs.tier")  # the tier's log: operators filter by it

#: Entries a scan batch holds (whole top directories): small enough to decode and apply in a few
#: slices of the loop.
_SCAN_STEP_ENTRIES = 1024
#: Top directories per walk request: workers walk while the loop waits, the loop applies while
#: they wait (see scan_workers._Turns).
_TOPS_PER_REQUEST = 1
#: ... and per request of a paced re-sync, which applies little: each request wakes a worker and
#: the loop, which costs more than walking one top directory.
_TOPS_PER_PACED_REQUEST = 8
#: Trees with more top directories than this are walked by worker processes, smaller ones on a
#: pool thread.
_IN_THREAD_TOPS = 512
#: Worker processes a walk uses at most.
_SCAN_WORKERS = 2
#: Default seconds between re-syncs; stretched on trees where a re-sync costs more than
#: ``_RESCAN_CPU_SHARE`` of a core at that pace (an explicit ``rescan_interval_s`` is kept).
_DEFAULT_RESCAN_S = 30.0
#: Of the CPU a pass measures itself; hand-offs and wake-ups it cannot see come on top, so that the
#: whole stays near 5% of a core.
_RESCAN_CPU_SHARE = 0.035
#: The loop applies scan results (and evicts) in slices of at most this long, then lets others run.
#: A task's wake-up waits for about two turns of the loop, so a turn must stay well under 2.5 ms.
_SLICE_S = 0.001


class SyncMetrics:
    """The tier's metrics a sync updates (declared by the tier, so that their order is the tier's)."""

    def __init__(self, *, rejected: MetricFamily, stale_tmp: MetricFamily, passes: MetricFamily,
                 interval: MetricFamily, dirs_listed: MetricFamily) -> None:
        self.rejected = rejected
        self.stale_tmp = stale_tmp
        self.passes = passes
        self.interval = interval
        self.dirs_listed = dirs_listed


class TreeSync:
    """The scan task of one fs tier: the start-up scan, then a re-sync every interval.

    It holds the records of what was seen (:class:`~kvtier.tiers.fs.scan.LeafMtimes`) and the
    scan workers; it shares the tier's ``index``, ``pool`` and ``deleting`` (keys whose files an
    eviction is deleting, with how many deletions each). ``removed(keys)`` reports chunks a pass
    found gone; ``publish_usage()`` and ``evict_over_capacity()`` are the tier's. Loop thread only.
    """

    def __init__(self, *, index: ChunkIndex, pool: DualQueuePool, deleting: Mapping[bytes, int], label: str,
                 blocks_dir: str, stale_tmp_grace_s: float, rescan_interval_s: float | None, metrics: SyncMetrics,
                 removed: Callable[[list[bytes]], None], publish_usage: Callable[[], None],
                 evict_over_capacity: Callable[[], Awaitable[None]]) -> None:
        self.index = index
        self._pool = pool
        self._deleting = deleting
        self._label = label
        self._blocks_dir = blocks_dir
        self._grace = stale_tmp_grace_s
        self.rescan_interval_s = rescan_interval_s
        self._auto_interval = _DEFAULT_RESCAN_S
        self._metrics = metrics
        self._removed = removed
        self._publish_usage = publish_usage
        self._evict_over_capacity = evict_over_capacity
        self.mtimes = LeafMtimes()
        self.workers = ScanWorkers(min(_SCAN_WORKERS, usable_cpus()))
        self._walk_in_thread = False  # set once workers could not be started
        self._dir_fd = -1
        self._opened = anyio.Event()  # the tree is open: the start-up scan may begin
        self._scanned = anyio.Event()  # the start-up scan is over (or was stopped)
        self._passes: list[float] = []  # start times of the passes under way (a rescan may meet a periodic one)
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._stop = threading.Event()  # set by stop: a long walk gives up

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, dir_fd: int) -> None:
        """The tree is open at ``dir_fd``: :meth:`run` may begin the start-up scan. Until it is
        over the index is incomplete (the unscanned rest counts as full)."""
        self._dir_fd = dir_fd
        self.index.complete = False
        self._opened.set()

    def cancel(self) -> None:
        """End :meth:`run` (the tier's task group is closing)."""
        self._scope.cancel()

    def stop(self) -> None:
        """Make a pass under way give up at its next directory, and end :meth:`run`."""
        self._stop.set()
        self._scope.cancel()

    async def wait_stopped(self) -> None:
        """Return once :meth:`run` has returned (the pool may then be closed)."""
        await self._done.wait()

    async def aclose(self) -> None:
        """Kill the scan workers."""
        await self.workers.aclose()

    async def wait_scanned(self) -> None:
        """Return once the start-up scan is over: usage and recency then cover the whole tree."""
        await self._scanned.wait()

    @property
    def scanned(self) -> bool:
        """Whether the start-up scan is over."""
        return self._scanned.is_set()

    def invalidate(self, key: bytes) -> None:
        """``key``'s directory may hold what the index does not: the next pass lists it again."""
        self.mtimes.invalidate(*leaf_of(key))

    async def run(self) -> None:
        """Once :meth:`start` was called: the start-up scan (as fast as the pool allows), then a
        re-sync every :attr:`rescan_interval`, each spread over the interval. I/O failures are
        logged; the task ends at :meth:`cancel` or :meth:`stop`."""
        try:
            with self._scope:
                await self._opened.wait()
                started = time.monotonic()
                try:
                    await self.run_pass(self._grace, initial=True)
                except (ScanStopped, anyio.ClosedResourceError):  # closing (or open failed)
                    return
                except OSError as exc:
                    logger.warning("tier %s: start-up scan failed, usage is what was found so far: %s",
                                   self._label, exc)
                finally:
                    self._scanned.set()
                logger.info("tier %s: %d chunk files (%.1f GiB) under %r, scanned in %.1f s", self._label,
                            len(self.index), self.index.used / 2**30, self._blocks_dir, time.monotonic() - started)
                while True:
                    began, interval = time.monotonic(), self.rescan_interval
                    self._metrics.interval.set(interval)
                    try:
                        cpu = await self.run_pass(None, spread_over=interval)
                    except ScanStopped:
                        return
                    except OSError as exc:
                        logger.warning("tier %s: rescan failed: %s", self._label, exc)
                    else:
                        self.pace(cpu)
                    await anyio.sleep(max(0.0, began + interval - time.monotonic()))
        finally:
            self._scanned.set()
            self._done.set()

    # --- pacing -------------------------------------------------------------------------------
    @property
    def rescan_interval(self) -> float:
        """Seconds between re-syncs: ``rescan_interval_s``, or by default 30 s stretched so that a
        re-sync takes at most 5% of a core (its cost grows with the shard directories to stat)."""
        return self.rescan_interval_s if self.rescan_interval_s is not None else self._auto_interval

    def pace(self, pass_cpu_s: float) -> None:
        """After a re-sync that took ``pass_cpu_s`` of CPU: the default interval follows its cost."""
        if self.rescan_interval_s is not None:
            return
        interval = max(_DEFAULT_RESCAN_S, pass_cpu_s / _RESCAN_CPU_SHARE)
        if interval > _DEFAULT_RESCAN_S and abs(interval - self._auto_interval) > 0.2 * self._auto_interval:
            logger.info("tier %s: a re-sync of %r takes %.1f s of CPU; re-syncing every %.0f s (~5%% of a core)",
                        self._label, self._blocks_dir, pass_cpu_s, interval)
        self._auto_interval = interval

    # --- a pass -------------------------------------------------------------------------------
    async def run_pass(self, tmp_grace_s: float | None, *, initial: bool = False, spread_over: float = 0.0) -> float:
        """One walk over the tree: list what changed, make the index agree, evict if over the cap.
        Returns the CPU seconds it took (the walkers' and the loop's share). Stale temporaries
        older than ``tmp_grace_s`` are removed (None keeps them).

        With ``spread_over`` the walk is paced to take that many seconds (a periodic re-sync:
        every directory is visited once per interval, at a steady rate)."""
        cpu = 0.0
        unreadable = 0
        started = time.monotonic()
        # Removal records older than every pass under way can mislead no listing to come.
        self._passes.append(started)
        self.index.forget_removals_before(self._passes[0])

        async def apply(batch: ScanBatch) -> None:
            nonlocal cpu, unreadable
            if self._stop.is_set():
                raise ScanStopped("scan stopped")
            unreadable += batch.unreadable
            cpu += batch.cpu_s + await self.apply_batch(batch, initial=initial)
            self.mtimes.commit(batch)  # only now may later passes skip what it listed

        try:
            root = await self._pool.run(IOQueue.READ, list_root, self._dir_fd, tmp_grace_s)
            plan = PassPlan(root, self.mtimes, tmp_grace_s=tmp_grace_s, budget=_SCAN_STEP_ENTRIES,
                            tops_per_request=_TOPS_PER_PACED_REQUEST if spread_over > 0 else _TOPS_PER_REQUEST)
            await apply(plan.first_batch())
            count = len(plan)

            def due(i: int) -> float:  # request i goes at the end of its share of the interval (not at
                return started + spread_over * (i + 1) / count  # once: the tree was just walked)

            paced = due if spread_over > 0 else None
            in_thread = len(root.tops) <= _IN_THREAD_TOPS or self._walk_in_thread
            if not in_thread:
                try:
                    await self.workers.walk(self._dir_fd, plan, due=paced, apply=apply)
                except ScanWorkerStartError as exc:
                    logger.warning("tier %s: cannot start scan worker processes (%s); walking %r on a thread "
                                   "(the event loop shares the interpreter with it)", self._label, exc,
                                   self._blocks_dir)
                    self._walk_in_thread = in_thread = True  # from the start: a tree walked twice is still right
            if in_thread:
                for i in range(count):
                    if paced is not None:
                        await anyio.sleep(max(0.0, paced(i) - time.monotonic()))
                    for batch in await self._pool.run(IOQueue.READ, _walk, self._dir_fd, plan.request(i), self._stop):
                        await apply(batch)
        finally:
            self._passes.remove(started)
        if unreadable:
            logger.warning("tier %s: %d directories under %r could not be read (permission denied); their "
                           "chunks are kept as last seen, and the next re-sync tries them again", self._label,
                           unreadable, self._blocks_dir)
        self._metrics.passes.inc()
        self.index.complete = True  # the whole tree was seen once: usage is known
        await self._evict_over_capacity()
        self._publish_usage()
        return cpu

    async def apply_batch(self, batch: ScanBatch, *, initial: bool) -> float:
        """Make the index agree with one scan step, in slices of at most ``_SLICE_S`` seconds;
        the seconds the loop spent on it."""
        metrics = self._metrics
        if batch.leaves_listed:
            metrics.dirs_listed.inc(batch.leaves_listed)
        if batch.removed_tmp:
            metrics.stale_tmp.inc(batch.removed_tmp)
        if batch.removed_unsafe:
            metrics.rejected.inc(batch.removed_unsafe, "not_regular")
            logger.warning("tier %s: removed %d links or special files from %r", self._label,
                           batch.removed_unsafe, self._blocks_dir)
        dropped: list[bytes] = []
        spent = 0.0
        slice_start = time.perf_counter()
        for leaf in batch.leaves:
            self._apply_leaf(leaf, initial, dropped)
            if time.perf_counter() - slice_start > _SLICE_S:
                spent += time.perf_counter() - slice_start
                await self._yield_slice(dropped)
                slice_start = time.perf_counter()
        # A pass's first batch names every top directory the root lacks (4096 on a new tree):
        # only those the index holds chunks in have anything to drop.
        held = self.index.held_tops() if batch.tops else set()
        for top in batch.tops:
            if top.top not in held:
                continue
            self._apply_top(top, dropped)
            if time.perf_counter() - slice_start > _SLICE_S:
                spent += time.perf_counter() - slice_start
                await self._yield_slice(dropped)
                slice_start = time.perf_counter()
        spent += time.perf_counter() - slice_start
        await self._yield_slice(dropped)
        await self._evict_over_capacity()
        return spent

    async def _yield_slice(self, dropped: list[bytes]) -> None:
        if dropped:
            self._removed(list(dropped))
            dropped.clear()
        self._publish_usage()
        await anyio.lowlevel.checkpoint()

    def _apply_leaf(self, listing: LeafListing, initial: bool, dropped: list[bytes]) -> None:
        """One leaf directory as listed: keys it lacks are dropped (another process deleted them)
        unless in use or confirmed after the listing started; keys only it has are added (cold on
        a start-up scan, most recent otherwise) unless this process dropped them after the listing
        started (it predates their deletion)."""
        index, listed_at = self.index, listing.listed_at
        known = index.leaf_keys(listing.group, listing.leaf)
        if initial and not known and not self._deleting and not index.removed_any_since(listed_at):
            index.add_cold(listing.chunks)  # the start-up scan's common case, in one call
            return
        deleting = self._deleting
        on_disk = {chunk[0]: (chunk[1], chunk[2]) for chunk in listing.chunks
                   if chunk[0] not in deleting and not index.removed_since(chunk[0], listed_at)}
        for key in known:
            found = on_disk.pop(key, None)
            if found is None:
                if not index.is_busy(key) and not index.confirmed_since(key, listed_at):
                    index.remove(key)
                    dropped.append(key)
            elif (found[0] != index.size_of(key) and not index.is_busy(key)
                  and not index.confirmed_since(key, listed_at)):
                index.add(key, found[0], found[1])
        if not on_disk:
            return
        if initial:
            index.add_cold((key, size, mtime) for key, (size, mtime) in on_disk.items())
        else:
            for key, (size, mtime) in sorted(on_disk.items(), key=lambda item: item[1][1]):
                index.add(key, size, mtime)

    def _apply_top(self, listing: TopListing, dropped: list[bytes]) -> None:
        """Leaf directories the index knows that a top directory no longer holds: their chunks
        are gone (same rules as :meth:`_apply_leaf`)."""
        index, present = self.index, listing.present
        for group in index.groups:
            for leaf in index.leaves_in_top(group, listing.top):
                if present is not None and (group << 20 | leaf) in present:
                    continue
                for key in index.leaf_keys(group, leaf):
                    if not index.is_busy(key) and not index.confirmed_since(key, listing.listed_at):
                        index.remove(key)
                        dropped.append(key)


def _walk(dir_fd: int, request: WalkRequest, stop: threading.Event) -> list[ScanBatch]:
    """One walk request on a pool thread (small trees; see ``_IN_THREAD_TOPS``)."""
    return list(walk_tops(dir_fd, request, stop=stop))

"""The tiering manager: the scheduler-facing orchestration of the host tier and secondary tiers.

``TieringManager`` is SYNCHRONOUS and NEVER BLOCKS. It is called from the engine's event-loop
thread only (the engine owns it; no lock is needed), and it only ever *submits* work to tiers and
*drains* their finished results.

Store: ``prepare_store`` allocates host slots (evicting by policy) → the caller copies device
blocks into the slots → ``complete_store`` makes the chunks visible and cascades them to every
secondary tier concurrently (each cascade pins the host slots with a read reference until the
tier reports).

Load: ``lookup`` walks the host tier, then the secondary tiers in configured order (honouring
the request's ``kv_load_tiers``). A secondary hit allocates a host slot at once and answers
``HIT_PENDING`` (so no other lookup of the same key starts a second promotion); the promotions
of one (tier, request) are submitted as one job at ``on_schedule_end``. A failed promotion frees
its slots and the key becomes a miss: the request recomputes, it never sees garbage. A promotion
never evicts a chunk that an unfinished request's lookups found or promoted: a prefix larger than
the room ends where the room does (the rest recomputes) instead of evicting itself, and two
concurrent requests do not evict each other's chunks, in a loop.

Write policies (a tier's ``write_policy``; the books are kept by ``kvtier.policies.write``):

* ``write_through`` (default): a stored chunk is cascaded to the tier at ``complete_store``.
* ``write_back``: the chunk is *dirty* for the tier and written when the host tier needs its slot.
  The manager holds one read pin on a dirty chunk, so it is never evicted, until every
  write-back tier has settled it. When ``prepare_store`` (or a promotion's allocation) finds no
  chunk to evict (the chunks of the request's own prefix do not count), the manager starts the
  write-back of the least recently hit dirty chunks, as many as the allocation lacks beyond the
  write-backs already in flight (at most
  ``WRITE_BACK_BATCH``), and answers ``None`` (a lookup answers ``RETRY`` while write-backs are in
  flight): the caller retries, and a chunk is evictable as soon as its write-backs are settled.
  A write-back that fails (a tier error, a full queue, the engine closing) or that back-pressure
  sheds settles the chunk for that tier all the same: the tier does not have it (a later load
  from it misses), it is counted (``write_backs_failed``/``write_backs_skipped``) and never
  retried. :meth:`TieringManager.flush_write_back` starts the write-back of every dirty chunk (the
  engine calls it before draining). ``reset_cache`` drops dirty chunks with the rest of host
  memory: they are lost to the write-back tiers (counted as ``write_backs_dropped``, logged), so
  the engine flushes and drains before it resets.
* ``selective``: the chunk is written to the tier once requests have hit it ``min_hits`` times
  while it is in host memory (``prepare_load``/``touch`` of a request; one hit per request and
  chunk; cascades are no hits); a chunk evicted before that never reaches the tier.

Write policies govern the cascades of stored chunks. A promoted chunk is cascaded to no tier
(whatever the policies), and a ``REQUEST_LEVEL`` tier gets the chunks of the requests that asked
for them at once, whatever its policy.

Back-pressure: a tier configured with a ``backpressure`` detector (``kvtier.backpressure``) is
asked before each store job to it; a store it sheds creates no job and pins nothing (the host
copy and the other tiers are unaffected), loads are never throttled, and the tier's store results
feed its detector. Pressure turning on or off is logged once per change.

Invariants (property-tested): every job submitted to a tier is accounted exactly once; a slot
pinned for a job is unpinned exactly once when its result is processed; promotions are never
duplicated; a key whose load failed is not re-promoted from a stale verdict (the tier base
invalidates it); after ``reset_cache`` no promotion starts until ``on_reset_flushed``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.config.tiers import SELECTIVE, WRITE_BACK, WRITE_THROUGH
from kvtier.context import RequestContext
from kvtier.policies.write import WriteLedger, WritePolicy, WriteTierStatistics
from kvtier.stats import LATENCY_BUCKETS, Histogram, HistogramSnapshot
from kvtier.tiers.base import ParentManager
from kvtier.types import CacheHitSource, LookupResult, OffloadingEvent, OffloadPolicy

if TYPE_CHECKING:
    from kvtier.backpressure import BackpressureDetector
    from kvtier.host.tier import HostTier, PrepareStoreOutput
    from kvtier.tiers.base import JobResult, SecondaryTier, TransferJob

__all__ = [
    "TieringManager",
    "ManagerStatistics",
    "JobsInFlight",
    "PRIMARY_LABEL",
    "WRITE_BACK_BATCH",
]

logger = logging.getLogger("kvtier.manager")

PRIMARY_LABEL = "0:primary"
#: Store failure reasons that say nothing about the tier's health (the engine is closing; a
#: tenant at its budget had chunks refused).
_NOT_TIER_FAILURES = frozenset({"closed", "cancelled", "tenant_quota"})
#: Most chunks of one write-back job, and most write-backs one allocation starts.
WRITE_BACK_BATCH = 256


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """A snapshot of the manager's counters (read by ``kvtier.metrics``)."""

    primary_lookups: int
    primary_hits: int
    promotion_allocation_failures: int
    store_allocation_failures: int
    active_promotion_jobs: dict[str, int]
    active_cascade_jobs: dict[str, int]
    promotion_job_failures: dict[str, int]
    cascade_job_failures: dict[str, int]
    promotion_latency: dict[str, dict[str, HistogramSnapshot]]
    cascade_latency: dict[str, dict[str, HistogramSnapshot]]
    jobs_in_flight: int
    promotions_held: bool
    # Back-pressure, only for tiers that have a detector:
    backpressure_stores_dropped: dict[str, int] = field(default_factory=dict)
    backpressure_blocks_dropped: dict[str, int] = field(default_factory=dict)
    backpressure_store_latency_ema: dict[str, float] = field(default_factory=dict)  # s/MiB
    backpressure_active: dict[str, bool] = field(default_factory=dict)
    #: Each tier's write policy and what it wrote (every tier listed).
    write_policies: dict[str, WriteTierStatistics] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobsInFlight:
    """Tier jobs of one tier submitted and not yet reported, with the chunks they carry."""

    cascade_jobs: int = 0
    cascade_chunks: int = 0
    promotion_jobs: int = 0
    promotion_chunks: int = 0

    @property
    def jobs(self) -> int:
        return self.cascade_jobs + self.promotion_jobs


@dataclass(slots=True)
class _JobRecord:
    tier_idx: int
    keys: list[bytes]
    is_promotion: bool
    created: float
    #: Submit time on the tier's back-pressure detector clock (store jobs of a tier that has one).
    bp_submitted: float | None = None
    #: The write policy a store job carries out (``None``: a job the tier made itself).
    write: str | None = None


@dataclass(slots=True)
class _PendingPromotion:
    ctx: RequestContext
    keys: list[bytes] = field(default_factory=list)
    slot_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    ctx: RequestContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    load_sources: dict[bytes, int] = field(default_factory=dict)
    #: Chunks this request's lookups found in host memory or started promoting, until it finishes
    #: (``TieringManager._active_prefixes`` counts them over all requests).
    prefix: set[bytes] = field(default_factory=set)
    #: Tiers that asked for every chunk of this request (OffloadPolicy.REQUEST_LEVEL).
    request_level_tiers: tuple[int, ...] = ()
    #: Chunks the host tier held when offered but still being written (HIT_PENDING): cascaded to
    #: the request-level tiers once ready, retried at every ``on_schedule_end``.
    parked_cascades: list[bytes] = field(default_factory=list)


class TieringManager:
    """Host tier + ordered secondary tiers behind vLLM's ``OffloadingManager`` semantics.

    ``tiers[i]`` is secondary tier ``i`` (metric label ``f"{i+1}:{type}"``); it is asked before
    tier ``i+1``. With no secondary tiers the manager is a thin layer over the host tier
    (``CPUOffloadingSpec``). ``backpressure[i]`` is tier ``i``'s back-pressure detector or
    ``None`` (co-indexed with ``tiers``; omitted: no tier has one).
    """

    def __init__(self, host: HostTier, tiers: Sequence[SecondaryTier] = (), *,
                 backpressure: Sequence[BackpressureDetector | None] | None = None) -> None:
        self.host = host
        self.tiers: list[SecondaryTier] = list(tiers)
        detectors: list[BackpressureDetector | None] = (
            list(backpressure) if backpressure is not None else [None] * len(self.tiers))
        if len(detectors) != len(self.tiers):
            raise ValueError(f"backpressure has {len(detectors)} entries for {len(self.tiers)} tiers")
        self._detectors: list[BackpressureDetector | None] = detectors
        #: (under pressure, failure-tripped) last logged per tier, so each change is logged once.
        self._bp_logged = [(False, False)] * len(self.tiers)
        #: Per tier: a failure trip was reported and no store has succeeded since (its probes,
        #: let through by idle decay and failing again, are not re-reported).
        self._bp_failing = [False] * len(self.tiers)
        #: Chunks in the prefix some unfinished request is resolving, with how many such requests:
        #: a promotion never evicts them (a prefix larger than the room would evict itself, and two
        #: requests each other's chunks, in a loop).
        self._active_prefixes: dict[bytes, int] = {}
        self._write = WriteLedger([WritePolicy.of(getattr(tier, "config", None)) for tier in self.tiers])
        self._job_ids = itertools.count()
        self._jobs: dict[tuple[int, int], _JobRecord] = {}
        self._pending: dict[tuple[int, str], _PendingPromotion] = {}
        self._requests: dict[str, _RequestState] = {}
        self._polled_this_step = False
        self._promotions_held = False
        self._serving_tiers = [
            idx for idx, tier in enumerate(self.tiers)
            if tier.serves_external_requests
        ]
        # statistics
        self._primary_lookups = 0
        self._primary_hits = 0
        self._promotion_alloc_failures = 0
        self._store_alloc_failures = 0
        labels = [tier.context.label for tier in self.tiers]
        self._labels = labels
        self._promotion_failures = dict.fromkeys(labels, 0)
        self._cascade_failures = dict.fromkeys(labels, 0)
        self._promotion_latency = {
            label: {r: Histogram(LATENCY_BUCKETS) for r in ("success", "failure")} for label in labels
        }
        self._cascade_latency = {
            label: {r: Histogram(LATENCY_BUCKETS) for r in ("success", "failure")} for label in labels
        }
        bp_labels = [label for label, d in zip(labels, detectors) if d is not None]
        self._bp_stores_dropped = dict.fromkeys(bp_labels, 0)
        self._bp_blocks_dropped = dict.fromkeys(bp_labels, 0)

    @property
    def backpressure_detectors(self) -> tuple[BackpressureDetector | None, ...]:
        """Each tier's back-pressure detector (``None``: the tier takes every store)."""
        return tuple(self._detectors)

    # ------------------------------------------------------------------ request bookkeeping
    def _state(self, ctx: RequestContext) -> _RequestState:
        state = self._requests.get(ctx.req_id)
        if state is None:
            state = self._requests[ctx.req_id] = _RequestState(ctx)
        return state

    def on_new_request(self, ctx: RequestContext, *, exclude_tier: int | None = None) -> OffloadPolicy:
        """A request starts: ask every tier which of its chunks it wants.

        Tiers answering ``REQUEST_LEVEL`` get every chunk the request offers to
        :meth:`prepare_store` (chunks already in host memory too); the answer is
        ``REQUEST_LEVEL`` if any tier asked for it.
        """
        levels = tuple(
            idx for idx, tier in enumerate(self.tiers)
            if idx != exclude_tier and tier.on_new_request(ctx) is OffloadPolicy.REQUEST_LEVEL
        )
        if not levels:
            return OffloadPolicy.CHUNK_LEVEL
        self._state(ctx).request_level_tiers = levels
        return OffloadPolicy.REQUEST_LEVEL

    # ------------------------------------------------------------------ load path
    def lookup(self, key: bytes, ctx: RequestContext, *, exclude_tier: int | None = None) -> LookupResult:
        """Where ``key`` can be loaded from now. Never blocks.

        ``HIT``: in host memory, ready. ``HIT_PENDING``: will be in host memory (a store or a
        promotion is in flight) — ask again after progress. ``RETRY``: some tier is still
        probing. ``MISS``: nowhere (or promotions are held after a reset). ``exclude_tier``
        skips one tier (a tier serving a peer looks up the rest of the stack).
        """
        if not self._polled_this_step:
            self.poll()
        result = self.host.lookup(key)
        hit = result is LookupResult.HIT or result is LookupResult.HIT_PENDING
        if ctx.first_lookup(PRIMARY_LABEL, key):
            self._primary_lookups += 1
            self._primary_hits += hit
        if hit:
            if self.tiers:
                self._hold_prefix(ctx, key)
            return result
        if self._promotions_held or not self.tiers:
            return LookupResult.MISS
        tier_filter = ctx.params.load_tier_filter
        any_retry = False
        for idx, tier in enumerate(self.tiers):
            cfg = tier.config
            if idx == exclude_tier or not tier_filter.allows(idx, cfg.type, tier.medium, cfg.locality):
                continue
            verdict = tier.lookup(key, ctx)
            if verdict is LookupResult.HIT:
                return self._initiate_promotion(idx, key, ctx)
            if verdict is LookupResult.RETRY:
                any_retry = True
        return LookupResult.RETRY if any_retry else LookupResult.MISS

    def _initiate_promotion(self, tier_idx: int, key: bytes, ctx: RequestContext) -> LookupResult:
        """HIT_PENDING: a slot is allocated for the promotion. RETRY: no room, but write-backs in
        flight will make some. MISS: no room."""
        prefix = self._active_prefixes.keys()
        out = self.host.prepare_write([key], ctx, protect=prefix)
        if out is None and self._write.num_cleaning:
            # Write-backs reported since the last poll may have made room; answering RETRY on
            # their account would wait for a wake-up that has already happened.
            self._collect_results()
            out = self.host.prepare_write([key], ctx, protect=prefix)
        if out is None and self._start_write_backs([key], prefix):
            out = self.host.prepare_write([key], ctx, protect=prefix)
        if out is None or not out.keys_to_store:
            self._promotion_alloc_failures += 1
            return LookupResult.RETRY if out is None and self._write.num_cleaning else LookupResult.MISS
        self._write.evicted(out.evicted_keys)
        pending = self._pending.get((tier_idx, ctx.req_id))
        if pending is None:
            pending = self._pending[(tier_idx, ctx.req_id)] = _PendingPromotion(ctx)
        pending.keys.append(key)
        pending.slot_ids.append(out.slot_ids[0])
        self._state(ctx).load_sources[key] = tier_idx
        self._hold_prefix(ctx, key)
        return LookupResult.HIT_PENDING

    def get_load_source(self, key: bytes, ctx: RequestContext) -> str:
        """Label of the tier that supplied ``key`` to this request (``"0:primary"`` for host hits)."""
        state = self._requests.get(ctx.req_id)
        if state is not None and key in state.load_sources:
            return self._labels[state.load_sources[key]]
        return PRIMARY_LABEL

    def get_cache_hit_source(self, key: bytes, ctx: RequestContext) -> CacheHitSource:
        state = self._requests.get(ctx.req_id)
        if state is not None and key in state.load_sources:
            return self.tiers[state.load_sources[key]].cache_hit_source
        return CacheHitSource.HOST

    def prepare_load(self, keys: Sequence[bytes], ctx: RequestContext) -> list[int]:
        """Pin ``keys`` (all must be ``HIT``) and return their host slots, co-indexed with ``keys``.

        A hit of the request on each key (write policies: see the module docstring)."""
        slot_ids = self.host.prepare_load(keys, ctx)
        self._count_hits(keys, ctx)
        return slot_ids

    def complete_load(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        """Unpin keys pinned by :meth:`prepare_load` once their bytes reached the device."""
        self.host.complete_load(keys)

    def touch(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        """Mark ``keys`` recently used by the request, everywhere; a hit on those in host memory."""
        self.host.touch(keys, ctx)
        for tier in self.tiers:
            tier.touch(keys, ctx)
        self._count_hits(keys, ctx)

    def _count_hits(self, keys: Sequence[bytes], ctx: RequestContext) -> None:
        """Dirty chunks hit become the most recent; selective tiers get the chunks now due to them."""
        if not self._write.defers_writes:
            return
        for idx, due in self._write.hit(keys, ctx).items():
            submitted = self._submit_cascade(idx, due, ctx, SELECTIVE)
            if len(submitted) < len(due):
                self._write.selective_skipped(idx, len(due) - len(submitted))

    # ------------------------------------------------------------------ store path
    def prepare_store(self, keys: Sequence[bytes], ctx: RequestContext) -> PrepareStoreOutput | None:
        """Allocate host slots for the keys not yet held. ``None``: no room now; retry later."""
        self.poll()
        out = self.host.prepare_store(keys, ctx)
        if out is None and self._start_write_backs(keys):
            out = self.host.prepare_store(keys, ctx)  # write-backs shed at once made room
        if out is None:
            self._store_alloc_failures += 1
            return None
        self._write.evicted(out.evicted_keys)
        if out.keys_to_store:
            self._state(ctx).pending_primary_stores += 1
        state = self._requests.get(ctx.req_id)
        if state is not None and state.request_level_tiers:
            # Request-level tiers get the chunks the host already held as well, now (or once
            # another request finished writing them).
            new = set(out.keys_to_store)
            ready: list[bytes] = []
            for key in keys:
                if key in new:
                    continue
                verdict = self.host.lookup(key)
                if verdict is LookupResult.HIT:
                    ready.append(key)
                elif verdict is LookupResult.HIT_PENDING:
                    state.parked_cascades.append(key)
            if ready:
                for idx in state.request_level_tiers:
                    self._submit_cascade(idx, ready, ctx)
        return out

    def complete_store(self, keys: Sequence[bytes], ctx: RequestContext, success: bool = True) -> None:
        """Publish stored keys (or release them on failure) and cascade them to every tier (to the
        write-back and selective ones when their policy says so)."""
        self.host.complete_store(keys, success)
        if success and keys:
            state = self._requests.get(ctx.req_id)
            request_level = state.request_level_tiers if state is not None else ()
            deferred: list[int] = []
            for idx, tier in enumerate(self.tiers):
                if tier.request_level_only and idx not in request_level:
                    continue
                if idx in request_level or not self._write.deferred(idx):
                    self._submit_cascade(idx, list(keys), ctx)
                else:
                    deferred.append(idx)
            if deferred:
                ready = [k for k in dict.fromkeys(keys) if self.host.lookup(k) is LookupResult.HIT]
                dirty = self._write.stored(ready, deferred)
                if dirty:
                    self.host.prepare_read(dirty)  # the hold that keeps a dirty chunk from eviction
        state = self._requests.get(ctx.req_id)
        if state is not None and state.pending_primary_stores > 0:
            state.pending_primary_stores -= 1
            self._maybe_finalize(state)

    def _submit_cascade(self, tier_idx: int, keys: list[bytes], ctx: RequestContext | None,
                        write: str = WRITE_THROUGH) -> list[bytes]:
        """Submit one store job of the ``keys`` ready in host memory; returns them (``[]``: none
        ready, or back-pressure shed the job)."""
        from kvtier.tiers.base import TransferJob

        ready = [k for k in keys if self.host.lookup(k) is LookupResult.HIT]
        if not ready:
            return []
        detector = self._detectors[tier_idx]
        if detector is not None and not self._admit_store(tier_idx, detector, len(ready)):
            return []  # shed: no job, no pin
        slot_ids = self.host.prepare_read(ready)
        job = TransferJob(next(self._job_ids), ready, slot_ids, is_promotion=False, ctx=ctx)
        self._jobs[(tier_idx, job.job_id)] = _JobRecord(
            tier_idx, ready, False, job.submit_time, detector.clock() if detector is not None else None, write
        )
        self.tiers[tier_idx].submit_store(job)
        return ready

    # ------------------------------------------------------------------ write-back
    def _start_write_backs(self, keys: Sequence[bytes], protect: Collection[bytes] = ()) -> bool:
        """An allocation for ``keys`` found no room: start the write-back of the least recently
        hit dirty chunks, as many as it lacks beyond the write-backs in flight. True when some
        chunk became evictable at once (its write-backs were shed): the caller tries again."""
        if not self._write.num_dirty:
            return False
        lacking = sum(1 for k in dict.fromkeys(keys) if self.host.lookup(k) is LookupResult.MISS)
        # The offered keys (and a promoting request's own prefix) are never evicted for them:
        # their slots do not count.
        evictable = self.host.evictable_slots - self.host.count_evictable({*keys, *protect})
        lacking -= self.host.free_slots + evictable + self._write.num_cleaning
        if lacking <= 0:
            return False
        return self._submit_write_backs(self._write.take_dirty(min(lacking, WRITE_BACK_BATCH), reason="evict"))

    def _submit_write_backs(self, by_tier: dict[int, list[bytes]]) -> bool:
        """Submit the write-backs taken from the ledger; True when some chunk is clean at once."""
        freed = False
        for idx, keys in by_tier.items():
            for start in range(0, len(keys), WRITE_BACK_BATCH):
                part = keys[start:start + WRITE_BACK_BATCH]
                submitted = set(self._submit_cascade(idx, part, None, WRITE_BACK))
                if len(submitted) < len(part):
                    clean = self._write.settled(idx, [k for k in part if k not in submitted], "skipped")
                    if clean:
                        self.host.complete_read(clean)
                        freed = True
        return freed

    def flush_write_back(self) -> int:
        """Start the write-back of every dirty chunk now (jobs of at most ``WRITE_BACK_BATCH``
        chunks); returns how many chunks. Never blocks: wait for :attr:`jobs_in_flight` to drain."""
        num_chunks = self._write.num_dirty
        if num_chunks:
            self._submit_write_backs(self._write.take_dirty(None, reason="flush"))
        return num_chunks

    def dirty_chunks_by_tier(self) -> dict[str, int]:
        """Per write-back tier label: chunks in host memory whose write-back to it has not started
        (what :meth:`flush_write_back` would start; ``statistics()`` counts those in flight too)."""
        return {self._labels[idx]: n for idx, n in self._write.unstarted_by_tier().items()}

    # ------------------------------------------------------------------ back-pressure
    def _admit_store(self, tier_idx: int, detector: BackpressureDetector, num_chunks: int) -> bool:
        """Ask tier ``tier_idx``'s detector once about one store job; count what it sheds."""
        admitted = detector.should_store(num_chunks)
        stores, blocks = detector.pop_stores_dropped()
        label = self._labels[tier_idx]
        self._bp_stores_dropped[label] += stores
        self._bp_blocks_dropped[label] += blocks
        self._log_pressure_change(tier_idx, detector)
        return admitted

    def _feed_backpressure(self, tier_idx: int, record: _JobRecord, result: JobResult) -> None:
        """A store job of tier ``tier_idx`` finished: tell its detector (if it has one).

        Success: seconds since submit and the bytes moved (``transfer_bytes``, else keys x slot
        size). Failure: one failed store, unless the engine itself caused it (closing).
        """
        detector = self._detectors[tier_idx]
        if detector is None or record.bp_submitted is None:
            return
        if result.success:
            nbytes = result.transfer_bytes
            if nbytes is None:
                nbytes = len(record.keys) * self.tiers[tier_idx].context.slot_bytes
            detector.update(record.bp_submitted, nbytes)
        elif result.failure_reason not in _NOT_TIER_FAILURES:
            detector.on_store_failed()
        self._log_pressure_change(tier_idx, detector)

    def _log_pressure_change(self, tier_idx: int, detector: BackpressureDetector) -> None:
        """Log a change of the tier's pressure state once. A tier that keeps failing is reported
        once: while no store has succeeded since, idle decay clearing its pressure (a probe
        store goes through) and the probe failing again are DEBUG, and the first success after
        it is the INFO "off"."""
        stats = detector.statistics()
        state = (stats.under_pressure, stats.failure_tripped)
        before = self._bp_logged[tier_idx]
        recovered = self._bp_failing[tier_idx] and stats.consecutive_failures == 0
        if recovered:
            self._bp_failing[tier_idx] = False
        if state == before and not recovered:
            return
        self._bp_logged[tier_idx] = state
        label = self._labels[tier_idx]
        ema = "n/a" if stats.store_latency_ema is None else f"{stats.store_latency_ema:.4g} s/MiB"
        if stats.failure_tripped and not before[1]:
            if self._bp_failing[tier_idx]:
                logger.debug("tier %s: probe store failed; back-pressure on again (%d consecutive failed "
                             "stores)", label, stats.consecutive_failures)
            else:
                self._bp_failing[tier_idx] = True
                logger.warning("tier %s: back-pressure on after %d consecutive failed stores (latency EMA %s); "
                               "stores to it are shed", label, stats.consecutive_failures, ema)
        elif stats.under_pressure and not before[0]:
            logger.warning("tier %s: back-pressure on (store latency EMA %s); stores to it are shed",
                           label, ema)
        elif not stats.under_pressure and (before[0] or recovered):
            if self._bp_failing[tier_idx]:
                logger.debug("tier %s: back-pressure decayed; probing with a store (%d consecutive failed "
                             "stores)", label, stats.consecutive_failures)
            else:
                logger.info("tier %s: back-pressure off (store latency EMA %s)", label, ema)

    # ------------------------------------------------------------------ step hooks
    def on_request_finished(self, ctx: RequestContext) -> None:
        """No more submit-side calls come for ``ctx``; completions may still arrive."""
        self.host.on_request_finished(ctx)
        state = self._requests.get(ctx.req_id)
        if state is None:
            for tier in self.tiers:
                tier.on_request_finished(ctx)
            return
        state.is_finished = True
        self._release_prefix(state)
        self._maybe_finalize(state)

    def _hold_prefix(self, ctx: RequestContext, key: bytes) -> None:
        """``key`` is part of the prefix ``ctx`` is resolving: no promotion evicts it until the
        request finishes (two requests would otherwise evict each other's chunks in turn)."""
        state = self._state(ctx)
        if state.is_finished or key in state.prefix:
            return
        state.prefix.add(key)
        self._active_prefixes[key] = self._active_prefixes.get(key, 0) + 1

    def _release_prefix(self, state: _RequestState) -> None:
        for key in state.prefix:
            left = self._active_prefixes.get(key, 0) - 1
            if left > 0:
                self._active_prefixes[key] = left
            else:
                self._active_prefixes.pop(key, None)
        state.prefix.clear()

    def _maybe_finalize(self, state: _RequestState) -> None:
        if not state.is_finished or state.pending_primary_stores > 0 or state.parked_cascades:
            return
        if any(p.ctx is state.ctx for p in self._pending.values()):
            return  # promotions still to submit: finalize after they are flushed
        for tier in self.tiers:
            tier.on_request_finished(state.ctx)
        self._requests.pop(state.ctx.req_id, None)

    def on_schedule_end(self) -> None:
        """End of a step: flush pending promotions as one job per (tier, request), then tier hooks."""
        from kvtier.tiers.base import TransferJob

        if not self._polled_this_step:
            self.poll()
        self._polled_this_step = False
        pending, self._pending = self._pending, {}
        for (tier_idx, _req_id), promo in pending.items():
            job = TransferJob(
                next(self._job_ids), promo.keys, promo.slot_ids, is_promotion=True, ctx=promo.ctx
            )
            self._jobs[(tier_idx, job.job_id)] = _JobRecord(tier_idx, promo.keys, True, job.submit_time)
            self.tiers[tier_idx].submit_load(job)
        self._retry_parked_cascades()
        for tier in self.tiers:
            tier.on_schedule_end()
        for promo in pending.values():
            state = self._requests.get(promo.ctx.req_id)
            if state is not None:
                self._maybe_finalize(state)

    def _retry_parked_cascades(self) -> None:
        for state in [s for s in self._requests.values() if s.parked_cascades]:
            ready: list[bytes] = []
            still: list[bytes] = []
            for key in state.parked_cascades:
                verdict = self.host.lookup(key)
                if verdict is LookupResult.HIT:
                    ready.append(key)
                elif verdict is LookupResult.HIT_PENDING:
                    still.append(key)
                # MISS: the write failed or the chunk was evicted; nothing to cascade
            state.parked_cascades = still
            if ready:
                for idx in state.request_level_tiers:
                    self._submit_cascade(idx, ready, state.ctx)
            self._maybe_finalize(state)

    def needs_step_end(self) -> bool:
        """True when :meth:`on_schedule_end` has work: promotions to submit, cascades parked."""
        return bool(self._pending) or any(s.parked_cascades for s in self._requests.values())

    def poll(self) -> None:
        """Process every finished tier job: complete promotions, unpin cascades. Never blocks."""
        self._polled_this_step = True
        self._collect_results()
        for idx in self._serving_tiers:
            self.tiers[idx].serve_external_requests(_TierFacingParent(self, idx))
        if self._promotions_held and not self._jobs and not self._pending:
            self._promotions_held = False

    def _collect_results(self) -> None:
        for idx, tier in enumerate(self.tiers):
            for result in tier.get_finished_jobs():
                self._process_result(idx, result)

    def _process_result(self, tier_idx: int, result: JobResult) -> None:
        record = self._jobs.pop((tier_idx, result.job_id), None)
        if record is None:
            logger.error("tier %s reported unknown job %s; ignored", self._labels[tier_idx], result.job_id)
            return
        label = self._labels[tier_idx]
        outcome = "success" if result.success else "failure"
        latency = time.monotonic() - record.created
        if record.is_promotion:
            self._promotion_latency[label][outcome].observe(latency)
            if result.success:
                self.host.complete_write(record.keys, True)
                return
            self._promotion_failures[label] += 1
            loaded = set(result.successful_keys or ())
            ok = [k for k in record.keys if k in loaded]
            failed = [k for k in record.keys if k not in loaded]
            if ok:
                self.host.complete_write(ok, True)
            self.host.complete_write(failed, False)
            for state in self._requests.values():
                for key in failed:
                    state.load_sources.pop(key, None)
        else:
            self._cascade_latency[label][outcome].observe(latency)
            self.host.complete_read(record.keys)
            if not result.success:
                self._cascade_failures[label] += 1
            self._feed_backpressure(tier_idx, record, result)
            if record.write == WRITE_BACK:
                clean = self._write.settled(tier_idx, record.keys, "written" if result.success else "failed")
                if clean:
                    self.host.complete_read(clean)  # the dirty hold: the chunk is evictable now
            elif record.write is not None and result.success:
                self._write.count_written(tier_idx, record.write, len(record.keys))

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._pending or self.needs_step_end()) or any(
            t.has_pending_work() for t in self.tiers)

    def create_store_job(self, tier_idx: int, keys: Sequence[bytes], ctx: RequestContext) -> TransferJob:
        """Pin ``keys`` (host HITs) for a store job tier ``tier_idx`` owns (see :class:`ParentManager`)."""
        from kvtier.tiers.base import TransferJob

        keys = list(keys)
        for key in keys:
            if self.host.lookup(key) is not LookupResult.HIT:
                raise ValueError(f"create_store_job: chunk {key.hex()[:16]} is not ready in host memory")
        slot_ids = self.host.prepare_read(keys)
        job = TransferJob(next(self._job_ids), keys, slot_ids, is_promotion=False, ctx=ctx)
        detector = self._detectors[tier_idx]
        self._jobs[(tier_idx, job.job_id)] = _JobRecord(
            tier_idx, keys, False, job.submit_time, detector.clock() if detector is not None else None
        )
        return job

    @property
    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    def jobs_in_flight_by_tier(self) -> dict[str, JobsInFlight]:
        """Jobs in flight (as of the last :meth:`poll`) per tier label, every tier listed."""
        counts = {label: [0, 0, 0, 0] for label in self._labels}
        for record in self._jobs.values():
            entry = counts[self._labels[record.tier_idx]]
            offset = 2 if record.is_promotion else 0
            entry[offset] += 1
            entry[offset + 1] += len(record.keys)
        return {label: JobsInFlight(*entry) for label, entry in counts.items()}

    # ------------------------------------------------------------------ events, stats, reset
    def take_events(self) -> list[OffloadingEvent]:
        """Host events first, then each tier's, in tier order."""
        events = list(self.host.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def reset_cache(self) -> None:
        """Evict everything from the host tier (secondary tiers keep their persistent data).

        Precondition: no tier job is in flight (the engine drains them first, see
        ``Engine.reset_cache``) — a late promotion could otherwise write a freed slot. Pending,
        unsubmitted promotions are dropped. With secondary tiers, promotions stay held (host
        misses answer ``MISS``) until :meth:`on_reset_flushed`. Dirty chunks (write-back) are
        dropped unwritten, counted and logged: flush and drain first to keep them.
        """
        self.poll()
        if self._jobs:
            raise RuntimeError(f"reset_cache with {len(self._jobs)} tier jobs in flight; drain first")
        self._pending.clear()
        for state in self._requests.values():
            state.load_sources.clear()
            state.pending_primary_stores = 0
        self._requests = {rid: s for rid, s in self._requests.items() if not s.is_finished}
        self.host.reset_cache()
        for idx, dropped in sorted(self._write.clear().items()):
            logger.warning("reset_cache: %d chunks not yet written to write-back tier %s are dropped",
                           dropped, self._labels[idx])
        for idx, detector in enumerate(self._detectors):
            if detector is not None:
                detector.reset()
                self._log_pressure_change(idx, detector)
        self._promotions_held = bool(self.tiers)

    def on_reset_flushed(self) -> None:
        """Every device copy in flight at the reset has been reported: promotions may resume."""
        self._promotions_held = False

    def get_stats(self) -> dict[str, object]:
        stats: dict[str, object] = dict(self.host.get_stats())
        stats["promotion_allocation_failures"] = self._promotion_alloc_failures
        stats["jobs_in_flight"] = len(self._jobs)
        return stats

    def statistics(self) -> ManagerStatistics:
        ema: dict[str, float] = {}
        active: dict[str, bool] = {}
        for label, detector in zip(self._labels, self._detectors):
            if detector is None:
                continue
            bp = detector.statistics()
            active[label] = bp.under_pressure
            if bp.store_latency_ema is not None:
                ema[label] = bp.store_latency_ema
        active_promotions = dict.fromkeys(self._labels, 0)
        active_cascades = dict.fromkeys(self._labels, 0)
        for record in self._jobs.values():
            target = active_promotions if record.is_promotion else active_cascades
            target[self._labels[record.tier_idx]] += 1
        return ManagerStatistics(
            primary_lookups=self._primary_lookups,
            primary_hits=self._primary_hits,
            promotion_allocation_failures=self._promotion_alloc_failures,
            store_allocation_failures=self._store_alloc_failures,
            active_promotion_jobs=active_promotions,
            active_cascade_jobs=active_cascades,
            promotion_job_failures=dict(self._promotion_failures),
            cascade_job_failures=dict(self._cascade_failures),
            promotion_latency={
                label: {r: h.snapshot() for r, h in hists.items()}
                for label, hists in self._promotion_latency.items()
            },
            cascade_latency={
                label: {r: h.snapshot() for r, h in hists.items()}
                for label, hists in self._cascade_latency.items()
            },
            jobs_in_flight=len(self._jobs),
            promotions_held=self._promotions_held,
            backpressure_stores_dropped=dict(self._bp_stores_dropped),
            backpressure_blocks_dropped=dict(self._bp_blocks_dropped),
            backpressure_store_latency_ema=ema,
            backpressure_active=active,
            write_policies={label: self._write.statistics(idx) for idx, label in enumerate(self._labels)},
        )


class _TierFacingParent(ParentManager):
    """The manager as one tier sees it while serving a peer: that tier is left out of lookups."""

    __slots__ = ("_manager", "_idx")

    def __init__(self, manager: TieringManager, tier_idx: int) -> None:
        self._manager = manager
        self._idx = tier_idx

    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy:
        return self._manager.on_new_request(ctx, exclude_tier=self._idx)

    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        return self._manager.lookup(key, ctx, exclude_tier=self._idx)

    def create_store_job(self, keys: Sequence[bytes], ctx: RequestContext) -> TransferJob:
        return self._manager.create_store_job(self._idx, keys, ctx)

    def on_request_finished(self, ctx: RequestContext) -> None:
        self._manager.on_request_finished(ctx)

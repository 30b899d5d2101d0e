"""The one statement of what a secondary tier provides.

A secondary tier keeps chunk bytes somewhere slower and larger than host memory (a filesystem,
an object store, a peer). Every tier runs as **one anyio task group**: the manager-facing methods
(``lookup``, ``submit_store``, ``submit_load``, ``get_finished_jobs``) are synchronous,
NON-BLOCKING channel operations; worker tasks inside the tier's task group perform the I/O by
calling the few async primitives a tier author writes: ``open``, ``close``, ``contains``,
``write``, ``read`` (and optionally ``known``, ``delete``, ``touch``, ``write_many``,
``read_many``, each optional one declared by its capability class attribute). Everything else is
inherited.

The contract in short: ``read`` fills ``dst`` completely or raises :class:`ChunkNotFound`,
:class:`ChunkCorrupt` or :class:`TierIOError` (any other exception is a bug, counted as
``"internal"``); primitives are cancellable; the same key is never written twice at once; a tier
reports every chunk it drops on its own through :meth:`SecondaryTier.emit_removed`. In return
every submitted job is reported EXACTLY ONCE by :meth:`SecondaryTier.get_finished_jobs`, and a
failed load invalidates the cached positive verdict of every key that did not load, so a key
whose promotion failed is never re-promoted from a stale verdict. The full guide
(preconditions, batch hooks, tiers that run whole jobs themselves) is in docs/tiers.md.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtier.context import RequestContext
from kvtier.stats import MetricFamily
from kvtier.tiers.counters import EVICTION_AGE_BUCKETS, TierCounters, TierStatistics
from kvtier.tiers.errors import ChunkCorrupt, ChunkNotFound, TierError, TierIOError, failure_reason
from kvtier.tiers.jobs import JobHandle, JobResult, TransferJob
from kvtier.tiers.runner import JobRunner, fan_out
from kvtier.tiers.verdicts import VerdictCache
from kvtier.types import CacheHitSource, LookupResult, Medium, OffloadingEvent, OffloadPolicy

if TYPE_CHECKING:
    from kvtier.config import TierConfig
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry
    from kvtier.model import KVModel

__all__ = [
    "TierError", "ChunkNotFound", "ChunkCorrupt", "TierIOError", "failure_reason", "TierContext",
    "TransferJob", "JobResult", "JobHandle", "TierStatistics", "SecondaryTier", "ParentManager", "EVICTION_AGE_BUCKETS",
]

logger = logging.getLogger(__name__)


class ParentManager(abc.ABC):
    """What a tier may ask of the manager while serving an external request.

    For each remote request, in order: :meth:`on_new_request`, then :meth:`lookup` and
    :meth:`create_store_job` as needed, then :meth:`on_request_finished` (always, even with no
    hits). The calling tier is excluded from the lookup's fan-out.
    """

    @abc.abstractmethod
    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy: ...

    @abc.abstractmethod
    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """HIT / HIT_PENDING (a promotion into host memory started) / RETRY / MISS."""

    @abc.abstractmethod
    def create_store_job(self, keys: Sequence[bytes], ctx: RequestContext) -> TransferJob:
        """Pin the host chunks of ``keys`` (all HIT) for a store job the calling tier owns.

        The tier reports the job through ``get_finished_jobs`` like any cascade; the pins are
        released then.
        """

    @abc.abstractmethod
    def on_request_finished(self, ctx: RequestContext) -> None: ...


# --- records -------------------------------------------------------------------------------------
@dataclass
class TierContext:
    """What the engine tells a tier about the run it serves."""

    index: int  # position in secondary_tiers (0-based)
    label: str  # "1:fs"
    slot_bytes: int
    host: SlotBuffer | None  # .view(slot_id); None only in pure-lookup tests
    geometry: KVGeometry | KVModel | None  # the model's KV cache (a geometry: one group)
    blocks_per_chunk: int
    run_fields: Mapping[str, Any]  # for layout.namespace(); includes blocks_per_file
    rank: int = 0
    kv_events_enabled: bool = False  # global events switch (tier also needs enable_kv_events)
    self_describing_kv_events: bool = False
    hash_algorithm: str = "sha256"  # block hashing: p2p peers compare its NONE_HASH seed


# --- the base class ------------------------------------------------------------------------------
class SecondaryTier(abc.ABC):
    """Base of every secondary tier: channels in, results out, one task group.

    Manager-facing methods are called only from the engine's event-loop thread and NEVER block:
    ``submit_*`` are ``send_nowait`` on bounded job streams, ``get_finished_jobs`` and
    ``take_events`` drain without waiting, ``lookup`` answers from what is known now.

    Tunables (keyword arguments a subclass passes to ``super().__init__``; not config keys):
    ``queue_size`` jobs buffered per direction (default 1024; beyond it a submit is rejected at
    once with ``"queue_full"``), ``max_concurrent_loads`` / ``max_concurrent_stores`` chunk I/Os
    in flight per direction (default 16), ``lookup_timeout_s`` (5 s), ``negative_ttl_s`` (1 s:
    how long a MISS verdict is trusted, so chunks written by another process are found later),
    ``verdict_cache_size`` (65536 keys, LRU), ``close_timeout_s`` (bound on ``close()``).

    Subclasses: call ``super().__init__`` first and do not assign attributes named like the
    base's private ones (the base uses descriptive ``_<what>_<unit>`` names to leave room).
    """

    tier_type: ClassVar[str] = ""
    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    #: True when the primitives only work on asyncio (the engine then refuses trio).
    requires_asyncio: ClassVar[bool] = False
    #: True for a tier that takes cascades only from requests that chose ``REQUEST_LEVEL`` for it
    #: in :meth:`on_new_request` (p2p: it holds a producer's chunks for its consumer, nothing else).
    request_level_only: ClassVar[bool] = False

    # Capabilities: what the tier implements beyond the required primitives. Declared, never
    # inferred from which methods a subclass overrides.
    #: :meth:`delete` removes a chunk (otherwise it raises ``NotImplementedError``).
    supports_delete: ClassVar[bool] = False
    #: :meth:`touch` acts on the recency hint; callers may skip calling it when False.
    supports_touch: ClassVar[bool] = False
    #: Store jobs go to :meth:`write_many` whole, once per job, instead of :meth:`write` per chunk.
    batched_writes: ClassVar[bool] = False
    #: Load jobs go to :meth:`read_many` whole, once per job, instead of :meth:`read` per chunk.
    batched_reads: ClassVar[bool] = False

    #: The tier answers requests from outside (a peer's lookups): the manager calls
    #: :meth:`serve_external_requests` on every poll.
    serves_external_requests: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__:
            # Derived from the medium unless the subclass states it (p2p does), as vLLM does.
            cls.cache_hit_source = {
                Medium.CPU: CacheHitSource.HOST,
                Medium.STORAGE: CacheHitSource.DISK,
            }.get(cls.medium, CacheHitSource.EXTERNAL_UNSPECIFIED)  # type: ignore[arg-type]

    def __init__(
        self,
        config: TierConfig,
        context: TierContext,
        *,
        queue_size: int = 1024,
        max_concurrent_loads: int = 16,
        max_concurrent_stores: int = 16,
        max_concurrent_lookups: int = 4,
        lookup_timeout_s: float = 5.0,
        negative_ttl_s: float = 1.0,
        verdict_cache_size: int = 65536,
        close_timeout_s: float = 3.0,
    ) -> None:
        for name, value in (
            ("queue_size", queue_size),
            ("max_concurrent_loads", max_concurrent_loads),
            ("max_concurrent_stores", max_concurrent_stores),
            ("max_concurrent_lookups", max_concurrent_lookups),
            ("verdict_cache_size", verdict_cache_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, fvalue in (
            ("lookup_timeout_s", lookup_timeout_s),
            ("negative_ttl_s", negative_ttl_s),
            ("close_timeout_s", close_timeout_s),
        ):
            if not fvalue >= 0:
                raise ValueError(f"{name} must be >= 0, got {fvalue!r}")
        self.config = config
        self.context = context
        self.label = context.label
        self.max_concurrent_loads = max_concurrent_loads
        self.max_concurrent_stores = max_concurrent_stores
        self.lookup_timeout_s = lookup_timeout_s
        self.negative_ttl_s = negative_ttl_s
        self.close_timeout_s = close_timeout_s
        self._max_concurrent_lookups = max_concurrent_lookups

        # Job channels: bounded, so a stalled tier pushes back instead of growing without limit.
        self._load_send: MemoryObjectSendStream[JobHandle]
        self._load_recv: MemoryObjectReceiveStream[JobHandle]
        self._store_send: MemoryObjectSendStream[JobHandle]
        self._store_recv: MemoryObjectReceiveStream[JobHandle]
        self._load_send, self._load_recv = anyio.create_memory_object_stream[JobHandle](queue_size)
        self._store_send, self._store_recv = anyio.create_memory_object_stream[JobHandle](queue_size)
        # Results are unbounded on purpose: a result must never be dropped or block a worker; its
        # size is bounded by the jobs outstanding since the manager's last drain.
        self._result_send, self._result_recv = anyio.create_memory_object_stream[JobResult](math.inf)
        # One lookup batch per step; a small buffer is plenty (a full one defers the batch).
        self._lookup_send, self._lookup_recv = anyio.create_memory_object_stream[
            tuple[tuple[bytes, ...], int]
        ](64)

        self._unfinished: dict[int, JobHandle] = {}  # id(record) -> record, until reported
        self._idle_event = anyio.Event()
        self._idle_event.set()
        self._wakeup: Callable[[], None] | None = None
        self._removal_listener: Callable[[Sequence[bytes]], None] | None = None
        self._pending_events: list[OffloadingEvent] = []

        self._verdicts = VerdictCache(verdict_cache_size, negative_ttl_s)
        self._probe_batch: dict[bytes, None] = {}  # ordered set: this step's keys to probe
        self._probes_in_flight: set[bytes] = set()

        self._run_started = False
        self._tier_closing = False
        self._stop_requested = anyio.Event()
        self._run_done = anyio.Event()

        self._tier_counters = TierCounters()
        self._reports_to: SecondaryTier | None = None  # a wrapper that reports for this tier
        self._job_runner = JobRunner(self, self._tier_counters, remember_stored=self._remember_stored,
                                     post=self._post, log=logger)

    # --- primitives (override) -----------------------------------------------------------------
    async def open(self) -> None:
        """Connect, probe, scan. Raise ``ConfigError`` for a misconfiguration (fails start-up)."""

    async def close(self) -> None:
        """Release what :meth:`open` acquired. Runs once, shielded, after every worker stopped."""

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        """Batched existence probe, co-indexed with ``keys``. Default: :meth:`known` (None = no)."""
        return [self.known(key) is True for key in keys]

    @abc.abstractmethod
    async def write(self, key: bytes, src: memoryview) -> None:
        """Persist the slot bytes ``src`` under ``key`` (atomically: readers never see half)."""

    @abc.abstractmethod
    async def read(self, key: bytes, dst: memoryview) -> None:
        """Fill ``dst`` completely with ``key``'s bytes, or raise (see module docstring)."""

    async def delete(self, key: bytes) -> None:
        """Remove ``key`` (optional, with ``supports_delete``; the framework never calls it on the
        serving path)."""
        raise NotImplementedError(f"tier type {self.tier_type!r} does not support delete")

    def known(self, key: bytes) -> bool | None:
        """Synchronous fast path of :meth:`lookup`: True/False if answerable now, else None."""
        return None

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        """Write a whole job's chunks; per item ``None`` or the chunk's exception (optional hook).

        With ``batched_writes`` the framework calls it once per store job instead of
        :meth:`write` per chunk (see "Batch hooks" in the module docstring). This default runs
        :meth:`write` for every item concurrently.
        """
        return await fan_out(self.write, items)

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        """Read a whole job's chunks; per item ``None`` or the chunk's exception (optional hook).

        With ``batched_reads`` the framework calls it once per load job instead of :meth:`read`
        per chunk. This default runs :meth:`read` for every item concurrently.
        """
        return await fan_out(self.read, items)

    # --- lookups -------------------------------------------------------------------------------
    def lookup(self, key: bytes, ctx: RequestContext | None = None) -> LookupResult:
        """HIT / MISS now, or RETRY while an asynchronous probe is outstanding. Never blocks.

        Answers from (1) the verdict cache (positive verdicts until invalidated, negative ones for
        ``negative_ttl_s``), (2) :meth:`known`, else (3) adds ``key`` to this step's probe batch
        (sent by :meth:`on_schedule_end`; a key already being probed is not probed twice) and
        answers RETRY. Only resolved answers are counted in ``lookups``/``hits``. After close,
        unknown keys are a MISS (a RETRY would stall the caller forever).
        """
        present = self._verdicts.get(key)
        if present is not None:
            return self.count_lookup(present, key, ctx)
        present = self.known(key)
        if present is not None:
            return self.count_lookup(present, key, ctx)
        if self._tier_closing:
            return self.count_lookup(False, key, ctx)
        if key not in self._probes_in_flight:
            self._probe_batch[key] = None
        return LookupResult.RETRY

    def count_lookup(self, present: bool, key: bytes, ctx: RequestContext | None) -> LookupResult:
        """For subclasses that answer :meth:`lookup` themselves: count a resolved answer, return it.

        Counted once per (request, key) in ``lookups``/``hits``, as vLLM's chunk_queries/chunk_hits.
        """
        if ctx is None or ctx.first_lookup(self.label, key):
            self._tier_counters.count_lookup(present)
        return LookupResult.HIT if present else LookupResult.MISS

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """Force MISS verdicts for ``keys`` (for ``negative_ttl_s``); a probe sent later wins."""
        self._verdicts.set(keys, False)

    def on_schedule_end(self) -> None:
        """End of a scheduler step: send this step's probe batch as ONE item to the lookup worker.

        If the lookup channel is full the batch is kept and sent at the next step.
        """
        if not self._probe_batch or self._tier_closing:
            return
        batch = tuple(self._probe_batch)
        try:
            self._lookup_send.send_nowait((batch, self._verdicts.epoch))
        except anyio.WouldBlock:
            return
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return
        self._probe_batch.clear()
        self._probes_in_flight.update(batch)

    async def _lookup_worker(self) -> None:
        probe_slots = anyio.Semaphore(self._max_concurrent_lookups)
        async with anyio.create_task_group() as tg:
            async for batch, epoch in self._lookup_recv:
                await probe_slots.acquire()  # at most N probes in flight; later batches wait
                tg.start_soon(self._run_probe, batch, epoch, probe_slots)

    async def _run_probe(self, keys: tuple[bytes, ...], epoch: int, probe_slots: anyio.Semaphore) -> None:
        try:
            present: Sequence[bool]
            try:
                with anyio.fail_after(self.lookup_timeout_s):
                    present = await self.contains(list(keys))
                if len(present) != len(keys):
                    raise ValueError(f"contains() returned {len(present)} answers for {len(keys)} keys")
            except TimeoutError:
                self._tier_counters.count_failure("lookup", "timeout")
                present = [False] * len(keys)
            except Exception as exc:
                reason = failure_reason(exc)
                self._tier_counters.count_failure("lookup", reason)
                if reason == "internal":
                    logger.error("tier %s: contains() failed", self.label, exc_info=exc)
                present = [False] * len(keys)
            for key, hit in zip(keys, present):
                self._verdicts.set((key,), bool(hit), probe_epoch=epoch)
            self._probes_in_flight.difference_update(keys)
            self.notify_manager()
        finally:
            probe_slots.release()

    # --- jobs ----------------------------------------------------------------------------------
    def submit_store(self, job: TransferJob) -> None:
        """Queue a store (host slots → tier). Never blocks.

        With the store queue full (``queue_size`` jobs) the job is rejected at once: a failed
        result with ``failure_reason="queue_full"`` is posted (and counted in ``rejected_jobs``);
        after :meth:`aclose` it fails with ``"closed"``. Either way the result is reported
        exactly once by :meth:`get_finished_jobs`; the manager unpins the slots then.
        """
        self._submit(job, "store", self._store_send)

    def submit_load(self, job: TransferJob) -> None:
        """Queue a promotion (tier → host slots). Never blocks; rejection as :meth:`submit_store`."""
        self._submit(job, "load", self._load_send)

    def _submit(self, job: TransferJob, direction: str, send: MemoryObjectSendStream[JobHandle]) -> None:
        record = self.open_job(job)
        if len(job.keys) != len(job.slot_ids):
            logger.error("tier %s: job %s has %d keys but %d slots", self.label, job.job_id,
                         len(job.keys), len(job.slot_ids))
            self.fail_job(record, "internal")
            return
        if self._tier_closing:
            self.fail_job(record, "closed")
            return
        try:
            send.send_nowait(record)
        except anyio.WouldBlock:
            self._tier_counters.count_rejected()
            self.fail_job(record, "queue_full")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.fail_job(record, "closed")

    def get_finished_jobs(self) -> list[JobResult]:
        """Every job finished since the last call, each exactly once. Never waits."""
        results: list[JobResult] = []
        while True:
            try:
                results.append(self._result_recv.receive_nowait())
            except anyio.WouldBlock:
                return results

    def _remember_stored(self, keys: list[bytes]) -> None:
        # The runner's report of chunks a store job wrote: lookups hit them without probing.
        self._verdicts.set(keys, True)

    # --- jobs a subclass runs itself ------------------------------------------------------------
    # A tier that moves whole jobs its own way (overriding submit_store/submit_load, or taking
    # store jobs from ParentManager.create_store_job) opens each job here and reports it with
    # succeed_job or fail_job. The framework keeps its promises for such jobs too: each is
    # reported exactly once, counted in the statistics, and failed "cancelled" if still open
    # when the tier stops.
    def open_job(self, job: TransferJob) -> JobHandle:
        """For subclasses: register ``job`` as unfinished and return its handle.

        The job counts as pending work (:meth:`drain` waits for it) until it is reported.
        """
        handle = JobHandle(job, "load" if job.is_promotion else "store")
        if not self._unfinished:
            self._idle_event = anyio.Event()
        self._unfinished[id(handle)] = handle
        return handle

    def succeed_job(self, handle: JobHandle, *, elapsed: float, nbytes: int) -> None:
        """For subclasses: report an open job done; a job already reported is left as it was.

        ``elapsed`` and ``nbytes`` become the result's ``transfer_time`` and ``transfer_bytes``
        (the byte statistics are :meth:`record_transfer`'s business).
        """
        job = handle.job
        self._post(handle, JobResult(job_id=job.job_id, success=True, is_promotion=job.is_promotion,
                                     transfer_time=elapsed, transfer_bytes=nbytes))

    def fail_job(self, handle: JobHandle, reason: str) -> None:
        """For subclasses (and the framework): report an open job failed with ``reason``.

        A job already reported is left as it was, so a fallback ``fail_job`` after a possible
        report is safe.
        """
        job = handle.job
        self._post(handle, JobResult(
            job_id=job.job_id,
            success=False,
            is_promotion=job.is_promotion,
            successful_keys=None,
            transfer_time=0.0,
            transfer_bytes=0,
            failure_reason=reason,
        ))

    def record_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """Count ``nbytes`` moved in ``seconds``: ``"load"`` tier → host, ``"store"`` host → tier.

        The framework calls it for the jobs it runs; a subclass calls it for bytes it moves itself.
        """
        self._tier_counters.record_transfer(direction, nbytes, seconds)

    @property
    def has_open_jobs(self) -> bool:
        """True while a job is submitted or opened and not yet reported."""
        return bool(self._unfinished)

    @property
    def closing(self) -> bool:
        """True once :meth:`aclose` was called or :meth:`run` is on its way out."""
        return self._tier_closing

    def _post(self, record: JobHandle, result: JobResult) -> None:
        """Report ``record`` once; a second report of the same job is ignored (exactly once)."""
        if self._unfinished.pop(id(record), None) is None:
            return
        self._tier_counters.job_reported(record.direction, result.success, result.failure_reason,
                                         time.monotonic() - record.job.submit_time)
        self._result_send.send_nowait(result)
        if not self._unfinished:
            self._idle_event.set()
        self.notify_manager()

    def _flush_unfinished(self, reason: str) -> None:
        for record in list(self._unfinished.values()):
            self.fail_job(record, reason)

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the tier, start its workers, report ready, and run until :meth:`aclose`.

        An exception from :meth:`open` (``ConfigError`` for a misconfiguration) propagates before
        ``task_status.started()``. On the way out (close or cancellation of the caller) every
        unfinished job is reported failed with ``"cancelled"`` and :meth:`close` runs shielded.
        """
        if self._run_started:
            raise RuntimeError(f"tier {self.label} is already running")
        self._run_started = True
        opened = False
        try:
            if self._tier_closing:  # closed before it ever ran: nothing to open
                task_status.started()
                return
            await self.open()
            opened = True
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._job_runner.dispatch, self._load_recv, self.max_concurrent_loads)
                tg.start_soon(self._job_runner.dispatch, self._store_recv, self.max_concurrent_stores)
                tg.start_soon(self._lookup_worker)
                task_status.started()
                await self._stop_requested.wait()
                tg.cancel_scope.cancel()
        finally:
            self._tier_closing = True
            with anyio.CancelScope(shield=True):
                # Workers are gone: whatever they held is reported now, exactly once.
                self._flush_unfinished("cancelled")
                self._probes_in_flight.clear()
                self._probe_batch.clear()
                if opened:
                    with anyio.move_on_after(self.close_timeout_s) as scope:
                        try:
                            await self.close()
                        except Exception:
                            logger.exception("tier %s: close() failed", self.label)
                    if scope.cancelled_caught:
                        logger.warning("tier %s: close() did not finish within %.1f s",
                                       self.label, self.close_timeout_s)
            self._run_done.set()

    async def aclose(self) -> None:
        """Stop the tier; idempotent.

        Later submits fail at once with ``"closed"``; queued and running jobs are cancelled and
        reported failed with ``"cancelled"`` (their results stay collectable); ``close()`` runs
        shielded; :meth:`run` returns. Cancellable I/O is cut short, so this returns promptly
        even with jobs stuck in slow I/O.
        """
        self._tier_closing = True
        for stream in (self._load_send, self._store_send, self._lookup_send):
            stream.close()
        if not self._run_started:
            self._flush_unfinished("cancelled")
            return
        self._stop_requested.set()
        await self._run_done.wait()

    async def drain(self) -> None:
        """Wait until no job is queued or running (new submits meanwhile are waited for too)."""
        while self._unfinished:
            await self._idle_event.wait()

    async def wait_scanned(self) -> None:
        """Return once the tier knows what its storage held at start-up (a tier that learns it
        in the background, like ``fs`` with its start-up scan, overrides this). Serving does not
        need it: until then a tier probes what it does not know."""

    # --- manager-facing no-ops -----------------------------------------------------------------
    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy:
        """A request starts: which of its chunks this tier wants (default: the ones it stores)."""
        return OffloadPolicy.CHUNK_LEVEL

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer requests that came from outside (a peer's lookups) through ``parent``.

        Called by the manager on every poll, on the loop thread, when the class declares
        :attr:`serves_external_requests`. ``parent`` is valid only during
        the call; it is the manager with this tier excluded (see :class:`ParentManager`).
        Default: nothing.
        """

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        """The manager used ``keys`` for a request (recency hint, with ``supports_touch``;
        default: nothing)."""

    def on_request_finished(self, ctx: RequestContext) -> None:
        """The request is done and all its cascades were submitted (default: nothing)."""

    def has_pending_work(self) -> bool:
        """True while a job is unfinished or a lookup probe is batched or in flight."""
        return bool(self._unfinished or self._probe_batch or self._probes_in_flight)

    def set_wakeup(self, cb: Callable[[], None] | None) -> None:
        """``cb()`` is called (loop thread) whenever a job result or a lookup verdict is posted."""
        self._wakeup = cb

    def set_removal_listener(self, cb: Callable[[Sequence[bytes]], None] | None) -> None:
        """``cb(keys)`` is called (loop thread) for every chunk the tier drops on its own.

        Whether or not events are enabled: a view of the tier kept elsewhere (the vLLM adapter's
        scheduler-side verdicts) stays truthful through it.
        """
        self._removal_listener = cb

    def notify_manager(self) -> None:
        """Call the wakeup callback (see :meth:`set_wakeup`): a result, a verdict or an external
        request is ready. The framework calls it for what it posts; subclasses for their own."""
        if self._wakeup is not None:
            try:
                self._wakeup()
            except Exception:
                logger.exception("tier %s: wakeup callback failed", self.label)

    # --- events --------------------------------------------------------------------------------
    @property
    def events_enabled(self) -> bool:
        """Events are emitted only with the global switch, the tier's switch and a medium."""
        return bool(self.context.kv_events_enabled and getattr(self.config, "enable_kv_events", False)
                    and self.medium is not None)

    def _make_event(self, keys: Sequence[bytes], removed: bool, reason: str | None) -> OffloadingEvent:
        locality = getattr(self.config, "locality", None)
        assert self.medium is not None
        return OffloadingEvent(
            keys=list(keys),
            medium=self.medium.value,
            removed=removed,
            locality=locality.value if locality is not None else None,
            ownership=self.label,
            reason=reason,
        )

    def emit_stored(self, keys: Sequence[bytes]) -> None:
        """Publish that the tier now holds ``keys`` (done automatically for successful stores)."""
        if self._reports_to is not None:
            self._reports_to.emit_stored(keys)
            return
        if keys and self.events_enabled:
            self._pending_events.append(self._make_event(keys, False, None))

    def emit_removed(self, keys: Sequence[bytes], reason: str) -> None:
        """The tier dropped ``keys`` (``"evicted"``, ``"deleted"``, ``"corrupt"``).

        Always invalidates their cached verdicts; publishes a removal event when events are on.
        """
        if not keys:
            return
        if self._reports_to is not None:
            self._reports_to.emit_removed(keys, reason)
            return
        self.mark_miss(keys)
        if self._removal_listener is not None:
            try:
                self._removal_listener(keys)
            except Exception:
                logger.exception("tier %s: removal listener failed", self.label)
        if self.events_enabled:
            self._pending_events.append(self._make_event(keys, True, reason))

    def report_to(self, outer: SecondaryTier) -> None:
        """For wrappers that run this tier's primitives inside their own jobs (``FaultyTier``):
        from now on, what this tier reports on its own (stored and removed chunks, evictions,
        usage, the metrics it declares) is reported by ``outer``; its metrics and usage so far
        move there too. ``ValueError`` if ``outer`` already declares one of its metric names.
        """
        self._tier_counters.move_metrics_to(outer._tier_counters, outer.label)
        outer.set_usage(self._tier_counters.bytes_used, self._tier_counters.capacity_bytes)
        self._reports_to = outer

    def take_events(self) -> list[OffloadingEvent]:
        """The events emitted since the last call, in order."""
        events, self._pending_events = self._pending_events, []
        return events

    # --- statistics ----------------------------------------------------------------------------
    def record_eviction(self, age_s: float) -> None:
        """Count one chunk evicted ``age_s`` seconds after it was stored."""
        if self._reports_to is not None:
            self._reports_to.record_eviction(age_s)
            return
        self._tier_counters.record_eviction(age_s)

    def set_usage(self, bytes_used: int | None, capacity_bytes: int | None) -> None:
        """Report the tier's occupancy (None = not accounted)."""
        if self._reports_to is not None:
            self._reports_to.set_usage(bytes_used, capacity_bytes)
            return
        self._tier_counters.set_usage(bytes_used, capacity_bytes)

    def add_metric(self, name: str, kind: str, documentation: str,
                   labels: Sequence[str] = ()) -> MetricFamily:
        """Declare a tier-specific metric; it appears in :meth:`statistics` and is exported.

        ``kvtier.metrics`` exports it as ``kvtier_tier_<name>`` with the ``tier`` label first, so
        name it after the tier type without a ``kvtier_`` prefix (``fs_rejected_chunks``).
        Raises ``ValueError`` for a bad name/kind or a name already declared by this tier.
        """
        if self._reports_to is not None:
            return self._reports_to.add_metric(name, kind, documentation, labels)
        return self._tier_counters.add_metric(name, kind, documentation, labels, self.label)

    def statistics(self) -> TierStatistics:
        """A frozen snapshot of the counters; later activity does not change it."""
        queued = self._load_send.statistics().current_buffer_used + \
            self._store_send.statistics().current_buffer_used
        return self._tier_counters.snapshot(self.label, self.tier_type, queued)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(label={self.label!r})"

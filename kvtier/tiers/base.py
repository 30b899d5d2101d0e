"""The one statement of what a secondary tier provides.

A secondary tier keeps chunk bytes somewhere slower and larger than host memory (a filesystem,
an object store, a peer). Every tier runs as **one anyio task group**: the manager-facing methods
(``lookup``, ``submit_store``, ``submit_load``, ``get_finished_jobs``) are synchronous,
NON-BLOCKING channel operations; worker tasks inside the tier's task group perform the I/O by
calling the few async primitives a tier author writes.

What a tier author writes (everything else is inherited)::

    class MyTier(SecondaryTier):
        tier_type = "mine"
        medium = Medium.STORAGE

        async def open(self) -> None: ...                      # connect / probe / scan
        async def close(self) -> None: ...                     # release what open() acquired
        async def contains(self, keys) -> Sequence[bool]: ...  # batched existence probe
        async def write(self, key, src: memoryview) -> None: ...
        async def read(self, key, dst: memoryview) -> None: ...
        async def delete(self, key) -> None: ...               # optional
        def known(self, key) -> bool | None: ...               # optional sync fast path

        # optional batch hooks: take a whole job at once instead of one call per chunk
        async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]: ...
        async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]: ...

Batch hooks: a tier whose I/O has a per-call cost worth amortising (a thread-pool hand-off per
chunk, a round trip) overrides ``write_many`` and/or ``read_many``; the framework then calls it
ONCE per job (per direction, independently) instead of ``write``/``read`` per chunk. ``items``
are ``(key, slot view)`` pairs in job order; the hook returns one entry per item, co-indexed:
``None`` for a chunk that succeeded, else the exception that chunk's ``write``/``read`` would
have raised (same mapping to reasons, same ``ChunkCorrupt`` handling). A chunk's failure must not
stop the others; the hook raises only for a failure of the whole batch (then every item fails
with that exception's reason) or for cancellation (it must then return only once no thread
touches the views any more). Everything else is unchanged: per-chunk results still drive
partial promotion (``successful_keys``), reasons and statistics; the same-key guarantee holds (a
batch never contains a key that another write — batched or not — is writing, and no key twice;
duplicates and busy keys wait for a later call); ``aclose`` cancels the call. Parallelism inside
a batch is the tier's business: ``max_concurrent_loads``/``max_concurrent_stores`` then bound
the number of *jobs* in flight, not chunks. The per-key ``write``/``read`` stay required (the
simple path, and what the base's default ``write_many``/``read_many`` fan out to).

Preconditions guaranteed by the framework:
  * ``src``/``dst`` are views of exactly one host slot (``slot_bytes`` long, page aligned), pinned
    by the manager for the whole job: nothing else writes ``src`` or reads ``dst`` meanwhile.
  * ``write``/``read`` of one job's chunks may run concurrently (bounded per direction by
    ``max_concurrent_stores`` / ``max_concurrent_loads``); the same key is never written twice
    at once by this process (``write`` and ``write_many`` alike).
  * ``open`` runs before any other primitive; ``close`` runs once, after every worker finished
    (shielded from cancellation, bounded by ``close_timeout_s``).
  * ``contains`` runs under ``anyio.fail_after(lookup_timeout_s)``; a timeout or an exception
    makes every key of the batch a MISS (counted under ``("lookup", reason)``).

What the implementation is responsible for:
  * ``read`` fills ``dst`` completely or raises; it never leaves unverified bytes in ``dst``
    that could be mistaken for a chunk (the framework treats a raise as a miss).
  * Raise :class:`ChunkNotFound` for an absent chunk, :class:`ChunkCorrupt` for bytes that fail
    verification (after removing them), :class:`TierIOError` with a ``reason`` for other
    failures. ``OSError`` is mapped to a reason by errno. Anything else is a bug: it fails the
    chunk, is counted under ``"internal"`` and logged with its traceback.
  * Primitives must be cancellable: ``aclose`` cancels running I/O and must return within a
    few seconds. Blocking libraries are called through ``anyio.to_thread.run_sync`` with the
    tier's own ``CapacityLimiter`` (never the default one), or through threads the tier owns
    and joins in ``close``.
  * Call :meth:`SecondaryTier.emit_removed` for every chunk the tier drops on its own (eviction,
    deletion) so events, verdicts and statistics stay truthful; :meth:`record_eviction` and
    :meth:`set_usage` feed the capacity statistics.

What the framework guarantees to the manager:
  * Every submitted job is reported EXACTLY ONCE by :meth:`SecondaryTier.get_finished_jobs`:
    completed, failed, rejected because the queue was full (``"queue_full"``), submitted after
    close (``"closed"``) or cut short by close (``"cancelled"``).
  * A failed load invalidates the cached positive verdict of every key that did not load, so a
    key whose promotion failed is never re-promoted from a stale verdict (vLLM #49176).
"""

from __future__ import annotations

import abc
import copy
import errno
import logging
import math
import re
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtier.context import RequestContext
from kvtier.stats import Histogram, HistogramSnapshot, MetricFamily
from kvtier.types import CacheHitSource, LookupResult, Medium, OffloadingEvent, OffloadPolicy

if TYPE_CHECKING:
    from kvtier.config import TierConfig
    from kvtier.layout import KVGeometry
    from kvtier.host.slots import SlotBuffer

__all__ = [
    "TierError",
    "ChunkNotFound",
    "ChunkCorrupt",
    "TierIOError",
    "failure_reason",
    "TierContext",
    "TransferJob",
    "JobResult",
    "TierStatistics",
    "SecondaryTier",
    "ParentManager",
    "EVICTION_AGE_BUCKETS",
]

logger = logging.getLogger(__name__)

#: Age of evicted chunks (seconds): from a minute to a day.
EVICTION_AGE_BUCKETS: tuple[float, ...] = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_METRIC_KINDS = frozenset({"counter", "gauge", "histogram"})


class ParentManager(abc.ABC):
    """What a tier may ask of the manager while serving an external request (reference §2.4).

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


# --- errors --------------------------------------------------------------------------------------
class TierError(Exception):
    """A chunk operation failed; ``reason`` is the short label counted in the statistics."""

    reason: str = "io_error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message or (reason or self.reason))
        if reason is not None:
            self.reason = reason


class ChunkNotFound(TierError):
    """The tier does not hold the chunk (reason ``"missing"``)."""

    reason = "missing"


class ChunkCorrupt(TierError):
    """The chunk's bytes failed verification; the tier removed them (reason ``"corrupt"``)."""

    reason = "corrupt"


class TierIOError(TierError):
    """Any other failure, with an explicit reason: ``"no_space"``, ``"permission"``,
    ``"io_error"``, ``"timeout"``, ``"throttled"``, …"""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message, reason=reason)


_ERRNO_REASONS: dict[int, str] = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
    errno.ENOENT: "missing",
    errno.EIO: "io_error",
}


def failure_reason(exc: BaseException) -> str:
    """The statistics label of a primitive's exception.

    :class:`TierError` → its ``reason``; ``TimeoutError`` → ``"timeout"`` (checked before
    ``OSError``, of which it is a subclass); ``OSError`` → by errno (ENOSPC/EDQUOT ``no_space``,
    EACCES/EPERM/EROFS ``permission``, ENOENT ``missing``, anything else ``io_error``); any other
    exception → ``"internal"`` (a bug in the tier).
    """
    if isinstance(exc, TierError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return _ERRNO_REASONS.get(exc.errno or 0, "io_error")
    return "internal"


# --- records -------------------------------------------------------------------------------------
@dataclass
class TierContext:
    """What the engine tells a tier about the run it serves."""

    index: int  # position in secondary_tiers (0-based)
    label: str  # "1:fs"
    slot_bytes: int
    host: SlotBuffer | None  # .view(slot_id); None only in pure-lookup tests
    geometry: KVGeometry | None
    blocks_per_chunk: int
    run_fields: Mapping[str, Any]  # for layout.namespace(); includes blocks_per_file
    rank: int = 0
    kv_events_enabled: bool = False  # global events switch (tier also needs enable_kv_events)
    self_describing_kv_events: bool = False
    hash_algorithm: str = "sha256"  # block hashing: p2p peers compare its NONE_HASH seed


@dataclass
class TransferJob:
    """One batch of chunks to move between host slots and a tier.

    ``is_promotion``: True = load (tier → host slots, already allocated by the manager), False =
    store/cascade (host slots → tier). ``slot_ids[i]`` is the host slot of ``keys[i]``; the
    manager keeps every slot pinned until the job's :class:`JobResult` is collected.
    ``submit_time`` is the creation stamp (``time.monotonic``) the job latency is measured from.
    """

    job_id: int
    keys: list[bytes]
    slot_ids: list[int]
    is_promotion: bool
    ctx: RequestContext | None = None
    submit_time: float = field(default_factory=time.monotonic)

    @property
    def chunk_ids(self) -> list[int]:
        """vLLM's name for :attr:`slot_ids`."""
        return self.slot_ids


@dataclass
class JobResult:
    """The outcome of one :class:`TransferJob`, reported exactly once.

    ``success`` is True only if every chunk succeeded. ``successful_keys`` is ``None`` when all
    keys share ``success``; for a partially failed promotion it lists the keys that did load (in
    job order, possibly empty). Stores never report a subset. ``transfer_bytes`` counts the
    succeeded chunks × ``slot_bytes``; ``transfer_time`` is the wall time of the job's I/O.
    """

    job_id: int
    success: bool
    is_promotion: bool
    successful_keys: list[bytes] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    failure_reason: str | None = None


@dataclass(frozen=True)
class TierStatistics:
    """A consistent snapshot of one tier's counters (read by ``kvtier.metrics``)."""

    label: str
    tier_type: str
    lookups: int  # resolved lookups (HIT or MISS), as vLLM's chunk_queries
    hits: int
    bytes_read: int  # tier → host (promotions)
    bytes_written: int  # host → tier (cascades)
    seconds_read: float
    seconds_written: float
    loads_in_flight: int
    stores_in_flight: int
    queued_jobs: int
    loads_completed: int
    stores_completed: int
    failures: Mapping[tuple[str, str], int]  # (direction "load"|"store"|"lookup", reason) -> count
    rejected_jobs: int  # rejected at submit because the queue was full
    evictions: int
    eviction_age: HistogramSnapshot
    load_latency: Mapping[str, HistogramSnapshot]  # "success"/"failure" -> job creation → completion
    store_latency: Mapping[str, HistogramSnapshot]
    bytes_used: int | None
    capacity_bytes: int | None
    custom_metrics: tuple[MetricFamily, ...]


@dataclass(eq=False)
class _JobRecord:
    """Framework bookkeeping of one submitted job (identity-compared)."""

    job: TransferJob
    direction: str  # "load" | "store"


@dataclass(slots=True)
class _Verdict:
    present: bool
    expires_at: float  # math.inf for positive verdicts
    epoch: int  # when it was set; newer facts win over older probes


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
        self._verdict_cache_size = verdict_cache_size
        self._max_concurrent_lookups = max_concurrent_lookups
        # Which directions the tier takes as whole jobs (see "Batch hooks" in the module doc).
        self._batched_writes = type(self).write_many is not SecondaryTier.write_many
        self._batched_reads = type(self).read_many is not SecondaryTier.read_many

        # Job channels: bounded, so a stalled tier pushes back instead of growing without limit.
        self._load_send: MemoryObjectSendStream[_JobRecord]
        self._load_recv: MemoryObjectReceiveStream[_JobRecord]
        self._store_send: MemoryObjectSendStream[_JobRecord]
        self._store_recv: MemoryObjectReceiveStream[_JobRecord]
        self._load_send, self._load_recv = anyio.create_memory_object_stream[_JobRecord](queue_size)
        self._store_send, self._store_recv = anyio.create_memory_object_stream[_JobRecord](queue_size)
        # Results are unbounded on purpose: a result must never be dropped or block a worker; its
        # size is bounded by the jobs outstanding since the manager's last drain.
        self._result_send, self._result_recv = anyio.create_memory_object_stream[JobResult](math.inf)
        # One lookup batch per step; a small buffer is plenty (a full one defers the batch).
        self._lookup_send, self._lookup_recv = anyio.create_memory_object_stream[
            tuple[tuple[bytes, ...], int]
        ](64)

        self._unfinished: dict[int, _JobRecord] = {}  # id(record) -> record, until reported
        self._keys_being_written: dict[bytes, anyio.Event] = {}  # keys being written now
        self._idle_event = anyio.Event()
        self._idle_event.set()
        self._wakeup: Callable[[], None] | None = None
        self._removal_listener: Callable[[Sequence[bytes]], None] | None = None
        self._pending_events: list[OffloadingEvent] = []

        self._verdicts: OrderedDict[bytes, _Verdict] = OrderedDict()
        self._verdict_clock: Callable[[], float] = time.monotonic  # verdict expiry clock (tests replace it)
        self._epoch = 0
        self._probe_batch: dict[bytes, None] = {}  # ordered set: this step's keys to probe
        self._probes_in_flight: set[bytes] = set()

        self._run_started = False
        self._tier_closing = False
        self._stop_requested = anyio.Event()
        self._run_done = anyio.Event()

        # statistics
        self._lookup_count = 0
        self._lookup_hits = 0
        self._read_bytes_total = 0
        self._written_bytes_total = 0
        self._read_seconds_total = 0.0
        self._written_seconds_total = 0.0
        self._jobs_running = {"load": 0, "store": 0}
        self._jobs_completed = {"load": 0, "store": 0}
        self._failure_counts: dict[tuple[str, str], int] = {}
        self._rejected_jobs = 0
        self._eviction_count = 0
        self._eviction_age_hist = Histogram(EVICTION_AGE_BUCKETS)
        self._job_latency = {
            (direction, outcome): Histogram()
            for direction in ("load", "store")
            for outcome in ("success", "failure")
        }
        self._usage_bytes: int | None = None
        self._usage_capacity: int | None = None
        self._metric_families: dict[str, MetricFamily] = {}

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
        """Remove ``key`` (optional; the framework never calls it on the serving path)."""
        raise NotImplementedError(f"tier type {self.tier_type!r} does not support delete")

    def known(self, key: bytes) -> bool | None:
        """Synchronous fast path of :meth:`lookup`: True/False if answerable now, else None."""
        return None

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        """Write a whole job's chunks; per item ``None`` or the chunk's exception (optional hook).

        Overriding it makes the framework call it once per store job instead of :meth:`write`
        per chunk (see "Batch hooks" in the module docstring). This default runs :meth:`write`
        for every item concurrently.
        """
        return await self._fan_out(self.write, items)

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        """Read a whole job's chunks; per item ``None`` or the chunk's exception (optional hook).

        Overriding it makes the framework call it once per load job instead of :meth:`read` per
        chunk. This default runs :meth:`read` for every item concurrently.
        """
        return await self._fan_out(self.read, items)

    @staticmethod
    async def _fan_out(primitive: Callable[[bytes, memoryview], Any],
                       items: Sequence[tuple[bytes, memoryview]]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(items)

        async def one(i: int, key: bytes, view: memoryview) -> None:
            try:
                await primitive(key, view)
            except Exception as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            for i, (key, view) in enumerate(items):
                tg.start_soon(one, i, key, view)
        return outcomes

    # --- lookups -------------------------------------------------------------------------------
    def lookup(self, key: bytes, ctx: RequestContext | None = None) -> LookupResult:
        """HIT / MISS now, or RETRY while an asynchronous probe is outstanding. Never blocks.

        Answers from (1) the verdict cache (positive verdicts until invalidated, negative ones for
        ``negative_ttl_s``), (2) :meth:`known`, else (3) adds ``key`` to this step's probe batch
        (sent by :meth:`on_schedule_end`; a key already being probed is not probed twice) and
        answers RETRY. Only resolved answers are counted in ``lookups``/``hits``. After close,
        unknown keys are a MISS (a RETRY would stall the caller forever).
        """
        verdict = self._verdicts.get(key)
        if verdict is not None:
            if verdict.expires_at > self._verdict_clock():
                self._verdicts.move_to_end(key)
                return self._count_lookup(verdict.present, key, ctx)
            del self._verdicts[key]
        present = self.known(key)
        if present is not None:
            return self._count_lookup(present, key, ctx)
        if self._tier_closing:
            return self._count_lookup(False, key, ctx)
        if key not in self._probes_in_flight:
            self._probe_batch[key] = None
        return LookupResult.RETRY

    def _count_lookup(self, present: bool, key: bytes, ctx: RequestContext | None) -> LookupResult:
        # Resolved lookups count once per (request, key), as vLLM's chunk_queries/chunk_hits.
        if ctx is None or ctx.first_lookup(self.label, key):
            self._lookup_count += 1
            self._lookup_hits += present
        return LookupResult.HIT if present else LookupResult.MISS

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        """Force MISS verdicts for ``keys`` (for ``negative_ttl_s``); a probe sent later wins."""
        self._set_verdicts(keys, False)

    def _set_verdicts(self, keys: Iterable[bytes], present: bool, *, probe_epoch: int | None = None) -> None:
        expires = math.inf if present else self._verdict_clock() + self.negative_ttl_s
        for key in keys:
            current = self._verdicts.get(key)
            if probe_epoch is not None and current is not None and current.epoch > probe_epoch:
                continue  # a store or failed load since the probe was sent knows better
            self._epoch += 1
            self._verdicts[key] = _Verdict(present, expires, self._epoch)
            self._verdicts.move_to_end(key)
        while len(self._verdicts) > self._verdict_cache_size:
            self._verdicts.popitem(last=False)

    def on_schedule_end(self) -> None:
        """End of a scheduler step: send this step's probe batch as ONE item to the lookup worker.

        If the lookup channel is full the batch is kept and sent at the next step.
        """
        if not self._probe_batch or self._tier_closing:
            return
        batch = tuple(self._probe_batch)
        try:
            self._lookup_send.send_nowait((batch, self._epoch))
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
                self._count_failure("lookup", "timeout")
                present = [False] * len(keys)
            except Exception as exc:
                reason = failure_reason(exc)
                self._count_failure("lookup", reason)
                if reason == "internal":
                    logger.error("tier %s: contains() failed", self.label, exc_info=exc)
                present = [False] * len(keys)
            for key, hit in zip(keys, present):
                self._set_verdicts((key,), bool(hit), probe_epoch=epoch)
            self._probes_in_flight.difference_update(keys)
            self._notify()
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

    def _submit(self, job: TransferJob, direction: str, send: MemoryObjectSendStream[_JobRecord]) -> None:
        record = _JobRecord(job, direction)
        self._register(record)
        if len(job.keys) != len(job.slot_ids):
            logger.error("tier %s: job %s has %d keys but %d slots", self.label, job.job_id,
                         len(job.keys), len(job.slot_ids))
            self._fail(record, "internal")
            return
        if self._tier_closing:
            self._fail(record, "closed")
            return
        try:
            send.send_nowait(record)
        except anyio.WouldBlock:
            self._rejected_jobs += 1
            self._fail(record, "queue_full")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._fail(record, "closed")

    def _register(self, record: _JobRecord) -> None:
        if not self._unfinished:
            self._idle_event = anyio.Event()
        self._unfinished[id(record)] = record

    def get_finished_jobs(self) -> list[JobResult]:
        """Every job finished since the last call, each exactly once. Never waits."""
        results: list[JobResult] = []
        while True:
            try:
                results.append(self._result_recv.receive_nowait())
            except anyio.WouldBlock:
                return results

    async def _dispatch(self, receive: MemoryObjectReceiveStream[_JobRecord], width: int) -> None:
        # ``width`` runners share the queue: a job leaves it only when a runner is free, so a slow
        # tier keeps its queue (and the queue_full back-pressure) meaningful instead of hoarding
        # running tasks — and no task is spawned per job.
        chunk_limiter = anyio.CapacityLimiter(width)
        async with anyio.create_task_group() as tg:
            for _ in range(width):
                tg.start_soon(self._run_jobs, receive, chunk_limiter)

    async def _run_jobs(self, receive: MemoryObjectReceiveStream[_JobRecord], limiter: anyio.CapacityLimiter) -> None:
        async for record in receive:
            await self._run_job(record, limiter)

    async def _run_job(self, record: _JobRecord, limiter: anyio.CapacityLimiter) -> None:
        job = record.job
        self._jobs_running[record.direction] += 1
        reasons: list[str | None] = [None] * len(job.keys)
        started = time.monotonic()
        try:
            if self._batched_reads if job.is_promotion else self._batched_writes:
                await self._run_batched(record, reasons)
            else:
                async with anyio.create_task_group() as tg:
                    for i in range(len(job.keys)):
                        tg.start_soon(self._run_chunk, record, i, reasons, limiter)
            self._complete(record, reasons, time.monotonic() - started)
        finally:
            self._jobs_running[record.direction] -= 1

    async def _run_chunk(self, record: _JobRecord, i: int, reasons: list[str | None], limiter: anyio.CapacityLimiter) -> None:
        job = record.job
        key = job.keys[i]
        try:
            async with limiter:
                host = self.context.host
                if host is None:
                    raise TierIOError("internal", "tier has no host buffer")
                view = host.view(job.slot_ids[i])
                if job.is_promotion:
                    await self.read(key, view)
                else:
                    await self._write_exclusive(key, view)
        except Exception as exc:
            self._chunk_failed(record, i, exc, reasons)

    def _chunk_failed(self, record: _JobRecord, i: int, exc: BaseException, reasons: list[str | None]) -> None:
        key = record.job.keys[i]
        reason = failure_reason(exc)
        reasons[i] = reason
        if reason == "internal":
            logger.error("tier %s: %s of chunk %s failed", self.label, record.direction,
                         key.hex()[:16], exc_info=exc)
        elif isinstance(exc, ChunkCorrupt):
            self.emit_removed([key], "corrupt")

    async def _run_batched(self, record: _JobRecord, reasons: list[str | None]) -> None:
        """One job through the tier's ``read_many``/``write_many`` (same guarantees as per chunk)."""
        job = record.job
        host = self.context.host
        if host is None:
            for i in range(len(job.keys)):
                self._chunk_failed(record, i, TierIOError("internal", "tier has no host buffer"), reasons)
            return
        try:
            views = host.views(job.slot_ids)
            pending = list(range(len(views)))
        except Exception:  # a bad slot id fails its chunk only, as on the per-chunk path
            views, pending = [], []
            for i, slot_id in enumerate(job.slot_ids):
                try:
                    views.append(host.view(slot_id))
                    pending.append(i)
                except Exception as exc:
                    views.append(memoryview(b""))
                    self._chunk_failed(record, i, exc, reasons)
        if job.is_promotion:
            if pending:
                await self._call_batch(record, self.read_many, pending, views, reasons)
            return
        # One writer per key: claim the job's free keys and write them as one batch; keys another
        # job is writing (or repeated in this job) wait for the next round.
        while pending:
            ready: list[int] = []
            waiting: list[int] = []
            claimed: dict[bytes, anyio.Event] = {}
            for i in pending:
                key = job.keys[i]
                if key in claimed or key in self._keys_being_written:
                    waiting.append(i)
                else:
                    claimed[key] = self._keys_being_written[key] = anyio.Event()
                    ready.append(i)
            if ready:
                try:
                    await self._call_batch(record, self.write_many, ready, views, reasons)
                finally:
                    for key, done in claimed.items():
                        del self._keys_being_written[key]
                        done.set()
            else:
                busy = self._keys_being_written.get(job.keys[waiting[0]])
                if busy is not None:
                    await busy.wait()
            pending = waiting

    async def _call_batch(
        self,
        record: _JobRecord,
        hook: Callable[[Sequence[tuple[bytes, memoryview]]], Any],
        indices: list[int],
        views: list[memoryview],
        reasons: list[str | None],
    ) -> None:
        keys = record.job.keys
        outcomes: Sequence[BaseException | None]
        try:
            outcomes = await hook([(keys[i], views[i]) for i in indices])
            if len(outcomes) != len(indices):
                raise ValueError(f"{hook.__name__}() returned {len(outcomes)} outcomes for {len(indices)} chunks")
        except Exception as exc:  # the whole batch failed
            outcomes = [exc] * len(indices)
        for i, outcome in zip(indices, outcomes):
            if outcome is not None:
                self._chunk_failed(record, i, outcome, reasons)

    async def _write_exclusive(self, key: bytes, src: memoryview) -> None:
        # The manager may cascade the same key in two jobs at once (vLLM cascades every key
        # offered to complete_store); tiers are promised one writer per key, so wait our turn.
        while (busy := self._keys_being_written.get(key)) is not None:
            await busy.wait()
        done = self._keys_being_written[key] = anyio.Event()
        try:
            await self.write(key, src)
        finally:
            del self._keys_being_written[key]
            done.set()

    def _complete(self, record: _JobRecord, reasons: list[str | None], elapsed: float) -> None:
        job = record.job
        ok_keys = [key for key, reason in zip(job.keys, reasons) if reason is None]
        failed = next((reason for reason in reasons if reason is not None), None)
        nbytes = len(ok_keys) * self.context.slot_bytes
        if job.is_promotion:
            self._read_bytes_total += nbytes
            self._read_seconds_total += elapsed
            if failed is not None:
                # Never re-promote a key whose load failed from a stale positive verdict.
                self.mark_miss(key for key, reason in zip(job.keys, reasons) if reason is not None)
        else:
            self._written_bytes_total += nbytes
            self._written_seconds_total += elapsed
            # Chunks that were written exist even if a sibling failed; a tier that can answer
            # synchronously (known) may already have dropped them again (eviction).
            stored = [key for key in ok_keys if self.known(key) is not False]
            self._set_verdicts(stored, True)
            if stored:
                self.emit_stored(stored)
        result = JobResult(
            job_id=job.job_id,
            success=failed is None,
            is_promotion=job.is_promotion,
            successful_keys=ok_keys if (failed is not None and job.is_promotion) else None,
            transfer_time=elapsed,
            transfer_bytes=nbytes,
            failure_reason=failed,
        )
        self._post(record, result)

    def _fail(self, record: _JobRecord, reason: str) -> None:
        job = record.job
        self._post(record, JobResult(
            job_id=job.job_id,
            success=False,
            is_promotion=job.is_promotion,
            successful_keys=None,
            transfer_time=0.0,
            transfer_bytes=0,
            failure_reason=reason,
        ))

    def _post(self, record: _JobRecord, result: JobResult) -> None:
        """Report ``record`` once; a second report of the same job is ignored (exactly once)."""
        if self._unfinished.pop(id(record), None) is None:
            return
        direction = record.direction
        outcome = "success" if result.success else "failure"
        self._job_latency[(direction, outcome)].observe(max(0.0, time.monotonic() - record.job.submit_time))
        if result.success:
            self._jobs_completed[direction] += 1
        else:
            self._count_failure(direction, result.failure_reason or "internal")
        self._result_send.send_nowait(result)
        if not self._unfinished:
            self._idle_event.set()
        self._notify()

    def _count_failure(self, direction: str, reason: str) -> None:
        self._failure_counts[(direction, reason)] = self._failure_counts.get((direction, reason), 0) + 1

    def _flush_unfinished(self, reason: str) -> None:
        for record in list(self._unfinished.values()):
            self._fail(record, reason)

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
                tg.start_soon(self._dispatch, self._load_recv, self.max_concurrent_loads)
                tg.start_soon(self._dispatch, self._store_recv, self.max_concurrent_stores)
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

        Called by the manager on every poll, on the loop thread. ``parent`` is valid only during
        the call; it is the manager with this tier excluded (see :class:`ParentManager`).
        Default: nothing.
        """

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        """The manager used ``keys`` for a request (recency hint; default: nothing)."""

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

    def _notify(self) -> None:
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
        if keys and self.events_enabled:
            self._pending_events.append(self._make_event(keys, False, None))

    def emit_removed(self, keys: Sequence[bytes], reason: str) -> None:
        """The tier dropped ``keys`` (``"evicted"``, ``"deleted"``, ``"corrupt"``).

        Always invalidates their cached verdicts; publishes a removal event when events are on.
        """
        if not keys:
            return
        self.mark_miss(keys)
        if self._removal_listener is not None:
            try:
                self._removal_listener(keys)
            except Exception:
                logger.exception("tier %s: removal listener failed", self.label)
        if self.events_enabled:
            self._pending_events.append(self._make_event(keys, True, reason))

    def take_events(self) -> list[OffloadingEvent]:
        """The events emitted since the last call, in order."""
        events, self._pending_events = self._pending_events, []
        return events

    # --- statistics ----------------------------------------------------------------------------
    def record_eviction(self, age_s: float) -> None:
        """Count one chunk evicted ``age_s`` seconds after it was stored."""
        self._eviction_count += 1
        self._eviction_age_hist.observe(max(0.0, age_s))

    def set_usage(self, bytes_used: int | None, capacity_bytes: int | None) -> None:
        """Report the tier's occupancy (None = not accounted)."""
        self._usage_bytes = bytes_used
        self._usage_capacity = capacity_bytes

    def add_metric(self, name: str, kind: str, documentation: str,
                   labels: Sequence[str] = ()) -> MetricFamily:
        """Declare a tier-specific metric; it appears in :meth:`statistics` and is exported.

        ``kvtier.metrics`` exports it as ``kvtier_tier_<name>`` with the ``tier`` label first, so
        name it after the tier type without a ``kvtier_`` prefix (``fs_rejected_chunks``).
        Raises ``ValueError`` for a bad name/kind or a name already declared by this tier.
        """
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        if kind not in _METRIC_KINDS:
            raise ValueError(f"metric kind must be one of {sorted(_METRIC_KINDS)}, got {kind!r}")
        if name in self._metric_families:
            raise ValueError(f"metric {name!r} is already declared by tier {self.label}")
        family = MetricFamily(name, kind, documentation, tuple(labels))
        self._metric_families[name] = family
        return family

    def statistics(self) -> TierStatistics:
        """A frozen snapshot of the counters; later activity does not change it."""
        queued = self._load_send.statistics().current_buffer_used + \
            self._store_send.statistics().current_buffer_used
        return TierStatistics(
            label=self.label,
            tier_type=self.tier_type,
            lookups=self._lookup_count,
            hits=self._lookup_hits,
            bytes_read=self._read_bytes_total,
            bytes_written=self._written_bytes_total,
            seconds_read=self._read_seconds_total,
            seconds_written=self._written_seconds_total,
            loads_in_flight=self._jobs_running["load"],
            stores_in_flight=self._jobs_running["store"],
            queued_jobs=queued,
            loads_completed=self._jobs_completed["load"],
            stores_completed=self._jobs_completed["store"],
            failures=types.MappingProxyType(dict(self._failure_counts)),
            rejected_jobs=self._rejected_jobs,
            evictions=self._eviction_count,
            eviction_age=self._eviction_age_hist.snapshot(),
            load_latency=types.MappingProxyType({
                outcome: self._job_latency[("load", outcome)].snapshot() for outcome in ("success", "failure")
            }),
            store_latency=types.MappingProxyType({
                outcome: self._job_latency[("store", outcome)].snapshot() for outcome in ("success", "failure")
            }),
            bytes_used=self._usage_bytes,
            capacity_bytes=self._usage_capacity,
            custom_metrics=tuple(copy.deepcopy(list(self._metric_families.values()))),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(label={self.label!r})"

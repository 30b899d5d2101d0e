"""kvtier's fs, obj and memory tiers as vLLM ``SecondaryTierManager``s.

vLLM builds a secondary tier as ``cls(offloading_spec=, primary_kv_view=, tier_type=,
backpressure_detector=, **the rest of the tier dict)`` and calls it from its scheduler thread,
under the manager lock, expecting every call but ``drain_jobs`` and ``shutdown`` to return at
once. A kvtier tier lives on the process's :class:`~kvtier.integrations.vllm.loop.LoopThread`
and is only ever touched from there. Between the two sits a *scheduler-side view*:

* **Lookups** answer from the view's verdicts. An unknown key answers ``RETRY`` and joins this
  step's probe batch; ``on_schedule_end`` hands the batch to the loop, which asks the tier (its
  index, or a probe of slow storage) and posts each verdict back. A verdict always comes back
  within the tier's ``lookup_timeout_s``; a key still unanswered after that reads as a MISS, so a
  request never waits forever.
* **Jobs**, touches and probes are queued on the scheduler side and handed to the loop in one
  ``loop.call_soon_threadsafe`` per step, at ``on_schedule_end`` (waking the loop per call would
  cost the scheduler thread the GIL each time); ``drain_jobs`` and ``shutdown`` hand over what is
  queued first. Results come back, exactly once, through the same inbox as the verdicts, in the
  order the loop saw them.
* **Removals** the tier makes on its own (eviction under ``max_bytes``, a corrupt file) reach the
  view through the tier's removal listener, so a key the tier dropped answers MISS at the next
  lookup. What another process removes is learnt at the first failed promotion (the tier then
  reports the key missing and the view forgets it): a stale HIT costs one failed promotion, never
  wrong bytes — kvtier checks every chunk's trailer before it reaches the primary rows.

The run's namespace is vLLM's own (:class:`~vllm.v1.kv_offload.file_mapper.FileMapper`), plus the
compatibility manifest of the top-level ``model_revision`` and ``namespace_tag`` keys of
``kv_connector_extra_config`` where they are set (:func:`kvtier.layout.with_manifest`). vLLM's own
model revision is not read: without those keys the namespace is exactly vLLM's.

The inbox is one ``collections.deque`` (appends and pops are atomic); the loop thread appends, the
scheduler side pops. Nothing else is shared between the threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult, SecondaryTierManager, TransferJob

from kvtier.config import TierConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.loop import HostedTask, LoopThread
from kvtier.layout import with_manifest
from kvtier.tiers import base as kbase
from kvtier.tiers.factory import SecondaryTierFactory as KvtierTierFactory
from kvtier.types import LookupResult as KvtierLookup

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvtierFsTier", "KvtierObjTier", "KvtierMemoryTier", "PrimaryRows"]

logger = logging.getLogger(__name__)

#: Keys whose verdicts the scheduler-side view remembers (oldest forgotten first).
_MAX_VERDICTS = 1 << 20
#: Margin over the tier's lookup_timeout_s before an unanswered key reads as a MISS.
_ANSWER_GRACE_S = 1.0
#: How often the statistics snapshot is refreshed on the loop (seconds).
_STATS_PERIOD_S = 0.25

_TIER_KEYS_VLLM_POPS = ("type", "module_path", "backpressure")

# vLLM does not tell a tier its position; each spec's positions are handed out once.
_claimed_positions: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_claim_lock = threading.Lock()


def _claim_position(spec: Any, tier_type: str, kwargs: dict[str, Any]) -> int:
    """This tier's index in ``secondary_tiers``: the first unclaimed entry that built it."""
    entries = getattr(spec, "secondary_tier_configs", None)
    with _claim_lock:
        try:
            claimed = _claimed_positions.setdefault(spec, set())
        except TypeError:  # a spec that cannot be weakly referenced: no memory across tiers
            claimed = set()
        if isinstance(entries, list):
            for i, entry in enumerate(entries):
                if i in claimed or not isinstance(entry, dict) or entry.get("type") != tier_type:
                    continue
                rest = {k: v for k, v in entry.items() if k not in _TIER_KEYS_VLLM_POPS}
                if rest == kwargs:
                    claimed.add(i)
                    return i
        position = len(claimed)
        claimed.add(position)
        return position


def _run_fields(vllm_fields: dict[str, Any], spec: Any) -> dict[str, Any]:
    """vLLM's run fields with the manifest of ``kv_connector_extra_config`` (the same top-level
    keys as :func:`kvtier.open`'s configuration); exactly vLLM's where neither key is set."""
    extra = getattr(spec, "extra_config", None)
    if not isinstance(extra, dict):
        return vllm_fields
    return with_manifest(vllm_fields, model_revision=extra.get("model_revision"),
                         namespace_tag=extra.get("namespace_tag"))


class PrimaryRows:
    """vLLM's primary KV view as kvtier's host buffer: one writable ``memoryview`` per slot.

    ``primary_kv_view`` has shape ``(num_chunks, row_stride)``; kvtier's tiers read and write a
    whole row, as vLLM's own tiers do. :meth:`release` drops the flat view, so vLLM can close its
    shared mapping once the tier is shut down.
    """

    def __init__(self, primary_kv_view: memoryview) -> None:
        if primary_kv_view.readonly:
            raise ValueError("the primary KV view must be writable")
        if primary_kv_view.ndim != 2 or not primary_kv_view.c_contiguous:
            raise ValueError(
                f"the primary KV view must be a C-contiguous (num_chunks, row_stride) view, "
                f"got shape {primary_kv_view.shape}"
            )
        shape, strides = primary_kv_view.shape, primary_kv_view.strides
        assert shape is not None and strides is not None
        self.num_slots, self.slot_bytes = shape[0], strides[0]
        self._flat: memoryview | None = primary_kv_view.cast("B")

    def view(self, slot_id: int) -> memoryview:
        return self.views([slot_id])[0]

    def views(self, slot_ids: Sequence[int]) -> list[memoryview]:
        flat, n = self._flat, self.slot_bytes
        if flat is None:
            raise RuntimeError("the primary KV view was released")
        if slot_ids and not (0 <= min(slot_ids) and max(slot_ids) < self.num_slots):
            bad = next(s for s in slot_ids if not 0 <= s < self.num_slots)
            raise IndexError(f"slot {bad} out of range [0, {self.num_slots})")
        return [flat[s * n : (s + 1) * n] for s in slot_ids]

    def release(self) -> None:
        if self._flat is not None:
            self._flat.release()
            self._flat = None


def _run_all(calls: list[tuple[Any, tuple[Any, ...]]]) -> None:
    """On the loop: run a step's hand-offs in order; one failing call does not stop the rest."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:
            logger.exception("kvtier: a call handed to the event loop failed")


class _KvtierTier(SecondaryTierManager):
    """The adapter proper; the public subclasses only name the kvtier tier type they wrap."""

    #: The kvtier tier type this class wraps (``"fs"``, ``"obj"``, ``"memory"``).
    kvtier_type: ClassVar[str] = ""
    #: True when this process sees every change of the tier (an in-process tier): a key the view
    #: has no verdict for is then a MISS at once, with no probe round trip.
    view_is_complete: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **tier_config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._closed = False
        self.index = _claim_position(offloading_spec, tier_type, tier_config)
        self.label = f"{self.index + 1}:{tier_type}"
        # kvtier's validation: a bad key fails vLLM's start-up with kvtier's ConfigError.
        config = TierConfig.from_dict({**tier_config, "type": self.kvtier_type}, self.index)
        if config.write_policy != "write_through":
            # vLLM's own tiering manager cascades every stored chunk: the key would do nothing.
            raise ConfigError(f"secondary_tiers[{self.index}].write_policy: {config.write_policy!r} is not "
                              "available inside vLLM (its manager writes every chunk through); use write_through")
        extra = getattr(offloading_spec, "extra_config", None)
        if config.options.get("tenant_bytes") is not None or (
                isinstance(extra, dict) and extra.get("tenant_cpu_bytes") is not None):
            # vLLM's manager owns host memory and hands tiers no request: no budget could act.
            key = "tenant_bytes" if config.options.get("tenant_bytes") is not None else "tenant_cpu_bytes"
            where = f"secondary_tiers[{self.index}].tenant_bytes" if key == "tenant_bytes" else key
            raise ConfigError(f"{where}: tenant quotas are not available inside vLLM (its manager owns host memory "
                              "and passes tiers no request to charge); use them with kvtier.open")
        self.locality = Locality(config.locality.value) if config.locality is not None else None
        events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if config.enable_kv_events and not events_on:
            logger.warning(
                "secondary tier %s: enable_kv_events is set but KV cache events are disabled "
                "globally; the tier will not emit events", self.label,
            )
        # The run's namespace exactly as vLLM's own fs tier derives it (absolute model paths too).
        mapper = FileMapper.from_offloading_spec(
            root_dir="", offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True,
        )
        self._rows = PrimaryRows(primary_kv_view)
        self._context = kbase.TierContext(
            index=self.index,
            label=self.label,
            slot_bytes=self._rows.slot_bytes,
            host=self._rows,  # type: ignore[arg-type]  # duck-typed: view()/views()
            geometry=None,
            blocks_per_chunk=offloading_spec.blocks_per_chunk,
            run_fields=_run_fields(mapper.get_run_config(), offloading_spec),
            rank=mapper.rank,
            kv_events_enabled=events_on,
            self_describing_kv_events=bool(offloading_spec.kv_events_config.self_describing_kv_events),
        )
        self._config = config

        # Scheduler-side view (touched only by vLLM's calls, under its manager lock).
        self._verdicts: dict[bytes, bool | float] = {}  # True, or the expiry of a MISS
        self._asked: dict[bytes, float] = {}  # key -> when an unanswered probe reads as MISS
        self._batch: list[bytes] = []
        self._jobs: dict[int, tuple[list[bytes], bool]] = {}  # job id -> (keys, is_promotion)
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats: kbase.TierStatistics | None = None  # latest snapshot, set by the loop
        self._stats_reported: kbase.TierStatistics | None = None
        self._stats_due = 0.0
        # The one channel from the loop thread: ("verdict", key, present) | ("removed", keys)
        # | ("result", kvtier JobResult, keys still held) | ("events", [kvtier events]).
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()

        self._outbox: list[tuple[Any, tuple[Any, ...]]] = []  # calls for the loop, sent per step

        # Loop-side state (touched only on the loop thread).
        self._waiting: set[bytes] = set()
        self._loop_jobs: dict[int, list[bytes]] = {}  # store job id -> keys, until its result
        self._pump_scheduled = False
        self._hosted: HostedTask | None = None

        self._tier: kbase.SecondaryTier
        self._loop = LoopThread.acquire()
        try:
            self._loop.call(self._start_on_loop)
        except BaseException:
            self._rows.release()
            self._loop.release()
            self._closed = True
            raise
        self._negative_ttl_s = self._tier.negative_ttl_s
        self._answer_within_s = self._tier.lookup_timeout_s + _ANSWER_GRACE_S
        self._forwards_touch = self._tier.supports_touch  # a tier that ignores touches is not woken for them

    # --- loop side -------------------------------------------------------------------------
    async def _start_on_loop(self) -> kbase.SecondaryTier:
        tier = self._tier = KvtierTierFactory.create(self._config, self._context)
        tier.set_wakeup(self._wake)
        tier.set_removal_listener(self._removed)
        self._loop_handle = asyncio.get_running_loop()
        self._hosted = await self._loop.host(tier.run)
        return tier

    def _wake(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._loop_handle.call_soon(self._pump)

    def _removed(self, keys: Sequence[bytes]) -> None:
        self._inbox.append(("removed", list(keys)))

    def _pump(self) -> None:
        """Move what the tier finished or learnt into the inbox (loop thread)."""
        self._pump_scheduled = False
        tier = self._tier
        for result in tier.get_finished_jobs():
            keys = self._loop_jobs.pop(result.job_id, ())
            # A stored chunk the tier already dropped again (evicted by a later chunk of the same
            # job) must not read as present: pass on only what the tier still holds.
            held = [k for k in keys if tier.known(k) is not False] if result.success else []
            self._inbox.append(("result", result, held))
        events = tier.take_events()
        if events:
            self._inbox.append(("events", events))
        if self._waiting:
            self._answer(list(self._waiting))

    def _submit_on_loop(self, job: kbase.TransferJob) -> None:
        if not job.is_promotion:
            self._loop_jobs[job.job_id] = job.keys
            self._tier.submit_store(job)
        else:
            self._tier.submit_load(job)

    def _probe(self, keys: Sequence[bytes]) -> None:
        self._answer(keys)

    def _answer(self, keys: Iterable[bytes]) -> None:
        tier, waiting = self._tier, self._waiting
        retry = False
        for key in keys:
            result = tier.lookup(key)
            if result is KvtierLookup.RETRY:
                waiting.add(key)
                retry = True
            else:
                waiting.discard(key)
                self._inbox.append(("verdict", key, result is KvtierLookup.HIT))
        if retry:
            tier.on_schedule_end()  # sends the tier's probe batch

    def _snapshot(self) -> None:
        self._stats = self._tier.statistics()

    async def _drain_on_loop(self) -> None:
        await self._tier.drain()
        self._pump()

    async def _close_on_loop(self) -> None:
        await self._tier.aclose()
        if self._hosted is not None:
            await self._hosted.done.wait()
        self._pump()
        self._tier.set_wakeup(None)
        self._tier.set_removal_listener(None)
        self._stats = self._tier.statistics()

    # --- scheduler side: lookups -------------------------------------------------------------
    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if self._inbox:
            self._absorb()
        verdict = self._verdicts.get(key)
        if verdict is True:
            return LookupResult.HIT
        if verdict is not None:
            if verdict > time.monotonic():
                return LookupResult.MISS
            del self._verdicts[key]
        if self._closed:
            return LookupResult.MISS
        deadline = self._asked.get(key)
        if deadline is None:
            if self.view_is_complete:
                return LookupResult.MISS
            self._asked[key] = time.monotonic() + self._answer_within_s
            self._batch.append(key)
        elif deadline < time.monotonic():  # the answer is overdue: recompute rather than wait
            del self._asked[key]
            return LookupResult.MISS
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's last call: hand this step's jobs, touches and probes to the loop at once."""
        if self._closed:
            return
        if self._batch:
            batch, self._batch = self._batch, []
            self._outbox.append((self._probe, (batch,)))
        now = time.monotonic()
        if now >= self._stats_due:
            self._stats_due = now + _STATS_PERIOD_S
            self._outbox.append((self._snapshot, ()))
        self._flush_outbox()

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        if self._forwards_touch and keys and not self._closed:
            self._outbox.append((self._tier.touch, (list(keys),)))

    # --- scheduler side: jobs ------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_promotion=True)

    def _submit(self, job: TransferJob, *, is_promotion: bool) -> None:
        if job.job_id in self._jobs:
            raise ValueError(f"tier {self.label}: job id {job.job_id} is already in flight")
        keys = cast("list[bytes]", list(job.keys))  # OffloadKey is bytes
        slots = [int(c) for c in job.chunk_ids]
        if len(keys) != len(slots):
            raise ValueError(f"tier {self.label}: job {job.job_id} has {len(keys)} keys but {len(slots)} chunk ids")
        self._jobs[job.job_id] = (keys, is_promotion)
        kjob = kbase.TransferJob(job_id=job.job_id, keys=keys, slot_ids=slots,
                                 is_promotion=is_promotion, submit_time=job.submit_time)
        if self._closed:
            self._inbox.append(("result", kbase.JobResult(job.job_id, False, is_promotion, failure_reason="closed"), ()))
            return
        self._outbox.append((self._submit_on_loop, (kjob,)))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._inbox:
            self._absorb()
        if not self._finished:
            return ()
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        if self._inbox:
            self._absorb()
        return bool(self._jobs or self._asked or self._finished or self._outbox)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._inbox:
            self._absorb()
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def _flush_outbox(self) -> None:
        """Hand everything queued this step to the loop in ONE wake-up (scheduler side).

        Waking the loop per call would cost the scheduler thread the GIL each time (the loop
        thread takes it and keeps it until it blocks); once per step it lands when the scheduler
        is about to run the model anyway. Jobs therefore start at the end of the step that
        submitted them, as vLLM's own deferred work does.
        """
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon(_run_all, batch)
        except RuntimeError:
            logger.error("tier %s: kvtier's event loop is gone; failing %d queued calls", self.label, len(batch))
            for _fn, args in batch:
                if args and isinstance(args[0], kbase.TransferJob):
                    job = args[0]
                    self._inbox.append(("result", kbase.JobResult(job.job_id, False, job.is_promotion,
                                                                  failure_reason="closed"), ()))

    def _absorb(self) -> None:
        """Apply what the loop posted, in the order it was posted (scheduler side)."""
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            kind = item[0]
            if kind == "verdict":
                _, key, present = item
                self._asked.pop(key, None)
                self._remember(key, present)
            elif kind == "result":
                self._finish(item[1], item[2])
            elif kind == "removed":
                for key in item[1]:
                    self._remember(key, False)
            else:
                self._events.extend(self._translate(event) for event in item[1])
        verdicts = self._verdicts
        while len(verdicts) > _MAX_VERDICTS:  # forget the oldest facts first
            del verdicts[next(iter(verdicts))]

    def _remember(self, key: bytes, present: bool) -> None:
        verdicts = self._verdicts
        verdicts.pop(key, None)
        verdicts[key] = True if present else time.monotonic() + self._negative_ttl_s

    def _finish(self, result: kbase.JobResult, held: Sequence[bytes]) -> None:
        entry = self._jobs.pop(result.job_id, None)
        if entry is None:
            logger.error("tier %s: result for unknown job %s ignored", self.label, result.job_id)
            return
        keys, is_promotion = entry
        successful_keys = None
        if is_promotion:
            if not result.success:
                loaded = set(result.successful_keys or ())
                for key in keys:
                    if key not in loaded:
                        self._remember(key, False)
                successful_keys = [k for k in keys if k in loaded] or None
        elif result.success:
            verdicts = self._verdicts
            for key in held:
                if verdicts.get(key) is not True:
                    verdicts.pop(key, None)  # a newer fact goes to the end (oldest forgotten first)
                    verdicts[key] = True
        self._finished.append(JobResult(
            job_id=result.job_id,
            success=result.success,
            successful_keys=cast("list[OffloadKey] | None", successful_keys),
            transfer_time=result.transfer_time,
            transfer_bytes=result.transfer_bytes,
        ))

    def _translate(self, event: Any) -> OffloadingEvent:
        return OffloadingEvent(
            keys=list(event.keys),
            medium=Medium(event.medium),
            removed=event.removed,
            locality=Locality(event.locality) if event.locality is not None else None,
            ownership=self.label,
        )

    # --- blocking calls vLLM allows ------------------------------------------------------------
    def drain_jobs(self) -> None:
        if self._closed:
            return
        self._flush_outbox()
        if not self._loop.is_alive:  # cannot happen unless a bug killed the loop: fail, never hang
            self._fail_everything()
            return
        self._loop.call(self._drain_on_loop)

    def _fail_everything(self) -> None:
        """Report every unfinished job failed and forget unanswered probes (the loop is gone)."""
        for job_id, (_keys, is_promotion) in list(self._jobs.items()):
            self._inbox.append(("result", kbase.JobResult(job_id, False, is_promotion, failure_reason="closed"), ()))
        self._asked.clear()
        self._absorb()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._flush_outbox()  # queued jobs reach the tier and are reported (cancelled if need be)
        self._closed = True
        try:
            if self._loop.is_alive:
                self._loop.call(self._close_on_loop)
            else:
                self._fail_everything()
        finally:
            self._rows.release()
            self._loop.release()
            self._absorb()

    # --- metrics -------------------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(_METRICS)

    def get_stats(self) -> OffloadingConnectorStats | None:
        current, previous = self._stats, self._stats_reported
        if current is None or current is previous:
            return None
        self._stats_reported = current
        stats = OffloadingConnectorStats()
        label = (self.label,)
        if current.bytes_used is not None:
            stats.set_gauge(_BYTES_USED, current.bytes_used, label)
        if current.capacity_bytes is not None:
            stats.set_gauge(_CAPACITY, current.capacity_bytes, label)
        stats.set_gauge(_QUEUED, current.queued_jobs, label)
        evicted = current.evictions - (previous.evictions if previous else 0)
        if evicted:
            stats.increase_counter(_EVICTIONS, evicted, label)
        before = previous.failures if previous else {}
        for (direction, reason), count in current.failures.items():
            delta = count - before.get((direction, reason), 0)
            if delta:
                stats.increase_counter(_FAILURES, delta, (self.label, direction, reason))
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_type",)

    def config_info(self) -> dict[str, str]:
        return {"kvtier_type": self.kvtier_type}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(label={self.label!r})"


_BYTES_USED = "kvtier:tier_bytes_used"
_CAPACITY = "kvtier:tier_capacity_bytes"
_QUEUED = "kvtier:tier_queued_jobs"
_EVICTIONS = "kvtier:tier_evictions"
_FAILURES = "kvtier:tier_failures"
_METRICS: dict[str, OffloadingMetricMetadata] = {
    _BYTES_USED: OffloadingGaugeMetadata("Bytes a kvtier tier holds (fs: its block tree).", (TIER_LABEL,)),
    _CAPACITY: OffloadingGaugeMetadata("A kvtier tier's byte bound (max_bytes, capacity_bytes).", (TIER_LABEL,)),
    _QUEUED: OffloadingGaugeMetadata("Jobs queued in a kvtier tier, not yet started.", (TIER_LABEL,)),
    _EVICTIONS: OffloadingCounterMetadata("Chunks a kvtier tier evicted to stay within its bound.", (TIER_LABEL,)),
    _FAILURES: OffloadingCounterMetadata(
        "Failed chunk operations of a kvtier tier, by direction (load/store/lookup) and reason.",
        (TIER_LABEL, "direction", "reason"),
    ),
}


class KvtierFsTier(_KvtierTier):
    """kvtier's fs tier (bounded by ``max_bytes``, checksummed, contained) inside vLLM."""

    kvtier_type = "fs"
    medium = Medium.STORAGE


class KvtierObjTier(_KvtierTier):
    """kvtier's S3 tier (aiobotocore; no NIXL needed) inside vLLM."""

    kvtier_type = "obj"
    medium = Medium.STORAGE


class KvtierMemoryTier(_KvtierTier):
    """kvtier's bounded in-process memory tier inside vLLM (``capacity_bytes``)."""

    kvtier_type = "memory"
    medium = Medium.CPU
    view_is_complete = True

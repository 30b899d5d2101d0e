"""The host (primary) tier: slot bookkeeping for chunks held in host memory.

:class:`HostTier` decides which host slot holds which chunk, pins chunks while a copy reads them,
evicts by a pluggable :class:`~kvtier.policies.base.CachePolicy`, and announces residency changes
as :class:`~kvtier.types.OffloadingEvent` s. It does **no I/O and never blocks**: the bytes live in
:attr:`HostTier.buffer` and are moved by a copy engine (``kvtier.host.copy_engine``) or a
secondary tier, both driven by the engine. Every method is called from the engine's event-loop
thread, so nothing here takes a lock.

Chunk state (``ChunkStatus.ref_cnt``)::

    absent --prepare_store/prepare_write--> -1 (write pending; lookup says HIT_PENDING)
    -1 --complete_store(True)--> 0 (ready, evictable)       -1 --complete_store(False)--> absent
    0  --prepare_load/prepare_read--> 1 .. n (pinned)       n --complete_load/complete_read--> n-1
    0  --chosen by the policy to make room--> absent (slot reused)

Who pins and unpins: whoever calls ``prepare_load``/``prepare_read`` owns one pin per key and must
call ``complete_load``/``complete_read`` exactly once for it; ``prepare_store``/``prepare_write``
hand out write-pending slots that the caller must settle with exactly one
``complete_store``/``complete_write`` (success or failure). A pinned or write-pending chunk is
never evicted.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.policies import CachePolicyFactory
from kvtier.policies.quotas import TenantQuotas, TenantStatistics
from kvtier.policies.tenant_policy import TenantPolicy
from kvtier.stats import Histogram, HistogramSnapshot
from kvtier.types import ChunkStatus, LookupResult, Medium, OffloadingEvent

if TYPE_CHECKING:
    from kvtier.host.copy_engine import CopyEngine
    from kvtier.policies.base import CachePolicy

__all__ = [
    "HostTier",
    "PrepareStoreOutput",
    "HostStatistics",
    "ALLOCATION_SIZE_BUCKETS",
    "EVICTION_AGE_BUCKETS",
]

#: Chunks requested per ``prepare_store`` (vLLM's ``kv_offload_cpu_allocation_size``).
ALLOCATION_SIZE_BUCKETS: tuple[float, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
#: Seconds a chunk stayed ready in host memory before it was evicted.
EVICTION_AGE_BUCKETS: tuple[float, ...] = (0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)

_GROUP_BYTES = 4  # an offload key ends with its 4-byte big-endian KV-cache group index
_MEDIUM = Medium.CPU.value


@dataclass(slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: store ``keys_to_store`` into ``slot_ids`` (co-indexed).

    ``evicted_keys`` left the host tier to make room, in eviction order. An empty
    ``keys_to_store`` means nothing needs storing (all offered keys are present or filtered).
    """

    keys_to_store: list[bytes]
    slot_ids: list[int]
    evicted_keys: list[bytes]


@dataclass(frozen=True, slots=True)
class HostStatistics:
    """A point-in-time snapshot of the host tier (counters are cumulative since creation)."""

    num_slots: int
    slot_bytes: int
    used_slots: int  # holding a chunk (write-pending, ready or pinned)
    pinned_slots: int  # ref_cnt != 0: write-pending plus those pinned by readers
    write_pending: int
    evictable: int
    stores_skipped: int  # candidates dropped by the store threshold
    evictions: int
    eviction_age: HistogramSnapshot
    allocation_failures: int  # prepare_store / prepare_write returned None
    allocation_sizes: HistogramSnapshot
    tenants: TenantStatistics | None = None  # per tenant pool, with tenant budgets only


@dataclass(slots=True)
class _RequestAccess:
    """One request's accesses to the host tier in one cache generation (kept in its state bag)."""

    generation: int
    groups: dict[int, list[bytes]] = field(default_factory=dict)  # first-seen order per KV group
    seen: set[bytes] = field(default_factory=set)
    inserted: set[bytes] = field(default_factory=set)
    reused: set[bytes] = field(default_factory=set)
    store_missed: set[bytes] = field(default_factory=set)  # already reported to on_store_miss
    finished: bool = False


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big") if len(key) > _GROUP_BYTES else 0


class HostTier:
    """The primary tier's bookkeeping, with the semantics of vLLM's ``CPUOffloadingManager``.

    Works without a device or copy engine (that is how policies are tested); the slot buffer is
    allocated only when :attr:`buffer` is first used. ``store_threshold`` ≥ 2 turns on the reuse
    tracker: a new chunk is stored only once :meth:`prepare_store` has been offered it that many
    times (offers are counted for at most ``max_tracker_size`` keys, the least recently offered
    forgotten first); promotions (:meth:`prepare_write`) bypass it.

    ``tenant_budgets`` (``tenant_cpu_bytes``: tenant label → bytes, ``"default"`` for every other
    request) turns on tenant quotas (:mod:`kvtier.policies.quotas`): each chunk is charged
    ``slot_bytes`` to the pool of the request that stored it, a pool at its budget evicts its own
    least recently used chunks (no room while too many of them are busy: None, as for a full
    tier), the chunks beyond what its whole budget holds are refused (dropped from the store,
    counted), and a full tier takes room from pools over their budget or without one before any
    other. The policy is then a :class:`~kvtier.policies.tenant_policy.TenantPolicy`
    (one ``eviction_policy`` per pool); without budgets nothing of this runs.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        eviction_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        store_threshold: int = 0,
        max_tracker_size: int = 64000,
        enable_events: bool = False,
        copy_engine: CopyEngine | None = None,
        pin_memory: bool | None = None,
        tenant_budgets: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots must be a positive integer, got {num_slots!r}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ConfigError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
        if max_tracker_size < 1:
            raise ConfigError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.copy_engine = copy_engine
        self._pin_memory = pin_memory
        self._buffer: SlotBuffer | None = None
        self._policy: CachePolicy
        self._tenants: TenantPolicy | None = None
        if tenant_budgets is None:
            self._policy = CachePolicyFactory.create(eviction_policy, num_slots, cache_policy_module_path)
        else:
            try:
                quotas = TenantQuotas(tenant_budgets)
            except ValueError as exc:
                raise ConfigError(f"tenant_cpu_bytes: {exc}") from None
            small = {label: budget for label, budget in tenant_budgets.items() if budget < slot_bytes}
            if small:  # a budget below one chunk would refuse every store of its tenant
                label, budget = next(iter(small.items()))
                raise ConfigError(f"tenant_cpu_bytes.{label} = {budget}: less than one chunk ({slot_bytes} bytes "
                                  "in host memory); give at least that, or leave the tenant out")
            self._policy = self._tenants = TenantPolicy(
                num_slots, quotas, slot_bytes,
                lambda capacity: CachePolicyFactory.create(eviction_policy, capacity, cache_policy_module_path))
        self._store_threshold = store_threshold
        self._max_tracker_size = max_tracker_size
        # key -> number of prepare_store offers, least recently offered first.
        self._tracker: collections.OrderedDict[bytes, int] | None = (
            collections.OrderedDict() if store_threshold >= 2 else None
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._generation = 0
        self._num_allocated = 0  # fresh slot ids handed out so far
        self._free: list[int] = []  # LIFO: the last freed slot is reused first
        self._evictable = 0
        self._write_pending = 0
        # Cumulative statistics.
        self._stores_skipped = 0
        self._evictions = 0
        self._allocation_failures = 0
        self._eviction_age = Histogram(EVICTION_AGE_BUCKETS)
        self._allocation_sizes = Histogram(ALLOCATION_SIZE_BUCKETS)

    # --- the bytes ------------------------------------------------------------------------------
    @property
    def buffer(self) -> SlotBuffer:
        """The host slot buffer, allocated on first use (pinned when CUDA is available)."""
        if self._buffer is None:
            self._buffer = SlotBuffer(self.num_slots, self.slot_bytes, pin_memory=self._pin_memory)
        return self._buffer

    def slot_view(self, slot_id: int) -> memoryview:
        """A writable, zero-copy view of one slot."""
        return self.buffer.view(slot_id)

    def close(self) -> None:
        """Release the slot buffer (if it was allocated). Views must no longer be used."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    # --- lookup ---------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> LookupResult:
        """MISS, HIT or HIT_PENDING (write in flight). No side effects: no recency, no tracker."""
        status = self._policy.get(key)
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.ref_cnt >= 0 else LookupResult.HIT_PENDING

    # --- store ----------------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> PrepareStoreOutput | None:
        """Allocate write-pending slots for the offered keys that are absent.

        Present-and-ready keys count as a reuse by ``ctx``; write-pending keys are ignored. When
        room is needed the policy evicts ready, unpinned chunks, never one of the offered keys.
        Returns ``None`` (no state change beyond the recorded offer) when room cannot be made;
        the caller may retry later. The caller settles every returned key with exactly one
        :meth:`complete_store`.
        """
        return self._prepare_store(keys, ctx, use_tracker=True)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Settle write-pending keys: ready on success, removed (slot freed) on failure.

        Keys that are absent or already ready are ignored, so a late or duplicate completion is
        harmless. Emits one stored event (success) or one metadata-only removal event (failure)
        for the keys whose state changed.
        """
        changed: list[bytes] = []
        if success:
            now = time.monotonic()
            for key in keys:
                status = self._policy.get(key)
                if status is None or status.ref_cnt != -1:
                    continue
                status.ref_cnt = 0
                status.stored_at = now
                self._write_pending -= 1
                self._evictable += 1
                self._policy.mark_evictable(key)
                changed.append(key)
            if changed and self._events is not None:
                self._events.append(OffloadingEvent(changed, _MEDIUM, removed=False))
            return
        for key in keys:
            status = self._policy.get(key)
            if status is None or status.ref_cnt != -1:
                continue
            self._policy.remove(key)
            self._free.append(status.slot_id)
            self._write_pending -= 1
            changed.append(key)
        if changed and self._events is not None:
            self._events.append(
                OffloadingEvent(changed, _MEDIUM, removed=True, metadata_only=True, reason="failed_store")
            )

    # --- load -----------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> list[int]:
        """Pin ``keys`` for a copy to the device; returns their slot ids, co-indexed.

        Every key must be present and ready (a HIT) — otherwise ``KeyError`` and nothing is
        pinned. Records the access for ``ctx`` (a reuse unless this request inserted the key).
        The caller calls :meth:`complete_load` once for these keys.
        """
        slot_ids = self._pin(keys)
        if ctx is not None:
            self._record_access(ctx, list(keys), reused=list(keys))
        return slot_ids

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key; a chunk whose last pin goes becomes evictable again."""
        self._unpin(keys)

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        """Mark ``keys`` recently used (the first most recent); absent keys are ignored by the policy.

        Resident keys are also recorded as accessed by ``ctx`` (a reuse unless it inserted them).
        """
        self._policy.touch(keys, ctx)
        if ctx is not None:
            resident = [k for k in keys if self._policy.get(k) is not None]
            if resident:
                self._record_access(ctx, resident, reused=resident)

    def on_request_finished(self, ctx: RequestContext) -> None:
        """Report the request's accesses to the policy (once per request and cache generation)."""
        record = ctx.get_state(_RequestAccess)
        if record is None or record.generation != self._generation or record.finished:
            return
        record.finished = True
        key_groups: list[list[bytes]] = []
        for group in sorted(record.groups):
            keys = record.groups[group]
            positions = [ctx.get_offload_key_position(k) for k in keys]
            if all(p is not None for p in positions):
                order = sorted(range(len(keys)), key=positions.__getitem__)  # type: ignore[arg-type]
                keys = [keys[i] for i in order]
            key_groups.append(keys)
        reused = set(record.reused)
        self._policy.on_request_finished(key_groups, record.inserted - reused, reused, ctx)

    # --- direction-explicit aliases for the tiering manager (cascades and promotions) ------------
    def prepare_read(self, keys: Sequence[bytes]) -> list[int]:
        """Pin ``keys`` for a cascade to a secondary tier; slot ids co-indexed.

        Unlike :meth:`prepare_load` this records **no** request access: cascades never change
        recency. Settle with :meth:`complete_read`.
        """
        return self._pin(keys)

    def complete_read(self, keys: Sequence[bytes]) -> None:
        """Release the pins taken by :meth:`prepare_read`."""
        self._unpin(keys)

    def prepare_write(self, keys: Sequence[bytes], ctx: RequestContext | None = None, *,
                      protect: Collection[bytes] = ()) -> PrepareStoreOutput | None:
        """Allocate slots for a promotion from a secondary tier (:meth:`prepare_store` semantics).

        The store threshold does not apply: a promoted chunk has already proved its reuse.
        ``protect`` are chunks never evicted to make room, as the offered keys are (the rest of the
        prefix the promoting request is resolving: evicting it to promote more would thrash).
        """
        return self._prepare_store(keys, ctx, use_tracker=False, protect=protect)

    def complete_write(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Settle a promotion (:meth:`complete_store` semantics)."""
        self.complete_store(keys, success)

    # --- events, reset, statistics -----------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        """Drain pending events (empty when events are disabled).

        A metadata-only removal keeps only keys the tier no longer holds (a retry may have
        re-allocated them) and is dropped when none remain.
        """
        if not self._events:
            return []
        events, self._events = self._events, []
        out: list[OffloadingEvent] = []
        for event in events:
            if event.metadata_only:
                event.keys = [k for k in event.keys if self._policy.get(k) is None]
                if not event.keys:
                    continue
            out.append(event)
        return out

    def reset_cache(self) -> None:
        """Forget every chunk: clear the policy, bump the cache generation, free all slots.

        Completions of jobs prepared before the reset must be discarded by the caller; per-request
        access records of the old generation are ignored. Cumulative statistics are kept.
        """
        self._policy.clear()
        self._generation += 1
        self._num_allocated = 0
        self._free.clear()
        self._evictable = 0
        self._write_pending = 0
        if self._tracker is not None:
            self._tracker.clear()

    @property
    def free_slots(self) -> int:
        """Slots holding no chunk."""
        return len(self._free) + self.num_slots - self._num_allocated

    @property
    def evictable_slots(self) -> int:
        """Slots holding a ready, unpinned chunk (the policy may evict it to make room)."""
        return self._evictable

    def count_evictable(self, keys: Collection[bytes]) -> int:
        """How many of the distinct ``keys`` are held ready and unpinned (evictable)."""
        count = 0
        for key in dict.fromkeys(keys):
            status = self._policy.get(key)
            count += status is not None and status.ref_cnt == 0
        return count

    @property
    def generation(self) -> int:
        """Bumped by every :meth:`reset_cache`."""
        return self._generation

    def statistics(self) -> HostStatistics:
        used = self._num_allocated - len(self._free)
        return HostStatistics(
            num_slots=self.num_slots,
            slot_bytes=self.slot_bytes,
            used_slots=used,
            pinned_slots=used - self._evictable,
            write_pending=self._write_pending,
            evictable=self._evictable,
            stores_skipped=self._stores_skipped,
            evictions=self._evictions,
            eviction_age=self._eviction_age.snapshot(),
            allocation_failures=self._allocation_failures,
            allocation_sizes=self._allocation_sizes.snapshot(),
            tenants=None if self._tenants is None else self._tenants.quotas.statistics(),
        )

    def get_stats(self) -> dict[str, Any]:
        """Usage gauges as vLLM reports them (fractions of ``num_slots``)."""
        usage = (self._num_allocated - len(self._free) - self._evictable) / self.num_slots
        write_usage = self._write_pending / self.num_slots
        stats: dict[str, Any] = {
            "cpu_cache_usage_perc": usage,
            "write_usage": write_usage,
            "read_usage": max(usage - write_usage, 0.0),
        }
        if self._tracker is not None:
            stats["stores_skipped"] = self._stores_skipped
        return stats

    def __repr__(self) -> str:
        return (
            f"HostTier(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
            f"used={self._num_allocated - len(self._free)}, policy={type(self._policy).__name__})"
        )

    # --- internals --------------------------------------------------------------------------------
    def _prepare_store(
        self, keys: Sequence[bytes], ctx: RequestContext | None, *, use_tracker: bool,
        protect: Collection[bytes] = (),
    ) -> PrepareStoreOutput | None:
        policy = self._policy
        tracker = self._tracker if use_tracker else None
        if tracker is not None:
            self._track_offer(tracker, keys)

        candidates: list[bytes] = []
        ready_existing: list[bytes] = []
        offered: set[bytes] = set()
        for key in keys:
            if key in offered:
                continue
            offered.add(key)
            status = policy.get(key)
            if status is None:
                candidates.append(key)
            elif status.ref_cnt >= 0:
                ready_existing.append(key)

        if tracker is not None:
            kept = [k for k in candidates if tracker.get(k, 0) >= self._store_threshold]
            self._stores_skipped += len(candidates) - len(kept)
            candidates = kept

        record = self._request_record(ctx) if ctx is not None else None
        if candidates:
            if record is None:
                policy.on_store_miss(candidates, ctx)
            else:
                unreported = [k for k in candidates if k not in record.store_missed]
                if unreported:
                    record.store_missed.update(unreported)
                    policy.on_store_miss(unreported, ctx)
        if ctx is not None and (candidates or ready_existing):
            candidate_set = set(candidates)
            # Offer order, restricted to candidates ∪ ready-existing (pending keys are not accesses).
            ready_set = set(ready_existing)
            accessed = [k for k in dict.fromkeys(keys) if k in candidate_set or k in ready_set]
            self._record_access(ctx, accessed, reused=ready_existing)

        if not candidates:
            return PrepareStoreOutput([], [], [])

        self._allocation_sizes.observe(len(candidates))
        need = len(candidates) - self.free_slots
        evicted: list[bytes] = []
        if self._tenants is not None:
            chosen = self._tenant_room(candidates, _Union(offered, protect) if protect else offered, ctx)
            if chosen is None:
                self._allocation_failures += 1
                return None
            candidates, chosen_victims = chosen
            self._release(chosen_victims, evicted)
            if len(candidates) > self.free_slots:  # an inner policy evicted fewer than it promised
                self._allocation_failures += 1
                return None
            if not candidates:
                return PrepareStoreOutput([], [], evicted)
        elif need > 0:
            if need > self._evictable:
                self._allocation_failures += 1
                return None
            # Every offered key is protected: evicting one to store another would thrash.
            victims = policy.evict(need, _Union(offered, protect) if protect else offered)
            if victims is None:
                self._allocation_failures += 1
                return None
            self._release(victims, evicted)

        slot_ids = self._allocate(len(candidates))
        for key, slot_id in zip(candidates, slot_ids):
            policy.insert(key, ChunkStatus(-1, slot_id), ctx)
        self._write_pending += len(candidates)
        if record is not None:
            record.inserted.update(candidates)
        return PrepareStoreOutput(candidates, slot_ids, evicted)

    def _release(self, victims: list[tuple[bytes, ChunkStatus]], evicted: list[bytes]) -> None:
        """Free the slots of chunks the policy evicted; their keys are appended to ``evicted``."""
        if not victims:
            return
        now = time.monotonic()
        for key, status in victims:
            self._free.append(status.slot_id)
            self._eviction_age.observe(max(now - status.stored_at, 0.0))
            evicted.append(key)
        self._evictable -= len(victims)
        self._evictions += len(victims)
        if self._events is not None:
            self._events.append(OffloadingEvent([key for key, _ in victims], _MEDIUM, removed=True, reason="evicted"))

    def _tenant_room(self, candidates: list[bytes], guard: Collection[bytes],
                     ctx: RequestContext | None) -> tuple[list[bytes], list[tuple[bytes, ChunkStatus]]] | None:
        """Tenant quotas: the candidates the requesting pool may store, and the victims that make
        room for them (already evicted), or None (no change) when the room cannot be made now.

        Candidates beyond what the pool's whole budget holds are refused (the tail: a prefix is
        worth more than its end), counted. For the rest, a pool past its budget evicts its own
        least recently used chunks; while too many of them are busy (being written or read) there
        is no room yet: None, as for a full tier, so a caller that waits for room waits for them.
        Room the tier lacks beyond that comes from :meth:`TenantQuotas.donors`.
        """
        assert self._tenants is not None
        tenants = self._tenants
        quotas, slot = tenants.quotas, self.slot_bytes
        pool = quotas.pool_of_request(ctx)
        budget = quotas.budgets[pool]
        keep = len(candidates) if budget is None else min(len(candidates), budget // slot)
        eligible = tenants.eligible(guard)
        own = -(-quotas.own_excess(pool, keep * slot) // slot)
        if own > eligible[pool]:
            return None
        plan = [(pool, own)] if own else []
        need = keep - self.free_slots - own
        if need > 0:
            eligible[pool] -= own
            more = tenants.plan(need, quotas.donors(pool), eligible)
            if more is None:
                return None
            plan.extend(more)
        if keep < len(candidates):
            quotas.count_refused(pool, len(candidates) - keep)
            candidates = candidates[:keep]
        return candidates, tenants.evict_planned(plan, guard) if plan else []

    def _allocate(self, n: int) -> list[int]:
        """``n`` slot ids: never-used ids first, then the most recently freed (caller checked room)."""
        fresh = min(n, self.num_slots - self._num_allocated)
        slot_ids = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        for _ in range(n - fresh):
            slot_ids.append(self._free.pop())
        return slot_ids

    def _track_offer(self, tracker: collections.OrderedDict[bytes, int], keys: Sequence[bytes]) -> None:
        """Count one offer of ``keys`` for the store threshold; keys of this offer are never
        dropped to make room."""
        offered = dict.fromkeys(keys)
        new_keys: list[bytes] = []
        # Tracked keys first: +1, to the MRU end, protected for the rest of this offer.
        for key in offered:
            count = tracker.get(key)
            if count is None:
                new_keys.append(key)
            else:
                tracker[key] = count + 1
                tracker.move_to_end(key)
        for key in new_keys:
            if len(tracker) >= self._max_tracker_size:
                # Keys of this offer sit at the MRU end, so the LRU entry is unprotected unless
                # every entry is; then the new key simply goes untracked.
                oldest = next(iter(tracker))
                if oldest in offered:
                    continue
                del tracker[oldest]
            tracker[key] = 1

    def _pin(self, keys: Sequence[bytes]) -> list[int]:
        statuses: list[ChunkStatus] = []
        for key in keys:
            status = self._policy.get(key)
            if status is None or status.ref_cnt < 0:
                raise KeyError(f"cannot pin chunk {key.hex()[:16]}…: it is {'absent' if status is None else 'write-pending'}")
            statuses.append(status)
        for key, status in zip(keys, statuses):
            if status.ref_cnt == 0:
                self._evictable -= 1
                self._policy.mark_non_evictable(key)
            status.ref_cnt += 1
        return [status.slot_id for status in statuses]

    def _unpin(self, keys: Sequence[bytes]) -> None:
        statuses: list[ChunkStatus] = []
        for key in keys:
            status = self._policy.get(key)
            if status is None or status.ref_cnt < 1:
                raise KeyError(f"chunk {key.hex()[:16]}… is not pinned")
            statuses.append(status)
        for key, status in zip(keys, statuses):
            status.ref_cnt -= 1
            if status.ref_cnt == 0:
                self._evictable += 1
                self._policy.mark_evictable(key)

    def _request_record(self, ctx: RequestContext) -> _RequestAccess:
        record = ctx.get_state(_RequestAccess)
        if record is None or record.generation != self._generation:
            record = _RequestAccess(self._generation)
            ctx.set_state(record)
        return record

    def _record_access(self, ctx: RequestContext, keys: Sequence[bytes], reused: Sequence[bytes]) -> None:
        """Add ``keys`` (offer order) to the request's accesses; ``reused`` count as reuses unless
        this request inserted them (re-reading one's own chunk, e.g. a cascade, is no reuse)."""
        record = self._request_record(ctx)
        new_keys: list[bytes] = []
        for key in keys:
            if key not in record.seen:
                record.seen.add(key)
                record.groups.setdefault(_group_of(key), []).append(key)
                new_keys.append(key)
        for key in reused:
            if key not in record.inserted:
                record.reused.add(key)
        if new_keys:
            self._policy.on_request_access(new_keys, ctx)


class _Union(AbstractSet[bytes]):
    """Two sets of keys seen as one, without copying either (the policies only ask ``in``)."""

    def __init__(self, first: AbstractSet[bytes], second: Collection[bytes]) -> None:
        self._first = first
        self._second = second

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._second

    def __iter__(self) -> Iterator[bytes]:
        yield from self._first
        yield from (key for key in self._second if key not in self._first)

    def __len__(self) -> int:
        return sum(1 for _ in self)

"""Runs a secondary tier's queued jobs through the tier's own primitives.

A :class:`JobRunner` takes :class:`~kvtier.tiers.jobs.JobHandle` records off a tier's job
stream and moves each job's chunks between host slots and the tier: per chunk through
``read``/``write``, or the whole job through ``read_many``/``write_many`` when the tier declares
``batched_reads``/``batched_writes``. It keeps the framework's promises about those calls (one
writer per key, chunk I/O bounded per direction, a chunk's failure fails only that chunk) and
hands every finished job back to the tier exactly once, with per-chunk failure reasons.
The contract the primitives follow is ``kvtier.tiers.base`` and docs/tiers.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from kvtier.tiers.counters import TierCounters
from kvtier.tiers.errors import ChunkCorrupt, TierIOError, failure_reason
from kvtier.tiers.jobs import JobHandle, JobResult

__all__ = ["JobRunner", "RunnableTier", "fan_out"]

#: One item of a batch hook: a chunk's key and the view of its host slot.
BatchItem = tuple[bytes, memoryview]


class RunnableTier(Protocol):
    """What the runner uses of a tier: its primitives and its public reporting helpers."""

    label: str
    context: Any  # a TierContext: ``host`` (the slot buffer, or None) and ``slot_bytes``

    @property
    def batched_reads(self) -> bool: ...

    @property
    def batched_writes(self) -> bool: ...

    async def read(self, key: bytes, dst: memoryview) -> None: ...

    async def write(self, key: bytes, src: memoryview) -> None: ...

    async def read_many(self, items: Sequence[BatchItem]) -> Sequence[BaseException | None]: ...

    async def write_many(self, items: Sequence[BatchItem]) -> Sequence[BaseException | None]: ...

    def known(self, key: bytes) -> bool | None: ...

    def mark_miss(self, keys: Iterable[bytes]) -> None: ...

    def emit_stored(self, keys: Sequence[bytes]) -> None: ...

    def emit_removed(self, keys: Sequence[bytes], reason: str) -> None: ...

    def record_transfer(self, direction: str, nbytes: int, seconds: float) -> None: ...


async def fan_out(primitive: Callable[[bytes, memoryview], Awaitable[Any]],
                  items: Sequence[BatchItem]) -> list[BaseException | None]:
    """Run ``primitive(key, view)`` for every item concurrently; per item ``None`` or its exception."""
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


class JobRunner:
    """The job workers of one tier.

    ``counters`` counts the jobs in flight; ``remember_stored(keys)`` records that the tier now
    holds ``keys`` (its positive verdicts); ``post(handle, result)`` reports a finished job;
    ``log`` receives the tracebacks of chunks that failed with an unexpected exception. Primitives
    are looked up on ``tier`` at every call, so what a subclass (or a test) puts there is used.
    """

    def __init__(
        self,
        tier: RunnableTier,
        counters: TierCounters,
        *,
        remember_stored: Callable[[list[bytes]], None],
        post: Callable[[JobHandle, JobResult], None],
        log: logging.Logger,
    ) -> None:
        self._tier = tier
        self._counters = counters
        self._remember_stored = remember_stored
        self._post = post
        self._log = log
        self._keys_being_written: dict[bytes, anyio.Event] = {}  # keys being written now

    async def dispatch(self, receive: MemoryObjectReceiveStream[JobHandle], width: int) -> None:
        """Run the jobs of ``receive`` until it closes, with at most ``width`` chunk I/Os in flight."""
        # ``width`` runners share the queue: a job leaves it only when a runner is free, so a slow
        # tier keeps its queue (and the queue_full back-pressure) meaningful instead of hoarding
        # running tasks — and no task is spawned per job.
        chunk_limiter = anyio.CapacityLimiter(width)
        async with anyio.create_task_group() as tg:
            for _ in range(width):
                tg.start_soon(self._run_jobs, receive, chunk_limiter)

    async def _run_jobs(self, receive: MemoryObjectReceiveStream[JobHandle], limiter: anyio.CapacityLimiter) -> None:
        async for record in receive:
            await self.run_job(record, limiter)

    async def run_job(self, record: JobHandle, limiter: anyio.CapacityLimiter) -> None:
        """Move one job's chunks (chunk I/O under ``limiter``) and report it."""
        tier = self._tier
        job = record.job
        self._counters.jobs_running[record.direction] += 1
        reasons: list[str | None] = [None] * len(job.keys)
        started = time.monotonic()
        try:
            if tier.batched_reads if job.is_promotion else tier.batched_writes:
                await self._run_batched(record, reasons)
            else:
                async with anyio.create_task_group() as tg:
                    for i in range(len(job.keys)):
                        tg.start_soon(self._run_chunk, record, i, reasons, limiter)
            self._complete(record, reasons, time.monotonic() - started)
        finally:
            self._counters.jobs_running[record.direction] -= 1

    async def _run_chunk(self, record: JobHandle, i: int, reasons: list[str | None], limiter: anyio.CapacityLimiter) -> None:
        job = record.job
        key = job.keys[i]
        try:
            async with limiter:
                host = self._tier.context.host
                if host is None:
                    raise TierIOError("internal", "tier has no host buffer")
                view = host.view(job.slot_ids[i])
                if job.is_promotion:
                    await self._tier.read(key, view)
                else:
                    await self.write_exclusive(key, view)
        except Exception as exc:
            self._chunk_failed(record, i, exc, reasons)

    def _chunk_failed(self, record: JobHandle, i: int, exc: BaseException, reasons: list[str | None]) -> None:
        key = record.job.keys[i]
        reason = failure_reason(exc)
        reasons[i] = reason
        if reason == "internal":
            self._log.error("tier %s: %s of chunk %s failed", self._tier.label, record.direction,
                            key.hex()[:16], exc_info=exc)
        elif isinstance(exc, ChunkCorrupt):
            self._tier.emit_removed([key], "corrupt")

    async def _run_batched(self, record: JobHandle, reasons: list[str | None]) -> None:
        """One job through the tier's ``read_many``/``write_many`` (same guarantees as per chunk)."""
        job = record.job
        host = self._tier.context.host
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
                await self._call_batch(record, self._tier.read_many, pending, views, reasons)
            return
        # One writer per key: claim the job's free keys and write them as one batch; keys another
        # job is writing (or repeated in this job) wait for the next round.
        # One event per round, shared by the keys it claims (all are released together).
        being_written = self._keys_being_written
        while pending:
            ready: list[int] = []
            waiting: list[int] = []
            claimed: list[bytes] = []
            done = anyio.Event()
            for i in pending:
                key = job.keys[i]
                if key in being_written:  # another job's, or repeated in this one
                    waiting.append(i)
                else:
                    being_written[key] = done
                    claimed.append(key)
                    ready.append(i)
            if ready:
                try:
                    await self._call_batch(record, self._tier.write_many, ready, views, reasons)
                finally:
                    for key in claimed:
                        del being_written[key]
                    done.set()
            else:
                busy = being_written.get(job.keys[waiting[0]])
                if busy is not None:
                    await busy.wait()
            pending = waiting

    async def _call_batch(
        self,
        record: JobHandle,
        hook: Callable[[Sequence[BatchItem]], Awaitable[Sequence[BaseException | None]]],
        indices: list[int],
        views: list[memoryview],
        reasons: list[str | None],
    ) -> None:
        keys = record.job.keys
        outcomes: Sequence[BaseException | None]
        try:
            whole = len(indices) == len(keys)  # the common case: every chunk of the job, in order
            outcomes = await hook(list(zip(keys, views)) if whole else [(keys[i], views[i]) for i in indices])
            if len(outcomes) != len(indices):
                raise ValueError(f"{hook.__name__}() returned {len(outcomes)} outcomes for {len(indices)} chunks")
        except Exception as exc:  # the whole batch failed
            outcomes = [exc] * len(indices)
        if outcomes.count(None) == len(outcomes):
            return
        for i, outcome in zip(indices, outcomes):
            if outcome is not None:
                self._chunk_failed(record, i, outcome, reasons)

    async def write_exclusive(self, key: bytes, src: memoryview) -> None:
        """``write(key, src)`` once no other write of ``key`` by this runner is in progress."""
        # The manager may cascade the same key in two jobs at once (vLLM cascades every key
        # offered to complete_store); tiers are promised one writer per key, so wait our turn.
        while (busy := self._keys_being_written.get(key)) is not None:
            await busy.wait()
        done = self._keys_being_written[key] = anyio.Event()
        try:
            await self._tier.write(key, src)
        finally:
            del self._keys_being_written[key]
            done.set()

    def _complete(self, record: JobHandle, reasons: list[str | None], elapsed: float) -> None:
        tier = self._tier
        job = record.job
        if reasons.count(None) == len(reasons):  # the common case: every chunk moved
            ok_keys, failed = list(job.keys), None
        else:
            ok_keys = [key for key, reason in zip(job.keys, reasons) if reason is None]
            failed = next(reason for reason in reasons if reason is not None)
        nbytes = len(ok_keys) * tier.context.slot_bytes
        tier.record_transfer("load" if job.is_promotion else "store", nbytes, elapsed)
        if job.is_promotion:
            if failed is not None:
                # Never re-promote a key whose load failed from a stale positive verdict.
                tier.mark_miss(key for key, reason in zip(job.keys, reasons) if reason is not None)
        else:
            # Chunks that were written exist even if a sibling failed; a tier that can answer
            # synchronously (known) may already have dropped them again (eviction).
            stored = [key for key in ok_keys if tier.known(key) is not False]
            self._remember_stored(stored)
            if stored:
                tier.emit_stored(stored)
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

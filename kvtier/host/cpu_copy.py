"""The CPU copy engine: the "device" KV cache is CPU memory (tests, CPU-only serving, benchmarks).

It keeps the contract of :class:`kvtier.host.copy_engine.CopyEngine` over the same plan of views as
the CUDA engine (:class:`kvtier.host.copy_plan.CopyPlan`), so the contract is testable on a
machine without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.host.copy_engine import CopyEngine
from kvtier.host.copy_jobs import CopyJob, CopyResult
from kvtier.host.copy_plan import CopyPlan, DeviceKV, first_tensor

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry
    from kvtier.model import KVModel

__all__ = ["CpuCopyEngine"]

log = logging.getLogger(__name__)


def _copy_pairs_numpy(plan: CopyPlan, job: CopyJob, host: np.ndarray, device_kv: Sequence[np.ndarray]) -> int:
    """Copy every pair of :meth:`CopyPlan.pairs` (one part of the job's group) with ``numpy.copyto``
    between byte views of the same memory; returns the bytes this rank moves for that part.

    ``numpy.copyto`` releases the GIL and runs on the calling thread only, so the engine's workers
    never compete with torch's intra-op thread pool on a busy host; slicing numpy views is much
    cheaper than slicing tensors, which matters for the many small page copies of the per-layer
    layout.
    """
    to_host = job.direction == "to_host"
    for host_view, device_view in plan.pairs(job, host, device_kv):
        if to_host:
            np.copyto(host_view, device_view)
        else:
            np.copyto(device_view, host_view)
    return plan.job_bytes(job)


#: Jobs a CPU copy worker takes per thread hop when several are queued.
_MAX_JOBS_PER_HOP = 8


class CpuCopyEngine(CopyEngine):
    """Copy engine whose "device" is CPU memory (tests, CPU-only serving, benchmarks).

    Each job runs in a worker thread through ``anyio.to_thread.run_sync`` with the engine's own
    :class:`anyio.CapacityLimiter` (``max_concurrent_jobs`` threads). Copies go straight from the
    device tensors into slot views (no staging copy) with ``numpy.copyto``; runs of consecutive
    device blocks are one copy each (one per layer with the per-layer layout), for each part of
    the job's group's pages.

    A worker takes up to ``_MAX_JOBS_PER_HOP`` queued jobs per thread hop and reports them when
    the batch is done; a job restricted to some layers ends its batch, so a layer-wise load sees
    each layer group as soon as it is copied (the jobs of one load run on the workers in
    submission order, ``max_concurrent_jobs`` at a time).
    """

    def __init__(
        self,
        device_kv: DeviceKV,
        model: KVModel | KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        *,
        max_queued_jobs: int = 1024,
        max_concurrent_jobs: int = 2,
    ) -> None:
        device = first_tensor(device_kv).device
        if device.type != "cpu":
            raise ConfigError(f"CpuCopyEngine needs CPU tensors, device_kv is on {device}")
        if max_concurrent_jobs < 1:
            raise ConfigError(f"max_concurrent_jobs must be >= 1, got {max_concurrent_jobs}")
        super().__init__(device_kv, model, blocks_per_chunk, buffer, max_queued_jobs=max_queued_jobs)
        self._concurrency = max_concurrent_jobs
        self._limiter = anyio.CapacityLimiter(max_concurrent_jobs)
        # Per group, per part: the plan and byte views (last dim in bytes) of the same memory; never copies.
        self._views: list[list[tuple[CopyPlan, np.ndarray, list[np.ndarray]]]] = [
            [(plan, plan.host.view(torch.uint8).numpy(), [t.view(torch.uint8).numpy() for t in plan.device_kv])
             for plan in plans]
            for plans in self._plans.groups
        ]

    async def _start_workers(self, tg: anyio.abc.TaskGroup) -> None:
        for _ in range(self._concurrency):
            tg.start_soon(self._worker)

    async def _worker(self) -> None:
        async for item in self._receive:
            # Take whatever else is queued too (up to a bound): one thread hop per batch, not per
            # job, so the hand-off does not dominate jobs of small copies.
            batch = [item[0]]
            while len(batch) < _MAX_JOBS_PER_HOP and batch[-1].layers is None:
                try:
                    batch.append(self._receive.receive_nowait()[0])
                except anyio.WouldBlock:
                    break
            batch = self._take_cancelled(batch)
            if not batch:
                continue
            start = time.monotonic()
            # Shielded: a copy handed to a thread cannot be recalled, so wait for it and report
            # what really happened rather than a failure for bytes that did move.
            with anyio.CancelScope(shield=True):
                outcomes = await anyio.to_thread.run_sync(self._copy_batch, batch, limiter=self._limiter)
            for job, (nbytes, seconds, error) in zip(batch, outcomes):
                if error is None:
                    self._report(CopyResult(job.job_id, True, nbytes, seconds))
                else:  # a failed copy is a failed job, never a crashed engine
                    log.warning("copy job %d failed: %r", job.job_id, error)
                    self._fail(job, f"copy_error: {type(error).__name__}", time.monotonic() - start)

    def _copy_batch(self, batch: list[CopyJob]) -> list[tuple[int, float, Exception | None]]:
        """Run in a worker thread: copy each job, recording its bytes, seconds and error."""
        outcomes: list[tuple[int, float, Exception | None]] = []
        for job in batch:
            start = time.monotonic()
            try:
                nbytes = 0
                if job.direction == "to_host":
                    self._plans.clear_unwritten(job)
                for plan, host_bytes, device_bytes in self._views[job.group]:
                    nbytes += _copy_pairs_numpy(plan, job, host_bytes, device_bytes)
            except Exception as exc:  # noqa: BLE001 - reported per job by the caller
                outcomes.append((0, time.monotonic() - start, exc))
            else:
                outcomes.append((nbytes, time.monotonic() - start, None))
        return outcomes

"""The CUDA copy engine and the copy routines it issues on its streams.

:class:`CudaCopyEngine` implements :class:`kvtier.host.copy_engine.CopyEngine` for CUDA device
tensors and a pinned host buffer. The routines — :func:`copy_pairs`, :func:`copy_gathered`,
:func:`copy_staged` — move one part of one job (a :class:`~kvtier.host.copy_plan.CopyPlan`: one
part of the pages of the job's group) with torch operations on the current stream, and
:func:`copy_parts` moves a whole job, each part with the routine that fits it; they work on CPU
tensors as well, which is how they are tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from kvtier.errors import ConfigError
from kvtier.host.completions import Completions, IssuedJob
from kvtier.host.copy_engine import CLOSE_TIMEOUT_S, CopyEngine
from kvtier.host.copy_jobs import CopyJob, CopyOrder, CopyResult
from kvtier.host.copy_plan import CopyPlan, DeviceKV, first_tensor

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry
    from kvtier.model import KVModel

__all__ = ["CudaCopyEngine", "copy_pairs", "copy_gathered", "copy_staged", "copy_parts"]

log = logging.getLogger(__name__)


def copy_pairs(plan: CopyPlan, job: CopyJob, non_blocking: bool = False) -> int:
    """Issue every copy of ``job`` with ``torch.Tensor.copy_``; returns the bytes this rank moves."""
    to_host = job.direction == "to_host"
    for host_view, device_view in plan.pairs(job, block_at_a_time=non_blocking):
        if to_host:
            host_view.copy_(device_view, non_blocking=non_blocking)
        else:
            device_view.copy_(host_view, non_blocking=non_blocking)
    return plan.job_bytes(job)


def copy_gathered(plan: CopyPlan, job: CopyJob, non_blocking: bool = False) -> int:
    """Move a job of whole pages (:meth:`CopyPlan.gathers`) in one contiguous copy per chunk.

    The job's pages are gathered on the device into a scratch laid out as the host slots are
    (``[chunks, bpc, layers, page]``, ``bpc`` the blocks one chunk of the group copies): per-layer
    tensors take one ``index_select`` per layer and a ``stack`` into the scratch for a store, one
    ``index_copy_`` per layer out of it for a load; a cross-layer tensor (blocks scattered in
    many runs) one ``index_select`` or ``index_copy_`` in all. Between the scratch and each host
    slot there is then a single contiguous DMA, instead of one small copy per page (``bpc ×
    layers`` Python calls per chunk). Device kernels are queued on the current stream (the copy
    stream), so the scratch is reused only after them. Works on CPU tensors as well (how it is
    tested). Returns the bytes this rank moves.
    """
    first, stop = plan.layer_range(job)
    blocks = torch.as_tensor(list(job.block_ids), dtype=torch.long)
    if plan.device.type == "cuda":
        # From pinned memory, asynchronously: a pageable copy would make this thread wait for the
        # copy stream, which may itself wait behind the caller's compute.
        blocks = blocks.pin_memory().to(plan.device, non_blocking=non_blocking)
    chunks = len(job.slot_ids)
    if plan.cross_layer:  # all layers (gathers() says so): a block is one contiguous [layers, page]
        cross = plan.device_kv[0]
        shape = (chunks, plan.bpc, *cross.shape[1:])
        if job.direction == "to_host":
            scratch = cross.index_select(0, blocks).view(shape)
            for i, slot in enumerate(job.slot_ids):
                plan.host[slot].copy_(scratch[i], non_blocking=non_blocking)
        else:
            scratch = torch.empty(shape, dtype=cross.dtype, device=plan.device)
            for i, slot in enumerate(job.slot_ids):
                scratch[i].copy_(plan.host[slot], non_blocking=non_blocking)
            cross.index_copy_(0, blocks, scratch.view(chunks * plan.bpc, *cross.shape[1:]))
        return plan.job_bytes(job)
    layers = plan.device_kv[first:stop]
    shape = (chunks, plan.bpc, stop - first, *layers[0].shape[1:])
    if job.direction == "to_host":
        scratch = torch.stack([layer.index_select(0, blocks) for layer in layers], dim=1).view(shape)
        for i, slot in enumerate(job.slot_ids):
            plan.host[slot][:, first:stop].copy_(scratch[i], non_blocking=non_blocking)
    else:
        scratch = torch.empty(shape, dtype=layers[0].dtype, device=plan.device)
        for i, slot in enumerate(job.slot_ids):
            scratch[i].copy_(plan.host[slot][:, first:stop], non_blocking=non_blocking)
        flat = scratch.view(chunks * plan.bpc, stop - first, *layers[0].shape[1:])
        for offset, layer in enumerate(layers):
            layer.index_copy_(0, blocks, flat[:, offset])
    return plan.job_bytes(job)


def copy_staged(
    plan: CopyPlan, job: CopyJob, non_blocking: bool = False
) -> tuple[int, Callable[[], None] | None]:
    """Move a job whose part of the host slots is strided — a part of a page of several parts
    (a state tensor), a layer group of a multi-block chunk (block-major in its slot) or of a
    cross-layer tensor — without the pageable staging (and wait) torch would add for a strided
    host copy, and without a call per page.

    The job's pages are gathered on the device into a contiguous scratch
    (``[blocks, layers, *part.shape]``; for attention K/V, block_size, heads, head_dim) and
    moved in one DMA to or from a contiguous pinned staging buffer; the CPU does the strided part. A load fills the staging
    from the host slots first (CPU work, no wait for the device), then copies and scatters into
    the device blocks. A store's bytes reach the host slots only once the DMA has finished: the
    returned ``finish`` does that and must be called after the job's completion event (the
    engine's completion thread does), before the job is reported. Returns ``(bytes, finish)``.
    """
    first, stop = plan.layer_range(job)
    on_cuda = plan.device.type == "cuda"
    blocks = torch.as_tensor(list(job.block_ids), dtype=torch.long)
    if on_cuda:
        blocks = blocks.pin_memory().to(plan.device, non_blocking=non_blocking)
    page = plan.part.shape  # e.g. K/V, block_size, heads, head_dim
    chunks = len(job.slot_ids)
    shape = (chunks, plan.bpc, stop - first, *page)
    staging = torch.empty(shape, dtype=plan.dtype, pin_memory=on_cuda)
    if job.direction == "to_device":
        for i, slot in enumerate(job.slot_ids):
            staging[i].copy_(plan.host[slot][:, first:stop])  # CPU: strided host → contiguous staging
        scratch = staging.to(plan.device, non_blocking=non_blocking).view(chunks * plan.bpc, stop - first, *page)
        if plan.cross_layer:
            plan.device_kv[0][:, first:stop].index_copy_(0, blocks, scratch)
        else:
            for offset, layer in enumerate(plan.device_kv[first:stop]):
                layer.index_copy_(0, blocks, scratch[:, offset])
        return plan.job_bytes(job), None
    if plan.cross_layer:
        scratch = plan.device_kv[0].index_select(0, blocks)[:, first:stop]
    else:
        scratch = torch.stack([layer.index_select(0, blocks) for layer in plan.device_kv[first:stop]], dim=1)
    staging.view(scratch.shape).copy_(scratch, non_blocking=non_blocking)

    def finish() -> None:
        for i, slot in enumerate(job.slot_ids):
            plan.host[slot][:, first:stop].copy_(staging[i])  # CPU: contiguous staging → strided host

    return plan.job_bytes(job), finish


#: Most bytes of device scratch (and pinned staging) one gathered or staged copy uses: a larger
#: job goes in pieces of whole chunks, so that a long load does not need a scratch as large as
#: itself on a device the model has all but filled.
SCRATCH_BYTES = 64 << 20


def _pieces(plan: CopyPlan, job: CopyJob) -> Iterator[CopyJob]:
    """``job`` as consecutive sub-jobs of whole chunks, each moving at most :data:`SCRATCH_BYTES`
    of this part (at least one chunk each); ``job`` itself when it fits."""
    per_chunk = max(1, plan.job_bytes(job) // max(1, len(job.slot_ids)))
    n = max(1, SCRATCH_BYTES // per_chunk)
    if len(job.slot_ids) <= n:
        yield job
        return
    bpc = plan.bpc
    for i in range(0, len(job.slot_ids), n):
        yield dataclasses.replace(job, slot_ids=job.slot_ids[i : i + n], block_ids=job.block_ids[i * bpc : (i + n) * bpc])


def copy_parts(
    plans: Sequence[CopyPlan], job: CopyJob, non_blocking: bool = False
) -> tuple[int, Callable[[], None] | None]:
    """Move every part of ``job`` (``plans``: its group's plans, one per page part) with the routine
    that fits the part, as the CUDA engine issues a job; returns the bytes this rank moves and the
    ``finish`` a store's staged parts need after the DMA (``None`` when there is none, see
    :func:`copy_staged`)."""
    nbytes = 0
    finishes: list[Callable[[], None]] = []
    for plan in plans:
        for piece in _pieces(plan, job):  # device scratch of bounded size, whatever the job's
            if plan.gathers(piece):
                nbytes += copy_gathered(plan, piece, non_blocking=non_blocking)
            elif plan.runs_contiguous(piece):  # this piece's blocks make few runs: no gather needed
                nbytes += copy_pairs(plan, piece, non_blocking=non_blocking)
            else:
                moved, finish = copy_staged(plan, piece, non_blocking=non_blocking)
                nbytes += moved
                if finish is not None:
                    finishes.append(finish)
    if not finishes:
        return nbytes, None
    if len(finishes) == 1:
        return nbytes, finishes[0]

    def finish_all() -> None:
        for finish in finishes:
            finish()

    return nbytes, finish_all


class CudaCopyEngine(CopyEngine):
    """Copy engine for CUDA device tensors and a pinned host buffer.

    Copies are issued (``non_blocking=True``) on a dedicated stream per direction, after the
    stream waits for the caller's order event (``kvtier.host.copy_engine``, "Ordering"). Each job
    records a timing event before its first copy and a blocking-sync timing event after its last;
    per stream a :class:`~kvtier.host.completions.Completions` helper thread waits for the oldest
    job's event and reports it (``CopyResult.seconds`` is the device's own measure of the copies,
    ``done`` the event).
    Issuing happens in a worker thread (own limiter of 1, so jobs enter their stream in
    submission order) to keep Python launch overhead off the loop. A layer-wise load submits one
    job per layer group, so each group gets its own event.

    Fences: a job whose issuing fails part-way is failed only after the copies it did issue have
    finished (an event recorded after them is waited for), so its slots and blocks are never
    released under a live copy; :meth:`aclose` waits for every issued copy of both streams; if they
    do not finish within the close timeout, :attr:`fenced` is False and the engine's owner must
    not release the host buffer (``kvtier.Engine`` then keeps it, and says so).

    A job copies every part of its group's pages, each with the routine that fits that part.
    Copy granularity, never one Python call per page: cross-layer with whole pages (all layers)
    copies each run of consecutive blocks in one DMA, or — when the blocks make more runs than
    the job has chunks — gathers them on the device like per-layer whole pages, which copy each
    chunk in one DMA (:func:`copy_gathered`). Everything else — a part of a page of several
    parts (Mamba state tensors), a layer group of a multi-block chunk: strided in the slot — is
    gathered on the device and moved through a contiguous pinned staging buffer
    (:func:`copy_staged`), the CPU doing the strided part: for a store after the DMA, on the
    completion thread, before the job is reported. A TP > 1 rank's slots hold its own heads densely
    (:meth:`kvtier.model.KVModel.rank_local`), so its copies take the same routines as at TP 1.
    """

    def __init__(
        self,
        device_kv: DeviceKV,
        model: KVModel | KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        *,
        max_queued_jobs: int = 1024,
    ) -> None:
        # Checked before the base class opens its job channel, so a refused engine owns nothing.
        if not torch.cuda.is_available():
            raise ConfigError("CudaCopyEngine needs CUDA; torch.cuda.is_available() is False")
        device = first_tensor(device_kv).device
        if device.type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs CUDA tensors, device_kv is on {device}")
        if not buffer.pinned:
            raise ConfigError("CudaCopyEngine needs a pinned host buffer (SlotBuffer(pin_memory=True))")
        super().__init__(device_kv, model, blocks_per_chunk, buffer, max_queued_jobs=max_queued_jobs)
        self._cuda_device = self._plans.device
        # Every CUDA object is created here, after the availability check.
        self._streams = {
            "to_host": torch.cuda.Stream(device=self._cuda_device),
            "to_device": torch.cuda.Stream(device=self._cuda_device),
        }
        self._issue_limiter = anyio.CapacityLimiter(1)
        self._completions = {direction: Completions(self._report_issued) for direction in self._streams}
        # Jobs to the device issued since the last get_issued and not reported yet: id → done event.
        self._issued: dict[int, Any] = {}

    def capture_order(self, stream: Any = None, after: Any = None) -> CopyOrder:
        """An event recorded now on ``stream`` (default: this thread's current stream on the
        engine's device), or ``after`` itself; ``TypeError``/``ValueError`` for a stream or event
        that is not a CUDA one of this device."""
        if stream is None:
            stream = torch.cuda.current_stream(self._cuda_device)
        elif not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, not {type(stream).__name__}")
        elif stream.device != self._cuda_device:
            raise ValueError(f"stream is on {stream.device}, the KV cache on {self._cuda_device}")
        if after is None:
            after = torch.cuda.Event()
            after.record(stream)
        elif not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be a torch.cuda.Event, not {type(after).__name__}")
        return CopyOrder(stream, after)

    def hand_over(self, order: CopyOrder | None, done: Any) -> None:
        if order is not None and done is not None:
            order.stream.wait_event(done)

    def get_issued(self) -> list[tuple[int, Any]]:
        issued = list(self._issued.items())
        self._issued.clear()
        return issued

    def _on_submit(self, job: CopyJob) -> Any:
        if job.order is not None:
            return job.order.ready
        # No caller's order: the submitting thread's current stream now (a direct user of the
        # engine, on the loop thread), so the copy at least waits for work enqueued there.
        return self.capture_order().ready

    async def _start_workers(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._issuer)
        for completions in self._completions.values():
            tg.start_soon(completions.run)

    def _issue(self, job: CopyJob, ready: Any) -> IssuedJob:
        """Enqueue the job's copies between its two events (worker thread; waits only to fence a
        job that failed part-way)."""
        stream = self._streams[job.direction]
        start = time.monotonic()
        if job.direction == "to_host":
            self._plans.clear_unwritten(job)  # host bytes no copy writes: no stream order needed
        with torch.cuda.device(self._cuda_device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            try:
                nbytes, finish = copy_parts(self._plans.groups[job.group], job, non_blocking=True)
            except BaseException:
                fence = torch.cuda.Event()
                fence.record(stream)
                fence.synchronize()  # the copies already issued end before the job is failed
                raise
            done = torch.cuda.Event(enable_timing=True, blocking=True)
            done.record(stream)
        return IssuedJob(job, started, done, nbytes, start, finish)

    async def _issuer(self) -> None:
        async for job, ready in self._receive:
            if not self._take_cancelled([job]):
                continue
            # Shielded: once handed to the thread the copies may be on the stream; keep the
            # job so its completion is observed and reported truthfully.
            with anyio.CancelScope(shield=True):
                try:
                    issued = await anyio.to_thread.run_sync(self._issue, job, ready, limiter=self._issue_limiter)
                except Exception as exc:
                    log.warning("copy job %d failed to issue: %r", job.job_id, exc)
                    self._fail(job, f"copy_error: {type(exc).__name__}")
                    continue
            if job.direction == "to_device" and job.layers is not None:
                # A layer group: its caller may order its work after it now (hand_over), before
                # it finishes. Recorded before the completion can be reported.
                self._issued[job.job_id] = issued.done
                if self._wakeup is not None:
                    self._wakeup()
            self._completions[job.direction].add(issued)

    def _report_issued(self, issued: IssuedJob, seconds: float, error: BaseException | None) -> None:
        self._issued.pop(issued.job.job_id, None)  # reported: get_finished says all there is
        if error is not None:
            log.warning("copy job %d failed after its copies: %r", issued.job.job_id, error)
            self._fail(issued.job, f"copy_error: {type(error).__name__}", seconds)
            return
        self._report(CopyResult(issued.job.job_id, True, issued.nbytes, seconds, done=issued.done))

    async def _finish_in_flight(self) -> None:
        # Copies already on a stream finish on their own: wait for all of them (well inside
        # aclose's timeout) so that nobody reuses slots or blocks, or frees the buffer, under one.
        deadline = anyio.current_time() + CLOSE_TIMEOUT_S / 2
        for completions in self._completions.values():
            if not await completions.fence(max(0.0, deadline - anyio.current_time())):
                self.fenced = False
        if not self.fenced:
            log.error("copies still running on the GPU %.1f s into closing; the host buffer is kept "
                      "(not freed under them)", CLOSE_TIMEOUT_S / 2)
        for completions in self._completions.values():
            for issued in completions.take_all():
                self._issued.pop(issued.job.job_id, None)
                self._fail(issued.job, "closed", time.monotonic() - issued.start)

"""Copy engines: move chunk bytes between the device KV cache and host slots, asynchronously.

A copy engine is an async component (one anyio task group) with a synchronous, NON-BLOCKING
front: the loop thread calls :meth:`CopyEngine.submit` and later drains
:meth:`CopyEngine.get_finished`. Every submitted job is reported **exactly once**, successful or
not, including jobs refused because the queue was full and jobs still queued at :meth:`aclose`.

Who pins what: the caller (the engine / host tier) pins the host slots for the job's whole
lifetime (``prepare_store``/``prepare_load`` before submit, ``complete_*`` after the result) and
keeps the device blocks allocated until the result arrives. The engine only copies bytes.

Layouts (``docs/internals.md``): ``device_kv`` is either a list of per-layer tensors
``[num_blocks, 2, block_size, heads, head_dim]`` or one cross-layer tensor
``[num_blocks, num_layers, 2, block_size, heads, head_dim]``; ``heads`` is this TP rank's share.
A host slot is canonical and independent of TP: page ``(b, l)`` at ``(b * num_layers + l) *
page_bytes``, i.e. the slot viewed as ``[bpc, num_layers, 2, block_size, all_heads, head_dim]``.
A rank copies into its head slice of every page, so ``tp_size`` ranks together fill one slot.

A job may be restricted to a range of layers (``CopyJob.layers``): layer-wise loading
(``kvtier.engine.layerwise``) submits one job per group of layers, in layer order, so a caller can
compute layer ``i`` while layer ``i + 1`` is still copying. Such a job is reported as soon as its
own copies are done (the CPU engine never holds its result back for other jobs), and a job not
yet started can be withdrawn with :meth:`CopyEngine.cancel`.

Two engines implement the contract: :class:`CpuCopyEngine` (the "device" is CPU memory; copies
run in worker threads) and :class:`CudaCopyEngine` (copies on a dedicated CUDA stream, completion
observed by polling a CUDA event — nothing on the serving path calls ``synchronize()``).

Ordering with the caller's device work (CUDA; the contract a caller reads):

* **A copy waits for the caller's stream as it was at the call.** :meth:`CopyEngine.capture_order`
  runs in the caller's thread when the caller's operation starts (``Engine.store``/``load`` call
  it first thing, the blocking facade in the thread that calls it): it records an event on the
  caller's stream — the one given, else the calling thread's current stream on the engine's
  device — or takes the event the caller gives (``after``). The job's copies are issued on the
  engine's own stream after that event: a store reads the KV only after the kernels that wrote it,
  a load overwrites blocks only after the work that last read them. Work the caller enqueues later
  is not waited for.
* **A load's bytes are ordered before the caller's later work.** Once a job to the device has
  finished, :meth:`CopyEngine.hand_over` makes the caller's stream wait for the job's completion
  event, so kernels the caller enqueues on that stream afterwards see the loaded KV (a layer-wise
  load hands over each group's event as it yields the group).
* Without CUDA both are no-ops (``capture_order`` refuses a ``stream``/``after``: there is
  nothing to order against).
"""

from __future__ import annotations

import abc
import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import numpy as np
import torch

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.layout import KVGeometry
    from kvtier.host.slots import SlotBuffer

__all__ = [
    "CopyJob",
    "CopyOrder",
    "CopyResult",
    "CopyEngine",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "make_copy_engine",
    "CLOSE_TIMEOUT_S",
]

log = logging.getLogger(__name__)

Direction = Literal["to_host", "to_device"]

#: How long :meth:`CopyEngine.aclose` waits for the task group to finish.
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """Where one caller's copies sit among its own device work (see the module docstring).

    ``stream`` is the caller's stream (a load hands its completion over to it); ``ready`` the
    event, recorded on it when the caller's operation started (or given by the caller), that the
    copies wait for.
    """

    stream: Any
    ready: Any


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Copy ``len(slot_ids)`` chunks between device blocks and host slots.

    ``direction`` is ``"to_host"`` (device → host, a store) or ``"to_device"`` (host → device, a
    load). Chunk ``i`` uses device blocks ``block_ids[i*bpc:(i+1)*bpc]`` and host slot
    ``slot_ids[i]``; so ``len(block_ids) == len(slot_ids) * blocks_per_chunk``. ``layers``
    ``(start, stop)`` copies only layers ``start <= l < stop`` of every page (``None``: all).
    ``order`` is the caller's :meth:`CopyEngine.capture_order` (``None``: the CUDA engine waits
    for the current stream of the thread that submits, the engine's loop thread).
    """

    job_id: int
    direction: Direction
    slot_ids: Sequence[int]
    block_ids: Sequence[int]
    layers: tuple[int, int] | None = None
    order: CopyOrder | None = None


@dataclass(frozen=True, slots=True)
class CopyResult:
    """Outcome of one job. ``nbytes`` counts bytes this rank copied (0 on failure);
    ``seconds`` is issue → observed completion; ``error`` names the failure (``None`` on success);
    ``done`` is the CUDA event recorded after the job's copies (``None`` without CUDA), which
    :meth:`CopyEngine.hand_over` makes the caller's stream wait for."""

    job_id: int
    success: bool
    nbytes: int
    seconds: float
    error: str | None = None
    done: Any = None


# --------------------------------------------------------------------------------------------
# Geometry of one rank's copies
# --------------------------------------------------------------------------------------------


def _head_slice(geometry: KVGeometry, tp_rank: int) -> tuple[int, int]:
    """(first head, head count) of ``tp_rank``'s KV heads inside a canonical page."""
    try:
        shard = geometry.shard(tp_rank)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return shard.heads_start, shard.heads_count


class _CopyPlan:
    """Validated shapes plus the tensor views one job copies between.

    Built once per engine; :meth:`pairs` yields ``(host_view, device_view)`` tensor pairs for a
    job, coalescing runs of consecutive device blocks into one copy (with the cross-layer layout a
    run is one contiguous region on both sides when ``tp_size == 1``).
    """

    def __init__(
        self,
        device_kv: torch.Tensor | Sequence[torch.Tensor],
        geometry: KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        tp_rank: int,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ConfigError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.bpc = blocks_per_chunk
        self.num_layers = int(geometry.num_layers)
        two, block_size, all_heads, head_dim = (int(x) for x in geometry.page_shape)
        head_start, heads = _head_slice(geometry, tp_rank)
        dtype = geometry.torch_dtype
        self.dtype = dtype
        page = (two, block_size, heads, head_dim)

        if isinstance(device_kv, torch.Tensor):
            self.cross_layer = True
            tensors = [device_kv]
            expected: tuple[str | int, ...] = ("num_blocks", self.num_layers, *page)
            legend = "num_blocks, num_layers, K/V, block_size, this rank's kv heads, head_dim"
        else:
            self.cross_layer = False
            tensors = list(device_kv)
            if len(tensors) != self.num_layers:
                raise ConfigError(
                    f"device_kv has {len(tensors)} per-layer tensors, geometry has {self.num_layers} layers"
                )
            expected = ("num_blocks", *page)
            legend = "num_blocks, K/V, block_size, this rank's kv heads, head_dim"
        if not tensors:
            raise ConfigError("device_kv is empty")
        num_blocks = int(tensors[0].shape[0]) if tensors[0].dim() > 0 else 0
        device = tensors[0].device
        for idx, t in enumerate(tensors):
            where = "device_kv" if self.cross_layer else f"device_kv[{idx}]"
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"{where} is a {type(t).__name__}, expected a torch.Tensor")
            if tuple(t.shape[1:]) != tuple(expected[1:]) or t.dim() != len(expected):
                raise ConfigError(f"{where} has shape {tuple(t.shape)}, expected {expected} ({legend})")
            if t.shape[0] != num_blocks:
                raise ConfigError(f"{where} has {t.shape[0]} blocks, device_kv[0] has {num_blocks}")
            if t.dtype != dtype:
                raise ConfigError(f"{where} has dtype {t.dtype}, geometry says {dtype}")
            if t.device != device:
                raise ConfigError(f"{where} is on {t.device}, device_kv[0] is on {device}")
            if not t.is_contiguous():
                # Copies address blocks by offset (and the CPU engine views the bytes in place):
                # a transposed or sliced tensor would be read and written at the wrong places.
                raise ConfigError(
                    f"{where} must be contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                    "pass the KV cache tensor itself, not a transposed or strided view of it"
                )
        if num_blocks < 1:
            raise ConfigError("device_kv has no blocks")
        self.device = device
        self.num_blocks = num_blocks
        self.device_kv = tensors

        page_bytes = int(geometry.page_bytes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if page_bytes != two * block_size * all_heads * head_dim * itemsize:
            raise ConfigError(f"geometry.page_bytes {page_bytes} does not match page_shape × itemsize")
        self.chunk_bytes = blocks_per_chunk * self.num_layers * page_bytes
        if buffer.slot_bytes < self.chunk_bytes:
            raise ConfigError(
                f"host slot of {buffer.slot_bytes} bytes cannot hold a chunk of {self.chunk_bytes} bytes"
            )
        self.buffer = buffer
        self.num_slots = buffer.num_slots
        # The whole host buffer as [num_slots, bpc, layers, 2, block_size, all_heads, head_dim]
        # (slot stride = slot_bytes, so padding is skipped), narrowed to this rank's heads.
        host = buffer.tensor
        if host.device.type != "cpu":  # pragma: no cover - SlotBuffer always lives on the host
            raise ConfigError("host buffer must be CPU memory")
        elems_per_slot = buffer.slot_bytes // itemsize
        full = host.view(-1).view(dtype)
        shape = (buffer.num_slots, blocks_per_chunk, self.num_layers, two, block_size, all_heads, head_dim)
        strides = [0] * len(shape)
        acc = 1
        for dim in range(len(shape) - 1, 0, -1):
            strides[dim] = acc
            acc *= shape[dim]
        strides[0] = elems_per_slot
        self.host = full.as_strided(shape, strides)[..., head_start : head_start + heads, :]
        # Bytes this rank moves per chunk (its head share of every page).
        self.rank_chunk_bytes = blocks_per_chunk * self.num_layers * two * block_size * heads * head_dim * itemsize
        #: This rank holds every head: its part of a host page is the whole page (contiguous).
        self.whole_pages = heads == all_heads

    def validate(self, job: CopyJob) -> str | None:
        """Why ``job`` cannot run, or ``None`` when it is well formed."""
        if job.direction not in ("to_host", "to_device"):
            return f"unknown direction {job.direction!r}"
        if job.layers is not None:
            start, stop = job.layers
            if not 0 <= start < stop <= self.num_layers:
                return f"layers {job.layers} is not a non-empty range inside [0, {self.num_layers})"
        if len(job.block_ids) != len(job.slot_ids) * self.bpc:
            return (
                f"{len(job.block_ids)} block ids for {len(job.slot_ids)} slots "
                f"(blocks_per_chunk={self.bpc})"
            )
        for s in job.slot_ids:
            if not 0 <= s < self.num_slots:
                return f"slot id {s} out of range [0, {self.num_slots})"
        for b in job.block_ids:
            if not 0 <= b < self.num_blocks:
                return f"block id {b} out of range [0, {self.num_blocks})"
        return None

    def layer_range(self, job: CopyJob) -> tuple[int, int]:
        """``(start, stop)`` of the layers ``job`` copies (all of them when ``job.layers`` is ``None``)."""
        return job.layers if job.layers is not None else (0, self.num_layers)

    def job_bytes(self, job: CopyJob) -> int:
        """Bytes this rank moves for ``job`` (its head share of the pages of the job's layers)."""
        start, stop = self.layer_range(job)
        return self.rank_chunk_bytes // self.num_layers * (stop - start) * len(job.slot_ids)

    def gathers(self, job: CopyJob) -> bool:
        """Whether :func:`_copy_gathered` can move ``job``: the per-layer layout at TP 1, with every
        chunk's part of the host slot contiguous (all layers, or one block per chunk)."""
        return (not self.cross_layer and self.whole_pages
                and (job.layers is None or self.bpc == 1 or self.layer_range(job) == (0, self.num_layers)))

    def runs_contiguous(self, job: CopyJob) -> bool:
        """Whether each run of consecutive blocks of ``job`` is one contiguous range on both sides
        (the cross-layer layout at TP 1, all layers): :func:`_copy_pairs` then copies one range
        per run."""
        return self.cross_layer and self.whole_pages and self.layer_range(job) == (0, self.num_layers)

    def pairs(
        self,
        job: CopyJob,
        host: Any = None,
        device_kv: Sequence[Any] | None = None,
        *,
        block_at_a_time: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """``(host_view, device_view)`` pairs covering the job, in chunk order.

        ``host``/``device_kv`` default to the torch views; the CPU engine passes numpy byte views
        of the same memory (indexed identically), which are far cheaper to slice.
        ``block_at_a_time`` splits per-layer runs into single blocks, so that (at TP 1) every
        host view is contiguous: a run of pages of one layer is strided in the host slot, and
        torch would stage a strided device↔host copy through a pageable temporary. The same
        holds for a run of a cross-layer job restricted to some layers (``job.layers``), while
        one block's pages of consecutive layers are contiguous on both sides.
        """
        host = self.host if host is None else host
        device_kv = self.device_kv if device_kv is None else device_kv
        bpc = self.bpc
        block_ids = job.block_ids
        first_layer, stop_layer = self.layer_range(job)
        all_layers = (first_layer, stop_layer) == (0, self.num_layers)
        layers = slice(first_layer, stop_layer)
        for i, slot in enumerate(job.slot_ids):
            host_chunk = host[slot]
            blocks = block_ids[i * bpc : (i + 1) * bpc]
            for first, start, n in _runs(blocks):
                host_run = host_chunk[first : first + n]
                if self.cross_layer and all_layers:
                    yield host_run, device_kv[0][start : start + n]
                elif self.cross_layer and block_at_a_time and n > 1:
                    for offset in range(n):
                        yield (host_run[offset : offset + 1, layers],
                               device_kv[0][start + offset : start + offset + 1, layers])
                elif self.cross_layer:
                    yield host_run[:, layers], device_kv[0][start : start + n, layers]
                elif block_at_a_time and n > 1:
                    for offset in range(n):
                        for layer in range(first_layer, stop_layer):
                            dev = device_kv[layer]
                            yield host_run[offset : offset + 1, layer], dev[start + offset : start + offset + 1]
                else:
                    for layer in range(first_layer, stop_layer):
                        yield host_run[:, layer], device_kv[layer][start : start + n]


def _first_tensor(device_kv: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(device_kv, torch.Tensor):
        return device_kv
    for tensor in device_kv:
        return tensor
    raise ConfigError("device_kv is empty")


def _runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in chunk, first device block, length) of each run of consecutive device blocks."""
    n = len(blocks)
    i = 0
    while i < n:
        j = i + 1
        while j < n and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield i, int(blocks[i]), j - i
        i = j


# --------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------


class CopyEngine(abc.ABC):
    """Asynchronous device ↔ host chunk copier (one anyio task group).

    * :meth:`submit` never blocks and never raises for a bad or refused job: a malformed job, a
      full queue (``max_queued_jobs``) or a closed engine produce an immediate failed result.
    * :meth:`get_finished` drains the results collected so far; it never waits and returns each
      result exactly once.
    * The wakeup callback (:meth:`set_wakeup`) is called from the loop thread whenever a result
      becomes available.
    * :meth:`cancel` withdraws a job that no worker has started: it is reported failed with
      ``error="cancelled"`` when a worker reaches it. A job already copying cannot be recalled;
      it finishes and is reported truthfully.
    * An engine that is constructed must be closed with :meth:`aclose` (run or not).
    * :meth:`run` opens the task group, reports ``task_status.started()`` and returns after
      :meth:`aclose`. :meth:`aclose` stops accepting jobs, lets copies already issued finish (a
      copy in flight cannot be recalled and its result is truthful), fails every job still
      queued with ``error="closed"``, and returns within :data:`CLOSE_TIMEOUT_S`; if copies it
      issued could still be running then, :attr:`fenced` is False.
    """

    def __init__(
        self,
        device_kv: torch.Tensor | Sequence[torch.Tensor],
        geometry: KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        tp_rank: int = 0,
        *,
        max_queued_jobs: int = 1024,
    ) -> None:
        if max_queued_jobs < 1:
            raise ConfigError(f"max_queued_jobs must be >= 1, got {max_queued_jobs}")
        self._plan = _CopyPlan(device_kv, geometry, blocks_per_chunk, buffer, tp_rank)
        # Opened last, so a constructor that raises leaves nothing to close. Each queued item carries what the engine prepared at submit time (see _on_submit).
        self._send, self._receive = anyio.create_memory_object_stream[tuple[CopyJob, Any]](max_queued_jobs)
        self._results: collections.deque[CopyResult] = collections.deque()
        self._wakeup: Callable[[], None] | None = None
        self._unreported: set[int] = set()  # ids of queued or running jobs (for cancel)
        self._cancelled: set[int] = set()  # a subset of _unreported
        self._closed = False
        self._cancel_scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        #: False once closing found copies still running: the host buffer must then be kept.
        self.fenced = True

    # --- manager-facing (sync, loop thread) ---------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        """Bytes one chunk occupies in a host slot (all ranks together)."""
        return self._plan.chunk_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks of the device KV cache: valid block ids are ``[0, num_blocks)``."""
        return self._plan.num_blocks

    def submit(self, job: CopyJob) -> None:
        """Queue ``job`` without waiting; a refused job is reported failed right away."""
        if self._closed:
            self._fail(job, "closed")
            return
        problem = self._plan.validate(job)
        if problem is not None:
            self._fail(job, f"invalid job: {problem}")
            return
        try:
            self._send.send_nowait((job, self._on_submit(job)))
        except anyio.WouldBlock:
            self._fail(job, "queue_full")
            return
        self._unreported.add(job.job_id)

    def capture_order(self, stream: Any = None, after: Any = None) -> CopyOrder | None:
        """The caller's place among its device work; call it in the caller's thread, first thing.

        This engine copies CPU memory: there is no device work to order against, so this is
        ``None``, and a ``stream`` or ``after`` is a ``ValueError`` (a caller's mistake, such as
        CUDA events for an engine opened with CPU tensors).
        """
        if stream is not None or after is not None:
            raise ValueError("stream= and after= order copies against CUDA work; this engine copies CPU "
                             "tensors (open it with CUDA device_kv)")
        return None

    def hand_over(self, order: CopyOrder | None, result: CopyResult) -> None:
        """After a successful job to the device: the caller's later work waits for its bytes.

        Nothing to do here (CPU copies are complete when reported); the CUDA engine makes
        ``order.stream`` wait for ``result.done``.
        """

    def cancel(self, job_id: int) -> None:
        """Withdraw job ``job_id`` if no worker has started it (see the class docstring).

        Non-blocking; an id that is unknown or already reported is ignored. The job is still
        reported exactly once: failed with ``error="cancelled"``, or — when it had already
        started — with its real outcome.
        """
        if job_id in self._unreported:
            self._cancelled.add(job_id)

    def get_finished(self) -> list[CopyResult]:
        """Every result not yet returned (possibly none); never waits."""
        out = list(self._results)
        self._results.clear()
        return out

    def set_wakeup(self, callback: Callable[[], None] | None) -> None:
        self._wakeup = callback

    # --- lifecycle ----------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Process jobs until :meth:`aclose`; see the class docstring."""
        if self._stopped is not None:
            raise RuntimeError("CopyEngine.run() may be called only once")
        self._stopped = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                self._cancel_scope = scope
                if self._closed:
                    scope.cancel()
                async with anyio.create_task_group() as tg:
                    await self._start_workers(tg)
                    task_status.started()
        finally:
            self._cancel_scope = None
            with anyio.CancelScope(shield=True):
                await self._finish_in_flight()
            self._fail_queued()
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop the engine; idempotent. Queued jobs are failed, issued copies finish."""
        self._closed = True
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()
        if self._stopped is not None:
            with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await self._stopped.wait()
        self._fail_queued()
        self._send.close()
        self._receive.close()

    # --- for subclasses -----------------------------------------------------------------------
    def _on_submit(self, job: CopyJob) -> Any:
        """Hook: capture submit-time state for ``job`` (runs on the loop thread)."""
        return None

    async def _finish_in_flight(self) -> None:
        """Hook: after the workers stopped, report jobs already handed to the hardware."""

    @abc.abstractmethod
    async def _start_workers(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the worker tasks that consume ``self._receive``."""

    def _take_cancelled(self, jobs: list[CopyJob]) -> list[CopyJob]:
        """Report the cancelled ``jobs`` (loop thread, before a worker starts them); return the rest."""
        if not self._cancelled:
            return jobs
        runnable = []
        for job in jobs:
            if job.job_id in self._cancelled:
                self._fail(job, "cancelled")
            else:
                runnable.append(job)
        return runnable

    def _report(self, result: CopyResult) -> None:
        self._unreported.discard(result.job_id)
        self._cancelled.discard(result.job_id)
        self._results.append(result)
        if self._wakeup is not None:
            self._wakeup()

    def _fail(self, job: CopyJob, error: str, seconds: float = 0.0) -> None:
        self._report(CopyResult(job.job_id, False, 0, seconds, error))

    def _fail_queued(self) -> None:
        while True:
            try:
                job, _ = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            self._fail(job, "closed")


# --------------------------------------------------------------------------------------------
# CPU engine
# --------------------------------------------------------------------------------------------


def _copy_pairs(plan: _CopyPlan, job: CopyJob, non_blocking: bool = False) -> int:
    """Issue every copy of ``job`` with ``torch.Tensor.copy_``; returns the bytes this rank moves."""
    to_host = job.direction == "to_host"
    for host_view, device_view in plan.pairs(job, block_at_a_time=non_blocking):
        if to_host:
            host_view.copy_(device_view, non_blocking=non_blocking)
        else:
            device_view.copy_(host_view, non_blocking=non_blocking)
    return plan.job_bytes(job)


def _copy_gathered(plan: _CopyPlan, job: CopyJob, non_blocking: bool = False) -> int:
    """Move a per-layer job (:meth:`_CopyPlan.gathers`) in one contiguous copy per chunk.

    The job's pages are gathered on the device into a scratch laid out as the host slots are
    (``[chunks, bpc, layers, page]``): one ``index_select`` per layer and a ``stack`` into the
    scratch for a store, one ``index_copy_`` per layer out of it for a load. Between the scratch
    and each host slot there is then a single contiguous DMA, instead of one small copy per page
    (``bpc × layers`` Python calls per chunk). Device kernels are queued on the current stream
    (the copy stream), so the scratch is reused only after them. Works on CPU tensors as well
    (how it is tested). Returns the bytes this rank moves.
    """
    first, stop = plan.layer_range(job)
    blocks = torch.as_tensor(list(job.block_ids), dtype=torch.long)
    if plan.device.type == "cuda":
        # From pinned memory, asynchronously: a pageable copy would make this thread wait for the
        # copy stream, which may itself wait behind the caller's compute.
        blocks = blocks.pin_memory().to(plan.device, non_blocking=non_blocking)
    layers = plan.device_kv[first:stop]
    chunks = len(job.slot_ids)
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


def _copy_staged(plan: _CopyPlan, job: CopyJob, non_blocking: bool = False) -> tuple[int, Callable[[], None] | None]:
    """Move a job whose part of the host slots is strided — a TP > 1 rank's heads inside every
    page, or a layer group of a multi-block chunk — without the pageable staging (and wait) torch
    would add for a strided host copy, and without a call per page.

    The rank's part of the job is gathered on the device into a contiguous scratch
    (``[blocks, layers, K/V, block_size, rank heads, head_dim]``) and moved in one DMA to or from
    a contiguous pinned staging buffer; the CPU does the strided part. A load fills the staging
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
    page = tuple(plan.device_kv[0].shape[-4:])  # K/V, block_size, rank heads, head_dim
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


def _copy_pairs_numpy(plan: _CopyPlan, job: CopyJob, host: np.ndarray, device_kv: Sequence[np.ndarray]) -> int:
    """CPU variant of :func:`_copy_pairs`: ``numpy.copyto`` between byte views of the same memory.

    ``numpy.copyto`` releases the GIL and runs on the calling thread only (torch's parallel copy
    measured slower on busy hosts), and slicing numpy views costs a fraction of torch's, which
    matters for the many small page copies of the per-layer layout.
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
    device blocks are one copy each (one per layer with the per-layer layout).

    A worker takes up to ``_MAX_JOBS_PER_HOP`` queued jobs per thread hop and reports them when
    the batch is done; a job restricted to some layers ends its batch, so a layer-wise load sees
    each layer group as soon as it is copied (the jobs of one load run on the workers in
    submission order, ``max_concurrent_jobs`` at a time).
    """

    def __init__(
        self,
        device_kv: torch.Tensor | Sequence[torch.Tensor],
        geometry: KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        tp_rank: int = 0,
        *,
        max_queued_jobs: int = 1024,
        max_concurrent_jobs: int = 2,
    ) -> None:
        device = _first_tensor(device_kv).device
        if device.type != "cpu":
            raise ConfigError(f"CpuCopyEngine needs CPU tensors, device_kv is on {device}")
        if max_concurrent_jobs < 1:
            raise ConfigError(f"max_concurrent_jobs must be >= 1, got {max_concurrent_jobs}")
        super().__init__(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, max_queued_jobs=max_queued_jobs)
        self._concurrency = max_concurrent_jobs
        self._limiter = anyio.CapacityLimiter(max_concurrent_jobs)
        # Byte views (last dim = head_dim * itemsize) of the same memory; never copies.
        self._host_bytes = self._plan.host.view(torch.uint8).numpy()
        self._device_bytes = [t.view(torch.uint8).numpy() for t in self._plan.device_kv]

    async def _start_workers(self, tg: anyio.abc.TaskGroup) -> None:
        for _ in range(self._concurrency):
            tg.start_soon(self._worker)

    async def _worker(self) -> None:
        async for item in self._receive:
            # Take whatever else is queued too (up to a bound): one thread hop per batch, not per
            # job, keeps the hand-off cost small next to a copy of a few hundred microseconds.
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
                nbytes = _copy_pairs_numpy(self._plan, job, self._host_bytes, self._device_bytes)
            except Exception as exc:  # noqa: BLE001 - reported per job by the caller
                outcomes.append((0, time.monotonic() - start, exc))
            else:
                outcomes.append((nbytes, time.monotonic() - start, None))
        return outcomes


# --------------------------------------------------------------------------------------------
# CUDA engine
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _IssuedJob:
    job: CopyJob
    started: Any  # event recorded on the stream before the job's first copy (timing)
    done: Any  # event recorded after its last copy (timing, blocking sync)
    nbytes: int
    start: float  # time.monotonic() when issuing began
    finish: Callable[[], None] | None = None  # host-side work once the copies are done (staged stores)

    def wait(self) -> None:
        """Block until the job's copies are done, then do its host-side part (helper thread)."""
        self.done.synchronize()
        if self.finish is not None:
            self.finish()


class _Completions:
    """The issued jobs of one stream, reported in order as their ``done`` events fire.

    :meth:`run` waits for the oldest job's event on a helper thread (``event.synchronize()`` of a
    blocking-sync event: the thread sleeps in the driver until the copies are done, then the loop
    is told at once) — no polling loop, so a job is seen done within a thread wake-up of its
    copies finishing instead of an event-loop sleep (rounded up to ~1 ms on asyncio and trio).
    Events of one stream fire in the order they were recorded, so waiting for the oldest is
    waiting for the next to finish. Duck-typed events (``synchronize()``,
    ``elapsed_time(other)``), so the logic is testable without CUDA.
    """

    def __init__(self, report: Callable[[_IssuedJob, float, BaseException | None], None]) -> None:
        self._report = report
        self._jobs: collections.deque[_IssuedJob] = collections.deque()
        self._arrived = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, issued: _IssuedJob) -> None:
        self._jobs.append(issued)
        self._arrived.set()

    async def run(self) -> None:
        """Report jobs as they finish, until cancelled."""
        while True:
            if not self._jobs:
                self._arrived = anyio.Event()
                await self._arrived.wait()
                continue
            issued = self._jobs[0]
            # Cancelled (closing), the thread is left to finish on its own and the job stays
            # queued: :meth:`fence` then waits for it, with a deadline.
            error = await self._wait(issued, abandon_on_cancel=True)
            self._jobs.popleft()
            self._report(issued, _gpu_seconds(issued), error)

    async def fence(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every remaining job's copies, reporting each as done; False
        (the rest left unreported, their copies possibly running) if they did not finish."""
        with anyio.move_on_after(timeout):
            while self._jobs:
                issued = self._jobs[0]
                error = await self._wait(issued, abandon_on_cancel=True)
                self._jobs.popleft()
                self._report(issued, _gpu_seconds(issued), error)
            return True
        return False

    async def _wait(self, issued: _IssuedJob, *, abandon_on_cancel: bool) -> BaseException | None:
        """:meth:`_IssuedJob.wait` on the helper thread; the exception it raised, if any (the job
        then fails: its bytes may be incomplete)."""
        try:
            await anyio.to_thread.run_sync(issued.wait, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel)
        except Exception as exc:  # noqa: BLE001 - reported with the job
            return exc
        return None

    def take_all(self) -> list[_IssuedJob]:
        jobs = list(self._jobs)
        self._jobs.clear()
        return jobs


def _gpu_seconds(issued: _IssuedJob) -> float:
    """The job's copy time measured by the device (its two timing events), else wall time."""
    try:
        return float(issued.started.elapsed_time(issued.done)) / 1000.0
    except Exception:  # noqa: BLE001 - an event without timing: the host's view is still right
        return time.monotonic() - issued.start


class CudaCopyEngine(CopyEngine):
    """Copy engine for CUDA device tensors and a pinned host buffer.

    Copies are issued (``non_blocking=True``) on a dedicated stream per direction, after the
    stream waits for the caller's order event (module docstring, "Ordering"). Each job records a
    timing event before its first copy and a blocking-sync timing event after its last; per
    stream a :class:`_Completions` helper thread waits for the oldest job's event and reports it
    (``CopyResult.seconds`` is the device's own measure of the copies, ``done`` the event).
    Issuing happens in a worker thread (own limiter of 1, so jobs enter their stream in
    submission order) to keep Python launch overhead off the loop. A layer-wise load submits one
    job per layer group, so each group gets its own event.

    Fences: a job whose issuing fails part-way is failed only after the copies it did issue have
    finished (an event recorded after them is waited for), so its slots and blocks are never
    released under a live copy; :meth:`aclose` waits for every issued copy of both streams; if they
    do not finish within the close timeout, :attr:`fenced` is False and the engine's owner must
    not release the host buffer (``kvtier.Engine`` then keeps it, and says so).

    Copy granularity, never one Python call per page: cross-layer at TP 1 (all layers) copies each
    run of consecutive blocks in one DMA; per-layer at TP 1 gathers the job's pages on the device
    and copies each chunk in one DMA (:func:`_copy_gathered`). Everything else — a TP > 1 rank,
    whose heads are strided inside each host page, or a layer group of a multi-block chunk, strided
    in its slot — is gathered on the device and moved through a contiguous pinned staging buffer
    (:func:`_copy_staged`), the CPU doing the strided part: for a store after the DMA, on the
    completion thread, before the job is reported.
    """

    def __init__(
        self,
        device_kv: torch.Tensor | Sequence[torch.Tensor],
        geometry: KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        tp_rank: int = 0,
        *,
        max_queued_jobs: int = 1024,
    ) -> None:
        # Checked before the base class opens its job channel, so a refused engine owns nothing.
        if not torch.cuda.is_available():
            raise ConfigError("CudaCopyEngine needs CUDA; torch.cuda.is_available() is False")
        device = _first_tensor(device_kv).device
        if device.type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs CUDA tensors, device_kv is on {device}")
        if not buffer.pinned:
            raise ConfigError("CudaCopyEngine needs a pinned host buffer (SlotBuffer(pin_memory=True))")
        super().__init__(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, max_queued_jobs=max_queued_jobs)
        self._cuda_device = self._plan.device
        # Every CUDA object is created here, after the availability check.
        self._streams = {
            "to_host": torch.cuda.Stream(device=self._cuda_device),
            "to_device": torch.cuda.Stream(device=self._cuda_device),
        }
        self._issue_limiter = anyio.CapacityLimiter(1)
        self._completions = {direction: _Completions(self._report_issued) for direction in self._streams}

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

    def hand_over(self, order: CopyOrder | None, result: CopyResult) -> None:
        if order is not None and result.done is not None:
            order.stream.wait_event(result.done)

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

    def _issue(self, job: CopyJob, ready: Any) -> _IssuedJob:
        """Enqueue the job's copies between its two events (worker thread; waits only to fence a
        job that failed part-way)."""
        stream = self._streams[job.direction]
        start = time.monotonic()
        with torch.cuda.device(self._cuda_device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            finish = None
            try:
                if self._plan.gathers(job):
                    nbytes = _copy_gathered(self._plan, job, non_blocking=True)
                elif self._plan.runs_contiguous(job):
                    nbytes = _copy_pairs(self._plan, job, non_blocking=True)
                else:
                    nbytes, finish = _copy_staged(self._plan, job, non_blocking=True)
            except BaseException:
                fence = torch.cuda.Event()
                fence.record(stream)
                fence.synchronize()  # the copies already issued end before the job is failed
                raise
            done = torch.cuda.Event(enable_timing=True, blocking=True)
            done.record(stream)
        return _IssuedJob(job, started, done, nbytes, start, finish)

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
            self._completions[job.direction].add(issued)

    def _report_issued(self, issued: _IssuedJob, seconds: float, error: BaseException | None) -> None:
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
                self._fail(issued.job, "closed", time.monotonic() - issued.start)


def make_copy_engine(
    device_kv: torch.Tensor | Sequence[torch.Tensor],
    geometry: KVGeometry,
    blocks_per_chunk: int,
    buffer: SlotBuffer,
    tp_rank: int = 0,
    **options: Any,
) -> CopyEngine:
    """The CUDA engine when ``device_kv`` lives on a CUDA device, the CPU engine otherwise."""
    if _first_tensor(device_kv).device.type == "cuda":
        return CudaCopyEngine(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, **options)
    return CpuCopyEngine(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, **options)

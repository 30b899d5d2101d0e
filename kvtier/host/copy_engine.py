"""The copy-engine contract: move chunk bytes between the device KV cache and host slots,
asynchronously.

A copy engine is an async component (one anyio task group) with a synchronous, NON-BLOCKING
front: the loop thread calls :meth:`CopyEngine.submit` and later drains
:meth:`CopyEngine.get_finished`. Every submitted job is reported **exactly once**, successful or
not, including jobs refused because the queue was full and jobs still queued at :meth:`aclose`.

Who pins what: the caller (the engine / host tier) pins the host slots for the job's whole
lifetime (``prepare_store``/``prepare_load`` before submit, ``complete_*`` after the result) and
keeps the device blocks allocated until the result arrives. The engine only copies bytes; the
layouts it copies between are described in :mod:`kvtier.host.copy_plan`.

An engine is opened for a :class:`kvtier.model.KVModel` (or a :class:`kvtier.layout.KVGeometry`,
its one-group case): a job copies chunks of one KV-cache group (``CopyJob.group``), every part
of that group's pages, between the group's device blocks and the host slots shared by all groups.

A job may be restricted to a range of layers (``CopyJob.layers``): layer-wise loading
(``kvtier.engine.layerwise``) submits one job per group of layers, in layer order, so a caller can
compute layer ``i`` while layer ``i + 1`` is still copying. Such a job is reported as soon as its
own copies are done (the CPU engine never holds its result back for other jobs), and a job not
yet started can be withdrawn with :meth:`CopyEngine.cancel`.

Two engines implement the contract: :class:`kvtier.host.cpu_copy.CpuCopyEngine` (the "device" is
CPU memory; copies run in worker threads) and :class:`kvtier.host.cuda_copy.CudaCopyEngine`
(copies on dedicated CUDA streams; a helper thread waits for each job's completion event, so the
loop thread never waits for the device). :func:`kvtier.host.copy_factory.make_copy_engine` picks
the one that fits a KV cache.

Ordering with the caller's device work (CUDA; the contract a caller reads):

* **A copy waits for the caller's stream as it was at the call.** :meth:`CopyEngine.capture_order`
  runs in the caller's thread when the caller's operation starts (``Engine.store``/``load`` call
  it first thing, the blocking facade in the thread that calls it): it records an event on the
  caller's stream — the one given, else the calling thread's current stream on the engine's
  device — or takes the event the caller gives (``after``). The job's copies are issued on the
  engine's own stream after that event: a store reads the KV only after the kernels that wrote it,
  a load overwrites blocks only after the work that last read them. Work the caller enqueues later
  is not waited for.
* **A load's bytes are ordered before the caller's later work.** :meth:`CopyEngine.hand_over`
  makes the caller's stream wait for a job's completion event, so kernels the caller enqueues on
  that stream afterwards see the loaded KV. A load hands its job over once it finished; a
  layer-wise load hands each group over as soon as its copies are on the engine's stream
  (:meth:`CopyEngine.get_issued`), so the caller's host code runs ahead of the copies and the
  device orders its kernels after them.
* Without CUDA both are no-ops (``capture_order`` refuses a ``stream``/``after``: there is
  nothing to order against).
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from kvtier.errors import ConfigError
from kvtier.host.copy_jobs import CopyJob, CopyOrder, CopyResult
from kvtier.host.copy_plan import DeviceKV, plan_copies

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry
    from kvtier.model import KVModel

__all__ = ["CopyEngine", "CLOSE_TIMEOUT_S"]

#: How long :meth:`CopyEngine.aclose` waits for the task group to finish.
CLOSE_TIMEOUT_S = 5.0


class CopyEngine(abc.ABC):
    """Asynchronous device ↔ host chunk copier (one anyio task group).

    * :meth:`submit` never blocks and never raises for a bad or refused job: a malformed job, a
      full queue (``max_queued_jobs``) or a closed engine produce an immediate failed result.
    * :meth:`get_finished` drains the results collected so far; it never waits and returns each
      result exactly once.
    * The wakeup callback (:meth:`set_wakeup`) is called from the loop thread whenever a result
      becomes available, and when a layer group is issued (:meth:`get_issued`).
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
        device_kv: DeviceKV,
        model: KVModel | KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        *,
        max_queued_jobs: int = 1024,
    ) -> None:
        if max_queued_jobs < 1:
            raise ConfigError(f"max_queued_jobs must be >= 1, got {max_queued_jobs}")
        self._plans = plan_copies(device_kv, model, blocks_per_chunk, buffer)
        # Opened last, so a constructor that raises leaves nothing to close. Each queued item
        # carries what the engine prepared at submit time (see _on_submit).
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
        """Bytes one chunk of group 0 occupies in a host slot (this rank's heads)."""
        return self._plans.model.chunk_bytes(0, self._plans.blocks_per_chunk)

    @property
    def num_blocks(self) -> int:
        """Blocks of group 0's device KV cache: its valid block ids are ``[0, num_blocks)``."""
        return self._plans.group_blocks[0]

    @property
    def group_blocks(self) -> tuple[int, ...]:
        """Device blocks of each KV-cache group: group ``g``'s valid block ids are ``[0, group_blocks[g])``."""
        return self._plans.group_blocks

    @property
    def num_groups(self) -> int:
        """KV-cache groups of the model (valid ``CopyJob.group`` values are ``[0, num_groups)``)."""
        return len(self._plans.groups)

    def submit(self, job: CopyJob) -> None:
        """Queue ``job`` without waiting; a refused job is reported failed right away."""
        if self._closed:
            self._fail(job, "closed")
            return
        problem = self._plans.validate(job)
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

    def hand_over(self, order: CopyOrder | None, done: Any) -> None:
        """After a job to the device was issued (``done``: its completion event, from
        :meth:`get_issued` or ``CopyResult.done``): the caller's later work waits for its bytes.

        Nothing to do here (CPU copies are complete when reported); the CUDA engine makes
        ``order.stream`` wait for ``done``.
        """

    def get_issued(self) -> list[tuple[int, Any]]:
        """Layer-group jobs to the device (``CopyJob.layers`` set) whose copies were put on a
        device stream since the last call, as ``(job_id, done)``, never waiting: device work
        ordered after ``done`` (:meth:`hand_over`) sees the job's bytes before the job is
        reported finished (the wakeup callback fires for these too). Every job is still reported
        by :meth:`get_finished`. None here: CPU copies are complete only when reported."""
        return []

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

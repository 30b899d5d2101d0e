"""An engine's device ↔ host copies: jobs submitted to its copy engine, their results awaited.

Semantics callers rely on:

* Every job submitted is reported exactly once (the copy engine promises it, also when it closes),
  so :meth:`DeviceCopies.wait` always ends. A result lands on its :class:`PendingCopy` when
  :meth:`DeviceCopies.dispatch` drains the copy engine: the engine's drive task does that on every
  wake-up, and a wait also dispatches by itself every second, so it ends even when no drive task
  runs any more. Layer-group copies the copy engine reports issued (CUDA) land there too
  (:meth:`DeviceCopies.wait_issued`): a layer-wise load hands them over before they finish.
* :meth:`DeviceCopies.copy` is one whole copy, and its wait is shielded from cancellation: a
  submitted copy cannot be recalled, and its caller releases the host slots (and may reuse the
  device blocks) as soon as it returns.
* The counters (:meth:`DeviceCopies.statistics`) take each finished copy once: its bytes and
  seconds when it succeeded, a failure otherwise. A copy withdrawn with :meth:`DeviceCopies.cancel`
  before it started is neither.
* Everything runs on the engine's event-loop thread, except :meth:`DeviceCopies.capture_order`,
  which runs in the caller's thread, first thing in its operation.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.host.copy_jobs import CopyJob
from kvtier.stats import SIZE_BUCKETS, Histogram, HistogramSnapshot

if TYPE_CHECKING:
    from kvtier.host.copy_engine import CopyEngine
    from kvtier.host.copy_jobs import CopyOrder, CopyResult, Direction

__all__ = ["CopyStatistics", "CopyCounters", "PendingCopy", "DeviceCopies"]

#: How long a wait for a copy result lasts before it drains the copy engine itself.
_PROGRESS_S = 1.0


@dataclass(frozen=True, slots=True)
class CopyStatistics:
    """Device ↔ host copy counters (read by ``kvtier.metrics``)."""

    bytes_to_host: int
    bytes_to_device: int
    seconds_to_host: float
    seconds_to_device: float
    store_size: HistogramSnapshot
    load_size: HistogramSnapshot
    failures: int


class CopyCounters:
    """Bytes, seconds and sizes of the copies that succeeded, per direction; the failures."""

    def __init__(self) -> None:
        self.bytes = {"to_host": 0, "to_device": 0}
        self.seconds = {"to_host": 0.0, "to_device": 0.0}
        self.sizes = {"to_host": Histogram(SIZE_BUCKETS), "to_device": Histogram(SIZE_BUCKETS)}
        self.failures = 0

    def record(self, direction: str, result: CopyResult) -> None:
        if not result.success:
            self.failures += 1
            return
        self.bytes[direction] += result.nbytes
        self.seconds[direction] += result.seconds
        self.sizes[direction].observe(result.nbytes)

    def statistics(self) -> CopyStatistics:
        return CopyStatistics(
            bytes_to_host=self.bytes["to_host"],
            bytes_to_device=self.bytes["to_device"],
            seconds_to_host=self.seconds["to_host"],
            seconds_to_device=self.seconds["to_device"],
            store_size=self.sizes["to_host"].snapshot(),
            load_size=self.sizes["to_device"].snapshot(),
            failures=self.failures,
        )


@dataclass(slots=True, eq=False)
class PendingCopy:
    """One submitted copy job; ``result`` is set, and ``done``, once the copy engine reported it.
    ``issued`` is set once its copies are on a device stream (``done_event``: the event device work
    can be ordered after, see :meth:`DeviceCopies.wait_issued`) or once it was reported."""

    job_id: int
    direction: Direction
    done: anyio.Event = field(default_factory=anyio.Event)
    result: CopyResult | None = None
    counted: bool = False
    issued: anyio.Event = field(default_factory=anyio.Event)
    done_event: Any = None


class DeviceCopies:
    """The copies of one engine: ids, the copies awaiting their result, the counters.

    ``copy_engine`` is ``None`` for an engine opened without ``device_kv``: then
    :meth:`submit` raises ``RuntimeError`` and :meth:`capture_order` refuses a ``stream``/``after``.
    """

    def __init__(self, copy_engine: CopyEngine | None) -> None:
        self.copy_engine = copy_engine
        self._ids = itertools.count()
        self._pending: dict[int, PendingCopy] = {}
        self._counters = CopyCounters()

    @property
    def num_device_blocks(self) -> int | None:
        """Blocks of the device KV cache of group 0 (valid block ids are ``[0, n)``); ``None`` without one."""
        return None if self.copy_engine is None else self.copy_engine.num_blocks

    @property
    def group_blocks(self) -> tuple[int, ...] | None:
        """Device blocks of each KV-cache group; ``None`` without a device KV cache."""
        return None if self.copy_engine is None else self.copy_engine.group_blocks

    def capture_order(self, stream: Any, after: Any) -> CopyOrder | None:
        """The caller's place among its device work (:meth:`CopyEngine.capture_order`).

        Call it in the caller's thread, first thing in the operation. Without a copy engine a
        ``stream`` or ``after`` is a ``ValueError``.
        """
        if self.copy_engine is None:
            if stream is not None or after is not None:
                raise ValueError("stream= and after= need an engine opened with device_kv")
            return None
        return self.copy_engine.capture_order(stream, after)

    def submit(self, direction: Direction, slot_ids: Sequence[int], block_ids: Sequence[int],
               order: CopyOrder | None, layers: tuple[int, int] | None = None, group: int = 0) -> PendingCopy:
        """Queue one copy job of KV-cache group ``group`` without waiting; :meth:`wait` for its result."""
        if self.copy_engine is None:
            raise RuntimeError("this engine was opened without device_kv; it cannot copy KV")
        copy = PendingCopy(next(self._ids), direction)
        self._pending[copy.job_id] = copy
        self.copy_engine.submit(CopyJob(copy.job_id, direction, slot_ids, block_ids, layers=layers, order=order,
                                        group=group))
        return copy

    def dispatch(self) -> None:
        """Hand every issue report and result the copy engine has to its :class:`PendingCopy`."""
        if self.copy_engine is None:
            return
        for job_id, done_event in self.copy_engine.get_issued():
            copy = self._pending.get(job_id)
            if copy is not None:
                copy.done_event = done_event
                copy.issued.set()
        for result in self.copy_engine.get_finished():
            copy = self._pending.pop(result.job_id, None)
            if copy is not None:
                copy.result = result
                copy.done.set()
                copy.issued.set()

    async def wait(self, copy: PendingCopy) -> CopyResult:
        """``copy``'s result, once reported (not shielded: the caller decides)."""
        while not copy.done.is_set():
            with anyio.move_on_after(_PROGRESS_S):
                await copy.done.wait()
            self.dispatch()
        assert copy.result is not None
        return copy.result

    async def wait_issued(self, copy: PendingCopy) -> Any:
        """Once ``copy`` is on a device stream: its completion event, which the caller's device
        work can be ordered after (:meth:`hand_over`) while the copy still runs; ``None`` once it
        was reported instead (its ``result`` says how it went). Only the CUDA engine reports
        copies issued; with the CPU engine this waits for the result."""
        while not copy.issued.is_set():
            with anyio.move_on_after(_PROGRESS_S):
                await copy.issued.wait()
            self.dispatch()
        return None if copy.done.is_set() else copy.done_event

    def discard(self, copy: PendingCopy) -> None:
        """Stop awaiting ``copy`` (its result, if one still comes, is dropped)."""
        self._pending.pop(copy.job_id, None)

    def cancel(self, copy: PendingCopy) -> None:
        """Withdraw ``copy`` if no worker started it (:meth:`CopyEngine.cancel`); it is still reported."""
        if not copy.done.is_set() and self.copy_engine is not None:
            self.copy_engine.cancel(copy.job_id)

    def count(self, copy: PendingCopy) -> None:
        """Add a reported copy to the counters, once; a withdrawn copy is not a failure."""
        if copy.counted or copy.result is None:
            return
        copy.counted = True
        if copy.result.error != "cancelled":
            self._counters.record(copy.direction, copy.result)

    def hand_over(self, order: CopyOrder | None, done: Any) -> None:
        """After a copy to the device was issued (``done``: its completion event, or a successful
        result's ``done``): the caller's later device work waits for its bytes."""
        if self.copy_engine is not None:
            self.copy_engine.hand_over(order, done)

    async def copy(self, direction: Direction, slot_ids: Sequence[int], block_ids: Sequence[int],
                   order: CopyOrder | None) -> CopyResult:
        """Submit one copy (of group 0) and wait for it, shielded (module docstring); count it,
        hand it over."""
        return (await self.copy_groups(direction, [(0, slot_ids, block_ids)], order))[0]

    async def copy_groups(self, direction: Direction, jobs: Sequence[tuple[int, Sequence[int], Sequence[int]]],
                          order: CopyOrder | None) -> list[CopyResult]:
        """Submit one copy per ``(group, slot_ids, block_ids)``, all at once, and wait for every
        one, shielded (module docstring); count them, hand the successful loads over."""
        pending = [self.submit(direction, slots, blocks, order, group=group) for group, slots, blocks in jobs]
        results: list[CopyResult] = []
        with anyio.CancelScope(shield=True):
            try:
                for copy in pending:
                    results.append(await self.wait(copy))
            finally:
                for copy in pending:
                    self.discard(copy)
        for copy, result in zip(pending, results):
            self.count(copy)
            if direction == "to_device" and result.success:
                self.hand_over(order, result.done)
        return results

    def statistics(self) -> CopyStatistics:
        return self._counters.statistics()

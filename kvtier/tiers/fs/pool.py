"""The dual-queue thread pool the fs tier runs its blocking file work on.

``n_read`` read-priority and ``n_write`` write-priority threads over two FIFO queues
(:class:`IOQueue`); a whole job's chunks go in together (:meth:`DualQueuePool.run_slices`), are
cut into slices only when workers would otherwise idle, and the event loop is woken once per job,
never once per chunk. See :class:`DualQueuePool` for cancellation, back-pressure and the hand-off
to the loop.
"""

from __future__ import annotations

import collections
import enum
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

__all__ = ["IOQueue", "DualQueuePool", "MAX_SLICE_ITEMS", "PoolStatistics", "usable_cpus"]

#: The most items one slice of a :meth:`DualQueuePool.run_slices` batch holds, so that a long job
#: stays open to workers that free up while it runs (a job of vLLM's usual size is one slice).
MAX_SLICE_ITEMS = 64

T = TypeVar("T")
A = TypeVar("A")


class IOQueue(enum.Enum):
    """Which queue a task joins: loads go to ``READ``, stores and deletions to ``WRITE``."""

    READ = "read"
    WRITE = "write"


class _State(enum.Enum):
    QUEUED = 0
    RUNNING = 1
    FINISHED = 2


class _Waitable:
    """Something the loop awaits: one task, or a batch of tasks reported together."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = anyio.Event()


class _Task(_Waitable, Generic[T]):
    __slots__ = ("fn", "args", "state", "result", "error", "batch")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...], batch: _Batch | None = None) -> None:
        if batch is None:
            super().__init__()  # a task of a batch is awaited through the batch's event only
        self.fn = fn
        self.args = args
        self.state = _State.QUEUED
        self.result: T | None = None
        self.error: BaseException | None = None
        self.batch = batch


class _Batch(_Waitable):
    """Tasks submitted together; the loop is woken once, when the last one finished.

    ``tasks`` are its slices in item order (one, until the worker that takes it cuts it), and
    ``cut`` says whether that worker has decided yet; all three change under the pool's lock.
    """

    __slots__ = ("remaining", "queue", "tasks", "cut")

    def __init__(self, queue: IOQueue) -> None:
        super().__init__()
        self.remaining = 1
        self.queue = queue
        self.tasks: list[_Task[Any]] = []
        self.cut = False


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, which container limits narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _call_each(fn: Callable[..., T], arg_tuples: Sequence[tuple[Any, ...]]) -> list[T | Exception]:
    """Worker side of ``run_batch``: ``fn(*args)`` for each ``args``, or the exception it raised.

    Results are plain values, not wrapper objects: at page-cache speeds a chunk takes about as
    long as a few thousand bytecodes, and every bytecode run under the GIL per chunk is felt by
    all workers.
    """
    results: list[T | Exception] = []
    for args in arg_tuples:
        try:
            results.append(fn(*args))
        except Exception as exc:  # noqa: BLE001 - reported per call to the awaiting tier
            results.append(exc)
    return results


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    queued_reads: int
    queued_writes: int
    running: int
    completed: int
    read_threads: int
    write_threads: int


class DualQueuePool:
    """``n_read`` read-priority and ``n_write`` write-priority worker threads over two FIFO queues.

    A worker takes from its own queue when it is non-empty and otherwise *steals* from the other
    one, so a burst of stores never leaves the read workers idle (and vice versa) while each
    direction keeps its reserved workers. A :meth:`run_slices` batch (one job's chunks) is queued
    whole; the worker that takes it cuts it into slices for the workers that would otherwise idle
    (see there), so one job alone runs in parallel across workers and a burst of jobs costs one
    hand-off each.

    Hand-off to the event loop: a worker never waits for the loop. Finished work is collected
    under the pool's lock and the loop is woken with a non-blocking ``run_sync_soon`` (asyncio
    ``call_soon_threadsafe`` / trio ``run_sync_soon``), at most one wake-up pending at a time; a
    batch wakes the loop once, not once per task.

    Lifecycle: :meth:`start` from the event-loop thread (it records the loop's token so workers
    can wake it on asyncio and trio alike), :meth:`aclose` once; the threads are owned by the pool
    and joined in ``aclose``. Queues are unbounded: back-pressure is the caller's (the tier bounds
    concurrent stores/loads), so :meth:`run` never blocks on a full queue.
    """

    def __init__(self, n_read: int, n_write: int, *, name: str = "kvtier-io", batch_slices: int | None = None) -> None:
        if n_read < 1 or n_write < 1:
            raise ValueError(f"a pool needs ≥ 1 read and ≥ 1 write thread, got {n_read}/{n_write}")
        if batch_slices is not None and batch_slices < 1:
            raise ValueError(f"batch_slices must be ≥ 1, got {batch_slices}")
        self._n_read = n_read
        self._n_write = n_write
        #: The most slices :meth:`run_slices` cuts a batch into (see there).
        self.batch_slices = batch_slices or min(n_read + n_write, usable_cpus())
        self._name = name
        self._cond = threading.Condition()
        self._queues: dict[IOQueue, collections.deque[_Task[Any]]] = {
            IOQueue.READ: collections.deque(),
            IOQueue.WRITE: collections.deque(),
        }
        self._finished: list[_Waitable] = []
        self._wake_pending = False
        self._running = 0
        self._completed = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None

    def start(self) -> None:
        """Start the worker threads. Call once, from the event loop that will await :meth:`run`."""
        if self._threads:
            raise RuntimeError("pool already started")
        self._token = anyio.lowlevel.current_token()
        for i in range(self._n_read + self._n_write):
            own = IOQueue.READ if i < self._n_read else IOQueue.WRITE
            suffix = f"r{i}" if own is IOQueue.READ else f"w{i - self._n_read}"
            thread = threading.Thread(target=self._worker, args=(own,), name=f"{self._name}-{suffix}", daemon=True)
            self._threads.append(thread)
            thread.start()

    async def run(self, queue: IOQueue, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a worker; return its result or raise its exception.

        Cancellation: a task still queued is withdrawn and never runs. A task already running
        cannot be interrupted (it may be filling a caller's buffer), so cancellation waits,
        shielded, until it finishes and then re-raises the cancellation — when this returns or
        raises, no thread touches ``args`` any more. Raises ``anyio.ClosedResourceError`` after
        :meth:`aclose`.
        """
        task: _Task[T] = _Task(fn, args)
        with self._cond:
            if self._stopping or not self._threads:
                raise anyio.ClosedResourceError("I/O pool is not running")
            self._queues[queue].append(task)
            self._cond.notify()
        try:
            await task.done.wait()
        except BaseException:
            with self._cond:
                if task.state is _State.QUEUED and task in self._queues[queue]:
                    self._queues[queue].remove(task)
                    raise
            with anyio.CancelScope(shield=True):
                await task.done.wait()
            raise
        if task.error is not None:
            raise task.error
        return task.result  # type: ignore[return-value]

    async def run_batch(self, queue: IOQueue, fn: Callable[..., T],
                        arg_tuples: Sequence[tuple[Any, ...]]) -> list[T | BaseException]:
        """Run ``fn(*args)`` for every ``args`` of ``arg_tuples`` in parallel across workers.

        Returns one result per call, co-indexed: the value ``fn`` returned, or the exception it
        raised (a failing call does not stop the others; ``fn`` must not *return* exceptions).
        Slices, the single wake-up, cancellation and closing as in :meth:`run_slices`.
        """
        return await self.run_slices(queue, partial(_call_each, fn), arg_tuples)

    async def run_slices(self, queue: IOQueue, fn: Callable[[Sequence[A]], Sequence[T]],
                         items: Sequence[A]) -> list[T | BaseException]:
        """Run ``fn(part)`` for consecutive parts of ``items`` in parallel across workers: ``fn``
        takes a slice of items and returns one result per item, co-indexed.

        Returns one result per item: what ``fn`` returned for it, or the exception that ended
        its slice (``fn`` raising, or returning a result count other than the slice's, fails
        every item of that slice only). The caller is woken ONCE, when the last slice finished.

        Slices: ``items`` are queued as one task. The worker that takes it counts the workers
        that nothing else queued will occupy and cuts the items into that many more slices of
        consecutive items (at most :attr:`batch_slices` in all) — or into slices of at most
        :data:`MAX_SLICE_ITEMS` items, if that makes more — runs the first and puts the rest at
        the head of the queue. A job alone thus runs on as many workers as there are slices, a
        long job is shared by the workers that free up while it runs, and a burst of jobs — as
        many as the workers, or more — goes one job per worker, each with one hand-off: at
        page-cache speeds a hand-off costs about what a chunk read does, and on a small machine
        the workers of several jobs already fill the cores.

        Cancellation as in :meth:`run`: queued slices are withdrawn and never run, running ones
        are waited for (shielded), then the cancellation propagates — afterwards no thread
        touches any item.
        Raises ``anyio.ClosedResourceError`` after :meth:`aclose`, and ``TypeError`` when
        ``items`` is not a sequence (a worker cuts it into slices).
        """
        if not isinstance(items, Sequence):
            raise TypeError(f"run_slices() takes a sequence of items (a list or tuple), got {type(items).__name__}")
        if not items:
            return []
        batch = _Batch(queue)
        batch.tasks.append(_Task(fn, (items,), batch))
        with self._cond:
            if self._stopping or not self._threads:
                raise anyio.ClosedResourceError("I/O pool is not running")
            self._queues[queue].append(batch.tasks[0])
            self._cond.notify()
        try:
            await batch.done.wait()
        except BaseException:
            with self._cond:
                withdrawn = [t for t in batch.tasks if t.state is _State.QUEUED]
                if withdrawn:
                    ids = {id(t) for t in withdrawn}
                    q = self._queues[queue]
                    kept = [t for t in q if id(t) not in ids]
                    q.clear()
                    q.extend(kept)
                    for t in withdrawn:
                        t.state = _State.FINISHED
                    batch.remaining -= len(withdrawn)
                outstanding = batch.remaining > 0
            if outstanding:
                with anyio.CancelScope(shield=True):
                    await batch.done.wait()
            batch.tasks = []  # as below
            raise
        # Tasks and their batch refer to each other: drop the tasks now, so that the items (views of
        # a caller's buffer) go with the last reference, not with a later garbage collection.
        tasks, batch.tasks = batch.tasks, []
        results: list[T | BaseException] = []
        for task in tasks:
            part = task.args[0]
            error = task.error
            if error is None:
                assert task.result is not None
                if len(task.result) == len(part):
                    results.extend(task.result)
                    continue
                error = ValueError(f"{getattr(fn, '__name__', fn)!r} returned {len(task.result)} results "
                                   f"for {len(part)} items")
            results.extend([error] * len(part))  # the slice never ran (pool closed), or it failed
        return results

    def statistics(self) -> PoolStatistics:
        with self._cond:
            return PoolStatistics(
                queued_reads=len(self._queues[IOQueue.READ]),
                queued_writes=len(self._queues[IOQueue.WRITE]),
                running=self._running,
                completed=self._completed,
                read_threads=self._n_read,
                write_threads=self._n_write,
            )

    async def aclose(self) -> None:
        """Stop accepting tasks, fail the ones still queued, let running ones finish, join.

        Joining happens off the event loop. Shielded from cancellation: the threads are always
        joined before this returns.
        """
        with self._cond:
            self._stopping = True
            leftovers = [t for q in self._queues.values() for t in q]
            for q in self._queues.values():
                q.clear()
            for t in leftovers:
                t.error = anyio.ClosedResourceError("I/O pool closed before the task ran")
                self._settle_locked(t)
            self._cond.notify_all()
        with anyio.CancelScope(shield=True):
            threads, self._threads = self._threads, []
            await anyio.to_thread.run_sync(_join_all, threads, limiter=anyio.CapacityLimiter(1))
            self._dispatch()

    # --- worker side --------------------------------------------------------------------------
    def _worker(self, own: IOQueue) -> None:
        other = IOQueue.WRITE if own is IOQueue.READ else IOQueue.READ
        mine, theirs = self._queues[own], self._queues[other]
        while True:
            with self._cond:
                while not (self._stopping or mine or theirs):
                    self._cond.wait()
                if self._stopping:
                    return
                task = mine.popleft() if mine else theirs.popleft()
                task.state = _State.RUNNING
                self._running += 1
                batch = task.batch
                if batch is not None and not batch.cut:
                    self._cut_locked(batch, len(mine) + len(theirs))
                del batch
            try:
                task.result = task.fn(*task.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                task.error = exc
            with self._cond:
                self._running -= 1
                self._completed += 1
                need_wake = self._settle_locked(task)
            # An idle worker must not keep its last task (its buffers, its result) alive.
            del task
            if need_wake:
                self._wake_loop()

    def _cut_locked(self, batch: _Batch, queued: int) -> None:
        """Cut ``batch``'s one task (just taken, lock held) into slices for the workers that
        the ``queued`` tasks leave idle, and into slices of at most :data:`MAX_SLICE_ITEMS`
        items; the slices after the first go to the queue's head."""
        batch.cut = True
        task = batch.tasks[0]
        items = task.args[0]
        idle = self._n_read + self._n_write - self._running - queued
        # Slices, not single calls: one lock/wake-up/result per slice rather than per chunk (a
        # page-cache read of a chunk costs about as much as a hand-off). As many slices as CPU
        # cores at most for idle workers: page-cache copies and checksums are CPU work, so more
        # threads on one batch than cores only add switching.
        parts = max(min(self.batch_slices, 1 + idle), -(-len(items) // MAX_SLICE_ITEMS))
        if parts < 2:
            return
        size = -(-len(items) // parts)
        task.args = (items[:size],)
        rest = [_Task(task.fn, (items[i : i + size],), batch) for i in range(size, len(items), size)]
        batch.tasks.extend(rest)
        batch.remaining += len(rest)
        self._queues[batch.queue].extendleft(reversed(rest))
        self._cond.notify(len(rest))

    def _settle_locked(self, task: _Task[Any]) -> bool:
        """Record ``task`` as done (lock held); True when the caller must wake the loop."""
        batch = task.batch
        if batch is not None:
            batch.remaining -= 1
            if batch.remaining:
                return False  # the batch's last task reports for all of them
            self._finished.append(batch)
        else:
            self._finished.append(task)
        if self._wake_pending:
            return False  # a wake-up is already on its way and will collect this one too
        self._wake_pending = True
        return True

    def _wake_loop(self) -> None:
        token = self._token
        if token is None:
            return
        try:
            backend = getattr(token, "backend_class", None)
            if backend is not None and hasattr(backend, "run_sync_soon"):
                # Non-blocking: the worker goes straight back to the queue instead of waiting
                # until the loop has run the dispatch (which ``from_thread.run_sync`` would do).
                # ``backend_class.run_sync_soon`` is anyio's backend interface (checked on 4.16).
                backend.run_sync_soon(self._dispatch, (), token.native_token)
            else:  # public, blocking fallback for anyio versions without that interface
                anyio.from_thread.run_sync(self._dispatch, token=token)
        except RuntimeError:  # anyio.RunFinishedError included
            pass  # the loop is gone (process shutting down); nobody awaits these tasks any more

    def _dispatch(self) -> None:
        """On the loop thread: wake the awaiters of every finished task or batch."""
        with self._cond:
            finished, self._finished = self._finished, []
            self._wake_pending = False
            for w in finished:
                if isinstance(w, _Task):
                    w.state = _State.FINISHED
        for w in finished:
            w.done.set()


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()

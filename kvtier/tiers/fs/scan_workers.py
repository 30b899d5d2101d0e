"""Scan worker processes: the fs tier walks a big block tree outside the engine's interpreter.

A pass over 10^6 chunk files is ~1.7·10^6 ``stat`` calls and as many small steps of Python. Run
on a thread of the engine's process it would share the interpreter lock with the event loop, so
every transfer of every tier would wait behind it (a thread holding the lock keeps it up to
``sys.getswitchinterval()``, 5 ms, at a time). So the fs tier hands big walks to worker
processes: each one is ``python -I`` running :func:`kvtier.tiers.fs.scan.worker_main`, holding the
tree's descriptor (passed at start; it walks it with the same no-follow rules) and answering
:class:`~kvtier.tiers.fs.scan.WalkRequest` frames on its stdin with
:class:`~kvtier.tiers.fs.scan.ScanBatch` frames on its stdout. The loop only decodes batches
(msgspec, validated: a worker's output is bounded and typed like any input) and applies them.

Workers start on a tier's first big pass and are kept for the next ones; a worker whose pass was
cut short (cancelled, failed) is killed, and one that dies is replaced at the next pass. They die
with the engine (``PR_SET_PDEATHSIG`` on Linux; on other systems at their next write). Two
workers walk in parallel where two cores are usable, in turns with the loop: they walk while it
waits, and wait while it applies what they found (a busy loop on the workers' cores would lose
them for whole scheduler ticks, see :class:`_Turns`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from kvtier.tiers.fs.scan import BATCH_HEADER, PassPlan, ScanBatch, ScanStopped, WalkRequest
from kvtier.worker_io import FRAME_HEADER, import_paths

__all__ = ["ScanWorker", "ScanWorkers", "ScanWorkerStartError"]

#: The largest batch a worker may send (a leaf directory of millions of files would come close).
_MAX_BATCH_BYTES = 1 << 30
_STDERR_KEPT = 4096  # of a dead worker's stderr, for the error message
_BOOT = ("import sys; sys.path[:0] = sys.argv[3:]; "
         "from kvtier.tiers.fs.scan import worker_main; worker_main(sys.argv[1:3])")
_DECODER = msgspec.msgpack.Decoder(ScanBatch)
_ENCODER = msgspec.msgpack.Encoder()


class ScanWorkerStartError(OSError):
    """A worker process could not be started (no Python executable, no permission, no memory)."""


class ScanWorker:
    """One worker process and its frame streams."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self._process = process
        self._buffer = bytearray()

    @classmethod
    async def start(cls, dir_fd: int) -> ScanWorker:
        if not sys.executable:
            raise ScanWorkerStartError(errno.ENOENT, "no Python executable (sys.executable is empty)")
        command = [sys.executable, "-I", "-c", _BOOT, str(dir_fd), str(os.getpid()), *import_paths(msgspec)]
        try:
            process = await anyio.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, pass_fds=(dir_fd,), start_new_session=True)
        except OSError as exc:
            raise ScanWorkerStartError(exc.errno, f"{sys.executable}: {exc.strerror or exc}") from exc
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.returncode is None

    async def send(self, request: WalkRequest) -> None:
        payload = _ENCODER.encode(request)
        assert self._process.stdin is not None
        try:
            await self._process.stdin.send(FRAME_HEADER.pack(len(payload)) + payload)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BrokenPipeError) as exc:
            raise OSError(errno.EPIPE, await self._death()) from exc

    async def receive(self) -> ScanBatch:
        return self.decode((await self.receive_frame())[1])

    async def receive_frame(self) -> tuple[bool, bytes]:
        """The next batch frame: whether it ends its request, and its payload undecoded (see
        :meth:`decode`)."""
        length, end = BATCH_HEADER.unpack(await self._read(BATCH_HEADER.size))
        if length > _MAX_BATCH_BYTES:
            raise OSError(errno.EPROTO, f"scan worker {self.pid} sent a frame of {length} bytes")
        return end, await self._read(length)

    def decode(self, payload: bytes) -> ScanBatch:
        started = time.thread_time()
        try:
            batch = _DECODER.decode(payload)
        except msgspec.MsgspecError as exc:
            raise OSError(errno.EPROTO, f"scan worker {self.pid} sent a bad batch: {exc}") from None
        batch.cpu_s += time.thread_time() - started  # the loop's share of receiving it
        return batch

    async def _read(self, n: int) -> bytes:
        buffer, stdout = self._buffer, self._process.stdout
        assert stdout is not None
        while len(buffer) < n:
            try:
                buffer += await stdout.receive(max(1 << 16, n - len(buffer)))
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise OSError(errno.EPIPE, await self._death()) from None
        data = bytes(buffer[:n])
        del buffer[:n]
        return data

    async def _death(self) -> str:
        """Why the worker stopped answering: its exit status and the end of its stderr."""
        status: int | None = None
        tail = b""
        with anyio.move_on_after(1.0):
            status = await self._process.wait()
            if self._process.stderr is not None:
                try:
                    while True:
                        tail = (tail + await self._process.stderr.receive())[-_STDERR_KEPT:]
                except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
        last = tail.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"scan worker {self.pid} exited (status {status}){': ' + last[0] if last[0] else ''}"

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._process.returncode is None:
                try:
                    self._process.kill()
                except ProcessLookupError:
                    pass
            await self._process.aclose()


class _Turns:
    """Workers and the loop taking turns: a worker is sent its next request only when no batch
    waits to be applied, and a batch is applied only when no worker is walking. So the workers
    walk while the loop waits, and the loop applies while they wait.

    Even at ``SCHED_IDLE``, a worker on the loop's core takes that core for whole scheduler ticks
    (4 ms at 250 Hz) once the loop has run more than its fair share, which a loop applying batches
    back to back soon has (Linux's EEVDF scheduler picks the eligible task). A loop that only
    wakes up (timers, transfers) preempts a worker at once. Without ``strict`` (a caller with no
    loop to keep responsive) nobody waits."""

    def __init__(self, strict: bool) -> None:
        self._strict = strict
        self._queued = 0  # batches received, not applied yet
        self._walking = 0  # requests sent, not answered in full yet
        self._may_send = anyio.Event()
        self._may_send.set()
        self._may_apply = anyio.Event()
        self._may_apply.set()

    async def send(self) -> None:
        """Before a request goes out."""
        while self._strict and not self._may_send.is_set():
            await self._may_send.wait()
        self._walking += 1
        if self._may_apply.is_set():
            self._may_apply = anyio.Event()

    def received(self) -> None:
        self._queued += 1
        if self._may_send.is_set():
            self._may_send = anyio.Event()

    def ended(self) -> None:
        """A request was answered in full (or its worker failed)."""
        self._walking -= 1
        if not self._walking:
            self._may_apply.set()

    async def apply(self) -> None:
        """Before a batch is applied."""
        while self._strict and not self._may_apply.is_set():
            await self._may_apply.wait()

    def applied(self) -> None:
        self._queued -= 1
        if not self._queued:
            self._may_send.set()


class ScanWorkers:
    """Up to ``size`` worker processes walking one tree; idle ones are kept between passes."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._idle: list[ScanWorker] = []
        self._live: dict[int, ScanWorker] = {}
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The workers alive now (to account for their CPU)."""
        return sorted(self._live)

    async def walk(self, dir_fd: int, plan: PassPlan, *, due: Callable[[int], float] | None,
                   apply: Callable[[ScanBatch], Awaitable[None]], turns: bool = True) -> None:
        """Run ``plan``'s requests on the workers (request ``i`` not before ``due(i)``, monotonic);
        ``apply`` each batch on this task as it arrives. A worker has one request at a time;
        workers and this task take turns (:class:`_Turns`), unless ``turns`` is false: a caller
        with no event loop to keep responsive (an operator command) applies while workers walk.
        Raises OSError when a worker fails or dies; ``apply``'s exceptions propagate; the
        workers of a pass cut short are killed."""
        count = len(plan)
        if not count:
            return
        next_request = 0
        taking = _Turns(turns)
        # Frames go to this task undecoded: decoding one (~0.3 ms) and applying it (slices of
        # ~1 ms) are then separate turns of the loop, never several workers' decodes in one turn.
        # Unbounded: a worker's frames wait here until its request is answered in full (taking
        # turns), at most one request's worth per worker.
        send, receive = anyio.create_memory_object_stream[tuple[ScanWorker, bytes] | Exception](math.inf)

        def claim() -> int | None:
            nonlocal next_request
            if next_request >= count:
                return None
            next_request += 1
            return next_request - 1

        async def drive(out: anyio.abc.ObjectSendStream[tuple[ScanWorker, bytes] | Exception]) -> None:
            worker: ScanWorker | None = None
            clean = walking = False
            async with out:
                try:
                    worker = await self._take(dir_fd)
                    while (i := claim()) is not None:
                        if due is not None:
                            await anyio.sleep(max(0.0, due(i) - time.monotonic()))
                        await taking.send()
                        walking = True
                        await worker.send(plan.request(i))
                        while walking:
                            end, payload = await worker.receive_frame()
                            taking.received()
                            if end:
                                walking = False
                                taking.ended()
                            await out.send((worker, payload))
                    clean = True
                except Exception as exc:
                    if walking:
                        taking.ended()  # so that batches already received are not held for it
                    with contextlib.suppress(anyio.BrokenResourceError):  # the pass already ended
                        await out.send(exc)
                finally:
                    if worker is not None:
                        await self._give_back(worker, clean)

        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            async with send:
                for _ in range(min(self.size, count)):
                    tg.start_soon(drive, send.clone())
            try:
                async with receive:
                    async for item in receive:
                        if isinstance(item, Exception):
                            raise item
                        batch = item[0].decode(item[1])
                        if batch.error:
                            raise OSError(batch.errno or errno.EIO, f"scan worker: {batch.error}")
                        await taking.apply()
                        await anyio.lowlevel.checkpoint()
                        await apply(batch)
                        taking.applied()
            except Exception as exc:  # re-raised below, outside the group, so it is not wrapped
                failure = exc
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _take(self, dir_fd: int) -> ScanWorker:
        if self._closed:
            raise ScanStopped("scan workers closed")
        while self._idle:
            worker = self._idle.pop()
            if worker.alive:
                return worker
            await self._give_back(worker, False)
        worker = await ScanWorker.start(dir_fd)
        self._live[worker.pid] = worker
        return worker

    async def _give_back(self, worker: ScanWorker, clean: bool) -> None:
        if clean and worker.alive and not self._closed:
            self._idle.append(worker)
            return
        self._live.pop(worker.pid, None)
        await worker.kill()

    async def aclose(self) -> None:
        """Kill every idle worker; those of a pass under way are killed when it ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            await self._give_back(worker, False)

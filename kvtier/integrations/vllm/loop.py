"""The one event-loop thread a process runs for every kvtier tier inside vLLM.

vLLM calls its tiers from the scheduler thread (and its tier-poll thread), synchronously and
under the manager's lock; kvtier's tiers live on an anyio event loop and must only be touched
from that loop's thread. :class:`LoopThread` is that loop: one asyncio loop on one daemon thread
(``kvtier-vllm-loop``), started by the first tier that needs it (never at import: vLLM's API
server imports tier classes only to read their metric definitions) and stopped when the last
tier releases it.

Two ways in:

* :meth:`LoopThread.call_soon` — hand a plain function to the loop and return at once
  (``loop.call_soon_threadsafe``, a few µs). The serving path uses only this.
* :meth:`LoopThread.call` — run a coroutine function on the loop and wait for its result. Only
  start-up, ``drain_jobs`` and ``shutdown`` use it (vLLM allows those to block).

:meth:`LoopThread.host` runs a long-lived task (a tier's ``run``) in the loop's task group and
returns once the task reported itself started; an error before that is raised to the caller.

asyncio, not trio: the obj tier's aiobotocore needs asyncio, and nothing inside vLLM cares.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.abc

__all__ = ["LoopThread", "HostedTask"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long the last release waits for the thread to end before giving up on it (it is a
#: daemon thread, so it never keeps the process alive).
_JOIN_TIMEOUT_S = 10.0


class HostedTask:
    """A task started by :meth:`LoopThread.host`; :attr:`done` is set (on the loop) when it ends."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.done = anyio.Event()
        self.error: BaseException | None = None


class _Status(anyio.abc.TaskStatus[None]):
    def __init__(self, hosted: HostedTask) -> None:
        self._hosted = hosted

    def started(self, value: None = None) -> None:
        self._hosted.started.set()


class LoopThread:
    """A reference-counted asyncio loop on its own thread (see the module docstring).

    Get it with :meth:`acquire`, give it back with :meth:`release`; the thread starts with the
    first acquire and stops with the last release. Tiers must be closed before they release.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _current: ClassVar[LoopThread | None] = None

    def __init__(self) -> None:
        self._refs = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvtier-vllm-loop", daemon=True)

    # --- lifetime --------------------------------------------------------------------------
    @classmethod
    def acquire(cls) -> LoopThread:
        """The process's loop thread, started if it is not running; count one more user."""
        with cls._lock:
            current = cls._current
            if current is None or not current._thread.is_alive():
                current = cls()
                current._start()
                cls._current = current
            current._refs += 1
            return current

    def release(self) -> None:
        """One user less; the last one stops the loop and joins its thread."""
        with LoopThread._lock:
            if self._refs <= 0:
                raise RuntimeError("LoopThread.release() without a matching acquire()")
            self._refs -= 1
            if self._refs:
                return
            if LoopThread._current is self:
                LoopThread._current = None
        self._shutdown()

    @classmethod
    def running(cls) -> LoopThread | None:
        """The loop thread if one is running (for tests and diagnostics)."""
        with cls._lock:
            return cls._current

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError("kvtier's event-loop thread failed to start") from self._failure

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the start
            self._failure = exc
            logger.exception("kvtier's event-loop thread ended with an error")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._ready.set()
            await self._stop.wait()
            tg.cancel_scope.cancel()

    def _shutdown(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop already ended
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("kvtier's event-loop thread did not stop within %.0f s", _JOIN_TIMEOUT_S)

    # --- ways in ---------------------------------------------------------------------------
    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon; never blocks. ``RuntimeError`` if the loop ended."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("kvtier's event loop is not running")
        loop.call_soon_threadsafe(fn, *args)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """Run ``await fn(*args)`` on the loop and return its result (blocks the caller).

        ``TimeoutError`` after ``timeout`` seconds (the coroutine is then cancelled).
        """
        loop = self._loop
        if loop is None or not self._thread.is_alive():
            raise RuntimeError("kvtier's event loop is not running")
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.call() from the loop's own thread would deadlock")

        async def run() -> T:
            return await fn(*args)

        future = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not finish within {timeout} s") from None

    async def host(self, fn: Callable[..., Awaitable[None]]) -> HostedTask:
        """On the loop: run ``fn(task_status=...)`` in the loop's task group until it returns.

        Returns once ``fn`` called ``task_status.started()``; an exception raised before that is
        raised here. A later exception is logged (it must not take the other tiers down) and
        kept in :attr:`HostedTask.error`.
        """
        assert self._tg is not None
        hosted = HostedTask()

        async def guarded() -> None:
            try:
                await fn(task_status=_Status(hosted))
            except BaseException as exc:  # noqa: BLE001 - recorded, logged once started
                hosted.error = exc
                if hosted.started.is_set() and not isinstance(exc, anyio.get_cancelled_exc_class()):
                    logger.exception("kvtier: a hosted task failed")
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
            finally:
                hosted.started.set()
                hosted.done.set()

        self._tg.start_soon(guarded)
        await hosted.started.wait()
        if hosted.done.is_set() and hosted.error is not None:
            raise hosted.error
        return hosted

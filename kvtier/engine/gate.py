"""Which calls an engine admits now: none once it closes; loads and stores together, or one reset.

Semantics callers rely on:

* From the moment closing starts (:attr:`OperationGate.closing`), :meth:`OperationGate.check_open`
  raises :class:`kvtier.EngineClosedError` naming the method and whether the engine is closing
  or closed.
* Loads and stores read and write host slots; they run inside :meth:`OperationGate.operation`
  and may run together. A reset (:meth:`OperationGate.exclusive`) runs alone: new operations
  wait until it ended, and it starts only once the running ones finished, so no device copy
  can target a slot it frees. A reset asked for while one runs waits for that one instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from kvtier.errors import EngineClosedError

__all__ = ["OperationGate"]


class OperationGate:
    """Admission of one engine's calls (loop thread only)."""

    def __init__(self) -> None:
        #: Close began: every public method refuses from now on.
        self.closing = False
        #: Close ran (its components are being or were closed).
        self.closed = False
        self._active = 0  # operations running
        self._idle: anyio.Event | None = None  # set when the last running operation ends
        self._exclusive: anyio.Event | None = None  # set when the running reset ends

    def check_open(self, method: str) -> None:
        if self.closing:
            state = "closed" if self.closed else "closing"
            raise EngineClosedError(
                f"Engine.{method}(): this kvtier engine is {state} (its `async with kvtier.open(...)` "
                "block was left or close() was called); open a new engine"
            )

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncIterator[None]:
        """Admit one load or store; waits while a reset is in progress."""
        while self._exclusive is not None:
            await self._exclusive.wait()
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0 and self._idle is not None:
                self._idle.set()

    async def exclusive(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` with no operation running; if one already runs, wait for it instead."""
        while self._exclusive is not None:  # a reset is already running: that one will do
            await self._exclusive.wait()
            return
        gate = self._exclusive = anyio.Event()
        try:
            while self._active:
                idle = self._idle = anyio.Event()
                await idle.wait()
            self._idle = None
            await work()
        finally:
            self._exclusive = None
            gate.set()

"""How an engine makes progress: components wake it, one step turns what they report into progress.

Semantics callers rely on:

* Components (copy engine, tiers) call :meth:`Progress.wake` on the loop thread whenever a job
  result or a lookup verdict is available, and so do the engine's own operations whenever they
  change what another may wait for: a store completing (its chunks loadable, or its slots free
  again), a load unpinning its chunks. A task that waits (:meth:`Progress.wait`) wakes at
  the first wake-up after its mark (:meth:`Progress.mark`, default: when it started waiting),
  and never polls. A waiter marks *before* the work whose results it will wait for (lookups,
  submissions): a tier may report, and wake, before the wait begins — a job it finishes at
  submission, say — and a wait that started after that wake-up would sleep until its deadline.
* :meth:`Progress.drive`, run as one task of the engine's task group, runs the step (the engine's
  dispatch: copy results, manager poll, events) after every wake-up, so results reach their
  waiters even while no load or store runs.
* A :class:`Progress` is built inside the engine's event loop (it holds an ``anyio.Event``).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

__all__ = ["Progress"]


class Progress:
    """Wake-ups of one engine and the step they trigger (``step``: the engine's dispatch)."""

    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step
        self._tick = anyio.Event()

    def wake(self) -> None:
        """Called by components (on the loop thread) when a result or verdict is available."""
        tick = self._tick
        # Swap before setting: whoever waits from now on waits for the *next* wake-up.
        self._tick = anyio.Event()
        tick.set()

    def mark(self) -> anyio.Event:
        """The point a later :meth:`wait` counts wake-ups from (module docstring)."""
        return self._tick

    async def wait(self, deadline: float, since: anyio.Event | None = None) -> bool:
        """Wait for the first wake-up after ``since`` (a :meth:`mark`; default: now); ``False``
        if ``deadline`` (anyio clock) passed first. Returns at once if it already happened."""
        tick = self._tick if since is None else since
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            await tick.wait()
            return True
        return False

    def step(self) -> None:
        """Run the engine's dispatch now (after a wait, so what woke it is handled at once)."""
        self._step()

    async def drive(self) -> None:
        """Forever: wait for a wake-up, then run the step."""
        while True:
            await self._tick.wait()
            self._step()

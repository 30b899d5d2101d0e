"""How the CUDA copy engine sees its copies finish: :class:`Completions` reports the issued jobs
of one stream in order, each as soon as its completion event fires.

Nothing here touches CUDA directly: events are duck-typed (``synchronize()``,
``elapsed_time(other)``), so the waiting logic is tested with stand-in events.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from kvtier.host.copy_jobs import CopyJob

__all__ = ["IssuedJob", "Completions"]


@dataclass(slots=True)
class IssuedJob:
    """One job whose copies are on a stream, between its two timing events."""

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


class Completions:
    """The issued jobs of one stream, reported in order as their ``done`` events fire.

    :meth:`run` waits for the oldest job's event on a helper thread (``event.synchronize()`` of a
    blocking-sync event: the thread sleeps in the driver until the copies are done, then the loop
    is told at once) — no polling loop, so a job is seen done within a thread wake-up of its
    copies finishing, not at the next tick of a timer. Events of one stream fire in the order
    they were recorded, so waiting for the oldest is waiting for the next to finish.
    """

    def __init__(self, report: Callable[[IssuedJob, float, BaseException | None], None]) -> None:
        self._report = report
        self._jobs: collections.deque[IssuedJob] = collections.deque()
        self._arrived = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, issued: IssuedJob) -> None:
        """Queue a job just issued on this stream (issue order is stream order)."""
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

    async def _wait(self, issued: IssuedJob, *, abandon_on_cancel: bool) -> BaseException | None:
        """:meth:`IssuedJob.wait` on the helper thread; the exception it raised, if any (the job
        then fails: its bytes may be incomplete)."""
        try:
            await anyio.to_thread.run_sync(issued.wait, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel)
        except Exception as exc:  # noqa: BLE001 - reported with the job
            return exc
        return None

    def take_all(self) -> list[IssuedJob]:
        """Remove and return every job not reported yet (closing: the caller fails them)."""
        jobs = list(self._jobs)
        self._jobs.clear()
        return jobs


def _gpu_seconds(issued: IssuedJob) -> float:
    """The job's copy time measured by the device (its two timing events), else wall time."""
    try:
        return float(issued.started.elapsed_time(issued.done)) / 1000.0
    except Exception:  # noqa: BLE001 - an event without timing: the host's view is still right
        return time.monotonic() - issued.start

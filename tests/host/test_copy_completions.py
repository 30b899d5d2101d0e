"""How the CUDA copy engine sees its copies finish (``Completions``), with stand-in events.

The waiting logic is duck-typed over events (``synchronize()``, ``elapsed_time()``), so it runs
here with events that a test fires by hand: jobs are reported in order, each as soon as its event
fires (a helper thread sleeps in ``synchronize``; nothing polls), and closing fences what was
issued, within a deadline.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from kvtier.host import completions as completions_module
from kvtier.host.completions import Completions, IssuedJob
from kvtier.host.copy_jobs import CopyJob

pytestmark = pytest.mark.anyio
HANG_GUARD_S = 10.0  # a broken waiter fails instead of hanging; never a timing claim


class FakeEvent:
    """A CUDA event stand-in: ``fire()`` completes it; counts how it is waited for."""

    def __init__(self, gpu_ms: float | None = None) -> None:
        self._fired = threading.Event()
        self.synchronized = 0
        self.queried = 0
        self.gpu_ms = gpu_ms

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._fired.wait()

    def query(self) -> bool:  # never used by the waiter: present to catch polling
        self.queried += 1
        return self._fired.is_set()

    def elapsed_time(self, end: FakeEvent) -> float:
        if end.gpu_ms is None:
            raise RuntimeError("no timing")
        return end.gpu_ms


def issued(job_id: int, gpu_ms: float | None = None) -> IssuedJob:
    return IssuedJob(CopyJob(job_id, "to_host", [0], [0]), FakeEvent(), FakeEvent(gpu_ms), 4096, 0.0)


async def test_jobs_are_reported_in_order_as_their_events_fire() -> None:
    reported: list[tuple[int, float]] = []
    got = anyio.Event()

    def report(job: IssuedJob, seconds: float, error: BaseException | None) -> None:
        assert error is None
        reported.append((job.job.job_id, seconds))
        got.set()

    completions = Completions(report)
    jobs = [issued(i, gpu_ms=2.5) for i in range(3)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(completions.run)
        for job in jobs:
            completions.add(job)
        for expected, job in enumerate(jobs):
            got = anyio.Event()
            job.done.fire()
            with anyio.fail_after(HANG_GUARD_S):
                await got.wait()
            assert [i for i, _ in reported] == list(range(expected + 1))
        tg.cancel_scope.cancel()
    assert all(seconds == pytest.approx(0.0025) for _, seconds in reported)  # the device's measure
    assert all(job.done.synchronized == 1 and job.done.queried == 0 for job in jobs)  # no polling


async def test_a_later_event_waits_behind_the_oldest() -> None:
    """Events of one stream fire in order; a job is never reported before those issued before it."""
    reported: list[int] = []
    completions = Completions(lambda job, _s, _e: reported.append(job.job.job_id))
    first, second = issued(1), issued(2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(completions.run)
        completions.add(first)
        completions.add(second)
        second.done.fire()
        await anyio.sleep(0.05)
        assert reported == []
        first.done.fire()
        with anyio.fail_after(HANG_GUARD_S):
            while len(reported) < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert reported == [1, 2]


async def test_fence_reports_what_finishes_and_says_when_copies_may_still_run() -> None:
    reported: list[int] = []
    completions = Completions(lambda job, _s, _e: reported.append(job.job.job_id))
    done, stuck = issued(1), issued(2)
    done.done.fire()
    completions.add(done)
    completions.add(stuck)
    assert not await completions.fence(0.2)  # the second never finishes: not fenced
    assert reported == [1]
    assert [job.job.job_id for job in completions.take_all()] == [2]
    stuck.done.fire()  # let the abandoned helper thread end
    again = issued(3)
    completions.add(again)
    again.done.fire()
    assert await completions.fence(HANG_GUARD_S)
    assert reported == [1, 3] and len(completions) == 0


async def test_cancelling_the_waiter_does_not_wait_for_a_stuck_event() -> None:
    completions = Completions(lambda job, _s, _e: None)
    stuck = issued(1)
    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(completions.run)
            completions.add(stuck)
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    assert len(completions) == 1  # left for the fence
    stuck.done.fire()


def test_seconds_fall_back_to_the_wall_clock_without_timing(monkeypatch: Any) -> None:
    monkeypatch.setattr(completions_module.time, "monotonic", lambda: 7.0)
    assert completions_module._gpu_seconds(issued(1)) == 7.0


async def test_host_side_work_runs_after_the_copies_and_its_failure_fails_the_job() -> None:
    """A staged store's bytes reach the host slot after its DMA (``finish``), on the helper
    thread, before the job is reported; if that fails, the job is reported with the error."""
    reported: list[tuple[int, BaseException | None]] = []
    order: list[str] = []
    completions = Completions(lambda job, _s, error: reported.append((job.job.job_id, error)))
    good, bad = issued(1), issued(2)
    good.finish = lambda: order.append("finish")
    original = good.done.synchronize

    def synchronize() -> None:
        original()
        order.append("synchronized")

    good.done.synchronize = synchronize  # type: ignore[method-assign]

    def broken() -> None:
        raise OSError("host side failed")

    bad.finish = broken
    for job in (good, bad):
        completions.add(job)
        job.done.fire()
    assert await completions.fence(HANG_GUARD_S)
    assert order == ["synchronized", "finish"]
    assert reported[0] == (1, None)
    assert reported[1][0] == 2 and isinstance(reported[1][1], OSError)

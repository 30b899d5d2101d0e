"""Driving a copy engine in a test: start it, submit jobs, collect every result, close it."""

from __future__ import annotations

from typing import Any

import anyio

from kvtier.host.copy_jobs import CopyJob, CopyResult


async def run_jobs(engine: Any, jobs: list[CopyJob], expect: int | None = None) -> list[CopyResult]:
    """Start ``engine``, submit ``jobs``, wait (via the wakeup callback) for ``expect`` results
    (default: one per job), then close the engine. Results in job-id order."""
    expect = len(jobs) if expect is None else expect
    results: list[CopyResult] = []
    changed = anyio.Event()

    def wake() -> None:
        changed.set()

    engine.set_wakeup(wake)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        for job in jobs:
            engine.submit(job)
        with anyio.fail_after(10):
            while len(results) < expect:
                await changed.wait()
                changed = anyio.Event()
                results.extend(engine.get_finished())
        await engine.aclose()
    return sorted(results, key=lambda r: r.job_id)

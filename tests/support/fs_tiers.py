"""An fs tier under test: its geometry, construction, start-up and the jobs the fs tests submit."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from kvtier.config import TierConfig
from kvtier.host.slots import SlotBuffer
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.fs.tier import FileSystemTier
from kvtier.tiers.integrity import TRAILER_PAGE
from kvtier.types import LookupResult

# 4 layers x 1 block x (2 x 16 tokens x 2 heads x 64 dim x 2 bytes) = 32 KiB... keep 16 KiB: 2 layers.
GEOMETRY = KVGeometry("org/tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
SLOT = GEOMETRY.slot_bytes(1)
FILE = SLOT + TRAILER_PAGE
job_ids = itertools.count(1)

assert SLOT == 16384


def key_of(i: int, group: int = 0) -> bytes:
    return make_offload_key(hashlib.sha256(f"chunk-{i}".encode()).digest(), group)


def make_tier(
    root: Path,
    host: SlotBuffer | None,
    *,
    geometry: KVGeometry = GEOMETRY,
    rank: int = 0,
    parallel_agnostic: bool = True,
    events: bool = False,
    **options: Any,
) -> FileSystemTier:
    opts: dict[str, Any] = {"root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **options}
    config = TierConfig(index=0, type="fs", enable_kv_events=events, options=opts)
    context = TierContext(
        index=0,
        label="1:fs",
        slot_bytes=geometry.slot_bytes(1),
        host=host,
        geometry=geometry,
        blocks_per_chunk=1,
        run_fields=geometry.run_fields(1, parallel_agnostic=parallel_agnostic),
        rank=rank,
        kv_events_enabled=events,
    )
    return FileSystemTier(config, context)


@asynccontextmanager
async def running(tier: FileSystemTier, *, scanned: bool = True) -> AsyncIterator[FileSystemTier]:
    """The tier, started; with ``scanned`` once its start-up scan is over (it runs in the
    background: ``kvtier.open`` does not wait for it)."""
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        try:
            if scanned:
                await tier.wait_scanned()
            yield tier
        finally:
            await tier.aclose()


async def finish(tier: FileSystemTier, jobs: Sequence[TransferJob]) -> dict[int, JobResult]:
    """Submit ``jobs`` and wait (woken by the tier's callback) until every result is in."""
    wake = anyio.Event()

    def wakeup() -> None:
        wake.set()

    tier.set_wakeup(wakeup)
    for job in jobs:
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    results: dict[int, JobResult] = {}
    with anyio.fail_after(30):
        while len(results) < len(jobs):
            await wake.wait()
            wake = anyio.Event()
            for result in tier.get_finished_jobs():
                results[result.job_id] = result
    return results


def fill(host: SlotBuffer, slot: int, i: int) -> None:
    host.view(slot)[:] = hashlib.sha256(f"payload-{i}".encode()).digest() * (SLOT // 32)


def expected(i: int) -> bytes:
    return hashlib.sha256(f"payload-{i}".encode()).digest() * (SLOT // 32)


async def store(tier: FileSystemTier, host: SlotBuffer, ids: Sequence[int]) -> JobResult:
    for slot, i in enumerate(ids):
        fill(host, slot, i)
    job = TransferJob(next(job_ids), [key_of(i) for i in ids], list(range(len(ids))), is_promotion=False)
    return (await finish(tier, [job]))[job.job_id]


async def load(tier: FileSystemTier, ids: Sequence[int]) -> JobResult:
    job = TransferJob(next(job_ids), [key_of(i) for i in ids], list(range(len(ids))), is_promotion=True)
    return (await finish(tier, [job]))[job.job_id]


async def probe(tier: FileSystemTier, keys: Sequence[bytes]) -> list[LookupResult]:
    """Look ``keys`` up until no answer is RETRY (flushing the probe batch like the manager)."""
    with anyio.fail_after(10):
        while True:
            answers = [tier.lookup(k) for k in keys]
            if LookupResult.RETRY not in answers:
                return answers
            tier.on_schedule_end()
            await anyio.sleep(0.005)


def metric(tier: FileSystemTier, name: str) -> dict[tuple[str, ...], float]:
    for family in tier.statistics().custom_metrics:
        if family.name == name:
            return {k: float(v) for k, v in family.values.items()}  # type: ignore[arg-type]
    raise KeyError(name)


def bin_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))

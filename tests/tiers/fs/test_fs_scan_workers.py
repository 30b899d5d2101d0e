"""Scan worker processes (kvtier.tiers.fs.scan_workers): a walk in workers finds what a walk on a
thread finds, paced or not; a worker that dies or talks nonsense fails the walk with an OSError and
is replaced; a tier that cannot start workers walks on a thread; closing a tier kills its workers."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from fs_tiers import FILE, SLOT, make_tier, running
from test_fs_scale import ScanGate, fill_tree

from kvtier.host.slots import SlotBuffer
from kvtier.tiers.fs import sync
from kvtier.tiers.fs.scan import LeafMtimes, PassPlan, ScanBatch, list_root, walk_tree
from kvtier.tiers.fs.scan_workers import ScanWorker, ScanWorkers, ScanWorkerStartError


@pytest.fixture
def host() -> Iterator[SlotBuffer]:
    buf = SlotBuffer(64, SLOT, pin_memory=False)
    yield buf
    buf.close()


def make_chunks(root: Path, count: int) -> set[str]:
    names = set()
    for i in range(count):
        h = f"{i * 2654435761 % (1 << 32):08x}"  # spread over many top directories
        d = root / h[:3] / f"{h[3:5]}_g0"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{h}.bin").write_bytes(b"x" * (i + 1))
        names.add(h)
    return names


def found(batches: list[ScanBatch]) -> dict[str, int]:
    return {key[:-4].hex(): size for b in batches for leaf in b.leaves for key, size, _ in leaf.chunks}


@pytest.fixture
def tree(tmp_path: Path):  # type: ignore[no-untyped-def]
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.anyio
@pytest.mark.parametrize("paced", [False, True])
async def test_workers_find_what_a_walk_on_a_thread_finds(tmp_path: Path, tree: int, paced: bool) -> None:
    names = make_chunks(tmp_path, 60)
    expected = found(list(walk_tree(tree, LeafMtimes(), tmp_grace_s=None)))
    assert set(expected) == names
    workers = ScanWorkers(2)
    plan = PassPlan(list_root(tree, None), LeafMtimes(), tmp_grace_s=None, tops_per_request=4, budget=8)
    batches: list[ScanBatch] = []
    sent_at: list[float] = []
    started = time.monotonic()

    async def apply(batch: ScanBatch) -> None:
        batches.append(batch)
        sent_at.append(time.monotonic())

    try:
        due = (lambda i: started + 0.3 * i / len(plan)) if paced else None
        await workers.walk(tree, plan, due=due, apply=apply)
        assert len(workers.pids) == 2  # kept for the next pass
        assert found(batches) == expected
        assert sum(b.end for b in batches) == len(plan)  # every request answered, once
        assert all(b.cpu_s >= 0 for b in batches)
        if paced:  # the last request was not sent before its time
            assert sent_at[-1] - started >= 0.3 * (len(plan) - 1) / len(plan)
        again: list[ScanBatch] = []

        async def apply_again(batch: ScanBatch) -> None:
            again.append(batch)

        pids = workers.pids
        await workers.walk(tree, plan, due=None, apply=apply_again)
        assert workers.pids == pids and found(again) == expected
    finally:
        await workers.aclose()
    assert workers.pids == [] and all(dead(pid) for pid in pids)


@pytest.mark.anyio
@pytest.mark.parametrize("turns", [True, False])
async def test_workers_take_turns_with_the_loop(tmp_path: Path, tree: int, turns: bool) -> None:
    """While a batch is being applied, no request goes out and no worker walks (the workers wait
    for the loop), unless the caller asked for no turns (an operator command)."""
    make_chunks(tmp_path, 60)
    plan = PassPlan(list_root(tree, None), LeafMtimes(), tmp_grace_s=None, tops_per_request=1, budget=8)
    requested: list[int] = []
    build = plan.request

    def request(i: int):  # type: ignore[no-untyped-def]
        requested.append(i)
        return build(i)

    plan.request = request  # type: ignore[method-assign]
    sent_while_applying = 0
    applied: list[ScanBatch] = []

    async def apply(batch: ScanBatch) -> None:
        nonlocal sent_while_applying
        before = len(requested)
        await anyio.sleep(0.02)  # a loop busy applying, in slices
        sent_while_applying += len(requested) - before
        applied.append(batch)

    workers = ScanWorkers(2)
    try:
        await workers.walk(tree, plan, due=None, apply=apply, turns=turns)
    finally:
        await workers.aclose()
    assert sorted(requested) == list(range(len(plan))) and sum(b.end for b in applied) == len(plan)
    if turns:
        assert sent_while_applying == 0
    else:
        assert sent_while_applying > 0


@pytest.mark.anyio
async def test_a_worker_that_dies_fails_the_walk_and_is_replaced(tmp_path: Path, tree: int) -> None:
    make_chunks(tmp_path, 40)
    workers = ScanWorkers(1)
    plan = PassPlan(list_root(tree, None), LeafMtimes(), tmp_grace_s=None, tops_per_request=2, budget=2)
    applied: list[ScanBatch] = []

    async def kill_after_first(batch: ScanBatch) -> None:
        applied.append(batch)
        if len(applied) == 1:
            [pid] = workers.pids
            os.kill(pid, 9)

    try:
        with pytest.raises(OSError, match="exited"):
            await workers.walk(tree, plan, due=None, apply=kill_after_first)
        assert workers.pids == []  # the dead one is gone
        batches: list[ScanBatch] = []

        async def apply(batch: ScanBatch) -> None:
            batches.append(batch)

        await workers.walk(tree, plan, due=None, apply=apply)
        assert len(found(batches)) == 40
    finally:
        await workers.aclose()


@pytest.mark.anyio
async def test_a_frame_that_is_not_a_batch_is_an_error() -> None:
    code = "import sys; sys.stdout.buffer.write(bytes([0, 0, 0, 3, 1]) + b'abc'); sys.stdout.flush()"
    worker = ScanWorker(await anyio.open_process([sys.executable, "-c", code]))
    try:
        with pytest.raises(OSError, match="bad batch"):
            await worker.receive()
    finally:
        await worker.kill()


@pytest.mark.anyio
async def test_a_worker_that_says_nothing_is_an_error_naming_its_status() -> None:
    worker = ScanWorker(await anyio.open_process([sys.executable, "-c", "import sys; sys.exit('no tree here')"]))
    try:
        with pytest.raises(OSError, match=r"status 1\): no tree here"):
            await worker.receive()
    finally:
        await worker.kill()


@pytest.mark.anyio
async def test_without_a_python_executable_the_tier_walks_on_a_thread(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await fill_tree(tmp_path, host, range(12))
    monkeypatch.setattr(sync, "_IN_THREAD_TOPS", 0)
    monkeypatch.setattr(sys, "executable", "")
    with pytest.raises(ScanWorkerStartError):
        await ScanWorker.start(0)
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.fs.tier"):
        async with running(tier):
            await tier.wait_scanned()
            assert len(tier.index) == 12 and tier.index.complete
            await tier.rescan()  # the next pass goes straight to the thread
    assert sum("cannot start scan worker processes" in r.message for r in caplog.records) == 1


@pytest.mark.anyio
async def test_closing_a_tier_during_a_walk_kills_its_workers(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    await fill_tree(tmp_path, host, range(24))
    monkeypatch.setattr(sync, "_IN_THREAD_TOPS", 0)
    monkeypatch.setattr(sync, "_SCAN_STEP_ENTRIES", 2)
    gate = ScanGate(monkeypatch, free=2)  # the loop stops applying: the workers wait on their pipes
    tier = make_tier(tmp_path, host, max_bytes=64 * FILE, rescan_interval_s=3600)
    async with running(tier, scanned=False):
        await anyio.to_thread.run_sync(gate.waiting.wait, 30)
        pids = tier.sync.workers.pids
        assert pids and not tier.scanned
    assert tier.sync.workers.pids == [] and all(dead(pid) for pid in pids)

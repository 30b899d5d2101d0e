"""The fs tier at scale, on small trees: the start-up scan runs in the background (serving starts
at once, the cap holds meanwhile), scan results are applied in bounded batches while stores and
loads run, and a periodic re-sync sees what other processes changed within one interval.
benchmarks/fs_scale.py measures the same at 10^6 files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from fs_tiers import (
    FILE,
    SLOT,
    bin_files,
    expected,
    key_of,
    load,
    make_tier,
    metric,
    probe,
    running,
    store,
)

from kvtier.host.slots import SlotBuffer
from kvtier.layout import Namespace
from kvtier.tiers.fs import chunks, sync
from kvtier.tiers.fs import tier as fs_module
from kvtier.tiers.fs.scan import LeafListing
from kvtier.tiers.fs.sync import TreeSync
from kvtier.tiers.fs.tree import key_from_relpath, leaf_of
from kvtier.types import LookupResult


@pytest.fixture
def host() -> Any:
    buf = SlotBuffer(64, SLOT, pin_memory=False)
    yield buf
    buf.close()


class ScanGate:
    """Holds the tier's scan before it applies each batch after the first ``free`` ones; each
    ``release.set()`` lets one held batch through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int = 0) -> None:
        self.free = free
        self.steps = 0
        self.release = threading.Event()
        self.waiting = threading.Event()
        real_apply = TreeSync.apply_batch
        gate = self

        async def apply(tier: TreeSync, batch: Any, *, initial: bool) -> float:
            if gate.steps >= gate.free:
                gate.waiting.set()
                while not gate.release.is_set():
                    await anyio.sleep(0.005)
                gate.release.clear()
            gate.steps += 1
            return await real_apply(tier, batch, initial=initial)

        monkeypatch.setattr(TreeSync, "apply_batch", apply)


@pytest.fixture(params=["thread", "processes"])
def walk_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Walk the tree on a pool thread (small trees) or in scan worker processes (big ones)."""
    if request.param == "processes":
        monkeypatch.setattr(sync, "_IN_THREAD_TOPS", 0)
    return str(request.param)


async def fill_tree(tmp_path: Path, host: SlotBuffer, ids: range) -> None:
    """Chunks ``ids`` on disk, stored by a tier that is then closed (as a previous run leaves them)."""
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        for start in range(ids.start, ids.stop, 8):
            assert (await store(tier, host, range(start, min(start + 8, ids.stop)))).success


async def wait_for(condition: Any, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after 30 s (a hang, not a slow run)."""
    with anyio.move_on_after(30):
        while not condition():
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"not within 30 s: {what}")


@pytest.mark.anyio
async def test_the_tier_serves_before_its_start_up_scan_is_over(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, walk_mode: str
) -> None:
    await fill_tree(tmp_path, host, range(20))
    gate = ScanGate(monkeypatch)
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier, scanned=False):
        await anyio.to_thread.run_sync(gate.waiting.wait, 30)
        assert not tier.scanned and len(tier.index) == 0
        # Unknown keys are probed on disk, as chunks of other processes are.
        assert await probe(tier, [key_of(3), key_of(99)]) == [LookupResult.HIT, LookupResult.MISS]
        result = await load(tier, [3, 4])
        assert result.success and bytes(host.view(0)) == expected(3)
        gate.free = 1 << 30
        gate.release.set()
        await tier.wait_scanned()
        assert tier.scanned and len(tier.index) == 20 and tier.index.used == 20 * FILE
        assert metric(tier, "fs_scan_passes")[()] >= 1


@pytest.mark.anyio
async def test_the_cap_holds_while_the_start_up_scan_is_under_way(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, walk_mode: str
) -> None:
    cap = 16 * FILE
    await fill_tree(tmp_path, host, range(16))  # the tree is full when the tier starts
    monkeypatch.setattr(sync, "_SCAN_STEP_ENTRIES", 4)  # small steps: the scan is seen half done
    gate = ScanGate(monkeypatch)
    peak = 0
    real_write = chunks.write_chunk

    def write_chunk(*args: Any, **kw: Any) -> int:
        nonlocal peak
        peak = max(peak, (len(bin_files(tmp_path)) + 1) * FILE)  # with the one being written
        return real_write(*args, **kw)

    monkeypatch.setattr(chunks, "write_chunk", write_chunk)
    tier = make_tier(tmp_path, host, max_bytes=cap, rescan_interval_s=3600)
    async with running(tier, scanned=False):
        await anyio.to_thread.run_sync(gate.waiting.wait, 30)
        # Nothing scanned yet: the unknown rest of the tree may fill the cap, so nothing can be evicted.
        result = await store(tier, host, [100])
        assert not result.success and result.failure_reason == "no_space"
        gate.free = 3  # let a few steps through, then hold again
        gate.waiting.clear()
        gate.release.set()
        await anyio.to_thread.run_sync(gate.waiting.wait, 30)
        gate.release.clear()
        await wait_for(lambda: gate.steps >= 3 and len(tier.index) > 0, "a partial scan")
        assert not tier.scanned
        known = len(tier.index)
        assert 0 < known < 16
        # Each store now evicts a chunk the scan already found: the disk never grows.
        result = await store(tier, host, [101])
        assert result.success
        assert len(bin_files(tmp_path)) == 16 and peak <= cap
        gate.free = 1 << 30
        gate.release.set()
        await tier.wait_scanned()
        assert tier.index.used == 16 * FILE == len(bin_files(tmp_path)) * FILE <= cap
        assert key_of(101) in tier.index
        assert (await store(tier, host, range(200, 204))).success
        assert len(bin_files(tmp_path)) == 16 and peak <= cap


@pytest.mark.anyio
async def test_scan_results_are_applied_in_slices_while_stores_and_loads_go_on(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, walk_mode: str
) -> None:
    await fill_tree(tmp_path, host, range(64))
    monkeypatch.setattr(sync, "_SCAN_STEP_ENTRIES", 8)
    monkeypatch.setattr(sync, "_SLICE_S", 0.0)  # yield to other tasks after every directory
    slices = 0
    real_yield = TreeSync._yield_slice

    async def counting_yield(self: Any, dropped: list[bytes]) -> None:
        nonlocal slices
        slices += 1
        await real_yield(self, dropped)

    monkeypatch.setattr(TreeSync, "_yield_slice", counting_yield)
    cap = 80 * FILE
    tier = make_tier(tmp_path, host, max_bytes=cap, rescan_interval_s=0.05)
    stored: set[bytes] = set()
    evicted: set[bytes] = set()
    real_report = tier._report_evictions

    def report(victims: Any) -> None:
        victims = list(victims)
        evicted.update(key for key, _ in victims)
        real_report(victims)

    monkeypatch.setattr(tier, "_report_evictions", report)
    async with running(tier, scanned=False):
        async def traffic() -> None:
            for wave in range(6):
                ids = range(1000 + 8 * wave, 1008 + 8 * wave)
                scanned = tier.scanned
                result = await store(tier, host, ids)
                if scanned:  # before, a store must evict as much as it adds (the cap may be full)
                    assert result.success
                    stored.update(key_of(i) for i in ids)
                elif not result.success:  # only while the scan has not found chunks to evict
                    assert result.failure_reason == "no_space"
                result = await load(tier, range(8 * wave, 8 * wave + 8))
                # A chunk may have been evicted to make room, never served wrong.
                for slot, i in enumerate(range(8 * wave, 8 * wave + 8)):
                    if result.success:
                        assert bytes(host.view(slot)) == expected(i)

        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic)
            tg.start_soon(tier.wait_scanned)
        await tier.rescan()
        assert slices > 16  # the start-up scan alone came back in many small slices
        on_disk = {key_from_relpath(str(p.relative_to(tier.namespace.blocks_dir)))
                   for p in bin_files(tmp_path)}
        assert set(tier.index.keys()) == on_disk
        assert tier.index.used == len(on_disk) * FILE <= cap
        # Every chunk stored once the usage was known is there, unless evicted as least recent
        # (loads make older chunks more recent): no listing forgot it.
        assert stored - evicted <= on_disk


@pytest.mark.anyio
async def test_a_periodic_re_sync_sees_other_processes_changes_within_one_interval(
    tmp_path: Path, host: SlotBuffer, walk_mode: str
) -> None:
    tier = make_tier(tmp_path, host, max_bytes=64 * FILE, rescan_interval_s=0.2)
    other = make_tier(tmp_path, host, rescan_interval_s=3600)  # another process on the same root
    async with running(tier), running(other):
        assert (await store(tier, host, range(8))).success
        assert (await store(other, host, range(100, 104))).success
        os.unlink(tier.namespace.chunk_path(key_of(0)))
        passes = metric(tier, "fs_scan_passes")[()]
        # The pass under way may have visited those directories already; the next one, which
        # starts within one interval, visits every directory.
        await wait_for(lambda: metric(tier, "fs_scan_passes")[()] >= passes + 2, "two more passes")
        assert key_of(0) not in tier.index
        assert all(key_of(i) in tier.index for i in range(100, 104))
        assert tier.index.used == 11 * FILE == len(bin_files(tmp_path)) * FILE


@pytest.mark.anyio
async def test_a_re_sync_lists_only_directories_that_changed(tmp_path: Path, host: SlotBuffer, walk_mode: str) -> None:
    await fill_tree(tmp_path, host, range(32))
    # Directory mtimes older than the "racy" window: a directory written this second is re-listed.
    old = os.stat(tmp_path).st_mtime - 60
    for d in Path(tmp_path).glob("*_r0/*/*"):
        os.utime(d, (old, old))
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        listed = metric(tier, "fs_scan_dirs_listed")[()]
        assert listed == len({p.parent for p in bin_files(tmp_path)})
        await tier.rescan()
        assert metric(tier, "fs_scan_dirs_listed")[()] == listed  # nothing changed: nothing listed
        os.unlink(tier.namespace.chunk_path(key_of(5)))
        await tier.rescan()
        assert metric(tier, "fs_scan_dirs_listed")[()] == listed + 1
        assert key_of(5) not in tier.index and len(tier.index) == 31


@pytest.mark.anyio
async def test_the_default_interval_stretches_so_a_re_sync_costs_at_most_5_percent_of_a_core(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host)  # no rescan_interval_s: the default
    async with running(tier):
        assert tier.rescan_interval == 30.0
        tier.sync.pace(0.5)  # a cheap re-sync: 30 s is within budget
        assert tier.rescan_interval == 30.0
        tier.sync.pace(3.0)  # 3 s of CPU per pass: 30 s would cost 10% of a core
        assert tier.rescan_interval == pytest.approx(3.0 / sync._RESCAN_CPU_SHARE)
        assert tier.rescan_interval >= 60.0
        # The start-up scan, and at most the first re-sync: on an empty tree it has nothing to
        # spread over its interval and may end at once; the next one waits out the interval.
        assert metric(tier, "fs_scan_passes")[()] in (1, 2)
    fixed = make_tier(tmp_path, host, rescan_interval_s=10.0)  # an explicit interval is kept
    async with running(fixed):
        fixed.sync.pace(3.0)
        assert fixed.rescan_interval == 10.0


def age_dirs(tmp_path: Path) -> None:
    old = os.stat(tmp_path).st_mtime - 60  # older than the "racy" window: trusted when unchanged
    for d in Path(tmp_path).glob("*_r0/*/*"):
        os.utime(d, (old, old))


@pytest.mark.anyio
async def test_a_re_sync_cut_short_loses_no_change(tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch,
                                                   walk_mode: str) -> None:
    await fill_tree(tmp_path, host, range(8))
    age_dirs(tmp_path)
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        await tier.wait_scanned()
        path = Path(tier.namespace.chunk_path(key_of(3)))
        path.unlink()  # another process deletes a chunk; its directory's mtime moves
        old = os.stat(path.parent).st_mtime - 30
        os.utime(path.parent, (old, old))
        real_apply = tier.sync.apply_batch
        listed = anyio.Event()

        async def stuck_apply(batch: Any, *, initial: bool) -> float:
            listed.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        monkeypatch.setattr(tier.sync, "apply_batch", stuck_apply)
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.rescan)
            await wait_for(listed.is_set, "the re-sync listed the tree")
            tg.cancel_scope.cancel()  # the caller gives up: the listing is never applied
        monkeypatch.setattr(tier.sync, "apply_batch", real_apply)
        await tier.rescan()
        assert key_of(3) not in tier.index and len(tier.index) == 7


@pytest.mark.anyio
async def test_a_failed_eviction_listed_meanwhile_is_found_again(tmp_path: Path, host: SlotBuffer,
                                                                  monkeypatch: pytest.MonkeyPatch, walk_mode: str) -> None:
    await fill_tree(tmp_path, host, range(4))
    age_dirs(tmp_path)
    tier = make_tier(tmp_path, host, rescan_interval_s=3600, max_bytes=4 * FILE)
    async with running(tier):
        await tier.wait_scanned()
        victim = tier.index.keys()[0]
        real_remove, real_all = chunks.remove_file, fs_module._remove_all

        def remove_file(dir_fd: int, relpath: str) -> bool:
            if relpath == Namespace.chunk_relpath(victim):
                raise PermissionError(13, "Permission denied")
            return real_remove(dir_fd, relpath)

        go, failed = threading.Event(), threading.Event()

        def remove_all(dir_fd: int, keys: Any) -> Any:
            out = real_all(dir_fd, keys)
            if victim in out:
                failed.set()
                go.wait(30)  # the loop learns of the failure only after a pass listed the directory
            return out

        monkeypatch.setattr(chunks, "remove_file", remove_file)
        monkeypatch.setattr(fs_module, "_remove_all", remove_all)
        async with anyio.create_task_group() as tg:
            async def storer() -> None:
                assert (await store(tier, host, [100])).success  # evicts the victim (and fails to)

            tg.start_soon(storer)
            await wait_for(failed.is_set, "the eviction of the victim failed")
            await tier.rescan()
            go.set()
        monkeypatch.setattr(fs_module, "_remove_all", real_all)
        await tier.rescan()
        await tier.rescan()
        blocks = Path(tier.namespace.blocks_dir)
        on_disk = {key_from_relpath(str(p.relative_to(blocks))) for p in bin_files(tmp_path)}
        assert on_disk <= set(tier.index.keys())  # no file on disk the index forgot for good
        assert len(on_disk) * FILE <= 4 * FILE


@pytest.mark.anyio
async def test_an_older_listing_does_not_shrink_a_chunk_rewritten_since(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=3600, max_bytes=8 * FILE)
    async with running(tier):
        await tier.wait_scanned()
        listed_at = time.monotonic()  # a listing began; it saw an older, shorter file under the name
        assert (await store(tier, host, [1])).success
        key = key_of(1)
        stale = LeafListing(*leaf_of(key), listed_at, [(key, FILE - 4096, time.time() - 5)])
        tier.sync._apply_leaf(stale, False, [])
        assert tier.index.size_of(key) == os.path.getsize(tier.namespace.chunk_path(key)) == FILE


@pytest.mark.anyio
async def test_an_unreadable_directory_is_skipped_with_a_warning_and_its_chunks_kept(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory the tier may not read (another user's, mode 0700) fails no pass: the pass goes
    on, says so, and keeps what the index knew of it. (Walked on a thread: the denial is a patch of
    this process; tests run as root, which permissions do not stop.)"""
    await fill_tree(tmp_path, host, range(16))
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        assert len(tier.index) == 16
        leaf_dir = Path(tier.namespace.chunk_path(key_of(3))).parent
        from kvtier.tiers.fs import scan as fs_scan

        real = fs_scan.open_dir

        def open_dir(parent_fd: int, name: str) -> int | None:
            if name == leaf_dir.name:
                raise PermissionError(13, "Permission denied", name)
            return real(parent_fd, name)

        monkeypatch.setattr(fs_scan, "open_dir", open_dir)
        tier.sync.invalidate(key_of(3))  # listed again by the next pass
        with caplog.at_level("WARNING", logger="kvtier.tiers.fs.tier"):
            await tier.rescan()
        assert "could not be read (permission denied)" in caplog.text
        assert key_of(3) in tier.index and len(tier.index) == 16

"""The fs tier against a hostile or broken tree: links, pipes, swapped and old files, full disks,
crash leftovers, and the capacity cap under concurrency and rescans (kvtier/tiers/fs/tier.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
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
    finish,
    job_ids,
    key_of,
    load,
    make_tier,
    metric,
    probe,
    running,
    store,
)
from test_fs_scan import walk

from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.tiers.base import TransferJob
from kvtier.tiers.fs import chunks, scan
from kvtier.tiers.fs.scan import ScanBatch
from kvtier.tiers.fs.tier import FileSystemTier
from kvtier.tiers.fs.tree import PROBE_PREFIX, config_path
from kvtier.tiers.integrity import checksum
from kvtier.types import LookupResult


@pytest.fixture
def host() -> SlotBuffer:
    buf = SlotBuffer(128, SLOT, pin_memory=False)
    yield buf
    buf.close()


def chunk_path(tier: FileSystemTier, i: int) -> Path:
    return Path(tier.namespace.chunk_path(key_of(i)))


async def stored_chunk_file(tmp_path: Path, host: SlotBuffer, i: int) -> bytes:
    """The bytes of a genuine chunk file for chunk ``i`` (written by a tier in another root)."""
    other = make_tier(tmp_path / "elsewhere", host)
    async with running(other):
        assert (await store(other, host, [i])).success
    return chunk_path(other, i).read_bytes()


# --- links and special files --------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_chunk_that_is_a_link_to_a_valid_chunk_outside_is_a_miss_removed_and_counted(
    tmp_path: Path, host: SlotBuffer
) -> None:
    genuine = await stored_chunk_file(tmp_path, host, 5)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(genuine)  # exactly the right bytes, but not in the tree
    tier = make_tier(tmp_path / "root", host, rescan_interval_s=3600)
    path = chunk_path(tier, 5)
    path.parent.mkdir(parents=True)
    os.symlink(outside, path)
    async with running(tier):
        assert len(tier.index) == 0  # the start-up scan did not index the link: it removed it
        assert not os.path.lexists(path)
        os.symlink(outside, path)  # planted again after start-up
        host.view(0)[:] = b"\xee" * SLOT
        result = await load(tier, [5])
        assert not result.success and result.failure_reason == "corrupt"
        assert bytes(host.view(0)) == bytes(SLOT)
        assert metric(tier, "fs_rejected_chunks")[("not_regular",)] == 2
    assert not os.path.lexists(path)
    assert outside.read_bytes() == genuine


@pytest.mark.anyio
async def test_a_linked_shard_directory_never_receives_a_store(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path / "root", host, rescan_interval_s=3600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with running(tier):
        shard = chunk_path(tier, 7).parent.parent  # <blocks>/<hhh>
        shard.mkdir(parents=True, exist_ok=True)
        shard.rmdir()
        os.symlink(elsewhere, shard)
        assert (await store(tier, host, [7])).success
        assert not shard.is_symlink() and chunk_path(tier, 7).stat().st_size == FILE
        assert metric(tier, "fs_rejected_chunks")[("not_regular",)] == 1
        host.view(0)[:] = bytes(SLOT)
        assert (await load(tier, [7])).success and bytes(host.view(0)) == expected(7)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.anyio
async def test_a_named_pipe_at_a_chunk_path_never_blocks_a_worker_or_close(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=3600, n_read_threads=1, n_write_threads=1)
    with anyio.fail_after(30):  # a hang guard only: before the fix the worker blocked forever
        async with running(tier):
            assert (await store(tier, host, [1, 2])).success
            path = chunk_path(tier, 2)
            path.unlink()
            os.mkfifo(path)
            result = await load(tier, [1, 2])
            assert result.successful_keys == [key_of(1)] and result.failure_reason == "corrupt"
            assert not os.path.lexists(path)
            assert metric(tier, "fs_rejected_chunks")[("not_regular",)] == 1
            os.mkfifo(path)
            assert await probe(tier, [key_of(2)]) == [LookupResult.MISS]  # a probe never opens it
            assert (await store(tier, host, [2])).success  # a store replaces it
            assert path.stat().st_size == FILE


# --- files that are not this chunk --------------------------------------------------------------


@pytest.mark.anyio
async def test_a_valid_chunk_file_renamed_or_copied_over_another_is_the_wrong_chunk(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        assert (await store(tier, host, [1, 2, 3])).success
        shutil.copyfile(chunk_path(tier, 1), chunk_path(tier, 2))  # copied over
        os.replace(chunk_path(tier, 1), chunk_path(tier, 3))  # renamed over
        for slot in range(3):
            host.view(slot)[:] = b"\xee" * SLOT
        result = await load(tier, [2, 3])
        assert not result.success and result.successful_keys == []
        assert bytes(host.view(0)) == bytes(host.view(1)) == bytes(SLOT)
        assert metric(tier, "fs_rejected_chunks")[("wrong_chunk",)] == 2
    assert bin_files(tmp_path) == []


@pytest.mark.anyio
async def test_a_chunk_of_another_run_in_this_runs_tree_is_the_wrong_chunk(tmp_path: Path, host: SlotBuffer) -> None:
    from fs_tiers import GEOMETRY

    other_run = make_tier(tmp_path, host, geometry=GEOMETRY.__class__(
        "org/other-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16))
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(other_run):
        assert (await store(other_run, host, [4])).success
    async with running(tier):
        chunk_path(tier, 4).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chunk_path(other_run, 4), chunk_path(tier, 4))
        assert not (await load(tier, [4])).success
        assert metric(tier, "fs_rejected_chunks")[("wrong_chunk",)] == 1


@pytest.mark.anyio
async def test_a_version_1_chunk_file_is_a_miss_and_is_replaced_by_the_next_store(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    path = chunk_path(tier, 9)
    path.parent.mkdir(parents=True)
    payload = expected(9)
    v1_trailer = struct.pack("<4sHHQQ8x", b"KVTR", 1, 0, SLOT, checksum(payload))
    path.write_bytes(payload + bytes(4096 - 32) + v1_trailer)  # what kvtier 0.1 wrote
    async with running(tier):
        assert not (await load(tier, [9])).success
        assert metric(tier, "fs_rejected_chunks")[("old_version",)] == 1
        assert not path.exists()
        assert (await store(tier, host, [9])).success
        host.view(0)[:] = bytes(SLOT)
        assert (await load(tier, [9])).success and bytes(host.view(0)) == expected(9)


# --- crash leftovers and full disks --------------------------------------------------------------


@pytest.mark.anyio
async def test_start_up_sweeps_stale_config_temporaries_and_probe_files(tmp_path: Path, host: SlotBuffer) -> None:
    first = make_tier(tmp_path, host)
    async with running(first):
        pass
    config_dir = Path(first.namespace.base_dir)
    blocks_dir = Path(first.namespace.blocks_dir)
    old = time.time() - 7200
    leftovers = [config_dir / "config.json_123.tmp", blocks_dir / f"{PROBE_PREFIX}_456"]
    young = [config_dir / "config.json_789.tmp", blocks_dir / f"{PROBE_PREFIX}_1011"]
    for f in leftovers + young:
        f.write_bytes(b"crash")
    for f in leftovers:
        os.utime(f, (old, old))
    tier = make_tier(tmp_path, host, stale_tmp_grace_s=3600)
    async with running(tier):
        assert metric(tier, "fs_stale_tmp_removed")[()] == 2
    assert not any(f.exists() for f in leftovers) and all(f.exists() for f in young)


def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new file or directory fails with ENOSPC."""
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.anyio
async def test_start_up_on_a_full_disk_serves_what_is_there(tmp_path: Path, host: SlotBuffer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_tier(tmp_path, host)
    async with running(first):
        assert (await store(first, host, [1, 2])).success
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    _disk_full(monkeypatch)
    tier = make_tier(tmp_path, host)
    async with running(tier):  # config.json exists and matches: no write needed to start
        host.view(0)[:] = host.view(1)[:] = bytes(SLOT)
        assert (await load(tier, [1, 2])).success
        assert bytes(host.view(0)) == expected(1) and bytes(host.view(1)) == expected(2)
        failed = await store(tier, host, [3])
        assert not failed.success and failed.failure_reason == "no_space"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing left behind


@pytest.mark.anyio
async def test_a_first_start_on_a_full_disk_is_a_config_error_that_leaves_nothing(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and str(path).startswith("config.json"):
            fd = real_open(path, flags, *args, **kwargs)
            os.close(fd)  # the temporary exists now; writing its contents then fails
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(ConfigError, match="root_dir.*No space left"):
        await make_tier(root, host).open()
    monkeypatch.undo()
    assert [p for p in root.rglob("*") if p.is_file()] == []  # its temporary file was removed


@pytest.mark.anyio
async def test_short_writes_on_a_full_disk_are_no_space_not_io_error(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path, host)
    async with running(tier):
        monkeypatch.setattr(chunks.os, "pwritev", lambda fd, bufs, off: 4096 if off == 0 else 0)
        failed = await store(tier, host, [1, 2])
        assert not failed.success and failed.failure_reason == "no_space"
        assert tier.statistics().failures[("store", "no_space")] == 1
        assert ("store", "io_error") not in tier.statistics().failures
    assert not list(tmp_path.rglob("*.tmp")) and bin_files(tmp_path) == []


# --- capacity is a hard cap ----------------------------------------------------------------------


class DiskModel:
    """What is on disk, from the moment a write starts until a removal has finished (the
    pessimistic view): ``peak`` is the most bytes ever present at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, initial: int = 0) -> None:
        self.lock = threading.Lock()
        self.present: dict[str, int] = {}
        self.peak = initial
        real_write, real_remove = chunks.write_chunk, chunks.remove_file

        def write_chunk(dir_fd: int, relpath: str, payload: memoryview, page: bytes, **kw: Any) -> int:
            with self.lock:
                self.present[relpath] = len(payload) + len(page)
                self.peak = max(self.peak, sum(self.present.values()))
            return real_write(dir_fd, relpath, payload, page, **kw)

        def remove_file(dir_fd: int, relpath: str) -> bool:
            removed = real_remove(dir_fd, relpath)
            with self.lock:
                self.present.pop(relpath, None)
            return removed

        monkeypatch.setattr(chunks, "write_chunk", write_chunk)
        monkeypatch.setattr(chunks, "remove_file", remove_file)


@pytest.mark.anyio
async def test_max_bytes_is_never_exceeded_on_disk_by_concurrent_jobs_evictions_and_rescans(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 24 * FILE
    model = DiskModel(monkeypatch)
    tier = make_tier(tmp_path, host, max_bytes=cap, rescan_interval_s=0.005, n_read_threads=2, n_write_threads=3)
    async with running(tier):
        for wave in range(8):  # waves of 3 jobs of 8 chunks at once: every wave evicts a cap's worth
            jobs = []
            for j in range(3):
                ids = range(1000 * wave + 100 * j, 1000 * wave + 100 * j + 8)
                slots = list(range(8 * j, 8 * j + 8))
                for slot, i in zip(slots, ids):
                    host.view(slot)[:] = expected(i)
                jobs.append(TransferJob(next(job_ids), [key_of(i) for i in ids], slots, is_promotion=False))
            results = await finish(tier, jobs)  # submitted together: the tier runs them concurrently
            assert all(r.success for r in results.values())
        assert tier.statistics().evictions >= 7 * 24
        await tier.rescan()
        assert tier.index.used == sum(f.stat().st_size for f in bin_files(tmp_path)) <= cap
    assert model.peak <= cap, f"{model.peak / FILE:.0f} chunk files on disk at once, cap {cap // FILE}"


@pytest.mark.anyio
async def test_a_rescan_never_forgets_a_chunk_written_while_it_listed_the_tree(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    scans: list[ScanBatch] = []
    real_write = chunks.write_chunk

    def write_during_a_scan(dir_fd: int, relpath: str, *args: Any, **kw: Any) -> int:
        # A rescan lists the tree after this chunk was reserved but before its file exists:
        # the exact race of a rescan with a fresh write.
        scans.append(walk(dir_fd))
        return real_write(dir_fd, relpath, *args, **kw)

    async with running(tier):
        monkeypatch.setattr(chunks, "write_chunk", write_during_a_scan)
        assert (await store(tier, host, [1])).success
        monkeypatch.undo()
        [batch] = scans
        assert batch.leaves == []  # its directory did not exist yet
        await tier.sync.apply_batch(batch, initial=False)
        assert key_of(1) in tier.index and tier.index.used == FILE
        assert await probe(tier, [key_of(1)]) == [LookupResult.HIT]
        assert (await load(tier, [1])).success


@pytest.mark.anyio
async def test_config_json_that_is_a_link_is_refused(tmp_path: Path, host: SlotBuffer) -> None:
    first = make_tier(tmp_path, host)
    async with running(first):
        pass
    config = Path(config_path(first.namespace))
    real = tmp_path / "real-config.json"
    real.write_text(json.dumps(dict(first.namespace.fields)))
    config.unlink()
    os.symlink(real, config)
    with pytest.raises(ConfigError, match="symbolic link"):
        await make_tier(tmp_path, host).open()


@pytest.mark.anyio
async def test_a_rescan_never_revives_a_chunk_evicted_after_it_listed_the_tree(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host, max_bytes=4 * FILE, rescan_interval_s=3600)
    async with running(tier):
        assert (await store(tier, host, [1, 2, 3, 4])).success
        batch = walk(tier._dir_fd)  # lists 1..4
        assert (await store(tier, host, [5, 6])).success  # evicts 1 and 2 after the listing
        await tier.sync.apply_batch(batch, initial=False)
        assert key_of(1) not in tier.index and key_of(2) not in tier.index
        assert tier.index.used == sum(f.stat().st_size for f in bin_files(tmp_path)) == 4 * FILE
        assert tier.statistics().evictions == 2  # nothing else evicted to make room for ghosts


@pytest.mark.anyio
async def test_a_chunk_of_another_ranks_tree_is_the_wrong_chunk(tmp_path: Path, host: SlotBuffer) -> None:
    rank0 = make_tier(tmp_path, host, parallel_agnostic=False, rank=0, rescan_interval_s=3600)
    rank1 = make_tier(tmp_path, host, parallel_agnostic=False, rank=1, rescan_interval_s=3600)
    assert rank0.namespace.blocks_dir != rank1.namespace.blocks_dir  # each rank holds its own heads
    async with running(rank0):
        assert (await store(rank0, host, [5])).success
    chunk_path(rank1, 5).parent.mkdir(parents=True)
    shutil.copyfile(chunk_path(rank0, 5), chunk_path(rank1, 5))
    async with running(rank1):
        assert not (await load(rank1, [5])).success
        assert metric(rank1, "fs_rejected_chunks")[("wrong_chunk",)] == 1


@pytest.mark.anyio
async def test_a_cap_lowered_between_runs_is_enforced_on_disk_at_start_up(tmp_path: Path, host: SlotBuffer) -> None:
    first = make_tier(tmp_path, host)
    async with running(first):
        assert (await store(first, host, range(8))).success
    tier = make_tier(tmp_path, host, max_bytes=3 * FILE, rescan_interval_s=3600)
    async with running(tier):
        assert len(bin_files(tmp_path)) == 3  # the oldest five were deleted, not just forgotten
        assert tier.index.used == 3 * FILE
        assert (await store(tier, host, [20, 21])).success
        assert len(bin_files(tmp_path)) == 3


@pytest.mark.anyio
async def test_close_during_a_long_scan_joins_every_thread_and_closes_the_tree(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path, host, rescan_interval_s=0.01, n_read_threads=1, n_write_threads=1)
    async with running(tier):
        assert (await store(tier, host, range(6))).success  # six shard directories to walk
        real_open_dir = scan.open_dir
        scanning = threading.Event()

        def slow_dir(*args: Any) -> Any:  # a tree of millions of files: each directory takes a while
            scanning.set()
            time.sleep(1.0)  # six of them outlast close_timeout_s (3 s)
            return real_open_dir(*args)

        monkeypatch.setattr(scan, "open_dir", slow_dir)
        with anyio.fail_after(10):
            while not scanning.is_set():
                await anyio.sleep(0.01)
        dir_fd = tier._dir_fd
    # close stopped the scan at its next directory: the pool's threads are joined, the fd closed
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-fs0")]
    with pytest.raises(OSError):
        os.fstat(dir_fd)


def test_a_directory_under_a_chunks_name_is_not_regular(tmp_path: Path) -> None:
    (tmp_path / "c.bin").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dst = memoryview(bytearray(SLOT))
        assert chunks.load_chunk(fd, "c.bin", dst, bytes(128), o_direct=False).reason == "not_regular"
    finally:
        os.close(fd)


def test_the_o_direct_probe_on_a_full_disk_keeps_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not chunks.probe_o_direct(fd):
            pytest.skip("this filesystem has no O_DIRECT")

        def full(*args: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(chunks.os, "pwrite", full)
        assert chunks.probe_o_direct(fd) is True
        assert list(tmp_path.iterdir()) == []  # the probe file is removed either way
    finally:
        os.close(fd)

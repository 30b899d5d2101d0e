"""Specification of the fs tier's raw file primitives and dual-queue pool (kvtier/tiers/fs_io.py)."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import anyio
import pytest

from kvtier.tiers import fs_io
from kvtier.tiers.fs_io import DualQueuePool, IOQueue
from kvtier.tiers.integrity import SizeClass, make_trailer_page, verify

SLOT = 16384


def _slot(fill: int) -> memoryview:
    buf = mmap.mmap(-1, SLOT)  # page aligned, as host slots are
    buf.write(bytes([fill]) * SLOT)
    return memoryview(buf)


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def o_direct(request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    if request.param and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem has no O_DIRECT")  # the buffered variant still runs
    return bool(request.param)


def test_write_then_read_round_trips_with_trailer(tmp_path: Path, o_direct: bool) -> None:
    src = _slot(0xAB)
    path = str(tmp_path / "abc" / "de_g0" / "abcdef00.bin")
    assert fs_io.write_chunk(path, src, make_trailer_page(src), o_direct=o_direct) == SLOT + 4096
    assert os.path.getsize(path) == SLOT + 4096
    dst = _slot(0)
    outcome = fs_io.read_chunk(path, dst, o_direct=o_direct)
    assert outcome.size_class is SizeClass.TRAILERED
    assert bytes(dst) == bytes(src)
    assert verify(dst, outcome.trailer_page).verified


def test_existing_final_file_is_a_finished_chunk_and_is_not_rewritten(tmp_path: Path) -> None:
    path = str(tmp_path / "c.bin")
    first = _slot(1)
    fs_io.write_chunk(path, first, make_trailer_page(first), o_direct=False)
    second = _slot(2)
    assert fs_io.write_chunk(path, second, make_trailer_page(second), o_direct=False) == 0
    dst = _slot(0)
    fs_io.read_chunk(path, dst, o_direct=False)
    assert bytes(dst) == bytes(first)


def test_failed_write_leaves_no_temporary_or_final_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs_io.os, "pwritev", no_space)
    src = _slot(3)
    with pytest.raises(OSError) as info:
        fs_io.write_chunk(str(tmp_path / "c.bin"), src, make_trailer_page(src), o_direct=False)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_short_write_is_an_error_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs_io.os, "pwritev", lambda fd, bufs, off: 100)
    src = _slot(3)
    with pytest.raises(OSError) as info:
        fs_io.write_chunk(str(tmp_path / "c.bin"), src, make_trailer_page(src), o_direct=False)
    assert info.value.errno == errno.EIO
    assert list(tmp_path.iterdir()) == []


def test_read_reports_wrong_sizes_without_reading(tmp_path: Path) -> None:
    short, long_ = tmp_path / "s.bin", tmp_path / "l.bin"
    short.write_bytes(b"x" * 100)
    long_.write_bytes(b"x" * (SLOT + 8192))
    dst = _slot(0)
    assert fs_io.read_chunk(str(short), dst, o_direct=False).size_class is SizeClass.SHORT
    assert fs_io.read_chunk(str(long_), dst, o_direct=False).size_class is SizeClass.LONG
    assert bytes(dst) == bytes(SLOT)


def test_raw_file_of_slot_size_reads_without_trailer(tmp_path: Path) -> None:
    raw = tmp_path / "r.bin"
    raw.write_bytes(b"\x05" * SLOT)
    dst = _slot(0)
    outcome = fs_io.read_chunk(str(raw), dst, o_direct=False)
    assert outcome.size_class is SizeClass.RAW and outcome.trailer_page is None
    assert bytes(dst) == b"\x05" * SLOT


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fs_io.read_chunk(str(tmp_path / "none.bin"), _slot(0), o_direct=False)
    assert fs_io.remove_file(str(tmp_path / "none.bin")) is False


def test_load_chunk_verifies_a_trailered_chunk_in_one_read(tmp_path: Path, o_direct: bool) -> None:
    src = _slot(0x3C)
    path = str(tmp_path / "c.bin")
    fs_io.write_chunk(path, src, make_trailer_page(src), o_direct=o_direct)
    dst = _slot(0)
    verdict = fs_io.load_chunk(path, dst, o_direct=o_direct)
    assert verdict.ok and verdict.verified
    assert bytes(dst) == bytes(src)


@pytest.mark.parametrize(
    ("size", "reason"),
    [(100, "short"), (SLOT - 4096, "short"), (SLOT + 1, "short"), (SLOT + 4095, "short"),
     (SLOT + 4097, "long"), (SLOT + 8192, "long"), (SLOT + 3 * 4096, "long")],
)
def test_load_chunk_rejects_wrong_sizes_by_what_one_read_returned(tmp_path: Path, size: int, reason: str) -> None:
    # No stat: the count read into [slot, trailer page, spare page] alone classifies the file.
    path = tmp_path / "c.bin"
    path.write_bytes(b"x" * size)
    verdict = fs_io.load_chunk(str(path), _slot(0), o_direct=False)
    assert not verdict.ok and verdict.reason == reason
    assert path.exists()  # removal is the tier's decision


def test_load_chunk_accepts_a_trailerless_slot_sized_file_unverified(tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(b"\x05" * SLOT)
    dst = _slot(0)
    verdict = fs_io.load_chunk(str(path), dst, o_direct=False)
    assert verdict.ok and not verdict.verified
    assert bytes(dst) == b"\x05" * SLOT


def test_load_chunk_reports_a_corrupt_payload_and_a_bad_trailer(tmp_path: Path) -> None:
    src = _slot(0x11)
    page = make_trailer_page(src)
    flipped = tmp_path / "flipped.bin"
    flipped.write_bytes(b"\x12" + bytes(src)[1:] + page)
    bad_magic = tmp_path / "magic.bin"
    bad_magic.write_bytes(bytes(src) + page[:-32] + b"XXXX" + page[-28:])
    assert fs_io.load_chunk(str(flipped), _slot(0), o_direct=False).reason == "checksum"
    assert fs_io.load_chunk(str(bad_magic), _slot(0), o_direct=False).reason == "bad_trailer"


def test_load_chunk_does_not_see_a_previous_reads_trailer(tmp_path: Path) -> None:
    # The trailer page is thread scratch: a later short file must not be judged by a stale one.
    src = _slot(0x21)
    good = str(tmp_path / "good.bin")
    fs_io.write_chunk(good, src, make_trailer_page(src), o_direct=False)
    assert fs_io.load_chunk(good, _slot(0), o_direct=False).verified
    torn = tmp_path / "torn.bin"
    torn.write_bytes(bytes(src) + bytes(4096 - 32))  # trailer page cut before its trailer
    assert fs_io.load_chunk(str(torn), _slot(0), o_direct=False).reason == "short"


@pytest.mark.skipif(not hasattr(os, "O_NOATIME"), reason="O_NOATIME is Linux-only")
def test_loads_leave_the_access_time_alone(tmp_path: Path) -> None:
    src = _slot(0x31)
    path = str(tmp_path / "c.bin")
    fs_io.write_chunk(path, src, make_trailer_page(src), o_direct=False)
    control = tmp_path / "control.bin"
    control.write_bytes(b"c")
    for p in (path, control):
        os.utime(p, ns=(1_000_000_000, 2_000_000_000))  # atime before mtime: relatime would update it
    control.read_bytes()
    if os.stat(control).st_atime_ns == 1_000_000_000:
        pytest.skip("this filesystem never updates access times (noatime mount)")
    assert fs_io.load_chunk(path, _slot(0), o_direct=False).verified
    assert os.stat(path).st_atime_ns == 1_000_000_000


@pytest.mark.skipif(not hasattr(os, "O_NOATIME"), reason="O_NOATIME is Linux-only")
def test_a_file_of_another_owner_is_read_without_o_noatime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _slot(0x32)
    path = str(tmp_path / "c.bin")
    fs_io.write_chunk(path, src, make_trailer_page(src), o_direct=False)
    real_open, flags_seen = os.open, []

    def not_the_owner(p: str, flags: int, *args: int) -> int:
        flags_seen.append(flags)
        if flags & os.O_NOATIME:
            raise PermissionError(errno.EPERM, "Operation not permitted", p)
        return real_open(p, flags, *args)

    monkeypatch.setattr(fs_io.os, "open", not_the_owner)
    dst = _slot(0)
    assert fs_io.load_chunk(path, dst, o_direct=False).verified
    assert bytes(dst) == bytes(src)
    assert [bool(f & os.O_NOATIME) for f in flags_seen] == [True, False]


def test_load_chunk_raises_file_not_found_for_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fs_io.load_chunk(str(tmp_path / "none.bin"), _slot(0), o_direct=False)


def test_scan_lists_layout_chunks_and_removes_only_stale_temporaries(tmp_path: Path) -> None:
    h = "abcdef0123"
    d = tmp_path / h[:3] / f"{h[3:5]}_g2"
    d.mkdir(parents=True)
    (d / f"{h}.bin").write_bytes(b"x" * 10)
    stale = d / f"{h}.bin_123.tmp"
    fresh = d / f"{h}.bin_456.tmp"
    stale.write_bytes(b"t")
    fresh.write_bytes(b"t")
    old = time.time() - 1000
    os.utime(stale, (old, old))
    (d / "notes.txt").write_text("not ours")
    (d / "ABCDEF0123.bin").write_bytes(b"upper-case is not a chunk name")
    (tmp_path / "zzz").mkdir()
    result = fs_io.scan_tree(str(tmp_path), tmp_grace_s=100.0)
    assert [c.key for c in result.chunks] == [bytes.fromhex(h) + (2).to_bytes(4, "big")]
    assert result.chunks[0].size == 10
    assert (result.removed_tmp, result.kept_tmp) == (1, 1)
    assert not stale.exists() and fresh.exists() and (d / "notes.txt").exists()


def test_scan_of_a_missing_tree_is_empty(tmp_path: Path) -> None:
    result = fs_io.scan_tree(str(tmp_path / "absent"), tmp_grace_s=0)
    assert result.chunks == [] and result.removed_tmp == 0


def test_scan_orders_chunks_oldest_first(tmp_path: Path) -> None:
    names = ["aaa111", "bbb222", "ccc333"]
    for age, h in zip((30, 10, 20), names):
        d = tmp_path / h[:3] / f"{h[3:5]}_g0"
        d.mkdir(parents=True)
        f = d / f"{h}.bin"
        f.write_bytes(b"x")
        t = time.time() - age
        os.utime(f, (t, t))
    result = fs_io.scan_tree(str(tmp_path), tmp_grace_s=None)
    assert [c.key[:-4].hex() for c in result.chunks] == ["aaa111", "ccc333", "bbb222"]


# --- the pool ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_pool_runs_tasks_and_propagates_results_and_errors() -> None:
    pool = DualQueuePool(2, 2)
    pool.start()
    try:
        assert await pool.run(IOQueue.READ, lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await pool.run(IOQueue.WRITE, lambda: 1 / 0)
    finally:
        await pool.aclose()
    assert pool.statistics().completed == 2


@pytest.mark.anyio
async def test_one_queue_steals_idle_workers_of_the_other() -> None:
    # 1 read + 3 write workers; 4 reads that block until all 4 run at once can only finish if
    # the write-priority workers steal from the read queue.
    pool = DualQueuePool(1, 3)
    pool.start()
    barrier = threading.Barrier(4, timeout=10)
    names: list[str] = []

    def blocking_read() -> None:
        names.append(threading.current_thread().name)
        barrier.wait()

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(pool.run, IOQueue.READ, blocking_read)
    finally:
        await pool.aclose()
    assert sorted(n.rsplit("-", 1)[1][0] for n in names) == ["r", "w", "w", "w"]


@pytest.mark.anyio
async def test_a_worker_with_both_queues_non_empty_takes_from_its_own() -> None:
    pool = DualQueuePool(1, 1)
    gates = {"kvtier-io-r0": threading.Event(), "kvtier-io-w0": threading.Event()}
    taken_by: dict[str, str] = {}

    def blocker() -> None:
        gates[threading.current_thread().name].wait(10)

    def record(kind: str) -> None:
        taken_by[kind] = threading.current_thread().name

    pool.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, IOQueue.READ, blocker)
            tg.start_soon(pool.run, IOQueue.WRITE, blocker)
            while pool.statistics().running < 2:
                await anyio.sleep(0.001)
            tg.start_soon(pool.run, IOQueue.WRITE, record, "write")
            tg.start_soon(pool.run, IOQueue.READ, record, "read")
            while pool.statistics().queued_reads + pool.statistics().queued_writes < 2:
                await anyio.sleep(0.001)
            gates["kvtier-io-w0"].set()  # only the write worker frees up, and both queues hold work
            while "write" not in taken_by:
                await anyio.sleep(0.001)
            assert taken_by["write"] == "kvtier-io-w0"
            gates["kvtier-io-r0"].set()
    finally:
        for gate in gates.values():
            gate.set()
        await pool.aclose()


@pytest.mark.anyio
async def test_cancelling_a_queued_task_withdraws_it() -> None:
    pool = DualQueuePool(1, 1)
    gate = threading.Event()
    ran: list[int] = []
    pool.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, IOQueue.READ, gate.wait)
            tg.start_soon(pool.run, IOQueue.WRITE, gate.wait)
            while pool.statistics().running < 2:
                await anyio.sleep(0.001)
            with anyio.move_on_after(0.05):
                await pool.run(IOQueue.READ, ran.append, 1)
            assert pool.statistics().queued_reads == 0
            gate.set()
    finally:
        await pool.aclose()
    assert ran == []


@pytest.mark.anyio
async def test_cancelling_a_running_task_waits_until_it_stops_touching_its_buffer() -> None:
    pool = DualQueuePool(1, 1)
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        started.set()
        release.wait(10)
        finished.append(True)

    pool.start()
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.run, IOQueue.WRITE, slow)
                await anyio.to_thread.run_sync(started.wait)
                scope.cancel()
                release.set()
        assert finished == [True]  # cancellation returned only after the task finished
    finally:
        await pool.aclose()


@pytest.mark.anyio
async def test_closed_pool_refuses_tasks_and_joins_its_threads() -> None:
    pool = DualQueuePool(2, 1)
    pool.start()
    threads = [t for t in threading.enumerate() if t.name.startswith("kvtier-io-")]
    assert len(threads) >= 3
    await pool.aclose()
    assert not any(t.is_alive() for t in threads if t.name.startswith("kvtier-io-"))
    with pytest.raises(anyio.ClosedResourceError):
        await pool.run(IOQueue.READ, lambda: None)


def test_pool_needs_workers_in_both_groups() -> None:
    with pytest.raises(ValueError):
        DualQueuePool(0, 1)


@pytest.mark.anyio
async def test_batch_returns_one_result_per_call_and_failures_do_not_stop_the_others() -> None:
    pool = DualQueuePool(2, 2, batch_slices=3)
    pool.start()
    try:
        outcomes = await pool.run_batch(IOQueue.WRITE, lambda x: 10 // x, [(5,), (0,), (2,)])
    finally:
        await pool.aclose()
    assert outcomes[0] == 2 and outcomes[2] == 5
    assert isinstance(outcomes[1], ZeroDivisionError)
    assert pool.statistics().completed == 3


@pytest.mark.anyio
async def test_a_batch_runs_its_calls_in_parallel_across_both_worker_groups() -> None:
    pool = DualQueuePool(1, 3, batch_slices=4)
    barrier = threading.Barrier(4, timeout=10)  # only passes if all four calls run at once
    pool.start()
    try:
        outcomes = await pool.run_batch(IOQueue.READ, barrier.wait, [()] * 4)
    finally:
        await pool.aclose()
    assert len(outcomes) == 4 and not any(isinstance(o, BaseException) for o in outcomes)


def test_a_batch_is_cut_into_one_slice_per_usable_core_at_most_one_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs_io, "usable_cpus", lambda: 2)
    assert DualQueuePool(4, 4).batch_slices == 2
    monkeypatch.setattr(fs_io, "usable_cpus", lambda: 64)
    assert DualQueuePool(4, 4).batch_slices == 8
    assert DualQueuePool(4, 4, batch_slices=3).batch_slices == 3
    with pytest.raises(ValueError):
        DualQueuePool(1, 1, batch_slices=0)


@pytest.mark.anyio
async def test_a_batch_of_n_slices_runs_as_n_pool_tasks() -> None:
    pool = DualQueuePool(2, 2, batch_slices=3)
    pool.start()
    try:
        assert await pool.run_batch(IOQueue.READ, lambda i: i * i, [(i,) for i in range(10)]) == [i * i for i in range(10)]
    finally:
        await pool.aclose()
    assert pool.statistics().completed == 3  # slices of 4, 4 and 2 calls


@pytest.mark.anyio
async def test_a_batch_wakes_the_loop_once_not_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = DualQueuePool(2, 2)
    dispatches: list[int] = []
    real_dispatch = pool._dispatch

    def counting_dispatch() -> None:
        dispatches.append(1)
        real_dispatch()

    monkeypatch.setattr(pool, "_dispatch", counting_dispatch)
    pool.start()
    try:
        outcomes = await pool.run_batch(IOQueue.READ, lambda i: i, [(i,) for i in range(64)])
    finally:
        await pool.aclose()
    assert outcomes == list(range(64))
    assert len(dispatches) == 2  # the batch's wake-up, and the final sweep of aclose


@pytest.mark.anyio
async def test_cancelling_a_batch_withdraws_queued_calls_and_waits_for_running_ones() -> None:
    # Calls are queued in `batch_slices` slices of `size` calls.
    n_slices = 4
    pool = DualQueuePool(1, 1, batch_slices=n_slices)
    size = 3
    started, release = threading.Barrier(3, timeout=10), threading.Event()
    ran: list[int] = []

    def call(i: int) -> None:
        if i in (0, size):
            started.wait()  # the first two slices occupy both workers
            release.wait(10)
        ran.append(i)

    pool.start()
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.run_batch, IOQueue.WRITE, call, [(i,) for i in range(size * n_slices)])
                await anyio.to_thread.run_sync(started.wait)
                assert pool.statistics().queued_writes == n_slices - 2
                scope.cancel()
                with anyio.CancelScope(shield=True):
                    with anyio.fail_after(5):  # hang guard: the queued slices are withdrawn
                        while pool.statistics().queued_writes:
                            await anyio.sleep(0.001)
                release.set()
        # returned only after the running slices finished; the queued ones never ran
        assert sorted(ran) == list(range(2 * size))
        assert pool.statistics().queued_writes == 0
    finally:
        await pool.aclose()
    assert sorted(ran) == list(range(2 * size))


@pytest.mark.anyio
async def test_closed_pool_refuses_batches() -> None:
    pool = DualQueuePool(1, 1)
    pool.start()
    await pool.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await pool.run_batch(IOQueue.READ, lambda: None, [()])

"""Specification of the fs tier's raw file primitives and dual-queue pool (kvtier/tiers/fs/chunks.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import pytest
from chunk_files import ME, SLOT, slot_filled_with, trailer_page_of

from kvtier.keys import make_offload_key
from kvtier.layout import Namespace
from kvtier.tiers.codec import ChunkCodec
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.fs import tier as fs_tier
from kvtier.tiers.fs.pool import MAX_SLICE_ITEMS, DualQueuePool, IOQueue
from kvtier.tiers.integrity import ACCEPTED_VERIFIED, SizeClass, identity, make_trailer_page, verify


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[int]:
    """A descriptor of ``tmp_path``: the primitives work beneath a directory the tier holds open."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def o_direct(request: pytest.FixtureRequest, tree: int) -> bool:
    if request.param and not chunks.probe_o_direct(tree):
        pytest.skip("this filesystem has no O_DIRECT")  # the buffered variant still runs
    return bool(request.param)


def test_write_then_read_round_trips_with_trailer(tmp_path: Path, tree: int, o_direct: bool) -> None:
    src = slot_filled_with(0xAB)
    rel = "abc/de_g0/abcdef00.bin"
    assert chunks.write_chunk(tree, rel, src, trailer_page_of(src), o_direct=o_direct) == SLOT + 4096
    assert os.path.getsize(tmp_path / rel) == SLOT + 4096
    dst = slot_filled_with(0)
    outcome = chunks.read_chunk(tree, rel, dst, o_direct=o_direct)
    assert outcome.size_class is SizeClass.TRAILERED
    assert bytes(dst) == bytes(src)
    assert verify(dst, outcome.trailer_page, ME).verified


def test_existing_final_file_is_a_finished_chunk_and_is_not_rewritten(tree: int) -> None:
    first = slot_filled_with(1)
    chunks.write_chunk(tree, "c.bin", first, trailer_page_of(first), o_direct=False)
    second = slot_filled_with(2)
    assert chunks.write_chunk(tree, "c.bin", second, trailer_page_of(second), o_direct=False) == 0
    dst = slot_filled_with(0)
    chunks.read_chunk(tree, "c.bin", dst, o_direct=False)
    assert bytes(dst) == bytes(first)


def test_a_file_of_another_size_under_the_name_is_replaced(tmp_path: Path, tree: int) -> None:
    (tmp_path / "c.bin").write_bytes(b"\x07" * SLOT)  # trailer-less (vLLM's format)
    src = slot_filled_with(4)
    assert chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False) == SLOT + 4096
    assert (tmp_path / "c.bin").read_bytes() == bytes(src) + trailer_page_of(src)


def test_failed_write_leaves_no_temporary_or_final_file(tmp_path: Path, tree: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chunks.os, "pwritev", no_space)
    src = slot_filled_with(3)
    with pytest.raises(OSError) as info:
        chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_short_write_is_retried_and_a_full_disk_is_no_space(tmp_path: Path, tree: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A full disk: the first call writes a little, the retry writes nothing.
    calls: list[int] = []

    def full(fd: int, bufs: list[memoryview], off: int) -> int:
        calls.append(off)
        return 100 if off == 0 else 0

    monkeypatch.setattr(chunks.os, "pwritev", full)
    src = slot_filled_with(3)
    with pytest.raises(OSError) as info:
        chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False)
    assert info.value.errno == errno.ENOSPC
    assert calls == [0, 100]
    assert list(tmp_path.iterdir()) == []


def test_a_short_write_that_can_be_completed_is_completed(tmp_path: Path, tree: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def interrupted(fd: int, bufs: list[memoryview], off: int) -> int:
        if off == 0:  # a signal cut the first call short after 5000 bytes
            return real(fd, [bufs[0][:5000]], 0)
        return real(fd, bufs, off)

    monkeypatch.setattr(chunks.os, "pwritev", interrupted)
    src = slot_filled_with(9)
    assert chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False) == SLOT + 4096
    assert (tmp_path / "c.bin").read_bytes() == bytes(src) + trailer_page_of(src)


def test_read_reports_wrong_sizes_without_reading(tmp_path: Path, tree: int) -> None:
    (tmp_path / "s.bin").write_bytes(b"x" * 100)
    (tmp_path / "l.bin").write_bytes(b"x" * (SLOT + 8192))
    dst = slot_filled_with(0)
    assert chunks.read_chunk(tree, "s.bin", dst, o_direct=False).size_class is SizeClass.SHORT
    assert chunks.read_chunk(tree, "l.bin", dst, o_direct=False).size_class is SizeClass.LONG
    assert bytes(dst) == bytes(SLOT)


def test_raw_file_of_slot_size_reads_without_trailer(tmp_path: Path, tree: int) -> None:
    (tmp_path / "r.bin").write_bytes(b"\x05" * SLOT)
    dst = slot_filled_with(0)
    outcome = chunks.read_chunk(tree, "r.bin", dst, o_direct=False)
    assert outcome.size_class is SizeClass.RAW and outcome.trailer_page is None
    assert bytes(dst) == b"\x05" * SLOT


def test_missing_file_raises_file_not_found(tree: int) -> None:
    with pytest.raises(FileNotFoundError):
        chunks.read_chunk(tree, "none.bin", slot_filled_with(0), o_direct=False)
    assert chunks.remove_file(tree, "none.bin") is False


def test_load_chunk_verifies_a_trailered_chunk_in_one_read(tree: int, o_direct: bool) -> None:
    src = slot_filled_with(0x3C)
    chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=o_direct)
    dst = slot_filled_with(0)
    verdict = chunks.load_chunk(tree, "c.bin", dst, ME, o_direct=o_direct)
    assert verdict.ok and verdict.verified
    assert bytes(dst) == bytes(src)


@pytest.mark.parametrize(
    ("size", "reason"),
    [(100, "short"), (SLOT - 4096, "short"), (SLOT + 1, "short"), (SLOT + 4095, "short"),
     (SLOT + 4097, "long"), (SLOT + 8192, "long"), (SLOT + 3 * 4096, "long")],
)
def test_load_chunk_rejects_wrong_sizes_by_what_one_read_returned(tmp_path: Path, tree: int, size: int,
                                                                  reason: str) -> None:
    # The count read into [slot, trailer page, spare page] alone classifies the file.
    path = tmp_path / "c.bin"
    path.write_bytes(b"x" * size)
    verdict = chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False)
    assert not verdict.ok and verdict.reason == reason
    assert path.exists()  # removal is the tier's decision


def test_load_chunk_refuses_a_trailerless_file_unless_asked_to_accept_it(tmp_path: Path, tree: int) -> None:
    (tmp_path / "r.bin").write_bytes(b"\x05" * SLOT)
    assert chunks.load_chunk(tree, "r.bin", slot_filled_with(0), ME, o_direct=False).reason == "unverified"
    dst = slot_filled_with(0)
    verdict = chunks.load_chunk(tree, "r.bin", dst, ME, o_direct=False, accept_unverified=True)
    assert verdict.ok and not verdict.verified
    assert bytes(dst) == b"\x05" * SLOT


def test_load_chunk_reports_a_corrupt_payload_a_bad_trailer_and_another_chunk(tmp_path: Path, tree: int) -> None:
    src = slot_filled_with(0x11)
    page = trailer_page_of(src)
    (tmp_path / "flipped.bin").write_bytes(b"\x12" + bytes(src)[1:] + page)
    (tmp_path / "magic.bin").write_bytes(bytes(src) + page[:-32] + b"XXXX" + page[-28:])
    other = identity(make_offload_key(hashlib.sha256(b"d").digest(), 0), hashlib.sha256(b"run").digest())
    (tmp_path / "other.bin").write_bytes(bytes(src) + make_trailer_page(src, other))
    assert chunks.load_chunk(tree, "flipped.bin", slot_filled_with(0), ME, o_direct=False).reason == "checksum"
    assert chunks.load_chunk(tree, "magic.bin", slot_filled_with(0), ME, o_direct=False).reason == "bad_trailer"
    assert chunks.load_chunk(tree, "other.bin", slot_filled_with(0), ME, o_direct=False).reason == "wrong_chunk"


def test_load_chunk_does_not_see_a_previous_reads_trailer(tmp_path: Path, tree: int) -> None:
    # The trailer page is thread scratch: a later short file must not be judged by a stale one.
    src = slot_filled_with(0x21)
    chunks.write_chunk(tree, "good.bin", src, trailer_page_of(src), o_direct=False)
    assert chunks.load_chunk(tree, "good.bin", slot_filled_with(0), ME, o_direct=False).verified
    (tmp_path / "torn.bin").write_bytes(bytes(src) + bytes(4096 - 32))  # cut before its trailer
    assert chunks.load_chunk(tree, "torn.bin", slot_filled_with(0), ME, o_direct=False).reason == "short"


@pytest.mark.skipif(not hasattr(os, "O_NOATIME"), reason="O_NOATIME is Linux-only")
def test_loads_leave_the_access_time_alone(tmp_path: Path, tree: int) -> None:
    src = slot_filled_with(0x31)
    path = tmp_path / "c.bin"
    chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False)
    control = tmp_path / "control.bin"
    control.write_bytes(b"c")
    for p in (path, control):
        os.utime(p, ns=(1_000_000_000, 2_000_000_000))  # atime before mtime: relatime would update it
    control.read_bytes()
    if os.stat(control).st_atime_ns == 1_000_000_000:
        pytest.skip("this filesystem never updates access times (noatime mount)")
    assert chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False).verified
    assert os.stat(path).st_atime_ns == 1_000_000_000


@pytest.mark.skipif(not hasattr(os, "O_NOATIME"), reason="O_NOATIME is Linux-only")
def test_a_file_of_another_owner_is_read_without_o_noatime(tree: int, monkeypatch: pytest.MonkeyPatch) -> None:
    src = slot_filled_with(0x32)
    chunks.write_chunk(tree, "c.bin", src, trailer_page_of(src), o_direct=False)
    monkeypatch.setenv("KVTIER_NO_OPENAT2", "1")  # resolve with os.open, which this test watches
    monkeypatch.setattr(beneath, "_openat2_state", {})
    real_open, flags_seen = os.open, []

    def not_the_owner(p: str, flags: int, *args: int, **kwargs: int) -> int:
        if p == "c.bin":
            flags_seen.append(flags)
            if flags & os.O_NOATIME:
                raise PermissionError(errno.EPERM, "Operation not permitted", p)
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(beneath.os, "open", not_the_owner)
    dst = slot_filled_with(0)
    assert chunks.load_chunk(tree, "c.bin", dst, ME, o_direct=False).verified
    assert bytes(dst) == bytes(src)
    assert [bool(f & os.O_NOATIME) for f in flags_seen] == [True, False]


RUN = hashlib.sha256(b"run").digest()


def chunk_key(i: int, group: int = 0) -> bytes:
    return make_offload_key(hashlib.sha256(b"%d" % i).digest(), group)


def put_chunk(tree: int, key: bytes, src: memoryview | bytes, *, run: bytes = RUN, o_direct: bool = False) -> Path:
    """``src`` as chunk ``key`` of ``run``, where the tier keeps it; returns its path relative to the tree."""
    relpath = Namespace.chunk_relpath(key)
    chunks.write_chunk(tree, relpath, src, make_trailer_page(src, identity(key, run)), o_direct=o_direct)
    return Path(relpath)


def test_the_slice_loader_vouches_for_intact_chunks_only_and_leaves_the_rest_to_load_chunk(
        tmp_path: Path, tree: int, o_direct: bool) -> None:
    load = chunks.slice_loader(o_direct, RUN)
    src = [slot_filled_with(0x10 + i) for i in range(20)]
    keys = [chunk_key(i) for i in range(20)]
    for key, data in zip(keys, src):
        put_chunk(tree, key, data, o_direct=o_direct)
    dsts = [slot_filled_with(0) for _ in keys]
    verified = load(tree, keys, dsts)
    if not beneath.has_openat2():  # it declines everything; load_chunk reads each chunk
        assert verified == [False] * len(keys)
        return
    assert verified == [True] * len(keys)
    assert [bytes(d) for d in dsts] == [bytes(s) for s in src]
    # Spoil some of them, each another way; the others still verify in the same slice.
    page = make_trailer_page(src[0], identity(keys[0], RUN))
    at = {i: tmp_path / put_chunk(tree, keys[i], src[i]) for i in range(20)}
    at[1].write_bytes(b"\x12" + bytes(src[1])[1:] + make_trailer_page(src[1], identity(keys[1], RUN)))  # checksum
    at[2].write_bytes(at[3].read_bytes())  # another chunk's file under its name: wrong_chunk
    at[4].unlink()
    put_chunk(tree, keys[4], src[4], run=hashlib.sha256(b"other run").digest())  # another run's: wrong_chunk
    at[5].write_bytes(b"\x05" * SLOT)  # raw (vLLM's): unverified
    at[6].write_bytes(bytes(src[6])[: SLOT // 2])  # short
    at[7].write_bytes(bytes(src[7]) + page + page)  # long
    at[8].unlink()
    os.symlink(at[0], at[8])  # a link: not_regular
    at[9].unlink()
    at[9].mkdir()
    at[10].unlink()
    os.mkfifo(at[10])
    at[11].unlink()  # missing
    bad_magic = bytearray(bytes(src[12]) + make_trailer_page(src[12], identity(keys[12], RUN)))
    bad_magic[-32] ^= 0xFF
    at[12].write_bytes(bytes(bad_magic))
    verified = load(tree, keys, [slot_filled_with(0) for _ in keys])
    assert [i for i, ok in enumerate(verified) if not ok] == [1, 2, *range(4, 13)]  # 3 is intact
    # What it declined, load_chunk judges as ever.
    reasons = {1: "checksum", 2: "wrong_chunk", 4: "wrong_chunk", 5: "unverified", 6: "short", 7: "long",
               8: "not_regular", 9: "not_regular", 10: "not_regular", 12: "bad_trailer"}
    for i, reason in reasons.items():
        verdict = chunks.load_chunk(tree, Namespace.chunk_relpath(keys[i]), slot_filled_with(0), identity(keys[i], RUN),
                                    o_direct=o_direct)
        assert verdict.reason == reason, i


def test_the_slice_loader_takes_any_number_of_keys_of_any_groups(tree: int, o_direct: bool) -> None:
    load = chunks.slice_loader(o_direct, RUN)
    keys = [chunk_key(i, group=i % 3) for i in range(150)]  # more than one slice's rows
    for i, key in enumerate(keys):
        put_chunk(tree, key, slot_filled_with(i % 251), o_direct=o_direct)
    dsts = [slot_filled_with(0) for _ in keys]
    verified = load(tree, keys, dsts)
    if beneath.has_openat2():
        assert verified == [True] * len(keys)
        assert all(bytes(d) == bytes([i % 251]) * SLOT for i, d in enumerate(dsts))
    assert load(tree, [], []) == []
    with pytest.raises(ValueError):
        load(tree, keys[:2], dsts[:1])
    with pytest.raises(ValueError):  # no offload key
        load(tree, [b"abc"], dsts[:1])


def test_a_load_slice_judges_each_chunk_the_slice_loader_does_not_vouch_for(tmp_path: Path, tree: int) -> None:
    good, corrupt = slot_filled_with(0x31), slot_filled_with(0x32)
    put_chunk(tree, chunk_key(1), good)
    (tmp_path / put_chunk(tree, chunk_key(2), corrupt)).write_bytes(
        b"\x00" + bytes(corrupt)[1:] + make_trailer_page(corrupt, identity(chunk_key(2), RUN)))
    items = [(chunk_key(1), slot_filled_with(0)), (chunk_key(2), slot_filled_with(0)), (b"abc", slot_filled_with(0)),
             (chunk_key(3), slot_filled_with(0))]

    def failing(*args: object) -> list[bool]:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    for fast in (chunks.slice_loader(False, RUN), failing, None):
        for _, dst in items:
            dst[:] = b"\x77" * SLOT
        results = fs_tier._load_slice(tree, RUN, False, False, ChunkCodec(dtype="float16", slot_bytes=SLOT), fast,
                                      items)
        assert results[0] is ACCEPTED_VERIFIED and bytes(items[0][1]) == bytes(good)
        assert getattr(results[1], "reason", None) == "checksum"  # and removed
        assert isinstance(results[2], ValueError)  # no offload key
        assert isinstance(results[3], FileNotFoundError)
        assert bytes(items[1][1]) == bytes(SLOT)  # rejected: zeroed
        if fast is not None:  # whatever a first read may have left in a failed chunk's slot is gone
            assert all(bytes(dst) == bytes(SLOT) for _, dst in items[2:])
        assert not (tmp_path / Namespace.chunk_relpath(chunk_key(2))).exists()
        put_chunk(tree, chunk_key(2), corrupt)  # intact now, for the next round's corruption
        (tmp_path / Namespace.chunk_relpath(chunk_key(2))).write_bytes(
            b"\x00" + bytes(corrupt)[1:] + make_trailer_page(corrupt, identity(chunk_key(2), RUN)))


def test_without_openat2_the_slice_loader_declines_every_chunk(tree: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_NO_OPENAT2", "1")  # resolution component by component: load_chunk's
    monkeypatch.setattr(beneath, "_openat2_state", {})
    src = slot_filled_with(0x21)
    put_chunk(tree, chunk_key(1), src)
    assert chunks.slice_loader(False, RUN)(tree, [chunk_key(1)], [slot_filled_with(0)]) == [False]
    dst = slot_filled_with(0)
    verdict = chunks.load_chunk(tree, Namespace.chunk_relpath(chunk_key(1)), dst, identity(chunk_key(1), RUN),
                                o_direct=False)
    assert verdict.verified and bytes(dst) == bytes(src)


def test_load_chunk_raises_file_not_found_for_a_missing_file(tree: int) -> None:
    with pytest.raises(FileNotFoundError):
        chunks.load_chunk(tree, "none.bin", slot_filled_with(0), ME, o_direct=False)


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
async def test_slices_return_one_result_per_item_and_a_failed_slice_fails_its_items_only() -> None:
    pool = DualQueuePool(2, 2, batch_slices=3)
    seen: list[list[int]] = []

    def squares(part: list[int]) -> list[int | str]:
        seen.append(list(part))
        if 5 in part:
            raise RuntimeError("this slice failed")
        if 8 in part:
            return ["too few"]
        return [i * i for i in part]

    pool.start()
    try:
        outcomes = await pool.run_slices(IOQueue.READ, squares, list(range(9)))
        assert await pool.run_slices(IOQueue.READ, squares, []) == []
    finally:
        await pool.aclose()
    assert sorted(seen) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # consecutive items, one slice per worker task
    assert outcomes[:3] == [0, 1, 4]
    assert all(isinstance(o, RuntimeError) for o in outcomes[3:6])
    assert all(isinstance(o, ValueError) and "1 results for 3 items" in str(o) for o in outcomes[6:])


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
    monkeypatch.setattr("kvtier.tiers.fs.pool.usable_cpus", lambda: 2)
    assert DualQueuePool(4, 4).batch_slices == 2
    monkeypatch.setattr("kvtier.tiers.fs.pool.usable_cpus", lambda: 64)
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
async def test_cancelling_batches_withdraws_queued_slices_and_waits_for_running_ones() -> None:
    # A batch alone on a pool of two workers is cut in two slices, one per worker; a second
    # batch then waits in the queue, whole.
    pool = DualQueuePool(1, 1, batch_slices=4)
    size = 3
    started, release = threading.Barrier(3, timeout=10), threading.Event()
    ran: list[int] = []

    def call(i: int) -> None:
        if i in (0, size):
            started.wait()  # the two slices of the first batch occupy both workers
            release.wait(10)
        ran.append(i)

    pool.start()
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.run_batch, IOQueue.WRITE, call, [(i,) for i in range(2 * size)])
                await anyio.to_thread.run_sync(started.wait)
                tg.start_soon(pool.run_batch, IOQueue.WRITE, call, [(i,) for i in range(100, 100 + 4 * size)])
                with anyio.fail_after(5):
                    while pool.statistics().queued_writes != 1:
                        await anyio.sleep(0.001)
                scope.cancel()
                with anyio.CancelScope(shield=True):
                    with anyio.fail_after(5):  # hang guard: the queued batch is withdrawn
                        while pool.statistics().queued_writes:
                            await anyio.sleep(0.001)
                release.set()
        # returned only after the running slices finished; the queued batch never ran
        assert sorted(ran) == list(range(2 * size))
        assert pool.statistics().queued_writes == 0
    finally:
        await pool.aclose()
    assert sorted(ran) == list(range(2 * size))


class Occupier:
    """Holds ``n`` pool workers busy (:meth:`block`) until :attr:`release` is set, and records the
    slices of a batch (:meth:`record`, calling :attr:`on_slice` after each)."""

    def __init__(self, n: int) -> None:
        self.release = threading.Event()
        self._busy = threading.Barrier(n + 1, timeout=10)
        self.on_slice: Callable[[], object] = lambda: None
        self.parts: list[list[int]] = []

    def block(self) -> None:
        self._busy.wait()
        self.release.wait(10)

    async def occupied(self) -> None:
        """Return once the ``n`` workers run :meth:`block`."""
        await anyio.to_thread.run_sync(self._busy.wait)

    def record(self, part: Sequence[int]) -> list[int]:
        self.parts.append(list(part))
        self.on_slice()
        return list(part)


@pytest.mark.anyio
async def test_batches_that_find_every_worker_busy_or_spoken_for_run_whole() -> None:
    pool = DualQueuePool(1, 1, batch_slices=2)
    both_running = threading.Barrier(2, timeout=10)  # a batch's worker is still on it when the other starts
    workers = Occupier(2)
    workers.on_slice = both_running.wait
    pool.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, IOQueue.READ, workers.block)
            tg.start_soon(pool.run, IOQueue.WRITE, workers.block)
            await workers.occupied()
            outcomes: dict[int, list[int | BaseException]] = {}

            async def batch(first: int) -> None:
                outcomes[first] = await pool.run_slices(IOQueue.READ, workers.record, list(range(first, first + 8)))

            tg.start_soon(batch, 0)
            tg.start_soon(batch, 10)
            with anyio.fail_after(5):
                while pool.statistics().queued_reads != 2:
                    await anyio.sleep(0.001)
            workers.release.set()
    finally:
        await pool.aclose()
    # Two batches for two workers: each worker takes one whole, whatever the other is doing then.
    assert sorted(workers.parts) == [list(range(8)), list(range(10, 18))]
    assert outcomes == {0: list(range(8)), 10: list(range(10, 18))}


@pytest.mark.anyio
async def test_a_batch_is_cut_for_the_idle_workers_only() -> None:
    pool = DualQueuePool(2, 2, batch_slices=4)
    workers = Occupier(1)
    pool.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, IOQueue.WRITE, workers.block)
            await workers.occupied()
            # One of four workers busy: the batch's worker and the two idle ones share it.
            assert await pool.run_slices(IOQueue.READ, workers.record, list(range(8))) == list(range(8))
            workers.release.set()
    finally:
        await pool.aclose()
    assert sorted(workers.parts) == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.mark.anyio
async def test_a_long_batch_is_cut_for_the_workers_that_free_up_while_it_runs() -> None:
    pool = DualQueuePool(1, 1, batch_slices=2)
    workers = Occupier(1)
    workers.on_slice = workers.release.set  # the other worker frees up once the batch runs
    n = 3 * MAX_SLICE_ITEMS + 1
    pool.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, IOQueue.WRITE, workers.block)
            await workers.occupied()  # no idle worker when the batch is taken
            assert await pool.run_slices(IOQueue.READ, workers.record, list(range(n))) == list(range(n))
    finally:
        await pool.aclose()
    # Four slices of consecutive items, as even as they come, none longer than MAX_SLICE_ITEMS.
    size = -(-n // 4)
    assert sorted(workers.parts) == [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    assert len(workers.parts) == 4 and max(map(len, workers.parts)) <= MAX_SLICE_ITEMS
    assert pool.statistics().completed == 1 + 4


@pytest.mark.anyio
@pytest.mark.timeout(60)  # a worker that died on the items would leave the call waiting for ever
async def test_items_that_cannot_be_cut_into_slices_are_refused_at_the_call() -> None:
    pool = DualQueuePool(1, 1)
    pool.start()
    try:
        for items in ((i for i in range(3)), {1, 2, 3}):
            with pytest.raises(TypeError, match="sequence of items"), anyio.fail_after(5):
                await pool.run_slices(IOQueue.READ, list, items)  # type: ignore[arg-type]
        with anyio.fail_after(5):  # every worker is still there
            assert await pool.run_slices(IOQueue.READ, list, (1, 2, 3)) == [1, 2, 3]
            assert await pool.run_batch(IOQueue.WRITE, lambda i: i, [(i,) for i in range(70)]) == list(range(70))
    finally:
        await pool.aclose()


@pytest.mark.anyio
async def test_closed_pool_refuses_batches() -> None:
    pool = DualQueuePool(1, 1)
    pool.start()
    await pool.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await pool.run_batch(IOQueue.READ, lambda: None, [()])

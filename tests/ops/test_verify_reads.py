"""How ``kvtier verify`` reads: from the page cache without waiting, from the storage with reads
in flight (``chunks.load_chunk(nowait=True)``, ``beneath.open_file(cached_only=True)``,
``verify_workers.Checker``, ``kvtier verify --io-depth``)."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from chunk_files import ME, SLOT, slot_filled_with, trailer_page_of  # noqa: E402
from test_ops import N, _same_findings, build, chunk, cli, cli_json, corrupt_everything  # noqa: E402

from kvtier.ops import verify as verify_mod  # noqa: E402
from kvtier.ops import verify_workers  # noqa: E402
from kvtier.ops.verify import run_verify_cli  # noqa: E402
from kvtier.ops.verify_workers import VERDICTS, Checker  # noqa: E402
from kvtier.tiers.fs import beneath, chunks  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="reads that may not wait are Linux-only")


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def evict(path: Path, offset: int = 0, length: int = 0) -> None:
    """Drop ``path``'s pages (``length`` bytes from ``offset``; 0: to the end) from the page cache,
    or skip the test where the filesystem cannot (tmpfs: its pages are the file) or cannot read
    without waiting. Tried on a file of its own first: a read that may not wait starts the
    readahead it does not wait for, so probing ``path`` itself would bring its pages back."""
    probe = path.parent / ".evict-probe"
    probe.write_bytes(bytes(4096))
    try:
        _drop(probe, 0, 0)
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
            pytest.skip("this filesystem keeps its pages in memory: nothing to evict")
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            pytest.skip("this filesystem cannot read without waiting")
        finally:
            os.close(fd)
    finally:
        probe.unlink()
    _drop(path, offset, length)


def would_block(path: Path, read: Callable[[], object], offset: int = 0, length: int = 0) -> None:
    """:func:`evict` ``path`` (``length`` bytes from ``offset``) and check that ``read``, a read
    that may not wait, raises ``BlockingIOError``. ``POSIX_FADV_DONTNEED`` does not always drop
    every page at once (seen intermittently on a shared VM, with the same code before and after),
    so an eviction that did not take is made again, a few times; a read that never blocks fails."""
    for _ in range(5):
        evict(path, offset, length)
        try:
            read()
        except BlockingIOError:
            return
    pytest.fail(f"{path.name}: a read that may not wait read it each time its pages were dropped")


def _drop(path: Path, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write(tree: int, tmp_path: Path, rel: str = "c.bin") -> Path:
    src = slot_filled_with(0x5A)
    chunks.write_chunk(tree, rel, src, trailer_page_of(src), o_direct=False)
    return tmp_path / rel


# --- chunks.load_chunk(nowait=True) ------------------------------------------------------------


def test_a_cached_chunk_is_read_and_checked_without_waiting(tree: int, tmp_path: Path) -> None:
    write(tree, tmp_path)
    dst = slot_filled_with(0)
    assert chunks.load_chunk(tree, "c.bin", dst, ME, o_direct=False, nowait=True).verified
    assert bytes(dst) == bytes(slot_filled_with(0x5A))


def test_an_evicted_chunk_would_block_then_reads_the_ordinary_way(tree: int, tmp_path: Path) -> None:
    would_block(write(tree, tmp_path),
                lambda: chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True))
    assert chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False).verified
    # That read brought it in: now it needs no waiting.
    assert chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True).verified


def test_a_chunk_whose_trailer_is_not_cached_would_block_never_passes_for_trailer_less(
        tree: int, tmp_path: Path) -> None:
    # The read that may not wait stops exactly at the slot's end, as a trailer-less file's would.
    would_block(write(tree, tmp_path),
                lambda: chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True),
                SLOT, 4096)


def test_a_long_chunk_whose_end_is_not_cached_would_block_never_passes_for_a_chunk(
        tree: int, tmp_path: Path) -> None:
    path = write(tree, tmp_path)
    with open(path, "ab") as f:
        f.write(bytes(3 * 4096))  # a valid chunk with bytes after it: "long" to an ordinary read
    would_block(path,  # the read that may not wait stops right after the trailer
                lambda: chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True),
                SLOT + 4096, 0)
    assert chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False).reason == "long"


def test_a_partly_cached_chunk_would_block_never_passes_for_short(tree: int, tmp_path: Path) -> None:
    path = write(tree, tmp_path)
    would_block(path,  # everything but the first page
                lambda: chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True),
                4096, 0)


def test_a_cached_trailer_less_chunk_is_unverified_without_waiting(tree: int, tmp_path: Path) -> None:
    (tmp_path / "raw.bin").write_bytes(bytes(slot_filled_with(0x11)))
    verdict = chunks.load_chunk(tree, "raw.bin", slot_filled_with(0), ME, o_direct=False, nowait=True)
    assert verdict.reason == "unverified"
    assert chunks.load_chunk(tree, "raw.bin", slot_filled_with(0), ME, o_direct=False, nowait=True,
                            accept_unverified=True).ok


def test_a_short_chunk_is_short_without_waiting_when_all_of_it_is_cached(tree: int, tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(SLOT // 2))
    assert chunks.load_chunk(tree, "short.bin", slot_filled_with(0), ME, o_direct=False, nowait=True).reason == "short"
    would_block(path,
                lambda: chunks.load_chunk(tree, "short.bin", slot_filled_with(0), ME, o_direct=False, nowait=True))
    assert chunks.load_chunk(tree, "short.bin", slot_filled_with(0), ME, o_direct=False).reason == "short"


def test_a_link_is_refused_without_waiting(tree: int, tmp_path: Path) -> None:
    write(tree, tmp_path)
    (tmp_path / "link.bin").symlink_to(tmp_path / "c.bin")
    assert chunks.load_chunk(tree, "link.bin", slot_filled_with(0), ME, o_direct=False, nowait=True).reason == "not_regular"


def test_where_reads_cannot_promise_not_to_wait_they_say_so(tree: int, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    write(tree, tmp_path)
    monkeypatch.setattr(chunks, "_RWF_NOWAIT", 0)  # Python or the platform lacks RWF_NOWAIT
    with pytest.raises(OSError) as raised:
        chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=False, nowait=True)
    assert raised.value.errno == errno.EOPNOTSUPP
    monkeypatch.undo()
    # Without openat2, paths are opened component by component: nothing can promise not to wait.
    monkeypatch.setenv("KVTIER_NO_OPENAT2", "1")
    monkeypatch.setattr(beneath, "_openat2_state", {})
    with pytest.raises(OSError) as raised:
        beneath.open_file(tree, "c.bin", os.O_RDONLY, cached_only=True)
    assert raised.value.errno == errno.EOPNOTSUPP
    os.close(beneath.open_file(tree, "c.bin", os.O_RDONLY))  # the ordinary open still works


# --- Checker ----------------------------------------------------------------------------------


class FakeReads:
    """Stands in for ``check_file``: the file's name is its verdict (``ok`` for None), and names
    starting with ``cold`` would block unless read the ordinary way (on a Checker thread)."""

    def __init__(self, *, nowait_error: OSError | None = None, hold: threading.Event | None = None) -> None:
        self.nowait_error = nowait_error
        self.hold = hold  # ordinary reads wait for it
        self.lock = threading.Lock()
        self.nowait_calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.threads: set[int] = set()

    def __call__(self, tree_fd: int, relpath: str, buf: memoryview, chunk_identity: bytes, *,
                 nowait: bool = False) -> str | None:
        verdict = relpath.split(":")[-1]
        if nowait:
            self.nowait_calls += 1
            if self.nowait_error is not None:
                raise self.nowait_error
            if relpath.startswith("cold"):
                raise BlockingIOError(errno.EAGAIN, "would wait", relpath)
            return None if verdict == "ok" else verdict
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.threads.add(threading.get_ident())
        try:
            if self.hold is not None:
                assert self.hold.wait(10)
            if verdict == "boom":
                raise RuntimeError("a bug in a reader")
            return None if verdict == "ok" else verdict
        finally:
            with self.lock:
                self.in_flight -= 1


def checked(checker: Checker, batches: list[list[str]]) -> list[list[str | None]]:
    """Submit ``batches`` (file names), close; the verdicts in the order ``done`` was called."""
    found: list[list[str | None]] = []
    for names in batches:
        checker.submit(0, 4096, [(name, b"") for name in names],
                       lambda codes: found.append([VERDICTS[c] for c in codes]))
    checker.close()
    return found


def test_checker_answers_batches_in_order_whichever_way_their_files_were_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads = FakeReads()
    monkeypatch.setattr(verify_workers, "check_file", reads)
    batches = [["cold1:checksum", "a:ok", "cold2:ok"], ["b:short"], [], ["cold3:wrong_chunk", "c:ok"]]
    assert checked(Checker(4), batches) == [["checksum", None, None], ["short"], [], ["wrong_chunk", None]]
    assert reads.nowait_calls == 6  # every file was first tried without waiting


def test_a_cached_batch_waits_for_an_earlier_one_still_on_the_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    hold = threading.Event()
    monkeypatch.setattr(verify_workers, "check_file", FakeReads(hold=hold))
    found: list[int] = []
    checker = Checker(2)
    checker.submit(0, 4096, [("cold:ok", b"")], lambda codes: found.append(1))
    checker.submit(0, 4096, [("warm:ok", b"")], lambda codes: found.append(2))
    assert found == []  # the second is checked, but answers come in order
    hold.set()
    checker.close()
    assert found == [1, 2]


def test_checker_keeps_at_most_depth_reads_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    hold = threading.Event()
    reads = FakeReads(hold=hold)
    monkeypatch.setattr(verify_workers, "check_file", reads)
    checker = Checker(3)
    found: list[list[int]] = []
    checker.submit(0, 4096, [(f"cold{i}:ok", b"") for i in range(6)], found.append)  # 3 reading, 3 queued
    deadline = time.monotonic() + 10
    while reads.in_flight < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a fourth reader, if one were started, would be in by now
    assert reads.in_flight == 3
    hold.set()
    checker.close()
    assert found == [[0] * 6] and reads.most_in_flight == 3 and len(reads.threads) == 3


def test_checker_queues_a_bounded_number_of_files(monkeypatch: pytest.MonkeyPatch) -> None:
    hold = threading.Event()
    monkeypatch.setattr(verify_workers, "check_file", FakeReads(hold=hold))
    checker = Checker(1)
    found: list[list[int]] = []
    submitting = threading.Thread(
        target=lambda: checker.submit(0, 4096, [(f"cold{i}:ok", b"") for i in range(50)], found.append))
    submitting.start()
    submitting.join(0.2)
    assert submitting.is_alive()  # 1 reading and 1 queued: it waits for room
    hold.set()
    submitting.join(10)
    checker.close()
    assert found == [[0] * 50]


def test_checker_starts_no_thread_for_a_tree_in_the_page_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = FakeReads()
    monkeypatch.setattr(verify_workers, "check_file", reads)
    before = threading.active_count()
    checker = Checker(8)
    checker.submit(0, 4096, [(f"warm{i}:ok", b"") for i in range(10)], lambda codes: None)
    assert threading.active_count() == before and not reads.threads
    checker.close()


@pytest.mark.parametrize("memory", [False, True], ids=["storage", "memory"])
def test_where_nothing_can_be_read_without_waiting_files_go_to_the_threads_unless_they_are_memory(
        monkeypatch: pytest.MonkeyPatch, memory: bool) -> None:
    reads = FakeReads(nowait_error=OSError(errno.EOPNOTSUPP, "not here"))
    monkeypatch.setattr(verify_workers, "check_file", reads)
    monkeypatch.setattr(chunks, "in_memory_fs", lambda fd: memory)
    assert checked(Checker(2), [["a:ok", "b:checksum"], ["c:ok"]]) == [[None, "checksum"], [None]]
    assert reads.nowait_calls == 1  # tried once, then never again
    if memory:  # read where they were submitted
        assert reads.threads == {threading.get_ident()}
    else:
        assert reads.threads and threading.get_ident() not in reads.threads


@pytest.mark.skipif(not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)), reason="no /dev/shm")
def test_a_tree_on_tmpfs_is_read_on_the_submitting_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if not chunks.in_memory_fs(fd):
                pytest.skip("/dev/shm is not tmpfs here")
            for name in ("a.bin", "b.bin"):
                src = slot_filled_with(0x5A)
                chunks.write_chunk(fd, name, src, trailer_page_of(src), o_direct=False)
            Path(tmp, "b.bin").write_bytes(b"short")
            before = threading.active_count()
            found: list[list[str | None]] = []
            checker = Checker(4)
            checker.submit(fd, SLOT, [("a.bin", ME), ("b.bin", ME)], lambda c: found.append([VERDICTS[x] for x in c]))
            assert threading.active_count() == before
            checker.close()
            assert found == [[None, "short"]]
        finally:
            os.close(fd)


def test_a_reader_thread_that_fails_is_reported_never_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_workers, "check_file", FakeReads())
    failures: list[BaseException] = []
    checker = Checker(2, on_error=failures.append)
    found: list[Any] = []
    checker.submit(0, 4096, [("cold:boom", b""), ("a:ok", b"")], found.append)
    with pytest.raises(RuntimeError, match="a bug in a reader"):
        checker.close()
    assert found == [] and len(failures) == 1 and isinstance(failures[0], RuntimeError)


def test_checker_refuses_a_depth_below_one() -> None:
    with pytest.raises(ValueError, match="depth must be at least 1"):
        Checker(0)


# --- kvtier verify on a tree the page cache does not hold --------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_verify_finds_the_same_in_an_evicted_tree_as_in_a_cached_one(tmp_path: Path, workers: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    tree = build(root, list(range(N)))
    corrupt_everything(root, tree, outside)
    status, cached = cli_json(run_verify_cli, str(root), "--workers", workers, "--io-depth", "4")
    handed_over: list[Any] = []
    real = Checker._hand_over
    monkeypatch.setattr(Checker, "_hand_over", lambda self, item: (handed_over.append(item), real(self, item)))
    for _ in range(3):  # evictions that did not all take are made again (see would_block)
        handed_over.clear()
        for i in range(N):
            if chunk(tree, i).is_file() and not chunk(tree, i).is_symlink():
                evict(chunk(tree, i))
        status_cold, cold = cli_json(run_verify_cli, str(root), "--workers", workers, "--io-depth", "4")
        assert status == status_cold == 1 and cold["io_depth"] == 4
        assert _same_findings(cold) == _same_findings(cached)
        if workers != "1" or len(handed_over) >= N - 3:
            break
    if workers == "1":  # read in this process: the evicted files went to the reader threads
        assert len(handed_over) >= N - 3


def test_io_depth_must_be_a_positive_integer(tmp_path: Path) -> None:
    build(tmp_path, [0])
    for bad in ("0", "-1", "x", "5000"):
        status, _ = cli(run_verify_cli, str(tmp_path), "--io-depth", bad)
        assert status == 2, bad
    status, report = cli_json(run_verify_cli, str(tmp_path), "--io-depth", "1")
    assert status == 0 and report["io_depth"] == 1 and report["ok"] == 1


def test_io_depth_is_shared_among_the_readers() -> None:
    assert [verify_mod._depth_per_reader(32, r) for r in (1, 2, 3, 64)] == [32, 16, 11, 1]


# --- batches ----------------------------------------------------------------------------------


def test_batches_shrink_as_the_work_runs_out_and_keep_one_tree_each() -> None:
    trees = [object(), object()]
    work: list[Any] = [(trees[0], i, b"") for i in range(1000)] + [(trees[1], i, b"") for i in range(37)]
    batches = verify_mod._batches(work, 2)
    assert [item for batch in batches for item in batch] == work  # all of it, in order
    assert all(len({id(t) for t, _, _ in batch}) == 1 for batch in batches)
    sizes = [len(b) for b in batches]
    assert sizes[0] == min(verify_mod._BATCH, 1037 // 4) and max(sizes) <= verify_mod._BATCH
    assert sizes[-1] == 1 and sizes[-2] <= 2  # the last ones, that others may wait out, are short
    first_tree = [len(b) for b in batches if b[0][0] is trees[0]]
    assert first_tree == sorted(first_tree, reverse=True)
    assert [len(b) for b in verify_mod._batches(work, 0)] == [256, 256, 256, 232, 37]  # in this process: full ones


# --- what the review of the first version found ------------------------------------------------


def test_a_directory_under_a_chunk_name_is_not_regular_and_leaves_reads_that_may_not_wait_on(
        tree: int, tmp_path: Path) -> None:
    (tmp_path / "dir.bin").mkdir()  # RWF_NOWAIT on a directory: EOPNOTSUPP, not EISDIR
    write(tree, tmp_path)
    assert chunks.load_chunk(tree, "dir.bin", slot_filled_with(0), ME, o_direct=False, nowait=True).reason == "not_regular"
    before = threading.active_count()
    found: list[list[str | None]] = []
    checker = Checker(4)
    checker.submit(tree, SLOT, [("dir.bin", ME), ("c.bin", ME)], lambda codes: found.append([VERDICTS[c] for c in codes]))
    assert threading.active_count() == before  # both checked at once: no file went to a thread
    checker.close()
    assert found == [["not_regular", None]]


def test_nowait_and_o_direct_together_are_refused(tree: int, tmp_path: Path) -> None:
    write(tree, tmp_path)
    with pytest.raises(ValueError, match="o_direct"):
        chunks.load_chunk(tree, "c.bin", slot_filled_with(0), ME, o_direct=True, nowait=True)


@pytest.mark.parametrize("error, verdict", [
    (OSError(errno.EIO, "I/O error"), "unreadable"),
    (PermissionError(errno.EACCES, "Permission denied"), "unreadable"),
    (OSError(errno.ESTALE, "Stale file handle"), "vanished"),
    (FileNotFoundError(errno.ENOENT, "gone"), "vanished"),
    (OSError(errno.EMFILE, "Too many open files"), None),  # this process's trouble: raised
    (OSError(errno.ENOMEM, "Cannot allocate memory"), None),
])
def test_a_file_that_cannot_be_read_is_unreadable_never_corrupt(monkeypatch: pytest.MonkeyPatch, error: OSError,
                                                                verdict: str | None) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(chunks, "load_chunk", failing)
    if verdict is None:
        with pytest.raises(OSError) as raised:
            verify_workers.check_file(0, "c.bin", slot_filled_with(0), ME)
        assert raised.value is error
    else:
        assert verify_workers.check_file(0, "c.bin", slot_filled_with(0), ME) == verdict
        assert verify_workers.check_file(0, "c.bin", slot_filled_with(0), ME, nowait=True) == verdict


def test_verify_reports_an_unreadable_chunk_and_repair_keeps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = build(tmp_path, list(range(4)))
    bad = str(chunk(tree, 1).relative_to(tree))
    real = chunks.load_chunk

    def eio_for_one(tree_fd: int, relpath: str, *args: Any, **kwargs: Any) -> Any:
        if relpath == bad:
            raise OSError(errno.EIO, "Input/output error", relpath)
        return real(tree_fd, relpath, *args, **kwargs)

    monkeypatch.setattr(chunks, "load_chunk", eio_for_one)
    status, report = cli_json(run_verify_cli, str(tmp_path), "--workers", "1", "--repair")
    assert status == 1 and report["counts"]["unreadable"] == 1 and report["ok"] == 3
    assert [(p["reason"], p["repaired"]) for p in report["problems"]] == [("unreadable", False)]
    assert report["problems_left"] == 1 and chunk(tree, 1).exists()


def test_running_out_of_descriptors_fails_the_check_and_repairs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tree = build(tmp_path, list(range(4)))
    chunk(tree, 0).write_bytes(b"short")  # a real problem that --repair would remove
    real = chunks.load_chunk
    calls = []

    def emfile_after_two(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(chunks, "load_chunk", emfile_after_two)
    status, out = cli(run_verify_cli, str(tmp_path), "--workers", "1", "--repair")
    assert status == 1 and out == "" and "Too many open files" in capsys.readouterr().err
    assert chunk(tree, 0).exists()


def test_after_a_reader_thread_fails_nothing_more_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = FakeReads()
    monkeypatch.setattr(verify_workers, "check_file", reads)

    def on_error(exc: BaseException) -> None:
        raise KeyError("a broken handler changes nothing")

    checker = Checker(1, on_error=on_error)
    checker.submit(0, 4096, [("cold:boom", b"")], lambda codes: None)
    deadline = time.monotonic() + 10
    while checker._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="a bug in a reader"):
        checker.submit(0, 4096, [("warm:ok", b"")], lambda codes: None)
    with pytest.raises(RuntimeError, match="a bug in a reader"):
        checker.close()
    assert reads.nowait_calls == 1  # the batch after the failure was not even tried


def test_verify_root_refuses_no_readers_or_no_depth(tmp_path: Path) -> None:
    from kvtier.ops.runs import open_root

    build(tmp_path, [0])
    fd = open_root(str(tmp_path))
    try:
        for workers, depth in ((0, 4), (1, 0), (2, -3)):
            with pytest.raises(ValueError, match="at least 1"):
                verify_mod.verify_root(fd, str(tmp_path), workers=workers, io_depth=depth)
    finally:
        os.close(fd)


def test_a_full_request_fits_a_pipe_so_sending_never_waits_for_a_busy_worker() -> None:
    import msgspec

    from kvtier.keys import make_offload_key
    from kvtier.layout import Namespace
    from kvtier.tiers.integrity import IDENTITY_SIZE

    longest = Namespace.chunk_relpath(make_offload_key(b"\xff" * 32, 2**31 - 1))
    request = verify_workers.CheckRequest(2**40, 1000, 1 << 30, [(longest, bytes(IDENTITY_SIZE))] * verify_mod._BATCH)
    assert len(msgspec.msgpack.encode(request)) + 4 <= 65536


@pytest.mark.parametrize("slow", [False, True], ids=["at once", "dying slowly while the next file is handed over"])
def test_a_worker_whose_reader_thread_fails_exits_and_fails_the_check(
        slow: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tree = build(tmp_path, list(range(4)))
    chunk(tree, 0).write_bytes(b"short")  # a real problem that --repair would remove
    # Workers whose files all seem to be on the storage, and whose reader threads then fail. Slow:
    # the worker's main thread takes a while to find each next file on the storage, and the failed
    # reader a while to print its traceback, so the main thread hands the next file over while
    # the reader is still dying; the worker's status must still say a reader failed.
    boot = ("import sys, time, traceback; sys.path[:0] = sys.argv[4:]; from kvtier.ops import verify_workers as vw\n"
            f"slow = {slow}\n"
            "def failing(*args, nowait=False):\n"
            "    if nowait:\n"
            "        time.sleep(0.3 if slow else 0)\n"
            "        raise BlockingIOError(11, 'on the storage')\n"
            "    raise RuntimeError('reader thread bug')\n"
            "def print_slowly(exc, _print=traceback.print_exception):\n"
            "    time.sleep(1.5 if slow else 0)\n"
            "    _print(exc)\n"
            "vw.traceback.print_exception = print_slowly\n"
            "vw.check_file = failing; vw.worker_main(sys.argv[1:4])")
    monkeypatch.setattr(verify_workers, "_BOOT", boot)
    status, out = cli(run_verify_cli, str(tmp_path), "--workers", "2", "--repair")
    err = capsys.readouterr().err
    assert status == 1 and out == ""
    assert "exited (status 3): RuntimeError: reader thread bug" in err, err
    assert chunk(tree, 0).exists()

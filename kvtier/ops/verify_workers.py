"""Reading and checking chunk files for ``kvtier verify``: in this process, or in worker processes.

Checking one chunk (:func:`check_file`) is the fs tier's own load path,
:func:`kvtier.tiers.fs.chunks.load_chunk`: a contained open (:mod:`kvtier.tiers.fs.beneath`: no link
followed, nothing outside the tree reached), one ``preadv`` of the whole file, the trailer's
length, version, run/rank identity and key, then the xxh3-64 checksum. Coded files (compressed
and/or encrypted, :mod:`kvtier.tiers.codec`) are decoded as a load decodes them: compressed ones
always; encrypted ones with a key file (their tag then proves them authentic), else they are
``no_key`` (layout and checksum checked, authenticity not). A reader loads the key file itself
(workers are told its path, in their environment; never a key). The read runs without the
interpreter lock; the checksum and the Python run per file hold it, so threads of one process
queue for that lock. :class:`VerifyWorkers` spreads the files over worker processes instead,
each with its own interpreter: ``python -I`` running :func:`worker_main`, holding the rank trees'
descriptors (inherited at start, ``pass_fds``), answering :class:`CheckRequest` frames on its
stdin with :class:`CheckAnswer` frames on its stdout. Before the files are handed out
(:meth:`VerifyWorkers.wait_ready`) every worker has started and mapped its buffers, so the
read-and-check phase measures reading and checking; batches are handed out as workers answer,
two in flight each.

Every reader (a worker, or this process alone) checks through a :class:`Checker`: a file in the
page cache is read and checked at once, one after another into one page-aligned buffer per slot
size, by a read that may not wait; a file that would wait for the storage goes to the reader's
threads, ``depth`` of them, so a tree on a disk or NFS has reads in flight (a page-cache tree
never starts one: threads would only queue for the interpreter lock).

What comes back is bounded and typed like any input: a frame header's length is capped, the
payload is decoded by msgspec into :class:`CheckAnswer` (never unpickled), every verdict must be
one of :data:`VERDICTS`, and an answer must carry the id of the oldest request sent to that worker
and one verdict per file of it; anything else, or a worker that dies, fails the whole check with
``OSError`` and every worker is killed. Workers read and check only: nothing is removed by them,
and no byte they read leaves them. They die with the parent (``PR_SET_PDEATHSIG`` on Linux;
elsewhere at their next write), run in their own session and ignore ``SIGINT`` (a terminal's ^C
is the parent's to handle: it kills them).
"""

from __future__ import annotations

import collections
import errno
import functools
import importlib
import mmap
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any

import msgspec
import xxhash

from kvtier.tiers.codec import ChunkCodec
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.integrity import IDENTITY_SIZE, REJECT_REASONS
from kvtier.worker_io import FRAME_HEADER, die_with_parent, import_paths, requests, write_all

__all__ = ["VERDICTS", "check_file", "slot_buffer", "Checker", "CheckRequest", "CheckAnswer", "VerifyWorkers",
           "worker_main"]

#: What checking a file can find: ``None`` (a valid chunk), ``"vanished"`` (it was removed
#: meanwhile: not a problem), ``"unreadable"`` (the file could not be read: a problem, never
#: removed) or a rejection reason. Answers carry indexes into this tuple.
VERDICTS: tuple[str | None, ...] = (None, "vanished", "unreadable", *REJECT_REASONS)
_CODE = {verdict: i for i, verdict in enumerate(VERDICTS)}
#: Errors of this process, not of the file: a check that meets one fails as a whole.
_OWN_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

_MAX_REQUEST_BYTES = 64 << 20
_MAX_ANSWER_BYTES = 1 << 20  # an answer is ~1 byte per file; requests hold far fewer files than this
_MAX_FILES = 1 << 16  # per request
_STDERR_KEPT = 4096  # of a dead worker's stderr, for the error message
_BOOT = ("import sys; sys.path[:0] = sys.argv[4:]; "
         "from kvtier.ops.verify_workers import worker_main; worker_main(sys.argv[1:4])")
#: The environment variable that tells a worker the key file's path (never a key).
KEY_FILE_ENV = "KVTIER_VERIFY_KEY_FILE"

_Verdict = Annotated[int, msgspec.Meta(ge=0, lt=len(VERDICTS))]
_Identity = Annotated[bytes, msgspec.Meta(min_length=IDENTITY_SIZE, max_length=IDENTITY_SIZE)]


class CheckRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Check these files of one rank tree against their identities."""

    id: Annotated[int, msgspec.Meta(ge=0)]
    tree: Annotated[int, msgspec.Meta(ge=0)]  # index into the worker's tree descriptors
    slot_bytes: Annotated[int, msgspec.Meta(gt=0)]
    files: Annotated[list[tuple[str, _Identity]], msgspec.Meta(max_length=_MAX_FILES)]  # relpath, identity


class CheckAnswer(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The verdicts of request ``id``'s files, in its order (indexes into :data:`VERDICTS`)."""

    id: int
    verdicts: Annotated[list[_Verdict], msgspec.Meta(max_length=_MAX_FILES)]


#: What a worker answers once it has started (and imported its code), before any request.
_STARTED = CheckRequest(-1, 0, 1, [])


_readers: dict[int, ChunkCodec] = {}


def reader_codec(slot_bytes: int, key_file: str | None = None) -> ChunkCodec:
    """The codec that checks files of ``slot_bytes`` slots: it decodes compressed files, decrypts
    with the keys of ``key_file`` when given (decrypt-only: plain files stay valid), and refuses
    encrypted files as ``no_key`` without one. ``ConfigError`` for an unusable key file."""
    if key_file:
        # dtype only steers encoding (the flags of a file say how to decode it).
        return ChunkCodec.from_options(None, {"key_file": key_file, "key_id": None}, dtype="fp8",
                                       slot_bytes=slot_bytes, where="--key-file: ")
    codec = _readers.get(slot_bytes)
    if codec is None:
        codec = _readers[slot_bytes] = ChunkCodec.reader(dtype="fp8", slot_bytes=slot_bytes)
    return codec


def check_file(tree_fd: int, relpath: str, buf: memoryview, chunk_identity: bytes, *,
               nowait: bool = False, codec: ChunkCodec | None = None) -> str | None:
    """Read chunk file ``relpath`` beneath ``tree_fd`` into ``buf`` (one slot) and check it; a
    verdict of :data:`VERDICTS`. A file that cannot be read (``EIO``, ``EACCES``, ...) is
    ``unreadable``: reported, never taken for corrupt. Raises ``OSError`` for what is this
    process's trouble, not the file's (out of descriptors or memory): nothing can be concluded.
    ``nowait``: from the kernel's caches only; ``BlockingIOError`` or ``OSError`` ``EOPNOTSUPP``
    as :func:`kvtier.tiers.fs.chunks.load_chunk` raises them (check it without, then).
    ``codec`` decodes coded files (default: :func:`reader_codec` without keys)."""
    if codec is None:
        codec = reader_codec(len(buf))
    try:
        return chunks.load_chunk(tree_fd, relpath, buf, chunk_identity, o_direct=False, nowait=nowait,
                                 codec=codec).reason
    except FileNotFoundError:
        return "vanished"
    except OSError as exc:
        if exc.errno in _OWN_ERRNOS or (nowait and (isinstance(exc, BlockingIOError)
                                                    or exc.errno == errno.EOPNOTSUPP)):
            raise
        return "vanished" if exc.errno == errno.ESTALE else "unreadable"


def slot_buffer(buffers: dict[int, memoryview], slot_bytes: int) -> memoryview:
    """The reader's buffer of ``slot_bytes`` from ``buffers`` (made on first use)."""
    buf = buffers.get(slot_bytes)
    if buf is None:
        # Page aligned (an anonymous mapping), as the tier's slots are; kept for the reader's life.
        buf = buffers[slot_bytes] = memoryview(mmap.mmap(-1, slot_bytes))
        buf[:] = bytes(slot_bytes)  # its pages mapped now, not during the first file's read
    return buf


# How a Checker reads a tree's files: tried without waiting first (then on the threads), all on
# the submitting thread, or all on the threads.
_NOWAIT, _HERE, _THREADS = "nowait", "here", "threads"


@dataclass(slots=True)
class _Batch:
    codes: list[int]  # verdict codes, in the batch's order
    left: int  # files not checked yet
    done: Callable[[list[int]], None]


class Checker:
    """Checks chunk files for one reader: a verify worker, or this process with ``--workers 1``.

    A file the kernel's caches hold is checked at once, on the thread that submits it
    (:func:`check_file` with ``nowait``): no thread switch, the one reader holding its
    interpreter lock. A file that would wait for the storage is queued for up to ``depth``
    threads (started when first needed) that read it the ordinary way, so a tree on a disk or
    NFS has ``depth`` reads in flight per reader. Where the kernel or the filesystem cannot read
    without waiting (:func:`kvtier.tiers.fs.chunks.load_chunk`), a tree's files are read on the
    submitting thread if its filesystem is memory (tmpfs: :func:`kvtier.tiers.fs.chunks.in_memory_fs`),
    else all on the threads.

    :meth:`submit` returns once the cached files of a batch are checked and the others queued (it
    waits while ``depth`` files are queued already); ``done(codes)`` (indexes
    into :data:`VERDICTS`, in the batch's order) is called for every batch once all its files
    are checked, in the order the batches were submitted, one call at a time, on the thread that
    checked the file that completed it and the batches before it. :meth:`close` waits for every
    batch. A check that fails on a thread (:func:`check_file` raising: this process's trouble,
    or a bug) calls ``on_error`` with the exception if given (a worker process exits there),
    before the failure shows anywhere else; from then on nothing more is checked or reported,
    and :meth:`submit` and :meth:`close` raise it.

    How many reads reach the storage at once: ``depth`` on the threads, and for each file queued
    for them (up to ``depth``) the readahead the kernel started when it was found not cached.
    """

    def __init__(self, depth: int, on_error: Callable[[BaseException], None] | None = None, *,
                 key_file: str | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._depth = depth
        self._key_file = key_file
        self._codecs: dict[int, ChunkCodec] = {}  # per slot size, with the key file's keys
        self._on_error = on_error
        self._ways: dict[int, str] = {}  # per tree: _NOWAIT until its filesystem says it cannot
        self._buffers: dict[int, memoryview] = {}  # the submitting thread's
        # Bounded: a cold tree of millions of files waits in the caller's list, not here twice;
        # and each file queued here has had its readahead started by the read that may not wait.
        self._queue: queue.Queue[tuple[_Batch, int, int, int, str, bytes, dict[str, Any]] | None] = queue.Queue(depth)
        self._threads: list[threading.Thread] = []
        self._queued = 0  # files handed to the threads and not checked yet
        self._lock = threading.Lock()
        self._order: collections.deque[_Batch] = collections.deque()
        self._error: BaseException | None = None

    def submit(self, tree_fd: int, slot_bytes: int, files: Sequence[tuple[str, bytes]],
               done: Callable[[list[int]], None]) -> None:
        """Check ``files`` (relpath, identity) of the tree open at ``tree_fd``, slots of ``slot_bytes``."""
        if self._error is not None:
            raise self._error
        batch = _Batch([0] * len(files), len(files), done)
        with self._lock:
            self._order.append(batch)
        buf = slot_buffer(self._buffers, slot_bytes)
        checked = 0
        way = self._ways.get(tree_fd, _NOWAIT)
        codec = self._codec_options(slot_bytes)
        for i, (relpath, chunk_identity) in enumerate(files):
            if way is not _THREADS:
                try:
                    batch.codes[i] = _CODE[check_file(tree_fd, relpath, buf, chunk_identity, nowait=way is _NOWAIT,
                                                      **codec)]
                    checked += 1
                    continue
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EOPNOTSUPP:
                        raise
                    # No read here can promise not to wait: read here anyway where files are
                    # memory, else on the threads.
                    way = self._ways[tree_fd] = _HERE if chunks.in_memory_fs(tree_fd) else _THREADS
                    if way is _HERE:
                        batch.codes[i] = _CODE[check_file(tree_fd, relpath, buf, chunk_identity, **codec)]
                        checked += 1
                        continue
            self._hand_over((batch, i, tree_fd, slot_bytes, relpath, chunk_identity, codec))
        self._settle(batch, checked)

    def _codec_options(self, slot_bytes: int) -> dict[str, Any]:
        """What :func:`check_file` is given for files of ``slot_bytes``: with a key file, the codec
        that decrypts with its keys (loaded once per slot size); else nothing (its default)."""
        if not self._key_file:
            return {}
        codec = self._codecs.get(slot_bytes)
        if codec is None:
            codec = self._codecs[slot_bytes] = reader_codec(slot_bytes, self._key_file)
        return {"codec": codec}

    def close(self) -> None:
        """Wait until every batch is done and end the threads; raise what failed one of them."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        if self._error is not None:
            raise self._error

    def _hand_over(self, item: tuple[_Batch, int, int, int, str, bytes, dict[str, Any]]) -> None:
        if self._error is not None:
            raise self._error
        with self._lock:
            self._queued += 1
            start = self._queued > len(self._threads) and len(self._threads) < self._depth
        if start:
            thread = threading.Thread(target=self._read, name="kvtier-verify-reader", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._queue.put(item)

    def _read(self) -> None:
        buffers: dict[int, memoryview] = {}
        while (item := self._queue.get()) is not None:
            if self._error is not None:  # failed: drained unchecked, so that no submit waits for room
                continue
            batch, i, tree_fd, slot_bytes, relpath, chunk_identity, codec = item
            try:
                batch.codes[i] = _CODE[check_file(tree_fd, relpath, slot_buffer(buffers, slot_bytes), chunk_identity,
                                                  **codec)]
                self._settle(batch, 1, handed_over=True)
            except BaseException as exc:  # not a file's fault: its batch is never done
                # ``on_error`` first: a worker process exits there with its own status, which
                # must not race with its main thread seeing the failure and exiting otherwise.
                if self._on_error is not None:
                    try:
                        self._on_error(exc)
                    except BaseException:  # it was told; what it raised changes nothing here
                        pass
                self._error = exc

    def _settle(self, batch: _Batch, checked: int, *, handed_over: bool = False) -> None:
        with self._lock:
            self._queued -= checked if handed_over else 0
            batch.left -= checked
            while self._order and not self._order[0].left:
                finished = self._order.popleft()
                finished.done(finished.codes)


# ------------------------------------------------------------------------------------------------
# The parent's side
# ------------------------------------------------------------------------------------------------


class _Worker:
    """One worker process, its pipes and the requests it has not answered yet."""

    def __init__(self, tree_fds: Sequence[int], depth: int, key_file: str | None = None) -> None:
        if not sys.executable:
            raise OSError(errno.ENOENT, "no Python executable to start verify workers (use --workers 1)")
        fds = ",".join(str(fd) for fd in tree_fds)
        command = [sys.executable, "-I", "-c", _BOOT, fds, str(os.getpid()), str(depth), *import_paths(*_worker_modules())]
        env = {k: v for k, v in os.environ.items() if k != KEY_FILE_ENV}
        if key_file:
            env[KEY_FILE_ENV] = key_file
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, pass_fds=tuple(tree_fds),
                                            start_new_session=True, env=env)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot start a verify worker ({sys.executable}): {exc.strerror or exc}") from exc
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin = self.process.stdin.fileno()
        self.stdout = self.process.stdout.fileno()
        self.pid = self.process.pid
        # Sent, not answered yet, in order; the first answer says the worker started.
        self.pending: collections.deque[CheckRequest] = collections.deque([_STARTED])
        self._buffer = bytearray()

    def send(self, request: CheckRequest, frame: bytes) -> None:
        self.pending.append(request)
        try:
            write_all(self.stdin, frame)
        except OSError as exc:  # EPIPE: it died
            raise OSError(errno.EPIPE, self.death()) from exc

    def receive(self) -> list[CheckAnswer]:
        """Read what the worker wrote (one ``read``, blocking until there is something) and return
        the answers it completes. ``OSError`` when it died or sent something malformed."""
        data = os.read(self.stdout, 1 << 16)
        if not data:
            raise OSError(errno.EPIPE, self.death())
        self._buffer += data
        answers = []
        while len(self._buffer) >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(self._buffer)
            if length > _MAX_ANSWER_BYTES:
                raise OSError(errno.EPROTO, f"verify worker {self.pid} sent a frame of {length} bytes")
            end = FRAME_HEADER.size + length
            if len(self._buffer) < end:
                break
            payload = bytes(self._buffer[FRAME_HEADER.size:end])
            del self._buffer[:end]
            try:
                answers.append(_DECODER.decode(payload))
            except msgspec.MsgspecError as exc:
                raise OSError(errno.EPROTO, f"verify worker {self.pid} sent a bad answer: {exc}") from None
        return answers

    def match(self, answer: CheckAnswer) -> CheckRequest:
        """The request ``answer`` answers (they come back in order), checked against it."""
        expected = self.pending.popleft() if self.pending else None
        if expected is None or answer.id != expected.id or len(answer.verdicts) != len(expected.files):
            raise OSError(errno.EPROTO, f"verify worker {self.pid} sent an answer to no request sent to it "
                                        f"(id {answer.id}, {len(answer.verdicts)} verdicts)")
        return expected

    def death(self) -> str:
        """Why the worker stopped answering: its exit status and the end of its stderr."""
        try:
            status: int | None = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            status = None
        tail = b""
        if status is not None and self.process.stderr is not None:
            tail = self.process.stderr.read()[-_STDERR_KEPT:]
        last = tail.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"verify worker {self.pid} exited (status {status}){': ' + last[0] if last[0] else ''}"

    def close(self) -> None:
        """Let the worker end (end of its stdin) and reap it; kill it if it does not."""
        try:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(timeout=5.0)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self._close_pipes()

    def kill(self) -> None:
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
            self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


class VerifyWorkers:
    """``size`` worker processes checking files of the trees open at ``tree_fds``, each with a
    :class:`Checker` of ``depth`` threads for files not in the page cache.

    Use as a context manager: leaving it normally ends the workers (end of their stdin), leaving
    it with an exception kills them. Starting them returns at once; :meth:`wait_ready` waits
    until every one has imported its code (overlap it with other work) and mapped its
    buffers."""

    def __init__(self, tree_fds: Sequence[int], size: int, depth: int, key_file: str | None = None) -> None:
        self.size = size
        self._workers: list[_Worker] = []
        try:
            for _ in range(size):
                self._workers.append(_Worker(tree_fds, depth, key_file))
        except BaseException:
            self._kill_all()
            raise

    def __enter__(self) -> VerifyWorkers:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            for worker in self._workers:
                worker.close()
        else:
            self._kill_all()

    def _kill_all(self) -> None:
        for worker in self._workers:
            worker.kill()

    def wait_ready(self, slot_sizes: Sequence[int]) -> None:
        """Block until every worker has started (its first answer says so) and made its buffer
        of each of ``slot_sizes`` (an empty request of that size)."""
        for worker in self._workers:
            for slot_bytes in slot_sizes:
                worker.send(*self.prepare([CheckRequest(0, 0, slot_bytes, [])])[0])
        for worker in self._workers:
            while worker.pending:
                for answer in worker.receive():
                    worker.match(answer)

    @staticmethod
    def prepare(requests: Sequence[CheckRequest]) -> list[tuple[CheckRequest, bytes]]:
        """Each request with its frame, encoded ahead of :meth:`run`."""
        out = []
        for request in requests:
            payload = _ENCODER.encode(request)
            out.append((request, FRAME_HEADER.pack(len(payload)) + payload))
        return out

    def run(self, requests: Sequence[tuple[CheckRequest, bytes]],
            done: Callable[[CheckRequest, list[str | None]], None], *, in_flight: int = 2) -> None:
        """Check every request's files (``requests`` from :meth:`prepare`); ``done(request,
        verdicts)`` for each, on this thread, as answers arrive. Each worker has up to
        ``in_flight`` requests queued, so it reads while its last answer travels. Raises
        ``OSError`` when a worker dies or answers out of protocol."""
        queue = collections.deque(requests)
        with selectors.DefaultSelector() as selector:
            for worker in self._workers:
                selector.register(worker.stdout, selectors.EVENT_READ, worker)
                while queue and len(worker.pending) < in_flight:
                    worker.send(*queue.popleft())
            busy = sum(len(w.pending) for w in self._workers)
            while busy:
                for key, _ in selector.select():
                    worker = key.data
                    for answer in worker.receive():
                        request = worker.match(answer)
                        busy -= 1
                        if request is not _STARTED:
                            done(request, [VERDICTS[code] for code in answer.verdicts])
                        if queue:
                            worker.send(*queue.popleft())
                            busy += 1


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(CheckAnswer)


def _worker_modules() -> list[ModuleType]:
    """The modules whose directories a worker imports from: kvtier's dependencies for checking
    (and the codec libraries this process has, for coded files)."""
    import numpy

    modules = [msgspec, xxhash, numpy]
    for name in ("zstandard", "cryptography"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    return modules


# ------------------------------------------------------------------------------------------------
# The worker process
# ------------------------------------------------------------------------------------------------


def worker_main(argv: list[str]) -> None:
    """A verify worker: ``argv`` = [the tree descriptors, comma separated; the parent's pid;
    reads in flight (:class:`Checker`'s ``depth``)]; the key file's path, if any, in the environment
    (:data:`KEY_FILE_ENV`). Answers :data:`_STARTED` at once, then each
    :class:`CheckRequest` frame on stdin with a :class:`CheckAnswer` frame on stdout, in order
    (a request is answered once all its files are checked, while the next is read); exits at the
    end of stdin, or when its parent dies."""
    tree_fds, parent, depth = [int(fd) for fd in argv[0].split(",")], int(argv[1]), int(argv[2])
    key_file = os.environ.get(KEY_FILE_ENV) or None
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle
    decoder = msgspec.msgpack.Decoder(CheckRequest)
    beneath.has_openat2()  # probed now, part of starting, not of the first file's check

    def answer(request_id: int, verdicts: list[int]) -> None:
        payload = _ENCODER.encode(CheckAnswer(request_id, verdicts))
        write_all(1, FRAME_HEADER.pack(len(payload)) + payload)

    def die(exc: BaseException) -> None:  # a reader thread failed: the parent must not wait for it
        traceback.print_exception(exc)
        sys.stderr.flush()
        os._exit(3)

    answer(_STARTED.id, [])
    checker = Checker(depth, on_error=die, key_file=key_file)
    for request in requests(decoder, max_bytes=_MAX_REQUEST_BYTES):
        checker.submit(tree_fds[request.tree], request.slot_bytes, request.files,
                       functools.partial(answer, request.id))
    checker.close()

"""Chunk files: the fs tier's blocking primitives to publish, read, verify and remove one chunk.

They never touch tier bookkeeping; they take a directory descriptor (the run's block tree, held
open by the tier), a path relative to it and buffers, and either return or raise ``OSError``
(mapped to a tier error by the caller). The tier runs them on its thread pool
(:mod:`kvtier.tiers.fs.pool`).

Containment (:mod:`kvtier.tiers.fs.beneath`): every path is resolved beneath that descriptor
without following a symbolic link at any level, and only regular files are read, so a link or a
special file planted in the tree never redirects a read or a write and never blocks a worker;
it surfaces as :class:`~kvtier.tiers.fs.beneath.UnsafeEntry` (reads: the ``not_regular`` verdict).

Atomic publication (:func:`write_chunk`): bytes go to a unique temporary name *in the destination
directory* (:func:`kvtier.tiers.fs.tree.chunk_tmp_name`, opened ``O_EXCL``) and are renamed over
the final name, so a reader sees either no file or a complete one; a failed write removes its
temporary file, and a crash leaves at most a stray ``.tmp`` file, which the fs tier's scan
(:func:`kvtier.tiers.fs.scan.walk_tops`) removes once it is older than a grace period. No
``fsync``: chunks are a cache, losing the last ones on power failure only costs a recompute, and
the trailer check catches torn pages.

Modes (:mod:`kvtier.tiers.fs.modes`): a chunk file, its temporary and every directory a write
makes get exactly the modes given (owner-only by default) whatever the umask.
"""

from __future__ import annotations

import array
import ctypes
import errno
import mmap
import os
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.layout import Namespace
from kvtier.tiers.fs import beneath, tree
from kvtier.tiers.fs.beneath import UnsafeEntry
from kvtier.tiers.fs.modes import PRIVATE, Modes
from kvtier.tiers.integrity import (
    HEAD_SIZE,
    IDENTITY_SIZE,
    MAGIC,
    TAIL_SIZE,
    TRAILER_PAGE,
    TRAILER_SIZE,
    SizeClass,
    Verdict,
    checksum,
    classify_size,
    expected_heads,
    rejected,
    verify,
)

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.tiers.codec import ChunkCodec

__all__ = [
    "probe_o_direct",
    "write_chunk",
    "write_image",
    "trailer_page",
    "read_chunk",
    "load_chunk",
    "slice_loader",
    "CodedVerdict",
    "image_buffer",
    "ReadOutcome",
    "remove_file",
    "in_memory_fs",
]

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_NOATIME: int = getattr(os, "O_NOATIME", 0)
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)

# ------------------------------------------------------------------------------------------------
# Raw primitives
# ------------------------------------------------------------------------------------------------

_scratch = threading.local()


def _scratch_pages() -> memoryview:
    """Two page-aligned, thread-private pages (``O_DIRECT`` needs aligned buffers).

    A read lands the trailer page in the first and uses the second only to notice a file that is
    longer than a chunk (see :func:`load_chunk`); writes stage their trailer in the first.
    """
    pages = getattr(_scratch, "pages", None)
    if pages is None:
        # An anonymous mapping is page aligned; one per thread, kept for the thread's life.
        _scratch.mapping = mmap.mmap(-1, 2 * TRAILER_PAGE)
        pages = _scratch.pages = memoryview(_scratch.mapping)
        _scratch.page = pages[:TRAILER_PAGE]
    return pages


def _scratch_page() -> memoryview:
    """The first of :func:`_scratch_pages` (the trailer page of a read or write)."""
    page = getattr(_scratch, "page", None)
    if page is None:
        _scratch_pages()
        page = _scratch.page
    return page


def trailer_page() -> memoryview:
    """This thread's page for a store's trailer: page aligned, zero except its last
    :data:`~kvtier.tiers.integrity.TRAILER_SIZE` bytes, where the caller writes the trailer
    (:func:`kvtier.tiers.integrity.write_trailer`) before handing it to :func:`write_chunk`,
    which then writes it as it is (no copy). Nothing else ever writes into it, so its zeros stay.
    """
    page = getattr(_scratch, "trailer", None)
    if page is None:
        _scratch.trailer_mapping = mmap.mmap(-1, TRAILER_PAGE)
        page = _scratch.trailer = memoryview(_scratch.trailer_mapping)
    return page


def image_buffer(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer of at least ``nbytes`` bytes, for a whole chunk file
    image: a coded store encodes into it (``O_DIRECT`` writes it as it is), a coded load copies
    the file there to decode it into the slot. Kept for the thread's life (grown when asked for
    more); valid until this thread asks again."""
    image = getattr(_scratch, "image", None)
    if image is None or len(image) < nbytes:
        _scratch.image_mapping = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        image = _scratch.image = memoryview(_scratch.image_mapping)
    return image


def probe_o_direct(dir_fd: int) -> bool:
    """Whether the filesystem of directory ``dir_fd`` accepts an aligned ``O_DIRECT`` write
    (tmpfs, overlayfs and some NFS mounts do not). Writes and deletes one hidden probe file
    (:func:`kvtier.tiers.fs.tree.probe_name`, owner-only); one left by a crash is swept by the
    start-up scan (:mod:`kvtier.tiers.fs.scan`)."""
    if not _O_DIRECT:
        return False
    name = tree.probe_name()
    try:
        fd = beneath.open_file(dir_fd, name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        page = _scratch_page()
        page[:] = bytes(TRAILER_PAGE)
        return os.pwrite(fd, page, 0) == TRAILER_PAGE
    except OSError as exc:
        # A full disk refuses the bytes, not the mode: O_DIRECT is there (an unsupported mode
        # fails with EINVAL), so a start-up on a full disk does not lose it for the process.
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        os.close(fd)
        _unlink_quietly(name, dir_fd)


def write_chunk(dir_fd: int, relpath: str, payload: memoryview, trailer: bytes | memoryview, *,
                o_direct: bool, modes: Modes = PRIVATE) -> int:
    """Publish ``payload`` + ``trailer`` (a trailer page) at ``relpath`` beneath ``dir_fd``
    atomically; return the bytes written. ``trailer`` may be this thread's :func:`trailer_page`
    (written as it is) or any bytes (copied into an aligned page first).

    Returns 0 without writing when a regular file of exactly that size is already there
    (content-addressed: it is the same chunk, and a load verifies it); anything else at the name
    (a file of another size, such as a trailer-less vLLM one, a link, a pipe) is replaced.
    Creates missing parent directories. The file (and every directory made) gets exactly the
    mode of ``modes`` (see :mod:`kvtier.tiers.fs.modes`). Raises :class:`UnsafeEntry` when a
    directory on the way is a link or not a directory. On any error no temporary file remains and
    the ``OSError`` propagates; a write the disk cannot complete raises ``OSError(ENOSPC)`` (or the
    error the kernel gave). With ``o_direct`` the payload must be page aligned with a page-multiple
    length (host slots are).
    """
    if trailer is getattr(_scratch, "trailer", None):
        tail = trailer
    else:
        tail = _scratch_page()[TRAILER_PAGE - len(trailer) :]
        tail[:] = trailer
    return _publish(dir_fd, relpath, [payload, tail], len(payload) + len(tail), o_direct, modes)


def write_image(dir_fd: int, relpath: str, image: memoryview, *, o_direct: bool, modes: Modes = PRIVATE) -> int:
    """Publish ``image``, a whole chunk file (a coded chunk with its trailer page), at ``relpath``
    beneath ``dir_fd``: :func:`write_chunk` for a file built beforehand. With ``o_direct``,
    ``image`` must be page aligned with a page-multiple length."""
    return _publish(dir_fd, relpath, [image], len(image), o_direct, modes)


def _publish(dir_fd: int, relpath: str, buffers: list[memoryview], total: int, o_direct: bool, modes: Modes) -> int:
    """Write ``buffers`` (``total`` bytes) to a temporary file and rename it to ``relpath``
    (see :func:`write_chunk`)."""
    head, _, name = relpath.rpartition("/")
    parent, made = beneath.open_or_make_dir(dir_fd, head, modes) if head else (beneath.open_dir(dir_fd, ""), False)
    try:
        # A directory this call made holds nothing to keep or check: no lookup of the name.
        st = None
        if not made:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                pass
        if st is not None:
            if stat.S_ISREG(st.st_mode) and st.st_size == total:
                return 0
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeEntry(relpath, "a directory where a chunk file belongs")
        tmp = tree.chunk_tmp_name(name)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                     | (_O_DIRECT if o_direct else 0), modes.file, dir_fd=parent)
        try:
            try:
                if modes.fix_file:
                    modes.settle_file(fd)
                _write_fully(fd, buffers, total, o_direct)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except IsADirectoryError:  # made under the name since it was looked at (or made into a new directory)
                raise UnsafeEntry(relpath, "a directory where a chunk file belongs") from None
            except FileExistsError:
                # Some shared filesystems refuse to replace: another writer won with the same bytes.
                _unlink_quietly(tmp, parent)
        except BaseException:
            _unlink_quietly(tmp, parent)
            raise
        return total
    finally:
        os.close(parent)


def _write_fully(fd: int, buffers: list[memoryview], total: int, o_direct: bool) -> None:
    """``pwritev`` ``buffers`` (``total`` bytes) at offset 0 until all bytes are written.

    A short count means the device is (nearly) full, or a signal cut the call short: the rest is
    written again, so a full disk reports its own error (``ENOSPC``/``EDQUOT``) rather than a
    generic one. A write that makes no progress, or one ``O_DIRECT`` cannot resume (unaligned),
    is ``ENOSPC``: a regular file only comes up short when space runs out.
    """
    done = os.pwritev(fd, buffers, 0)
    while done < total:
        if done <= 0 or (o_direct and done % TRAILER_PAGE):
            raise OSError(errno.ENOSPC, f"short write ({done} of {total} bytes): no space left on device")
        rest, skip = [], done
        for buf in buffers:
            if skip >= len(buf):
                skip -= len(buf)
            else:
                rest.append(buf[skip:])
                skip = 0
        n = os.pwritev(fd, rest, done)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"short write ({done} of {total} bytes): no space left on device")
        done += n


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """What :func:`read_chunk` found. ``trailer_page`` is set only for ``TRAILERED`` files whose
    payload was read completely into the destination."""

    size_class: SizeClass
    file_size: int
    trailer_page: bytes | None = None


#: The flags :func:`_open_for_read` tries first, by ``o_direct``.
_READ_FLAGS = {False: os.O_RDONLY | _O_NOATIME, True: os.O_RDONLY | _O_NOATIME | _O_DIRECT}


def _open_for_read(dir_fd: int, relpath: str, o_direct: bool, *, regular_only: bool = True,
                   cached_only: bool = False) -> int:
    """Open chunk file ``relpath`` for reading: ``O_NOATIME`` where allowed, ``O_DIRECT`` if asked.

    ``O_NOATIME``: under ``relatime`` the first read of a freshly written file updates its
    atime, a metadata write per chunk that a page-cache load feels; kvtier's recency never uses
    atime. The kernel refuses it (``EPERM``) on files the process
    does not own (a ``root_dir`` shared between users): those open without it. ``O_DIRECT`` is
    dropped (``EINVAL``) for a file on a filesystem without it (a mount below ``root_dir``).
    Raises :class:`UnsafeEntry` for anything but a regular file reached without links (see
    :func:`~kvtier.tiers.fs.beneath.open_file` for ``regular_only`` and ``cached_only``).
    """
    flags = _READ_FLAGS[o_direct]
    while True:
        try:
            return beneath.open_file(dir_fd, relpath, flags, regular_only=regular_only, cached_only=cached_only)
        except UnsafeEntry:
            raise
        except OSError as exc:
            if exc.errno == errno.EPERM and flags & _O_NOATIME:
                flags &= ~_O_NOATIME
            elif exc.errno == errno.EINVAL and flags & _O_DIRECT:
                flags &= ~_O_DIRECT
            else:
                raise


def read_chunk(dir_fd: int, relpath: str, dst: memoryview, *, o_direct: bool) -> ReadOutcome:
    """Read the chunk at ``relpath`` into ``dst`` (exactly one slot) and return its trailer page.

    The file's size is checked first: a ``SHORT``/``LONG`` file is reported without reading any
    of it. A file that shrinks while being read is reported ``SHORT``. The caller verifies the
    payload in ``dst`` against the trailer and must not trust ``dst`` before that.
    Raises ``OSError`` (``FileNotFoundError`` for a missing file, :class:`UnsafeEntry` for a link
    or special file). The tier's loads use the faster :func:`load_chunk` instead; this is the
    inspection primitive (tools, tests).
    """
    fd = _open_for_read(dir_fd, relpath, o_direct)
    try:
        size = os.fstat(fd).st_size
        size_class = classify_size(size, len(dst))
        if size_class in (SizeClass.SHORT, SizeClass.LONG):
            return ReadOutcome(size_class, size)
        if size_class is SizeClass.RAW:
            if os.preadv(fd, [dst], 0) != len(dst):
                return ReadOutcome(SizeClass.SHORT, size)
            return ReadOutcome(size_class, size)
        # Payload and trailer page in ONE system call (both buffers are page aligned, so this
        # also works with O_DIRECT): a syscall per chunk is measurable at page-cache speeds.
        page = _scratch_page()
        if os.preadv(fd, [dst, page], 0) != len(dst) + TRAILER_PAGE:
            return ReadOutcome(SizeClass.SHORT, size)
        return ReadOutcome(size_class, size, bytes(page))
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class CodedVerdict(Verdict):
    """The verdict on a file that :func:`load_chunk` handed to its codec (a coded file, or a
    plain one an encrypting codec refuses), with the file's size: what it takes on disk."""

    file_size: int = 0


def load_chunk(dir_fd: int, relpath: str, dst: memoryview, chunk_identity: bytes, *, o_direct: bool,
               accept_unverified: bool = False, nowait: bool = False, codec: ChunkCodec | None = None) -> Verdict:
    """Read the chunk at ``relpath`` into ``dst`` (exactly one slot) and verify that it is chunk
    ``chunk_identity`` (:func:`kvtier.tiers.integrity.identity`) with intact bytes: the tier's
    load path for every kind of file, :func:`read_chunk` plus
    :func:`kvtier.tiers.integrity.verify` in fewer steps (a plain trailered chunk, the common
    case, is first tried by :func:`slice_loader`, which hands everything else here).

    Returns the verdict, rejections included: ``not_regular`` for a link or special file (never
    read, never waited on), ``short``/``long`` by what could be read, ``unverified`` for a
    trailer-less file unless ``accept_unverified``, and the trailer's own reasons. ``dst`` may
    hold a rejected file's bytes: it is trusted only when ``verdict.ok`` (the tier zeroes it
    otherwise). Rejected files are left in place (the caller decides). Raises ``OSError``
    (``FileNotFoundError`` for a missing file).

    ``codec`` (:class:`kvtier.tiers.codec.ChunkCodec`) reads coded files (format version 3,
    compressed and/or encrypted): a file whose size is not a plain chunk's (``slot_bytes`` +
    4096, or ``slot_bytes``) is then copied whole into this thread's :func:`image_buffer` (it was
    read in the same single ``preadv``: a coded file is at most a slot and two pages) and decoded
    into ``dst`` by the codec, which returns a :class:`CodedVerdict` (so does a plain file that an
    encrypting codec refuses). Plain files take the path above, unchanged. Without a codec, other
    sizes are ``short``/``long`` as ever.

    ``nowait`` reads only what the kernel's caches hold (``RESOLVE_CACHED``, ``RWF_NOWAIT``):
    ``BlockingIOError`` when the path or a byte the verdict depends on (the file's first slot and
    two pages) would have to come from the storage, ``OSError`` ``EOPNOTSUPP`` where the kernel
    or the filesystem cannot promise not to
    wait (NFS, tmpfs, kernels before 5.12). The caller then reads it without ``nowait``, on a
    thread that may wait. ``nowait`` with ``o_direct`` is a ``ValueError`` (a direct read waits
    for the device).

    Why it differs from :func:`read_chunk` (each step is measurable at page-cache speeds): ONE
    ``preadv`` into ``dst`` then two scratch pages (the trailer page, a spare one) tells the size
    class, since reading stops at end of file and a file longer than a chunk spills into the spare
    page; and the trailer is checked in place, in this thread's scratch page, before anything on
    this thread can reuse it (no copy).
    """
    if nowait and (o_direct or not _RWF_NOWAIT):
        if o_direct:  # a direct read waits for the device whatever the flag says
            raise ValueError("nowait reads the page cache: it cannot be combined with o_direct")
        raise OSError(errno.EOPNOTSUPP, "reads that may not wait are not supported here", relpath)
    try:
        # No fstat (a system call per chunk): what is not a regular file fails the read below.
        fd = _open_for_read(dir_fd, relpath, o_direct, regular_only=False, cached_only=nowait)
    except UnsafeEntry:
        return rejected("not_regular")
    slot_bytes = len(dst)
    # A tier that encodes reads mostly coded files: straight into the image buffer (one page more
    # than the largest coded file, so a longer file shows), no copy on the way; a plain file found
    # there (written before the option was on) is copied into the slot by the codec.
    image = image_buffer(slot_bytes + 3 * TRAILER_PAGE) if codec is not None and codec.active else None
    try:
        if image is not None:
            n = os.preadv(fd, [image[: slot_bytes + 3 * TRAILER_PAGE]], 0, _RWF_NOWAIT if nowait else 0)
            if nowait and n < slot_bytes + 3 * TRAILER_PAGE and os.lseek(fd, 0, os.SEEK_END) != n:
                raise BlockingIOError(errno.EAGAIN, "not all in the page cache", relpath)
            return _decode_image(codec, image, n, dst, chunk_identity, accept_unverified)  # type: ignore[arg-type]
        # Both buffers are page aligned with page-multiple lengths, so O_DIRECT accepts them
        # (it may still return a count that is not a page multiple at end of file).
        n = os.preadv(fd, [dst, _scratch_pages()], 0, _RWF_NOWAIT if nowait else 0)
        # A read that may not wait stops where the page cache does: what it read is the whole
        # file only where the file ends there (a file longer than a slot and two pages is
        # "long" however much of it is cached).
        if nowait and n <= slot_bytes + TRAILER_PAGE and os.lseek(fd, 0, os.SEEK_END) != n:
            raise BlockingIOError(errno.EAGAIN, "not all in the page cache", relpath)
        if codec is not None and n > slot_bytes + TRAILER_PAGE:
            # A coded file of up to a slot and two pages (encrypted), or part of a longer file.
            end = os.lseek(fd, 0, os.SEEK_END)
            if end != n:
                if nowait and end <= slot_bytes + 2 * TRAILER_PAGE:
                    raise BlockingIOError(errno.EAGAIN, "not all in the page cache", relpath)
                return CodedVerdict(False, False, "long" if end > n else "short", end)
    except OSError as exc:
        if exc.errno in (errno.ESPIPE, errno.EISDIR):  # a pipe or a directory under a chunk's name
            return rejected("not_regular")
        if nowait and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # refused: by an old kernel (EINVAL),
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # by what is no regular file (a directory),
                return rejected("not_regular")
            # or by the filesystem (NFS, tmpfs)
            raise OSError(errno.EOPNOTSUPP, "reads that may not wait are not supported", relpath) from None
        raise
    finally:
        os.close(fd)
    if codec is None or not codec.encrypts:  # no codec, or one that reads plain chunks as they are
        if n == slot_bytes + TRAILER_PAGE:
            return verify(dst, _scratch.page, chunk_identity)
        if n == slot_bytes:  # a trailer-less file (written by vLLM) of exactly one slot
            return verify(dst, None, chunk_identity, accept_unverified=accept_unverified)
        if codec is None:
            # A file that shrank (or grew) while being read classifies by what was read, like read_chunk.
            return rejected("short" if n < slot_bytes + TRAILER_PAGE else "long")
    return _decode(codec, dst, n, chunk_identity, accept_unverified)


#: How many chunks a :func:`slice_loader` reads before it checks their trailers together.
_SLICE_ROWS = 64


class _SliceScratch:
    """One thread's landing places for the trailers of up to :data:`_SLICE_ROWS` chunks read
    together by a :func:`slice_loader`: their heads and checksums end up in row order in two
    arrays, so the whole slice is checked with two comparisons. Small (a pool's threads live as
    long as their tier, and each makes one on its first load): direct reads' page rows are made
    on the first direct read."""

    def __init__(self) -> None:
        rows = _SLICE_ROWS
        # A spare page, page aligned (an anonymous mapping), after the trailer: it catches a file
        # longer than a chunk. A buffered read also sends what comes before the trailer and its
        # reserved end there, and the head and the checksum to their rows.
        self.spare_mapping = mmap.mmap(-1, TRAILER_PAGE)
        self.spare = memoryview(self.spare_mapping)
        self.before = self.spare[: TRAILER_PAGE - TRAILER_SIZE]
        self.reserved = self.spare[: TAIL_SIZE - (HEAD_SIZE - IDENTITY_SIZE) - 8]
        self.heads = bytearray(rows * HEAD_SIZE)
        heads = memoryview(self.heads)
        self.head_rows = [heads[i * HEAD_SIZE : (i + 1) * HEAD_SIZE] for i in range(rows)]
        self.digests = array.array("Q", bytes(8 * rows))
        digests = memoryview(self.digests).cast("B")
        self.digest_rows = [digests[8 * i : 8 * (i + 1)] for i in range(rows)]
        self._pages: list[memoryview] | None = None

    @property
    def pages(self) -> list[memoryview]:
        """Page-aligned rows for direct reads, which land each chunk's whole trailer page."""
        if self._pages is None:
            self.pages_mapping = mmap.mmap(-1, _SLICE_ROWS * TRAILER_PAGE)
            whole = memoryview(self.pages_mapping)
            self._pages = [whole[i * TRAILER_PAGE : (i + 1) * TRAILER_PAGE] for i in range(_SLICE_ROWS)]
            # The heads and checksums of those pages, and their rows, as arrays: gathered in two
            # copies per slice (a copy per row would be Python run per chunk).
            at = TRAILER_PAGE - TRAILER_SIZE
            pages = np.frombuffer(self.pages_mapping, dtype=np.uint8).reshape(_SLICE_ROWS, TRAILER_PAGE)
            self.page_heads = pages[:, at : at + HEAD_SIZE]
            self.page_digests = pages[:, at + HEAD_SIZE : at + HEAD_SIZE + 8]
            self.head_array = np.frombuffer(self.heads, dtype=np.uint8).reshape(_SLICE_ROWS, HEAD_SIZE)
            self.digest_array = np.frombuffer(self.digests, dtype=np.uint8).reshape(_SLICE_ROWS, 8)
        return self._pages


def _slice_scratch() -> _SliceScratch:
    scratch: _SliceScratch | None = getattr(_scratch, "slices", None)
    if scratch is None:
        scratch = _scratch.slices = _SliceScratch()
    return scratch


SliceLoad = Callable[[int, Sequence[bytes], Sequence[memoryview]], "list[bool]"]


def slice_loader(o_direct: bool, run_fingerprint: bytes) -> SliceLoad:
    """The tier's load hot path for the common case: ``load(dir_fd, keys, dsts)`` reads chunk
    ``keys[i]`` of the run ``run_fingerprint`` names into ``dsts[i]`` (one slot each) and says,
    per chunk, whether it is a plain trailered chunk file that verified as that chunk: what
    :func:`load_chunk` would accept as ``ACCEPTED_VERIFIED``. Every ``False`` (a file it cannot
    open, of another size, a read that failed, any trailer or checksum mismatch) is the caller's
    to hand to :func:`load_chunk`, which opens and reads again and says why; the slot holds
    whatever was read meanwhile.

    Per chunk only the system calls and the checksum run: one ``openat2`` (as
    :func:`~kvtier.tiers.fs.beneath.open_file`, called as
    :func:`~kvtier.tiers.fs.beneath.raw_opener` prepared it, with no function around it), one
    ``preadv`` that lands the payload in the slot and the trailer's head and checksum in this
    thread's rows (:class:`_SliceScratch`), and xxh3-64 of the slot. The paths are made for the
    whole slice at once (:meth:`~kvtier.layout.Namespace.chunk_relpaths`) and the trailers
    checked together against :func:`~kvtier.tiers.integrity.expected_heads`: at page-cache speeds
    every bytecode a worker runs per chunk holds the interpreter lock that its peers and the
    event loop wait for, and costs several times its own length in throughput. Without
    ``openat2`` every chunk is declined (the general way walks each path component by component).

    Not for coded chunks (a tier with compression or encryption on) nor reads that may not
    wait. A ``ValueError`` for a key that is no offload key (as :func:`load_chunk`'s caller
    would get).
    """
    raw = beneath.raw_opener(_READ_FLAGS[o_direct])
    if raw is None:  # no openat2 here: every chunk is opened the general way
        def decline(dir_fd: int, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> list[bool]:
            if len(keys) != len(dsts):
                raise ValueError(f"{len(keys)} keys for {len(dsts)} slots")
            Namespace.chunk_relpaths(keys)  # a key that is no offload key: its ValueError
            return [False] * len(keys)
        return decline
    openat2, nr, how, how_size = raw
    preadv, close, digest_of, relpaths_of = os.preadv, os.close, checksum, Namespace.chunk_relpaths
    big_endian = sys.byteorder == "big"  # the trailer's checksum is little-endian

    def load_rows(dir_fd: int, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> list[bool]:
        n = len(keys)
        slot_bytes = len(dsts[0])
        if set(map(len, dsts)) != {slot_bytes}:
            return [False] * n
        relpaths = relpaths_of(keys)  # hexadecimal names: bytes without a NUL, as openat2 needs
        expected = expected_heads(keys, run_fingerprint, slot_bytes)
        scratch = _slice_scratch()
        spare, before, reserved = scratch.spare, scratch.before, scratch.reserved
        head_rows, digest_rows = scratch.head_rows, scratch.digest_rows
        pages = scratch.pages if o_direct else []
        sizes = [0] * n
        digests = [0] * n
        for i in range(n):
            fd = openat2(nr, dir_fd, relpaths[i], how, how_size)
            if fd < 0:
                continue
            dst = dsts[i]
            try:
                if o_direct:  # page-aligned buffers only
                    sizes[i] = preadv(fd, [dst, pages[i], spare], 0)
                else:
                    sizes[i] = preadv(fd, [dst, before, head_rows[i], digest_rows[i], reserved, spare], 0)
                digests[i] = digest_of(dst)
            except OSError:
                pass
            finally:
                close(fd)
        if o_direct:
            scratch.head_array[:n] = scratch.page_heads[:n]
            scratch.digest_array[:n] = scratch.page_digests[:n]
        stored = scratch.digests[:n]
        if big_endian:
            stored.byteswap()
        heads = scratch.heads
        size = slot_bytes + TRAILER_PAGE
        if sizes.count(size) == n and stored.tolist() == digests and heads[: n * HEAD_SIZE] == expected:
            return [True] * n
        return [sizes[i] == size and stored[i] == digests[i]
                and heads[i * HEAD_SIZE : (i + 1) * HEAD_SIZE] == expected[i * HEAD_SIZE : (i + 1) * HEAD_SIZE]
                for i in range(n)]

    def load_slice(dir_fd: int, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> list[bool]:
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys for {len(dsts)} slots")
        if len(keys) <= _SLICE_ROWS:
            return load_rows(dir_fd, keys, dsts) if keys else []
        verified: list[bool] = []
        for start in range(0, len(keys), _SLICE_ROWS):
            verified += load_rows(dir_fd, keys[start : start + _SLICE_ROWS], dsts[start : start + _SLICE_ROWS])
        return verified
    return load_slice


def _decode(codec: ChunkCodec, dst: memoryview, n: int, chunk_identity: bytes, accept_unverified: bool) -> CodedVerdict:
    """Decode the ``n``-byte file :func:`load_chunk` read into ``dst`` and this thread's scratch
    pages: copied whole into :func:`image_buffer` first (the codec's source and target must not
    overlap), then :func:`_decode_image`."""
    slot_bytes = len(dst)
    image = image_buffer(slot_bytes + 3 * TRAILER_PAGE)
    head = min(n, slot_bytes)
    image[:head] = dst[:head]
    if n > slot_bytes:
        image[slot_bytes:n] = _scratch.pages[: n - slot_bytes]
    return _decode_image(codec, image, n, dst, chunk_identity, accept_unverified)


def _decode_image(codec: ChunkCodec, image: memoryview, n: int, dst: memoryview, chunk_identity: bytes,
                  accept_unverified: bool) -> CodedVerdict:
    """Decode the ``n``-byte file in ``image`` into ``dst`` (zeroed on a rejection). A file of
    neither a plain size nor a kvtier tail is ``short``/``long`` by its size, as without a codec;
    a file longer than a coded one can be is ``long``."""
    slot_bytes = len(dst)
    plain = n == slot_bytes or n == slot_bytes + TRAILER_PAGE
    if n > slot_bytes + 2 * TRAILER_PAGE or (
            not plain and (n < TAIL_SIZE or image[n - TAIL_SIZE : n - TAIL_SIZE + len(MAGIC)] != MAGIC)):
        dst[:] = bytes(slot_bytes)
        return CodedVerdict(False, False, "short" if n < slot_bytes + TRAILER_PAGE else "long", n)
    verdict = codec.decode_into(image[:n], chunk_identity, dst, accept_unverified=accept_unverified)
    return CodedVerdict(verdict.ok, verdict.verified, verdict.reason, n)


def remove_file(dir_fd: int, relpath: str) -> bool:
    """Delete what is at ``relpath`` beneath ``dir_fd`` without following links (see
    :func:`~kvtier.tiers.fs.beneath.remove_entry`); ``False`` if it was already gone (not an
    error: others share the tree)."""
    return beneath.remove_entry(dir_fd, relpath)


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


_MEMORY_FS_MAGIC = frozenset({0x01021994, 0x858458F6})  # tmpfs, ramfs (statfs(2) f_type)


def in_memory_fs(fd: int) -> bool:
    """Whether the file or directory open at ``fd`` lives on a filesystem whose files are memory
    (tmpfs, ramfs): reading never waits for a device there, though reads that may not wait are
    refused. False where that cannot be told (not Linux, ``fstatfs`` unavailable)."""
    if not sys.platform.startswith("linux"):
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) first
    try:
        if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FS_MAGIC

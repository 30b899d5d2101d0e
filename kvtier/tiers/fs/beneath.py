"""Opening files beneath a directory without ever leaving it.

The filesystem tier's tree is shared storage: other processes and users write into it, and a
hostile one may plant a symbolic link, a named pipe or a device where a chunk file or a shard
directory should be. Every path the tier opens is therefore resolved *relative to a directory file
descriptor it holds* (its run's block tree), and:

* no symbolic link is followed, at any level — the file itself or any directory on the way;
* nothing outside the directory is reached (no ``..``, no absolute path, no link);
* only regular files are opened as chunks, and opening never blocks (``O_NONBLOCK``: a named pipe
  opens at once instead of waiting for a writer, and is then refused as not regular).

A violation raises :class:`UnsafeEntry` (an ``OSError``) naming the offending path; the caller
decides what to do with it (the tier removes it with :func:`remove_entry` and counts it).

Where the kernel has ``openat2(2)`` (Linux ≥ 5.6) a path is resolved in one system call with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``; elsewhere (older kernels, seccomp filters that refuse
it, other platforms) each component is opened in turn with ``O_NOFOLLOW``, same guarantees, a
few more system calls. Paths use ``/`` and never contain ``.`` or ``..`` segments.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from kvtier.tiers.fs.modes import PRIVATE, Modes

__all__ = [
    "UnsafeEntry",
    "open_file",
    "try_opener",
    "raw_opener",
    "RawOpen",
    "open_dir",
    "open_or_make_dir",
    "lstat",
    "remove_entry",
    "has_openat2",
]

_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY: int = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)
_O_PATH: int = getattr(os, "O_PATH", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC

# Errors that mean "a component is not what the layout says" rather than a storage failure:
# a symbolic link (ELOOP), a non-directory on the way (ENOTDIR), an escape (EXDEV from
# RESOLVE_BENEATH), a socket (ENXIO), a directory where a file belongs (EISDIR).
_UNSAFE_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.ENXIO, errno.EISDIR})


class UnsafeEntry(OSError):
    """A symbolic link, special file or wrong kind of entry where the layout expects a chunk file
    or a directory. ``relpath`` is the path (relative to the base directory) that was asked for."""

    def __init__(self, relpath: str, what: str) -> None:
        super().__init__(errno.ELOOP, f"{what}: {relpath}")
        self.relpath = relpath


# --- openat2 ----------------------------------------------------------------------------------
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "riscv64": 437, "ppc64le": 437, "s390x": 437}
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_CACHED = 0x20  # Linux >= 5.12: EAGAIN rather than wait for the storage to resolve a path
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_Openat2 = tuple[Any, int]  # (libc.syscall, the syscall number)
_Opener = Callable[[int, str], int]
# "fn": the probe's result (an _Openat2, or None); (flags, mode, cached_only): that open, prepared.
# One dict, so that forgetting the probe (tests do, to switch resolution) forgets what was
# prepared with it.
_openat2_state: dict[Any, Any] = {}
_openat2_lock = threading.Lock()


def _openat2_fn() -> _Openat2 | None:
    """``libc.syscall`` bound for openat2, or None where it is not available (probed once)."""
    state = _openat2_state
    if "fn" in state:
        return state["fn"]
    with _openat2_lock:
        if "fn" in state:
            return state["fn"]
        fn: _Openat2 | None = None
        nr = _SYS_OPENAT2.get(os.uname().machine) if sys.platform == "linux" else None
        if nr is not None and os.environ.get("KVTIER_NO_OPENAT2") != "1":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                syscall = libc.syscall
                syscall.restype = ctypes.c_long
                probe_fd = os.open("/", _DIR_FLAGS & ~_O_NOFOLLOW)
                try:
                    how = _OpenHow(_DIR_FLAGS, 0, _RESOLVE)
                    fd = syscall(nr, probe_fd, b".", ctypes.byref(how), ctypes.sizeof(how))
                    if fd >= 0:
                        os.close(fd)
                        fn = (syscall, nr)
                finally:
                    os.close(probe_fd)
            except (OSError, AttributeError):
                fn = None
        state["fn"] = fn
        return fn


def has_openat2() -> bool:
    """Whether paths are resolved with one ``openat2`` call (else component by component)."""
    return _openat2_fn() is not None


# --- resolution -------------------------------------------------------------------------------
def _components(relpath: str) -> list[str]:
    """``relpath``'s names; an absolute path or a ``.``/``..``/empty segment is an escape."""
    parts = relpath.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafeEntry(relpath, "path leaves its directory")
    return parts


def _walk_open(dir_fd: int, relpath: str, flags: int, mode: int) -> int:
    """Component-by-component ``O_NOFOLLOW`` resolution (the fallback for openat2)."""
    parts = _components(relpath)
    fd = dir_fd
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = next_fd
        return os.open(parts[-1], flags, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def _open_beneath(dir_fd: int, relpath: str, flags: int, mode: int = 0o600) -> int:
    """Open ``relpath`` beneath ``dir_fd`` with ``flags`` (``O_NOFOLLOW | O_CLOEXEC`` added):
    :class:`UnsafeEntry` for a link, a non-directory on the way or an escape."""
    prepared = _openat2_state.get((flags, mode, False))
    if prepared is None:
        prepared = _prepare(flags, mode, False)
    return prepared(dir_fd, relpath)


def _prepare(flags: int, mode: int, cached_only: bool) -> _Opener:
    """The open of :func:`_open_beneath` for ``flags``/``mode``, built once and kept: the load
    path's hot spot (a large share of a page-cache chunk read) is then one ``openat2``
    through ctypes with everything bound, the path encoded directly (layout paths are ASCII).
    ``cached_only`` adds ``RESOLVE_CACHED`` (see :func:`open_file`)."""
    fn = _openat2_fn()
    all_flags = flags | _O_NOFOLLOW | _O_CLOEXEC

    def unsafe(relpath: str) -> UnsafeEntry:
        return UnsafeEntry(relpath, "symbolic link, special file or misplaced entry")

    if fn is None:
        def open_walking(dir_fd: int, relpath: str) -> int:
            if cached_only:
                raise OSError(errno.EOPNOTSUPP, "no openat2: cannot open from the caches only", relpath)
            try:
                return _walk_open(dir_fd, relpath, all_flags, mode)
            except OSError as exc:
                if exc.errno in _UNSAFE_ERRNOS:
                    raise unsafe(relpath) from None
                raise
        prepared: _Opener = open_walking
    else:
        syscall, nr = fn
        # openat2 refuses a mode without O_CREAT. ``how`` (a ctypes reference) keeps the structure alive.
        resolve = _RESOLVE | (_RESOLVE_CACHED if cached_only else 0)
        how = ctypes.byref(_OpenHow(all_flags, mode if flags & os.O_CREAT else 0, resolve))
        size = ctypes.sizeof(_OpenHow)

        def open_beneath(dir_fd: int, relpath: str) -> int:
            fd: int = syscall(nr, dir_fd, relpath.encode(), how, size)
            if fd >= 0:
                return fd
            err = ctypes.get_errno()
            if err in _UNSAFE_ERRNOS:
                raise unsafe(relpath)
            if cached_only and err == errno.EINVAL:  # a kernel older than RESOLVE_CACHED (5.12)
                err = errno.EOPNOTSUPP
            raise OSError(err, os.strerror(err), relpath)  # EAGAIN: a BlockingIOError
        prepared = open_beneath
    _openat2_state[(flags, mode, cached_only)] = prepared
    return prepared


def open_file(dir_fd: int, relpath: str, flags: int, mode: int = 0o600, *, regular_only: bool = True,
              cached_only: bool = False) -> int:
    """Open the regular file ``relpath`` beneath ``dir_fd``; return its descriptor.

    ``flags`` are ``os.open`` flags (``O_NOFOLLOW``, ``O_CLOEXEC`` and ``O_NONBLOCK`` are added);
    ``mode`` is the new file's with ``O_CREAT`` (less the umask, as ``open`` does).
    Raises :class:`UnsafeEntry` for a symbolic link at any level, a non-directory on the way or
    anything but a regular file at the end (checked with ``fstat`` after opening, which never
    blocks); ``FileNotFoundError`` and other ``OSError`` as ``open`` does.

    ``regular_only=False`` skips that ``fstat`` for a caller whose next step refuses anything
    else by itself: links and sockets are still refused by the open, and what is left opens
    without blocking and fails a positioned read (a pipe: ``ESPIPE``, a directory: ``EISDIR``) or
    yields bytes that cannot pass a trailer check (a device — which only root can create).

    ``cached_only`` opens only what the kernel can resolve from its caches (``RESOLVE_CACHED``):
    ``BlockingIOError`` when resolving would wait for the storage, ``OSError`` ``EOPNOTSUPP``
    where the kernel cannot promise that (no ``openat2``, or older than Linux 5.12).
    """
    flags |= _O_NONBLOCK
    key = (flags, mode, cached_only)
    prepared = _openat2_state.get(key)  # _open_beneath, one frame fewer on the load path
    fd = (prepared or _prepare(*key))(dir_fd, relpath)
    if not regular_only:
        return fd
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeEntry(relpath, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd  # O_NONBLOCK changes nothing for a regular file's reads and writes


class RawOpen(NamedTuple):
    """One ``openat2`` beneath a directory, prepared for a loop that opens many paths:
    ``call(nr, dir_fd, path, how, size)`` returns the descriptor, or a negative number wherever
    :func:`open_file` would raise. ``path`` must be ``bytes`` without a NUL byte, and nothing
    checks that here: ``ctypes`` would send a ``str`` as wide characters and the kernel would
    see a path cut at the NUL. :func:`try_opener` is the checked form."""

    call: Callable[..., int]
    nr: int
    how: Any
    size: int


def raw_opener(flags: int) -> RawOpen | None:
    """:func:`try_opener`'s system call without the function around it, or None where there is
    no ``openat2`` (the caller then opens with :func:`open_file`). Same flags, resolution and
    guarantees; ``O_CREAT`` is refused (``ValueError``).

    For a loader that makes its paths itself (hexadecimal names: bytes without a NUL by
    construction): at page-cache speeds even the few bytecodes of a wrapper per chunk are
    interpreter-lock time that its peer threads wait for."""
    if flags & os.O_CREAT:
        raise ValueError("raw_opener opens existing files: O_CREAT is open_file's")
    if ("raw", flags) in _openat2_state:
        return _openat2_state[("raw", flags)]  # type: ignore[no-any-return]
    fn = _openat2_fn()
    raw: RawOpen | None = None
    if fn is not None:
        syscall, nr = fn
        how = _OpenHow(flags | _O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC, 0, _RESOLVE)
        raw = RawOpen(syscall, nr, ctypes.byref(how), ctypes.sizeof(how))
    _openat2_state[("raw", flags)] = raw
    return raw


def try_opener(flags: int) -> Callable[[int, bytes], int]:
    """For a hot path: ``try_open(dir_fd, relpath)``, with ``relpath`` as bytes (the path
    :func:`open_file` takes, encoded), which opens like :func:`open_file` with ``flags`` and
    ``regular_only=False`` and returns the descriptor, or -1 wherever :func:`open_file` would
    raise (and always on a system without ``openat2``), without saying why: the caller then
    calls :func:`open_file` to learn it.

    Same flags, same resolution, same guarantees as :func:`open_file`; what it saves is the
    exception machinery and the frames around the one ``openat2`` call. A ``str`` path raises
    ``TypeError``, a NUL byte ``ValueError``; ``O_CREAT`` is refused (``ValueError``): this
    opens existing files only.
    """
    if flags & os.O_CREAT:
        raise ValueError("try_opener opens existing files: O_CREAT is open_file's")
    quick = _openat2_state.get(("try", flags))
    if quick is not None:
        return quick  # type: ignore[no-any-return]
    raw = raw_opener(flags)
    if raw is None:
        def unavailable(dir_fd: int, relpath: bytes) -> int:
            _check_path_bytes(relpath)
            return -1
        quick = unavailable
    else:
        syscall, nr, how, size = raw

        def try_open(dir_fd: int, relpath: bytes) -> int:
            if type(relpath) is not bytes or b"\0" in relpath:
                _check_path_bytes(relpath)
            fd: int = syscall(nr, dir_fd, relpath, how, size)
            return fd if fd >= 0 else -1
        quick = try_open
    _openat2_state[("try", flags)] = quick
    return quick


def _check_path_bytes(relpath: object) -> None:
    """What :func:`try_opener`'s opener refuses: a path that is not bytes (``ctypes`` would pass a
    ``str`` as wide characters) or holds a NUL byte (the system call would see a shorter path)."""
    if type(relpath) is not bytes:
        raise TypeError(f"try_open takes a bytes path, not {type(relpath).__name__}")
    if b"\0" in relpath:
        raise ValueError("embedded null byte in a path")


def open_dir(dir_fd: int, relpath: str, *, create: bool = False, modes: Modes = PRIVATE) -> int:
    """Open directory ``relpath`` beneath ``dir_fd`` (``""`` opens ``dir_fd`` itself again).

    With ``create``, missing directories on the way are made with ``modes.dir`` (owner-only by
    default; see :class:`~kvtier.tiers.fs.modes.Modes`; a concurrent creator is not an error).
    Raises :class:`UnsafeEntry` when a component is a symbolic link or not a directory
    (``relpath`` of the exception is then the whole path asked for).
    """
    if not relpath:
        return os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    if create:
        return open_or_make_dir(dir_fd, relpath, modes)[0]
    return _open_beneath(dir_fd, relpath, _DIR_FLAGS)


def open_or_make_dir(dir_fd: int, relpath: str, modes: Modes = PRIVATE) -> tuple[int, bool]:
    """:func:`open_dir` with ``create=True`` (``relpath`` not empty), and whether this call made
    the last directory of ``relpath`` (it was then empty a moment ago; another process may
    write into it since). Directories this call makes get exactly ``modes.dir``; existing ones
    are left as they are."""
    try:
        return _open_beneath(dir_fd, relpath, _DIR_FLAGS), False
    except FileNotFoundError:
        pass
    # Make the missing components one at a time, each beneath an already safe parent, and keep
    # the last one open: each was opened O_NOFOLLOW as a directory, so it is what a resolution
    # beneath dir_fd would give.
    fd = dir_fd
    made = False
    try:
        for part in _components(relpath):
            try:
                os.mkdir(part, modes.dir, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in _UNSAFE_ERRNOS:
                    raise UnsafeEntry(relpath, "symbolic link or non-directory on the way") from None
                raise
            if fd != dir_fd:
                os.close(fd)
            fd = next_fd
            if made:  # what was opened is the directory just made (a swap would be a link: refused)
                modes.settle_dir(fd)
    except BaseException:
        if fd != dir_fd:
            os.close(fd)
        raise
    return fd, made


def lstat(dir_fd: int, relpath: str) -> os.stat_result | None:
    """``lstat`` of ``relpath`` beneath ``dir_fd`` (the entry itself, never a link's target);
    ``None`` when it does not exist. Raises :class:`UnsafeEntry` for a symbolic link or
    non-directory *on the way* (the last component may be anything: check ``st_mode``)."""
    head, _, name = relpath.rpartition("/")
    try:
        parent = open_dir(dir_fd, head) if head else None
    except FileNotFoundError:
        return None
    try:
        return os.stat(name, dir_fd=dir_fd if parent is None else parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        if parent is not None:
            os.close(parent)


def remove_entry(dir_fd: int, relpath: str) -> bool:
    """Remove whatever is at ``relpath`` beneath ``dir_fd`` without following links: the deepest
    component that is a symbolic link or not a directory on the way is removed instead (that is
    what made the path unsafe); a directory at the end is removed only if empty.

    Returns True when something was removed, False when nothing was there. Never touches
    anything outside ``dir_fd``.
    """
    parts = _components(relpath)
    fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for i, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            last = i == len(parts) - 1
            if stat.S_ISDIR(st.st_mode) and not last:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
                continue
            try:
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(part, dir_fd=fd)
                else:
                    os.unlink(part, dir_fd=fd)
            except FileNotFoundError:
                return False
            return True
        return False
    finally:
        os.close(fd)

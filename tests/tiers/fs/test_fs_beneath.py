"""Specification of containment beneath a directory (kvtier/tiers/fs/beneath.py).

Every test runs twice: with ``openat2`` (where the kernel has it) and with the component-by-component
fallback, which must give the same guarantees.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiers.fs import beneath
from kvtier.tiers.fs.beneath import UnsafeEntry


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(beneath, "_openat2_state", {})
    if request.param == "walk":
        monkeypatch.setenv("KVTIER_NO_OPENAT2", "1")
    elif not beneath.has_openat2():
        pytest.skip("this kernel has no openat2; the walk variant covers it")
    return str(request.param)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    root = tmp_path / "base"
    (root / "abc" / "de_g0").mkdir(parents=True)
    (root / "abc" / "de_g0" / "real.bin").write_bytes(b"real")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(b"secret")
    (tmp_path / "outside" / "de_g0").mkdir()
    (tmp_path / "outside" / "de_g0" / "real.bin").write_bytes(b"outside copy")
    return root


@pytest.fixture
def base_fd(base: Path, resolution: str) -> Iterator[int]:
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def test_a_regular_file_beneath_opens(base_fd: int) -> None:
    assert _read(beneath.open_file(base_fd, "abc/de_g0/real.bin", os.O_RDONLY)) == b"real"


def test_a_linked_file_is_refused_not_followed(base: Path, base_fd: int) -> None:
    os.symlink(base.parent / "outside" / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    with pytest.raises(UnsafeEntry) as info:
        beneath.open_file(base_fd, "abc/de_g0/link.bin", os.O_RDONLY)
    assert info.value.relpath == "abc/de_g0/link.bin"


def test_a_linked_directory_on_the_way_is_refused(base: Path, base_fd: int) -> None:
    os.symlink(base.parent / "outside", base / "xyz")
    with pytest.raises(UnsafeEntry):
        beneath.open_file(base_fd, "xyz/de_g0/real.bin", os.O_RDONLY)
    with pytest.raises(UnsafeEntry):
        beneath.open_dir(base_fd, "xyz/de_g0", create=True)
    assert sorted(os.listdir(base.parent / "outside")) == ["de_g0", "secret.bin"]  # nothing made there


def test_a_named_pipe_is_refused_without_blocking(base: Path, base_fd: int) -> None:
    os.mkfifo(base / "abc" / "de_g0" / "pipe.bin")
    with pytest.raises(UnsafeEntry):  # a blocking open would hang this test (pytest-timeout)
        beneath.open_file(base_fd, "abc/de_g0/pipe.bin", os.O_RDONLY)


def test_a_socket_and_a_directory_are_not_files(base: Path, base_fd: int, tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(base / "abc" / "de_g0" / "sock.bin"))
        with pytest.raises(UnsafeEntry):
            beneath.open_file(base_fd, "abc/de_g0/sock.bin", os.O_RDONLY)
    finally:
        sock.close()
    with pytest.raises(UnsafeEntry):
        beneath.open_file(base_fd, "abc/de_g0", os.O_RDONLY)


def test_a_file_where_a_directory_belongs_is_refused(base: Path, base_fd: int) -> None:
    (base / "fff").write_bytes(b"not a dir")
    with pytest.raises(UnsafeEntry):
        beneath.open_file(base_fd, "fff/de_g0/x.bin", os.O_RDONLY)


def test_escapes_are_refused(base_fd: int) -> None:
    with pytest.raises((UnsafeEntry, FileNotFoundError)):
        beneath.open_file(base_fd, "../outside/secret.bin", os.O_RDONLY)


def test_open_dir_creates_missing_directories_beneath(base: Path, base_fd: int) -> None:
    fd = beneath.open_dir(base_fd, "new/sub", create=True)
    os.close(fd)
    assert (base / "new" / "sub").is_dir()
    with pytest.raises(FileNotFoundError):
        beneath.open_dir(base_fd, "absent/sub")


def test_lstat_reports_the_entry_itself(base: Path, base_fd: int) -> None:
    os.symlink(base.parent / "outside" / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    st = beneath.lstat(base_fd, "abc/de_g0/link.bin")
    assert st is not None and stat.S_ISLNK(st.st_mode)
    real = beneath.lstat(base_fd, "abc/de_g0/real.bin")
    assert real is not None and stat.S_ISREG(real.st_mode) and real.st_size == 4
    assert beneath.lstat(base_fd, "abc/de_g0/none.bin") is None
    assert beneath.lstat(base_fd, "nope/de_g0/none.bin") is None
    os.symlink(base.parent / "outside", base / "xyz")
    with pytest.raises(UnsafeEntry):
        beneath.lstat(base_fd, "xyz/de_g0/real.bin")


def test_remove_entry_removes_the_offending_link_never_its_target(base: Path, base_fd: int) -> None:
    outside = base.parent / "outside"
    os.symlink(outside, base / "xyz")
    assert beneath.remove_entry(base_fd, "xyz/de_g0/real.bin") is True
    assert not os.path.lexists(base / "xyz")
    assert (outside / "de_g0" / "real.bin").read_bytes() == b"outside copy"
    os.symlink(outside / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    assert beneath.remove_entry(base_fd, "abc/de_g0/link.bin") is True
    assert (outside / "secret.bin").read_bytes() == b"secret"
    assert beneath.remove_entry(base_fd, "abc/de_g0/real.bin") is True
    assert beneath.remove_entry(base_fd, "abc/de_g0/real.bin") is False


# --- inline opens (openat2 from the kernel's caches, the interpreter lock held) -------------------


@pytest.fixture
def inline_fd(base: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(beneath, "_openat2_state", {})
    if not beneath.has_openat2():
        pytest.skip("this kernel has no openat2: opens are never inline there (the walk variants cover it)")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_inline_opens_keep_every_guarantee(base: Path, inline_fd: int) -> None:
    os.symlink(base.parent / "outside" / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    os.symlink(base.parent / "outside", base / "xyz")
    os.mkfifo(base / "abc" / "de_g0" / "pipe.bin")
    assert _read(beneath.open_file(inline_fd, "abc/de_g0/real.bin", os.O_RDONLY, inline=True)) == b"real"
    assert _read(beneath.opener(os.O_RDONLY, inline=True)(inline_fd, "abc/de_g0/real.bin")) == b"real"
    for relpath in ("abc/de_g0/link.bin", "xyz/de_g0/real.bin", "abc/de_g0/pipe.bin", "abc/de_g0"):
        with pytest.raises(UnsafeEntry):
            beneath.open_file(inline_fd, relpath, os.O_RDONLY, inline=True)
    with pytest.raises(FileNotFoundError):
        beneath.open_file(inline_fd, "abc/de_g0/none.bin", os.O_RDONLY, inline=True)
    with pytest.raises((UnsafeEntry, FileNotFoundError)):
        beneath.open_file(inline_fd, "../outside/secret.bin", os.O_RDONLY, inline=True)
    fd, made = beneath.open_or_make_dir(inline_fd, "abc/de_g0", inline=True)
    os.close(fd)
    assert not made
    with pytest.raises(UnsafeEntry):
        beneath.open_or_make_dir(inline_fd, "xyz/de_g0", inline=True)


def _held_answering(err: int) -> tuple[list[int], object]:
    """A stand-in for the lock-holding syscall that fails with ``err``, counting its calls."""
    calls: list[int] = []

    def held(*args: object) -> int:
        calls.append(1)
        ctypes.set_errno(err)
        return -1
    return calls, held


@pytest.mark.parametrize("err", [errno.EAGAIN, errno.EXDEV], ids=["not-cached", "another-mount"])
def test_an_open_the_caches_cannot_answer_is_made_the_ordinary_way(base: Path, inline_fd: int, err: int) -> None:
    syscall, nr, _ = beneath._openat2_fn()  # type: ignore[misc]
    calls, held = _held_answering(err)
    beneath._openat2_state["fn"] = (syscall, nr, held)
    assert _read(beneath.open_file(inline_fd, "abc/de_g0/real.bin", os.O_RDONLY, inline=True)) == b"real"
    os.symlink(base.parent / "outside", base / "xyz")
    with pytest.raises(UnsafeEntry):  # the ordinary open still refuses the link
        beneath.open_file(inline_fd, "xyz/de_g0/real.bin", os.O_RDONLY, inline=True)
    assert len(calls) == 2


def test_a_kernel_without_cached_lookups_stops_trying_them(inline_fd: int) -> None:
    syscall, nr, _ = beneath._openat2_fn()  # type: ignore[misc]
    calls, held = _held_answering(errno.EINVAL)  # RESOLVE_CACHED unknown before Linux 5.12
    beneath._openat2_state["fn"] = (syscall, nr, held)
    for _ in range(3):
        assert _read(beneath.open_file(inline_fd, "abc/de_g0/real.bin", os.O_RDONLY, inline=True)) == b"real"
    assert len(calls) == 1


def test_inline_opens_only_on_local_filesystems(inline_fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    local = beneath.fs_magic(inline_fd)
    assert local is not None
    assert beneath.inline_opens_safe(inline_fd) is (local in beneath._LOCAL_FS_MAGIC)
    monkeypatch.setattr(beneath, "fs_magic", lambda fd: 0x65735546)  # FUSE: its open asks a daemon
    assert beneath.inline_opens_safe(inline_fd) is False
    monkeypatch.setattr(beneath, "fs_magic", lambda fd: 0x6969)  # NFS
    assert beneath.inline_opens_safe(inline_fd) is False

"""Specification of containment beneath a directory (kvtier/tiers/fs/beneath.py).

Every test runs twice: with ``openat2`` (where the kernel has it) and with the component-by-component
fallback, which must give the same guarantees.
"""

from __future__ import annotations

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


def test_the_hot_path_opener_opens_what_open_file_opens_and_nothing_else(base: Path, base_fd: int,
                                                                          resolution: str) -> None:
    # try_opener: a descriptor or -1, never an exception; without openat2 it always declines
    # (its caller then asks open_file, which resolves component by component).
    try_open = beneath.try_opener(os.O_RDONLY)
    with pytest.raises(TypeError):  # a str would reach the system call as wide characters
        try_open(base_fd, "abc/de_g0/real.bin")  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # the system call would see "abc/de_g0/real.bin"
        try_open(base_fd, b"abc/de_g0/real.bin\0/../x")
    fd = try_open(base_fd, b"abc/de_g0/real.bin")
    if resolution == "walk":
        assert fd == -1
        return
    assert _read(fd) == b"real"
    os.symlink(base.parent / "outside" / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    os.symlink(base.parent / "outside", base / "xyz")
    (base / "fff").write_bytes(b"not a dir")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(base / "abc" / "de_g0" / "sock.bin"))
        for relpath in (b"abc/de_g0/link.bin", b"xyz/de_g0/real.bin", b"fff/de_g0/x.bin", b"../outside/secret.bin",
                        b"/etc/hostname", b"abc/de_g0/none.bin", b"abc/de_g0/sock.bin"):
            assert try_open(base_fd, relpath) == -1, relpath
    finally:
        sock.close()


def test_the_raw_opener_resolves_as_the_hot_path_opener(base: Path, base_fd: int, resolution: str) -> None:
    # raw_opener: try_opener's system call, prepared; a descriptor or a negative number.
    raw = beneath.raw_opener(os.O_RDONLY)
    if resolution == "walk":
        assert raw is None  # its caller then opens each file with open_file
        return
    assert raw is not None

    def open_raw(relpath: bytes) -> int:
        return raw.call(raw.nr, base_fd, relpath, raw.how, raw.size)
    assert _read(open_raw(b"abc/de_g0/real.bin")) == b"real"
    os.symlink(base.parent / "outside" / "secret.bin", base / "abc" / "de_g0" / "link.bin")
    os.symlink(base.parent / "outside", base / "xyz")
    for relpath in (b"abc/de_g0/link.bin", b"xyz/de_g0/real.bin", b"../outside/secret.bin", b"/etc/hostname",
                    b"abc/de_g0/none.bin"):
        assert open_raw(relpath) < 0, relpath
    assert beneath.raw_opener(os.O_RDONLY) is raw  # prepared once per flags


def test_the_raw_opener_refuses_to_create() -> None:
    with pytest.raises(ValueError):
        beneath.raw_opener(os.O_RDONLY | os.O_CREAT)


def test_the_hot_path_opener_refuses_to_create() -> None:
    with pytest.raises(ValueError):
        beneath.try_opener(os.O_RDONLY | os.O_CREAT)


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

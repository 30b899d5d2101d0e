"""Private files: the fs tier's ``file_mode`` / ``dir_mode`` (kvtier/tiers/fs/modes.py and its use in
the tier). Everything the tier creates — chunk files and their temporaries, ``config.json``, the
directories it makes — gets exactly the configured mode whatever the umask, and another user id
cannot read what an owner-only tree holds (the tests run as root and fork a child that drops to
an unprivileged uid/gid)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fs_tiers import SLOT, bin_files, expected, load, make_tier, running, store

from kvtier.host.slots import SlotBuffer
from kvtier.tiers.fs.modes import Modes, current_umask

NOBODY = 65534
OTHER_GID = 65533
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


@pytest.fixture
def host() -> Iterator[SlotBuffer]:
    buf = SlotBuffer(16, SLOT, pin_memory=False)
    yield buf
    buf.close()


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user may traverse (pytest's own ``tmp_path`` is owner-only), so that
    what keeps another user out below it is the tier's modes."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-modes-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    """Set the process umask for a test; the previous one comes back afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def created_dirs(root: Path) -> list[Path]:
    """Every directory below ``root`` (the run directory, the rank tree, its shard directories)."""
    return sorted(p for p in root.rglob("*") if p.is_dir())


def as_user(action: Callable[[], Any], *, uid: int = NOBODY, gid: int = NOBODY) -> str:
    """Run ``action`` in a forked child that dropped to ``uid``/``gid`` (no other group):
    ``"ok"``, ``"denied"`` (a ``PermissionError``) or the other exception's repr."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                action()
                answer = b"ok"
            except PermissionError:
                answer = b"denied"
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = repr(exc).encode()
            os.write(write_end, answer)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    return text


def read_file(path: Path) -> Callable[[], Any]:
    return lambda: path.read_bytes()


def list_dir(path: Path) -> Callable[[], Any]:
    return lambda: os.listdir(path)


# --- modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_modes_are_computed_once_from_the_umask(umask: Callable[[int], int], mask: int) -> None:
    umask(mask)
    assert current_umask() == mask
    assert Modes.for_umask(0o600, 0o700) == Modes(0o600, 0o700, False, False)
    group = Modes.for_umask(0o660, 0o770)
    assert (group.fix_file, group.fix_dir) == (True, True)  # both umasks strip group write


@pytest.mark.anyio
@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
@pytest.mark.parametrize(("file_mode", "dir_mode"), [(0o600, 0o700), (0o640, 0o750), (0o660, 0o770)],
                         ids=["private", "group-read", "group-write"])
async def test_everything_the_tier_creates_gets_exactly_the_configured_modes(
    base: Path, host: SlotBuffer, umask: Callable[[int], int], monkeypatch: pytest.MonkeyPatch,
    mask: int, file_mode: int, dir_mode: int,
) -> None:
    umask(mask)
    temporaries: list[int] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        if str(src).endswith(".tmp"):  # a chunk file's temporary, just before it is published
            temporaries.append(stat.S_IMODE(os.stat(src, dir_fd=src_dir_fd).st_mode))
        real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "replace", replace)
    root = base / "cache"
    tier = make_tier(root, host, file_mode=file_mode, dir_mode=dir_mode)
    async with running(tier):
        assert (await store(tier, host, range(6))).success
    files = bin_files(root)
    assert len(files) == 6 and temporaries == [file_mode] * 6
    assert {mode(f) for f in files} == {file_mode}
    assert [mode(p) for p in root.glob("*/config.json")] == [file_mode]
    dirs = created_dirs(root)
    assert len(dirs) >= 2 + 2 * 6 - 1  # run dir, rank tree, and a top and a leaf per chunk (a few may share)
    assert {mode(d) for d in [root, *dirs]} == {dir_mode}


@pytest.mark.anyio
async def test_the_default_modes_cost_no_system_call_per_chunk(
    base: Path, host: SlotBuffer, umask: Callable[[int], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    umask(0o022)
    chmods: list[int] = []
    real_fchmod = os.fchmod
    def fchmod(fd: int, new_mode: int) -> None:
        chmods.append(new_mode)
        real_fchmod(fd, new_mode)

    monkeypatch.setattr(os, "fchmod", fchmod)
    tier = make_tier(base / "cache", host)
    async with running(tier):
        assert (await store(tier, host, range(8))).success
        assert (await load(tier, range(8))).success
    assert chmods == []


@pytest.mark.anyio
async def test_existing_directories_and_files_keep_their_modes(base: Path, host: SlotBuffer,
                                                               umask: Callable[[int], int]) -> None:
    umask(0o022)
    root = base / "cache"
    old = make_tier(root, host, file_mode=0o600, dir_mode=0o700)
    async with running(old):
        assert (await store(old, host, [1])).success
    old_dirs = [root, *created_dirs(root)]
    for path in old_dirs:  # what an older version made: world-readable
        path.chmod(0o755)
    for path in [*bin_files(root), *root.glob("*/config.json")]:
        path.chmod(0o644)
    tier = make_tier(root, host)
    async with running(tier):
        assert (await store(tier, host, [1, 2])).success  # chunk 1 is there already: kept
        assert (await load(tier, [1, 2])).success
    new = [f for f in bin_files(root) if mode(f) == 0o600]
    assert len(new) == 1 and {mode(f) for f in bin_files(root)} == {0o600, 0o644}
    assert [mode(p) for p in root.glob("*/config.json")] == [0o644]
    assert {mode(d) for d in old_dirs} == {0o755}  # the tree as it was
    new_dirs = set(created_dirs(root)) - set(old_dirs)  # chunk 2's shard directories
    assert new_dirs and {mode(d) for d in new_dirs} == {0o700}


# --- another user ------------------------------------------------------------------------------


@needs_root
@pytest.mark.anyio
@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
async def test_another_uid_can_neither_list_a_shard_directory_nor_read_a_chunk(
    base: Path, host: SlotBuffer, umask: Callable[[int], int], mask: int
) -> None:
    umask(mask)
    root = base / "cache"
    tier = make_tier(root, host)
    async with running(tier):
        assert (await store(tier, host, [3])).success
    (chunk,) = bin_files(root)
    leaf = chunk.parent
    (config,) = root.glob("*/config.json")
    assert as_user(list_dir(root)) == "denied"  # root_dir was created by the tier
    assert as_user(list_dir(leaf)) == "denied"
    # Even where every directory on the way lets it through, the files keep it out.
    for directory in [root, *created_dirs(root)]:
        directory.chmod(0o755)
    assert as_user(list_dir(leaf)) == "ok"
    assert as_user(read_file(chunk)) == "denied"
    assert as_user(read_file(config)) == "denied"
    assert chunk.read_bytes()[:SLOT] == expected(3)  # the owner still can


@needs_root
@pytest.mark.anyio
@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
async def test_a_group_mode_lets_the_group_read_through_a_set_group_id_root(
    base: Path, host: SlotBuffer, umask: Callable[[int], int], mask: int
) -> None:
    umask(mask)
    root = base / "cache"
    root.mkdir()
    os.chown(root, 0, NOBODY)
    root.chmod(0o2750)  # the operator's shared root: its group is handed to everything below
    tier = make_tier(root, host, file_mode=0o640, dir_mode=0o750)
    async with running(tier):
        assert (await store(tier, host, [4])).success
    (chunk,) = bin_files(root)
    (config,) = root.glob("*/config.json")
    for directory in created_dirs(root):
        st = directory.stat()
        assert st.st_gid == NOBODY and st.st_mode & stat.S_ISGID and stat.S_IMODE(st.st_mode) & 0o777 == 0o750
    assert mode(chunk) == 0o640 and chunk.stat().st_gid == NOBODY
    assert as_user(list_dir(chunk.parent)) == "ok"
    assert as_user(read_file(chunk)) == "ok"
    assert as_user(read_file(config)) == "ok"
    # A user outside the group is still kept out.
    assert as_user(list_dir(chunk.parent), gid=OTHER_GID) == "denied"

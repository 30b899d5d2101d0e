"""Listing a block tree (kvtier.tiers.fs.scan): what the fs tier's scans and the operator commands
share. Trees are built by hand here; tests/tiers/fs/test_fs_tier.py and tests/tiers/fs/test_fs_scale.py cover the
tier's use of it."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.layout import Namespace
from kvtier.tiers.fs import scan
from kvtier.tiers.fs.scan import (
    LeafMtimes,
    PassPlan,
    ScanBatch,
    ScanStopped,
    list_root,
    walk_tops,
    walk_tree,
)
from kvtier.tiers.fs.tree import PROBE_PREFIX, chunk_key, key_from_relpath


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def merged(batches: Iterable[ScanBatch], mtimes: LeafMtimes | None = None) -> ScanBatch:
    """Batches merged into one; each committed to ``mtimes`` (as the tier does once applied)."""
    total = ScanBatch()
    for batch in batches:
        if mtimes is not None:
            mtimes.commit(batch)
        total.leaves += batch.leaves
        total.tops += batch.tops
        for name in ("removed_tmp", "kept_tmp", "removed_unsafe", "leaves_checked", "leaves_listed", "files",
                     "unreadable"):
            setattr(total, name, getattr(total, name) + getattr(batch, name))
    return total


def walk(tree: int, mtimes: LeafMtimes | None = None, *, grace: float | None = None,
         budget: int = 1 << 20) -> ScanBatch:
    """One whole pass, its batches merged; each batch committed as the tier does once applied."""
    mtimes = mtimes if mtimes is not None else LeafMtimes()
    return merged(walk_tree(tree, mtimes, tmp_grace_s=grace, budget=budget), mtimes)


def chunk(root: Path, h: str, group: int = 0, data: bytes = b"x", age: float = 0.0) -> Path:
    d = root / h[:3] / f"{h[3:5]}_g{group}"
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{h}.bin"
    f.write_bytes(data)
    if age:
        t = time.time() - age
        os.utime(f, (t, t))
    return f


def hexes(batch: ScanBatch) -> list[str]:
    return sorted(chunk[0][:-4].hex() for leaf in batch.leaves for chunk in leaf.chunks)


def test_a_pass_lists_layout_chunks_and_removes_only_stale_temporaries(tmp_path: Path, tree: int) -> None:
    h = "abcdef0123"
    chunk(tmp_path, h, group=2, data=b"x" * 10)
    d = tmp_path / "abc" / "de_g2"
    stale, fresh = d / f"{h}.bin_123.tmp", d / f"{h}.bin_456.tmp"
    stale_probe = tmp_path / f"{PROBE_PREFIX}_77"
    for f in (stale, fresh, stale_probe):
        f.write_bytes(b"t")
    old = time.time() - 1000
    os.utime(stale, (old, old))
    os.utime(stale_probe, (old, old))
    (d / "notes.txt").write_text("not ours")
    (d / "ABCDEF0123.bin").write_bytes(b"upper-case is not a chunk name")
    (tmp_path / "zzz").mkdir()
    result = walk(tree, grace=100.0)
    [leaf] = result.leaves
    assert (leaf.group, leaf.leaf) == (2, 0xABCDE)
    assert leaf.chunks[0][:2] == (bytes.fromhex(h) + (2).to_bytes(4, "big"), 10)
    assert (result.removed_tmp, result.kept_tmp) == (2, 1)
    assert not stale.exists() and not stale_probe.exists()
    assert fresh.exists() and (d / "notes.txt").exists()
    assert len(result.tops) == 4096  # every possible top directory is reported, present or not
    assert [t.present for t in result.tops if t.top == 0xABC] == [frozenset({2 << 20 | 0xABCDE})]


def test_a_pass_over_an_empty_tree_reports_every_top_directory_gone(tree: int) -> None:
    result = walk(tree, grace=0)
    assert result.leaves == [] and result.removed_tmp == 0
    assert all(t.present is None for t in result.tops) and len(result.tops) == 4096


def test_batches_are_bounded_by_their_budget(tmp_path: Path, tree: int) -> None:
    for i in range(40):
        chunk(tmp_path, f"{i:03x}aa")
    batches = list(walk_tree(tree, LeafMtimes(), tmp_grace_s=None, budget=4))
    listed = [len(b.leaves) for b in batches]
    assert sum(listed) == 40 and max(listed) <= 2  # a top directory (2 entries here) is never split
    assert sum(b.end for b in batches) == 1 + 5  # the root's batch, then 5 requests of 8 tops


def test_a_second_pass_lists_only_leaves_whose_mtime_changed(tmp_path: Path, tree: int) -> None:
    for h in ("aaa111", "bbb222", "ccc333"):
        chunk(tmp_path, h)
    # Make the directories' mtimes old enough to be trusted (not "racy").
    old = time.time() - 60
    for d in tmp_path.glob("*/*_g0"):
        os.utime(d, (old, old))
    mtimes = LeafMtimes()
    assert walk(tree, mtimes).leaves_listed == 3
    again = walk(tree, mtimes)
    assert (again.leaves_checked, again.leaves_listed) == (3, 0)
    chunk(tmp_path, "bbb22f")  # same leaf as bbb222: its mtime moves
    (tmp_path / "ccc" / "33_g0" / "ccc333.bin").unlink()
    changed = walk(tree, mtimes)
    assert sorted((leaf.leaf, len(leaf.chunks)) for leaf in changed.leaves) == [(0xBBB22, 2), (0xCCC33, 0)]


def test_a_leaf_changed_within_the_timestamp_tick_is_listed_again_next_pass(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")  # its directory's mtime is now: too recent to trust
    mtimes = LeafMtimes()
    assert walk(tree, mtimes).leaves_listed == 1
    assert walk(tree, mtimes).leaves_listed == 1


def test_an_invalidated_leaf_is_listed_again(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")
    old = time.time() - 60
    os.utime(tmp_path / "aaa" / "11_g0", (old, old))
    mtimes = LeafMtimes()
    walk(tree, mtimes)
    assert walk(tree, mtimes).leaves_listed == 0
    mtimes.invalidate(0, 0xAAA11)  # e.g. a failed eviction: the file may still be there
    assert walk(tree, mtimes).leaves_listed == 1
    assert walk(tree, mtimes).leaves_listed == 0


def test_a_removed_leaf_or_top_directory_is_reported(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")
    chunk(tmp_path, "aaa222")
    chunk(tmp_path, "bbb111")
    (tmp_path / "aaa" / "22_g0" / "aaa222.bin").unlink()
    (tmp_path / "aaa" / "22_g0").rmdir()
    for f in (tmp_path / "bbb").rglob("*.bin"):
        f.unlink()
    (tmp_path / "bbb" / "11_g0").rmdir()
    (tmp_path / "bbb").rmdir()
    tops = {t.top: t.present for t in walk(tree).tops}
    assert tops[0xAAA] == frozenset({0xAAA11})
    assert tops[0xBBB] is None


def test_passes_listing_the_same_tree_at_once_each_see_every_chunk(tmp_path: Path, tree: int) -> None:
    for h in ("aaa111", "bbb222", "ccc333"):
        chunk(tmp_path, h)
    # Another listing of the tree's descriptor is under way: its directory stream position is
    # shared by every dup of the descriptor, so the walker lists the root through its own.
    with os.scandir(tree) as other:
        next(other)
        assert hexes(walk(tree)) == ["aaa111", "bbb222", "ccc333"]


def test_links_and_pipes_under_layout_names_are_removed_without_being_followed(tmp_path: Path, tree: int) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    (outside / "de_g0").mkdir(parents=True)
    (outside / "de_g0" / "abcdef.bin").write_bytes(b"outside")
    os.symlink(outside, tmp_path / "abc")  # a top directory that is a link
    d = tmp_path / "bbb" / "22_g0"
    d.mkdir(parents=True)
    os.symlink(outside / "de_g0", tmp_path / "bbb" / "33_g0")  # a leaf directory that is a link
    os.symlink(outside / "de_g0" / "abcdef.bin", d / "bbb222.bin")  # a chunk that is a link
    os.mkfifo(d / "bbb223.bin")  # a chunk that is a pipe
    (d / "bbb224.bin").write_bytes(b"real")
    result = walk(tree)
    assert hexes(result) == ["bbb224"]
    assert result.removed_unsafe == 4
    assert not os.path.lexists(tmp_path / "abc") and not os.path.lexists(d / "bbb222.bin")
    assert not os.path.lexists(d / "bbb223.bin") and not os.path.lexists(tmp_path / "bbb" / "33_g0")
    assert (outside / "de_g0" / "abcdef.bin").read_bytes() == b"outside"  # the target is untouched


def test_a_set_stop_event_ends_the_walk_at_the_next_directory(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")
    chunk(tmp_path, "bbb111")
    stop = threading.Event()
    plan = PassPlan(list_root(tree, None), LeafMtimes(), tmp_grace_s=None, tops_per_request=8, budget=1)
    walking = walk_tops(tree, plan.request(0), stop=stop)
    assert [leaf.leaf for leaf in next(walking).leaves] == [0xAAA11]
    stop.set()
    with pytest.raises(ScanStopped):
        next(walking)


@given(st.binary(min_size=3, max_size=40), st.integers(0, 2**32 - 1))
def test_chunk_key_agrees_with_the_layout(block_hash: bytes, group: int) -> None:
    key = block_hash + group.to_bytes(4, "big")
    relpath = Namespace.chunk_relpath(key)
    top, leaf_dir, name = relpath.split("/")
    expected = key if len(key) <= 36 else None  # longer keys are not the index's to hold
    assert chunk_key(name, top, leaf_dir[:2], group) == expected
    assert key_from_relpath(relpath) == key


@pytest.mark.parametrize("name", ["abcdef.bin", "abcde.bin", "ABCDEF.bin", "abcdef.bin.tmp", "abd123.bin",
                                  "abcdef0.bin", " abcdef.bin", "abcdef.BIN"])
def test_chunk_key_refuses_what_the_layout_would(name: str) -> None:
    relpath = f"abc/de_g0/{name}"
    assert (chunk_key(name, "abc", "de", 0) is None) == (key_from_relpath(relpath) is None)


def old_dirs(root: Path) -> None:
    """Directory mtimes old enough to be trusted (not "racy")."""
    old = time.time() - 60
    for d in [*root.glob("*"), *root.glob("*/*_g*")]:
        os.utime(d, (old, old))


def test_a_batch_lost_on_the_way_is_listed_again(tmp_path: Path, tree: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises (or a batch its caller never applied) records nothing: the next pass
    lists those directories again instead of skipping them as seen."""
    for h in ("aaa111", "bbb222"):
        chunk(tmp_path, h)
    old_dirs(tmp_path)
    mtimes = LeafMtimes()
    real = scan.list_leaf

    def failing(leaf_fd: int, top: str, leaf_hex: str, group: int) -> scan.Leaf:
        if top == "bbb":
            raise OSError(errno.EIO, "I/O error")
        return real(leaf_fd, top, leaf_hex, group)

    monkeypatch.setattr(scan, "list_leaf", failing)
    with pytest.raises(OSError):
        list(walk_tree(tree, mtimes, tmp_grace_s=None))  # aaa11 was listed, then lost
    monkeypatch.setattr(scan, "list_leaf", real)
    uncommitted = merged(walk_tree(tree, mtimes, tmp_grace_s=None))  # its caller was cancelled before applying it
    assert hexes(uncommitted) == ["aaa111", "bbb222"]
    assert 0xAAA in {t.top for t in uncommitted.tops if t.present is not None}
    again = walk(tree, mtimes)
    assert hexes(again) == ["aaa111", "bbb222"]
    assert {t.top for t in again.tops if t.present is not None} == {0xAAA, 0xBBB}
    after = walk(tree, mtimes)  # committed now: nothing changed, nothing listed or reported
    assert after.leaves_listed == 0 and all(t.present is None for t in after.tops)


def test_an_invalidation_made_after_a_listing_began_outlives_its_commit(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")
    old_dirs(tmp_path)
    mtimes = LeafMtimes()
    walk(tree, mtimes)
    mtimes.invalidate(0, 0xAAA11)
    early = list(walk_tree(tree, mtimes, tmp_grace_s=None))  # lists it, then a second failure invalidates it again
    assert merged(early).leaves_listed == 1
    mtimes.invalidate(0, 0xAAA11)
    merged(early, mtimes)  # committed after the second invalidation
    assert walk(tree, mtimes).leaves_listed == 1  # the later invalidation still counts
    assert walk(tree, mtimes).leaves_listed == 0


def test_a_leaf_whose_mtime_is_the_epoch_is_listed(tmp_path: Path, tree: int) -> None:
    """0 means "never recorded": a directory whose mtime is 0 (restored archives) is still listed."""
    chunk(tmp_path, "aaa111")
    os.utime(tmp_path / "aaa" / "11_g0", (0, 0))
    os.utime(tmp_path / "aaa", (0, 0))
    mtimes = LeafMtimes()
    first = walk(tree, mtimes)
    assert hexes(first) == ["aaa111"] and [t.top for t in first.tops if t.present] == [0xAAA]
    assert hexes(walk(tree, mtimes)) == ["aaa111"]  # never trusted as unchanged


def test_a_directory_under_a_chunk_name_is_not_counted_as_removed(tmp_path: Path, tree: int) -> None:
    chunk(tmp_path, "aaa111")
    (tmp_path / "aaa" / "11_g0" / "aaa112.bin").mkdir()  # not followed, not removable by unlink
    result = walk(tree)
    assert hexes(result) == ["aaa111"] and result.removed_unsafe == 0
    assert (tmp_path / "aaa" / "11_g0" / "aaa112.bin").is_dir()


def deny(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Opening a directory of one of ``names`` fails with EACCES (as for another user's 0700
    directory; tests run as root, which permissions do not stop)."""
    real = scan.open_dir

    def open_dir(parent_fd: int, name: str) -> int | None:
        if name in names:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real(parent_fd, name)

    monkeypatch.setattr(scan, "open_dir", open_dir)


def test_an_unreadable_directory_is_counted_and_skipped_not_fatal(tmp_path: Path, tree: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for h in ("aaa111", "aaa222", "bbb333", "ccc444"):
        chunk(tmp_path, h)
    old = time.time() - 60  # mtimes old enough to be trusted (not "racy")
    for d in [*tmp_path.glob("*/*_g0"), *tmp_path.glob("???")]:
        os.utime(d, (old, old))
    mtimes = LeafMtimes()
    deny(monkeypatch, "22_g0", "bbb")  # a leaf directory of top aaa, and the whole top bbb
    result = walk(tree, mtimes)
    assert hexes(result) == ["aaa111", "ccc444"] and result.unreadable == 2
    # The unreadable leaf is still present in its top directory (its chunks are not dropped), and
    # the unreadable top directory is not reported at all (neither gone nor listed).
    [aaa] = [t for t in result.tops if t.top == 0xAAA]
    assert aaa.present == frozenset({0xAAA11, 0xAAA22})
    assert 0xBBB not in {t.top for t in result.tops}
    # Nothing of theirs was recorded: once readable, the next pass lists them.
    monkeypatch.undo()
    again = walk(tree, mtimes)
    assert hexes(again) == ["aaa222", "bbb333"] and again.unreadable == 0


def test_a_reporting_walk_fails_on_an_unreadable_directory(tmp_path: Path, tree: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    chunk(tmp_path, "aaa111")
    deny(monkeypatch, "11_g0")
    plan = PassPlan(list_root(tree, None), LeafMtimes(), tmp_grace_s=None, tops_per_request=8, budget=64, report=True)
    with pytest.raises(PermissionError):
        list(walk_tops(tree, plan.request(0)))

"""The operator commands' listing in scan worker processes (a big tree's path): the same report as
the in-process listing, on a tree holding every kind of entry, and nothing changed or followed."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fs_tiers import SLOT, key_of  # noqa: E402
from test_ops import build, chunk  # noqa: E402

from kvtier.layout import Namespace  # noqa: E402
from kvtier.ops import runs  # noqa: E402
from kvtier.ops.gc import run_gc_cli  # noqa: E402
from kvtier.ops.inspect import run_inspect_cli  # noqa: E402
from kvtier.tiers.fs.tree import PROBE_PREFIX, TOP_DIR  # noqa: E402

N = 24


def hostile_tree(root: Path, outside: Path) -> Path:
    """A tree of N chunks plus one entry of every kind the listing must classify."""
    tree = build(root, list(range(N)))
    outside.mkdir()
    (outside / "secret").write_bytes(b"x" * 100)
    leaf = chunk(tree, 0).parent
    top = leaf.parent
    old = time.time() - 7200
    (tree / "README").write_text("not of the layout")  # stray at the tree's root
    (tree / f"{PROBE_PREFIX}_12").write_bytes(b"")  # a probe file at the root: tmp
    (top / "notes.txt").write_text("stray in a top directory")
    (leaf / "stray.bin").write_bytes(b"s")
    tmp = leaf / (chunk(tree, 1).name + "_77.tmp")
    tmp.write_bytes(b"t" * 10)
    os.utime(tmp, (old, old))
    (leaf / os.fsdecode(b"\xff\xfebad-name")).write_bytes(b"b")  # not UTF-8: still reported
    # Unsafe: links and special files under chunk and shard names (none of them followed).
    fake = Namespace.chunk_relpath(key_of(1000))
    (tree / fake).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside / "secret", tree / fake)
    fifo = Namespace.chunk_relpath(key_of(1001))
    (tree / fifo).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(tree / fifo)
    dir_chunk = Namespace.chunk_relpath(key_of(1002))
    (tree / dir_chunk).mkdir(parents=True)
    os.symlink(outside, top / "ff_g0")  # a link under a leaf directory's name
    (tree / "fff").write_bytes(b"a file under a top directory's name")
    os.symlink(outside, tree / "ffe")  # a link under a top directory's name
    # A trailer-less (vLLM format) chunk file: exactly slot_bytes.
    (tree / Namespace.chunk_relpath(key_of(1003))).parent.mkdir(parents=True, exist_ok=True)
    (tree / Namespace.chunk_relpath(key_of(1003))).write_bytes(bytes(SLOT))
    return tree


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``root`` with its mode, size and link target (nothing followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_size, os.readlink(path) if os.path.islink(path) else "")
    return out


def listing(root: Path, tree: Path, *, in_workers: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[runs.TreeListing, int]:
    monkeypatch.setattr(runs, "IN_PROCESS_TOPS", -1 if in_workers else 1 << 20)
    shards = [0]

    def tick() -> None:
        shards[0] += 1

    fd = runs.open_root(str(root))
    try:
        return runs.list_tree(fd, tree.name, workers=2, on_shard=tick), shards[0]
    finally:
        os.close(fd)


def by_path(entries: list[runs.FileEntry]) -> list[runs.FileEntry]:
    return sorted(entries, key=lambda e: e.relpath)


def test_workers_list_what_the_process_lists_and_change_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    tree = hostile_tree(root, tmp_path / "outside")
    before = snapshot(tmp_path)
    here, here_shards = listing(root, tree, in_workers=False, monkeypatch=monkeypatch)
    there, there_shards = listing(root, tree, in_workers=True, monkeypatch=monkeypatch)
    assert snapshot(tmp_path) == before  # nothing removed, nothing followed
    assert (tmp_path / "outside" / "secret").read_bytes() == b"x" * 100

    assert there.chunks == here.chunks  # oldest first, the same order
    for kind in ("unsafe", "tmp", "stray"):
        assert by_path(getattr(there, kind)) == by_path(getattr(here, kind)), kind
    assert there_shards == here_shards == len([p for p in tree.iterdir() if TOP_DIR.fullmatch(p.name)])

    assert len(here.chunks) == N + 1  # the vLLM-format file is a chunk file
    unsafe = {e.relpath for e in here.unsafe}
    assert unsafe == {Namespace.chunk_relpath(key_of(1000)), Namespace.chunk_relpath(key_of(1001)),
                      Namespace.chunk_relpath(key_of(1002)), f"{chunk(tree, 0).parent.parent.name}/ff_g0",
                      "fff", "ffe"}
    leaf = chunk(tree, 0).parent.relative_to(tree)
    assert {e.relpath for e in here.tmp} == {f"{PROBE_PREFIX}_12", f"{leaf}/{chunk(tree, 1).name}_77.tmp"}
    assert {e.relpath for e in here.stray} == {"README", f"{leaf.parent}/notes.txt", f"{leaf}/stray.bin",
                                               f"{leaf}/" + os.fsdecode(b"\xff\xfebad-name")}


def cli_json(fn: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    status = fn([*argv, "--json"], out=out)
    return status, json.loads(out.getvalue())


def test_inspect_and_gc_report_the_same_from_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    hostile_tree(root, tmp_path / "outside")
    reports = []
    for in_workers in (False, True):
        monkeypatch.setattr(runs, "IN_PROCESS_TOPS", -1 if in_workers else 1 << 20)
        inspected = cli_json(run_inspect_cli, str(root), "--scan-workers", "2")
        collected = cli_json(run_gc_cli, str(root), "--max-bytes", str(10 * SLOT), "--dry-run")
        reports.append((inspected, collected))
    assert reports[0] == reports[1]
    (status, inspected), (gc_status, collected) = reports[1]
    assert status == 1  # stray and unsafe entries
    (tree,) = inspected["runs"][0]["trees"]
    assert tree["chunk_files"] == N + 1 and tree["tmp_files"] == 2 and len(tree["unsafe_entries"]) == 6
    assert gc_status == 0 and collected["files_before"] == N + 1 and collected["bytes_after"] <= 10 * SLOT


def test_a_worker_that_dies_fails_the_listing_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    tree = build(root, list(range(4)))
    monkeypatch.setattr(runs, "IN_PROCESS_TOPS", -1)
    from kvtier.tiers.fs import scan_workers

    monkeypatch.setattr(scan_workers, "_BOOT", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)")
    fd = runs.open_root(str(root))
    try:
        with pytest.raises(OSError, match=r"exited \(status 3\): boom"):
            runs.list_tree(fd, tree.name, workers=1)
    finally:
        os.close(fd)
    status = run_inspect_cli([str(root)], out=io.StringIO())
    assert status == 1  # an OSError while working: one line on stderr, no traceback
    err = capsys.readouterr().err
    assert "kvtier inspect: error: scan worker" in err and "Traceback" not in err


def test_scan_workers_must_be_a_positive_count(tmp_path: Path) -> None:
    build(tmp_path, [0])
    assert run_inspect_cli([str(tmp_path), "--scan-workers", "0"], out=io.StringIO()) == 2

"""``kvtier inspect`` showing each run's compatibility manifest, and ``kvtier gc --run`` removing
exactly one whole run, on trees written by the fs tier itself."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import anyio
import pytest
from fs_tiers import GEOMETRY, SLOT, running, store
from test_ops import cli, cli_json  # noqa: E402

from kvtier.config import TierConfig
from kvtier.host.slots import SlotBuffer
from kvtier.layout import KVGeometry, Namespace, namespace
from kvtier.ops.gc import gc_run, run_gc_cli
from kvtier.ops.inspect import run_inspect_cli
from kvtier.ops.runs import open_root
from kvtier.ops.verify import run_verify_cli
from kvtier.tiers.base import TierContext
from kvtier.tiers.fs.tier import FileSystemTier


def build(root: Path, ids: list[int], *, revision: str | None = None, tag: str | None = None, rank: int = 0,
          agnostic: bool = True) -> Namespace:
    """Store chunks ``ids`` with the fs tier under ``root`` in the run of this manifest."""
    geometry: KVGeometry = dataclasses.replace(GEOMETRY, model_revision=revision)
    fields = geometry.run_fields(1, parallel_agnostic=agnostic, namespace_tag=tag)

    async def main() -> None:
        host = SlotBuffer(len(ids), SLOT, pin_memory=False)
        try:
            config = TierConfig(index=0, type="fs", options={"root_dir": str(root), "n_read_threads": 1,
                                                             "n_write_threads": 1})
            context = TierContext(index=0, label="1:fs", slot_bytes=SLOT, host=host, geometry=geometry,
                                  blocks_per_chunk=1, run_fields=fields, rank=rank)
            async with running(FileSystemTier(config, context)) as tier:
                await store(tier, host, ids)
        finally:
            host.close()

    anyio.run(main)
    return namespace(str(root), fields, rank)


def files_under(path: Path) -> int:
    return sum(len(files) + len(dirs) for _, dirs, files in os.walk(path))


# --- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_each_runs_manifest(tmp_path: Path) -> None:
    plain = build(tmp_path, [0, 1])
    revised = build(tmp_path, [0, 1, 2], revision="3f2a9c1e", tag="blue")
    status, report = cli_json(run_inspect_cli, str(tmp_path))
    assert status == 0
    manifests = {run["name"]: run["manifest"] for run in report["runs"]}
    assert manifests[plain.leaf] == {"model": "org/tiny-model", "model_revision": None, "namespace_tag": None,
                                     "vllm_compatible": True}
    assert manifests[revised.leaf] == {"model": "org/tiny-model", "model_revision": "3f2a9c1e",
                                       "namespace_tag": "blue", "vllm_compatible": False}
    status, text = cli(run_inspect_cli, str(tmp_path))
    assert status == 0
    assert "manifest none (vLLM-compatible namespace)" in text
    assert "manifest model org/tiny-model  model_revision 3f2a9c1e  namespace_tag blue" in text
    status, report = cli_json(run_verify_cli, str(tmp_path))  # the trailers name the run with its manifest
    assert status == 0 and report["ok"] == 5


def test_inspect_escapes_a_hostile_revision(tmp_path: Path) -> None:
    run = build(tmp_path, [0])
    # A run whose config.json someone else wrote: a revision holding a terminal escape (kvtier
    # itself refuses one), in a directory named for the digest of those fields.
    path = Path(run.base_dir) / "config.json"
    fields = json.loads(path.read_text())
    fields["model_revision"] = "evil\x1b[31m"
    bad = namespace(str(tmp_path), fields, 0)
    Path(bad.base_dir).mkdir()
    (Path(bad.base_dir) / "config.json").write_text(json.dumps(fields))
    status, text = cli(run_inspect_cli, str(tmp_path))
    assert status == 0 and "\x1b" not in text and "model_revision evil\\x1b[31m" in text


# --- gc --run ------------------------------------------------------------------------------------


def test_gc_run_removes_exactly_that_run(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"s" * 100)
    keep = build(root, [0, 1, 2])
    old_r0 = build(root, [0, 1, 2, 3], revision="old", agnostic=False, rank=0)
    old_r1 = build(root, [0, 1], revision="old", agnostic=False, rank=1)
    other_rev = build(root, [4], revision="new")
    tree = Path(old_r0.blocks_dir)
    (tree / "notes.txt").write_text("stray")
    (tree / "abc" / "de_g0").mkdir(parents=True, exist_ok=True)
    (tree / "abc" / "de_g0" / "link.bin").symlink_to(outside / "secret.bin")
    (tree / "to-outside").symlink_to(outside, target_is_directory=True)
    orphan = Path(f"{old_r0.base_dir}_r7")  # a tree this run's fields never produce: still this run's
    orphan.mkdir()
    (orphan / "x").write_text("x")
    (root / "unrelated.txt").write_text("not a run")
    keep_files = files_under(Path(keep.blocks_dir)) + files_under(Path(keep.base_dir))
    before = sorted(p.name for p in root.iterdir())

    status, report = cli_json(run_gc_cli, str(root), "--run", old_r0.digest, "--dry-run")
    assert status == 0 and report["dry_run"] and report["run"] == old_r0.leaf
    assert report["manifest"]["model_revision"] == "old"
    assert [d["path"] for d in report["directories"]] == [old_r0.blocks_leaf, old_r1.blocks_leaf,
                                                        orphan.name, old_r0.leaf]
    assert [d["files"] for d in report["directories"]][:2] == [4 + 3, 2]  # chunks, notes.txt and two links
    assert not any(d["removed"] for d in report["directories"])
    assert sorted(p.name for p in root.iterdir()) == before  # a dry run removes nothing

    status, text = cli(run_gc_cli, str(root), "--run", old_r0.leaf)
    assert status == 0
    assert text.index(f"to be removed {old_r0.blocks_leaf}/") < text.index(f"to be removed {old_r0.leaf}/")
    assert f"run {old_r0.leaf}: removed " in text
    after = sorted(p.name for p in root.iterdir())
    assert after == sorted(set(before) - {old_r0.blocks_leaf, old_r1.blocks_leaf, orphan.name, old_r0.leaf})
    assert {keep.leaf, keep.blocks_leaf, other_rev.leaf, other_rev.blocks_leaf, "unrelated.txt"} <= set(after)
    assert files_under(Path(keep.blocks_dir)) + files_under(Path(keep.base_dir)) == keep_files
    assert (outside / "secret.bin").read_bytes() == b"s" * 100 and outside.is_dir()  # no link followed

    status, report = cli_json(run_inspect_cli, str(root))
    assert status == 0 and sorted(r["name"] for r in report["runs"]) == sorted([keep.leaf, other_rev.leaf])


def test_gc_run_json_records_the_outcome_and_lists_to_stderr(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = build(tmp_path, [0, 1, 2], tag="green")
    status, report = cli_json(run_gc_cli, str(tmp_path), "--run", run.digest)
    assert status == 0 and report["failed"] == [] and report["files"] == 3 + 1  # the chunks and config.json
    assert [d["removed"] for d in report["directories"]] == [True, True]
    assert report["manifest"] == {"model": "org/tiny-model", "model_revision": None, "namespace_tag": "green"}
    assert f"to be removed {run.blocks_leaf}/" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_gc_run_removes_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    run = build(tmp_path, [0])
    fd = os.open(run.blocks_dir, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1200):  # one level at a time, from the parent's descriptor (no path grows)
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    assert cli(run_gc_cli, str(tmp_path), "--run", run.digest)[0] == 0
    assert list(tmp_path.iterdir()) == []


def test_gc_run_leaves_a_link_named_like_the_runs_tree_and_its_target(tmp_path: Path) -> None:
    run = build(tmp_path / "root", [0])
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("keep")
    Path(run.blocks_dir + "_r1").symlink_to(target, target_is_directory=True)  # a name the layout gives, as a link
    status, report = cli_json(run_gc_cli, str(tmp_path / "root"), "--run", run.digest)
    assert status == 0 and (target / "keep").read_text() == "keep"
    assert os.path.islink(run.blocks_dir + "_r1")  # an unsafe entry: reported by inspect, never touched


def test_gc_run_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = build(tmp_path, [0])
    assert cli(run_gc_cli, str(tmp_path), "--run", "0123456789ab")[0] == 2
    assert "no run with digest or name" in capsys.readouterr().err
    assert cli(run_gc_cli, str(tmp_path), "--run", run.digest, "--max-bytes", "1G")[0] == 2
    assert cli(run_gc_cli, str(tmp_path))[0] == 2
    assert Path(run.blocks_dir).is_dir()


def test_gc_run_progress_goes_to_a_terminal_only(tmp_path: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    run = build(tmp_path, [0, 1])
    stream = Terminal()
    fd = open_root(str(tmp_path))
    try:
        report = gc_run(fd, str(tmp_path), run=run.digest, dry_run=True, progress_stream=stream)
    finally:
        os.close(fd)
    assert report["files"] == 3 and "\r\x1b[K" in stream.getvalue()

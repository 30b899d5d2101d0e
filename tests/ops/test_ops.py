"""The operator commands (kvtier/ops/): ``kvtier inspect``, ``kvtier verify`` and ``kvtier gc``,
on trees written by the fs tier itself."""

from __future__ import annotations

import io
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from fs_tiers import FILE, GEOMETRY, SLOT, key_of, make_tier, running, store  # noqa: E402
from kv_blocks import block_equals, fill_block  # noqa: E402

import kvtier  # noqa: E402
from kvtier.host.slots import SlotBuffer  # noqa: E402
from kvtier.layout import Namespace, namespace  # noqa: E402
from kvtier.ops.gc import run_gc_cli  # noqa: E402
from kvtier.ops.inspect import run_inspect_cli  # noqa: E402
from kvtier.ops.runs import guess_slot_bytes, parse_size  # noqa: E402
from kvtier.ops.verify import REASONS, run_verify_cli  # noqa: E402

N = 12


def build(root: Path, ids: list[int], *, rank: int = 0, agnostic: bool = True) -> Path:
    """Store chunks ``ids`` with the fs tier under ``root``; return the rank tree's directory."""

    async def main() -> None:
        host = SlotBuffer(len(ids), SLOT, pin_memory=False)
        try:
            tier = make_tier(root, host, rank=rank, parallel_agnostic=agnostic)
            async with running(tier):
                await store(tier, host, ids)
        finally:
            host.close()

    anyio.run(main)
    ns = namespace(str(root), GEOMETRY.run_fields(1, parallel_agnostic=agnostic), rank)
    return Path(ns.blocks_dir)


def chunk(tree: Path, i: int) -> Path:
    return tree / Namespace.chunk_relpath(key_of(i))


def cli(fn: Any, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return fn(list(argv), out=out), out.getvalue()


def cli_json(fn: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    status, text = cli(fn, *argv, "--json")
    return status, json.loads(text)


# --- a clean tree ------------------------------------------------------------------------------


def test_clean_tree_inspects_and_verifies_clean(tmp_path: Path) -> None:
    tree = build(tmp_path, list(range(N)))
    status, report = cli_json(run_inspect_cli, str(tmp_path))
    assert status == 0
    (run,) = report["runs"]
    assert run["model"] == "org/tiny-model" and run["ranks"] == [0]
    assert run["name"] == tree.name.removesuffix("_r0") and run["fields"]["blocks_per_file"] == 1
    (t,) = run["trees"]
    assert t["chunk_files"] == N and t["chunk_bytes"] == N * FILE
    assert t["slot_bytes"] == SLOT and t["slot_bytes_source"] == "guessed"
    assert t["trailerless_files"] == 0 and t["tmp_files"] == 0 and t["stray_entries"] == []
    assert t["oldest_mtime"] <= t["newest_mtime"]
    assert report["totals"]["chunk_files"] == N and report["totals"]["chunk_bytes"] == N * FILE
    status, text = cli(run_inspect_cli, str(tmp_path))
    assert status == 0 and f"chunk files  {N}" in text

    status, report = cli_json(run_verify_cli, str(tmp_path), "--workers", "3")
    assert status == 0
    assert report["ok"] == N and report["files_checked"] == N and report["bytes_read"] == N * FILE
    assert report["problems"] == [] and report["problems_left"] == 0
    assert report["trees"][0]["slot_bytes"] == SLOT and report["trees"][0]["slot_bytes_source"] == "trailer"
    assert set(report["counts"]) == set(REASONS) and not any(report["counts"].values())
    status, text = cli(run_verify_cli, str(tmp_path))
    assert status == 0 and "GiB/s" in text and "problems left: 0" in text


# --- corruption of every kind ------------------------------------------------------------------


def corrupt_everything(root: Path, tree: Path, outside: Path) -> dict[str, Path]:
    """One file per reason; returns reason -> path."""
    paths = {}
    p = paths["short"] = chunk(tree, 0)
    p.write_bytes(p.read_bytes()[: FILE // 2])
    p = paths["long"] = chunk(tree, 1)
    p.write_bytes(p.read_bytes() + bytes(8192))
    p = paths["checksum"] = chunk(tree, 2)
    data = bytearray(p.read_bytes())
    data[100] ^= 0x01
    p.write_bytes(bytes(data))
    p = paths["wrong_chunk"] = chunk(tree, 3)
    p.write_bytes(chunk(tree, 4).read_bytes())  # chunk 4's file under chunk 3's name
    p = paths["old_version"] = chunk(tree, 5)
    data = bytearray(p.read_bytes())
    struct.pack_into("<H", data, len(data) - 28, 1)  # version field of the tail
    p.write_bytes(bytes(data))
    p = paths["bad_trailer"] = chunk(tree, 6)
    data = bytearray(p.read_bytes())
    data[-32:-28] = b"NOPE"
    p.write_bytes(bytes(data))
    p = paths["unverified"] = chunk(tree, 7)
    p.write_bytes(p.read_bytes()[:SLOT])  # trailer-less, exactly one slot: vLLM's format
    # A link to a file outside ROOT under a chunk's name, and a linked shard directory.
    (outside / "secret.bin").write_bytes(b"do not touch" * 1000)
    link = paths["not_regular"] = tree / Namespace.chunk_relpath(key_of(100))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "secret.bin")
    shard_target = outside / "shard"
    (shard_target / "aa_g0").mkdir(parents=True)
    (shard_target / "aa_g0" / "keep.txt").write_text("keep")
    free = next(f"{n:03x}" for n in range(4096) if not (tree / f"{n:03x}").exists())
    (tree / free).symlink_to(shard_target, target_is_directory=True)
    paths["not_regular_dir"] = tree / free
    # Stray names, temporary files (one stale, one young).
    paths["stray"] = tree / "notes.txt"
    paths["stray"].write_text("hello")
    key8 = Namespace.chunk_relpath(key_of(8))
    stale = paths["stale_tmp"] = tree / (key8 + "_123.tmp")
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    paths["young_tmp"] = tree / (key8 + "_456.tmp")
    paths["young_tmp"].write_bytes(b"y" * 100)
    return paths


def test_every_kind_of_corruption_is_reported_by_reason_and_repaired(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = build(root, list(range(N)))
    paths = corrupt_everything(root, tree, outside)

    status, report = cli_json(run_inspect_cli, str(root))
    assert status == 1  # stray and unsafe entries
    t = report["runs"][0]["trees"][0]
    assert t["slot_bytes"] == SLOT
    assert t["trailerless_files"] == 1 and t["tmp_files"] == 2 and t["other_size_files"] == 2
    assert t["stray_entries"] == ["notes.txt"]
    assert sorted(t["unsafe_entries"]) == sorted([paths["not_regular_dir"].name,
                                                  Namespace.chunk_relpath(key_of(100))])

    status, report = cli_json(run_verify_cli, str(root), "--workers", "4")
    assert status == 1
    counts = report["counts"]
    for reason in ("short", "long", "checksum", "wrong_chunk", "old_version", "bad_trailer", "unverified"):
        assert counts[reason] == 1, (reason, counts)
    assert counts["not_regular"] == 2 and counts["stray"] == 2  # notes.txt + the stale tmp file
    assert report["ok"] == N - 7 and report["tmp_in_progress"] == 1
    by_path = {p["path"]: p["reason"] for p in report["problems"]}
    for reason in ("short", "long", "checksum", "wrong_chunk", "old_version", "bad_trailer"):
        assert by_path[str(paths[reason].relative_to(root))] == reason
    assert report["unverified"] == [str(paths["unverified"].relative_to(root))]
    assert all(p.exists() or p.is_symlink() for p in paths.values())  # verify alone changes nothing

    status, report = cli_json(run_verify_cli, str(root), "--repair")
    assert status == 0 and report["problems_left"] == 0
    assert all(p["repaired"] for p in report["problems"])
    for reason in ("short", "long", "checksum", "wrong_chunk", "old_version", "bad_trailer", "stray", "stale_tmp"):
        assert not paths[reason].exists(), reason
    assert not paths["not_regular"].is_symlink() and not paths["not_regular_dir"].is_symlink()
    # Never the targets of links, never trailer-less files, never young temporary files.
    assert (outside / "secret.bin").read_bytes() == b"do not touch" * 1000
    assert (outside / "shard" / "aa_g0" / "keep.txt").read_text() == "keep"
    assert paths["unverified"].stat().st_size == SLOT and paths["young_tmp"].exists()
    assert chunk(tree, 4).exists() and chunk(tree, 8).exists()

    status, report = cli_json(run_verify_cli, str(root))
    assert status == 0 and report["ok"] == N - 7 and report["counts"]["unverified"] == 1


def test_a_chunk_copied_between_rank_trees_is_wrong_chunk(tmp_path: Path) -> None:
    r0 = build(tmp_path, [0, 1, 2], rank=0, agnostic=False)
    r1 = build(tmp_path, [0, 1, 2], rank=1, agnostic=False)
    assert r0.name.endswith("_r0") and r1.name.endswith("_r1")
    status, report = cli_json(run_inspect_cli, str(tmp_path))
    assert status == 0 and report["runs"][0]["ranks"] == [0, 1]
    chunk(r0, 1).write_bytes(chunk(r1, 1).read_bytes())  # same key, other rank's shard of the heads
    status, report = cli_json(run_verify_cli, str(tmp_path))
    assert status == 1 and report["counts"]["wrong_chunk"] == 1 and report["ok"] == 5
    assert report["problems"][0]["path"] == str(chunk(r0, 1).relative_to(tmp_path))


def test_only_the_run_asked_for_is_verified(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1])
    digest = tree.name.removesuffix("_r0").rsplit("_", 1)[1]
    status, report = cli_json(run_verify_cli, str(tmp_path), "--run", digest)
    assert status == 0 and report["ok"] == 2
    status, _ = cli(run_verify_cli, str(tmp_path), "--run", "000000000000")
    assert status == 2


def test_root_level_problems_are_reported_not_touched(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1])
    run_dir = tmp_path / tree.name.removesuffix("_r0")
    other = tmp_path / "org_other-model_0123456789ab"
    other.mkdir()
    (other / "config.json").write_text("[1, 2]")
    (tmp_path / "org_ghost_0123456789ab_r0").mkdir()
    (tmp_path / "unrelated").write_text("x")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.bin").write_text("keep")
    linked_tree = tmp_path / (run_dir.name + "_r1")
    linked_tree.symlink_to(elsewhere, target_is_directory=True)
    status, report = cli_json(run_inspect_cli, str(tmp_path))
    assert status == 1
    assert report["invalid_runs"] == [{"name": other.name, "reason": "config.json is not a JSON object"}]
    assert report["orphan_trees"] == ["org_ghost_0123456789ab_r0"] and report["other_entries"] == ["unrelated"]
    assert report["unsafe_entries"] == [linked_tree.name] and report["runs"][0]["ranks"] == [0]
    status, report = cli_json(run_verify_cli, str(tmp_path), "--repair")
    assert status == 1 and report["ok"] == 2 and report["problems_left"] == 3
    assert other.exists() and (tmp_path / "org_ghost_0123456789ab_r0").exists() and run_dir.exists()
    assert linked_tree.is_symlink() and (elsewhere / "keep.bin").read_text() == "keep"
    status, report = cli_json(run_gc_cli, str(tmp_path), "--max-bytes", "0")
    assert status == 0 and len(report["removed"]) == 2 and (elsewhere / "keep.bin").exists()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_goes_to_stderr_only_when_it_is_a_terminal(tmp_path: Path) -> None:
    from kvtier.ops.inspect import inspect_root
    from kvtier.ops.runs import open_root
    from kvtier.ops.verify import verify_root

    build(tmp_path, list(range(4)))
    fd = open_root(str(tmp_path))
    try:
        for stream, shown in ((io.StringIO(), False), (FakeTerminal(), True)):
            inspect_root(fd, str(tmp_path), progress_stream=stream)
            report = verify_root(fd, str(tmp_path), workers=1, progress_stream=stream)
            assert report["ok"] == 4
            assert ("\x1b[K" in stream.getvalue()) == shown
    finally:
        os.close(fd)


# --- exit statuses and help ----------------------------------------------------------------------


@pytest.mark.parametrize("fn", [run_inspect_cli, run_verify_cli, run_gc_cli])
def test_usage_errors_exit_2_with_one_line_and_help_shows_defaults_and_exit_codes(
        fn: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--max-bytes", "1G"] if fn is run_gc_cli else []
    assert fn([str(tmp_path / "missing"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err
    (tmp_path / "file").write_text("x")
    assert fn([str(tmp_path / "file"), *extra]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert fn([str(tmp_path), "--bogus", *extra]) == 2
    capsys.readouterr()
    assert fn(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "exit status:" in help_text and "  2  usage error" in help_text
    if fn is run_verify_cli:
        assert "(default: " in help_text  # --workers, --tmp-grace
    assert fn([str(tmp_path), *extra]) == 0  # an empty root is clean


def test_gc_size_argument_errors_exit_2(tmp_path: Path) -> None:
    assert cli(run_gc_cli, str(tmp_path))[0] == 2  # --max-bytes is required
    assert cli(run_gc_cli, str(tmp_path), "--max-bytes", "lots")[0] == 2
    assert cli(run_verify_cli, str(tmp_path), "--workers", "0")[0] == 2


def test_parse_size_and_slot_guess() -> None:
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20 and parse_size("10G") == 10 << 30 and parse_size("10g") == 10 << 30
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("20GB") == 20 * 10**9 and parse_size("4k") == 4096
    for bad in ("", "abc", "-1G", "1iB", "10Q"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert guess_slot_bytes([]) is None
    assert guess_slot_bytes([FILE] * 5 + [100]) == SLOT
    assert guess_slot_bytes([SLOT] * 5 + [FILE]) == SLOT  # a vLLM tree with a few kvtier files


# --- gc ------------------------------------------------------------------------------------------


def test_gc_removes_least_recently_written_chunks_until_under_the_cap(tmp_path: Path) -> None:
    tree = build(tmp_path, list(range(N)))
    now = time.time()
    for i in range(N):  # chunk i written i minutes after chunk 0
        os.utime(chunk(tree, i), (now - 3600 + 60 * i, now - 3600 + 60 * i))
    (tree / "notes.txt").write_text("stray files are not gc's business")

    status, report = cli_json(run_gc_cli, str(tmp_path), "--max-bytes", str(4 * FILE), "--dry-run")
    assert status == 0 and report["dry_run"]
    assert [r["path"] for r in report["removed"]] == [str(chunk(tree, i).relative_to(tmp_path)) for i in range(N - 4)]
    assert report["bytes_before"] == N * FILE and report["bytes_after"] == 4 * FILE
    assert all(chunk(tree, i).exists() for i in range(N))

    status, text = cli(run_gc_cli, str(tmp_path), "--max-bytes", f"{4 * FILE + FILE // 2}")
    assert status == 0 and text.count("removed ") == N - 4 + 1
    assert [chunk(tree, i).exists() for i in range(N)] == [False] * (N - 4) + [True] * 4
    assert (tree / "notes.txt").exists()
    status, report = cli_json(run_gc_cli, str(tmp_path), "--max-bytes", "1G")
    assert status == 0 and report["removed"] == [] and report["files_after"] == 4
    status, report = cli_json(run_verify_cli, str(tmp_path))
    assert report["ok"] == 4


def test_gc_counts_every_run_and_rank_of_the_root_together(tmp_path: Path) -> None:
    r0 = build(tmp_path, [0, 1, 2], rank=0, agnostic=False)
    r1 = build(tmp_path, [0, 1, 2], rank=1, agnostic=False)
    other = build(tmp_path, [5, 6])
    old = time.time() - 1000
    for tree in (r0, r1):
        for i in (0, 1, 2):
            os.utime(chunk(tree, i), (old + i, old + i))
    status, report = cli_json(run_gc_cli, str(tmp_path), "--max-bytes", str(3 * FILE))
    assert status == 0 and report["bytes_before"] == 8 * FILE and report["bytes_after"] == 3 * FILE
    left = [p for p in (*(chunk(r0, i) for i in range(3)), *(chunk(r1, i) for i in range(3)),
                        chunk(other, 5), chunk(other, 6)) if p.exists()]
    # The newest (the other run's) survive, and one of the two ranks' newest old chunks.
    assert len(left) == 3 and chunk(other, 5) in left and chunk(other, 6) in left
    assert chunk(r0, 2) in left or chunk(r1, 2) in left


def test_gc_never_follows_links(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = build(root, [0, 1, 2])
    (outside / "secret.bin").write_bytes(b"s" * FILE)
    link = tree / Namespace.chunk_relpath(key_of(50))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "secret.bin")
    status, report = cli_json(run_gc_cli, str(root), "--max-bytes", "0")
    assert status == 0 and len(report["removed"]) == 3
    assert link.is_symlink() and (outside / "secret.bin").read_bytes() == b"s" * FILE


# --- gc next to a running engine -----------------------------------------------------------------

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 2, 2, 16, 64


@pytest.mark.anyio
async def test_gc_while_an_engine_serves_loads_gives_misses_never_wrong_bytes(tmp_path: Path) -> None:
    import random

    geometry = kvtier.KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                 dtype="float16", block_size=BLOCK)
    kv = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 4 * geometry.slot_bytes(1),
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}],
    }
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(48)]
    gen = torch.Generator().manual_seed(4)
    expected = {}
    async with kvtier.open(config, geometry, kv) as engine:
        for i, tokens in enumerate(prompts):
            expected[i] = fill_block(kv, i % NUM_BLOCKS, gen)
            assert await engine.store(tokens, [i % NUM_BLOCKS]) == BLOCK
        await engine.drain()
        loaded = missed = 0
        for cap in (f"{24 * (geometry.slot_bytes(1) + 4096)}", "0"):
            done = anyio.Event()

            async def collect(cap: str = cap, done: anyio.Event = done) -> None:
                for _ in range(3):
                    status, _ = await anyio.to_thread.run_sync(lambda: cli(run_gc_cli, str(tmp_path), "--max-bytes", cap))
                    assert status == 0
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                rounds = 0
                while not done.is_set() or rounds < 2:
                    rounds += 1
                    for i, tokens in enumerate(prompts):
                        target = (i * 7 + 3) % NUM_BLOCKS
                        for layer in kv:
                            layer[target].zero_()
                        placed = await engine.load(tokens, [target])
                        if placed == BLOCK:
                            loaded += 1
                            assert block_equals(kv, target, expected[i]), f"chunk {i} came back different"
                        else:
                            assert placed == 0
                            missed += 1
        assert missed > 0 and loaded > 0
    status, report = cli_json(run_verify_cli, str(tmp_path))
    assert status == 0  # whatever the engine wrote back after gc is intact


def test_a_vllm_only_tree_is_unverified_and_never_repaired_away(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1, 2])
    for i in range(3):
        chunk(tree, i).write_bytes(chunk(tree, i).read_bytes()[:SLOT])  # no trailer anywhere
    status, report = cli_json(run_inspect_cli, str(tmp_path), "--slot-bytes", str(SLOT))
    assert status == 0 and report["runs"][0]["trees"][0]["trailerless_files"] == 3
    status, report = cli_json(run_verify_cli, str(tmp_path), "--repair")
    assert status == 0 and report["counts"]["unverified"] == 3 and report["problems"] == []
    assert report["trees"][0]["slot_bytes"] == SLOT and report["trees"][0]["slot_bytes_source"] == "guessed"
    assert all(chunk(tree, i).stat().st_size == SLOT for i in range(3))
    # Files of no plausible size: nothing to check against, nothing removed, exit 1.
    for i in range(3):
        chunk(tree, i).write_bytes(b"z" * 1000)
    status, report = cli_json(run_verify_cli, str(tmp_path), "--repair")
    assert status == 1 and report["unchecked"] == 3 and report["problems_left"] == 3
    assert all(chunk(tree, i).exists() for i in range(3))
    status, report = cli_json(run_verify_cli, str(tmp_path), "--repair", "--slot-bytes", str(SLOT))
    assert status == 0 and report["counts"]["short"] == 3 and not any(chunk(tree, i).exists() for i in range(3))


# --- verify in worker processes ------------------------------------------------------------------


def _same_findings(report: dict[str, Any]) -> dict[str, Any]:
    """A verify report without what depends on who read the files and how fast."""
    return {k: v for k, v in report.items() if k not in ("workers", "elapsed_s", "gib_per_s")}


def test_worker_processes_find_exactly_what_this_process_finds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = build(root, list(range(N)))
    build(root, [0, 1, 2], rank=1, agnostic=False)  # a second run, so requests name several trees
    corrupt_everything(root, tree, outside)
    status_1, alone = cli_json(run_verify_cli, str(root), "--workers", "1")
    status_3, workers = cli_json(run_verify_cli, str(root), "--workers", "3")
    assert status_1 == status_3 == 1 and alone["workers"] == 1 and workers["workers"] == 3
    assert alone["ok"] == N - 7 + 3 and alone["counts"]["checksum"] == 1 and alone["counts"]["not_regular"] == 2
    assert _same_findings(workers) == _same_findings(alone)


def test_a_worker_killed_mid_run_fails_the_check_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    from kvtier.ops import verify_workers

    tree = build(tmp_path, list(range(N)))
    data = bytearray(chunk(tree, 0).read_bytes())
    data[100] ^= 0x01
    chunk(tree, 0).write_bytes(bytes(data))  # a checksum problem that --repair would remove
    workers: list[Any] = []
    real_match = verify_workers._Worker.match

    def match_then_kill(self: Any, answer: Any) -> Any:
        request = real_match(self, answer)
        workers.append(self)
        if answer.verdicts:  # after its first real answer: as if the OOM killer took it
            os.kill(self.pid, signal.SIGKILL)
        return request

    monkeypatch.setattr(verify_workers._Worker, "match", match_then_kill)
    status, out = cli(run_verify_cli, str(tmp_path), "--workers", "2", "--repair")
    err = capsys.readouterr().err
    assert status == 1 and out == ""  # no report: the check did not finish
    assert "kvtier verify: error: verify worker" in err and "exited (status -9)" in err, err
    assert all(w.process.returncode is not None for w in workers)  # none left running
    assert chunk(tree, 0).exists()  # nothing repaired on a failed check


def _frame(obj: Any) -> str:
    import msgspec

    payload = msgspec.msgpack.encode(obj)
    return (struct.pack(">I", len(payload)) + payload).hex()


@pytest.mark.parametrize("answer, message", [
    ((struct.pack(">I", 5) + b"\xc1junk").hex(), "sent a bad answer"),  # not msgpack
    (_frame([0, [len(REASONS) + 5]]), "sent a bad answer"),  # a verdict out of range
    (_frame([0, "ok"]), "sent a bad answer"),  # wrong types
    (_frame([7, [0]]), "answer to no request"),  # not the request sent
    (_frame([0, [0, 0, 0]]), "answer to no request"),  # not one verdict per file
    (struct.pack(">I", 1 << 30).hex(), "sent a frame of 1073741824 bytes"),  # over the bound
])
def test_a_malformed_answer_from_a_worker_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], answer: str,
                                                      message: str) -> None:
    from kvtier.ops import verify_workers

    build(tmp_path, [0, 1])
    # A stand-in worker: says it started, then answers whatever it is sent with ``answer``.
    fake = ("import os; os.write(1, bytes.fromhex(%r)); os.read(0, 1 << 16); os.write(1, bytes.fromhex(%r)); "
            "os.read(0, 1 << 16)" % (_frame([-1, []]), answer))
    monkeypatch.setattr(verify_workers, "_BOOT", fake)
    status, out = cli(run_verify_cli, str(tmp_path), "--workers", "2")
    err = capsys.readouterr().err
    assert status == 1 and out == "" and message in err, err

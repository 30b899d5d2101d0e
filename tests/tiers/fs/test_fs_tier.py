"""Specification of the filesystem tier (kvtier/tiers/fs/tier.py), driven directly through the base
class's channels: ``tg.start(tier.run)``, ``submit_*``, ``get_finished_jobs`` with the wakeup
callback, and a :class:`SlotBuffer` as the host."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
from fs_tiers import (
    FILE,
    GEOMETRY,
    SLOT,
    bin_files,
    expected,
    fill,
    finish,
    job_ids,
    key_of,
    load,
    make_tier,
    metric,
    probe,
    running,
    store,
)

from kvtier.errors import ConfigError
from kvtier.host.slots import SlotBuffer
from kvtier.layout import KVGeometry, namespace, run_digest
from kvtier.tiers.base import TransferJob
from kvtier.tiers.fs import chunks
from kvtier.tiers.fs.tier import FileSystemTier
from kvtier.tiers.fs.tree import key_from_relpath
from kvtier.tiers.integrity import REJECT_REASONS, identity
from kvtier.types import LookupResult, Medium

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def host() -> SlotBuffer:
    buf = SlotBuffer(128, SLOT, pin_memory=False)
    yield buf
    buf.close()


# --- layout ----------------------------------------------------------------------------------------


def documented_fields(tp_size: int, agnostic: bool) -> dict[str, Any]:
    """The run fields of ``org/tiny-model`` with one block per file, as the layout documents them."""
    fields: dict[str, Any] = {
        "model_name": "org/tiny-model",
        "tokens_per_hash": 16,
        "blocks_per_file": 1,
        "tp_size": 1 if agnostic else tp_size,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "float16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(2)]}],
        "inference_engine": "kvtier",
    }
    if not agnostic:
        fields["parallel_agnostic"] = False
    return fields


def documented_trailer_page(payload: bytes, tree_fingerprint: bytes, key: bytes) -> bytes:
    """The trailer page of format version 2, field by field: zeros, the identity (the tree's
    fingerprint, the key's length and the key padded to 64 bytes, 30 reserved bytes), then the
    tail (magic, version, flags, payload length, xxh3-64 of the payload with seed 0, 8 reserved)."""
    identity = tree_fingerprint + len(key).to_bytes(2, "little") + key.ljust(64, b"\0") + bytes(30)
    tail = (b"KVTR" + (2).to_bytes(2, "little") + bytes(2) + len(payload).to_bytes(8, "little")
            + xxhash.xxh3_64_intdigest(payload, seed=0).to_bytes(8, "little") + bytes(8))
    return bytes(4096 - len(identity) - len(tail)) + identity + tail


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tp_size", "rank", "agnostic"),
    [(1, 0, True), (2, 1, False), (2, 1, True)],
    ids=["tp1", "tp2-rank1", "parallel-agnostic"],
)
async def test_layout_and_digest_follow_the_vllm_namespace(
    tmp_path: Path, host: SlotBuffer, tp_size: int, rank: int, agnostic: bool
) -> None:
    geometry = KVGeometry("org/tiny-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                          block_size=16, tp_size=tp_size)
    fields = geometry.run_fields(1, parallel_agnostic=agnostic)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    assert run_digest(fields) == digest
    assert fields == documented_fields(tp_size, agnostic)
    tier = make_tier(tmp_path, host, geometry=geometry, rank=rank, parallel_agnostic=agnostic)
    async with running(tier):
        assert (await store(tier, host, [7])).success
    h = key_of(7)[:-4].hex()
    dir_rank = 0 if agnostic else rank
    assert bin_files(tmp_path) == [tmp_path / f"org_tiny-model_{digest}_r{dir_rank}" / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"]
    # The file's bytes: the payload, then the trailer page naming this chunk of this run and rank.
    tree = hashlib.sha256(hashlib.sha256(canonical.encode()).digest() + dir_rank.to_bytes(8, "big")).digest()
    assert bin_files(tmp_path)[0].read_bytes() == expected(7) + documented_trailer_page(expected(7), tree, key_of(7))
    config = json.loads((tmp_path / f"org_tiny-model_{digest}" / "config.json").read_text())
    assert config == fields
    assert ("parallel_agnostic" in config) == (not agnostic)
    assert config["tp_size"] == (1 if agnostic else tp_size)


@pytest.mark.anyio
async def test_kv_cache_group_index_names_the_shard_directory(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path, host)
    key = key_of(1, group=3)
    fill(host, 0, 1)
    async with running(tier):
        result = (await finish(tier, [TransferJob(next(job_ids), [key], [0], False)]))
    assert all(r.success for r in result.values())
    assert bin_files(tmp_path)[0].parent.name.endswith("_g3")


@pytest.mark.anyio
async def test_config_json_of_a_different_geometry_is_a_config_error(tmp_path: Path, host: SlotBuffer) -> None:
    async with running(make_tier(tmp_path, host)):
        pass
    [config_path] = tmp_path.glob("*/config.json")
    fields = json.loads(config_path.read_text())
    fields["kv_cache_groups"][0]["layer_names"] = ["another.layer.0", "another.layer.1"]
    config_path.write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match="kv_cache_groups"):
        await make_tier(tmp_path, host).run()  # fails in open(), before reporting ready


@pytest.mark.anyio
async def test_unknown_eviction_policy_is_a_config_error_listing_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allowed: lru"):
        make_tier(tmp_path, None, eviction_policy="arc")


# --- round trip and lookups ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stored_chunks_load_back_byte_exact_and_are_known(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, range(64))).success
        assert await probe(tier, [key_of(i) for i in range(64)]) == [LookupResult.HIT] * 64
        for slot in range(64):
            host.view(slot)[:] = bytes(SLOT)
        result = await load(tier, range(64))
        assert result.success and result.transfer_bytes == 64 * SLOT
        assert all(bytes(host.view(slot)) == expected(i) for slot, i in enumerate(range(64)))
    assert all(f.stat().st_size == FILE for f in bin_files(tmp_path))
    assert tier.medium is Medium.STORAGE


@pytest.mark.anyio
async def test_unknown_key_is_probed_off_thread_and_found_if_another_writer_made_it(
    tmp_path: Path, host: SlotBuffer
) -> None:
    writer, reader = make_tier(tmp_path, host), make_tier(tmp_path, host)
    async with running(writer), running(reader):
        assert tier_answers_retry_first(reader, key_of(1))
        assert await probe(reader, [key_of(1)]) == [LookupResult.MISS]
        assert (await store(writer, host, [2])).success
        assert reader.lookup(key_of(2)) is LookupResult.RETRY
        assert await probe(reader, [key_of(2)]) == [LookupResult.HIT]


def tier_answers_retry_first(tier: FileSystemTier, key: bytes) -> bool:
    return tier.lookup(key) is LookupResult.RETRY


@pytest.mark.anyio
async def test_file_deleted_between_lookup_and_load_is_a_miss_and_the_tier_keeps_working(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [1, 2])).success
        assert await probe(tier, [key_of(1)]) == [LookupResult.HIT]
        os.unlink(tier.namespace.chunk_path(key_of(1)))
        result = await load(tier, [1, 2])
        assert not result.success and result.failure_reason == "missing"
        assert result.successful_keys == [key_of(2)]
        assert tier.lookup(key_of(1)) is LookupResult.MISS
        assert (await load(tier, [2])).success
        assert tier.statistics().failures[("load", "missing")] == 1


# --- cross-process sharing and crash safety --------------------------------------------------------

_WRITER_SCRIPT = r"""
import sys, json, hashlib, anyio
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/support"]
from fs_tiers import make_tier, running, store, SLOT
from kvtier.host.slots import SlotBuffer
from pathlib import Path

async def main():
    root, first, count, per_job = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    host = SlotBuffer(per_job, SLOT, pin_memory=False)
    tier = make_tier(root, host)
    async with running(tier):
        for start in range(first, first + count, per_job):
            ids = list(range(start, min(start + per_job, first + count)))
            result = await store(tier, host, ids)
            print(json.dumps({"stored": ids, "ok": result.success}), flush=True)

anyio.run(main)
"""


def _writer(root: Path, first: int, count: int, per_job: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(REPO), str(root), str(first), str(count), str(per_job)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
    )


@pytest.mark.anyio
async def test_a_second_process_finds_and_loads_chunks_the_first_stored(tmp_path: Path, host: SlotBuffer) -> None:
    proc = _writer(tmp_path, 100, 16, 8)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert all(json.loads(line)["ok"] for line in out.splitlines())
    tier = make_tier(tmp_path, host, rescan_interval_s=3600)
    async with running(tier):
        keys = [key_of(i) for i in range(100, 116)]
        assert await probe(tier, keys) == [LookupResult.HIT] * 16  # known from the start-up scan
        result = await load(tier, range(100, 116))
        assert result.success
        assert all(bytes(host.view(slot)) == expected(i) for slot, i in enumerate(range(100, 116)))
        assert tier.statistics().bytes_used == 16 * FILE


@pytest.mark.anyio
async def test_writer_killed_mid_run_leaves_only_verifiable_files_and_startup_removes_stale_tmp(
    tmp_path: Path, host: SlotBuffer
) -> None:
    proc = _writer(tmp_path, 0, 500, 4)
    assert proc.stdout is not None
    for _ in range(5):  # let it get well into its writes, then kill it without warning
        assert proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    ns = namespace(str(tmp_path), GEOMETRY.run_fields(1), 0)
    # A stray temporary as a crash mid-write leaves it (old), and one of a live writer (fresh).
    victim = Path(ns.chunk_path(key_of(9999)))
    victim.parent.mkdir(parents=True, exist_ok=True)
    stale, fresh = Path(f"{victim}_1.tmp"), Path(f"{victim}_2.tmp")
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (time.time() - 120, time.time() - 120))

    files = bin_files(tmp_path)
    assert 20 <= len(files) < 500
    buf = memoryview(bytearray(SLOT))
    tree = os.open(ns.blocks_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for path in files:
            relpath = str(path.relative_to(ns.blocks_dir))
            key = key_from_relpath(relpath)
            assert key is not None
            assert chunks.load_chunk(tree, relpath, buf, identity(key, ns.fingerprint), o_direct=False).verified, path
    finally:
        os.close(tree)

    tier = make_tier(tmp_path, host, stale_tmp_grace_s=60)
    async with running(tier):
        assert not stale.exists() and fresh.exists()
        assert metric(tier, "fs_stale_tmp_removed")[()] >= 1
        assert len(tier.index) == len(files)


# --- corruption ------------------------------------------------------------------------------------


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "short":
        data = data[: len(data) // 2]
    elif how == "long":
        data += b"\0" * 8192
    elif how == "checksum":
        data[len(data) // 3] ^= 0x40
    elif how == "bad_trailer":
        data[-32:-28] = b"NOPE"
    path.write_bytes(bytes(data))


@pytest.mark.anyio
async def test_every_corrupt_file_is_a_miss_is_removed_and_counted_by_reason(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host)
    ids = list(range(120))
    async with running(tier):
        for start in range(0, 120, 60):
            assert (await store(tier, host, ids[start : start + 60])).success
        reasons = ["short", "long", "checksum", "bad_trailer"]
        corrupted = {i: reasons[i % 4] for i in ids[:100]}
        for i, how in corrupted.items():
            _corrupt(Path(tier.namespace.chunk_path(key_of(i))), how)
        for start in range(0, 120, 60):
            chunk_ids = ids[start : start + 60]
            for slot in range(60):
                host.view(slot)[:] = b"\xee" * SLOT
            result = await load(tier, chunk_ids)
            assert not result.success and result.failure_reason == "corrupt"
            assert result.successful_keys == [key_of(i) for i in chunk_ids if i not in corrupted]
            for slot, i in enumerate(chunk_ids):
                # Rejected bytes never stay in the slot; good chunks are exact.
                assert bytes(host.view(slot)) == (bytes(SLOT) if i in corrupted else expected(i))
        rejected = metric(tier, "fs_rejected_chunks")
        assert rejected == {(r,): 25.0 if r in reasons else 0.0 for r in REJECT_REASONS}
        assert tier.statistics().failures[("load", "corrupt")] == 2
        assert await probe(tier, [key_of(i) for i in corrupted]) == [LookupResult.MISS] * 100
    assert len(bin_files(tmp_path)) == 20
    assert not any(os.path.exists(make_tier(tmp_path, None).namespace.chunk_path(key_of(i))) for i in corrupted)


@pytest.mark.anyio
async def test_trailerless_file_of_exact_slot_size_is_not_a_hit_and_is_left_alone_by_default(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host)
    path = Path(tier.namespace.chunk_path(key_of(1)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(expected(1))  # what vLLM writes: the slot's bytes, nothing to verify them by
    async with running(tier):
        assert await probe(tier, [key_of(1)]) == [LookupResult.MISS]
        host.view(0)[:] = b"\xee" * SLOT
        result = await load(tier, [1])  # a caller with a stale positive verdict still gets no bytes
        assert not result.success and result.failure_reason == "unverified"
        assert bytes(host.view(0)) == bytes(SLOT)
        assert metric(tier, "fs_rejected_chunks")[("unverified",)] == 1
        assert metric(tier, "fs_unverified_loads").get((), 0) == 0
        # Storing the chunk replaces the file with a verifiable one, which then loads.
        assert (await store(tier, host, [1])).success
        host.view(0)[:] = bytes(SLOT)
        assert (await load(tier, [1])).success and bytes(host.view(0)) == expected(1)
    assert path.stat().st_size == FILE


@pytest.mark.anyio
async def test_trailerless_file_of_exact_slot_size_loads_unverified_when_accepted_other_sizes_are_rejected(
    tmp_path: Path, host: SlotBuffer
) -> None:
    tier = make_tier(tmp_path, host, accept_unverified_chunks=True)
    for i, size in ((1, SLOT), (2, SLOT - 4096), (3, SLOT + 4096 - 1)):
        path = Path(tier.namespace.chunk_path(key_of(i)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(expected(i)[:size] + b"\1" * max(0, size - SLOT))
    async with running(tier):
        good = await load(tier, [1])
        assert good.success and bytes(host.view(0)) == expected(1)
        assert metric(tier, "fs_unverified_loads")[()] == 1
        bad = await load(tier, [2, 3])
        assert not bad.success and bad.successful_keys == []
        assert metric(tier, "fs_rejected_chunks")[("short",)] == 2
    assert len(bin_files(tmp_path)) == 1


# --- capacity --------------------------------------------------------------------------------------


def _disk_bytes(tier: FileSystemTier) -> int:
    return sum(f.stat().st_size for f in Path(tier.namespace.blocks_dir).rglob("*.bin"))


@pytest.mark.anyio
async def test_max_bytes_holds_after_every_job_evicting_least_recently_used(
    tmp_path: Path, host: SlotBuffer
) -> None:
    cap = 50 * FILE
    tier = make_tier(tmp_path, host, max_bytes=cap, events=True)
    async with running(tier):
        assert (await store(tier, host, range(0, 10))).success
        for start in range(10, 500, 10):
            # Loading chunks 0-4 keeps them the most recently used, so they survive.
            assert (await load(tier, range(5))).success
            assert (await store(tier, host, range(start, start + 10))).success
            assert tier.index.used <= cap and _disk_bytes(tier) <= cap
        stats = tier.statistics()
        assert stats.bytes_used == 50 * FILE and stats.capacity_bytes == cap
        assert stats.evictions == 450
        survivors = set(tier.index.keys())
        assert {key_of(i) for i in range(5)} <= survivors
        assert {key_of(i) for i in range(460, 500)} <= survivors  # the last four jobs
        removed = [e for e in tier.take_events() if e.removed]
        assert sum(len(e.keys) for e in removed) == 450
        assert all(e.medium == "STORAGE" and e.reason == "evicted" for e in removed)
        assert await probe(tier, [key_of(10)]) == [LookupResult.MISS]
    restarted = make_tier(tmp_path, host, max_bytes=cap)
    async with running(restarted):
        assert restarted.statistics().bytes_used == 50 * FILE == _disk_bytes(restarted)
        assert set(restarted.index.keys()) == survivors


@pytest.mark.anyio
async def test_rescan_accounts_for_files_other_processes_added_or_deleted(tmp_path: Path, host: SlotBuffer) -> None:
    cap = 10 * FILE
    a, b = make_tier(tmp_path, host, max_bytes=cap), make_tier(tmp_path, host)
    async with running(a), running(b):
        assert (await store(a, host, range(8))).success
        assert (await store(b, host, range(100, 108))).success
        os.unlink(a.namespace.chunk_path(key_of(0)))
        await a.rescan()
        assert key_of(0) not in a.index
        assert a.statistics().bytes_used <= cap and _disk_bytes(a) <= cap


@pytest.mark.anyio
async def test_unbounded_tier_warns_once_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running(make_tier(tmp_path, None)):
        pass
    assert sum("without limit" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.anyio
async def test_unbounded_warning_is_logged_once_per_directory_not_per_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):  # e.g. a benchmark opening many engines on one root
        async with running(make_tier(tmp_path / "a", None)):
            pass
    async with running(make_tier(tmp_path / "b", None)):
        pass
    warnings = [r.getMessage() for r in caplog.records if "without limit" in r.getMessage()]
    assert len(warnings) == 2
    assert str(tmp_path / "a") in warnings[0] and str(tmp_path / "b") in warnings[1]



@pytest.mark.anyio
async def test_a_root_with_control_bytes_is_logged_escaped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A byte that is no UTF-8 (decoded as a lone surrogate) and a terminal escape in the root's
    # name: written raw, the first breaks a UTF-8 log handler and the second clears the screen.
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/root\xff\x1b[2J"))
    async with running(make_tier(root, None)):
        pass
    warnings = [r.getMessage() for r in caplog.records if "without limit" in r.getMessage()]
    assert len(warnings) == 1
    assert "\\xff" in warnings[0] or "\\udcff" in warnings[0]
    assert "\\x1b[2J" in warnings[0] and warnings[0].isprintable()
    warnings[0].encode("utf-8")  # no lone surrogate left

@pytest.mark.anyio
@pytest.mark.parametrize("o_direct", [False, True])
async def test_jobs_are_cut_per_core_for_page_cache_io_and_per_worker_for_o_direct(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch, o_direct: bool
) -> None:
    monkeypatch.setattr("kvtier.tiers.fs.pool.usable_cpus", lambda: 1)
    monkeypatch.setattr(chunks, "probe_o_direct", lambda directory: o_direct)
    tier = make_tier(tmp_path, host)  # 2 read + 2 write workers
    async with running(tier):
        assert tier.o_direct is o_direct
        assert tier._pool.batch_slices == (4 if o_direct else 1)


@pytest.mark.anyio
async def test_a_job_is_handed_to_the_pool_as_one_batch(tmp_path: Path, host: SlotBuffer) -> None:
    tier = make_tier(tmp_path, host)
    batches: list[int] = []
    real = tier._pool.run_slices  # what run_batch (stores) runs on too

    async def spy(queue: Any, fn: Any, items: Any) -> Any:
        batches.append(len(items))
        return await real(queue, fn, items)

    tier._pool.run_slices = spy  # type: ignore[method-assign]
    async with running(tier):
        assert (await store(tier, host, range(8))).success
        assert (await load(tier, range(8))).success
    assert batches == [8, 8]


# --- faults ----------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_disk_full_fails_stores_cleanly_while_loads_keep_working(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path, host, max_bytes=100 * FILE)
    async with running(tier):
        assert (await store(tier, host, range(4))).success

        def no_space(*args: object) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(chunks.os, "pwritev", no_space)
        failed = await store(tier, host, range(10, 14))
        assert not failed.success and failed.failure_reason == "no_space"
        assert tier.statistics().failures[("store", "no_space")] == 1
        assert tier.statistics().bytes_used == 4 * FILE
        assert (await load(tier, range(4))).success
        monkeypatch.undo()
        assert (await store(tier, host, range(10, 14))).success
    names = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert not [n for n in names if n.endswith(".tmp")]
    assert len(bin_files(tmp_path)) == 8


@pytest.mark.anyio
async def test_permission_and_io_errors_fail_only_their_chunks_and_are_counted_by_reason(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(tmp_path, host)
    async with running(tier):
        assert (await store(tier, host, [1])).success

        def denied(*args: object) -> int:
            raise PermissionError(13, "Permission denied")

        def broken(*args: object) -> int:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(chunks.os, "pwritev", denied)
        assert (await store(tier, host, [2])).failure_reason == "permission"
        monkeypatch.setattr(chunks.os, "preadv", broken)
        assert (await load(tier, [1])).failure_reason == "io_error"
        monkeypatch.undo()
        # An I/O error is not corruption: the file stays and loads once the device recovers.
        assert (await load(tier, [1])).success
        assert (await store(tier, host, [2])).success
        failures = tier.statistics().failures
        assert failures[("store", "permission")] == 1 and failures[("load", "io_error")] == 1

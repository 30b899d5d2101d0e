"""kvtier's tiers inside vLLM 0.33's own TieringOffloadingManager (real vLLM classes, on CPU)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from harness import Driver, chunk_keys, payload, tiering_spec
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import kvtier
from kvtier.integrations.vllm import KvtierARCPolicy, KvtierFsTier, register
from kvtier.integrations.vllm.loop import LoopThread
from kvtier.tiers.integrity import stored_size

register()

ROW = 64 * 1024  # the harness's row (slot) size
FILE = stored_size(ROW)  # a kvtier chunk file: the row and its integrity trailer page


def kvtier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtier")]


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test ends with no kvtier thread and no event loop running."""
    yield
    assert LoopThread.running() is None
    assert kvtier_threads() == []


def block_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every chunk file under ``root``."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.bin")}


def roundtrip(tiers: list[dict], keys: list[bytes]) -> list[bytes | None]:
    """Store ``keys`` through one manager, load them through a fresh one; the bytes loaded."""
    writer = Driver(tiering_spec(tiers))
    try:
        writer.store(keys)
    finally:
        writer.shutdown()
    reader = Driver(tiering_spec(tiers))
    try:
        return reader.load(keys)
    finally:
        reader.shutdown()


def test_fs_store_cascade_fresh_manager_promotion_bytes_identical(tmp_path: Path) -> None:
    keys = chunk_keys("fs", 12)
    loaded = roundtrip([{"type": "kvtier_fs", "root_dir": str(tmp_path)}], keys)
    assert loaded == [payload(k, ROW).tobytes() for k in keys]
    assert len(block_files(tmp_path)) == 12


def test_obj_store_cascade_fresh_manager_promotion_bytes_identical(s3_server, s3_bucket, dummy_aws_env) -> None:
    tier = {"type": "kvtier_obj", "prefix": "kv",
            "store_config": {"bucket": s3_bucket, "endpoint_override": s3_server.endpoint}}
    keys = chunk_keys("obj", 6)
    loaded = roundtrip([tier], keys)
    assert loaded == [payload(k, ROW).tobytes() for k in keys]
    objects = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert len(objects) == 6 and all(o["Key"].startswith("kv/") for o in objects)


def test_memory_tier_promotes_what_the_primary_evicted() -> None:
    """8 primary slots, 24 chunks: the first ones live only in the memory tier, then come back."""
    d = Driver(tiering_spec([{"type": "kvtier_memory", "capacity_bytes": 64 * ROW}], num_chunks=8))
    try:
        keys = chunk_keys("mem", 24)
        for start in range(0, 24, 4):
            d.store(keys[start:start + 4])
        with d.manager.lock:
            ctx = d.context()
            assert d.manager.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS
        assert d.load(keys[:4]) == [payload(k, ROW).tobytes() for k in keys[:4]]
    finally:
        d.shutdown()


def test_paths_are_byte_identical_to_vllms_fs_tier(tmp_path: Path) -> None:
    """Same run configuration, absolute model path: kvtier's tree is vLLM's tree (config.json too)."""
    keys = chunk_keys("paths", 5)
    ours, theirs = tmp_path / "kvtier", tmp_path / "vllm"
    for tier in ({"type": "kvtier_fs", "root_dir": str(ours)}, {"type": "fs", "root_dir": str(theirs)}):
        d = Driver(tiering_spec([tier], model="/models/Llama-3.1-8B"))
        try:
            d.store(keys)
        finally:
            d.shutdown()
    ours_files, theirs_files = block_files(ours), block_files(theirs)
    assert sorted(ours_files) == sorted(theirs_files) and len(ours_files) == 5
    assert all(name.startswith("_models_Llama-3.1-8B_") for name in ours_files)
    (config_dir,) = [p for p in theirs.iterdir() if (p / "config.json").exists()]
    assert json.loads((ours / config_dir.name / "config.json").read_text()) == \
        json.loads((config_dir / "config.json").read_text())
    # kvtier's files carry the integrity trailer after the row; vLLM's are the bare row.
    assert set(ours_files.values()) == {FILE} and set(theirs_files.values()) == {ROW}


def test_vllm_reads_kvtier_files_and_kvtier_reads_vllm_files_when_allowed(tmp_path: Path) -> None:
    keys_ours, keys_theirs = chunk_keys("ours", 4), chunk_keys("theirs", 4)
    ours = {"type": "kvtier_fs", "root_dir": str(tmp_path)}
    theirs = {"type": "fs", "root_dir": str(tmp_path)}
    for tier, keys in ((ours, keys_ours), (theirs, keys_theirs)):
        d = Driver(tiering_spec([tier]))
        try:
            d.store(keys)
        finally:
            d.shutdown()
    # vLLM's own fs tier loads kvtier's chunk files.
    d = Driver(tiering_spec([theirs]))
    try:
        assert d.load(keys_ours) == [payload(k, ROW).tobytes() for k in keys_ours]
    finally:
        d.shutdown()
    # kvtier refuses unverified (trailer-less) files by default ...
    d = Driver(tiering_spec([ours]))
    try:
        assert d.load(keys_theirs) == [None] * 4
    finally:
        d.shutdown()
    # ... and loads them when the operator opts in.
    d = Driver(tiering_spec([dict(ours, accept_unverified_chunks=True)]))
    try:
        assert d.load(keys_theirs) == [payload(k, ROW).tobytes() for k in keys_theirs]
    finally:
        d.shutdown()


def test_max_bytes_eviction_reaches_the_scheduler(tmp_path: Path) -> None:
    """The tier keeps 4 chunks; evicted keys answer MISS at once, kept ones HIT (no probe round)."""
    tier = {"type": "kvtier_fs", "root_dir": str(tmp_path), "max_bytes": 4 * FILE}
    d = Driver(tiering_spec([tier], num_chunks=4))
    try:
        keys = chunk_keys("evict", 12)
        for start in range(0, 12, 4):
            d.store(keys[start:start + 4])
        assert len(block_files(tmp_path)) == 4
        (fs_tier,) = d.manager.secondary_tiers
        ctx = d.context()
        with d.manager.lock:
            first = [fs_tier.lookup(k, ctx) for k in keys]
        assert first == [LookupResult.MISS] * 8 + [LookupResult.HIT] * 4
        assert d.load(keys[8:]) == [payload(k, ROW).tobytes() for k in keys[8:]]
        stats = d.manager.get_stats()
        assert stats is not None
    finally:
        d.shutdown()


def test_corrupt_file_fails_the_promotion_and_is_recomputed_never_loaded(tmp_path: Path) -> None:
    keys = chunk_keys("corrupt", 4)
    tier = {"type": "kvtier_fs", "root_dir": str(tmp_path)}
    d = Driver(tiering_spec([tier]))
    try:
        d.store(keys)
    finally:
        d.shutdown()
    victim = next(p for p in tmp_path.rglob(f"{keys[1][:-4].hex()}.bin"))
    with open(victim, "r+b") as f:  # flip one payload byte; the size and trailer stay valid
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    d = Driver(tiering_spec([tier]))
    try:
        loaded = d.load(keys)
        assert loaded[1] is None  # a MISS: the connector recomputes it
        assert [loaded[i] for i in (0, 2, 3)] == [payload(keys[i], ROW).tobytes() for i in (0, 2, 3)]
        assert not victim.exists()  # removed, so no later request tries it again
        # The chunk is stored again on recompute, and then loads.
        d.store(keys[1:2])
        assert d.load(keys[1:2]) == [payload(keys[1], ROW).tobytes()]
    finally:
        d.shutdown()


def test_kvtier_config_error_fails_vllm_start_up(tmp_path: Path) -> None:
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path), "max_bytes": -5}])
    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[0\]\.max_bytes"):
        spec.get_manager()
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path)},
                         {"type": "kvtier_fs", "root_dir": str(tmp_path), "n_read_thread": 4}])
    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[1\].*n_read_thread"):
        spec.get_manager()
    # vLLM's manager writes every chunk through: a write policy would do nothing there.
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path), "write_policy": "write_back"}])
    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[0\]\.write_policy"):
        spec.get_manager()
    # Nor could tenant budgets: vLLM's manager owns host memory and hands tiers no request.
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path), "tenant_bytes": {"a": 1 << 20}}])
    with pytest.raises(kvtier.ConfigError, match=r"secondary_tiers\[0\]\.tenant_bytes: tenant quotas are not available"):
        spec.get_manager()
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path)}], tenant_cpu_bytes={"a": 1 << 20})
    with pytest.raises(kvtier.ConfigError, match=r"tenant_cpu_bytes: tenant quotas are not available inside vLLM"):
        spec.get_manager()


def test_reset_cache_drains_and_shutdown_leaves_nothing(tmp_path: Path) -> None:
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path / "a")},
                         {"type": "kvtier_memory", "capacity_bytes": 64 * ROW}])
    d = Driver(spec)
    region = spec._scheduler_mmap
    keys = chunk_keys("reset", 16)
    ctx = d.context()
    m = d.manager
    with m.lock:  # cascades submitted, not waited for
        m.on_new_request(ctx)
        out = m.prepare_store(keys, ctx)
        for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            d.rows[slot] = payload(key, ROW)
        m.complete_store(keys, ctx)
        m.on_request_finished(ctx)
    assert len(kvtier_threads()) == 1 + 32  # the loop, and the fs tier's I/O pool
    m.reset_cache()  # drains every tier's jobs, then asserts none is left (vLLM's own check)
    assert len(block_files(tmp_path / "a")) == 16  # drained jobs finished, none aborted
    d.shutdown()
    assert region.mmap_obj is None  # vLLM could unmap: no view of its rows is left
    assert LoopThread.running() is None and kvtier_threads() == []


def test_the_loop_starts_with_the_first_tier_not_at_import(tmp_path: Path) -> None:
    extra = {"secondary_tiers": [{"type": "kvtier_fs", "root_dir": str(tmp_path)}]}
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)  # what vLLM's API server does
    assert "kvtier:tier_failures" in metrics
    assert "kvtier_type" in TieringOffloadingSpec.config_info_keys(extra)
    assert LoopThread.running() is None
    first = Driver(tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path)}]))
    second = Driver(tiering_spec([{"type": "kvtier_memory", "capacity_bytes": 8 * ROW}]))
    loop = LoopThread.running()
    assert loop is not None and kvtier_threads().count("kvtier-vllm-loop") == 1  # shared
    first.shutdown()
    assert LoopThread.running() is loop  # still used by the second
    second.shutdown()


def test_labels_metrics_and_events_inside_vllm(tmp_path: Path) -> None:
    tiers = [{"type": "fs", "root_dir": str(tmp_path / "v")},
             {"type": "kvtier_fs", "root_dir": str(tmp_path / "k"), "enable_kv_events": True,
              "max_bytes": 2 * FILE, "locality": "LOCAL"}]
    d = Driver(tiering_spec(tiers, events=True))
    try:
        ours = d.manager.secondary_tiers[1]
        assert isinstance(ours, KvtierFsTier) and ours.label == "2:kvtier_fs" and ours.index == 1
        keys = chunk_keys("events", 4)
        d.store(keys[:2])
        d.store(keys[2:])  # the tier holds two chunks: the first two are evicted
        events = [e for e in d.manager.take_events() if e.ownership == "2:kvtier_fs"]
        stored = [k for e in events if not e.removed for k in e.keys]
        removed = [k for e in events if e.removed for k in e.keys]
        assert sorted(stored) == sorted(keys) and sorted(removed) == sorted(keys[:2])
        assert all(e.medium is Medium.STORAGE and e.locality.value == "LOCAL" for e in events)
        d.settle()
        # get_stats() is reset-on-read (vLLM sums counters, keeps the last gauge): read until the
        # loop's snapshot (refreshed every few steps) shows both evictions.
        gauges: dict = {}
        evictions = 0
        deadline = time.monotonic() + 10
        while evictions < 2 and time.monotonic() < deadline:
            d.step()
            stats = ours.get_stats()
            if stats is not None:
                data = stats.data["data"]
                gauges.update({name: data[name] for name in data if "capacity" in name or "used" in name})
                evictions += sum(data.get("kvtier:tier_evictions", {}).values())
            time.sleep(0.05)
        assert evictions == 2
        assert gauges["kvtier:tier_capacity_bytes"] == {("2:kvtier_fs",): 2 * FILE}
        assert gauges["kvtier:tier_bytes_used"] == {("2:kvtier_fs",): 2 * FILE}
        infos = d.manager.config_info()
        assert {"tier": "2:kvtier_fs", "kvtier_type": "fs"}.items() <= dict(infos[2]).items()
    finally:
        d.shutdown()


def test_readme_configuration_builds_a_working_manager(tmp_path: Path) -> None:
    """examples/vllm_config.json is the README's JSON; vLLM's own spec builds kvtier's tiers from it."""
    repo = Path(__file__).resolve().parents[2]
    text = (repo / "examples" / "vllm_config.json").read_text()
    assert text.strip() in (repo / "README.md").read_text()  # the README shows exactly this
    transfer_config = json.loads(text)
    assert transfer_config["kv_connector"] == "OffloadingConnector"
    extra = transfer_config["kv_connector_extra_config"]
    # Only where the data goes and how much of /dev/shm the host cache takes differ from the README
    # (vLLM refuses a region larger than the free /dev/shm; test machines have little).
    extra["cpu_bytes_to_use"] = 32 * ROW
    for tier in extra["secondary_tiers"]:
        if "root_dir" in tier:
            tier["root_dir"] = str(tmp_path / os.path.basename(tier["root_dir"]))
    from harness import offloading_config

    spec = TieringOffloadingSpec(offloading_config(extra))
    d = Driver(spec)
    try:
        assert [type(t).__name__ for t in d.manager.secondary_tiers] == ["KvtierFsTier"]
        assert isinstance(d.manager.primary_tier._policy, KvtierARCPolicy)
        keys = chunk_keys("readme", 4)
        d.store(keys)
    finally:
        d.shutdown()
    d = Driver(TieringOffloadingSpec(offloading_config(extra)))
    try:
        assert d.load(keys) == [payload(k, ROW).tobytes() for k in keys]
    finally:
        d.shutdown()


def test_a_store_job_larger_than_the_tier_leaves_no_stale_hit() -> None:
    """One job of 4 chunks into a 2-chunk memory tier: the first two are evicted by the last two
    before the job's result is reported; the scheduler must not believe they are there."""
    d = Driver(tiering_spec([{"type": "kvtier_memory", "capacity_bytes": 2 * ROW}]))
    try:
        keys = chunk_keys("overflow", 4)
        d.store(keys)
        (tier,) = d.manager.secondary_tiers
        ctx = d.context()
        with d.manager.lock:
            assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2 + [LookupResult.HIT] * 2
    finally:
        d.shutdown()


def test_the_readme_s3_snippet_is_a_valid_kvtier_obj_tier() -> None:
    """The README's S3 tier entry passes kvtier's validation as given."""
    import re

    from kvtier.config import TierConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Using kvtier from vLLM"):]
    snippet = json.loads(re.search(r'```json\n(\{"type": "kvtier_obj".*?)\n```', section, re.S).group(1))
    config = TierConfig.from_dict({**snippet, "type": "obj"}, 0)
    assert config.options["store_config"]["bucket"] == "my-kv-bucket"

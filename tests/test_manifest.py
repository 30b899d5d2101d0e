"""The compatibility manifest: ``model_revision`` and ``namespace_tag`` in the run fields.

Absent, the run fields, digest and names are exactly what they were before the manifest existed
(pinned below: vLLM's namespace); present, another revision or tag is another namespace, whose
chunks an engine never reads (the fs tier here, the obj tier in tests/tiers/test_obj_manifest.py).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_blocks import block_equals, fill_block

import kvtier
from kvtier import ConfigError
from kvtier.config import EngineConfig
from kvtier.layout import (
    KVGeometry,
    check_model_revision,
    check_namespace_tag,
    manifest_of,
    namespace,
    run_digest,
    run_fingerprint,
    with_manifest,
)
from kvtier.model import KVCacheGroup, KVModel

MODEL = "meta-llama/Llama-3-8B"


def geometry(tp_size: int = 2, **extra: Any) -> KVGeometry:
    return KVGeometry(MODEL, 4, 8, 128, "bfloat16", 16, tp_size=tp_size, **extra)


def hybrid(**extra: Any) -> KVModel:
    return KVModel("hybrid/m", "float16", (
        KVCacheGroup.full_attention(block_size=16, layer_names=["a.0", "a.1"], num_kv_heads=4, head_dim=64),
        KVCacheGroup.sliding_window(window=128, block_size=16, layer_names=["b.2"], num_kv_heads=4, head_dim=64),
    ), tp_size=2, **extra)


def mla() -> KVModel:
    return KVModel("deepseek", "bfloat16", (KVCacheGroup.mla(block_size=64, layer_names=["l.0"], latent_dim=576),),
                   tp_size=4)


# --- absent: exactly the fields of before ------------------------------------------------------

# Computed from the code before the manifest existed; they must never change.
PINNED_FINGERPRINT = "5191753b4879f32395ddf174edfb81a3a58458d4e773c19edccb5ddc61841cc0"


def test_without_a_manifest_the_fields_and_digests_are_unchanged() -> None:
    fields = geometry(1).run_fields(4)
    assert sorted(fields) == ["blocks_per_file", "dcp_size", "dtype", "inference_engine", "kv_cache_groups",
                              "model_name", "pcp_size", "pp_size", "tokens_per_hash", "tp_size"]
    assert run_fingerprint(fields).hex() == PINNED_FINGERPRINT
    assert run_digest(fields) == "5191753b4879"
    assert namespace("/r", fields, 1).base_dir == "/r/meta-llama_Llama-3-8B_5191753b4879"
    assert run_digest(KVModel.of(geometry(tp_size=1)).run_fields(4, "vllm")) == "f6d678c713ad"
    # At TP > 1 each engine rank persists its own heads only: the sizes are named, a tree per rank.
    sharded = KVModel.of(geometry()).run_fields(4, "vllm")
    assert (sharded["tp_size"], sharded["parallel_agnostic"]) == (2, False)
    assert namespace("/r", sharded, 1).blocks_dir.endswith("_r1")
    assert run_digest(hybrid().run_fields(2)) == "d6d32b580b6e"
    assert run_digest(mla().run_fields(1)) == "c89509ecd40b"
    assert with_manifest(fields) == fields
    assert manifest_of(fields) == {"model": MODEL, "model_revision": None, "namespace_tag": None}


def test_engine_parts_without_a_manifest_use_the_plain_run_fields() -> None:
    from kvtier.engine.build import EngineParts
    from kvtier.specs import load_spec

    config = EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 20})
    model = KVModel.of(geometry())
    parts = EngineParts(config, load_spec(config), model, None, blocks_per_chunk=4, slot_bytes=4096, num_slots=1,
                        tp_rank=0, hash_algorithm="sha256", kv_events_enabled=False)
    assert parts.run_fields == model.run_fields(4) and parts.model is model


# --- present: another namespace ----------------------------------------------------------------


def test_a_revision_or_a_tag_is_another_digest() -> None:
    plain = geometry(1).run_fields(4)
    rev_a = geometry(1, model_revision="rev-a").run_fields(4)
    rev_b = geometry(1, model_revision="rev-b").run_fields(4)
    tagged = geometry(1).run_fields(4, namespace_tag="team-1")
    assert rev_a == {**plain, "model_revision": "rev-a"}
    assert tagged == {**plain, "namespace_tag": "team-1"}
    digests = {run_digest(f) for f in (plain, rev_a, rev_b, tagged)}
    assert len(digests) == 4
    assert KVModel.of(geometry(model_revision="rev-a")).model_revision == "rev-a"
    assert KVModel.of(geometry(1, model_revision="rev-a")).run_fields(4) == rev_a
    assert hybrid(model_revision="r").run_fields(2) == {**hybrid().run_fields(2), "model_revision": "r"}
    assert manifest_of(with_manifest(plain, model_revision="rev-a", namespace_tag="t")) == {
        "model": MODEL, "model_revision": "rev-a", "namespace_tag": "t"}


@pytest.mark.parametrize("bad", ["", "a\nb", "nul\x00", "x" * 257, 7, b"rev"])
def test_a_bad_model_revision_is_a_config_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="model_revision"):
        check_model_revision(bad)
    with pytest.raises(ConfigError, match="model_revision"):
        geometry(model_revision=bad)
    with pytest.raises(ConfigError, match="model_revision"):
        hybrid(model_revision=bad)


def test_good_revisions_and_tags_pass() -> None:
    for good in (None, "x" * 256, "3f2a9c1e", "v1.2 (2026-01-05)", "main@ünïcode"):
        assert check_model_revision(good) == good
    for tag in (None, "a", "T" * 64, "team_1.prod-eu"):
        assert check_namespace_tag(tag) == tag


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x" * 65, "tag\n", 3])
def test_a_bad_namespace_tag_is_a_config_error_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="namespace_tag"):
        check_namespace_tag(bad)


# --- kvtier.open -------------------------------------------------------------------------------

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 2, 2, 16, 32


def small(**extra: Any) -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16",
                      block_size=BLOCK, **extra)


def fs_config(root: Path, **top: Any) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 * small().slot_bytes(1),
            "secondary_tiers": [{"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}],
            **top}


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(n)]


async def write(config: dict[str, Any], model: KVGeometry, chunks: list[list[int]]) -> dict[int, list[torch.Tensor]]:
    kv = device_kv()
    gen = torch.Generator().manual_seed(1)
    written = {}
    async with kvtier.open(config, model, kv) as engine:
        for i, tokens in enumerate(chunks):
            written[i] = fill_block(kv, i, gen)
            assert await engine.store(tokens, [i]) == BLOCK
        await engine.drain()
    return written


async def read(config: dict[str, Any], model: KVGeometry, chunks: list[list[int]]) -> list[int]:
    """Tokens each chunk loads in a fresh engine (an empty host tier: whatever loads is the fs tier's)."""
    kv = device_kv()
    async with kvtier.open(config, model, kv, wait_timeout_s=10) as engine:
        return [await engine.load(tokens, [16 + i]) for i, tokens in enumerate(chunks)]


def run_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.rsplit("_", 1)[-1].startswith("r"))


@pytest.mark.anyio
async def test_absent_manifest_keeps_the_namespace_of_before(tmp_path: Path) -> None:
    await write(fs_config(tmp_path), small(), prompts(2))
    digest = run_digest(KVModel.of(small()).run_fields(1))
    assert run_dirs(tmp_path) == [f"test_model_{digest}"]


@pytest.mark.anyio
async def test_a_new_revision_never_reads_the_old_revisions_chunks_on_the_fs_tier(tmp_path: Path) -> None:
    chunks = prompts(6)
    written = await write(fs_config(tmp_path, model_revision="rev-a"), small(), chunks)
    # The new revision, from the configuration or from the model description: nothing loads.
    assert await read(fs_config(tmp_path, model_revision="rev-b"), small(), chunks) == [0] * 6
    assert await read(fs_config(tmp_path), small(model_revision="rev-b"), chunks) == [0] * 6
    assert await read(fs_config(tmp_path), small(), chunks) == [0] * 6  # nor does the unversioned namespace
    assert await read(fs_config(tmp_path, namespace_tag="t"), small(model_revision="rev-a"), chunks) == [0] * 6
    names = run_dirs(tmp_path)
    rev_a = namespace(str(tmp_path), small(model_revision="rev-a").run_fields(1), 0)
    rev_b = namespace(str(tmp_path), small(model_revision="rev-b").run_fields(1), 0)
    assert rev_a.leaf in names and rev_b.leaf in names and len(names) == 4
    assert '"model_revision": "rev-a"' in (Path(rev_a.base_dir) / "config.json").read_text()

    # Even the old revision's files put where the new revision looks are never read: their
    # trailers record the old run's fingerprint.
    old_tree, new_tree = Path(rev_a.blocks_dir), Path(rev_b.blocks_dir)
    for path in old_tree.rglob("*.bin"):
        target = new_tree / path.relative_to(old_tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    assert await read(fs_config(tmp_path, model_revision="rev-b"), small(), chunks) == [0] * 6

    # The old revision still reads its own (the test would see a read across revisions).
    kv = device_kv()
    async with kvtier.open(fs_config(tmp_path), small(model_revision="rev-a"), kv, wait_timeout_s=10) as engine:
        for i, tokens in enumerate(chunks):
            assert await engine.load(tokens, [16 + i]) == BLOCK
            assert block_equals(kv, 16 + i, written[i])


@pytest.mark.anyio
async def test_a_revision_in_both_places_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_revision") as info:
        async with kvtier.open(fs_config(tmp_path, model_revision="rev-b"), small(model_revision="rev-a"), device_kv()):
            pass
    assert "rev-a" in str(info.value) and "rev-b" in str(info.value)
    # The same revision in both places is one revision.
    async with kvtier.open(fs_config(tmp_path, model_revision="rev-a"), small(model_revision="rev-a"),
                           device_kv()) as engine:
        assert engine.parts.run_fields["model_revision"] == "rev-a"
        assert engine.parts.model.model_revision == "rev-a"


@pytest.mark.anyio
async def test_the_configured_manifest_reaches_every_tier_and_the_model(tmp_path: Path) -> None:
    config = fs_config(tmp_path, model_revision="rev-c", namespace_tag="blue")
    async with kvtier.open(config, small(), device_kv()) as engine:
        (tier,) = engine.tiers
        assert engine.parts.model.model_revision == "rev-c"
        assert tier.context.run_fields == {**KVModel.of(small()).run_fields(1), "model_revision": "rev-c",
                                           "namespace_tag": "blue"}
        assert tier.namespace.fingerprint == namespace("", engine.parts.run_fields, 0).fingerprint


def test_the_peer_identity_of_p2p_follows_the_manifest() -> None:
    from kvtier.tiers.base import TierContext
    from kvtier.tiers.p2p.roles import fingerprint

    def identity(model: KVGeometry, tag: str | None = None) -> str:
        return fingerprint(TierContext(index=0, label="1:p2p", slot_bytes=model.slot_bytes(1), host=None,
                                       geometry=model, blocks_per_chunk=1,
                                       run_fields=model.run_fields(1, namespace_tag=tag)))

    ids = {identity(small()), identity(small(model_revision="a")), identity(small(model_revision="b")),
           identity(small(), "t")}
    assert len(ids) == 4
    assert identity(small(model_revision="a")) == identity(small(model_revision="a"))

"""A shared cache behind ``kvtier.open``: every issue-29 option at once, end to end.

An fs tier with a model revision, tenant budgets, private modes, compression and encryption: what
one engine stores, the next one (a new process's host memory) loads byte for byte; the files are
private and coded; another revision, or a tier without the key, loads nothing.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import KVGeometry

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 64
NUM_BLOCKS = 4
PROMPTS = 6

GEOMETRY = KVGeometry("shared/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16",
                      block_size=BLOCK)
SLOT = GEOMETRY.slot_bytes(1)


def prompt(i: int) -> list[int]:
    return [1000 * i + t for t in range(BLOCK)]


def payload(i: int) -> list[torch.Tensor]:
    """KV-like bf16 values (small Gaussians): compressible the way real KV is, not by runs of zeros."""
    seed = int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "big") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    return [(0.1 * torch.randn((2, BLOCK, HEADS, DIM), generator=gen)).to(torch.bfloat16) for _ in range(LAYERS)]


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16) for _ in range(LAYERS)]


def key_file(tmp_path: Path) -> str:
    path = tmp_path / "chunk.keys"
    path.write_text("# test keys\n1:" + "5a" * 32 + "\n")
    path.chmod(0o600)
    return str(path)


def config(root: Path, keys: str | None, **top: Any) -> dict[str, Any]:
    tier: dict[str, Any] = {"type": "fs", "root_dir": str(root), "compression": {"codec": "zstd"},
                            "tenant_bytes": {"alice": 64 * SLOT, "default": 64 * SLOT}}
    if keys is not None:
        tier["encryption"] = {"key_file": keys, "key_id": 1}
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 * SLOT, "model_revision": "rev-1",
            "tenant_cpu_bytes": {"alice": SLOT, "bob": SLOT}, "secondary_tiers": [tier], **top}


async def store_all(engine: Any, kv: list[torch.Tensor]) -> None:
    for i in range(PROMPTS):
        for layer, data in zip(kv, payload(i)):
            layer[0].copy_(data)
        tenant = "alice" if i % 2 else "bob"
        assert await engine.store(prompt(i), [0], {"tenant": tenant}) == BLOCK


async def hits(engine: Any, kv: list[torch.Tensor]) -> int:
    found = 0
    for i in range(PROMPTS):
        for layer in kv:
            layer[1].zero_()
        placed = await engine.load(prompt(i), [1], {"tenant": "alice"})
        if placed:
            assert placed == BLOCK
            for layer, data in zip(kv, payload(i)):
                assert torch.equal(layer[1], data), f"prompt {i}: other bytes loaded"
            found += 1
    return found


@pytest.mark.anyio
async def test_everything_on_round_trips_privately_and_stays_in_its_namespace(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    keys = key_file(tmp_path)
    kv = device_kv()
    async with kvtier.open(config(root, keys), GEOMETRY, kv) as engine:
        await store_all(engine, kv)
        exposition = engine.metrics.render().decode()
    files = [p for p in root.rglob("*.bin")]
    assert len(files) == PROMPTS
    for path in files:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o600, f"{path}: {mode:o}"
        assert path.stat().st_size not in (SLOT, SLOT + 4096), "a plain file where a coded one belongs"
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        if directory != root:
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    (config_json,) = root.glob("*/config.json")
    assert stat.S_IMODE(config_json.stat().st_mode) == 0o600
    assert '"model_revision": "rev-1"' in config_json.read_text()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in exposition.splitlines()
               if line.startswith("kvtier_tier_tenant_bytes_used{")}
    assert tenants == {"alice", "bob", "default"}, exposition

    # A new engine (empty host memory) on the same tree: every chunk loads, decrypted, byte for byte.
    async with kvtier.open(config(root, keys), GEOMETRY, kv) as engine:
        assert await hits(engine, kv) == PROMPTS
    # Another revision: another namespace, nothing found.
    async with kvtier.open(config(root, keys, model_revision="rev-2"), GEOMETRY, kv) as engine:
        assert await hits(engine, kv) == 0
    # The same revision without the key: the encrypted chunks are misses, never bytes.
    async with kvtier.open(config(root, None), GEOMETRY, kv) as engine:
        assert await hits(engine, kv) == 0
    assert not any(os.access(p, os.F_OK) for p in files), "files refused as no_key are removed by a load"

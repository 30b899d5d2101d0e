"""Tenant isolation through extra keys: a request finds only chunks stored with its own salt,
LoRA adapter, multimodal items and prompt embeddings — in host memory, in an fs tier shared by
several engines, and through the blocking facade — and its keys are vLLM 0.33's.

Chunks here are two device blocks, so a salt (hashed into block 0 only) reaches a chunk key only
through the hash chain.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_blocks import block_equals, fill_block
from test_keys import EXTRA_KEY_BLOCK_SIZE, EXTRA_KEY_CASES, EXTRA_KEY_VECTORS

import kvtier
from kvtier import KVGeometry
from kvtier.events import BlockStored

BLOCK = 4
BPC = 2  # device blocks per chunk
CHUNK = BLOCK * BPC
LAYERS = 2
HEADS = 2
DIM = 8
NUM_BLOCKS = 48


def geometry() -> KVGeometry:
    return KVGeometry("test/tenants", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def config(tiers: list[dict] | None = None, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cpu_bytes_to_use": 16 * geometry().slot_bytes(BPC), "blocks_per_chunk": BPC}
    if tiers:
        cfg.update(spec_name="TieringOffloadingSpec", secondary_tiers=tiers)
    cfg.update(over)
    return cfg


def fs_tier(root: Path) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1,
            "rescan_interval_s": 3600.0}


PROMPT = [random.Random(7).randrange(1, 50_000) for _ in range(3 * CHUNK)]
EMBEDS = torch.randn((3 * CHUNK, 16), generator=torch.Generator().manual_seed(5))

# (mine, other): the same prompt stored with `mine` must be invisible to `other` and to a plain
# request. Each pair differs in one input only.
PAIRS = {
    "salt": ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
    "lora_adapter": ({"lora_name": "sql", "lora_path": "/adapters/sql"},
                     {"lora_name": "chat", "lora_path": "/adapters/chat"}),
    "lora_repointed": ({"lora_name": "sql", "lora_path": "/adapters/sql-v1"},
                       {"lora_name": "sql", "lora_path": "/adapters/sql-v2"}),
    "salt_with_lora": ({"cache_salt": "tenant-a", "lora_name": "sql", "lora_path": "/adapters/sql"},
                       {"lora_name": "sql", "lora_path": "/adapters/sql"}),
    "image": ({"mm_items": [("image-1", 2, 9)]}, {"mm_items": [("image-2", 2, 9)]}),
    "image_position": ({"mm_items": [("image-1", 2, 9)]}, {"mm_items": [("image-1", 3, 9)]}),
    "prompt_embeds": ({"prompt_embeds": EMBEDS}, {"prompt_embeds": EMBEDS + 1}),
}


@pytest.mark.anyio
@pytest.mark.parametrize("pair", sorted(PAIRS))
async def test_host_memory_serves_a_chunk_only_to_its_own_keys(pair: str) -> None:
    mine, other = PAIRS[pair]
    kv = device_kv()
    gen = torch.Generator().manual_seed(1)
    async with kvtier.open(config(), geometry(), kv) as engine:
        data = [fill_block(kv, b, gen) for b in range(6)]
        assert await engine.store(PROMPT, list(range(6)), **mine) == 3 * CHUNK
        assert engine.cached_prefix_tokens(PROMPT, **mine) == 3 * CHUNK
        for keys in (other, {}):
            assert engine.cached_prefix_tokens(PROMPT, **keys) == 0
            assert await engine.load(PROMPT, list(range(10, 16)), **keys) == 0
            async with engine.load_layerwise(PROMPT, list(range(10, 16)), **keys) as layers:
                assert layers.tokens == 0 and [g async for g in layers] == [(0, 1), (1, 2)]
        assert not any(layer[10:16].any() for layer in kv)
        assert not set(engine.chunk_keys(PROMPT, **mine)) & set(engine.chunk_keys(PROMPT, **other))

        # The other tenant's copy of the same prompt is stored beside, not deduplicated into, mine.
        theirs = [fill_block(kv, b, gen) for b in range(6, 12)]
        assert await engine.store(PROMPT, list(range(6, 12)), **other) == 3 * CHUNK
        outcome = await engine.load_with_sources(PROMPT, list(range(20, 26)), **mine)
        assert outcome.tokens == 3 * CHUNK and outcome.tokens_by_tier == {"0:primary": 3 * CHUNK}
        assert all(block_equals(kv, 20 + b, data[b]) for b in range(6))
        assert await engine.load(PROMPT, list(range(30, 36)), **other) == 3 * CHUNK
        assert all(block_equals(kv, 30 + b, theirs[b]) for b in range(6))
        # Layer-wise loading keys the request the same way: each tenant gets its own bytes.
        for keys, expected in ((mine, data), (other, theirs)):
            async with engine.load_layerwise(PROMPT, list(range(40, 46)), **keys) as layers:
                assert layers.tokens_by_tier == {"0:primary": 3 * CHUNK}
                assert [g async for g in layers] == [(0, 1), (1, 2)]
            assert all(block_equals(kv, 40 + b, expected[b]) for b in range(6))


@pytest.mark.anyio
@pytest.mark.parametrize("pair", ["salt", "lora_adapter", "image"])
async def test_a_shared_fs_tier_serves_a_chunk_only_to_its_own_keys(pair: str, tmp_path: Path) -> None:
    mine, other = PAIRS[pair]
    kv = device_kv()
    gen = torch.Generator().manual_seed(2)
    async with kvtier.open(config([fs_tier(tmp_path)]), geometry(), kv) as writer:
        data = [fill_block(kv, b, gen) for b in range(6)]
        assert await writer.store(PROMPT, list(range(6)), **mine) == 3 * CHUNK
        await writer.drain()
    # A second engine on the same root, with empty host memory: everything it finds is on disk.
    # load waits for the fs tier's probes, so a 0 is a verdict, not "not known yet".
    async with kvtier.open(config([fs_tier(tmp_path)]), geometry(), kv) as reader:
        for keys in (other, {}):
            assert await reader.load(PROMPT, list(range(10, 16)), **keys) == 0
        assert not any(layer[10:16].any() for layer in kv)
        outcome = await reader.load_with_sources(PROMPT, list(range(20, 26)), **mine)
        assert outcome.tokens_by_tier == {"1:fs": 3 * CHUNK}
        assert all(block_equals(kv, 20 + b, data[b]) for b in range(6))
        async with reader.load_layerwise(PROMPT, list(range(30, 36)), **other) as layers:
            assert layers.tokens == 0
        await reader.reset_cache()  # host memory forgets: the layer-wise load promotes from disk
        async with reader.load_layerwise(PROMPT, list(range(30, 36)), **mine) as layers:
            assert layers.tokens_by_tier == {"1:fs": 3 * CHUNK}
            assert len([g async for g in layers]) == LAYERS
        assert all(block_equals(kv, 30 + b, data[b]) for b in range(6))
        assert reader.cached_prefix_tokens(PROMPT, **mine) == 3 * CHUNK


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(EXTRA_KEY_CASES))
async def test_chunk_keys_are_vllms(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Literal vectors computed by vLLM 0.33 itself (tests/test_keys.py says how); one block per
    # chunk, so every block hash is a chunk key.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    geo = KVGeometry("test/vectors", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                     block_size=EXTRA_KEY_BLOCK_SIZE)
    case = dict(EXTRA_KEY_CASES[name])
    tokens = case.pop("tokens")
    async with kvtier.open({"cpu_bytes_to_use": 4 * geo.slot_bytes(1)}, geo) as engine:
        keys = engine.chunk_keys(tokens, **case)
    assert keys == [bytes.fromhex(h) + bytes(4) for h in EXTRA_KEY_VECTORS[name]]


def test_the_blocking_facade_passes_the_extra_keys_through() -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(3)
    mine = {"cache_salt": "tenant-a", "lora_name": "sql", "lora_path": "/adapters/sql",
            "mm_items": [("image-1", 2, 9)], "prompt_embeds": EMBEDS}
    engine = kvtier.start_in_thread(config(), geometry(), kv)
    try:
        data = [fill_block(kv, b, gen) for b in range(6)]
        assert engine.chunk_keys(PROMPT, **mine) == engine.engine.chunk_keys(PROMPT, **mine)
        assert engine.chunk_keys(PROMPT, **mine) != engine.chunk_keys(PROMPT)
        assert engine.store(PROMPT, list(range(6)), **mine) == 3 * CHUNK
        assert engine.cached_prefix_tokens(PROMPT, **mine) == 3 * CHUNK
        for dropped in (("cache_salt",), ("lora_name", "lora_path"), ("mm_items",), ("prompt_embeds",)):
            partial = {k: v for k, v in mine.items() if k not in dropped}  # any one missing: a miss
            assert engine.cached_prefix_tokens(PROMPT, **partial) == 0
            assert engine.load(PROMPT, list(range(10, 16)), **partial) == 0
            with engine.load_layerwise(PROMPT, list(range(10, 16)), **partial) as layers:
                assert layers.tokens == 0
        assert engine.load_with_sources(PROMPT, list(range(20, 26)), **mine).tokens == 3 * CHUNK
        assert all(block_equals(kv, 20 + b, data[b]) for b in range(6))
        with engine.load_layerwise(PROMPT, list(range(30, 36)), **mine) as layers:
            assert layers.tokens == 3 * CHUNK and len(list(layers)) == LAYERS
        assert all(block_equals(kv, 30 + b, data[b]) for b in range(6))
        with pytest.raises(ValueError, match="cache_salt"):
            engine.load(PROMPT, list(range(10, 16)), cache_salt="")
    finally:
        engine.close()


BAD = {
    "empty_salt": ({"cache_salt": ""}, ValueError, "cache_salt"),
    "salt_type": ({"cache_salt": b"tenant"}, TypeError, "cache_salt"),
    "lora_without_path": ({"lora_name": "sql"}, ValueError, "lora_path"),
    "overlapping_items": ({"mm_items": [("a", 0, 5), ("b", 4, 1)]}, ValueError, "overlap"),
    "embeds_type": ({"prompt_embeds": [[0.5]]}, TypeError, "prompt_embeds"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["load", "load_with_sources", "load_layerwise", "store",
                                    "cached_prefix_tokens", "chunk_keys"])
async def test_bad_extra_keys_raise_at_the_call(method: str) -> None:
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        for bad, error, message in BAD.values():
            with pytest.raises(error, match=message):
                if method in ("load", "load_with_sources", "store"):
                    await getattr(engine, method)(PROMPT, list(range(6)), **bad)
                elif method == "load_layerwise":  # at the call, before the `async with`
                    engine.load_layerwise(PROMPT, list(range(6)), **bad)
                else:
                    getattr(engine, method)(PROMPT, **bad)
        stats = engine.statistics()
        assert stats["0:primary"].used_slots == 0 and stats["copies"].bytes_to_host == 0


@pytest.mark.anyio
async def test_self_describing_events_name_the_lora_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    published: list[Any] = []
    events = {"endpoint": "tcp://127.0.0.1:*"}
    async with kvtier.open(config(self_describing_kv_events=True), geometry(), device_kv(),
                           events=events) as engine:
        real_publish = engine.publisher.publish

        def capture(batch: Any, ts: float | None = None) -> bool:
            published.extend(batch)
            return bool(real_publish(batch, ts))

        monkeypatch.setattr(engine.publisher, "publish", capture)
        await engine.store(PROMPT[:CHUNK], [0, 1], lora_name="sql", lora_path="/adapters/sql")
        await engine.store(PROMPT[CHUNK:], [2, 3, 4, 5])
    stored = [e for e in published if isinstance(e, BlockStored)]
    assert [(len(e.token_ids), e.lora_name) for e in stored] == [(CHUNK, "sql"), (CHUNK, None), (CHUNK, None)]

"""Hybrid models through ``kvtier.open``: what each KV-cache group loads and stores, with real bytes.

The model: a full-attention group (block 4), a sliding-window group (block 4, window 8) and a
Mamba state group (block 8, two state tensors of different dtypes). With ``blocks_per_chunk`` 1 a
full/window chunk is 4 tokens and a state chunk 8 tokens, so every hit is a multiple of 8.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server

import kvtier
from kvtier import ConfigError, KVCacheGroup, KVModel

BLOCK = 4
STATE_BLOCK = 8
WINDOW = 8
HEADS = 2
DIM = 8
NUM_BLOCKS = 48
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SWA = ["model.layers.1.self_attn.attn"]
STATE = ["model.layers.3.mixer"]
STATE_SHAPES = [(3, 8), (2, 4, 4)]


def model() -> KVModel:
    return KVModel("test/hybrid", "float16", groups=(
        KVCacheGroup.full_attention(block_size=BLOCK, layer_names=FULL, num_kv_heads=HEADS, head_dim=DIM),
        KVCacheGroup.sliding_window(window=WINDOW, block_size=BLOCK, layer_names=SWA, num_kv_heads=HEADS,
                                    head_dim=DIM),
        KVCacheGroup.mamba(block_size=STATE_BLOCK, layer_names=STATE, state_shapes=STATE_SHAPES,
                           state_dtypes=["float16", "float32"]),
    ))


def device_kv(seed: int | None = None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed or 0)

    def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if seed is None:
            return torch.zeros(shape, dtype=dtype)
        return torch.randn(shape, generator=gen).to(dtype)

    kv: dict[str, Any] = {name: tensor((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), torch.float16) for name in FULL + SWA}
    for name in STATE:
        kv[name] = (tensor((NUM_BLOCKS, *STATE_SHAPES[0]), torch.float16),
                    tensor((NUM_BLOCKS, *STATE_SHAPES[1]), torch.float32))
    return kv


def config(tiers: list[dict[str, Any]] | None = None, slots: int = 64) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * model().slot_bytes(1),
            "secondary_tiers": tiers or []}


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def blocks(n_tokens: int, offset: int = 0) -> list[list[int]]:
    """One block table per group: full and window blocks of 4 tokens, state blocks of 8."""
    return [list(range(offset, offset + n_tokens // BLOCK)), list(range(offset, offset + n_tokens // BLOCK)),
            list(range(offset, offset + n_tokens // STATE_BLOCK))]


def layer_blocks(kv: dict[str, Any], name: str, block: int) -> list[torch.Tensor]:
    value = kv[name]
    return [t[block].clone() for t in value] if isinstance(value, tuple) else [value[block].clone()]


def zero(kv: dict[str, Any]) -> None:
    for value in kv.values():
        for t in value if isinstance(value, tuple) else (value,):
            t.zero_()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def untouched(kv: dict[str, Any], name: str, block: int) -> bool:
    return all(not t.any() for t in layer_blocks(kv, name, block))


async def store_prompt(engine: kvtier.Engine, prompt: list[int]) -> None:
    assert await engine.store(prompt, blocks(len(prompt))) > 0
    await engine.drain()


@pytest.mark.anyio
async def test_window_and_state_groups_load_only_what_the_model_needs() -> None:
    source = device_kv(seed=1)
    prompt = tokens(32)
    async with kvtier.open(config(), model(), source) as engine:
        await store_prompt(engine, prompt)
        zero(source)
        loaded_before = engine.statistics()["copies"].bytes_to_device
        # The caller passes the prompt without its last token: hits are multiples of 8 -> 24.
        assert await engine.load(prompt[:-1], blocks(32, offset=16)) == 24
        copied = engine.statistics()["copies"].bytes_to_device - loaded_before
    reference = device_kv(seed=1)
    page = 2 * BLOCK * HEADS * DIM * 2
    state_page = 3 * 8 * 2 + 2 * 4 * 4 * 4
    # Full attention: chunks 0..5 (two layers); window: chunks 4, 5 (tokens 16..24); state: after token 24.
    assert copied == 6 * 2 * page + 2 * page + state_page
    for chunk in range(6):
        for name in FULL:
            assert same(layer_blocks(source, name, 16 + chunk), layer_blocks(reference, name, chunk))
    for chunk in range(6):
        if chunk in (4, 5):
            assert same(layer_blocks(source, SWA[0], 16 + chunk), layer_blocks(reference, SWA[0], chunk))
        else:
            assert untouched(source, SWA[0], 16 + chunk), f"window chunk {chunk} is outside the window"
    # The state after token 24 sits in state block 24 // 8 - 1 = 2 of the request's table.
    assert same(layer_blocks(source, STATE[0], 16 + 2), layer_blocks(reference, STATE[0], 2))
    for other in (16, 17, 19):
        assert untouched(source, STATE[0], other)


@pytest.mark.anyio
async def test_stores_keep_only_the_window_and_the_state_at_the_boundary() -> None:
    prompt = tokens(40)
    async with kvtier.open(config(), model(), device_kv(seed=2)) as engine:
        await store_prompt(engine, prompt)
        full_keys = engine.chunk_keys(prompt)
        window_keys = engine.chunk_keys(prompt, group=1)
        state_keys = engine.chunk_keys(prompt, group=2)
        assert len(full_keys) == 10 and len(window_keys) == 10 and len(state_keys) == 5
        host = engine.host
        assert all(host.lookup(k).name == "HIT" for k in full_keys)
        # Hits of 40 (a continuation) and 32 (the prompt again, without its last token) need the
        # window chunks 6..9 and the states after tokens 32 and 40.
        assert [host.lookup(k).name for k in window_keys] == ["MISS"] * 6 + ["HIT"] * 4
        assert [host.lookup(k).name for k in state_keys] == ["MISS"] * 3 + ["HIT"] * 2


@pytest.mark.anyio
async def test_a_missing_state_chunk_lowers_the_hit_to_a_state_that_exists(tmp_path: Path) -> None:
    source = device_kv(seed=3)
    prompt = tokens(32)
    fs = [{"type": "fs", "root_dir": str(tmp_path)}]
    async with kvtier.open(config(fs), model(), source) as engine:
        await store_prompt(engine, prompt[:16])  # the states after tokens 8 and 16
        await store_prompt(engine, prompt)  # the states after tokens 24 and 32
        await engine.reset_cache()
        tree = engine.tiers[0].namespace
        for state in engine.chunk_keys(prompt, group=2)[2:]:
            Path(tree.chunk_path(state)).unlink()
        zero(source)
        # Full attention and the window hold up to 32, the states only up to 16: the hit is 16.
        assert await engine.load(prompt, blocks(32, offset=16)) == 16
    reference = device_kv(seed=3)
    # The state loaded is the one after token 16 (state block 1), from the first store.
    assert same(layer_blocks(source, STATE[0], 16 + 1), layer_blocks(reference, STATE[0], 1))
    assert untouched(source, STATE[0], 16 + 3)
    for chunk in range(4, 8):  # full attention stops at the hit
        assert untouched(source, FULL[0], 16 + chunk)


@pytest.mark.anyio
async def test_window_chunks_outside_the_window_are_not_read_from_the_fs_tier(tmp_path: Path) -> None:
    prompt = tokens(48)
    fs = [{"type": "fs", "root_dir": str(tmp_path)}]
    async with kvtier.open(config(fs), model(), device_kv(seed=4)) as engine:
        await store_prompt(engine, prompt[:24])  # window chunks 2..5, the states at 16 and 24
        await store_prompt(engine, prompt)  # window chunks 8..11, the states at 40 and 48
        await engine.reset_cache()
        read_before = engine.tiers[0].statistics().bytes_read
        assert await engine.load(prompt, blocks(48)) == 48
        chunks_read = (engine.tiers[0].statistics().bytes_read - read_before) // model().slot_bytes(1)
    # Full chunks 0..11, window chunks 10 and 11, the state at 48: no other window chunk or state.
    assert chunks_read == 12 + 2 + 1


def obj_tier(server: S3Server, bucket: str) -> dict[str, Any]:
    store = {"bucket": bucket, "endpoint_override": server.endpoint, "scheme": "http",
             "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY, "region": "us-east-1"}
    return {"type": "obj", "store_config": store, "prefix": "kv", "request_timeout_s": 2.0}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the obj tier needs asyncio (aiobotocore)
@pytest.mark.anyio
async def test_every_group_round_trips_through_fs_and_obj_tiers(tmp_path: Path, s3_server: S3Server,
                                                                s3_bucket: str) -> None:
    prompt = tokens(33)
    for tiers in ([{"type": "fs", "root_dir": str(tmp_path)}], [obj_tier(s3_server, s3_bucket)]):
        source = device_kv(seed=5)
        async with kvtier.open(config(tiers), model(), source) as engine:
            await store_prompt(engine, prompt)
            await engine.reset_cache()
            zero(source)
            sources = await engine.load_with_sources(prompt[:-1], blocks(32, offset=8))
            assert sources.tokens == 32
            assert set(sources.tokens_by_tier) == {engine.tiers[0].context.label}
        reference = device_kv(seed=5)
        for chunk in range(8):
            assert same(layer_blocks(source, FULL[1], 8 + chunk), layer_blocks(reference, FULL[1], chunk))
        for chunk in (6, 7):
            assert same(layer_blocks(source, SWA[0], 8 + chunk), layer_blocks(reference, SWA[0], chunk))
        assert same(layer_blocks(source, STATE[0], 8 + 3), layer_blocks(reference, STATE[0], 3))


@pytest.mark.anyio
async def test_layerwise_loads_every_group_in_model_layer_order() -> None:
    source = device_kv(seed=6)
    prompt = tokens(16)
    async with kvtier.open(config(), model(), source) as engine:
        await store_prompt(engine, prompt)
        zero(source)
        seen = []
        async with engine.load_layerwise(prompt, blocks(16, offset=20)) as layers:
            assert layers.tokens == 16
            async for group in layers:
                seen.append((group.start, group.stop))
    assert seen == [(0, 1), (1, 2), (2, 3), (3, 4)]
    reference = device_kv(seed=6)
    assert same(layer_blocks(source, FULL[1], 20 + 3), layer_blocks(reference, FULL[1], 3))
    assert same(layer_blocks(source, SWA[0], 20 + 2), layer_blocks(reference, SWA[0], 2))
    assert same(layer_blocks(source, STATE[0], 20 + 1), layer_blocks(reference, STATE[0], 1))


@pytest.mark.anyio
async def test_misuse_of_a_hybrid_model_raises_at_the_call() -> None:
    async with kvtier.open(config(), model(), device_kv()) as engine:
        with pytest.raises(TypeError, match="one sequence of block ids per KV-cache group"):
            await engine.load(tokens(8), [0, 1])
        with pytest.raises(ValueError, match="3 KV-cache groups"):
            await engine.store(tokens(8), [[0, 1], [0, 1]])
        with pytest.raises(ValueError, match=r"block_ids\[0\]"):
            await engine.store(tokens(8), [[0, 0], [0, 1], [0]])
    with pytest.raises(ConfigError, match="share one block size"):
        async with kvtier.open({**config(), "block_size": 8}, model(), device_kv()):
            pass


@pytest.mark.anyio
async def test_self_describing_events_describe_full_attention_chunks_and_name_each_groups_kind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    published: list[Any] = []
    settings = {**config(), "self_describing_kv_events": True}
    async with kvtier.open(settings, model(), device_kv(seed=7), events={"endpoint": "tcp://127.0.0.1:*"}) as engine:
        monkeypatch.setattr(engine.publisher, "publish", lambda events: published.extend(events))
        await store_prompt(engine, tokens(16))
    stored: dict[int, list[Any]] = {}
    for event in published:
        if type(event).__name__ == "BlockStored":
            stored.setdefault(event.group_idx, []).append(event)
    full, window, state = stored[0], stored[1], stored[2]
    assert [len(e.token_ids) for e in full] == [BLOCK] * 4 and {e.block_size for e in full} == {BLOCK}
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in full} == {("full_attention", None)}
    # Other groups keep placeholders (their key alone), naming their kind as vLLM does.
    assert len(window) == 4 and all(e.token_ids == [] and e.block_size == 0 for e in window)
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in window} == {("sliding_window", WINDOW)}
    assert len(state) == 2 and {e.kv_cache_spec_kind for e in state} == {"mamba"}


@pytest.mark.anyio
async def test_a_group_may_be_given_as_one_cross_layer_tensor() -> None:
    per_layer = device_kv(seed=8)
    # The full-attention group as one tensor [num_blocks, layers, 2, block, heads, dim], same bytes.
    cross = {0: torch.stack([per_layer[name] for name in FULL], dim=1).contiguous(),
             **{name: per_layer[name] for name in SWA + STATE}}
    prompt = tokens(16)
    async with kvtier.open(config(), model(), cross) as engine:
        await store_prompt(engine, prompt)
        zero(cross)
        assert await engine.load(prompt, blocks(16, offset=20)) == 16
    reference = device_kv(seed=8)
    for chunk in range(4):
        for layer, name in enumerate(FULL):
            assert torch.equal(cross[0][20 + chunk, layer], reference[name][chunk])
    with pytest.raises(ConfigError, match="given whole"):
        async with kvtier.open(config(), model(), {**cross, FULL[0]: per_layer[FULL[0]]}):
            pass
    with pytest.raises(ConfigError, match=r"device_kv\[0\].*expected"):
        async with kvtier.open(config(), model(), {**cross, 0: cross[0][:, :1].contiguous()}):
            pass

"""Warm-up: ``Engine.prefetch`` promotes a prefix held by secondary tiers into host memory.

Every test seeds a secondary tier the ordinary way (store, drain, then ``reset_cache`` so host
memory forgets the prefix), prefetches, and checks what a load then finds in host memory.
"""

from __future__ import annotations

import inspect
import math
import random
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from kv_blocks import block_equals, fill_block
from prometheus_client.parser import text_string_to_metric_families
from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server

import kvtier
from kvtier import EngineClosedError, KVCacheGroup, KVGeometry, KVModel
from kvtier.engine.prefetch import PrefetchOutcome
from kvtier.types import LookupResult

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 64
CHUNKS = 4
TOKENS = CHUNKS * BLOCK


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


SLOT_BYTES = geometry().slot_bytes(1)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def config(tiers: list[dict[str, Any]], slots: int = 16) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * SLOT_BYTES, "secondary_tiers": tiers}


def memory() -> dict[str, Any]:
    return {"type": "memory", "capacity_bytes": 1 << 24}


def prompt(seed: int, tokens: int = TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(tokens)]


async def seed_tier(engine: kvtier.Engine, kv: list[torch.Tensor], tokens: list[int], first_block: int = 0,
                    *, forget: bool = True, **extras: Any) -> list[list[torch.Tensor]]:
    """Store ``tokens`` from device blocks ``first_block...`` with known bytes, wait for the cascade,
    then (``forget``) empty host memory: only the secondary tiers hold the prefix."""
    gen = torch.Generator().manual_seed(len(tokens) * 1000 + first_block)
    blocks = list(range(first_block, first_block + len(tokens) // BLOCK))
    data = [fill_block(kv, b, gen) for b in blocks]
    assert await engine.store(tokens, blocks, **extras) == len(tokens)
    await engine.drain()
    if forget:
        await engine.reset_cache()
    return data


def loaded_bytes_equal(kv: list[torch.Tensor], first_block: int, data: list[list[torch.Tensor]]) -> bool:
    return all(block_equals(kv, first_block + i, expected) for i, expected in enumerate(data))


def metric(engine: kvtier.Engine, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name}{labels} not exported")


async def until(condition: Any, timeout: float = 10.0) -> None:
    """Wait (bounded) for a condition the engine's own tasks make true."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.005)


async def prefetch_then_load_from_host(engine: kvtier.Engine, kv: list[torch.Tensor], label: str,
                                       **prefetch_args: Any) -> None:
    tokens = prompt(1)
    data = await seed_tier(engine, kv, tokens, **prefetch_args)
    if prefetch_args:
        assert (await engine.prefetch(tokens)).tokens == 0  # other extra keys: other chunks
    outcome = await engine.prefetch(tokens, **prefetch_args)
    assert outcome == PrefetchOutcome(TOKENS, {label: CHUNKS}, 0, False)
    assert engine.statistics()["0:primary"].pinned_slots == 0  # nothing stays pinned
    for layer in kv:
        layer.zero_()
    loaded = await engine.load_with_sources(tokens, list(range(20, 20 + CHUNKS)), **prefetch_args)
    assert loaded.tokens == TOKENS and loaded.tokens_by_tier == {"0:primary": TOKENS}
    assert loaded_bytes_equal(kv, 20, data)
    # A second warm-up finds everything in host memory and promotes nothing.
    read = engine.statistics()[label].bytes_read
    assert await engine.prefetch(tokens, **prefetch_args) == PrefetchOutcome(TOKENS, {"0:primary": CHUNKS}, 0, False)
    assert engine.statistics()[label].bytes_read == read == CHUNKS * SLOT_BYTES


# ---------------------------------------------------------------------------------------------- tiers
@pytest.mark.anyio
async def test_prefetch_from_the_memory_tier_then_the_load_is_served_from_host_memory() -> None:
    kv = device_kv()
    async with kvtier.open(config([memory()]), geometry(), kv) as engine:
        await prefetch_then_load_from_host(engine, kv, "1:memory")


@pytest.mark.anyio
async def test_prefetch_from_the_fs_tier_then_the_load_is_served_from_host_memory(tmp_path: Path) -> None:
    kv = device_kv()
    async with kvtier.open(config([{"type": "fs", "root_dir": str(tmp_path)}]), geometry(), kv) as engine:
        await prefetch_then_load_from_host(engine, kv, "1:fs", cache_salt="tenant-a")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the obj tier is asyncio-only (aiobotocore)
async def test_prefetch_from_the_obj_tier_then_the_load_is_served_from_host_memory(
        s3_server: S3Server, s3_bucket: str) -> None:
    store = {"bucket": s3_bucket, "endpoint_override": s3_server.endpoint, "scheme": "http",
             "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY, "region": "us-east-1"}
    obj = {"type": "obj", "store_config": store, "prefix": "kv/warm", "request_timeout_s": 2.0,
           "lookup_timeout_s": 2.0}
    kv = device_kv()
    async with kvtier.open(config([obj]), geometry(), kv) as engine:
        await prefetch_then_load_from_host(engine, kv, "1:obj")


@pytest.mark.anyio
async def test_tiers_and_kv_load_tiers_are_intersected_and_max_load_tokens_caps(tmp_path: Path) -> None:
    kv = device_kv()
    tiers = [memory(), {"type": "fs", "root_dir": str(tmp_path)}]
    async with kvtier.open(config(tiers), geometry(), kv) as engine:
        tokens = prompt(2)
        await seed_tier(engine, kv, tokens)
        # Both tiers hold the prefix; memory is asked first unless the call narrows the tiers.
        nothing = await engine.prefetch(tokens, {"kv_load_tiers": ["memory"]}, tiers=["fs"])
        assert nothing == PrefetchOutcome(0, {}, 0, False)
        assert await engine.prefetch(tokens, tiers=[]) == PrefetchOutcome(0, {}, 0, False)
        capped = await engine.prefetch(tokens, {"max_load_tokens": 2 * BLOCK + 1}, tiers=["2:FS"])
        assert capped == PrefetchOutcome(2 * BLOCK, {"2:fs": 2}, 0, False)
        rest = await engine.prefetch(tokens, {"kv_load_tiers": [{"medium": "CPU"}]}, tiers=[0, 1])
        assert rest == PrefetchOutcome(TOKENS, {"0:primary": 2, "1:memory": 2}, 0, False)
        assert engine.statistics()["1:memory"].bytes_read == 2 * SLOT_BYTES


# ---------------------------------------------------------------------------------------------- races
def slow_tier(engine: kvtier.Engine, latency_s: float) -> Any:
    """From now on every read (and write) of the engine's faulty tier takes ``latency_s``."""
    tier = engine.tiers[0]
    tier.latency_s = latency_s
    return tier


@pytest.mark.anyio
@pytest.mark.parametrize("first", ["prefetch", "load"])
async def test_a_prefetch_and_a_load_of_the_same_prefix_share_one_promotion(first: str) -> None:
    kv = device_kv()
    async with kvtier.open(config([{"type": "faulty", "capacity_bytes": 1 << 24}]), geometry(), kv) as engine:
        tokens = prompt(3)
        data = await seed_tier(engine, kv, tokens)
        tier = slow_tier(engine, 0.05)
        for layer in kv:
            layer.zero_()
        results: dict[str, Any] = {}

        async def prefetch() -> None:
            results["prefetch"] = await engine.prefetch(tokens)

        async def load() -> None:
            results["load"] = await engine.load_with_sources(tokens, list(range(30, 30 + CHUNKS)))

        calls = {"prefetch": prefetch, "load": load}
        async with anyio.create_task_group() as tg:
            tg.start_soon(calls[first])
            # The first call's promotions are in flight before the second asks.
            await until(lambda: engine.statistics()["0:primary"].write_pending == CHUNKS)
            tg.start_soon(calls["load" if first == "prefetch" else "prefetch"])
        assert results["load"].tokens == TOKENS and loaded_bytes_equal(kv, 30, data)
        assert results["prefetch"].tokens == TOKENS
        promoter = "1:faulty"
        if first == "prefetch":
            assert results["prefetch"].chunks_by_tier == {promoter: CHUNKS}
            assert results["load"].tokens_by_tier == {"0:primary": TOKENS}  # it joined the prefetch's
            assert engine.parts.prefetches.statistics().hits == CHUNKS
        else:
            assert results["load"].tokens_by_tier == {promoter: TOKENS}
            assert results["prefetch"].chunks_by_tier == {"0:primary": CHUNKS}
            assert engine.parts.prefetches.statistics().chunks == {}
        stats = tier.statistics()
        assert stats.loads_completed == 1 and stats.bytes_read == CHUNKS * SLOT_BYTES  # each chunk read once
        assert engine.statistics()["0:primary"].pinned_slots == 0


# ---------------------------------------------------------------------------------------------- capacity
@pytest.mark.anyio
async def test_a_full_host_tier_is_evicted_only_when_allowed() -> None:
    kv = device_kv()
    async with kvtier.open(config([memory()], slots=4), geometry(), kv) as engine:
        warm = prompt(4, 2 * BLOCK)
        await seed_tier(engine, kv, warm, 0)
        others = [prompt(10 + i, BLOCK) for i in range(4)]
        for i, other in enumerate(others):  # four requests fill host memory (ready, unpinned)
            await seed_tier(engine, kv, other, 10 + i, forget=False)
        host = engine.statistics()["0:primary"]
        assert host.used_slots == 4 and host.evictable == 4
        assert await engine.prefetch(warm, evict=False) == PrefetchOutcome(0, {}, 0, False)
        assert engine.statistics()["0:primary"].evictions == host.evictions  # nothing evicted
        outcome = await engine.prefetch(warm)  # evict=True: the two least recently used go
        assert outcome == PrefetchOutcome(2 * BLOCK, {"1:memory": 2}, 0, False)
        assert engine.statistics()["0:primary"].evictions == host.evictions + 2
        held = [await engine.load(other, [40], {"kv_load_tiers": []}) for other in others]
        assert held == [0, 0, BLOCK, BLOCK]


@pytest.mark.anyio
async def test_without_eviction_only_free_slots_are_filled_prefix_first() -> None:
    kv = device_kv()
    async with kvtier.open(config([memory()], slots=4), geometry(), kv) as engine:
        tokens = prompt(5)
        await seed_tier(engine, kv, tokens)
        for i in range(3):  # three of the four slots taken
            await seed_tier(engine, kv, prompt(20 + i, BLOCK), 20 + i, forget=False)
        outcome = await engine.prefetch(tokens, evict=False)
        assert outcome == PrefetchOutcome(BLOCK, {"1:memory": 1}, 0, False)
        keys = engine.chunk_keys(tokens)
        assert [engine.host.lookup(k) for k in keys] == [LookupResult.HIT] + [LookupResult.MISS] * 3
        assert engine.statistics()["0:primary"].evictions == 0


@pytest.mark.anyio
async def test_chunks_pinned_by_a_request_are_never_evicted_for_a_prefetch() -> None:
    kv = device_kv()
    async with kvtier.open(config([memory()], slots=4), geometry(), kv) as engine:
        warm = prompt(6, 2 * BLOCK)
        await seed_tier(engine, kv, warm)
        busy = prompt(7)
        await seed_tier(engine, kv, busy, 10, forget=False)  # fills host memory
        async with engine.load_layerwise(busy, list(range(40, 44)), layers_per_group=LAYERS) as layers:
            assert layers.tokens == TOKENS  # its four chunks are pinned until the block is left
            assert await engine.prefetch(warm) == PrefetchOutcome(0, {}, 0, False)
            async for _ in layers:
                pass
        assert engine.statistics()["0:primary"].evictions == 0
        assert (await engine.prefetch(warm)).tokens == 2 * BLOCK  # unpinned now: they may go


# ---------------------------------------------------------------------------------------------- deadline
@pytest.mark.anyio
async def test_the_deadline_returns_with_promotions_pending_and_the_engine_stays_healthy() -> None:
    kv = device_kv()
    tiers = [{"type": "faulty", "capacity_bytes": 1 << 24}]
    async with kvtier.open(config(tiers), geometry(), kv, wait_timeout_s=0.2, flush_timeout_s=0) as engine:
        tokens = prompt(8)
        await seed_tier(engine, kv, tokens)
        slow_tier(engine, 3600.0)  # reads never finish while the engine is open
        with anyio.fail_after(5):
            outcome = await engine.prefetch(tokens, deadline_s=0.1)
        assert outcome == PrefetchOutcome(0, {}, CHUNKS, True)
        with anyio.fail_after(5):  # the default deadline is the engine's wait_timeout_s
            again = await engine.prefetch(tokens)
        assert again.timed_out and again.pending == CHUNKS and again.tokens == 0
        # The engine serves other prompts meanwhile: host memory stores and loads them.
        other = prompt(9, 2 * BLOCK)
        gen = torch.Generator().manual_seed(9)
        data = [fill_block(kv, b, gen) for b in (20, 21)]
        assert await engine.store(other, [20, 21]) == 2 * BLOCK  # (drain would wait for the slow tier)
        for layer in kv:
            layer.zero_()
        assert await engine.load(other, [50, 51]) == 2 * BLOCK and loaded_bytes_equal(kv, 50, data)
        assert engine.statistics()["0:primary"].write_pending == CHUNKS  # still promoting
        assert engine.manager.jobs_in_flight_by_tier()["1:faulty"].promotion_jobs == 1  # the second joined it


# ---------------------------------------------------------------------------------------------- hybrid
FULL, SWA, STATE = ["l.0.attn"], ["l.1.attn"], ["l.2.mixer"]


def hybrid_model() -> KVModel:
    return KVModel("test/hybrid-warm", "float16", groups=(
        KVCacheGroup.full_attention(block_size=BLOCK, layer_names=FULL, num_kv_heads=HEADS, head_dim=DIM),
        KVCacheGroup.sliding_window(window=8, block_size=BLOCK, layer_names=SWA, num_kv_heads=HEADS, head_dim=DIM),
        KVCacheGroup.mamba(block_size=8, layer_names=STATE, state_shapes=[(3, 8)], state_dtypes=["float32"]),
    ))


@pytest.mark.anyio
async def test_a_hybrid_model_prefetches_only_the_window_and_the_state_at_the_hit() -> None:
    model = hybrid_model()
    kv: dict[str, Any] = {name: torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16)
                          for name in FULL + SWA}
    kv[STATE[0]] = (torch.zeros((NUM_BLOCKS, 3, 8), dtype=torch.float32),)
    settings = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * model.slot_bytes(1),
                "secondary_tiers": [memory()]}
    tokens = prompt(11, 32)  # 8 full-attention chunks, window chunks of 4 tokens, states of 8
    blocks = [list(range(8)), list(range(8)), list(range(4))]
    async with kvtier.open(settings, model, kv) as engine:
        assert await engine.store(tokens, blocks) == 32
        await engine.drain()
        await engine.reset_cache()
        outcome = await engine.prefetch(tokens)
        # Full attention: all 8 chunks; the window of 8 tokens before 32: chunks 6, 7; the state at 32.
        assert outcome == PrefetchOutcome(32, {"1:memory": 8 + 2 + 1}, 0, False)
        held = [[engine.host.lookup(k) is LookupResult.HIT for k in engine.chunk_keys(tokens, group=g)]
                for g in range(3)]
        assert held == [[True] * 8, [False] * 6 + [True] * 2, [False, False, False, True]]
        loaded = await engine.load_with_sources(tokens, [list(range(20, 28)), list(range(20, 28)), list(range(20, 24))])
        assert loaded.tokens == 32 and loaded.tokens_by_tier == {"0:primary": 32}


# ---------------------------------------------------------------------------------------------- metrics
@pytest.mark.anyio
@pytest.mark.parametrize("events", [False, True])
async def test_hits_and_wasted_prefetches_are_counted(events: bool) -> None:
    kv = device_kv()
    extra: dict[str, Any] = {"events": {"endpoint": "tcp://127.0.0.1:*"}} if events else {}
    async with kvtier.open(config([memory()], slots=6), geometry(), kv, **extra) as engine:
        tokens = prompt(12)
        await seed_tier(engine, kv, tokens)
        assert (await engine.prefetch(tokens)).chunks_by_tier == {"1:memory": CHUNKS}
        assert await engine.load(tokens[: 2 * BLOCK], [40, 41]) == 2 * BLOCK  # uses two of the four
        for i in range(4):  # two fill the free slots, two evict the least recently used: the unused two
            await seed_tier(engine, kv, prompt(30 + i, BLOCK), 30 + i, forget=False)
        assert [engine.host.lookup(k) for k in engine.chunk_keys(tokens)] == (
            [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2)
        await engine.drain()  # one more step: the tracker has seen the evictions
        assert metric(engine, "kvtier_prefetch_requests_total") == 1
        assert metric(engine, "kvtier_prefetched_chunks_total", tier="1:memory") == CHUNKS
        assert metric(engine, "kvtier_prefetched_tokens_total") == TOKENS
        assert metric(engine, "kvtier_prefetch_hits_total") == 2
        assert metric(engine, "kvtier_prefetch_wasted_total") == 2
        assert engine.parts.prefetches.watched == 0


@pytest.mark.anyio
async def test_a_reset_forgets_prefetched_chunks_without_counting_them() -> None:
    kv = device_kv()
    async with kvtier.open(config([memory()]), geometry(), kv) as engine:
        tokens = prompt(13)
        await seed_tier(engine, kv, tokens)
        await engine.prefetch(tokens)
        await engine.reset_cache()
        stats = engine.parts.prefetches.statistics()
        assert (stats.requests, stats.hits, stats.wasted, engine.parts.prefetches.watched) == (1, 0, 0, 0)


# ---------------------------------------------------------------------------------------------- misuse
@pytest.mark.anyio
async def test_arguments_are_checked_at_the_call() -> None:
    async with kvtier.open(config([memory()]), geometry(), device_kv()) as engine:
        bad: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"token_ids": [1, "2"]}, TypeError, r"token_ids\[1\]"),
            ({"token_ids": [1, -2]}, ValueError, r"token_ids\[1\]"),
            ({"tiers": "memory"}, TypeError, "tiers must be a list"),
            ({"tiers": [True]}, TypeError, r"tiers\[0\]"),
            ({"tiers": [3]}, ValueError, r"tiers\[0\] = 3: no such tier"),
            ({"tiers": ["memory", "fs"]}, ValueError, r"tiers\[1\] = 'fs' names no tier.*1:memory"),
            ({"tiers": [{"medium": "GPU"}]}, ValueError, r"tiers\[0\]: medium must be"),
            ({"tiers": [{"speed": "fast"}]}, ValueError, r"tiers\[0\]: unknown matcher key 'speed'"),
            ({"tiers": [1.5]}, TypeError, r"tiers\[0\]"),
            ({"deadline_s": 0}, ValueError, "deadline_s"),
            ({"deadline_s": -1.0}, ValueError, "deadline_s"),
            ({"deadline_s": math.inf}, ValueError, "deadline_s"),
            ({"deadline_s": math.nan}, ValueError, "deadline_s"),
            ({"deadline_s": "1"}, TypeError, "deadline_s"),
            ({"deadline_s": True}, TypeError, "deadline_s"),
            ({"evict": "yes"}, TypeError, "evict"),
            ({"cache_salt": ""}, ValueError, "salt"),
            ({"lora_name": "a"}, ValueError, "lora"),
        ]
        for args, error, match in bad:
            call = {"token_ids": prompt(14), **args}
            with pytest.raises(error, match=match):
                await engine.prefetch(call.pop("token_ids"), **call)
        assert engine.parts.prefetches.statistics().requests == 0  # refused before any work
        with pytest.raises(kvtier.RequestError):
            await engine.prefetch(prompt(14), {"remote_prefiller": {"kv_request_id": "a", "remote_host": "h",
                                                                     "remote_port": 1},
                                               "remote_decoder": {"kv_request_id": "a"}}, tiers=[0])
    with pytest.raises(EngineClosedError, match="prefetch"):
        await engine.prefetch(prompt(14))


@pytest.mark.anyio
async def test_an_engine_without_device_kv_or_secondary_tiers_prefetches_too() -> None:
    async with kvtier.open({"cpu_bytes_to_use": 8 * SLOT_BYTES}, geometry()) as engine:
        assert await engine.prefetch(prompt(15)) == PrefetchOutcome(0, {}, 0, False)


def test_the_blocking_facade_prefetches() -> None:
    kv = device_kv()
    engine = kvtier.start_in_thread(config([memory()]), geometry(), kv)
    try:
        tokens = prompt(16)
        fill_block(kv, 0, torch.Generator().manual_seed(0))
        assert engine.store(tokens[:BLOCK], [0]) == BLOCK
        engine.drain()
        engine.reset_cache()
        assert engine.prefetch(tokens[:BLOCK], deadline_s=5) == PrefetchOutcome(BLOCK, {"1:memory": 1}, 0, False)
        parameters = inspect.signature(engine.prefetch).parameters
        assert {"tiers", "deadline_s", "evict", "cache_salt"} <= set(parameters)
    finally:
        engine.close()
    with pytest.raises(EngineClosedError):
        engine.prefetch(prompt(16))

"""Write-back and selective tiers behind ``kvtier.open``: eviction storms, failed write-backs, a crash.

The invariants: a chunk stored is readable from host memory or from the tier, never lost, while
its write-back succeeds; a chunk whose write-back failed or never happened is a miss later,
never other bytes.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvtier
from kvtier import KVGeometry

BLOCK = 4
LAYERS = 2
HEADS = 1
DIM = 8
NUM_BLOCKS = 8
PROMPTS = 24
HOST_SLOTS = 4

GEOMETRY = KVGeometry("write-back/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)
SLOT = GEOMETRY.slot_bytes(1)


def prompt(i: int) -> list[int]:
    return [1000 * i + t for t in range(BLOCK)]


def chunk_payload(i: int) -> list[torch.Tensor]:
    seed = int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "big") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((2, BLOCK, HEADS, DIM), generator=gen).to(torch.float16) for _ in range(LAYERS)]


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def config(tier: dict[str, Any]) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": HOST_SLOTS * SLOT, "secondary_tiers": [tier]}


async def store_all(engine: Any, kv: list[torch.Tensor]) -> None:
    for i in range(PROMPTS):
        for layer, data in zip(kv, chunk_payload(i)):
            layer[0].copy_(data)
        assert await engine.store(prompt(i), [0]) == BLOCK


async def load(engine: Any, kv: list[torch.Tensor], i: int) -> bool:
    """Load prompt ``i`` into block 1: True on a hit with the stored bytes, False on a miss."""
    for layer in kv:
        layer[1].fill_(float("nan"))
    placed = await engine.load(prompt(i), [1])
    if placed == 0:
        return False
    assert placed == BLOCK
    for layer, data in zip(kv, chunk_payload(i)):
        assert torch.equal(layer[1], data), f"prompt {i}: a load returned other bytes"
    return True


async def wait_idle(engine: Any) -> None:
    """Until the tier jobs in flight have been reported (without flushing write-backs)."""
    with anyio.fail_after(10):
        while engine.manager.jobs_in_flight:
            await anyio.sleep(0.005)


@pytest.fixture(params=["memory", "fs"])
def write_back_tier(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "memory":
        return {"type": "memory", "capacity_bytes": 1 << 24, "write_policy": "write_back"}
    return {"type": "fs", "root_dir": str(tmp_path / "kv"), "write_policy": "write_back"}


@pytest.mark.anyio
async def test_an_eviction_storm_into_a_small_host_tier_loses_nothing(write_back_tier: dict[str, Any]) -> None:
    kv = device_kv()
    async with kvtier.open(config(write_back_tier), GEOMETRY, kv, wait_timeout_s=5) as engine:
        label = engine.tiers[0].context.label
        await store_all(engine, kv)
        await wait_idle(engine)
        evictions = engine.statistics()["0:primary"].evictions
        written = engine.statistics()["manager"].write_policies[label]
        assert written.chunks_written_back == evictions == PROMPTS - HOST_SLOTS
        assert written.dirty_chunks == HOST_SLOTS
        assert engine.tiers[0].statistics().bytes_written // SLOT == evictions  # nothing written at store
        for i in range(PROMPTS):
            assert await load(engine, kv, i), f"prompt {i} was lost"
        engine.manager.flush_write_back()
        await engine.drain()
        written = engine.statistics()["manager"].write_policies[label]
        assert written.dirty_chunks == 0
        assert written.chunks_written_back == PROMPTS  # promoted chunks are not written again
        assert engine.statistics()["0:primary"].pinned_slots == 0


@pytest.mark.anyio
async def test_failed_write_backs_lose_only_their_chunks() -> None:
    tier = {"type": "faulty", "fail_write_fraction": 1.0, "write_policy": "write_back"}
    kv = device_kv()
    async with kvtier.open(config(tier), GEOMETRY, kv, wait_timeout_s=5) as engine:
        await store_all(engine, kv)
        await wait_idle(engine)
        failed = engine.statistics()["manager"].write_policies["1:faulty"].write_backs_failed
        assert failed == PROMPTS - HOST_SLOTS
        hits = [await load(engine, kv, i) for i in range(PROMPTS)]
        # the chunks still in host memory are the last ones stored; every other one is a miss
        assert hits == [False] * failed + [True] * HOST_SLOTS


@pytest.mark.anyio
async def test_a_crashed_write_back_engine_loses_only_its_unwritten_chunks(tmp_path: Path) -> None:
    root = str(tmp_path / "kv")
    kv = device_kv()
    async with kvtier.open(config({"type": "fs", "root_dir": root, "write_policy": "write_back"}),
                           GEOMETRY, kv, wait_timeout_s=5) as crashed:
        await store_all(crashed, kv)
        await wait_idle(crashed)
        written = crashed.statistics()["manager"].write_policies["1:fs"].chunks_written_back
        assert written == PROMPTS - HOST_SLOTS
        # Another engine on the same directory sees what the first one wrote, as it would after a
        # crash of the first: the chunks evicted (written back) hit, the dirty ones miss.
        survivor_kv = device_kv()
        async with kvtier.open(config({"type": "fs", "root_dir": root}), GEOMETRY, survivor_kv,
                               wait_timeout_s=5) as survivor:
            hits = [await load(survivor, survivor_kv, i) for i in range(PROMPTS)]
        assert hits == [True] * written + [False] * (PROMPTS - written)


@pytest.mark.anyio
async def test_closing_a_write_back_engine_writes_every_dirty_chunk(tmp_path: Path) -> None:
    root = str(tmp_path / "kv")
    kv = device_kv()
    async with kvtier.open(config({"type": "fs", "root_dir": root, "write_policy": "write_back"}),
                           GEOMETRY, kv, wait_timeout_s=5) as engine:
        await store_all(engine, kv)
        await wait_idle(engine)
        assert engine.manager.dirty_chunks_by_tier()["1:fs"] == HOST_SLOTS
        metrics = engine.metrics.render().decode()
        assert 'kvtier_tier_write_back_dirty_chunks{tier="1:fs"} 4.0' in metrics
        assert 'kvtier_tier_write_policy_info{policy="write_back",tier="1:fs"} 1.0' in metrics
    # Leaving the block flushed the chunks still dirty: another engine loads every prompt.
    reader_kv = device_kv()
    async with kvtier.open(config({"type": "fs", "root_dir": root}), GEOMETRY, reader_kv, wait_timeout_s=5) as reader:
        assert [await load(reader, reader_kv, i) for i in range(PROMPTS)] == [True] * PROMPTS


@pytest.mark.anyio
async def test_a_selective_tier_gets_only_the_prompts_hit_often_enough() -> None:
    tier = {"type": "memory", "capacity_bytes": 1 << 24, "write_policy": "selective", "min_hits": 2}
    kv = device_kv()
    async with kvtier.open(config(tier), GEOMETRY, kv, wait_timeout_s=5) as engine:
        for i in range(HOST_SLOTS):
            for layer, data in zip(kv, chunk_payload(i)):
                layer[0].copy_(data)
            await engine.store(prompt(i), [0])
        for _ in range(2):
            assert await load(engine, kv, 0)
        assert await load(engine, kv, 1)
        await engine.drain()
        assert engine.tiers[0].statistics().bytes_written == SLOT
        stats = engine.statistics()["manager"].write_policies["1:memory"]
        assert (stats.chunks_written_selective, stats.selective_unwritten) == (1, HOST_SLOTS - 1)


@pytest.mark.anyio
async def test_random_stores_and_loads_with_write_back_and_selective_tiers_never_corrupt_or_leak() -> None:
    tiers = [
        {"type": "faulty", "capacity_bytes": 12 * SLOT, "fail_read_fraction": 0.1, "fail_write_fraction": 0.2,
         "seed": 7, "write_policy": "write_back"},
        {"type": "faulty", "capacity_bytes": 1 << 24, "fail_write_fraction": 0.1, "seed": 8,
         "write_policy": "selective", "min_hits": 2},
    ]
    kv = [torch.zeros((64, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]
    free_blocks = list(range(64))
    prompts = [prompt(i) + prompt(i + 100) + prompt(i + 200) for i in range(20)]

    def payload_of(tokens: list[int], c: int) -> list[torch.Tensor]:
        return chunk_payload(hash(tuple(tokens[: (c + 1) * BLOCK])))

    engine_config = {**config(tiers[0]), "cpu_bytes_to_use": 12 * SLOT, "secondary_tiers": tiers}
    async with kvtier.open(engine_config, GEOMETRY, kv, wait_timeout_s=5) as engine:
        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(300):
                tokens = prompts[rng.randrange(len(prompts))][: rng.randint(1, 3) * BLOCK]
                blocks = [free_blocks.pop() for _ in range(len(tokens) // BLOCK)]
                try:
                    op = rng.random()
                    if op < 0.5:
                        for c, block in enumerate(blocks):
                            for layer, data in zip(kv, payload_of(tokens, c)):
                                layer[block].copy_(data)
                        await engine.store(tokens, blocks)
                    else:
                        for block in blocks:
                            for layer in kv:
                                layer[block].fill_(float("nan"))
                        placed = await engine.load(tokens, blocks)
                        for c in range(placed // BLOCK):
                            for layer, data in zip(kv, payload_of(tokens, c)):
                                assert torch.equal(layer[blocks[c]], data), "a load returned other bytes"
                finally:
                    free_blocks.extend(blocks)

        async with anyio.create_task_group() as tg:
            for w in range(4):
                tg.start_soon(worker, 50 + w)
        engine.manager.flush_write_back()
        await engine.drain()
        assert engine.manager.jobs_in_flight == 0
        assert engine.statistics()["0:primary"].pinned_slots == 0
        assert engine.statistics()["manager"].write_policies["1:faulty"].dirty_chunks == 0


@pytest.mark.anyio
async def test_a_load_waiting_on_a_store_in_progress_is_woken_when_it_completes() -> None:
    """With a write-back tier nothing cascades at store: the store's own completion must wake a
    load that found its chunk still being written (it otherwise waited out wait_timeout_s and
    missed)."""
    kv = device_kv()
    tier = {"type": "memory", "capacity_bytes": 1 << 24, "write_policy": "write_back"}
    async with kvtier.open(config(tier), GEOMETRY, kv, wait_timeout_s=10) as engine:
        for layer, data in zip(kv, chunk_payload(0)):
            layer[0].copy_(data)
        loaded: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.store, prompt(0), [0])
            await anyio.wait_all_tasks_blocked()  # the store is copying: its chunk is being written

            async def load_it() -> None:
                loaded.append(await engine.load(prompt(0), [1]))

            tg.start_soon(load_it)
        assert loaded == [BLOCK]
        assert engine.statistics()["loads"].wait_timeouts == 0  # woken by the store, not by its deadline
        assert engine.statistics()["manager"].write_policies["1:memory"].chunks_written_back == 0

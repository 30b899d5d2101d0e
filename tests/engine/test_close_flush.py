"""Closing flushes: leaving ``kvtier.open`` (or ``ThreadedEngine.close``) waits, up to
``flush_timeout_s``, for the cascades in flight, then logs what it abandons.

The secondary tier is :class:`KeepingTier`, a slow ``faulty`` memory tier (``latency_s`` per chunk)
whose chunks outlive ``close()``, so a test can count after the block what reached it. Nothing
here asserts on elapsed time: "promptly" is checked by a generous hang guard and by flush
timeouts far longer than the guard.
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any

import anyio
import pytest
import torch

import kvtier
from kvtier import KVGeometry
from kvtier.tiers.faulty import FaultyTier

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
CHUNKS_PER_PROMPT = 8
NUM_BLOCKS = CHUNKS_PER_PROMPT
#: Hang guard only; a flush that is (wrongly) waited for lasts far longer than this.
GUARD_S = 30
LABEL = "1:KeepingTier"


class KeepingTier(FaultyTier):
    """A faulty (slow) memory tier whose chunks survive ``close()``. FOR TESTS ONLY."""

    async def close(self) -> None:
        """Keep the chunks: the test reads them after the engine is gone."""


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def config(latency_s: float, host_slots: int = 1024) -> dict[str, Any]:
    # Enough host slots for the whole burst: stores never wait for a cascade to free one.
    tier = {"type": "KeepingTier", "module_path": __name__, "capacity_bytes": 1 << 30, "latency_s": latency_s}
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": host_slots * geometry().slot_bytes(1),
        "secondary_tiers": [tier],
    }


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(CHUNKS_PER_PROMPT * BLOCK)] for _ in range(n)]


async def store_burst(engine: kvtier.Engine, n_prompts: int) -> list[bytes]:
    """Store ``n_prompts`` × 8 chunks (one cascade job per prompt); return every chunk key."""
    keys: list[bytes] = []
    for tokens in prompts(n_prompts):
        assert await engine.store(tokens, list(range(CHUNKS_PER_PROMPT))) == len(tokens)
        keys.extend(engine.chunk_keys(tokens))
    return keys


def abandoned_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvtier.engine.engine" and r.levelno == logging.WARNING and "abandons" in r.getMessage()]


@pytest.mark.anyio
async def test_every_chunk_of_an_800_chunk_burst_reaches_the_tier_after_the_block(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    with anyio.fail_after(GUARD_S):
        # flush_timeout_s well above the ~0.3 s the cascades need, so a loaded machine passes too
        async with kvtier.open(config(latency_s=0.005), geometry(), device_kv(), flush_timeout_s=25) as engine:
            keys = await store_burst(engine, 100)
            tier = engine.tiers[0]
            assert engine.manager.jobs_in_flight > 0  # the burst is still cascading as the block ends
    assert len(set(keys)) == 800
    assert all(tier.known(key) for key in keys)
    stats = engine.statistics()[LABEL]
    assert stats.bytes_written == 800 * geometry().slot_bytes(1)
    assert not stats.failures  # nothing cancelled
    assert abandoned_warnings(caplog) == []


@pytest.mark.anyio
async def test_the_default_flush_waits_for_cascades() -> None:
    with anyio.fail_after(GUARD_S):
        async with kvtier.open(config(latency_s=0.002), geometry(), device_kv()) as engine:
            keys = await store_burst(engine, 40)
            tier = engine.tiers[0]
            assert engine.manager.jobs_in_flight > 0
    assert all(tier.known(key) for key in keys)
    assert engine.flush_timeout_s == 5.0


@pytest.mark.anyio
async def test_a_body_that_raises_still_flushes() -> None:
    class Boom(Exception):
        pass

    with anyio.fail_after(GUARD_S), pytest.raises(Boom):
        async with kvtier.open(config(latency_s=0.005), geometry(), device_kv(), flush_timeout_s=25) as engine:
            keys = await store_burst(engine, 20)
            tier = engine.tiers[0]
            raise Boom
    assert all(tier.known(key) for key in keys)


@pytest.mark.anyio
async def test_flush_timeout_zero_abandons_the_cascades_and_logs_them(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    with anyio.fail_after(GUARD_S):
        async with kvtier.open(config(latency_s=600), geometry(), device_kv(), flush_timeout_s=0) as engine:
            keys = await store_burst(engine, 100)
            tier = engine.tiers[0]
    assert not any(tier.known(key) for key in keys)
    [warning] = abandoned_warnings(caplog)
    assert "flush_timeout_s=0" in warning
    assert f"tier {LABEL} abandons 100 cascade jobs (800 chunks not written to it)" in warning


@pytest.mark.anyio
async def test_a_flush_that_runs_out_of_time_abandons_the_rest_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    with anyio.fail_after(GUARD_S):
        async with kvtier.open(config(latency_s=600), geometry(), device_kv(), flush_timeout_s=0.2) as engine:
            await store_burst(engine, 3)
    [warning] = abandoned_warnings(caplog)
    assert "flush_timeout_s=0.2 passed" in warning
    assert "abandons 3 cascade jobs (24 chunks" in warning
    assert set(engine.statistics()[LABEL].failures) == {("store", "cancelled")}


@pytest.mark.anyio
async def test_a_cancelled_caller_does_not_wait_for_the_flush(caplog: pytest.LogCaptureFixture) -> None:
    """Cancelled inside the block: close skips the flush (it is not shielded) but still closes."""
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    with anyio.fail_after(GUARD_S):  # the flush would wait 600 s: only an unshielded one returns
        with anyio.CancelScope() as scope:
            async with kvtier.open(config(latency_s=600), geometry(), device_kv(), flush_timeout_s=600) as engine:
                await store_burst(engine, 4)
                scope.cancel()
                await anyio.sleep_forever()
    assert scope.cancelled_caught
    [warning] = abandoned_warnings(caplog)
    assert "close was cancelled while flushing" in warning
    assert "abandons 4 cascade jobs (32 chunks" in warning
    with pytest.raises(kvtier.EngineClosedError):
        engine.cached_prefix_tokens(prompts(1)[0])


@pytest.mark.anyio
async def test_a_deadline_that_passes_during_the_flush_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    """The body ends normally; the caller's deadline then expires while close is flushing."""
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    with anyio.fail_after(GUARD_S):
        with anyio.move_on_after(0.5) as scope:
            async with kvtier.open(config(latency_s=600), geometry(), device_kv(), flush_timeout_s=600) as engine:
                await store_burst(engine, 2)
    assert scope.cancelled_caught
    [warning] = abandoned_warnings(caplog)
    # (on a very slow machine the deadline may already end the body: one job or two)
    assert re.search(r"abandons [12] cascade jobs \((8|16) chunks", warning)
    with pytest.raises(kvtier.EngineClosedError):
        await engine.drain()


def test_threaded_engine_close_flushes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    engine = kvtier.start_in_thread(config(latency_s=0.005), geometry(), device_kv(), flush_timeout_s=25)
    keys: list[bytes] = []
    try:
        for tokens in prompts(25, seed=1):
            assert engine.store(tokens, list(range(CHUNKS_PER_PROMPT))) == len(tokens)
            keys.extend(engine.engine.chunk_keys(tokens))
        tier = engine.engine.tiers[0]
    finally:
        engine.close()
    assert all(tier.known(key) for key in keys)
    assert abandoned_warnings(caplog) == []


def test_threaded_engine_with_flush_timeout_zero_abandons_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.engine.engine")
    engine = kvtier.start_in_thread(config(latency_s=600), geometry(), device_kv(), flush_timeout_s=0)
    try:
        for tokens in prompts(5, seed=2):
            engine.store(tokens, list(range(CHUNKS_PER_PROMPT)))
    finally:
        engine.close()
    [warning] = abandoned_warnings(caplog)
    assert "abandons 5 cascade jobs (40 chunks" in warning

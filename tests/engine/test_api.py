"""The embedding API end to end: kvtier.open / start_in_thread with real tiers and real bytes."""

from __future__ import annotations

import random
import time
from pathlib import Path

import anyio
import pytest
import torch
from kv_blocks import block_equals, fill_block

import kvtier
from kvtier import ConfigError, KVGeometry

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 64


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def tiering_config(slots: int = 16, tiers: list[dict] | None = None) -> dict:
    slot_bytes = geometry().slot_bytes(1)
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": slots * slot_bytes,
        "secondary_tiers": tiers if tiers is not None else [{"type": "memory", "capacity_bytes": 1 << 30}],
    }


def prompts(n: int, tokens_per_prompt: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(tokens_per_prompt)] for _ in range(n)]


@pytest.mark.anyio
async def test_round_trip_200_chunks_through_promotion_is_byte_identical() -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(1)
    expected = {}
    async with kvtier.open(tiering_config(slots=16), geometry(), kv) as engine:
        for i, tokens in enumerate(prompts(200, BLOCK)):
            block = i % NUM_BLOCKS
            expected[i] = fill_block(kv, block, gen)
            assert await engine.store(tokens, [block]) == BLOCK
        await engine.drain()
        for layer in kv:
            layer.zero_()
        sources: dict[str, int] = {}
        for i, tokens in enumerate(prompts(200, BLOCK)):
            target = (i * 7 + 3) % NUM_BLOCKS
            outcome = await engine.load_with_sources(tokens, [target])
            assert outcome.tokens == BLOCK, f"chunk {i} not loaded"
            assert block_equals(kv, target, expected[i]), f"chunk {i} came back different"
            for label, count in outcome.tokens_by_tier.items():
                sources[label] = sources.get(label, 0) + count
        # 16 host slots cannot hold 200 chunks: most came back through a promotion.
        assert sources.get("1:memory", 0) >= (200 - 16) * BLOCK
        stats = engine.statistics()
        assert stats["0:primary"].pinned_slots == 0


@pytest.mark.anyio
async def test_host_only_engine_round_trip_and_prefix_semantics() -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(2)
    config = {"cpu_bytes_to_use": 32 * geometry().slot_bytes(1)}
    tokens = prompts(1, 4 * BLOCK + 2, seed=5)[0]  # four full chunks and a partial one
    async with kvtier.open(config, geometry(), kv) as engine:
        data = [fill_block(kv, b, gen) for b in range(4)]
        assert await engine.store(tokens, [0, 1, 2, 3, 4]) == 4 * BLOCK
        assert engine.cached_prefix_tokens(tokens) == 4 * BLOCK
        # the already-held chunks are not copied again
        assert await engine.store(tokens, [0, 1, 2, 3, 4]) == 0
        for layer in kv:
            layer.zero_()
        # caller already has the first chunk on device: only chunks 1..3 are loaded
        placed = await engine.load(tokens, [10, 11, 12, 13, 14], num_computed_tokens=BLOCK)
        assert placed == 3 * BLOCK
        assert all(block_equals(kv, 10 + b, data[b]) for b in range(1, 4))
        assert not kv[0][10].any()
        # a different continuation shares only the first two chunks
        other = tokens[: 2 * BLOCK] + [t + 1 for t in tokens[2 * BLOCK :]]
        assert engine.cached_prefix_tokens(other) == 2 * BLOCK
        assert await engine.load(other, list(range(20, 25))) == 2 * BLOCK


@pytest.mark.anyio
async def test_per_request_caps_are_honoured() -> None:
    kv = device_kv()
    config = {"cpu_bytes_to_use": 32 * geometry().slot_bytes(1)}
    tokens = prompts(1, 4 * BLOCK, seed=9)[0]
    async with kvtier.open(config, geometry(), kv) as engine:
        stored = await engine.store(tokens, [0, 1, 2, 3], {"max_offload_tokens": 2 * BLOCK + 1})
        assert stored == 2 * BLOCK
        assert await engine.store(tokens, [0, 1, 2, 3], {"max_offload_tokens": 0}) == 0
        assert await engine.load(tokens, [8, 9, 10, 11], {"max_load_tokens": 0}) == 0
        assert await engine.load(tokens, [8, 9, 10, 11], {"max_load_tokens": BLOCK + 3}) == BLOCK
        assert await engine.store(tokens, [0, 1, 2, 3], num_prompt_tokens=3 * BLOCK) == BLOCK


@pytest.mark.anyio
async def test_failed_secondary_load_is_a_miss_not_an_error() -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(3)
    tiers = [{"type": "faulty", "capacity_bytes": 1 << 24, "fail_read_fraction": 1.0}]
    async with kvtier.open(tiering_config(slots=4, tiers=tiers), geometry(), kv, wait_timeout_s=5) as engine:
        all_prompts = prompts(12, BLOCK, seed=11)
        for i, tokens in enumerate(all_prompts):
            fill_block(kv, i, gen)
            await engine.store(tokens, [i])
        await engine.drain()
        # the first prompts were evicted from host memory; their promotions fail every time
        with anyio.fail_after(10):
            for _ in range(3):
                assert await engine.load(all_prompts[0], [40]) == 0
        stats = engine.statistics()
        assert stats["manager"].promotion_job_failures["1:faulty"] >= 1
        assert stats["0:primary"].pinned_slots == 0


@pytest.mark.anyio
async def test_close_with_jobs_in_flight_returns_promptly() -> None:
    kv = device_kv()
    tiers = [{"type": "faulty", "capacity_bytes": 1 << 24, "latency_s": 60.0}]
    started = time.monotonic()
    with anyio.fail_after(10):
        # flush_timeout_s=0: close does not wait for the stuck cascades (tests/engine/test_close_flush.py
        # covers the flush itself).
        async with kvtier.open(tiering_config(slots=16, tiers=tiers), geometry(), kv,
                               flush_timeout_s=0) as engine:
            for i, tokens in enumerate(prompts(8, BLOCK, seed=4)):
                await engine.store(tokens, [i])
            assert engine.manager.jobs_in_flight > 0
    assert time.monotonic() - started < 5.0


@pytest.mark.anyio
async def test_open_rejects_bad_configuration_before_yielding() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        async with kvtier.open({"cpu_bytes_to_use": 0}, geometry(), device_kv()):
            pass  # pragma: no cover
    with pytest.raises(ConfigError, match="secondary_tiers"):
        async with kvtier.open(
            {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "memory", "capacity_bytes": 1}]},
            geometry(), device_kv(),
        ):
            pass  # pragma: no cover


def test_start_in_thread_facade_round_trip() -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(6)
    tokens = prompts(1, 2 * BLOCK, seed=8)[0]
    engine = kvtier.start_in_thread(tiering_config(slots=8), geometry(), kv)
    try:
        data = [fill_block(kv, b, gen) for b in range(2)]
        assert engine.store(tokens, [0, 1]) == 2 * BLOCK
        engine.drain()
        for layer in kv:
            layer.zero_()
        assert engine.load(tokens, [5, 6]) == 2 * BLOCK
        assert block_equals(kv, 5, data[0]) and block_equals(kv, 6, data[1])
    finally:
        engine.close()
    engine.close()  # idempotent


@pytest.mark.anyio
async def test_exceptions_from_the_body_come_back_unwrapped() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with kvtier.open({"cpu_bytes_to_use": 1 << 20}, geometry(), device_kv()):
            raise Boom


@pytest.mark.anyio
async def test_tier_start_failure_is_a_plain_config_error(tmp_path) -> None:  # noqa: ANN001
    bad_root = tmp_path / "file"
    bad_root.write_text("not a directory")
    tiers = [{"type": "fs", "root_dir": str(bad_root)}]
    with pytest.raises(ConfigError):
        async with kvtier.open(tiering_config(tiers=tiers), geometry(), device_kv()):
            pass  # pragma: no cover


def test_every_public_name_resolves_to_its_module() -> None:
    import importlib

    from kvtier import _EXPORTS

    assert set(kvtier.__all__) == set(_EXPORTS) | {"__version__"}
    for name, module in _EXPORTS.items():
        assert getattr(kvtier, name) is getattr(importlib.import_module(module), name), name
    for name in ("RequestExtraKeys", "MultimodalItem", "LayerwiseLoadError", "LayerGroup"):
        assert name in kvtier.__all__


SPECS_MODULE = """
from kvtier.manager import TieringManager
from kvtier.specs import TieringOffloadingSpec


class DroppingSpec(TieringOffloadingSpec):  # forgets to pass the detectors on
    def create_manager(self, host, tiers):
        return TieringManager(host, tiers)


class PassingSpec(TieringOffloadingSpec):
    def create_manager(self, host, tiers):
        return TieringManager(host, tiers, backpressure=self.backpressure)
"""


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["top_level", "per_tier"])
async def test_a_custom_spec_that_drops_the_configured_backpressure_is_refused(
    where: str, tmp_path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    (tmp_path / "kvtier_test_bp_specs.py").write_text(SPECS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    bp = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy"}
    memory = {"type": "memory", "capacity_bytes": 1 << 20}
    if where == "top_level":
        config, key = {**tiering_config(tiers=[memory]), "backpressure": bp}, "backpressure"
    else:
        config = tiering_config(tiers=[memory, {**memory, "backpressure": bp}])
        key = r"secondary_tiers\[1\]\.backpressure"
    config["spec_module_path"] = "kvtier_test_bp_specs"
    with pytest.raises(ConfigError, match=rf"^{key}: .*DropStorePolicy.*backpressure=self\.backpressure"):
        async with kvtier.open({**config, "spec_name": "DroppingSpec"}, geometry(), device_kv()):
            pass  # pragma: no cover
    # The same configuration acts when the spec passes the detectors on.
    async with kvtier.open({**config, "spec_name": "PassingSpec"}, geometry(), device_kv()) as engine:
        assert engine.manager.backpressure_detectors[-1] is not None


@pytest.mark.anyio
async def test_load_counts_only_tokens_beyond_what_the_caller_had() -> None:
    kv = device_kv()
    tokens = prompts(1, 3 * BLOCK, seed=12)[0]
    async with kvtier.open({"cpu_bytes_to_use": 8 * geometry().slot_bytes(1)}, geometry(), kv) as engine:
        await engine.store(tokens, [0, 1, 2])
        outcome = await engine.load_with_sources(tokens, [0, 1, 2], num_computed_tokens=BLOCK + 1)
        # chunks 1 and 2 are placed; one token of chunk 1 was already on the device
        assert outcome.tokens == 2 * BLOCK - 1
        assert outcome.tokens_by_tier == {"0:primary": 2 * BLOCK - 1}


@pytest.mark.anyio
async def test_a_prefix_larger_than_host_memory_never_evicts_itself_while_promoting(tmp_path: Path) -> None:
    """Promotions of one request never evict the chunks it already resolved: a prefix of 8 chunks
    behind 6 host slots loads its first 6 chunks (the rest recomputes) instead of evicting its own
    chunks to promote the next ones, again and again."""
    (long_prompt,) = prompts(1, 8 * BLOCK, seed=11)
    others = prompts(6, BLOCK, seed=12)
    fs = [{"type": "fs", "root_dir": str(tmp_path)}]
    async with kvtier.open(tiering_config(slots=16, tiers=fs), geometry(), device_kv()) as writer:
        assert await writer.store(long_prompt, list(range(8))) == 8 * BLOCK
    async with kvtier.open(tiering_config(slots=6, tiers=fs), geometry(), device_kv(), wait_timeout_s=2.0) as engine:
        for i, tokens in enumerate(others):
            assert await engine.store(tokens, [10 + i]) == BLOCK
        await engine.drain()
        evictions = engine.statistics()["0:primary"].evictions
        assert await engine.load(long_prompt, list(range(20, 28))) == 6 * BLOCK
        # Exactly the 6 other chunks made room; none of the prefix was evicted for its own promotions.
        assert engine.statistics()["0:primary"].evictions - evictions == 6

"""Specification of ``kvtier bench --model hybrid``: the miniature hybrid decoder and its pool, the
engine round trip of its three kinds of KV-cache group, and the bench's hybrid-vs-twin report.

Bytes are asserted structurally (what a load must copy per group), never time."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtier.bench.cli import run_bench_cli
from kvtier.bench.hybrid import HybridBlockPool, HybridConfig, HybridDecoder
from kvtier.bench.model import PoolExhausted
from kvtier.bench.report import format_table, twin_comparison, twin_lines
from kvtier.bench.runner import (
    BenchPlan,
    LogitsMismatch,
    ReferenceLogits,
    RunResult,
    builtin_strategies,
    hybrid_capacities,
    run_one,
    run_point,
)
from kvtier.bench.workload import WorkloadSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = HybridConfig(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                     block_size=16, window=32, state_size=32)
#: The same model with the recurrent state kept every 32 tokens (two attention blocks).
COARSE_STATE = replace(SMALL, state_block_size=32)


@pytest.fixture(scope="module")
def model() -> HybridDecoder:
    return HybridDecoder(SMALL)


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist()


def _needed_blocks(config: HybridConfig, kind: str, hit: int) -> list[int]:
    """The token blocks of group ``kind`` that a prefix of ``hit`` tokens must put on the device."""
    bs = config.group_block_size(kind)
    if kind == "full":
        return list(range(hit // bs))
    if kind == "sliding":
        return list(range(max(0, hit - config.window) // bs, hit // bs))
    return [hit // bs - 1]


def _place_prefix(config: HybridConfig, src: HybridBlockPool, src_ids: list[list[int]], dst: HybridBlockPool,
                  dst_ids: list[list[int]], hit: int) -> None:
    """Copy by hand what a load of ``hit`` tokens needs, and nothing else, from ``src`` to ``dst``."""
    for g, (kind, layers) in enumerate(config.groups()):
        for i in _needed_blocks(config, kind, hit):
            for layer in layers:
                if kind == "recurrent":
                    for s, d in zip(src.state[layer], dst.state[layer]):
                        d[dst_ids[g][i]] = s[src_ids[g][i]]
                else:
                    dst.kv[layer][dst_ids[g][i]] = src.kv[layer][src_ids[g][i]]


# --- model -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [SMALL, COARSE_STATE], ids=["state-every-block", "state-every-2-blocks"])
@pytest.mark.parametrize("cached", [0, 32, 64, 96])
def test_paged_prefill_from_a_hand_placed_prefix_equals_a_dense_recompute(config: HybridConfig, cached: int) -> None:
    decoder = HybridDecoder(config)
    tokens = _tokens(99)
    src, dst = HybridBlockPool(16, config), HybridBlockPool(16, config)
    a, b = src.acquire(tokens), dst.acquire(tokens)
    decoder.prefill(tokens, 0, src, a.block_ids)
    # Only the window of the sliding layers and one state are placed; every other block of the
    # fresh pool is NaN, so a read of anything else would show in the logits.
    _place_prefix(config, src, a.block_ids, dst, b.block_ids, cached)
    logits = decoder.prefill(tokens, cached, dst, b.block_ids)
    torch.testing.assert_close(logits, decoder.dense_logits(tokens), rtol=1e-4, atol=1e-4)


def test_sliding_window_layers_see_only_the_window(model: HybridDecoder) -> None:
    tokens = _tokens(99)
    wide = HybridDecoder(replace(SMALL, window=4096))
    assert not torch.allclose(model.dense_logits(tokens), wide.dense_logits(tokens), atol=1e-3)
    # Sliding layers only: a token older than the window of every later query changes nothing
    # but the full-attention and recurrent layers, which still see it.
    only_sliding = replace(SMALL, layer_kinds=("sliding", "sliding"))
    sliding = HybridDecoder(only_sliding)
    changed = [(tokens[0] + 1) % SMALL.vocab_size] + tokens[1:]
    torch.testing.assert_close(sliding.dense_logits(tokens), sliding.dense_logits(changed), rtol=0, atol=0)
    assert not torch.equal(model.dense_logits(tokens), model.dense_logits(changed))


@pytest.mark.parametrize("kind", ["full", "sliding", "recurrent"])
def test_prefill_reads_each_group_from_the_pool(model: HybridDecoder, kind: str) -> None:
    tokens = _tokens(99)
    pool = HybridBlockPool(16, SMALL)
    alloc = pool.acquire(tokens)
    model.prefill(tokens, 0, pool, alloc.block_ids)
    g = [k for k, _ in SMALL.groups()].index(kind)
    block = alloc.block_ids[g][_needed_blocks(SMALL, kind, 96)[-1]]  # a block the prefix needs
    for layer in SMALL.groups()[g][1]:
        for tensor in pool.state.get(layer, ()) or (pool.kv[layer],):
            tensor[block] += 1.0
    assert not torch.allclose(model.prefill(tokens, 96, pool, alloc.block_ids), model.dense_logits(tokens), atol=1e-3)


def test_a_block_nobody_wrote_turns_the_logits_into_nan(model: HybridDecoder) -> None:
    tokens = _tokens(99)
    pool = HybridBlockPool(16, SMALL)
    alloc = pool.acquire(tokens)  # fresh: NaN everywhere, nothing loaded
    assert torch.isnan(model.prefill(tokens, 64, pool, alloc.block_ids)).all()


def test_prefill_checks_its_arguments(model: HybridDecoder) -> None:
    pool = HybridBlockPool(16, COARSE_STATE)
    coarse = HybridDecoder(pool.config)
    alloc = pool.acquire(_tokens(64))
    with pytest.raises(ValueError, match="multiple of the recurrent block size"):
        coarse.prefill(_tokens(64), 16, pool, alloc.block_ids)
    with pytest.raises(ValueError, match="num_cached_tokens"):
        coarse.prefill(_tokens(64), 64, pool, alloc.block_ids)  # the last token must be computed
    with pytest.raises(ValueError, match="one block list per group"):
        coarse.prefill(_tokens(64), 0, pool, alloc.block_ids[:2])


def test_weights_are_a_function_of_the_seed_and_identical_in_another_process() -> None:
    tokens = _tokens(40)
    a, b = HybridDecoder(SMALL), HybridDecoder(SMALL)
    assert torch.equal(a.dense_logits(tokens), b.dense_logits(tokens))
    assert not torch.allclose(a.dense_logits(tokens), HybridDecoder(replace(SMALL, seed=1)).dense_logits(tokens))
    script = (
        "import sys, torch; from dataclasses import replace; from kvtier.bench.hybrid import HybridConfig, HybridDecoder\n"
        f"config = HybridConfig(**{SMALL.__dict__!r})\n"
        f"sys.stdout.write(HybridDecoder(config).dense_logits({tokens!r}).numpy().tobytes().hex())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, check=True)
    assert proc.stdout == a.dense_logits(tokens).numpy().tobytes().hex()


def test_kv_model_has_one_group_per_kind_and_the_twin_is_all_full_attention() -> None:
    kv_model = SMALL.kv_model()
    assert [g.kind for g in kv_model.groups] == ["full_attention", "sliding_window", "mamba"]
    assert kv_model.groups[0].layer_names == ("model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn")
    assert kv_model.groups[1].window == SMALL.window
    assert kv_model.groups[2].layer_names == ("model.layers.5.mixer",)
    assert kv_model.groups[2].state_shapes == ((SMALL.conv_width - 1, SMALL.state_size), (SMALL.state_size,))
    twin = SMALL.twin()
    assert twin.is_twin and twin.num_layers == SMALL.num_layers and twin.hidden_size == SMALL.hidden_size
    [group] = twin.kv_model().groups
    assert group.kind == "full_attention" and group.num_layers == SMALL.num_layers
    pool = HybridBlockPool(8, SMALL)
    device_kv = pool.device_kv()
    assert device_kv["model.layers.1.self_attn.attn"].shape == (8, 2, 16, 2, 16)
    assert [t.shape for t in device_kv["model.layers.5.mixer"]] == [(8, 3, 32), (8, 32)]


def test_pool_hands_out_per_group_tables_and_refuses_what_it_cannot_hold() -> None:
    pool = HybridBlockPool(4, SMALL)
    alloc = pool.acquire(_tokens(40))
    assert [len(blocks) for blocks in alloc.block_ids] == [3, 3, 3] and alloc.cached_tokens == 0
    assert len({tuple(blocks) for blocks in alloc.block_ids}) > 1  # each group has its own table
    with pytest.raises(PoolExhausted):
        pool.acquire(_tokens(40))
    pool.release(alloc)
    pool.release(alloc)  # idempotent
    assert [len(blocks) for blocks in pool.acquire(_tokens(64)).block_ids] == [4, 4, 4]


# --- the engine round trip -------------------------------------------------------------------
@pytest.mark.anyio
async def test_engine_loads_each_group_what_it_needs_and_the_logits_match(model: HybridDecoder) -> None:
    import kvtier

    tokens = _tokens(130)
    hybrid = SMALL.kv_model()
    config = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 * hybrid.slot_bytes(1)}
    pool = HybridBlockPool(24, SMALL)
    async with kvtier.open(config, hybrid, pool.device_kv()) as engine:
        first = pool.acquire(tokens[:97])
        model.prefill(tokens[:97], 0, pool, first.block_ids)
        await engine.store(tokens[:97], first.block_ids, num_prompt_tokens=97)
        await engine.drain()
        second = pool.acquire(tokens)  # fresh blocks, NaN until written
        placed = await engine.load(tokens[:-1], second.block_ids, num_computed_tokens=0)
        assert placed == 96
        copies = engine.statistics()["copies"]
    # Full attention got every block of the prefix, the sliding window only the blocks of the
    # last `window` tokens, the recurrent group only the state at token 96.
    for g, (kind, layers) in enumerate(SMALL.groups()):
        needed = set(_needed_blocks(SMALL, kind, 96))
        for i, block in enumerate(second.block_ids[g]):
            for layer in layers:
                for tensor in pool.state.get(layer, ()) or (pool.kv[layer],):
                    assert torch.isnan(tensor[block]).all() == (i not in needed), (kind, i)
    chunk = SMALL.block_size * SMALL.attention_bytes_per_token
    assert copies.bytes_to_device == (2 * 6 + 3 * 2) * chunk + SMALL.state_bytes
    logits = model.prefill(tokens, placed, pool, second.block_ids)
    torch.testing.assert_close(logits, model.dense_logits(tokens), rtol=1e-4, atol=1e-4)


def _plan(strategies: tuple, host_conversations: float = 4) -> BenchPlan:
    spec = WorkloadSpec(system_tokens=32, first_prompt_tokens=96, turn_tokens=32, rounds=2,
                        vocab_size=SMALL.vocab_size)
    blocks, host, twin_host = hybrid_capacities(SMALL, spec, host_conversations)
    return BenchPlan(SMALL, spec, (2,), strategies, blocks, host, check="all", twin_host_bytes=twin_host)


@pytest.mark.anyio
async def test_sliding_window_model_loads_fewer_bytes_per_hit_token_than_its_twin(model: HybridDecoder) -> None:
    cpu = builtin_strategies()["cpu"]
    plan = _plan((cpu, cpu.with_twin()))
    twin = ReferenceLogits(HybridDecoder(SMALL.twin()))
    hybrid_row, twin_row = await run_point(plan, plan.strategies, 2, model, ReferenceLogits(model), twin=twin)
    assert twin_row.strategy == "cpu/twin"
    for row in (hybrid_row, twin_row):
        assert row.checked_requests == row.requests == 6 and row.max_logit_error < 1e-3
        assert row.kvtier_tokens > 0 and row.bytes_loaded > 0
        assert sum(row.tokens_by_tier.values()) == row.prompt_tokens
    # The twin loads every layer of every hit token ...
    assert twin_row.bytes_loaded == twin_row.kvtier_tokens * SMALL.num_layers * SMALL.attention_bytes_per_token
    # ... the hybrid model two full-attention layers, a window and a state.
    assert hybrid_row.bytes_per_hit_token < twin_row.bytes_per_hit_token
    assert hybrid_row.bytes_loaded < twin_row.bytes_loaded
    [row] = twin_comparison([hybrid_row, twin_row])
    assert row["ratio"]["bytes_per_hit_token"] == twin_row.bytes_per_hit_token / hybrid_row.bytes_per_hit_token > 1
    assert "KiB per hit token" in twin_lines([row])[1]
    assert "KiB/hit tok" in format_table([hybrid_row, twin_row], bytes_per_hit_token=True)


@pytest.mark.anyio
async def test_a_prefill_reading_a_block_nobody_loaded_fails_the_check(model: HybridDecoder) -> None:
    class ForgetfulDecoder(HybridDecoder):
        """Claims a block more than was placed: it reads blocks nobody wrote (NaN)."""

        def prefill(self, token_ids, num_cached_tokens, pool, block_ids):  # type: ignore[no-untyped-def]
            extra = SMALL.block_size if num_cached_tokens + SMALL.block_size < len(token_ids) else 0
            return super().prefill(token_ids, num_cached_tokens + extra, pool, block_ids)

    forgetful = ForgetfulDecoder(SMALL)
    plan = _plan((builtin_strategies()["recompute"],))
    with pytest.raises(LogitsMismatch, match="offloaded KV is wrong"):
        await run_one(plan, plan.strategies[0], 2, forgetful, ReferenceLogits(model))


def test_twin_strategies_need_a_hybrid_model_and_hybrid_plans_refuse_layerwise() -> None:
    from kvtier.bench.model import ModelConfig

    cpu = builtin_strategies()["cpu"]
    assert (cpu.with_twin().name, cpu.with_twin().twin) == ("cpu/twin", True)
    spec = WorkloadSpec(system_tokens=16, first_prompt_tokens=16, turn_tokens=16, rounds=0)
    with pytest.raises(ValueError, match="only a hybrid model"):
        BenchPlan(ModelConfig(), spec, (1,), (cpu.with_twin(),), 4, 1 << 20)
    with pytest.raises(ValueError, match="layer-wise"):
        BenchPlan(SMALL, spec, (1,), (cpu.with_layerwise(),), 4, 1 << 20)


def test_twin_comparison_pairs_rows_and_leaves_ratios_of_nothing_empty() -> None:
    def row(strategy: str, loaded: int, tokens: int, ttft: float) -> RunResult:
        return RunResult(strategy=strategy, conversations=2, requests=4, prompt_tokens=1000, computed_tokens=100,
                         elapsed_s=1.0, throughput_tokens_per_s=1000.0, ttft_p50_s=ttft, ttft_p90_s=ttft,
                         ttft_mean_s=ttft, tokens_by_tier={}, hit_rate=0.9, working_set_tokens=500,
                         checked_requests=4, max_logit_error=0.0, bytes_loaded=loaded, kvtier_tokens=tokens,
                         bytes_per_hit_token=loaded / tokens if tokens else 0.0)

    rows = [row("recompute", 0, 0, 0.08), row("cpu", 2048, 2, 0.02), row("cpu/twin", 6144, 2, 0.025),
            row("recompute/twin", 0, 0, 0.09), row("cpu+fs", 10, 1, 0.1)]
    recompute, cpu = twin_comparison(rows)  # cpu+fs has no twin row: not compared
    assert recompute["ratio"]["bytes_per_hit_token"] is None
    assert recompute["ratio"]["ttft_mean_s"] == pytest.approx(0.09 / 0.08)
    assert cpu["ratio"]["bytes_per_hit_token"] == pytest.approx(3.0)
    lines = twin_lines([recompute, cpu])
    assert "nothing loaded from kvtier" in lines[1] and "1.00 vs 3.00 KiB per hit token (3.00x)" in lines[2]


# --- command line -----------------------------------------------------------------------------
def test_quick_hybrid_bench_passes_its_logits_check_and_compares_with_the_twin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hybrid.json"
    assert run_bench_cli(["--model", "hybrid", "--quick", "--output", str(out), "--fs-root", str(tmp_path),
                          "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert (tmp_path / "hybrid.png").stat().st_size > 0
    check = doc["logits_check"]
    assert check["passed"] and check["mode"] == "all" and check["checked_requests"] == check["requests"] > 0
    assert doc["model"]["kind"] == "hybrid"
    rows = {(r["strategy"], r["conversations"]): r for r in doc["results"]}
    strategies = {s for s, _ in rows}
    assert strategies == {"recompute", "cpu", "cpu+fs", "recompute/twin", "cpu/twin", "cpu+fs/twin"}
    comparison = doc["summary"]["hybrid_vs_twin"]
    assert {(c["strategy"], c["conversations"]) for c in comparison} == {
        (s, n) for s in ("recompute", "cpu", "cpu+fs") for n in doc["workload"]["conversations"]}
    for c in comparison:
        if c["strategy"] == "recompute":
            assert c["hybrid"]["bytes_loaded"] == c["twin"]["bytes_loaded"] == 0
            continue
        # Structural: per hit token the twin copies every layer, the hybrid model far less.
        assert c["hybrid"]["kvtier_tokens"] > 0 and c["twin"]["kvtier_tokens"] > 0
        assert c["twin"]["bytes_per_hit_token"] == 6 * HybridConfig().attention_bytes_per_token
        assert c["hybrid"]["bytes_per_hit_token"] < c["twin"]["bytes_per_hit_token"]
        assert c["ratio"]["bytes_per_hit_token"] > 1
        assert c["ratio"]["ttft_mean_s"] is not None
    printed = capsys.readouterr().out
    assert "hybrid vs full-attention twin" in printed and "KiB/hit tok" in printed


def test_hybrid_bench_refuses_layerwise_and_unknown_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench_cli(["--model", "hybrid", "--layerwise", "--no-progress"]) == 2
    assert "--layerwise" in capsys.readouterr().err
    assert run_bench_cli(["--model", "moe", "--no-progress"]) == 2

"""``kvtier bench --warmup`` and ``--write-policies``: the extra strategies and their comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.cli import run_bench_cli
from kvtier.bench.report import warmup_lines, write_policy_comparison, write_policy_lines
from kvtier.bench.runner import RunResult, Strategy, builtin_strategies


def test_warmup_and_write_policy_variants_are_named_and_configured() -> None:
    fs = builtin_strategies()["cpu+fs"]
    assert fs.with_warmup().name == "cpu+fs/warmup" and fs.with_warmup().warmup
    back = fs.with_write_policy("write_back")
    assert back.name == "cpu+fs/write_back"
    assert [t["write_policy"] for t in back.secondary_tiers] == ["write_back"]
    assert "write_policy" not in fs.secondary_tiers[0]  # the base strategy is untouched
    for strategy in (builtin_strategies()["cpu"], Strategy("recompute", None)):
        with pytest.raises(ValueError, match="no secondary tier"):
            strategy.with_warmup()
        with pytest.raises(ValueError, match="no secondary tier"):
            strategy.with_write_policy("selective")


def test_write_policy_comparison_sets_each_policy_beside_write_through() -> None:
    def row(name: str, written: int, tput: float) -> RunResult:
        return RunResult(strategy=name, conversations=4, requests=1, prompt_tokens=1, computed_tokens=0,
                         elapsed_s=1.0, throughput_tokens_per_s=tput, ttft_p50_s=0.1, ttft_p90_s=0.1,
                         ttft_mean_s=0.1, tokens_by_tier={}, hit_rate=0.5, working_set_tokens=1,
                         checked_requests=0, max_logit_error=0.0, engine_stats={}, bytes_written=written)

    rows = [row("cpu+fs", 4 << 20, 100.0), row("cpu+fs/write_back", 1 << 20, 90.0), row("cpu+fs/selective", 0, 80.0)]
    comparison = write_policy_comparison(rows)
    assert [(c["policy"], c["bytes_written"]["ratio"]) for c in comparison] == [("write_back", 0.25), ("selective", 0.0)]
    assert comparison[0]["throughput_tokens_per_s"]["ratio"] == pytest.approx(0.9)
    assert "written 1.0 vs 4.0 MiB (0.25x)" in write_policy_lines(comparison)[1]
    assert warmup_lines([]) == []


def test_quick_bench_with_warmup_and_write_policies_passes_its_logits_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert run_bench_cli(["--quick", "--strategies", "cpu+fs", "--warmup", "--write-policies", "--conversations", "8",
                          "--rounds", "1", "--output", str(out), "--fs-root", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["logits_check"]["passed"]
    rows = {r["strategy"]: r for r in doc["results"]}
    assert set(rows) == {"cpu+fs", "cpu+fs/warmup", "cpu+fs/write_back", "cpu+fs/selective"}
    # Host memory holds ~6 of the 8 conversations: the fs tier serves the rest, and the warm-up
    # moves those promotions ahead of the requests, so its loads come from host memory.
    assert rows["cpu+fs/warmup"]["tokens_by_tier"].get("1:fs", 0) < rows["cpu+fs"]["tokens_by_tier"]["1:fs"]
    # Write-back writes only what host memory evicted; selective only what was hit twice.
    assert rows["cpu+fs/write_back"]["bytes_written"] < rows["cpu+fs"]["bytes_written"]
    assert rows["cpu+fs/selective"]["bytes_written"] < rows["cpu+fs"]["bytes_written"]
    assert {c["policy"] for c in doc["summary"]["write_policies"]} == {"write_back", "selective"}
    assert [c["strategy"] for c in doc["summary"]["warmup"]] == ["cpu+fs"]
    printed = capsys.readouterr().out
    assert "warm-up of the next request's prefix" in printed and "write policies against write_through" in printed


def test_warmup_needs_a_strategy_with_a_secondary_tier(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench_cli(["--quick", "--strategies", "cpu", "--warmup", "--no-progress"]) == 2
    assert "--warmup" in capsys.readouterr().err

"""``benchmarks/vllm_adapter.py`` runs in its tiny mode and prints its table (no timing checks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "vllm_adapter.py"

ROWS = [
    "lookup, first (RETRY)",
    "lookup, resolved HIT",
    "lookup, resolved MISS",
    "submit_store",
    "submit_load",
    "get_finished_jobs (stores)",
    "get_finished_jobs (loads)",
    "on_schedule_end (probe flush)",
    "STORE PHASE, all productive calls",
    "LOOKUP+LOAD PHASE, all productive calls",
    "BOTH PHASES, per chunk stored+looked up",
    "get_finished_jobs, idle poll",
    "on_schedule_end, idle",
]


def test_vllm_adapter_benchmark_tiny_run_prints_its_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "'fs' vs kvtier 'kvtier_fs'" in out, out
    assert "kvtier/vLLM" in out and "target" in out and "<=1.2" in out, out
    for row in ROWS:
        lines = [line for line in out.splitlines() if line.startswith(row)]
        assert lines, f"{row!r} missing from:\n{out}"
        assert lines[0].split()[len(row.split())] in ("chunk", "call"), lines[0]
        # Every figure was measured: no row printed as '-' (a row without samples).
        assert " - " not in lines[0][len(row):].split("|")[0] + " ", lines[0]
    assert "second RETRYs" in out, out


def test_fs_tier_benchmark_compares_with_vllm_and_with_vllm_checksummed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "fs_tier.py"), "--repeats", "1", "--jobs",
                           "1", "--sizes", "256", "--mode", "buffered", "--vllm-xxh3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "kvtier/vLLM" in out and "skipped" not in out, out
    title = "kvtier vs vLLM with xxh3-64 added to its stores and loads"
    assert title in out, out
    table = out.split(title, 1)[1].splitlines()[2:4]  # after the title and the header: its two rows
    assert [row.split()[2] for row in table] == ["store", "load"], out
    for row in table:  # every figure measured: GiB/s, ratios, and four CPU figures after the bar
        assert len(row.split("|")[1].split()) == 4 and float(row.split()[4]) > 0, row

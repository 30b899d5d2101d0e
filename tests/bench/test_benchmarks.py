"""Every script in ``benchmarks/`` runs on a tiny workload and prints its table.

Numbers are not checked (performance is judged from the scripts' ratios on a quiet machine, never
by timed assertions); what is checked is that a change to the library did not break a benchmark
nobody would otherwise run until it is needed. A new script fails
:func:`test_every_benchmark_is_smoke_tested` until it is listed in ``RUNS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"

# script -> (arguments for a run of a few seconds, lines or fragments its output must contain)
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "fs_tier.py": (
        ["--repeats", "1", "--jobs", "1", "--sizes", "256", "--mode", "buffered", "--no-vllm"],
        ["256 KiB  store  buffered", "256 KiB   load  buffered", "CPU per GiB moved",
         "--no-vllm given: the comparison with vLLM's fs tier was skipped"],
    ),
    "policies.py": (["--quick"], ["raw    touch", "lru    evict", "arc    insert"]),
    "backpressure.py": (
        ["--requests", "60", "--chunks", "4", "--host-slots", "64"],
        ["host-tier hit rate", "engine.store p99 ms", "chunks shed by slow tier", "bp / none"],
    ),
    "host_copy.py": (
        ["--sizes", "256K", "--repeats", "1", "--total", "4M"],
        ["256K  cross-layer   in order", "manager lookup, 1000-chunk prefix of host hits"],
    ),
    "obj_tier.py": (["--chunks", "4", "--rounds", "1"], ["store", "load", "raw MiB/s"]),
    "fs_scale.py": (
        ["--files", "300", "--changes", "10", "--interval", "0.5"],
        ["chunk files found (raw walk / indexed)", "300 / 300", "changes seen by that rescan",
         "periodic re-sync, CPU share of one core", "index bytes per chunk"],
    ),
    "p2p_tier.py": (["--tiny"], ["raw GiB/s", "256 KiB", "2 MiB"]),
    "hybrid_windows.py": (["--quick", "--threads", "1"],
                          ["full-attention twin", "hybrid, window 64", "twin / hybrid:", "bytes per hit token"]),
    "compression.py": (
        ["--prompts", "1", "--blocks", "1", "--levels", "1", "--repeats", "1", "--jobs", "1", "--threads", "1"],
        ["zstd-1+planes", "aes-gcm", "stored/payload", "fs tier, 1 x 64 chunks", "x plain"],
    ),
    "verify.py": (
        ["--chunks", "16", "--chunk-kib", "64", "--trials", "2", "--passes", "1", "--readers", "2"],
        ["16 chunk files x 64 KiB", "raw GiB/s", "verify GiB/s", "median", "target ratio >= 0.8"],
    ),
}
#: Benchmarks that need something this virtualenv lacks, and the test that runs them where it is.
RUN_ELSEWHERE: dict[str, str] = {
    "vllm_adapter.py": "tests/integrations/test_vllm_benchmark.py (needs vLLM: .ci/run's side virtualenv)",
}


def test_every_benchmark_is_smoke_tested() -> None:
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted([*RUNS, *RUN_ELSEWHERE])


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_runs(script: str, tmp_path: Path) -> None:
    args, expected = RUNS[script]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fragment in expected:
        assert fragment in proc.stdout, f"{fragment!r} missing from:\n{proc.stdout}"


def test_fs_tier_refuses_vllm_xxh3_without_vllm(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fs_tier.py"), "--vllm-xxh3", "--no-vllm"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--vllm-xxh3 runs vLLM with kvtier's checksum, but --no-vllm given" in proc.stderr


def test_fs_tier_loop_report_takes_the_loop_apart_three_ways(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fs_tier.py"), "--loop", "--repeats", "1", "--jobs", "1",
                           "--sizes", "256", "--mode", "buffered"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("  256 KiB buffered")]
    assert [row.split(":")[0].split("buffered")[1].strip() for row in rows] == [
        "real reads", "pool, no I/O", "no pool"], proc.stdout
    assert all("µs/job" in row and "selector polls/job" in row and "µs in them)" in row and "µs/chunk" in row for row in rows)


def test_fs_tier_worker_report_takes_a_chunk_read_apart(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fs_tier.py"), "--worker", "--repeats", "1", "--jobs", "1",
                           "--threads", "2", "--sizes", "64", "--mode", "buffered"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("   64 KiB buffered")]
    assert [row.split(":")[0].split("buffered")[1].strip() for row in rows] == ["1 thread", "2 threads"], proc.stdout
    for row in rows:
        assert all(way in row for way in ("open+read", "+xxh3-64", "+trailer, openat2", "slice loader")), row
    assert proc.stdout.count("the verification's system calls") == 2, proc.stdout


@pytest.mark.parametrize("reports", [["--loop", "--profile"], ["--worker", "--loop"]])
def test_fs_tier_reports_are_one_at_a_time(reports: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fs_tier.py"), *reports], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "are separate reports: give one" in proc.stderr

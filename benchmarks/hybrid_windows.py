"""Sliding windows vs full attention: what a hybrid model's prefix loads cost, next to its twin's.

The bench's miniature hybrid model (``kvtier.bench.hybrid``: 2 full-attention layers, 3
sliding-window layers, 1 recurrent layer) and its *full-attention twin* (the same 6 layers, all
full attention) serve the same multi-turn chat workload in this process, each with the ``cpu``
strategy (host memory only) and the two served request by request in lockstep. Each turn loads
the conversation's history from kvtier: the twin copies K/V of every layer for every hit token;
the hybrid model copies it for its full-attention layers only, the last ``window`` tokens for its
sliding-window layers and one state for its recurrent layer. Every request's logits are checked
against a full recompute (``--check``), so the smaller loads are proven sufficient.

Printed per model: the tokens kvtier supplied, the bytes it copied to the device and the
seconds those copies took (``engine.statistics()["copies"]``), the bytes per hit token and the
mean TTFT of the requests kvtier supplied; then the ratios twin / hybrid. With several
``--windows`` the hybrid model runs once per window (the twin, which has none, once). ::

    python benchmarks/hybrid_windows.py                  # windows 64 and 256, ~45 s on 2 busy cores
    python benchmarks/hybrid_windows.py --quick          # a smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvtier.bench.hybrid import HybridConfig, HybridDecoder  # noqa: E402
from kvtier.bench.runner import (  # noqa: E402
    BenchPlan,
    ReferenceLogits,
    RunResult,
    builtin_strategies,
    hybrid_capacities,
    run_point,
)
from kvtier.bench.workload import WorkloadSpec  # noqa: E402

KIB = 1024


def windows(text: str) -> list[int]:
    values = [int(item) for item in text.split(",") if item.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive token counts, got {text!r}")
    return values


async def run(args: argparse.Namespace) -> list[tuple[str, RunResult]]:
    """``(label, row)`` of the twin, then of the hybrid model at each window."""
    spec = WorkloadSpec(system_tokens=args.system_tokens, first_prompt_tokens=args.prompt_tokens,
                        turn_tokens=args.turn_tokens, rounds=args.rounds, seed=args.seed)
    cpu = builtin_strategies()["cpu"]
    rows: list[tuple[str, RunResult]] = []
    for i, window in enumerate(args.windows):
        config = replace(HybridConfig(seed=args.seed), window=window)
        blocks, host, twin_host = hybrid_capacities(config, spec, args.conversations)
        strategies = (cpu, cpu.with_twin()) if i == 0 else (cpu,)
        plan = BenchPlan(config, spec, (args.conversations,), strategies, blocks, host, check=args.check,
                         twin_host_bytes=twin_host)
        model = HybridDecoder(config)
        twin = ReferenceLogits(HybridDecoder(config.twin())) if i == 0 else None
        results = await run_point(plan, strategies, args.conversations, model, ReferenceLogits(model), twin=twin)
        if i == 0:
            rows.append(("full-attention twin", results[1]))
        rows.append((f"hybrid, window {window}", results[0]))
    return rows


def ratio(twin: float, hybrid: float) -> str:
    return f"{twin / hybrid:.2f}x" if hybrid else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=windows, default=[64, 256], help="sliding windows, in tokens (default 64,256)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="turns after the first prompt")
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="first prompt of each conversation")
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--check", choices=("all", "sample", "none"), default="sample",
                        help="logits check (sample: conversations 0 and 1)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 conversations of 3 short turns, window 64")
    args = parser.parse_args()
    if args.quick:
        args.windows, args.conversations, args.rounds = [64], 2, 2
        args.system_tokens, args.prompt_tokens, args.turn_tokens = 32, 160, 64
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("kvtier").setLevel(logging.ERROR)

    print(f"{args.conversations} conversations x {args.rounds + 1} turns: {args.system_tokens}-token system prompt + "
          f"{args.prompt_tokens}-token first prompt, +{args.turn_tokens} tokens per turn; cpu strategy (host memory); "
          f"logits check: {args.check}")
    rows = anyio.run(run, args)
    print(f"{'model':24} {'hit tokens':>10} {'bytes loaded':>13} {'KiB/hit tok':>11} {'load ms':>8} "
          f"{'TTFT hits ms':>12} {'max |error|':>11}")
    for label, r in rows:
        print(f"{label:24} {r.kvtier_tokens:>10} {r.bytes_loaded:>13} {r.bytes_per_hit_token / KIB:>11.2f} "
              f"{r.load_seconds * 1000:>8.2f} {r.ttft_kvtier_hit_mean_s * 1000:>12.1f} {r.max_logit_error:>11.2g}")
    twin = rows[0][1]
    print("twin / hybrid:")
    for label, r in rows[1:]:
        print(f"  {label}: bytes loaded {ratio(twin.bytes_loaded, r.bytes_loaded)}, "
              f"bytes per hit token {ratio(twin.bytes_per_hit_token, r.bytes_per_hit_token)}, "
              f"load seconds {ratio(twin.load_seconds, r.load_seconds)}, "
              f"TTFT of hits {ratio(twin.ttft_kvtier_hit_mean_s, r.ttft_kvtier_hit_mean_s)}")


if __name__ == "__main__":
    main()

"""Back-pressure on a slow secondary tier: the fast path with and without it.

One engine (CPU copy engine, host tier of ``--host-slots`` chunks) cascades every stored chunk
to a slow tier: an in-memory tier whose store jobs take ``--seconds-per-mib`` and run one at a
time (a serial device of ``1 / seconds-per-mib`` MiB/s, 250 MiB/s by default). Each request
stores a new prompt of ``--chunks`` chunks (64 KiB each), waits a simulated model step of
``--step-ms``, then loads a prompt stored up to ``--reuse-window`` requests earlier. The offered
store rate is about what the tier can write, so without back-pressure its queue, and the host
slots pinned for it, come and go and ``engine.store`` waits for slots; with
``backpressure: {"backpressure_cls": "EMABackpressureDetector"}`` (the LOCAL defaults: high water
0.010 s/MiB, low 0.002 s/MiB, measured from submit, so queueing counts) the tier sheds stores
instead: a faster fast path, fewer chunks in the slow tier.

The same workload (same seed) runs first without, then with back-pressure, in this process. Printed
per run: the host-tier hit rate of the loads (tokens served from host memory / tokens asked), the
hit rate from any tier, p50/p99 of ``engine.store`` (the fast path: device -> host; the cascade
runs behind it), the store jobs and chunks the slow tier shed, the chunks it wrote, its backlog at
the end, and the ratio with/without. ::

    python benchmarks/backpressure.py                    # ~20 s on 2 cores
    python benchmarks/backpressure.py --requests 150     # a smoke run
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import kvtier  # noqa: E402
from kvtier import KVGeometry  # noqa: E402
from kvtier.tiers.memory import MemoryTier  # noqa: E402

MIB = 1 << 20
# 4 layers x one 16-token block of 4 heads x 64 dims in fp16 = 64 KiB per chunk.
GEOMETRY = KVGeometry("bench/model", num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_size=16)
SLOW_LABEL = "1:DelayedTier"


class DelayedTier(MemoryTier):
    """A memory tier whose store jobs take ``seconds_per_mib`` per MiB, one job at a time.

    One sleep per job (the batch hook), not per chunk, so the delay is what was asked for and
    not the event loop's timer granularity times the chunks.
    """

    def __init__(self, config: Any, context: Any, **tunables: Any) -> None:
        super().__init__(config, context, **{**tunables, "max_concurrent_stores": 1})
        self.seconds_per_mib = float(config.options["seconds_per_mib"])

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        await anyio.sleep(self.seconds_per_mib * sum(view.nbytes for _, view in items) / MIB)
        for key, view in items:
            await self.write(key, view)
        return [None] * len(items)


@dataclass
class RunResult:
    host_hit_rate: float
    any_hit_rate: float
    store_p50_ms: float
    store_p99_ms: float
    stores_shed: int
    chunks_shed: int
    chunks_written: int
    backlog_jobs: int
    wall_s: float


def config(args: argparse.Namespace, backpressure: bool) -> dict[str, Any]:
    slow: dict[str, Any] = {"type": "DelayedTier", "module_path": "__main__", "capacity_bytes": 1 << 34,
                            "seconds_per_mib": args.seconds_per_mib}
    if backpressure:
        slow["backpressure"] = {"backpressure_cls": "EMABackpressureDetector"}
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": args.host_slots * GEOMETRY.slot_bytes(1),
            "secondary_tiers": [slow]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace, backpressure: bool) -> RunResult:
    rng = random.Random(args.seed)
    tokens_per_prompt = args.chunks * GEOMETRY.block_size
    prompts = [[rng.randrange(1, 50_000) for _ in range(tokens_per_prompt)] for _ in range(args.requests)]
    reuse = [rng.randint(1, args.reuse_window) for _ in range(args.requests)]
    device_blocks = 4 * args.chunks
    device_kv = torch.ones((device_blocks, GEOMETRY.num_layers, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads,
                            GEOMETRY.head_dim), dtype=torch.float16)
    store_blocks = list(range(args.chunks))
    load_blocks = list(range(args.chunks, 2 * args.chunks))
    store_s: list[float] = []
    asked = host_tokens = any_tokens = 0
    started = time.perf_counter()
    async with kvtier.open(config(args, backpressure), GEOMETRY, device_kv, flush_timeout_s=0) as engine:
        for i, tokens in enumerate(prompts):
            t0 = time.perf_counter()
            await engine.store(tokens, store_blocks)
            store_s.append(time.perf_counter() - t0)
            await anyio.sleep(args.step_ms / 1000)
            if i >= reuse[i]:
                outcome = await engine.load_with_sources(prompts[i - reuse[i]], load_blocks)
                asked += tokens_per_prompt
                any_tokens += outcome.tokens
                host_tokens += outcome.tokens_by_tier.get("0:primary", 0)
        wall = time.perf_counter() - started
        engine.manager.poll()
        stats = engine.manager.statistics()
        result = RunResult(
            host_hit_rate=host_tokens / max(asked, 1),
            any_hit_rate=any_tokens / max(asked, 1),
            store_p50_ms=1000 * statistics.median(store_s),
            store_p99_ms=1000 * percentile(store_s, 0.99),
            stores_shed=stats.backpressure_stores_dropped.get(SLOW_LABEL, 0),
            chunks_shed=stats.backpressure_blocks_dropped.get(SLOW_LABEL, 0),
            chunks_written=engine.tiers[0].statistics().bytes_written // GEOMETRY.slot_bytes(1),
            backlog_jobs=engine.manager.jobs_in_flight_by_tier()[SLOW_LABEL].cascade_jobs,
            wall_s=wall,
        )
    return result


def ratio(with_bp: float, without: float) -> str:
    return f"{with_bp / without:.2f}x" if without else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--chunks", type=int, default=16, help="chunks (64 KiB each) per stored prompt")
    parser.add_argument("--host-slots", type=int, default=384, help="host tier size in chunks")
    parser.add_argument("--seconds-per-mib", type=float, default=0.004, help="slow tier write time (serial)")
    parser.add_argument("--step-ms", type=float, default=1.0, help="simulated model step between requests")
    parser.add_argument("--reuse-window", type=int, default=30, help="a load asks a prompt this many requests back at most")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("kvtier").setLevel(logging.ERROR)  # state-change and close warnings are expected here

    mib_per_store = args.chunks * GEOMETRY.slot_bytes(1) / MIB
    print(f"{args.requests} requests: store {args.chunks} new chunks ({mib_per_store * 1024:.0f} KiB), "
          f"step {args.step_ms:g} ms, load a prompt <= {args.reuse_window} requests back; host tier "
          f"{args.host_slots} chunks; slow tier {args.seconds_per_mib:g} s/MiB serial "
          f"({1 / args.seconds_per_mib:.0f} MiB/s, {args.seconds_per_mib * mib_per_store * 1000:.1f} ms per store job)")
    without = anyio.run(run, args, False)
    with_bp = anyio.run(run, args, True)
    rows = [
        ("host-tier hit rate", f"{without.host_hit_rate:.3f}", f"{with_bp.host_hit_rate:.3f}",
         ratio(with_bp.host_hit_rate, without.host_hit_rate)),
        ("hit rate, any tier", f"{without.any_hit_rate:.3f}", f"{with_bp.any_hit_rate:.3f}",
         ratio(with_bp.any_hit_rate, without.any_hit_rate)),
        ("engine.store p50 ms", f"{without.store_p50_ms:.3f}", f"{with_bp.store_p50_ms:.3f}",
         ratio(with_bp.store_p50_ms, without.store_p50_ms)),
        ("engine.store p99 ms", f"{without.store_p99_ms:.3f}", f"{with_bp.store_p99_ms:.3f}",
         ratio(with_bp.store_p99_ms, without.store_p99_ms)),
        ("store jobs shed by slow tier", str(without.stores_shed), str(with_bp.stores_shed), ""),
        ("chunks shed by slow tier", str(without.chunks_shed), str(with_bp.chunks_shed), ""),
        ("chunks written to slow tier", str(without.chunks_written), str(with_bp.chunks_written),
         ratio(with_bp.chunks_written, without.chunks_written)),
        ("slow-tier backlog at end (jobs)", str(without.backlog_jobs), str(with_bp.backlog_jobs), ""),
        ("wall s", f"{without.wall_s:.2f}", f"{with_bp.wall_s:.2f}", ratio(with_bp.wall_s, without.wall_s)),
    ]
    print(f"{'':32} {'no back-pressure':>17} {'back-pressure':>14} {'bp / none':>10}")
    for name, a, b, r in rows:
        print(f"{name:32} {a:>17} {b:>14} {r:>10}")


if __name__ == "__main__":
    main()

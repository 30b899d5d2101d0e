"""``kvtier bench``: reproduce the tiered-offloading scaling chart on this machine.

``run_bench_cli(argv)`` parses the arguments, runs every (strategy, conversations) pair of the
sweep, prints a header and a table, writes the JSON results and the PNG chart, and returns the
exit status: 0 on success, 1 when a request's logits differ from a full recompute (offloaded KV
was wrong) or a run failed, 2 on bad arguments (one line on stderr naming the option).

Comma-separated lists (``--conversations``, ``--strategies``) refuse empty items and an item
given twice. The fs tier's per-run directories are created (``kvtier-bench-*``) under
``--fs-root`` or the system's temporary directory and removed after their run, unless
``--keep-fs-dirs``; nothing else there is ever removed.

``--model hybrid`` serves a miniature hybrid model (full attention, sliding-window attention and
a recurrent layer: ``kvtier.bench.hybrid``) and, for every strategy, its full-attention twin
(``<strategy>/twin``); the report sets the bytes each loaded per hit token, and their TTFTs,
side by side. Its device pool has no prefix cache, so ``--device-conversations`` and
``--layerwise`` do not apply to it.

``--warmup`` adds, for every strategy with a secondary tier, ``<strategy>/warmup``: before each
request it starts ``engine.prefetch`` of the next request's prefix in the background, as a
router would, and the report sets the TTFTs with and without side by side. ``--write-policies``
adds ``<strategy>/write_back`` and ``<strategy>/selective`` (``write_policy`` on every secondary
tier) and reports the bytes the secondary tiers wrote during the run and the throughput against
write-through.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import stat
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvtier.ops.cli_args import CliParser, exit_codes_epilog

__all__ = ["run_bench_cli", "build_parser", "summarize", "QUICK", "FULL", "QUICK_HYBRID", "FULL_HYBRID", "AGREEMENT"]

#: Workload and sweep of ``--quick`` (CI: well under a minute on 2 cores) ...
QUICK: dict[str, Any] = {
    "system_tokens": 128, "first_prompt_tokens": 640, "turn_tokens": 128, "rounds": 3,
    "conversations": (2, 4, 8), "check": "all",
}
#: ... and of the default run (under 3 minutes on 2 cores).
FULL: dict[str, Any] = {
    "system_tokens": 128, "first_prompt_tokens": 512, "turn_tokens": 128, "rounds": 4,
    "conversations": (1, 2, 4, 8, 12), "check": "sample",
}
#: Workload and sweep of ``--model hybrid --quick`` (each strategy runs twice: hybrid and twin) ...
QUICK_HYBRID: dict[str, Any] = {
    "system_tokens": 64, "first_prompt_tokens": 256, "turn_tokens": 64, "rounds": 3,
    "conversations": (2, 4), "check": "all",
}
#: ... and of ``--model hybrid``.
FULL_HYBRID: dict[str, Any] = {
    "system_tokens": 128, "first_prompt_tokens": 512, "turn_tokens": 128, "rounds": 4,
    "conversations": (1, 2, 4, 8), "check": "sample",
}
#: Default tier sizes, in conversations' working sets: the sweeps straddle both.
DEVICE_CONVERSATIONS = 3.0
HOST_CONVERSATIONS = 6.0
#: Strategies whose throughputs at the smallest sweep point are within this fraction of each
#: other are said to run alike (the summary line after the table).
AGREEMENT = 0.10
_MAX_CONVERSATIONS = 10_000
_MAX_CONFIG_BYTES = 1 << 20


def _comma_list(text: str) -> list[str]:
    """The items of a comma-separated list: none empty, none given twice (a typo, not a wish)."""
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once in {text!r}")
    return items


def _conversation_counts(text: str) -> tuple[int, ...]:
    """``--conversations``: distinct counts in 1..10000, run in increasing order."""
    items = _comma_list(text)
    try:
        values = [int(item) for item in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(not 0 < v <= _MAX_CONVERSATIONS for v in values):
        raise argparse.ArgumentTypeError(f"each count must be in 1..{_MAX_CONVERSATIONS}, got {text!r}")
    if len(set(values)) < len(values):  # "2,02"
        raise argparse.ArgumentTypeError(f"a count is given more than once in {text!r}")
    return tuple(sorted(values))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="kvtier bench",
        description="Multi-turn chat prefill on a miniature transformer: throughput vs concurrent "
        "conversations for recompute, cpu and cpu+fs offloading (and any --config).",
        epilog=exit_codes_epilog({
            0: "success",
            1: "a request's logits differ from a full recompute (offloaded KV was wrong), or a run failed",
            2: "usage error (bad arguments or configuration)",
        }),
    )
    p.add_argument("--model", choices=("dense", "hybrid"), default="dense",
                   help="dense: a 4-layer transformer (default); hybrid: full + sliding-window attention + a "
                   "recurrent layer, each strategy also run on its full-attention twin ('<strategy>/twin')")
    p.add_argument("--quick", action="store_true",
                   help="small sweep for CI (2, 4, 8 conversations, about 100 s on a busy 2-core VM; "
                   "with --model hybrid 2, 4 conversations of shorter prompts, about 20 s)")
    p.add_argument("--strategies", type=_comma_list, default="recompute,cpu,cpu+fs",
                   help="comma-separated built-in strategies: recompute, cpu, cpu+fs (default: all)")
    p.add_argument("--config", action="append", default=[], metavar="FILE.json",
                   help="extra strategy: a kv_connector_extra_config JSON file (named after the file); "
                   "repeatable. cpu_bytes_to_use defaults to the bench's host size")
    p.add_argument("--layerwise", action="store_true",
                   help="also run every kvtier strategy with layer-wise loading (engine.load_layerwise: "
                   "layer i computes while layer i+1 loads), as '<strategy>/layerwise', and report the "
                   "TTFT with and without it")
    p.add_argument("--warmup", action="store_true",
                   help="also run every strategy with a secondary tier warming each next request's prefix "
                   "(engine.prefetch while the current request computes), as '<strategy>/warmup', and report "
                   "the TTFT with and without it")
    p.add_argument("--write-policies", action="store_true",
                   help="also run every strategy with a secondary tier with write_policy write_back and "
                   "selective, as '<strategy>/write_back' and '<strategy>/selective', and report the bytes "
                   "written to the secondary tiers and the throughput against write_through")
    p.add_argument("--conversations", type=_conversation_counts,
                   help="sweep, e.g. 2,4,8 (distinct counts; default 1,2,4,8,12, with --quick 2,4,8)")
    p.add_argument("--rounds", type=_non_negative_int, help="turns after the first prompt")
    p.add_argument("--system-tokens", type=_positive_int)
    p.add_argument("--prompt-tokens", type=_positive_int, help="first prompt of each conversation")
    p.add_argument("--turn-tokens", type=_positive_int, help="tokens appended per round")
    p.add_argument("--device-conversations", type=_positive_float, default=DEVICE_CONVERSATIONS,
                   help="device KV pool size, in conversations' working sets (default %(default)s)")
    p.add_argument("--host-conversations", type=_positive_float, default=HOST_CONVERSATIONS,
                   help="host tier size, in conversations' working sets (default %(default)s)")
    p.add_argument("--fs-root", help="existing directory in which the fs tier's per-run directories "
                   "(kvtier-bench-*) are created; only those are ever removed (default: system temp)")
    p.add_argument("--keep-fs-dirs", action="store_true",
                   help="keep the fs tier's per-run directories after the bench and print where they are "
                   "(for 'kvtier inspect DIR'); by default each is removed after its run")
    p.add_argument("--output", default="bench-results.json", help="JSON results (default %(default)s)")
    p.add_argument("--chart", help="PNG chart (default: next to --output, same name .png)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--threads", type=_positive_int, help="torch threads (default: all CPUs)")
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="cold runs of every (strategy, conversations) point; the table, JSON and chart "
                   "report the median and the min-max spread (default %(default)s)")
    p.add_argument("--check", choices=("all", "sample", "none"),
                   help="logits check against a full recompute (default: all with --quick, else sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep kvtier's warnings")
    return p


def run_bench_cli(argv: Sequence[str], stdout: TextIO | None = None) -> int:
    """Entry point of ``kvtier bench`` (see the module docstring for the exit status)."""
    out = stdout if stdout is not None else sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    try:
        plan, describe = _make_plan(args)
    except ValueError as exc:
        try:
            parser.error(str(exc))  # one line, as argparse's own usage errors
        except SystemExit as usage:
            return int(usage.code or 2)
    return _run(args, plan, describe, out)


def _make_plan(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    import torch

    from kvtier.bench.hybrid import HybridConfig
    from kvtier.bench.model import ModelConfig
    from kvtier.bench.runner import (
        WRITE_POLICIES,
        BenchPlan,
        Strategy,
        builtin_strategies,
        default_capacities,
        hybrid_capacities,
    )
    from kvtier.bench.workload import WorkloadSpec

    hybrid = args.model == "hybrid"
    if hybrid:
        preset = QUICK_HYBRID if args.quick else FULL_HYBRID
    else:
        preset = QUICK if args.quick else FULL
    model: ModelConfig | HybridConfig = HybridConfig(seed=args.seed) if hybrid else ModelConfig(seed=args.seed)
    workload = WorkloadSpec(
        system_tokens=args.system_tokens or preset["system_tokens"],
        first_prompt_tokens=args.prompt_tokens or preset["first_prompt_tokens"],
        turn_tokens=args.turn_tokens or preset["turn_tokens"],
        rounds=preset["rounds"] if args.rounds is None else args.rounds,
        vocab_size=model.vocab_size,
        seed=args.seed,
    )
    builtins = builtin_strategies()
    strategies: list[Strategy] = []
    for name in args.strategies:
        if name not in builtins:
            raise ValueError(f"--strategies: unknown strategy {name!r}; built-in: {', '.join(builtins)}")
        strategies.append(builtins[name])
    for path in args.config:
        strategies.append(_load_config_strategy(path, {s.name for s in strategies}))
    if not strategies:
        raise ValueError("no strategy to run")
    if args.layerwise and hybrid:
        raise ValueError("--layerwise: not available with --model hybrid")
    if hybrid:
        strategies += [s.with_twin() for s in strategies]
    if args.layerwise:
        layerwise = [s.with_layerwise() for s in strategies if s.config is not None]
        if not layerwise:
            raise ValueError("--layerwise: no kvtier strategy to load layer-wise (only recompute was chosen)")
        strategies += layerwise
    with_tiers = [s for s in strategies if s.secondary_tiers and not s.layerwise]
    if (args.warmup or args.write_policies) and not with_tiers:
        flag = "--warmup" if args.warmup else "--write-policies"
        raise ValueError(f"{flag}: no strategy with a secondary tier (e.g. cpu+fs) was chosen")
    if args.warmup:
        strategies += [s.with_warmup() for s in with_tiers]
    if args.write_policies:
        strategies += [s.with_write_policy(policy) for s in with_tiers for policy in WRITE_POLICIES]
    if args.fs_root is not None and not os.path.isdir(args.fs_root):
        raise ValueError(f"--fs-root {args.fs_root!r} is not a directory")
    fs_root = os.path.abspath(args.fs_root) if args.fs_root is not None else None  # printed, when kept
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    twin_host_bytes = None
    if isinstance(model, HybridConfig):
        device_blocks, host_bytes, twin_host_bytes = hybrid_capacities(model, workload, args.host_conversations)
    else:
        device_blocks, host_bytes = default_capacities(model, workload, args.device_conversations,
                                                       args.host_conversations)
    plan = BenchPlan(
        model=model,
        workload=workload,
        conversations=args.conversations or preset["conversations"],
        strategies=tuple(strategies),
        device_blocks=device_blocks,
        host_bytes=host_bytes,
        check=args.check or preset["check"],
        fs_root=fs_root,
        device=device,
        repeats=args.repeats,
        keep_fs_dirs=args.keep_fs_dirs,
        twin_host_bytes=twin_host_bytes,
    )
    describe = {
        "workload": (
            f"{workload.system_tokens}-token shared system prompt + {workload.first_prompt_tokens}-token "
            f"first prompt, then {workload.rounds} rounds of +{workload.turn_tokens} tokens "
            f"(prompts {workload.prompt_tokens(0)}..{workload.prompt_tokens(workload.rounds)} tokens), "
            f"round-robin over {', '.join(map(str, plan.conversations))} conversations"
        ),
        "device_tokens": device_blocks * model.block_size,
        "device_conversations": args.device_conversations,
        "host_bytes": host_bytes,
        "host_conversations": args.host_conversations,
        "fs_root": (f"a fresh directory per run under {fs_root or 'the system temp directory'}, "
                    + ("kept after the bench" if args.keep_fs_dirs else "removed after its run")),
        "check": {
            "all": "every request compared with a full recompute",
            "sample": "requests of conversations 0 and 1 of every run compared with a full recompute",
            "none": "disabled",
        }[plan.check],
        "repeats": plan.repeats,
    }
    if hybrid:
        describe["device_tokens"] = None
        describe["twin_host_bytes"] = twin_host_bytes
        describe["tiers"] = (
            f"device: no prefix cache (every request loads from kvtier or recomputes), "
            f"host {host_bytes / 2**20:.1f} MiB for the hybrid model and {(twin_host_bytes or 0) / 2**20:.1f} MiB "
            f"for its twin (~{args.host_conversations} conversations each), fs unbounded ({describe['fs_root']})"
        )
    return plan, describe


def _load_config_strategy(path: str, taken: set[str]) -> Any:
    from kvtier.bench.runner import Strategy
    from kvtier.config import EngineConfig

    text = _read_config_file(path)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path!r}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r}: expected a JSON object (kv_connector_extra_config)")
    # Validate now (with a placeholder host size) so a typo fails before any run starts.
    try:
        EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 30, **config})
    except ValueError as exc:
        raise ValueError(f"--config {path!r}: {exc}") from None
    name = Path(path).stem
    while name in taken:
        name += "'"
    return Strategy(name, config)


def _read_config_file(path: str) -> str:
    """The text of a ``--config`` file; ``ValueError`` naming the option and the path otherwise.

    Opened without waiting (a FIFO would block the open until a writer came) and refused unless
    it is a regular file of at most 1 MiB of UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"--config {path!r}: cannot open it ({_reason(exc)})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ValueError(f"--config {path!r}: is a directory, not a JSON file")
        if not stat.S_ISREG(mode):
            raise ValueError(f"--config {path!r}: not a regular file")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: cannot read it ({_reason(exc)})") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path!r}: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path!r}: not UTF-8 text (byte {exc.start})") from None


def _reason(exc: OSError) -> str:
    """An ``OSError`` as a reader wants it: "No such file or directory", not "[Errno 2] ..."."""
    return (exc.strerror or type(exc).__name__).lower()


def _run(args: argparse.Namespace, plan: Any, describe: dict[str, Any], out: TextIO) -> int:
    import anyio
    import torch

    import kvtier
    from kvtier.bench.hybrid import HybridDecoder
    from kvtier.bench.model import TinyDecoder
    from kvtier.bench.report import (
        Progress,
        describe_machine,
        describe_model,
        format_table,
        header_lines,
        layerwise_comparison,
        layerwise_lines,
        twin_comparison,
        twin_lines,
        warmup_comparison,
        warmup_lines,
        write_chart,
        write_json,
        write_policy_comparison,
        write_policy_lines,
    )
    from kvtier.bench.runner import LogitsMismatch, capacity_markers, capacity_tokens, run_plan

    threads = args.threads or os.cpu_count() or 1
    previous_threads = torch.get_num_threads()
    kvtier_logger = logging.getLogger("kvtier")
    previous_level = kvtier_logger.level
    if not args.verbose:
        # Per-run fs tiers warn that they are unbounded; in a bench that is noise.
        kvtier_logger.setLevel(logging.ERROR)
    workload = plan.workload
    mean_context = workload.tokens_per_conversation / workload.requests_per_conversation / 2
    model_info = describe_model(plan.model, mean_context)
    machine = describe_machine(plan.device, threads)
    for line in header_lines(model_info, machine, describe):
        print(line, file=out)
    progress = Progress(plan.total_requests, enabled=not args.no_progress)
    started = time.perf_counter()
    try:
        torch.set_num_threads(threads)
        model = (HybridDecoder(plan.model, device=plan.device) if plan.hybrid
                 else TinyDecoder(plan.model, device=plan.device))
        # As vLLM's engine core does once started: what is alive now (torch, the model) is left out
        # of every later collection, so a full one (~70 ms with torch imported) cannot land inside
        # one strategy's request and be measured as its latency.
        gc.collect()
        gc.freeze()
        results = anyio.run(
            run_plan, plan, model, lambda s, n: progress.advance(f"{s} x{n}")
        )
    except LogitsMismatch as exc:
        progress.close()
        print(f"kvtier bench: LOGITS CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        gc.unfreeze()
        torch.set_num_threads(previous_threads)
        kvtier_logger.setLevel(previous_level)
    progress.close()
    total_s = time.perf_counter() - started
    print(format_table(results, bytes_per_hit_token=plan.hybrid), file=out)
    checked = sum(r.checked_requests * r.repeats for r in results)
    requests = sum(r.requests * r.repeats for r in results)
    max_error = max((r.max_logit_error for r in results), default=0.0)
    print(f"logits check: {checked} of {requests} requests match a full recompute "
          f"(max |error| {max_error:.2g}); total {total_s:.1f}s", file=out)
    summary = summarize([r for r in results if not plan.hybrid or r.strategy in plain_names(plan)], plan.conversations)
    if plan.hybrid:
        summary["hybrid_vs_twin"] = twin_comparison(results)
        summary["lines"] += twin_lines(summary["hybrid_vs_twin"])
    if args.layerwise:
        summary["layerwise"] = layerwise_comparison(results)
        summary["lines"] += layerwise_lines(summary["layerwise"])
    if args.warmup:
        summary["warmup"] = warmup_comparison(results)
        summary["lines"] += warmup_lines(summary["warmup"])
    if args.write_policies:
        summary["write_policies"] = write_policy_comparison(results)
        summary["lines"] += write_policy_lines(summary["write_policies"])
    for line in summary["lines"]:
        print(line, file=out)
    if args.keep_fs_dirs:
        kept = [path for r in results for path in r.fs_dirs]
        if kept:
            print("fs tier directories kept (--keep-fs-dirs); look inside with 'kvtier inspect DIR':", file=out)
            for path in kept:
                print(f"  {path}", file=out)
        else:
            print("--keep-fs-dirs: no strategy had an fs tier in a fresh directory; nothing kept", file=out)
    if plan.hybrid:
        # No device prefix cache: only the host tier runs out (sized as hybrid_capacities does).
        slot = plan.model.kv_model().slot_bytes(1)
        host_tokens = plan.host_bytes // slot // len(plan.model.groups()) * plan.model.block_size
        markers = [m for m in capacity_markers(workload, plan.conversations, 0, host_tokens) if m["tier"] == "host"]
    else:
        device_tokens, host_tokens = capacity_tokens(plan.model, plan.device_blocks, plan.host_bytes)
        markers = capacity_markers(workload, plan.conversations, device_tokens, host_tokens)
    document = {
        "kvtier_version": kvtier.__version__,
        "machine": machine,
        "model": model_info,
        "workload": {**workload.__dict__, "conversations": list(plan.conversations),
                     "description": describe["workload"]},
        "capacities": {
            "device_blocks": plan.device_blocks,
            "device_tokens": describe["device_tokens"],
            "device_conversations": describe["device_conversations"],
            "host_bytes": plan.host_bytes,
            "host_tokens": host_tokens,
            "host_conversations": describe["host_conversations"],
            "fs_root": describe["fs_root"],
            **({"twin_host_bytes": plan.twin_host_bytes} if plan.hybrid else {}),
        },
        "strategies": {s.name: (dict(s.config) if s.config is not None else None) for s in plan.strategies},
        "logits_check": {"mode": plan.check, "description": describe["check"], "checked_requests": checked,
                         "requests": requests, "max_abs_error": max_error, "passed": True},
        "summary": {k: v for k, v in summary.items() if k != "lines"},
        "repeats": plan.repeats,
        "markers": markers,
        "total_seconds": total_s,
        "results": [r.as_dict() for r in results],
    }
    write_json(args.output, document)
    print(f"results: {args.output}", file=out)
    chart = args.chart or str(Path(args.output).with_suffix(".png"))
    if plan.hybrid:
        title = (f"kvtier bench --model hybrid{' --quick' if args.quick else ''}: {plan.model.num_layers}-layer toy "
                 f"hybrid (window {plan.model.window}) and its\nfull-attention twin (dashed), "
                 f"{workload.rounds + 1} turns per conversation")
    else:
        title = (f"kvtier bench{' --quick' if args.quick else ''}: {plan.model.num_layers}-layer toy decoder, "
                 f"{workload.rounds + 1} turns per conversation")
    skipped = write_chart(chart, results, title, markers=markers)
    print(skipped or f"chart: {chart}", file=out)
    return 0


def plain_names(plan: Any) -> set[str]:
    """Names of the strategies that serve the plan's own model (not its full-attention twin)."""
    return {s.name for s in plan.strategies if not s.twin}


def summarize(results: Sequence[Any], sweep: Sequence[int]) -> dict[str, Any]:
    """The seed's shape in numbers: how alike the strategies run at the smallest N (where the
    device holds everything, so offloading should cost nothing), speed-ups at the largest.

    Printed ``lines``, and the numbers behind them: ``spread_at_smallest`` (the rows' tok/s,
    fastest over slowest, minus 1), ``paired_spread_at_smallest`` (the largest median, over the
    requests of every run, of one strategy's service time over another's for the same request:
    the strategies of a run serve each request back to back) and
    ``speedup_vs_recompute_at_largest``. A run at a small N has few requests, so one request
    slowed by the machine's other work moves its whole tok/s; the paired median is not moved by
    it. Agreement is claimed only when one of the two spreads is within :data:`AGREEMENT`, and
    says which; with one strategy nothing is compared.
    """
    def at(n: int) -> dict[str, Any]:
        return {r.strategy: r for r in results if r.conversations == n}

    small, large = at(min(sweep)), at(max(sweep))
    summary: dict[str, Any] = {"lines": []}
    throughputs = {name: r.throughput_tokens_per_s for name, r in small.items()}
    if len(small) > 1 and min(throughputs.values()) > 0:
        fastest = max(throughputs, key=throughputs.__getitem__)
        slowest = min(throughputs, key=throughputs.__getitem__)
        spread = throughputs[fastest] / throughputs[slowest] - 1
        paired, pairs = _paired_spread(list(small.values()))
        summary["spread_at_smallest"] = spread
        summary["paired_spread_at_smallest"] = paired
        head = f"at {min(sweep)} conversations: strategies"
        if spread <= AGREEMENT:
            line = f"{head} within {spread:.0%} of each other"
        elif paired is not None and paired <= AGREEMENT:
            repeats = max(r.repeats for r in small.values())
            line = (f"{head} within {paired:.0%} of each other request by request (median of {pairs} "
                    f"paired requests); tok/s differ by up to {spread:.0%}, moved by a few slow requests"
                    + (" (--repeats 3 reports medians)" if repeats == 1 else ""))
        else:
            line = f"{head} differ by up to {spread:.0%} in tok/s ({fastest} fastest, {slowest} slowest)"
        summary["lines"].append(line)
    base = large.get("recompute")
    if base is not None and base.throughput_tokens_per_s > 0:
        speedups = {name: r.throughput_tokens_per_s / base.throughput_tokens_per_s
                    for name, r in large.items() if name != "recompute"}
        summary["speedup_vs_recompute_at_largest"] = speedups
        if speedups:
            summary["lines"].append(
                f"at {max(sweep)} conversations vs recompute: "
                + ", ".join(f"{name} {x:.2f}x" for name, x in speedups.items())
            )
    return summary


def _paired_spread(rows: Sequence[Any]) -> tuple[float | None, int]:
    """``(largest paired median ratio - 1, requests per pair)`` over every two of ``rows`` (the
    strategies of one sweep point); ``(None, 0)`` without per-request times to pair."""
    def times(row: Any) -> list[list[float]]:
        return [run["service_times_s"] for run in row.runs] if row.runs else [row.service_times_s]

    worst: float | None = None
    pairs = 0
    for a in rows:
        for b in rows:
            if a is b:
                continue
            ratios = [x / y for run_a, run_b in zip(times(a), times(b)) if len(run_a) == len(run_b)
                      for x, y in zip(run_a, run_b) if x > 0 and y > 0]
            if not ratios:
                return None, 0
            pairs = len(ratios)
            worst = max(worst or 0.0, statistics.median(ratios) - 1)
    return worst, pairs

"""What the bench prints and writes: header, progress bar, table, JSON document and chart.

For a hybrid model the table has a bytes-per-hit-token column and :func:`twin_comparison` sets
each strategy's row beside its full-attention twin's (``<strategy>/twin``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from kvtier.bench.hybrid import HybridConfig
from kvtier.bench.model import LLAMA_8B_FLOPS_PER_TOKEN, LLAMA_8B_KV_BYTES_PER_TOKEN, ModelConfig
from kvtier.bench.runner import (
    DEVICE_LABEL,
    LAYERWISE_SUFFIX,
    RECOMPUTE_LABEL,
    TWIN_SUFFIX,
    WARMUP_SUFFIX,
    WRITE_POLICIES,
    RunResult,
)

__all__ = [
    "Progress",
    "describe_machine",
    "describe_model",
    "header_lines",
    "format_table",
    "layerwise_comparison",
    "layerwise_lines",
    "twin_comparison",
    "twin_lines",
    "write_json",
    "write_chart",
]


class Progress:
    """A one-line progress bar on ``stream`` (``\\r`` updates, no dependency); silent if disabled."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.started = time.monotonic()
        isatty = getattr(self.stream, "isatty", None)
        self._interactive = bool(isatty and isatty())

    def advance(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        if not self._interactive:
            # A log file gets a plain line every tenth of the way, not thousands of \r updates.
            step = max(1, self.total // 10)
            if self.done % step == 0 or self.done == self.total:
                self.stream.write(f"{self.done}/{self.total} requests  {elapsed:5.1f}s  {label}\n")
                self.stream.flush()
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} requests  {elapsed:5.1f}s  {label:<24}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._interactive:
            self.stream.write("\n")
            self.stream.flush()


def describe_machine(device: str, threads: int) -> dict[str, Any]:
    """Where the numbers come from (goes into the JSON and the header)."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe_model(model: ModelConfig | HybridConfig, mean_context: float) -> dict[str, Any]:
    """FLOPs and KV bytes per token, and how their ratio compares with Llama-3.1-8B's.

    A hybrid model (``"kind": "hybrid"``) is described with its full-attention twin instead.
    """
    if isinstance(model, HybridConfig):
        return _describe_hybrid(model, mean_context)
    flops = model.flops_per_token(int(mean_context))
    kv = model.kv_bytes_per_token
    ratio = flops / kv
    llama_ratio = LLAMA_8B_FLOPS_PER_TOKEN / LLAMA_8B_KV_BYTES_PER_TOKEN
    return {
        "config": dict(model.__dict__),
        "mean_context_tokens": mean_context,
        "flops_per_token": flops,
        "kv_bytes_per_token": kv,
        "flops_per_kv_byte": ratio,
        "llama_3_1_8b_flops_per_kv_byte": llama_ratio,
        "ratio_vs_llama_3_1_8b": ratio / llama_ratio,
    }


def _describe_hybrid(model: HybridConfig, mean_context: float) -> dict[str, Any]:
    twin = model.twin()
    context = int(mean_context)
    # KV a load of `context` tokens copies: full layers every token, sliding layers the window
    # (rounded out to whole blocks), the recurrent layer one state.
    window_tokens = min(context, -(-model.window // model.block_size) * model.block_size + model.block_size)
    per_layer = model.attention_bytes_per_token
    loaded = (model.layer_kinds.count("full") * context + model.layer_kinds.count("sliding") * window_tokens) * per_layer
    loaded += model.layer_kinds.count("recurrent") * model.state_bytes
    return {
        "kind": "hybrid",
        "config": {**model.__dict__, "layer_kinds": list(model.layer_kinds)},
        "mean_context_tokens": mean_context,
        "flops_per_token": model.flops_per_token(context),
        "twin_flops_per_token": twin.flops_per_token(context),
        "attention_bytes_per_token_per_layer": per_layer,
        "state_bytes_per_layer": model.state_bytes,
        "kv_bytes_per_token": model.kv_bytes_per_token(),
        "twin_kv_bytes_per_token": twin.kv_bytes_per_token(),
        "kv_bytes_at_mean_context": loaded,
        "twin_kv_bytes_at_mean_context": twin.kv_bytes_per_token() * context,
    }


def _hybrid_model_lines(m: Mapping[str, Any]) -> list[str]:
    cfg = m["config"]
    kinds = cfg["layer_kinds"]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("full", "sliding", "recurrent") if k in kinds)
    context = m["mean_context_tokens"]
    return [
        f"model: hybrid, {len(kinds)} layers ({counts}: {' '.join(kinds)}), hidden {cfg['hidden_size']}, "
        f"{cfg['num_heads']} heads ({cfg['num_kv_heads']} KV) x {cfg['head_dim']}, window {cfg['window']} tokens, "
        f"recurrent state {m['state_bytes_per_layer'] / 1024:.1f} KiB, MLP {cfg['intermediate_size']}, "
        f"{cfg['dtype']}, block {cfg['block_size']} tokens",
        f"  {m['flops_per_token'] / 1e6:.1f} MFLOPs/token; KV of a {context:.0f}-token prefix "
        f"{m['kv_bytes_at_mean_context'] / 1024:.0f} KiB (full layers {m['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
        f"sliding layers the window, recurrent layer one state)",
        f"  full-attention twin (every layer full attention, same sizes): {m['twin_flops_per_token'] / 1e6:.1f} "
        f"MFLOPs/token, {m['twin_kv_bytes_per_token'] / 1024:.1f} KiB KV/token, "
        f"{m['twin_kv_bytes_at_mean_context'] / 1024:.0f} KiB for the same prefix",
    ]


def header_lines(model_info: Mapping[str, Any], machine: Mapping[str, Any], plan_info: Mapping[str, Any]) -> list[str]:
    """The lines printed before the table: machine, model, workload, tiers and the check."""
    m = model_info
    cfg = m["config"]
    machine_line = (f"machine: {machine['platform']}, {machine['cpu_count']} CPUs, torch {machine['torch']} "
                    f"({machine['torch_threads']} threads), device {machine['device']}")
    if m.get("kind") == "hybrid":
        return [
            "kvtier bench --model hybrid: multi-turn chat prefill on a hybrid model and its full-attention twin",
            machine_line,
            *_hybrid_model_lines(m),
            f"workload: {plan_info['workload']}",
            f"tiers: {plan_info['tiers']}",
            f"logits check: {plan_info['check']}",
        ] + ([
            f"repeats: {plan_info['repeats']} cold runs of every point, interleaved; tok/s and TTFT are medians"
        ] if plan_info.get("repeats", 1) > 1 else [])
    return [
        "kvtier bench: multi-turn chat prefill, throughput vs concurrent conversations",
        machine_line,
        f"model: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_heads']} heads "
        f"({cfg['num_kv_heads']} KV) x {cfg['head_dim']}, MLP {cfg['intermediate_size']}, {cfg['dtype']}, "
        f"block {cfg['block_size']} tokens",
        f"  {m['flops_per_token'] / 1e6:.1f} MFLOPs/token (at {m['mean_context_tokens']:.0f} tokens of context), "
        f"{m['kv_bytes_per_token'] / 1024:.1f} KiB KV/token -> {m['flops_per_kv_byte']:,.0f} FLOPs per KV byte",
        f"  Llama-3.1-8B: ~16 GFLOPs/token, 128 KiB KV/token (bf16) -> "
        f"{m['llama_3_1_8b_flops_per_kv_byte']:,.0f} FLOPs per KV byte; this model recomputes "
        f"{m['ratio_vs_llama_3_1_8b']:.2f}x as much per byte of KV (a real model favours loading more)",
        f"workload: {plan_info['workload']}",
        f"tiers: device {plan_info['device_tokens']} tokens (~{plan_info['device_conversations']} conversations), "
        f"host {plan_info['host_bytes'] / 2**20:.1f} MiB (~{plan_info['host_conversations']} conversations), "
        f"fs unbounded ({plan_info['fs_root']})",
        f"logits check: {plan_info['check']}",
    ] + ([
        f"repeats: {plan_info['repeats']} cold runs of every point, interleaved; tok/s and TTFT are "
        f"medians, (min-max) in brackets; every run is logits-checked, token counts are the first run's"
    ] if plan_info.get("repeats", 1) > 1 else [])


def _with_range(value: str, low: str, high: str, repeats: int) -> str:
    return f"{value} ({low}\u2013{high})" if repeats > 1 else value


def format_table(results: Sequence[RunResult], bytes_per_hit_token: bool = False) -> str:
    """One row per point: throughput, TTFT p50/p90, tokens from each tier, hit rate.

    A row of several runs shows median throughput and TTFT p50 with their (min-max) spread.
    ``bytes_per_hit_token`` adds the KiB kvtier copied to the device per token it supplied.
    """
    tiers: list[str] = [DEVICE_LABEL]
    for r in results:
        for label in sorted(r.tokens_by_tier):
            if label not in tiers and label != RECOMPUTE_LABEL:
                tiers.append(label)
    tiers.append(RECOMPUTE_LABEL)
    head = ["strategy", "conv", "WS tok", "tok/s", "TTFT p50", "TTFT p90", *tiers, "hit"]
    if bytes_per_hit_token:
        head.append("KiB/hit tok")
    rows = [head]
    for r in results:
        rows.append(
            [
                r.strategy,
                str(r.conversations),
                str(r.working_set_tokens),
                _with_range(*_spread(r, "throughput_tokens_per_s", lambda v: f"{v:,.0f}"), r.repeats),
                _with_range(*_spread(r, "ttft_p50_s", lambda v: f"{v * 1000:.0f}"), r.repeats) + " ms",
                f"{r.ttft_p90_s * 1000:.0f} ms",
                *[str(r.tokens_by_tier.get(t, 0)) for t in tiers],
                f"{r.hit_rate:.0%}",
            ]
        )
        if bytes_per_hit_token:
            rows[-1].append(f"{r.bytes_per_hit_token / 1024:.2f}" if r.kvtier_tokens else "-")
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: TTFTs compared between a strategy and its layer-wise variant.
LAYERWISE_TTFTS = ("ttft_p50_s", "ttft_mean_s", "ttft_kvtier_hit_mean_s")


def layerwise_comparison(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """TTFT of each ``<strategy>/layerwise`` row next to its ``<strategy>`` row (same conversations).

    Per row: ``{"strategy", "conversations", "kvtier_hit_requests", <ttft>: {"without", "with",
    "ratio"}}`` for each of :data:`LAYERWISE_TTFTS`; ``ratio`` is with / without (below 1:
    layer-wise loading is faster), ``None`` when there is nothing to compare (no kvtier hit).
    """
    return _with_without(results, LAYERWISE_SUFFIX)


def warmup_comparison(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """TTFT of each ``<strategy>/warmup`` row next to its ``<strategy>`` row, as
    :func:`layerwise_comparison` (below 1: warming the next request's prefix made it faster)."""
    return _with_without(results, WARMUP_SUFFIX)


def _with_without(results: Sequence[RunResult], suffix: str) -> list[dict[str, Any]]:
    rows = {(r.strategy, r.conversations): r for r in results}
    out: list[dict[str, Any]] = []
    for r in results:
        if not r.strategy.endswith(suffix):
            continue
        base = rows.get((r.strategy[: -len(suffix)], r.conversations))
        if base is None:
            continue
        row: dict[str, Any] = {"strategy": base.strategy, "conversations": r.conversations,
                               "kvtier_hit_requests": base.kvtier_hit_requests}
        for name in LAYERWISE_TTFTS:
            without, with_ = getattr(base, name), getattr(r, name)
            row[name] = {"without": without, "with": with_,
                         "ratio": with_ / without if without > 0 and with_ > 0 else None}
        out.append(row)
    return out


def layerwise_lines(comparison: Sequence[Mapping[str, Any]]) -> list[str]:
    """The comparison as printed lines (TTFT in ms, without -> with, and the ratio)."""
    return with_without_lines(comparison, "layer-wise loading")


def warmup_lines(comparison: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`warmup_comparison` as printed lines."""
    return with_without_lines(comparison, "warm-up of the next request's prefix")


def with_without_lines(comparison: Sequence[Mapping[str, Any]], what: str) -> list[str]:
    if not comparison:
        return []
    lines = [f"{what}, TTFT without -> with (ratio; below 1 is faster):"]
    labels = {"ttft_p50_s": "p50", "ttft_mean_s": "mean", "ttft_kvtier_hit_mean_s": "mean of kvtier hits"}
    for row in comparison:
        parts = []
        for name, label in labels.items():
            values = row[name]
            if values["ratio"] is None:
                continue
            parts.append(f"{label} {values['without'] * 1000:.1f} -> {values['with'] * 1000:.1f} ms "
                         f"({values['ratio']:.2f}x)")
        hits = row["kvtier_hit_requests"]
        lines.append(f"  {row['strategy']} x{row['conversations']} ({hits} requests hit kvtier): "
                     + (", ".join(parts) or "no request to compare"))
    return lines


def write_policy_comparison(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Each ``<strategy>/<policy>`` row (``WRITE_POLICIES``) next to its write-through ``<strategy>``
    row: bytes the secondary tiers wrote during the run and throughput, with ratios policy / base."""
    rows = {(r.strategy, r.conversations): r for r in results}
    out: list[dict[str, Any]] = []
    for r in results:
        base_name, _, policy = r.strategy.rpartition("/")
        if policy not in WRITE_POLICIES:
            continue
        base = rows.get((base_name, r.conversations))
        if base is None:
            continue
        out.append({
            "strategy": base_name, "policy": policy, "conversations": r.conversations,
            "bytes_written": {"write_through": base.bytes_written, policy: r.bytes_written,
                              "ratio": r.bytes_written / base.bytes_written if base.bytes_written else None},
            "throughput_tokens_per_s": {
                "write_through": base.throughput_tokens_per_s, policy: r.throughput_tokens_per_s,
                "ratio": (r.throughput_tokens_per_s / base.throughput_tokens_per_s
                          if base.throughput_tokens_per_s else None)},
            "hit_rate": {"write_through": base.hit_rate, policy: r.hit_rate},
        })
    return out


def write_policy_lines(comparison: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`write_policy_comparison` as printed lines."""
    if not comparison:
        return []
    lines = ["write policies against write_through (bytes written to secondary tiers during the run; tok/s):"]
    for row in comparison:
        policy = row["policy"]
        written, tput = row["bytes_written"], row["throughput_tokens_per_s"]
        ratio = "-" if written["ratio"] is None else f"{written['ratio']:.2f}x"
        speed = "-" if tput["ratio"] is None else f"{tput['ratio']:.2f}x"
        lines.append(
            f"  {row['strategy']} x{row['conversations']} {policy}: written {written[policy] / 2**20:.1f} vs "
            f"{written['write_through'] / 2**20:.1f} MiB ({ratio}), tok/s {tput[policy]:,.0f} vs "
            f"{tput['write_through']:,.0f} ({speed}), hit rate {row['hit_rate'][policy]:.0%} vs "
            f"{row['hit_rate']['write_through']:.0%}")
    return lines


#: Numbers of a row set beside its twin's by :func:`twin_comparison`.
TWIN_FIELDS = ("bytes_per_hit_token", "bytes_loaded", "load_seconds", "kvtier_tokens", "ttft_p50_s", "ttft_mean_s",
               "ttft_kvtier_hit_mean_s")


def twin_comparison(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Each hybrid row beside its full-attention twin's (``<strategy>/twin``, same conversations).

    Per row: ``{"strategy", "conversations", "hybrid": {...}, "twin": {...}, "ratio": {...}}``, the
    dicts holding :data:`TWIN_FIELDS`; ``ratio`` is twin / hybrid (above 1: the hybrid model loads
    fewer bytes, or is faster), ``None`` where the hybrid's number is 0 (nothing loaded).
    """
    rows = {(r.strategy, r.conversations): r for r in results}
    out: list[dict[str, Any]] = []
    for r in results:
        if r.strategy.endswith(TWIN_SUFFIX):
            continue
        twin = rows.get((r.strategy + TWIN_SUFFIX, r.conversations))
        if twin is None:
            continue
        hybrid_numbers = {name: getattr(r, name) for name in TWIN_FIELDS}
        twin_numbers = {name: getattr(twin, name) for name in TWIN_FIELDS}
        out.append({
            "strategy": r.strategy,
            "conversations": r.conversations,
            "hybrid": hybrid_numbers,
            "twin": twin_numbers,
            "ratio": {name: (twin_numbers[name] / hybrid_numbers[name] if hybrid_numbers[name] else None)
                      for name in TWIN_FIELDS},
        })
    return out


def twin_lines(comparison: Sequence[Mapping[str, Any]]) -> list[str]:
    """The comparison as printed lines: KiB per hit token, load seconds and mean TTFT, hybrid vs twin."""
    if not comparison:
        return []
    lines = ["hybrid vs full-attention twin (ratio twin / hybrid):"]
    for row in comparison:
        h, t, ratio = row["hybrid"], row["twin"], row["ratio"]
        head = f"  {row['strategy']} x{row['conversations']}: "
        ttft = (f"TTFT mean {h['ttft_mean_s'] * 1000:.1f} vs {t['ttft_mean_s'] * 1000:.1f} ms"
                + (f" ({ratio['ttft_mean_s']:.2f}x)" if ratio["ttft_mean_s"] else ""))
        if not h["kvtier_tokens"] or not t["kvtier_tokens"]:
            lines.append(head + f"nothing loaded from kvtier; {ttft}")
            continue
        lines.append(
            head + f"{h['bytes_per_hit_token'] / 1024:.2f} vs {t['bytes_per_hit_token'] / 1024:.2f} KiB per hit token "
            f"({ratio['bytes_per_hit_token']:.2f}x), loaded {h['bytes_loaded'] / 2**20:.1f} vs "
            f"{t['bytes_loaded'] / 2**20:.1f} MiB in {h['load_seconds'] * 1000:.0f} vs {t['load_seconds'] * 1000:.0f} ms; "
            + ttft
        )
    return lines


def _spread(r: RunResult, name: str, fmt: Any) -> tuple[str, str, str]:
    value = getattr(r, name)
    spread = r.spread.get(name, {"min": value, "max": value})
    return fmt(value), fmt(spread["min"]), fmt(spread["max"])


def write_json(path: str, document: Mapping[str, Any]) -> None:
    """Write ``document`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_chart(
    path: str, results: Sequence[RunResult], title: str, markers: Sequence[Mapping[str, Any]] = ()
) -> str | None:
    """Throughput vs conversations, one line per strategy (PNG, Agg backend).

    Rows of several runs draw the median with a shaded min-max band. Each of ``markers`` (see
    ``runner.capacity_markers``) whose position lies within the sweep is a dashed vertical line
    labelled with its ``label``. Full-attention twins (``<strategy>/twin``) are dashed. Returns
    ``None`` on success, or the reason the chart was skipped (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvtier[bench]'); chart skipped"
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    for r in results:
        spread = r.spread.get("throughput_tokens_per_s", {})
        value = r.throughput_tokens_per_s
        series.setdefault(r.strategy, []).append(
            (r.conversations, value, spread.get("min", value), spread.get("max", value))
        )
    repeats = max((r.repeats for r in results), default=1)
    sweep = sorted({r.conversations for r in results})
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    try:
        for name, points in series.items():
            points.sort()
            xs = [p[0] for p in points]
            # A full-attention twin's line is dashed, beside its hybrid strategy's solid one.
            style = "--" if name.endswith(TWIN_SUFFIX) else "-"
            (line,) = ax.plot(xs, [p[1] for p in points], marker="o", linestyle=style, label=name, zorder=3)
            if repeats > 1:
                ax.fill_between(xs, [p[2] for p in points], [p[3] for p in points],
                                color=line.get_color(), alpha=0.2, linewidth=0, zorder=2)
        if sweep:
            for marker in markers:
                x = float(marker["conversations"])
                if not sweep[0] <= x <= sweep[-1]:
                    continue
                ax.axvline(x, color="0.35", linestyle="--", linewidth=1, zorder=1)
                ax.text(x, 0.03, f" {marker['label']}", transform=ax.get_xaxis_transform(), rotation=90,
                        ha="right", va="bottom", fontsize=8, color="0.3")
            ax.set_xticks(sweep)
        ax.set_xlabel("concurrent conversations")
        ax.set_ylabel("prefill throughput (prompt tokens/s)")
        if repeats > 1:
            title += f"\nmedian of {repeats} runs per point, shaded: min\u2013max"
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return None

"""Runs the chat workload against each offloading strategy and checks every answer.

One *run* is one (strategy, conversations) pair, started cold: a fresh device pool, a fresh
kvtier engine and a fresh directory for any filesystem tier (conversation ``c`` has the same
tokens at every ``N``, so a warm disk would leak hits between runs). That directory is created
by the run (``kvtier-bench-<strategy>-<N>conv-*``, under ``BenchPlan.fs_root`` or the system's
temporary directory) and removed after it unless ``BenchPlan.keep_fs_dirs``; the run removes
nothing it did not create. Requests are served one at a time, like a single prefill worker:

1. ``DeviceBlockPool.acquire`` pins the device prefix-cache hit and allocates the other blocks;
2. ``engine.load_with_sources`` fills the following whole chunks from kvtier's tiers (never the
   last token, whose logits must be computed);
3. ``TinyDecoder.prefill`` computes the rest, in a worker thread so the engine's event loop
   keeps cascading to secondary tiers meanwhile (as a GPU computes while the host does I/O);
   a *layer-wise* strategy (``Strategy.layerwise``) does steps 2 and 3 together with
   ``engine.load_layerwise``: layer ``i`` is computed as soon as its prefix KV is on the device,
   while the following layers are still being copied;
   a *warm-up* strategy (``Strategy.warmup``) first starts, in the background, an
   ``engine.prefetch`` of the *next* request's prefix, as a router that knows which request comes
   next would: its promotions from slower tiers run while this request computes;
4. ``engine.store`` offloads the prompt's complete chunks; the pool then releases the blocks.

With a hybrid model (``BenchPlan.model`` a ``HybridConfig``, ``kvtier bench --model hybrid``) the
device pool is a ``HybridBlockPool`` (one block table per KV-cache group, no device prefix cache:
step 1 only allocates) and the engine is opened with the model's ``kvtier.KVModel``; a strategy
made with ``Strategy.with_twin`` runs the same workload on the model's full-attention twin, so
the bytes each loads per hit token can be compared (``RunResult.bytes_per_hit_token``).

The timed section is exactly steps 1-4 of every request; a strategy's throughput is its prompt
tokens over the sum of its requests' service times. The strategies of one sweep point run in
lockstep (see ``run_point``) so that load from elsewhere on the machine hits them alike.
Reference recomputes for the logits check run after the engines are closed, so no strategy's
background I/O overlaps untimed work.

With ``BenchPlan.repeats`` > 1 the whole sweep runs that many times (repeat-major, the strategy
order rotated per repeat), every run is logits-checked, and each (strategy, conversations) row
reports the median of its runs with their min and max (``aggregate_runs``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import torch

from kvtier.bench.hybrid import HybridBlockPool, HybridConfig, HybridDecoder
from kvtier.bench.model import DeviceBlockPool, ModelConfig, TinyDecoder
from kvtier.bench.workload import ChatRequest, WorkloadSpec, iter_requests

__all__ = [
    "Strategy",
    "BenchPlan",
    "RunResult",
    "LogitsMismatch",
    "ReferenceLogits",
    "builtin_strategies",
    "default_capacities",
    "capacity_tokens",
    "capacity_markers",
    "hybrid_capacities",
    "aggregate_runs",
    "run_plan",
    "DEVICE_LABEL",
    "RECOMPUTE_LABEL",
    "LAYERWISE_SUFFIX",
    "TWIN_SUFFIX",
    "WARMUP_SUFFIX",
    "WRITE_POLICIES",
]

#: ``tokens_by_tier`` label of tokens found in the device prefix cache.
DEVICE_LABEL = "device"
#: ``tokens_by_tier`` label of tokens the model computed.
RECOMPUTE_LABEL = "recompute"
#: Marker in a strategy's tier list replaced by a fresh per-run directory.
FRESH_DIR = "<fresh temporary directory>"
#: Name suffix of a strategy's layer-wise variant (``Strategy.with_layerwise``).
LAYERWISE_SUFFIX = "/layerwise"
#: Name suffix of a strategy run on the hybrid model's full-attention twin (``Strategy.with_twin``).
TWIN_SUFFIX = "/twin"
#: The host tier's label in ``engine.statistics()`` (the others are the secondary tiers').
PRIMARY_TIER = "0:primary"
#: Name suffix of a strategy that warms the next request's prefix (``Strategy.with_warmup``).
WARMUP_SUFFIX = "/warmup"
#: The write policies ``Strategy.with_write_policy`` sets on every secondary tier (name suffix ``/<policy>``).
WRITE_POLICIES = ("write_back", "selective")

# What may appear of a strategy's name (a --config file's stem, "/layerwise") in a directory name.
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.+-]")

# float32 logits of a paged prefill and a dense one differ only by summation order.
_ATOL = 1e-3
_RTOL = 1e-3


class LogitsMismatch(AssertionError):
    """A request's logits differ from a full recompute: some tier returned wrong KV."""


@dataclass(frozen=True)
class Strategy:
    """A named caching strategy: ``config`` is a ``kv_connector_extra_config`` dict, or ``None``
    for ``recompute`` (device prefix cache only, kvtier not used). ``layerwise`` loads with
    ``engine.load_layerwise`` and overlaps each layer's compute with the next layers' copies.
    ``twin`` serves a hybrid plan's full-attention twin instead of the hybrid model. ``warmup``
    prefetches each next request's prefix while the current one computes."""

    name: str
    config: Mapping[str, Any] | None = None
    layerwise: bool = False
    twin: bool = False
    warmup: bool = False

    def with_layerwise(self) -> Strategy:
        """The same configuration loaded layer-wise, named ``<name>/layerwise``."""
        if self.config is None:
            raise ValueError(f"strategy {self.name!r} does not use kvtier: it has nothing to load layer-wise")
        return Strategy(self.name + LAYERWISE_SUFFIX, self.config, layerwise=True, twin=self.twin)

    def with_twin(self) -> Strategy:
        """The same strategy on the hybrid model's full-attention twin, named ``<name>/twin``."""
        return Strategy(self.name + TWIN_SUFFIX, self.config, layerwise=self.layerwise, twin=True)

    def with_warmup(self) -> Strategy:
        """The same configuration, warming each next request's prefix, named ``<name>/warmup``."""
        if not self.secondary_tiers:
            raise ValueError(f"strategy {self.name!r} has no secondary tier: there is nothing to warm up")
        return Strategy(self.name + WARMUP_SUFFIX, self.config, twin=self.twin, warmup=True)

    def with_write_policy(self, policy: str) -> Strategy:
        """The same configuration with ``write_policy: policy`` on every secondary tier, named
        ``<name>/<policy>``."""
        if not self.secondary_tiers:
            raise ValueError(f"strategy {self.name!r} has no secondary tier: no write policy applies")
        assert self.config is not None
        config = dict(self.config)
        config["secondary_tiers"] = [{**tier, "write_policy": policy} for tier in self.secondary_tiers]
        return Strategy(f"{self.name}/{policy}", config, twin=self.twin)

    @property
    def secondary_tiers(self) -> list[Mapping[str, Any]]:
        return list((self.config or {}).get("secondary_tiers", ()))

    def resolve(self, host_bytes: int, fresh_dir: Callable[[], str]) -> dict[str, Any] | None:
        """The engine config of one run: host size filled in when absent, ``FRESH_DIR`` replaced."""
        if self.config is None:
            return None
        cfg = dict(self.config)
        cfg.setdefault("cpu_bytes_to_use", host_bytes)
        tiers = []
        for tier in cfg.get("secondary_tiers", ()):
            tier = dict(tier)
            if tier.get("root_dir") == FRESH_DIR:
                tier["root_dir"] = fresh_dir()
            tiers.append(tier)
        if tiers:
            cfg["secondary_tiers"] = tiers
        return cfg


def builtin_strategies() -> dict[str, Strategy]:
    """``recompute``, ``cpu`` and ``cpu+fs`` (fs in a fresh directory per run)."""
    fs = {"type": "fs", "root_dir": FRESH_DIR, "n_read_threads": 4, "n_write_threads": 2}
    return {
        "recompute": Strategy("recompute", None),
        "cpu": Strategy("cpu", {"spec_name": "CPUOffloadingSpec"}),
        "cpu+fs": Strategy("cpu+fs", {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [fs]}),
    }


@dataclass(frozen=True)
class BenchPlan:
    """Everything one bench invocation runs: model, workload, sweep, strategies and tier sizes.

    With a hybrid ``model``, ``device_blocks`` is per KV-cache group and ``twin_host_bytes`` the
    host tier of the strategies run on the full-attention twin (``Strategy.twin``).
    """

    model: ModelConfig | HybridConfig
    workload: WorkloadSpec
    conversations: tuple[int, ...]
    strategies: tuple[Strategy, ...]
    device_blocks: int
    host_bytes: int
    check: str = "all"  # "all" | "sample" (conversations 0 and 1 of every run) | "none"
    fs_root: str | None = None
    device: str = "cpu"
    repeats: int = 1  # cold runs of every (strategy, conversations) point; rows report the median
    keep_fs_dirs: bool = False  # leave each run's fs tier directory (RunResult.fs_dirs) in place
    twin_host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        hybrid = isinstance(self.model, HybridConfig)
        for strategy in self.strategies:
            if strategy.twin and not hybrid:
                raise ValueError(f"strategy {strategy.name!r} runs a full-attention twin: only a hybrid model has one")
            if strategy.layerwise and hybrid:
                raise ValueError(f"strategy {strategy.name!r}: layer-wise loading is not run on the hybrid model")

    @property
    def hybrid(self) -> bool:
        return isinstance(self.model, HybridConfig)

    def host_bytes_of(self, strategy: Strategy) -> int:
        """The host tier size of ``strategy``'s runs."""
        if strategy.twin and self.twin_host_bytes is not None:
            return self.twin_host_bytes
        return self.host_bytes

    @property
    def total_requests(self) -> int:
        per_strategy = sum(self.conversations) * self.workload.requests_per_conversation
        return per_strategy * len(self.strategies) * self.repeats


def default_capacities(
    model: ModelConfig, workload: WorkloadSpec, device_conversations: float, host_conversations: float
) -> tuple[int, int]:
    """``(device_blocks, host_bytes)`` holding the working sets of that many conversations.

    With the sweep straddling both sizes, the three regimes appear: everything fits on the
    device, only in host memory, or only on disk. Host bytes count whole chunk slots (the
    geometry's 4 KiB-aligned slot size, one block per chunk).
    """
    bs = model.block_size
    device_tokens = _ws(workload, device_conversations)
    longest = workload.prompt_tokens(workload.rounds)
    device_blocks = max(math.ceil(device_tokens / bs), math.ceil(longest / bs) + 1)
    host_chunks = math.ceil(_ws(workload, host_conversations) / bs)
    slot: int = geometry_for(model).slot_bytes(1)
    return device_blocks, host_chunks * slot


def capacity_tokens(model: ModelConfig, device_blocks: int, host_bytes: int) -> tuple[int, int]:
    """``(device_tokens, host_tokens)``: tokens of KV the device pool and the host tier hold.

    The host tier holds whole chunk slots (one block per chunk), as ``default_capacities`` sizes it.
    """
    slot: int = geometry_for(model).slot_bytes(1)
    return device_blocks * model.block_size, host_bytes // slot * model.block_size


def capacity_markers(
    workload: WorkloadSpec, conversations: Sequence[int], device_tokens: int, host_tokens: int
) -> list[dict[str, Any]]:
    """Where the device and the host tier run out, in conversations (the chart's dashed lines).

    For each tier: ``conversations`` is the (fractional) count whose working set equals the
    tier's capacity, ``first_exceeding`` the smallest count of the sweep whose working set
    exceeds it (``None`` if none does).
    """
    private = workload.prompt_tokens(workload.rounds) - workload.system_tokens
    markers = []
    for tier, label, tokens in (("device", "device full", device_tokens), ("host", "host full", host_tokens)):
        over = [n for n in sorted(conversations) if workload.working_set_tokens(n) > tokens]
        markers.append({
            "tier": tier,
            "label": label,
            "capacity_tokens": tokens,
            "conversations": max(0.0, (tokens - workload.system_tokens) / private),
            "first_exceeding": over[0] if over else None,
        })
    return markers


def hybrid_capacities(
    model: HybridConfig, workload: WorkloadSpec, host_conversations: float
) -> tuple[int, int, int]:
    """``(device_blocks, host_bytes, twin_host_bytes)`` of a hybrid plan.

    The device pool has no prefix cache, so it holds the longest prompt (plus a block) in each
    group. Each host tier holds the KV that ``host_conversations`` working sets may store: at
    most one chunk per token block and group (one block per chunk), in the model's slots for
    the hybrid model and in the twin's for the twin.
    """
    longest = workload.prompt_tokens(workload.rounds)
    device_blocks = math.ceil(longest / min(model.block_size, model.state_block)) + 1
    token_blocks = math.ceil(_ws(workload, host_conversations) / min(model.block_size, model.state_block))
    hybrid, twin = model.kv_model(), model.twin().kv_model()
    return (device_blocks, token_blocks * len(hybrid.groups) * hybrid.slot_bytes(1),
            token_blocks * len(twin.groups) * twin.slot_bytes(1))


def _ws(workload: WorkloadSpec, conversations: float) -> float:
    private = workload.prompt_tokens(workload.rounds) - workload.system_tokens
    return workload.system_tokens + conversations * private


def geometry_for(model: ModelConfig) -> Any:
    """The ``kvtier.KVGeometry`` of the miniature model's device pool."""
    from kvtier.layout import KVGeometry

    return KVGeometry(model.model_name, model.num_layers, model.num_kv_heads, model.head_dim,
                      model.dtype, model.block_size)


@dataclass
class RunResult:
    """Every number of one run (one row of the report and of the JSON ``results``)."""

    strategy: str
    conversations: int
    requests: int
    prompt_tokens: int
    computed_tokens: int
    elapsed_s: float
    throughput_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_mean_s: float
    tokens_by_tier: dict[str, int]
    hit_rate: float
    working_set_tokens: int
    checked_requests: int
    max_logit_error: float
    engine_stats: dict[str, Any] = field(default_factory=dict)
    #: Requests to which kvtier supplied tokens, and their mean TTFT (0 when there were none):
    #: the requests that loading (layer-wise or not) can speed up.
    kvtier_hit_requests: int = 0
    ttft_kvtier_hit_mean_s: float = 0.0
    #: Cold runs behind this row. With more than one, the throughput, TTFT and ``elapsed_s``
    #: fields above are medians, ``spread`` holds each one's per-run values, min and max, and
    #: ``runs`` every run's own numbers (token accounting and engine statistics above are the
    #: first run's).
    repeats: int = 1
    spread: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: Each request's service time (steps 1-4), in the order served: the same requests in the
    #: same order for every strategy of a sweep point, so runs compare request by request. Of
    #: several runs, the first run's (each run's own are in ``runs``).
    service_times_s: list[float] = field(default_factory=list)
    #: The fs tier directories kept after the run(s), of every run (``BenchPlan.keep_fs_dirs``).
    fs_dirs: list[str] = field(default_factory=list)
    #: What kvtier copied to the device (``engine.statistics()["copies"]``: bytes and seconds
    #: to device) for the tokens it supplied, and the bytes per such token (0 without any).
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    kvtier_tokens: int = 0
    bytes_per_hit_token: float = 0.0
    #: Bytes every secondary tier wrote during the run (before the engine's close flushes what
    #: is left: a write-back tier writes the rest then).
    bytes_written: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("spread", "runs")}
        for name, values in self.spread.items():
            out[f"{name}_runs"] = list(values["runs"])
            out[f"{name}_min"] = values["min"]
            out[f"{name}_max"] = values["max"]
        out["runs"] = list(self.runs)
        return out


#: Fields of ``RunResult`` that ``aggregate_runs`` reports as median, per-run values, min and max.
SPREAD_FIELDS = ("throughput_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "ttft_kvtier_hit_mean_s",
                 "elapsed_s")
_RUN_FIELDS = (*SPREAD_FIELDS, "computed_tokens", "hit_rate", "tokens_by_tier",
               "checked_requests", "max_logit_error", "service_times_s", "fs_dirs", "bytes_loaded",
               "load_seconds", "kvtier_tokens", "bytes_per_hit_token", "bytes_written")


def aggregate_runs(runs: Sequence[RunResult]) -> RunResult:
    """One row from the cold runs of one (strategy, conversations) point.

    Throughput, TTFTs and ``elapsed_s`` are the medians of the runs (``spread`` keeps each run's
    value, min and max); the logits check covers every run (``max_logit_error`` is the worst;
    ``checked_requests`` counts one run's, the same in each); token accounting and engine
    statistics are the first run's, every run's own token accounting being in ``runs``.
    """
    if not runs:
        raise ValueError("no runs to aggregate")
    first = runs[0]
    row = RunResult(**{k: v for k, v in first.__dict__.items() if k not in ("repeats", "spread", "runs")})
    row.repeats = len(runs)
    row.max_logit_error = max(r.max_logit_error for r in runs)
    row.fs_dirs = [path for r in runs for path in r.fs_dirs]
    for name in SPREAD_FIELDS:
        values = [getattr(r, name) for r in runs]
        setattr(row, name, statistics.median(values))
        row.spread[name] = {"runs": values, "min": min(values), "max": max(values)}
    row.runs = [{k: getattr(r, k) for k in _RUN_FIELDS} for r in runs]
    return row


class ReferenceLogits:
    """Full-recompute logits per (conversation, round), memoized across runs.

    Valid because the workload draws conversation ``c``'s tokens independently of ``N``.
    """

    def __init__(self, model: TinyDecoder | HybridDecoder) -> None:
        self.model = model
        self._cache: dict[tuple[int, int, int], torch.Tensor] = {}

    def get(self, request: ChatRequest) -> torch.Tensor:
        key = (request.conversation, request.round, len(request.token_ids))
        ref = self._cache.get(key)
        if ref is None:
            ref = self._cache[key] = self.model.dense_logits(request.token_ids)
        return ref


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _should_check(plan: BenchPlan, request: ChatRequest) -> bool:
    if plan.check == "all":
        return True
    if plan.check == "sample":
        return request.conversation < 2
    return False


class _Server:
    """One strategy's prefill worker for one run: its device pool, engine and tallies."""

    def __init__(self, plan: BenchPlan, strategy: Strategy, model: TinyDecoder | HybridDecoder, engine: Any) -> None:
        self.plan = plan
        self.strategy = strategy
        # A TinyDecoder with a DeviceBlockPool, or a HybridDecoder with a HybridBlockPool: the
        # two pools acquire and release alike, the two models prefill alike (with their pool's
        # block tables), so serving needs no branch on which it is.
        self.model: Any = model
        self.engine = engine
        self.pool: Any
        if isinstance(model, HybridDecoder):
            self.pool = HybridBlockPool(plan.device_blocks, model.config, device=plan.device)
        else:
            self.pool = DeviceBlockPool(plan.device_blocks, plan.model, device=plan.device)  # type: ignore[arg-type]
        self.by_tier: dict[str, int] = {DEVICE_LABEL: 0, RECOMPUTE_LABEL: 0}
        self.ttfts: list[float] = []
        self.hit_ttfts: list[float] = []  # of requests to which kvtier supplied tokens
        self.busy_s = 0.0
        self.service_times: list[float] = []
        self.fs_dirs: list[str] = []  # kept ones only
        self.prompt_tokens = 0
        self.to_check: list[tuple[ChatRequest, torch.Tensor, dict[str, int]]] = []
        #: Where a warm-up strategy's prefetches run (closed before the engine, so they end first).
        self.background: anyio.abc.TaskGroup | None = None

    def open_engine(self, config: Mapping[str, Any]) -> Any:
        """``kvtier.open`` for this server's device memory (the engine's async context manager)."""
        import kvtier

        if isinstance(self.pool, HybridBlockPool):
            return kvtier.open(config, self.pool.config.kv_model(), self.pool.device_kv())
        return kvtier.open(config, geometry_for(self.pool.config), self.pool.kv)

    async def serve(self, request: ChatRequest, upcoming: ChatRequest | None = None) -> None:
        """Prefill ``request`` (steps 1-4 of the module docstring), timing it; a warm-up strategy
        starts the prefetch of ``upcoming`` first."""
        tokens = request.token_ids
        engine = self.engine
        if engine is not None and self.strategy.warmup and upcoming is not None and self.background is not None:
            self.background.start_soon(functools.partial(engine.prefetch, upcoming.token_ids[:-1]))
        t0 = time.perf_counter()
        alloc = self.pool.acquire(tokens)
        cached = alloc.cached_tokens
        sources = {DEVICE_LABEL: cached}
        loaded: dict[str, int] = {}
        if engine is not None and self.strategy.layerwise:
            logits, loaded = await self._load_and_prefill_layerwise(tokens, cached, alloc.block_ids)
        else:
            if engine is not None:
                # Never the last token: its logits are the answer and must be computed.
                outcome = await engine.load_with_sources(tokens[:-1], alloc.block_ids, num_computed_tokens=cached)
                loaded = outcome.tokens_by_tier
            computed_from = cached + sum(loaded.values())
            logits = await anyio.to_thread.run_sync(
                self.model.prefill, tokens, computed_from, self.pool, alloc.block_ids)
        ttft = time.perf_counter() - t0
        self.ttfts.append(ttft)
        if loaded:
            self.hit_ttfts.append(ttft)
        for label, n in loaded.items():
            sources[label] = sources.get(label, 0) + n
        cached += sum(loaded.values())
        if engine is not None:
            await engine.store(tokens, alloc.block_ids, num_prompt_tokens=len(tokens))
        self.pool.release(alloc)
        service_s = time.perf_counter() - t0
        self.busy_s += service_s
        self.service_times.append(service_s)
        sources[RECOMPUTE_LABEL] = len(tokens) - cached
        for label, n in sources.items():
            self.by_tier[label] = self.by_tier.get(label, 0) + n
        self.prompt_tokens += len(tokens)
        if _should_check(self.plan, request):
            self.to_check.append((request, logits, sources))

    async def _load_and_prefill_layerwise(
        self, tokens: list[int], cached: int, block_ids: list[int]
    ) -> tuple[torch.Tensor, dict[str, int]]:
        """Prefill while ``engine.load_layerwise`` places the prefix: layer ``i`` is computed as
        soon as its KV is on the device. Returns the logits and the tokens placed per tier.

        The model runs in a worker thread and, before each layer, blocks on the event loop for
        the next group. If a group's copy fails the whole prefix is recomputed, as the
        layer-wise contract demands.
        """
        from kvtier.engine.layerwise import LayerwiseLoadError

        try:
            async with self.engine.load_layerwise(tokens[:-1], block_ids, num_computed_tokens=cached) as layers:
                steps = aiter(layers)
                ready = 0  # layers [0, ready) of the prefix are on the device

                async def next_group() -> int:
                    return int((await anext(steps)).stop)

                def before_layer(layer: int) -> None:
                    nonlocal ready
                    while layer >= ready:
                        ready = anyio.from_thread.run(next_group)

                logits = await anyio.to_thread.run_sync(
                    self.model.prefill, tokens, cached + layers.tokens, self.pool, block_ids, before_layer)
                return logits, dict(layers.tokens_by_tier)
        except LayerwiseLoadError:
            logits = await anyio.to_thread.run_sync(self.model.prefill, tokens, cached, self.pool, block_ids)
            return logits, {}

    def result(self, conversations: int, references: ReferenceLogits, engine_stats: dict[str, Any]) -> RunResult:
        """The run's numbers, after checking every kept answer; raises ``LogitsMismatch``."""
        max_error = 0.0
        for request, logits, sources in self.to_check:
            ref = references.get(request)
            error = float((logits - ref).abs().max())
            max_error = max(max_error, error) if not math.isnan(error) else math.inf
            if not error <= _ATOL + _RTOL * float(ref.abs().max()):  # NaN (a block nobody wrote) fails too
                raise LogitsMismatch(
                    f"strategy {self.strategy.name!r}, {conversations} conversations: request of "
                    f"conversation {request.conversation} round {request.round} "
                    f"({len(request.token_ids)} tokens, sources {sources}) has logits off by "
                    f"{error:.3g} from a full recompute: offloaded KV is wrong"
                )
        computed = self.by_tier[RECOMPUTE_LABEL]
        ttfts, total = self.ttfts, self.prompt_tokens
        copies = engine_stats.get("copies") or {}
        loaded_bytes = int(copies.get("bytes_to_device", 0))
        kvtier_tokens = sum(n for label, n in self.by_tier.items() if label not in (DEVICE_LABEL, RECOMPUTE_LABEL))
        return RunResult(
            strategy=self.strategy.name,
            conversations=conversations,
            requests=len(ttfts),
            prompt_tokens=total,
            computed_tokens=computed,
            elapsed_s=self.busy_s,
            throughput_tokens_per_s=total / self.busy_s if self.busy_s > 0 else 0.0,
            ttft_p50_s=_quantile(ttfts, 0.5),
            ttft_p90_s=_quantile(ttfts, 0.9),
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
            tokens_by_tier={k: v for k, v in self.by_tier.items() if v or k in (DEVICE_LABEL, RECOMPUTE_LABEL)},
            hit_rate=1.0 - computed / total if total else 0.0,
            working_set_tokens=self.plan.workload.working_set_tokens(conversations),
            checked_requests=len(self.to_check),
            max_logit_error=max_error,
            engine_stats=engine_stats,
            kvtier_hit_requests=len(self.hit_ttfts),
            ttft_kvtier_hit_mean_s=sum(self.hit_ttfts) / len(self.hit_ttfts) if self.hit_ttfts else 0.0,
            service_times_s=list(self.service_times),
            fs_dirs=list(self.fs_dirs),
            bytes_loaded=loaded_bytes,
            load_seconds=float(copies.get("seconds_to_device", 0.0)),
            kvtier_tokens=kvtier_tokens,
            bytes_per_hit_token=loaded_bytes / kvtier_tokens if kvtier_tokens else 0.0,
            bytes_written=sum(int(v.get("bytes_written", 0)) for label, v in engine_stats.items()
                              if label[:1].isdigit() and label != PRIMARY_TIER and isinstance(v, Mapping)),
        )


async def run_point(
    plan: BenchPlan,
    strategies: Sequence[Strategy],
    conversations: int,
    model: TinyDecoder | HybridDecoder,
    references: ReferenceLogits,
    on_request: Callable[[str], None] = lambda name: None,
    rotation: int = 0,
    twin: ReferenceLogits | None = None,
) -> list[RunResult]:
    """One cold run of ``conversations`` per strategy, served in lockstep.

    A twin strategy (``Strategy.twin``) serves ``twin.model`` and is checked against ``twin``.

    Each request is served by every strategy back to back (the order rotating per request, and
    by ``rotation`` more), so a burst of load from elsewhere on the machine slows all
    strategies alike instead of whichever run it happened to overlap. Throughput is prompt
    tokens over each strategy's own busy time (the sum of its requests' service times). Raises
    ``LogitsMismatch``.
    """
    with contextlib.ExitStack() as dirs:

        def fresh_dir(server: _Server) -> str:
            # mkdtemp creates a new directory (never an existing one), so removing it after the
            # run removes only what this run wrote.
            prefix = f"kvtier-bench-{_SAFE_NAME.sub('_', server.strategy.name)[:64]}-{conversations}conv-"
            path = tempfile.mkdtemp(prefix=prefix, dir=plan.fs_root)
            if plan.keep_fs_dirs:
                server.fs_dirs.append(path)
            else:
                dirs.callback(shutil.rmtree, path, ignore_errors=True)
            return path

        async with contextlib.AsyncExitStack() as stack:
            servers: list[_Server] = []
            checks: list[ReferenceLogits] = []
            for strategy in strategies:
                if strategy.twin and twin is None:
                    raise ValueError(f"strategy {strategy.name!r} needs the full-attention twin's reference logits")
                check = twin if strategy.twin and twin is not None else references
                server = _Server(plan, strategy, check.model if strategy.twin else model, None)
                config = strategy.resolve(plan.host_bytes_of(strategy), functools.partial(fresh_dir, server))
                if config is not None:
                    server.engine = await stack.enter_async_context(server.open_engine(config))
                    if strategy.warmup:
                        server.background = await stack.enter_async_context(anyio.create_task_group())
                servers.append(server)
                checks.append(check)
            requests = list(iter_requests(plan.workload, conversations))
            for i, request in enumerate(requests):
                upcoming = requests[i + 1] if i + 1 < len(requests) else None
                shift = (i + rotation) % len(servers)
                for server in servers[shift:] + servers[:shift]:
                    await server.serve(request, upcoming)
                    on_request(server.strategy.name)
            stats = [_summarize_stats(s.engine.statistics()) if s.engine is not None else {} for s in servers]
    # Reference recomputes run after every engine is closed: no background I/O overlaps them.
    return [s.result(conversations, check, st) for s, check, st in zip(servers, checks, stats)]


async def run_one(
    plan: BenchPlan, strategy: Strategy, conversations: int, model: TinyDecoder | HybridDecoder,
    references: ReferenceLogits, twin: ReferenceLogits | None = None,
) -> RunResult:
    """One cold run of one strategy (``run_point`` with a single strategy)."""
    return (await run_point(plan, [strategy], conversations, model, references, twin=twin))[0]


def _summarize_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-able view of ``engine.statistics()`` (dataclass snapshots become dicts)."""

    def plain(value: Any) -> Any:
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        fields = getattr(value, "__dataclass_fields__", None) or getattr(value, "__struct_fields__", None)
        if fields is not None:
            return {name: plain(getattr(value, name)) for name in fields}
        return repr(value)

    return {str(k): plain(v) for k, v in stats.items()}


async def run_plan(
    plan: BenchPlan, model: TinyDecoder | HybridDecoder, on_request: Callable[[str, int], None] = lambda s, n: None
) -> list[RunResult]:
    """Every (strategy, conversations) row of ``plan``, strategy-major, in sweep order.

    A hybrid plan with twin strategies builds the full-attention twin of ``model`` (same seed).

    The sweep runs ``plan.repeats`` times, repeat-major (so slow drift on the machine lands on
    every point and strategy alike) with the strategies' order rotated by one per repeat; each
    row aggregates its runs (``aggregate_runs``). Raises ``LogitsMismatch`` on the first bad run.
    """
    references = ReferenceLogits(model)
    twin: ReferenceLogits | None = None
    if isinstance(model, HybridDecoder) and any(s.twin for s in plan.strategies):
        twin = ReferenceLogits(HybridDecoder(model.config.twin(), device=model.device))
    # Untimed warm-up: the first forward pass of a process pays one-off costs (allocator growth,
    # kernel selection) that would otherwise land on whichever strategy serves first.
    first = next(iter(iter_requests(plan.workload, plan.conversations[0])), None)
    if first is not None:
        for reference in (references, twin):
            if reference is not None:
                await anyio.to_thread.run_sync(reference.model.dense_logits, first.token_ids)
    by_point: dict[int, list[list[RunResult]]] = {n: [] for n in plan.conversations}
    for repeat in range(plan.repeats):
        for n in plan.conversations:
            def progress(name: str, n: int = n) -> None:
                on_request(name, n)

            by_point[n].append(
                await run_point(plan, plan.strategies, n, model, references, progress, rotation=repeat, twin=twin)
            )
    return [
        aggregate_runs([runs[i] for runs in by_point[n]])
        for i in range(len(plan.strategies))
        for n in plan.conversations
    ]

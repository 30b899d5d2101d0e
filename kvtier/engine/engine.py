"""Embedding kvtier in a server: ``kvtier.open`` and ``kvtier.start_in_thread``.

``async with kvtier.open(config, geometry, device_kv) as engine`` builds the whole stack — host
tier, copy engine, secondary tiers, manager, optional event publisher and metrics server — and
runs every component's task group *inside the caller's* structured concurrency (asyncio or
trio). Leaving the block closes everything:

* first it *flushes*: it waits, up to ``flush_timeout_s`` (default 5 s; 0 = do not wait), for
  the tier jobs in flight — the cascades of stored chunks to the secondary tiers, promotions —
  as :meth:`Engine.drain` does. The wait is not shielded: a cancelled caller does not wait.
  Jobs still unfinished then are logged (WARNING, per tier: jobs and chunks abandoned);
* then tiers are closed (all of them, even if one fails), jobs still in flight are cancelled and
  reported, threads are joined (shielded: this part always runs to the end);
* from the moment closing starts every public method raises :class:`kvtier.EngineClosedError`.

Call arguments are checked at the call, before any work is queued (``kvtier.engine.arguments``).

``kvtier.start_in_thread(...)`` runs the same engine on an event loop in a background thread and
returns a blocking, thread-safe facade for callers without an event loop.

All manager calls happen on the engine's event-loop thread, so the manager needs no lock.
Components wake the engine through a callback whenever a job result or lookup verdict arrives;
``load``/``store`` wait on that signal rather than sleeping in a poll loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import socket
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.engine.arguments import check_block_ids, count, int_ids
from kvtier.config import EngineConfig, redact
from kvtier.context import RequestContext
from kvtier.errors import ConfigError, EngineClosedError, trim_traceback
from kvtier.keys import NO_EXTRA_KEYS, BlockHasher, RequestExtraKeys, chunk_keys
from kvtier.layout import KVGeometry
from kvtier.manager import PRIMARY_LABEL, TieringManager, load_spec
from kvtier.stats import SIZE_BUCKETS, Histogram, HistogramSnapshot
from kvtier.types import LookupResult

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    import torch

    from kvtier.engine.layerwise import BlockingLayerwiseLoad, LayerwiseLoad
    from kvtier.tiers.base import SecondaryTier
    from kvtier.host.copy_engine import CopyEngine, CopyOrder, CopyResult, Direction
    from kvtier.host.tier import HostTier

__all__ = ["Engine", "LoadOutcome", "open", "start_in_thread", "ThreadedEngine", "CopyStatistics"]

logger = logging.getLogger("kvtier.engine.engine")

#: How long ``load``/``store`` wait for promotions, probes or free host slots before giving up
#: (the request then recomputes / is not offloaded). Overridable per engine.
DEFAULT_WAIT_TIMEOUT_S = 10.0
#: How long leaving the engine waits for tier jobs in flight (cascades) before abandoning them.
DEFAULT_FLUSH_TIMEOUT_S = 5.0
#: ``cpu_bytes_to_use`` is rounded down to whole slots (as vLLM does). The remainder, under one
#: slot, is logged at INFO: nearly every byte count leaves one, and it is a negligible share of a
#: real host tier. Above this share of the configured bytes it is a WARNING: the configuration
#: probably meant a slot more.
_UNUSED_HOST_SHARE_TO_WARN = 0.1


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What ``load_with_sources`` placed: new tokens, and how many came from each tier label."""

    tokens: int
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CopyStatistics:
    """Device ↔ host copy counters (read by ``kvtier.metrics``)."""

    bytes_to_host: int
    bytes_to_device: int
    seconds_to_host: float
    seconds_to_device: float
    store_size: HistogramSnapshot
    load_size: HistogramSnapshot
    failures: int


@dataclass(slots=True)
class StagedLoad:
    """A load staged up to its host→device copy (:meth:`Engine._stage_load`).

    ``hit_keys`` — the prefix to place, from chunk ``num_computed_tokens // chunk_tokens`` on —
    are pinned in host memory (``slot_ids``, co-indexed) until :meth:`Engine._finish_load`;
    ``block_ids`` are their device blocks, in order. ``tokens_by_tier`` counts, per tier label,
    the tokens beyond ``num_computed_tokens`` they hold. Empty lists: a miss, nothing pinned.
    """

    ctx: RequestContext
    hit_keys: list[bytes] = field(default_factory=list)
    slot_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """New tokens on the device once every chunk of the prefix arrived (what ``load`` returns)."""
        return sum(self.tokens_by_tier.values())


class _CopyCounters:
    def __init__(self) -> None:
        self.bytes = {"to_host": 0, "to_device": 0}
        self.seconds = {"to_host": 0.0, "to_device": 0.0}
        self.sizes = {"to_host": Histogram(SIZE_BUCKETS), "to_device": Histogram(SIZE_BUCKETS)}
        self.failures = 0

    def record(self, direction: str, result: CopyResult) -> None:
        if not result.success:
            self.failures += 1
            return
        self.bytes[direction] += result.nbytes
        self.seconds[direction] += result.seconds
        self.sizes[direction].observe(result.nbytes)

    def statistics(self) -> CopyStatistics:
        return CopyStatistics(
            bytes_to_host=self.bytes["to_host"],
            bytes_to_device=self.bytes["to_device"],
            seconds_to_host=self.seconds["to_host"],
            seconds_to_device=self.seconds["to_device"],
            store_size=self.sizes["to_host"].snapshot(),
            load_size=self.sizes["to_device"].snapshot(),
            failures=self.failures,
        )


def _request_keys(cache_salt: str | None = None, lora_name: str | None = None,
                  lora_path: str | None = None, mm_items: Sequence[tuple[str, int, int]] | None = None,
                  prompt_embeds: torch.Tensor | None = None) -> RequestExtraKeys:
    """The extra-key inputs of one call (validated: ``TypeError``/``ValueError`` at the call).

    Every public method keying a request takes these keyword arguments and passes this object
    to :meth:`Engine._hashes_and_keys`; a plain request (all ``None``) shares one empty object.
    """
    if cache_salt is None and lora_name is None and lora_path is None and mm_items is None \
            and prompt_embeds is None:
        return NO_EXTRA_KEYS
    return RequestExtraKeys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)


class Engine:
    """A running kvtier stack. Obtain one from :func:`open` (or :func:`start_in_thread`).

    Every method that keys a request (``load``, ``load_with_sources``, ``load_layerwise``,
    ``store``, ``cached_prefix_tokens``, ``chunk_keys``) also takes keyword-only *extra keys*,
    hashed into the chunk keys exactly as vLLM 0.33 does (:class:`kvtier.keys.RequestExtraKeys`):
    a call finds only chunks stored with the same values.

    * ``cache_salt``: the tenant's salt (non-empty str); isolates its chunks from every other
      salt and from unsalted requests.
    * ``lora_name`` and ``lora_path``: the LoRA adapter of the request (both or neither).
    * ``mm_items``: the multimodal inputs, ``(identifier, offset, length)`` per item
      (:class:`kvtier.keys.MultimodalItem`) in prompt order, not overlapping.
    * ``prompt_embeds``: the request's 2-D prompt-embeddings tensor, if it has one.
    """

    def __init__(
        self,
        config: EngineConfig,
        geometry: KVGeometry,
        device_kv: Sequence[torch.Tensor] | torch.Tensor | None = None,
        *,
        tp_rank: int = 0,
        hash_algorithm: str = "sha256",
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
        kv_events_enabled: bool = False,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
    ) -> None:
        if not math.isfinite(wait_timeout_s) or wait_timeout_s <= 0:
            raise ConfigError(f"wait_timeout_s: {wait_timeout_s!r} is invalid; expected a positive number")
        if (isinstance(flush_timeout_s, bool) or not isinstance(flush_timeout_s, (int, float))
                or not math.isfinite(flush_timeout_s) or flush_timeout_s < 0):
            raise ConfigError(
                f"flush_timeout_s: {flush_timeout_s!r} is invalid; expected a finite number of seconds >= 0 "
                "(0: do not wait for cascades at close)"
            )
        self.config = config
        self.spec = load_spec(config)
        self.geometry = geometry
        self.device_kv = device_kv
        self.tp_rank = tp_rank
        self.blocks_per_chunk = config.resolve_blocks_per_chunk(geometry.block_size)
        self.chunk_tokens = geometry.block_size * self.blocks_per_chunk
        self.slot_bytes = geometry.slot_bytes(self.blocks_per_chunk)
        self.num_slots = config.num_slots(self.slot_bytes)
        #: Bytes of the host tier: ``cpu_bytes_to_use`` rounded down to whole slots.
        self.host_bytes = self.num_slots * self.slot_bytes
        self.wait_timeout_s = wait_timeout_s
        self.flush_timeout_s = float(flush_timeout_s)
        self.kv_events_enabled = kv_events_enabled
        #: Blocks of the device KV cache (valid block ids are ``[0, num_device_blocks)``);
        #: ``None`` without ``device_kv``.
        self.num_device_blocks: int | None = None
        self._hasher = BlockHasher(hash_algorithm, geometry.block_size)
        self._req_ids = itertools.count()
        self._copy_ids = itertools.count()
        self._copy_waiters: dict[int, tuple[anyio.Event, list[CopyResult]]] = {}
        self._copy_counters = _CopyCounters()
        self._tick: anyio.Event | None = None
        self._running = False  # every component started (the body of ``open`` was reached)
        self._closing = False  # close began: public methods refuse from now on
        self._closed = False
        # Why close did not finish the flush (for the abandoned-jobs warning).
        self._flush_shortfall = "the flush was not attempted"
        # load/store operations are "readers" of the host tier; reset_cache is the "writer".
        self._active_ops = 0
        self._ops_idle: anyio.Event | None = None
        self._reset_gate: anyio.Event | None = None
        self.host: HostTier
        self.tiers: list[SecondaryTier] = []
        self.copy_engine: CopyEngine | None = None
        self.manager: TieringManager
        self.publisher: Any = None
        self.translator: Any = None
        self.metrics: Any = None
        #: The ``/metrics`` HTTP server when ``metrics=`` was given (``.host``, ``.port``).
        self.metrics_server: Any = None

    # ------------------------------------------------------------------ construction
    def _build_host(self) -> None:
        from kvtier.host.tier import HostTier

        cfg = self.config
        unused = cfg.cpu_bytes_to_use - self.host_bytes
        if unused:
            logger.log(
                logging.WARNING if unused > _UNUSED_HOST_SHARE_TO_WARN * cfg.cpu_bytes_to_use else logging.INFO,
                "cpu_bytes_to_use = %d is not a whole number of host slots: the host tier holds %d slots "
                "of %d bytes = %d bytes, %d bytes unused",
                cfg.cpu_bytes_to_use, self.num_slots, self.slot_bytes, self.host_bytes, unused,
            )
        self.host = HostTier(
            self.num_slots,
            self.slot_bytes,
            eviction_policy=cfg.eviction_policy,
            cache_policy_module_path=cfg.cache_policy_module_path,
            store_threshold=cfg.store_threshold,
            max_tracker_size=cfg.max_tracker_size,
            enable_events=self.kv_events_enabled,
        )
        try:
            _ = self.host.buffer  # allocate now: a size the machine cannot hold fails at start-up
        except ConfigError as exc:
            detail = str(exc).removeprefix("cpu_bytes_to_use: ")
            raise ConfigError(
                f"cpu_bytes_to_use: {cfg.cpu_bytes_to_use} is more than this machine can allocate: {detail}"
            ) from None

    def _build_tiers(self) -> None:
        from kvtier.tiers.base import TierContext
        from kvtier.tiers.factory import SecondaryTierFactory

        if not self.config.secondary_tiers:
            return
        if not self.spec.supports_tiers:
            raise ConfigError(
                f"secondary_tiers: spec {self.config.spec_name!r} does not take secondary tiers"
            )
        on_asyncio = _running_on_asyncio()
        run_fields = self.geometry.run_fields(self.blocks_per_chunk)
        for tier_cfg in self.config.secondary_tiers:
            context = TierContext(
                index=tier_cfg.index,
                label=tier_cfg.label,
                slot_bytes=self.slot_bytes,
                host=self.host.buffer,
                geometry=self.geometry,
                blocks_per_chunk=self.blocks_per_chunk,
                run_fields=run_fields,
                rank=self.tp_rank,
                kv_events_enabled=self.kv_events_enabled,
                self_describing_kv_events=self.config.self_describing_kv_events,
                hash_algorithm=self._hasher.algorithm,
            )
            tier = SecondaryTierFactory.create(tier_cfg, context)
            if getattr(tier, "requires_asyncio", False) and not on_asyncio:
                raise ConfigError(
                    f"secondary_tiers[{tier_cfg.index}].type: {tier_cfg.type!r} requires the asyncio "
                    "event loop, but kvtier.open() runs under another one (trio?); use asyncio or "
                    "remove the tier"
                )
            self.tiers.append(tier)

    async def _start(self, tg: anyio.abc.TaskGroup, events: Mapping[str, Any] | None,
                     metrics: Mapping[str, Any] | None) -> None:
        self._tick = anyio.Event()
        if events is not None:  # validated before any tier opens (a scan, a bucket probe)
            from kvtier.events import EventTranslator, publisher_from_config

            self.publisher = publisher_from_config(events)
            self.translator = EventTranslator(
                self.config.self_describing_kv_events, int_hashes=self.publisher.int_hashes
            )
        self._build_host()
        if self.device_kv is not None:
            from kvtier.host.copy_engine import make_copy_engine

            self.copy_engine = make_copy_engine(
                self.device_kv, self.geometry, self.blocks_per_chunk, self.host.buffer, tp_rank=self.tp_rank
            )
            self.num_device_blocks = self.copy_engine.num_blocks
            self.copy_engine.set_wakeup(self._wake)
            await tg.start(self.copy_engine.run)
        self._build_tiers()
        for tier in self.tiers:
            tier.set_wakeup(self._wake)
            await tg.start(tier.run)
        self.manager = self.spec.create_manager(self.host, self.tiers)
        self._check_backpressure_reached_the_manager()
        if self.publisher is not None:
            await tg.start(self.publisher.run)
        self._setup_metrics(metrics)
        tg.start_soon(self._drive)
        self._running = True

    def _check_backpressure_reached_the_manager(self) -> None:
        """A configured ``backpressure`` must act: the manager needs a detector for every tier
        that has one. An out-of-tree spec overriding ``create_manager`` can silently drop them."""
        detectors = self.manager.backpressure_detectors
        for i, tier_cfg in enumerate(self.config.secondary_tiers):
            settings = self.config.backpressure_for(tier_cfg)
            if settings is None or (i < len(detectors) and detectors[i] is not None):
                continue
            own = tier_cfg.backpressure is not None
            key = f"secondary_tiers[{tier_cfg.index}].backpressure" if own else "backpressure"
            value = redact(dict((tier_cfg.backpressure if own else self.config.backpressure) or {}))
            raise ConfigError(
                f"{key}: {value!r} is configured for tier {tier_cfg.label}, but the manager that spec "
                f"{self.config.spec_name!r} built has no back-pressure detector for it, so it would never "
                "act; a spec that overrides create_manager must pass backpressure=self.backpressure to "
                "TieringManager (or remove this key)"
            )

    def _setup_metrics(self, metrics: Mapping[str, Any] | None) -> None:
        from kvtier.metrics import EngineMetrics, serve_metrics

        self.metrics = EngineMetrics()
        self.metrics.add_host(self.host)
        for tier in self.tiers:
            self.metrics.add_tier(tier)
        self.metrics.add_manager(self.manager)
        self.metrics.add_copies(self._copy_counters)
        if self.publisher is not None:
            self.metrics.add_publisher(self.publisher)
        if metrics is not None:
            unknown = set(metrics) - {"host", "port"}
            if unknown:
                raise ConfigError(f"metrics.{sorted(unknown)[0]}: unknown key; allowed: host, port")
            port = metrics.get("port", 9464)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ConfigError(f"metrics.port: {port!r} is invalid; expected an int in [0, 65535]")
            host = str(metrics.get("host", "127.0.0.1"))
            try:
                self.metrics_server = serve_metrics(self.metrics.registry, host=host, port=port)
            except OSError as exc:
                # Which key is at fault: a name that does not resolve or an address this machine
                # does not have is the host's; a port in use (or privileged) is the port's.
                key = "metrics.host" if isinstance(exc, socket.gaierror) or exc.errno in (
                    errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) else "metrics.port"
                raise ConfigError(
                    f"{key}: cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
                ) from None

    # ------------------------------------------------------------------ progress
    def _wake(self) -> None:
        """Called by components (on the loop thread) when a result or verdict is available."""
        tick = self._tick
        if tick is not None:
            # Swap before setting: whoever waits from now on waits for the *next* wake-up.
            self._tick = anyio.Event()
            tick.set()

    async def _wait_progress(self, deadline: float) -> bool:
        """Wait for the next wake-up; ``False`` if ``deadline`` (anyio clock) passed first."""
        tick = self._tick
        assert tick is not None
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            await tick.wait()
            return True
        return False

    async def _drive(self) -> None:
        """Background task: turn wake-ups into manager polls and copy completions."""
        while True:
            tick = self._tick
            assert tick is not None
            await tick.wait()
            self._dispatch()

    def _dispatch(self) -> None:
        if self.copy_engine is not None:
            for result in self.copy_engine.get_finished():
                waiter = self._copy_waiters.pop(result.job_id, None)
                if waiter is not None:
                    waiter[1].append(result)
                    waiter[0].set()
        self.manager.poll()
        if self.manager.needs_step_end():  # promotions started by a peer's lookups, parked cascades
            self.manager.on_schedule_end()
        self._publish_events()

    def _publish_events(self) -> None:
        events = self.manager.take_events()
        if self.publisher is None or not events:
            return
        self.publisher.publish(self.translator.translate(events))

    def _order(self, stream: Any, after: Any) -> CopyOrder | None:
        """The caller's place among its device work (``CopyEngine.capture_order``); call it in the
        caller's thread, first thing in the operation."""
        if self.copy_engine is None:
            if stream is not None or after is not None:
                raise ValueError("stream= and after= need an engine opened with device_kv")
            return None
        return self.copy_engine.capture_order(stream, after)

    async def _copy(self, direction: Direction, slot_ids: list[int], block_ids: list[int],
                    order: CopyOrder | None) -> CopyResult:
        from kvtier.host.copy_engine import CopyJob

        if self.copy_engine is None:
            raise RuntimeError("this engine was opened without device_kv; it cannot copy KV")
        job_id = next(self._copy_ids)
        done = anyio.Event()
        box: list[CopyResult] = []
        self._copy_waiters[job_id] = (done, box)
        self.copy_engine.submit(CopyJob(job_id, direction, slot_ids, block_ids, order=order))
        # Shielded: the copy cannot be recalled once submitted, and the caller releases the host
        # slots (and may reuse the device blocks) as soon as this returns — so even a cancelled
        # caller waits for the copy's result. Copies are bounded (a few ms); the copy engine
        # reports every job exactly once, also when it is closed.
        with anyio.CancelScope(shield=True):
            try:
                while not done.is_set():
                    await self._wait_progress(anyio.current_time() + 1.0)
                    self._dispatch()
            finally:
                self._copy_waiters.pop(job_id, None)
        result = box[0]
        self._copy_counters.record(direction, result)
        if direction == "to_device" and result.success:
            self.copy_engine.hand_over(order, result)
        return result

    @contextlib.asynccontextmanager
    async def _operation(self) -> AsyncIterator[None]:
        """Admit one load/store; waits while a reset is in progress."""
        while self._reset_gate is not None:
            await self._reset_gate.wait()
        self._active_ops += 1
        try:
            yield
        finally:
            self._active_ops -= 1
            if self._active_ops == 0 and self._ops_idle is not None:
                self._ops_idle.set()

    # ------------------------------------------------------------------ keys
    def chunk_keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                   lora_name: str | None = None, lora_path: str | None = None,
                   mm_items: Sequence[tuple[str, int, int]] | None = None,
                   prompt_embeds: torch.Tensor | None = None) -> list[bytes]:
        """Offload keys of the complete chunks of ``token_ids`` (prefix order), with the extra keys."""
        self._check_open("chunk_keys")
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return self._hashes_and_keys(int_ids(token_ids, "token_ids"), extras)[1]

    def _hashes_and_keys(self, token_ids: Sequence[int],
                         extras: RequestExtraKeys) -> tuple[list[bytes], list[bytes]]:
        """Block hashes of ``token_ids`` keyed with ``extras``, and the chunks' offload keys."""
        bs = self._hasher.block_size
        hashes = self._hasher.hash_blocks(token_ids, extras.per_block(len(token_ids) // bs, bs))
        return hashes, chunk_keys(hashes, self.blocks_per_chunk)

    def _remember_chunks(self, token_ids: Sequence[int], hashes: Sequence[bytes],
                         keys: Sequence[bytes], extras: RequestExtraKeys, first_chunk: int = 0) -> None:
        """Give the event translator what self-describing events say about these chunks.

        ``keys`` are consecutive chunks from chunk ``first_chunk`` on. Each chunk's metadata
        carries its blocks' slice of ``extras.per_block`` (``None`` for a plain request), which
        the translator publishes untagged, as vLLM does.
        """
        if self.translator is None or not self.config.self_describing_kv_events or not keys:
            return
        from kvtier.events import ChunkMetadata

        bpc, tokens = self.blocks_per_chunk, self.chunk_tokens
        # Only the blocks up to the last chunk remembered (prompt-embeds digests cost a hash).
        per_block = extras.per_block((first_chunk + len(keys)) * bpc, self.geometry.block_size)
        for i, key in enumerate(keys, start=first_chunk):
            self.translator.remember_chunk(key, ChunkMetadata(
                block_hashes=hashes[i * bpc : (i + 1) * bpc],
                parent_block_hash=hashes[i * bpc - 1] if i else None,
                token_ids=token_ids[i * tokens : (i + 1) * tokens],
                block_size=self.geometry.block_size,
                lora_name=extras.lora_name,
                extra_keys=None if per_block is None else per_block[i * bpc : (i + 1) * bpc],
            ))

    def _context(self, kind: str, params: Mapping[str, Any] | None, keys: Sequence[bytes],
                 first_chunk: int = 0) -> RequestContext:
        ctx = RequestContext(f"{kind}-{next(self._req_ids)}", params)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (first_chunk + i + 1) * self.chunk_tokens)
        return ctx

    def _check_open(self, method: str) -> None:
        if self._closing:
            state = "closed" if self._closed else "closing"
            raise EngineClosedError(
                f"Engine.{method}(): this kvtier engine is {state} (its `async with kvtier.open(...)` "
                "block was left or close() was called); open a new engine"
            )

    # ------------------------------------------------------------------ public API
    def cached_prefix_tokens(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                             lora_name: str | None = None, lora_path: str | None = None,
                             mm_items: Sequence[tuple[str, int, int]] | None = None,
                             prompt_embeds: torch.Tensor | None = None) -> int:
        """Tokens of ``token_ids`` whose chunks some tier holds now. Non-blocking, no promotion.

        A tier that does not know yet counts as a miss (its probe is started, so a later call
        may answer more). Bad ``token_ids`` or extra keys raise ``TypeError``/``ValueError``
        (see :meth:`load`).
        """
        self._check_open("cached_prefix_tokens")
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        keys = self._hashes_and_keys(int_ids(token_ids, "token_ids"), extras)[1]
        ctx = RequestContext(f"peek-{next(self._req_ids)}")
        held = 0
        for key in keys:
            if self.host.lookup(key) is not LookupResult.MISS:
                held += 1
                continue
            if not any(t.lookup(key, ctx) is LookupResult.HIT for t in self.tiers):
                break
            held += 1
        for tier in self.tiers:
            tier.on_request_finished(ctx)
        return held * self.chunk_tokens

    async def load(self, token_ids: Sequence[int], block_ids: Sequence[int],
                   params: Mapping[str, Any] | None = None, *, num_computed_tokens: int = 0,
                   cache_salt: str | None = None, lora_name: str | None = None,
                   lora_path: str | None = None, mm_items: Sequence[tuple[str, int, int]] | None = None,
                   prompt_embeds: torch.Tensor | None = None, stream: Any = None, after: Any = None) -> int:
        """Copy the cached prefix of ``token_ids`` into device blocks; return the new tokens placed.

        Chunks are looked up from chunk ``num_computed_tokens // chunk_tokens`` on (the caller
        already has the tokens before it on the device). ``block_ids[i]`` is the device block of
        token block ``i`` (absolute index). Promotions from secondary tiers are awaited; a chunk
        whose promotion fails or does not finish within ``wait_timeout_s`` ends the prefix (the
        caller recomputes from there). Only whole chunks are loaded, and only chunks that lie
        entirely inside ``token_ids``: a caller that must compute the last prompt token itself
        (to sample from its logits) passes ``token_ids[:-1]``.

        Returns the number of tokens beyond ``num_computed_tokens`` now on the device, so the
        caller's new computed count is ``num_computed_tokens + result``.

        Arguments are checked before any work is queued: ``token_ids`` and ``block_ids`` are
        sequences of ints (``TypeError`` otherwise: bool, float, str, None), token ids are >= 0,
        ``num_computed_tokens`` is an int >= 0, and the block ids this call may use — those of
        the chunks from ``num_computed_tokens`` to the end of ``token_ids`` — exist, lie in
        ``[0, number of device blocks)`` and are distinct (``ValueError`` naming the id).
        The extra keys (``cache_salt``, ``lora_name``/``lora_path``, ``mm_items``,
        ``prompt_embeds``; see :class:`Engine`) must be those the chunks were stored with;
        bad ones raise ``TypeError``/``ValueError`` naming the argument.
        Raises :class:`kvtier.EngineClosedError` once the engine is closing.

        With CUDA ``device_kv`` (ordering, ``kvtier.host.copy_engine``): the copy overwrites the
        blocks only after the work enqueued on ``stream`` before this call — default: the calling
        thread's current stream, as it is when this is called — or after the event ``after``;
        when this returns, ``stream`` waits for the copy, so kernels enqueued there afterwards read
        the loaded KV. ``stream``/``after`` with CPU tensors are a ``ValueError``.
        """
        self._check_open("load")
        order = self._order(stream, after)
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return (await self._checked_load(token_ids, block_ids, params, num_computed_tokens, extras,
                                         order)).tokens

    async def load_with_sources(self, token_ids: Sequence[int], block_ids: Sequence[int],
                                params: Mapping[str, Any] | None = None, *,
                                num_computed_tokens: int = 0, cache_salt: str | None = None,
                                lora_name: str | None = None, lora_path: str | None = None,
                                mm_items: Sequence[tuple[str, int, int]] | None = None,
                                prompt_embeds: torch.Tensor | None = None, stream: Any = None,
                                after: Any = None) -> LoadOutcome:
        """Like :meth:`load`, also reporting how many tokens came from each tier label."""
        self._check_open("load_with_sources")
        order = self._order(stream, after)
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return await self._checked_load(token_ids, block_ids, params, num_computed_tokens, extras, order)

    async def _checked_load(self, token_ids: Sequence[int], block_ids: Sequence[int],
                            params: Mapping[str, Any] | None, num_computed_tokens: int,
                            extras: RequestExtraKeys, order: CopyOrder | None) -> LoadOutcome:
        token_ids = int_ids(token_ids, "token_ids")
        block_ids = int_ids(block_ids, "block_ids")
        num_computed_tokens = count(num_computed_tokens, "num_computed_tokens")
        async with self._operation():
            return await self._load(token_ids, block_ids, params, num_computed_tokens, extras, order)

    async def _load(self, token_ids: Sequence[int], block_ids: Sequence[int],
                    params: Mapping[str, Any] | None, num_computed_tokens: int,
                    extras: RequestExtraKeys, order: CopyOrder | None) -> LoadOutcome:
        staged = await self._stage_load(token_ids, block_ids, params, num_computed_tokens, extras)
        arrived = False
        try:
            if not staged.hit_keys:
                return LoadOutcome(0, {})
            result = await self._copy("to_device", staged.slot_ids, staged.block_ids, order)
            if not result.success:
                logger.error("host→device copy failed: %s", result.error)
                return LoadOutcome(0, {})
            arrived = True
            return LoadOutcome(staged.tokens, dict(staged.tokens_by_tier))
        finally:
            self._finish_load(staged, arrived=arrived)

    async def _stage_load(self, token_ids: Sequence[int], block_ids: Sequence[int],
                          params: Mapping[str, Any] | None, num_computed_tokens: int,
                          extras: RequestExtraKeys) -> StagedLoad:
        """Everything a load does before its host→device copy; ``load`` and ``load_layerwise`` share it.

        Keys ``token_ids`` with ``extras``, starts the request, takes the chunks from chunk
        ``num_computed_tokens // chunk_tokens`` on (capped by ``max_load_tokens``), checks the
        block ids they would use, resolves the prefix held in host memory (promotions awaited, see
        :meth:`_resolve_prefix`), records its chunks for self-describing events and pins it.

        The caller owns the result and must hand it to :meth:`_finish_load` exactly once, whatever
        happens to its copy. If this raises (bad block ids, cancellation), it has finished the
        request itself and nothing stays pinned.
        """
        hashes, keys = self._hashes_and_keys(token_ids, extras)
        first = num_computed_tokens // self.chunk_tokens
        ctx = self._context("load", params, keys[first:], first)
        self.manager.on_new_request(ctx)
        staged = StagedLoad(ctx)
        try:
            candidates = keys[first:]
            limit = ctx.params.max_load_tokens
            if limit is not None:
                candidates = candidates[: limit // self.chunk_tokens]
            bpc = self.blocks_per_chunk
            check_block_ids(block_ids, first * bpc, (first + len(candidates)) * bpc, self.num_device_blocks)
            hit_keys = await self._resolve_prefix(candidates, ctx)
            if not hit_keys:
                return staged
            self._remember_chunks(token_ids, hashes, hit_keys, extras, first)
            staged.slot_ids = self.manager.prepare_load(hit_keys, ctx)
            staged.hit_keys = hit_keys
            staged.block_ids = list(block_ids[first * bpc : (first + len(hit_keys)) * bpc])
            # Count only tokens beyond what the caller already had: the first chunk may start
            # before num_computed_tokens when that is not chunk-aligned.
            for i, key in enumerate(hit_keys, start=first):
                new_tokens = (i + 1) * self.chunk_tokens - max(i * self.chunk_tokens, num_computed_tokens)
                if new_tokens > 0:
                    label = self.manager.get_load_source(key, ctx)
                    staged.tokens_by_tier[label] = staged.tokens_by_tier.get(label, 0) + new_tokens
        except BaseException:
            self._finish_load(staged, arrived=False)
            raise
        return staged

    def _finish_load(self, staged: StagedLoad, *, arrived: bool) -> None:
        """End a staged load: unpin its chunks, count them as used (recency) only if ``arrived``
        (every byte reached the device), finish the request and publish its events."""
        try:
            if staged.hit_keys:
                self.manager.complete_load(staged.hit_keys, staged.ctx)
                if arrived:
                    self.manager.touch(staged.hit_keys, staged.ctx)
        finally:
            self.manager.on_request_finished(staged.ctx)
            self._publish_events()

    async def _resolve_prefix(self, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
        """Longest prefix of ``keys`` that is ``HIT`` in host memory, awaiting promotions/probes."""
        deadline = anyio.current_time() + self.wait_timeout_s
        while True:
            prefix = 0
            waiting = False
            for key in keys:
                verdict = self.manager.lookup(key, ctx)
                if verdict is LookupResult.HIT:
                    if not waiting:
                        prefix += 1
                elif verdict is LookupResult.MISS:
                    break
                else:  # HIT_PENDING or RETRY: keep scanning so later probes start now
                    waiting = True
            if not waiting:
                return list(keys[:prefix])
            self.manager.on_schedule_end()
            if not await self._wait_progress(deadline):
                # Give up on what is still pending; a later request will find it.
                self.manager.on_schedule_end()
                return list(keys[:prefix])
            self._dispatch()

    async def store(self, token_ids: Sequence[int], block_ids: Sequence[int],
                    params: Mapping[str, Any] | None = None, *,
                    num_prompt_tokens: int | None = None, cache_salt: str | None = None,
                    lora_name: str | None = None, lora_path: str | None = None,
                    mm_items: Sequence[tuple[str, int, int]] | None = None,
                    prompt_embeds: torch.Tensor | None = None, stream: Any = None, after: Any = None) -> int:
        """Offload the complete chunks of ``token_ids`` held in device ``block_ids``.

        Returns the number of tokens newly copied to host memory, once the device blocks may be
        reused; the cascade to secondary tiers continues in the background. Chunks already
        held are not copied again. Honours ``max_offload_tokens`` and, when
        ``offload_prompt_only`` is set and ``num_prompt_tokens`` is given, stops at the prompt.
        If no host slot can be freed within ``wait_timeout_s`` nothing is offloaded (0).

        Arguments are checked before any work is queued, as for :meth:`load`; the block ids
        checked for range and duplicates are those of the chunks this call offloads;
        ``num_prompt_tokens`` is ``None`` or an int >= 0. The chunks are keyed with the extra
        keys (see :class:`Engine`): only a call with the same ones finds them. Raises
        :class:`kvtier.EngineClosedError` once the engine is closing.

        With CUDA ``device_kv`` (ordering, ``kvtier.host.copy_engine``): the copy reads the
        blocks only after the work enqueued on ``stream`` before this call — default: the calling
        thread's current stream, as it is when this is called; write the KV there, or pass the
        stream that does — or after the event ``after``. ``stream``/``after`` with CPU tensors
        are a ``ValueError``.
        """
        self._check_open("store")
        order = self._order(stream, after)
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        token_ids = int_ids(token_ids, "token_ids")
        block_ids = int_ids(block_ids, "block_ids")
        if num_prompt_tokens is not None:
            num_prompt_tokens = count(num_prompt_tokens, "num_prompt_tokens")
        async with self._operation():
            return await self._store(token_ids, block_ids, params, num_prompt_tokens, extras, order)

    async def _store(self, token_ids: Sequence[int], block_ids: Sequence[int],
                     params: Mapping[str, Any] | None, num_prompt_tokens: int | None,
                     extras: RequestExtraKeys, order: CopyOrder | None) -> int:
        hashes, keys = self._hashes_and_keys(token_ids, extras)
        ctx = self._context("store", params, keys)
        self.manager.on_new_request(ctx)
        limit = len(token_ids)
        cap = ctx.params.max_offload_tokens
        if cap is not None:
            limit = min(limit, cap)
        if self.config.offload_prompt_only and num_prompt_tokens is not None:
            limit = min(limit, num_prompt_tokens)
        keys = keys[: limit // self.chunk_tokens]
        try:
            if not keys:
                return 0
            check_block_ids(block_ids, 0, len(keys) * self.blocks_per_chunk, self.num_device_blocks)
            deadline = anyio.current_time() + self.wait_timeout_s
            while (out := self.manager.prepare_store(keys, ctx)) is None:
                if not await self._wait_progress(deadline):
                    logger.warning("no host slot became free within %.1fs; %d chunks not offloaded",
                                   self.wait_timeout_s, len(keys))
                    return 0
                self._dispatch()
            if not out.keys_to_store:
                return 0
            self._remember_chunks(token_ids, hashes, keys, extras)
            index = {key: i for i, key in enumerate(keys)}
            device_blocks: list[int] = []
            for key in out.keys_to_store:
                i = index[key]
                device_blocks.extend(block_ids[i * self.blocks_per_chunk : (i + 1) * self.blocks_per_chunk])
            success = False
            try:
                result = await self._copy("to_host", list(out.slot_ids), device_blocks, order)
                success = result.success
                if not success:
                    logger.error("device→host copy failed: %s", result.error)
            finally:
                self.manager.complete_store(out.keys_to_store, ctx, success)
            return len(out.keys_to_store) * self.chunk_tokens if success else 0
        finally:
            self.manager.on_request_finished(ctx)
            self._publish_events()

    async def reset_cache(self) -> None:
        """Drop every chunk from host memory (secondary tiers keep theirs), safely.

        New loads and stores wait; the ones running finish first (so no device copy can target
        a freed slot), then every tier job in flight is drained, then the host tier is reset.
        """
        self._check_open("reset_cache")
        while self._reset_gate is not None:  # a reset is already running: that one will do
            await self._reset_gate.wait()
            return
        gate = self._reset_gate = anyio.Event()
        try:
            while self._active_ops:
                idle = self._ops_idle = anyio.Event()
                await idle.wait()
            self._ops_idle = None
            await self._drain()
            self.manager.reset_cache()
            self.manager.on_reset_flushed()
            if self.publisher is not None:
                self.publisher.publish(self.translator.cleared())
        finally:
            self._reset_gate = None
            gate.set()

    async def drain(self) -> None:
        """Wait until every job in flight (cascades included) has been reported."""
        self._check_open("drain")
        await self._drain()

    async def _drain(self) -> None:
        self.manager.on_schedule_end()
        while self.manager.jobs_in_flight:
            await self._wait_progress(anyio.current_time() + 1.0)
            self._dispatch()

    def statistics(self) -> dict[str, Any]:
        """Snapshots of every component, keyed by tier label (also after close: the final counts)."""
        stats: dict[str, Any] = {PRIMARY_LABEL: self.host.statistics(), "manager": self.manager.statistics(),
                                 "copies": self._copy_counters.statistics()}
        for tier in self.tiers:
            stats[tier.context.label] = tier.statistics()
        return stats

    # ------------------------------------------------------------------ shutdown
    async def _flush(self) -> None:
        """First step of close: wait up to ``flush_timeout_s`` for the tier jobs in flight.

        Not shielded: if the caller's scope is cancelled the wait ends at once (and the jobs are
        abandoned by :meth:`_aclose`, which logs them). Public methods refuse from here on.
        """
        self._closing = True
        if not self._running:
            return
        if self.flush_timeout_s == 0:
            self._flush_shortfall = "flush_timeout_s=0: close does not wait"
            return
        self._flush_shortfall = "close was cancelled while flushing"
        with anyio.move_on_after(self.flush_timeout_s):
            await self._drain()
            self._flush_shortfall = ""
            return
        self._flush_shortfall = f"flush_timeout_s={self.flush_timeout_s:g} passed"

    def _log_abandoned(self) -> None:
        """WARNING per tier with jobs still in flight at close: they are about to be cancelled."""
        self.manager.poll()
        for label, jobs in self.manager.jobs_in_flight_by_tier().items():
            if not jobs.jobs:
                continue
            logger.warning(
                "closing the kvtier engine (%s): tier %s abandons %d cascade jobs (%d chunks not "
                "written to it) and %d promotion jobs (%d chunks)",
                self._flush_shortfall or "flushed", label, jobs.cascade_jobs, jobs.cascade_chunks,
                jobs.promotion_jobs, jobs.promotion_chunks,
            )

    async def _aclose(self) -> None:
        """Close every component; all are attempted, the first error is re-raised."""
        self._closing = True
        if self._closed:
            return
        self._closed = True
        if self._running:
            try:
                self._log_abandoned()
            except Exception:  # noqa: BLE001 - a report must never keep a component open
                logger.exception("counting the tier jobs abandoned at close failed")
        errors: list[BaseException] = []
        with anyio.CancelScope(shield=True):
            for tier in self.tiers:
                try:
                    await tier.aclose()
                except Exception as exc:  # noqa: BLE001 - every tier must be attempted
                    logger.exception("closing tier %s failed", tier.context.label)
                    errors.append(exc)
            if self.copy_engine is not None:
                try:
                    await self.copy_engine.aclose()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            if self.publisher is not None:
                try:
                    await self.publisher.aclose()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            if self.metrics_server is not None:
                self.metrics_server.close()
        if errors:
            raise errors[0]  # the host buffer stays alive: the tier that failed may still touch it
        if self.copy_engine is not None and not self.copy_engine.fenced:
            return  # a device copy may still read or write it: keep the buffer (the engine said so)
        host = getattr(self, "host", None)  # absent when start-up failed before building it
        if host is not None:
            host.close()

    # ------------------------------------------------------------------ layer-wise loading
    def load_layerwise(self, token_ids: Sequence[int], block_ids: Sequence[int],
                       params: Mapping[str, Any] | None = None, *, num_computed_tokens: int = 0,
                       layers_per_group: int = 1, cache_salt: str | None = None,
                       lora_name: str | None = None, lora_path: str | None = None,
                       mm_items: Sequence[tuple[str, int, int]] | None = None,
                       prompt_embeds: torch.Tensor | None = None, stream: Any = None,
                       after: Any = None) -> LayerwiseLoad:
        """:meth:`load`, delivered layer group by layer group (semantics: ``kvtier.engine.layerwise``).

        ``async with engine.load_layerwise(...) as layers:`` stages the load as :meth:`load`
        does (the same code: promotions awaited, ``max_load_tokens``, pins); ``layers.tokens`` is
        then what :meth:`load` would return, and
        ``async for group in layers`` yields each ``LayerGroup(start, stop)`` of
        ``layers_per_group`` layers once its bytes are on the device, in layer order. A failed
        copy raises :class:`kvtier.engine.layerwise.LayerwiseLoadError` from the iteration: recompute
        the whole prefix. Leaving the block waits for the copies in flight, then unpins.

        Arguments are checked at the call as for :meth:`load` (the block ids on entering), the
        extra keys included (see :class:`Engine`: only chunks stored with the same ones are
        found); ``layers_per_group`` is an int >= 1; an engine opened without ``device_kv``
        raises ``RuntimeError``; a closing engine :class:`kvtier.EngineClosedError`.
        ``stream``/``after`` order the copies as for :meth:`load`, captured at this call; each
        group's copy is handed over to ``stream`` as the group is yielded.
        """
        from kvtier.engine.layerwise import LayerwiseLoad, check_layers_per_group

        self._check_open("load_layerwise")
        extras = _request_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        token_ids = int_ids(token_ids, "token_ids")
        block_ids = int_ids(block_ids, "block_ids")
        num_computed_tokens = count(num_computed_tokens, "num_computed_tokens")
        layers_per_group = check_layers_per_group(layers_per_group)
        if self.copy_engine is None:
            raise RuntimeError("this engine was opened without device_kv; it cannot load KV layer-wise")
        order = self._order(stream, after)
        return LayerwiseLoad(self, token_ids, block_ids, params, extras,
                             num_computed_tokens=num_computed_tokens, layers_per_group=layers_per_group,
                             order=order)


@contextlib.asynccontextmanager
async def open(  # noqa: A001 - the public name is kvtier.open
    config: Mapping[str, Any] | EngineConfig,
    geometry: KVGeometry,
    device_kv: Sequence[torch.Tensor] | torch.Tensor | None = None,
    *,
    events: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    tp_rank: int = 0,
    hash_algorithm: str = "sha256",
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
) -> AsyncIterator[Engine]:
    """Run a kvtier engine inside the caller's structured concurrency.

    ``config`` is the ``kv_connector_extra_config`` dictionary (or an ``EngineConfig``);
    ``events`` enables KV events and configures the ZMQ publisher; ``metrics={"port": P,
    "host": H}`` serves ``/metrics`` (the registry is ``engine.metrics.registry`` either way).
    Raises :class:`kvtier.ConfigError` for a bad configuration, an unusable tier, a host buffer
    the machine cannot allocate, an events endpoint or metrics port that cannot be bound (all
    before yielding).

    On exit — normal, or an exception from the body — the engine first waits up to
    ``flush_timeout_s`` seconds (default 5; finite, >= 0) for tier jobs in flight, so chunks
    just stored reach the secondary tiers; ``0`` does not wait. The wait is not shielded: when
    the caller's scope is cancelled, exit does not wait. Jobs still unfinished are then logged
    at WARNING (per tier, jobs and chunks) and cancelled, and every component is closed and
    joined. From the start of the exit every engine method raises
    :class:`kvtier.EngineClosedError`.
    """
    try:
        engine = Engine(EngineConfig.coerce(config), geometry, device_kv, tp_rank=tp_rank,
                        hash_algorithm=hash_algorithm, wait_timeout_s=wait_timeout_s,
                        kv_events_enabled=events is not None, flush_timeout_s=flush_timeout_s)
    except ConfigError as exc:
        raise trim_traceback(exc)  # the message says it all: the traceback ends at this call
    started = False
    try:
        async with anyio.create_task_group() as tg:
            try:
                await engine._start(tg, events, metrics)
                started = True
                yield engine
            finally:
                try:
                    try:
                        await engine._flush()  # unshielded on purpose: cancellation cuts it short
                    finally:
                        await engine._aclose()
                finally:
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The engine's task group wraps whatever crossed it (a ConfigError from a tier's start,
        # or the caller's own exception from the ``async with`` body); give back the single
        # exception when there is exactly one, as the caller raised or expects it. A configuration
        # error found while starting (an unusable root_dir) ends at this call, like one found above.
        error = _sole_exception(group)
        if isinstance(error, ConfigError) and not started:
            error = trim_traceback(error)
        raise error from None


def _running_on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _sole_exception(group: BaseExceptionGroup) -> BaseException:
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


class ThreadedEngine:
    """Blocking, thread-safe facade over an :class:`Engine` running in a background thread.

    Every method raises :class:`kvtier.EngineClosedError` after :meth:`close` (also when another
    thread closes the engine during the call), except :meth:`statistics`, which then returns the
    final snapshot, and :meth:`close` itself, which is idempotent.
    """

    def __init__(self, portal_cm: Any, portal: Any, engine_cm: Any, engine: Engine) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._engine_cm = engine_cm
        self.engine = engine
        self.manager = engine.manager
        self.chunk_tokens = engine.chunk_tokens
        self.host_bytes = engine.host_bytes
        self._closed = False  # close() was called: every method but statistics refuses
        self._loop_gone = False  # close() returned: the engine's loop thread has stopped

    def _call(self, method: str, func: Any, *args: Any) -> Any:
        """Run ``func`` on the engine's loop; a closed engine is an EngineClosedError, never a portal error."""
        if self._closed:
            raise EngineClosedError(f"ThreadedEngine.{method}(): this kvtier engine is closed; start a new one")
        try:
            return self._portal.call(func, *args)
        except EngineClosedError:
            raise
        except RuntimeError as exc:
            if self._closed:  # closed by another thread while this call waited for the portal
                raise EngineClosedError(
                    f"ThreadedEngine.{method}(): this kvtier engine was closed during the call"
                ) from exc
            raise

    def _order(self, stream: Any, after: Any) -> dict[str, Any]:
        """Capture the caller's order here, in the calling thread (its current stream is the one
        that matters, not the loop thread's), as the ``stream``/``after`` the engine is given."""
        order = self.engine._order(stream, after)
        return {} if order is None else {"stream": order.stream, "after": order.ready}

    # The extra keys (cache_salt, lora_name, lora_path, mm_items, prompt_embeds) are those of
    # :class:`Engine`, passed through unchanged; ``stream``/``after`` order the copies against the
    # calling thread's device work (see :meth:`Engine.store`, :meth:`Engine.load`).
    def load(self, token_ids: Sequence[int], block_ids: Sequence[int],
             params: Mapping[str, Any] | None = None, *, num_computed_tokens: int = 0,
             cache_salt: str | None = None, lora_name: str | None = None, lora_path: str | None = None,
             mm_items: Sequence[tuple[str, int, int]] | None = None,
             prompt_embeds: torch.Tensor | None = None, stream: Any = None, after: Any = None) -> int:
        order = self._order(stream, after)
        return self._call("load", lambda: self.engine.load(
            token_ids, block_ids, params, num_computed_tokens=num_computed_tokens, cache_salt=cache_salt,
            lora_name=lora_name, lora_path=lora_path, mm_items=mm_items, prompt_embeds=prompt_embeds,
            **order))

    def load_with_sources(self, token_ids: Sequence[int], block_ids: Sequence[int],
                          params: Mapping[str, Any] | None = None, *,
                          num_computed_tokens: int = 0, cache_salt: str | None = None,
                          lora_name: str | None = None, lora_path: str | None = None,
                          mm_items: Sequence[tuple[str, int, int]] | None = None,
                          prompt_embeds: torch.Tensor | None = None, stream: Any = None,
                          after: Any = None) -> LoadOutcome:
        order = self._order(stream, after)
        return self._call("load_with_sources", lambda: self.engine.load_with_sources(
            token_ids, block_ids, params, num_computed_tokens=num_computed_tokens, cache_salt=cache_salt,
            lora_name=lora_name, lora_path=lora_path, mm_items=mm_items, prompt_embeds=prompt_embeds,
            **order))

    def store(self, token_ids: Sequence[int], block_ids: Sequence[int],
              params: Mapping[str, Any] | None = None, *, num_prompt_tokens: int | None = None,
              cache_salt: str | None = None, lora_name: str | None = None, lora_path: str | None = None,
              mm_items: Sequence[tuple[str, int, int]] | None = None,
              prompt_embeds: torch.Tensor | None = None, stream: Any = None, after: Any = None) -> int:
        order = self._order(stream, after)
        return self._call("store", lambda: self.engine.store(
            token_ids, block_ids, params, num_prompt_tokens=num_prompt_tokens, cache_salt=cache_salt,
            lora_name=lora_name, lora_path=lora_path, mm_items=mm_items, prompt_embeds=prompt_embeds,
            **order))

    def cached_prefix_tokens(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                             lora_name: str | None = None, lora_path: str | None = None,
                             mm_items: Sequence[tuple[str, int, int]] | None = None,
                             prompt_embeds: torch.Tensor | None = None) -> int:
        return self._call("cached_prefix_tokens", lambda: self.engine.cached_prefix_tokens(
            token_ids, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path,
            mm_items=mm_items, prompt_embeds=prompt_embeds))

    def chunk_keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                   lora_name: str | None = None, lora_path: str | None = None,
                   mm_items: Sequence[tuple[str, int, int]] | None = None,
                   prompt_embeds: torch.Tensor | None = None) -> list[bytes]:
        """Offload keys of the complete chunks of ``token_ids`` (see :meth:`Engine.chunk_keys`)."""
        return self._call("chunk_keys", lambda: self.engine.chunk_keys(
            token_ids, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path,
            mm_items=mm_items, prompt_embeds=prompt_embeds))  # type: ignore[no-any-return]

    def reset_cache(self) -> None:
        """Drop every chunk from host memory, safely (see :meth:`Engine.reset_cache`)."""
        self._call("reset_cache", self.engine.reset_cache)

    def drain(self) -> None:
        self._call("drain", self.engine.drain)

    @property
    def metrics(self) -> Any:
        """The engine's :class:`kvtier.metrics.EngineMetrics` (``.registry`` for Prometheus).

        Collecting reads counters only, so it is safe from any thread, also after :meth:`close`
        (the final values).
        """
        return self.engine.metrics

    @property
    def metrics_server(self) -> Any:
        """The ``/metrics`` HTTP server when ``metrics=`` was given (``.host``, ``.port``), else ``None``."""
        return self.engine.metrics_server

    def statistics(self) -> dict[str, Any]:
        if self._loop_gone:  # nothing runs on the engine any more: the final counts, read here
            return self.engine.statistics()
        try:
            return self._portal.call(self.engine.statistics)  # on the loop, even while closing
        except RuntimeError:
            if not self._closed:
                raise
        while not self._loop_gone:  # the loop stopped under this call; close() is finishing
            time.sleep(0.001)
        return self.engine.statistics()

    def close(self) -> None:
        """Close the engine and stop its thread. Idempotent.

        Like leaving ``kvtier.open``: first waits up to ``flush_timeout_s`` (given to
        :func:`start_in_thread`; default 5 s, 0 = no wait) for cascades in flight, logs what is
        abandoned, then closes every component and joins the thread.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._engine_cm.__exit__(None, None, None)
        finally:
            try:
                self._portal_cm.__exit__(None, None, None)
            finally:
                self._loop_gone = True

    def __enter__(self) -> ThreadedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_layerwise(self, token_ids: Sequence[int], block_ids: Sequence[int],
                       params: Mapping[str, Any] | None = None, *, num_computed_tokens: int = 0,
                       layers_per_group: int = 1, cache_salt: str | None = None,
                       lora_name: str | None = None, lora_path: str | None = None,
                       mm_items: Sequence[tuple[str, int, int]] | None = None,
                       prompt_embeds: torch.Tensor | None = None, stream: Any = None,
                       after: Any = None) -> BlockingLayerwiseLoad:
        """Blocking :meth:`Engine.load_layerwise`: ``with engine.load_layerwise(...) as layers:``
        then ``for group in layers:``, each step blocking until that group is on the device."""
        from kvtier.engine.layerwise import BlockingLayerwiseLoad

        order = self._order(stream, after)
        load = self._call("load_layerwise", lambda: self.engine.load_layerwise(
            token_ids, block_ids, params, num_computed_tokens=num_computed_tokens,
            layers_per_group=layers_per_group, cache_salt=cache_salt, lora_name=lora_name,
            lora_path=lora_path, mm_items=mm_items, prompt_embeds=prompt_embeds, **order))
        return BlockingLayerwiseLoad(load, self._call)


def start_in_thread(
    config: Mapping[str, Any] | EngineConfig,
    geometry: KVGeometry,
    device_kv: Sequence[torch.Tensor] | torch.Tensor | None = None,
    **kwargs: Any,
) -> ThreadedEngine:
    """Start an engine on an asyncio loop in a background thread; return its blocking facade.

    ``kwargs`` are those of :func:`open` (``events``, ``metrics``, ``wait_timeout_s``,
    ``flush_timeout_s``, ...); :meth:`ThreadedEngine.close` flushes as leaving :func:`open` does.
    """
    try:
        config = EngineConfig.coerce(config)  # a bad configuration fails before a thread starts
    except ConfigError as exc:
        raise trim_traceback(exc)
    portal_cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
    portal = portal_cm.__enter__()
    try:
        engine_cm = portal.wrap_async_context_manager(open(config, geometry, device_kv, **kwargs))
        engine = engine_cm.__enter__()
    except BaseException as exc:
        portal_cm.__exit__(None, None, None)
        if isinstance(exc, ConfigError):
            raise trim_traceback(exc)  # not the portal's and the event loop's frames
        raise
    return ThreadedEngine(portal_cm, portal, engine_cm, engine)

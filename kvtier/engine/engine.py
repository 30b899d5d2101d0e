"""Embedding kvtier in a server: :func:`open` and the :class:`Engine` it yields.

``async with kvtier.open(config, geometry, device_kv) as engine`` builds the whole stack — host
tier, copy engine, secondary tiers, manager, optional event publisher and metrics server
(``kvtier.engine.build``) — and runs every component's task group *inside the caller's*
structured concurrency (asyncio or trio). Leaving the block closes everything:

* first it *flushes*: it waits, up to ``flush_timeout_s`` (default 5 s; 0 = do not wait), for
  the tier jobs in flight — the cascades of stored chunks to the secondary tiers, promotions —
  as :meth:`Engine.drain` does. The wait is not shielded: a cancelled caller does not wait.
  Jobs still unfinished then are logged (WARNING, per tier: jobs and chunks abandoned);
* then tiers are closed (all of them, even if one fails), jobs still in flight are cancelled and
  reported, threads are joined (shielded: this part always runs to the end);
* from the moment closing starts every public method raises :class:`kvtier.EngineClosedError`.

Call arguments are checked at the call, before any work is queued (``kvtier.engine.arguments``).
``kvtier.start_in_thread`` (``kvtier.engine.threaded``) runs the same engine on an event loop in
a background thread, behind a blocking, thread-safe facade.

All manager calls happen on the engine's event-loop thread, so the manager needs no lock.
Components wake the engine (``kvtier.engine.progress``) whenever a job result or lookup verdict
arrives; ``load``/``store`` wait on that signal rather than sleeping in a poll loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import anyio
import anyio.abc

from kvtier.config import EngineConfig
from kvtier.engine.arguments import count, group_ids, int_ids
from kvtier.engine.build import EngineParts
from kvtier.engine.copies import DeviceCopies
from kvtier.engine.gate import OperationGate
from kvtier.engine.groups import resolve_hit
from kvtier.engine.keying import RequestKeying, extra_keys
from kvtier.engine.layerwise import LayerwiseLoad, check_layers_per_group
from kvtier.engine.prefetch import Prefetcher, PrefetchOutcome, check_deadline, check_tiers
from kvtier.engine.progress import Progress
from kvtier.engine.staging import LoadStager
from kvtier.engine.storing import Storer
from kvtier.errors import ConfigError, trim_traceback
from kvtier.keys import BlockHasher, RequestExtraKeys
from kvtier.layout import KVGeometry
from kvtier.manager import PRIMARY_LABEL, TieringManager
from kvtier.model import KVModel
from kvtier.specs import load_spec
from kvtier.types import LookupResult

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    import torch

    from kvtier.host.copy_engine import CopyEngine
    from kvtier.host.copy_jobs import CopyOrder
    from kvtier.host.copy_plan import DeviceKV
    from kvtier.host.tier import HostTier
    from kvtier.tiers.base import SecondaryTier

#: Block ids of a call: one sequence for a one-group model, or one sequence per KV-cache group.
BlockIds = Union[Sequence[int], Sequence[Sequence[int]]]

__all__ = ["Engine", "LoadOutcome", "PrefetchOutcome", "open", "DEFAULT_WAIT_TIMEOUT_S", "DEFAULT_FLUSH_TIMEOUT_S"]

logger = logging.getLogger("kvtier.engine.engine")

#: How long ``load``/``store`` wait for promotions, probes or free host slots before giving up
#: (the request then recomputes / is not offloaded). Overridable per engine.
DEFAULT_WAIT_TIMEOUT_S = 10.0
#: How long leaving the engine waits for tier jobs in flight (cascades) before abandoning them.
DEFAULT_FLUSH_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What ``load_with_sources`` placed: new tokens, and how many came from each tier label."""

    tokens: int
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


class Engine:
    """A running kvtier stack. Obtain one from :func:`open` (or :func:`kvtier.start_in_thread`).

    Every method that keys a request (``load``, ``load_with_sources``, ``load_layerwise``,
    ``store``, ``prefetch``, ``cached_prefix_tokens``, ``chunk_keys``) also takes keyword-only *extra keys*,
    hashed into the chunk keys exactly as vLLM 0.33 does (:class:`kvtier.keys.RequestExtraKeys`):
    a call finds only chunks stored with the same values.

    * ``cache_salt``: the tenant's salt (non-empty str); isolates its chunks from every other
      salt and from unsalted requests.
    * ``lora_name`` and ``lora_path``: the LoRA adapter of the request (both or neither).
    * ``mm_items``: the multimodal inputs, ``(identifier, offset, length)`` per item
      (:class:`kvtier.keys.MultimodalItem`) in prompt order, not overlapping.
    * ``prompt_embeds``: the request's 2-D prompt-embeddings tensor, if it has one.

    Its collaborators are objects of their own, which the layer-wise load holds too: ``gate``
    (admission: closing, operations and resets), ``copies`` (device ↔ host copies), ``stager``
    (the start and end of every load) and ``keying`` (hashes, keys, request contexts).
    """

    def __init__(
        self,
        config: EngineConfig,
        geometry: KVGeometry | KVModel,
        device_kv: DeviceKV | None = None,
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
        #: The description given to :func:`open` (a :class:`KVGeometry` or a :class:`KVModel`).
        self.geometry = geometry
        #: The model's KV-cache groups (:meth:`KVModel.of` of a geometry).
        self.model = model = KVModel.of(geometry)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < model.tp_size:
            raise ConfigError(f"tp_rank must be in [0, {model.tp_size}) (the model's tp_size), got {tp_rank!r}")
        self.device_kv = device_kv
        self.tp_rank = tp_rank
        self.blocks_per_chunk = config.resolve_blocks_per_chunk(_device_block_size(model, config))
        #: Tokens per chunk of the first group (the only group of a one-group model).
        self.chunk_tokens = model.chunk_tokens(0, self.blocks_per_chunk)
        #: Bytes of one host slot: a chunk of this rank's KV (its own heads at TP > 1, see
        #: :meth:`KVModel.rank_local`), rounded up to 4096.
        self.slot_bytes = model.rank_local().slot_bytes(self.blocks_per_chunk)
        self.num_slots = config.num_slots(self.slot_bytes)
        #: Bytes of the host tier: ``cpu_bytes_to_use`` rounded down to whole slots.
        self.host_bytes = self.num_slots * self.slot_bytes
        self.wait_timeout_s = wait_timeout_s
        self.flush_timeout_s = float(flush_timeout_s)
        self.kv_events_enabled = kv_events_enabled
        #: Blocks of the device KV cache (valid block ids are ``[0, num_device_blocks)``);
        #: ``None`` without ``device_kv``.
        self.num_device_blocks: int | None = None
        self.keying = RequestKeying(BlockHasher(hash_algorithm, model.hash_block_size), model, self.blocks_per_chunk)
        self.gate = OperationGate()
        self.parts = EngineParts(
            config, self.spec, model, device_kv, blocks_per_chunk=self.blocks_per_chunk,
            slot_bytes=self.slot_bytes, num_slots=self.num_slots, tp_rank=tp_rank,
            hash_algorithm=self.keying.hasher.algorithm, kv_events_enabled=kv_events_enabled,
        )
        self.progress: Progress  # these three are set by _start, inside the event loop
        self.copies: DeviceCopies
        self.stager: LoadStager
        self.prefetcher: Prefetcher
        self.storer: Storer
        self._running = False  # every component started (the body of ``open`` was reached)
        # Why close did not finish the flush (for the abandoned-jobs warning).
        self._flush_shortfall = "the flush was not attempted"

    # ------------------------------------------------------------------ components
    @property
    def host(self) -> HostTier:
        return self.parts.host

    @property
    def tiers(self) -> list[SecondaryTier]:
        return self.parts.tiers

    @property
    def copy_engine(self) -> CopyEngine | None:
        return self.parts.copy_engine

    @property
    def manager(self) -> TieringManager:
        return self.parts.manager

    @property
    def publisher(self) -> Any:
        return self.parts.publisher

    @property
    def translator(self) -> Any:
        return self.parts.translator

    @property
    def metrics(self) -> Any:
        """The engine's :class:`kvtier.metrics.EngineMetrics` (``.registry`` for Prometheus)."""
        return self.parts.metrics

    @property
    def warmup_server(self) -> Any:
        """The warm-up endpoint (:class:`kvtier.engine.warm_server.WarmupServer`) when ``warmup=``
        was given (``.endpoint``, ``.port``, ``.statistics()``), else ``None``."""
        return self.parts.warmup_server

    @property
    def metrics_server(self) -> Any:
        """The ``/metrics`` HTTP server when ``metrics=`` was given (``.host``, ``.port``), else ``None``."""
        return self.parts.metrics_server

    async def _start(self, tg: anyio.abc.TaskGroup, events: Mapping[str, Any] | None,
                     metrics: Mapping[str, Any] | None, warmup: Mapping[str, Any] | None = None) -> None:
        self.progress = Progress(self._dispatch)
        self.copies = self.parts.copies  # no copy engine yet: counters for a failed start's close
        await self.parts.start(tg, self.progress.wake, events, metrics, warmup)
        self.copies = self.parts.copies
        self.num_device_blocks = self.copies.num_device_blocks
        self.stager = LoadStager(self.manager, self.keying, self.parts.relay, self.progress,
                                 group_blocks=self.copies.group_blocks, wait_timeout_s=self.wait_timeout_s,
                                 prefetches=self.parts.prefetches)
        self.prefetcher = Prefetcher(self.manager, self.keying, self.parts.relay, self.progress, self.parts.prefetches)
        if self.metrics is not None:
            self.metrics.add_loads(self.stager)
        self.storer = Storer(self.manager, self.keying, self.parts.relay, self.progress, self.copies, self.stager.tables,
                             offload_prompt_only=self.config.offload_prompt_only, wait_timeout_s=self.wait_timeout_s)
        tg.start_soon(self.progress.drive)
        await self.parts.serve_warmup(tg, self)
        self._running = True

    def _dispatch(self) -> None:
        """One step of progress: copy results to their waiters, the manager's jobs, events."""
        self.copies.dispatch()
        self.manager.poll()
        if self.manager.needs_step_end():  # promotions started by a peer's lookups, parked cascades
            self.manager.on_schedule_end()
        self.parts.relay.publish()

    # ------------------------------------------------------------------ public API
    def chunk_keys(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                   lora_name: str | None = None, lora_path: str | None = None,
                   mm_items: Sequence[tuple[str, int, int]] | None = None,
                   prompt_embeds: torch.Tensor | None = None, group: int = 0) -> list[bytes]:
        """Offload keys of the complete chunks of ``token_ids`` (prefix order) of KV-cache group
        ``group`` (default the first), with the extra keys."""
        self.gate.check_open("chunk_keys")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.model.groups):
            raise ValueError(f"group must be an int in [0, {len(self.model.groups)}), got {group!r}")
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return self.keying.group_keys(self.keying.hashes(int_ids(token_ids, "token_ids"), extras), group)

    def cached_prefix_tokens(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                             lora_name: str | None = None, lora_path: str | None = None,
                             mm_items: Sequence[tuple[str, int, int]] | None = None,
                             prompt_embeds: torch.Tensor | None = None) -> int:
        """Tokens of ``token_ids`` a load could place now: the hit every KV-cache group can serve
        from chunks some tier holds (``kvtier.engine.groups``). Non-blocking, no promotion.

        A tier that does not know yet counts as a miss (its probe is started, so a later call
        may answer more). Bad ``token_ids`` or extra keys raise ``TypeError``/``ValueError``
        (see :meth:`load`).
        """
        self.gate.check_open("cached_prefix_tokens")
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        hashes = self.keying.hashes(int_ids(token_ids, "token_ids"), extras)
        ctx = self.keying.context("peek")

        def peek(key: bytes) -> LookupResult:
            if self.host.lookup(key) is not LookupResult.MISS:
                return LookupResult.HIT
            held = any(t.lookup(key, ctx) is LookupResult.HIT for t in self.tiers)
            return LookupResult.HIT if held else LookupResult.MISS

        try:
            return resolve_hit(self.keying.groups(hashes), len(token_ids), 0, peek)[0]
        finally:
            for tier in self.tiers:
                tier.on_request_finished(ctx)

    async def prefetch(self, token_ids: Sequence[int], params: Mapping[str, Any] | None = None, *,
                       cache_salt: str | None = None, lora_name: str | None = None,
                       lora_path: str | None = None, mm_items: Sequence[tuple[str, int, int]] | None = None,
                       prompt_embeds: torch.Tensor | None = None, tiers: Sequence[Any] | None = None,
                       deadline_s: float | None = None, evict: bool = True) -> PrefetchOutcome:
        """Warm up: promote the prefix of ``token_ids`` held by secondary tiers into host memory,
        without device blocks, so that a later :meth:`load` of it is served from host memory.

        The prefix is looked up as :meth:`load` from token 0 looks it up — host memory, then each
        secondary tier in order — honouring ``params`` (the request's ``kv_transfer_params``:
        ``kv_load_tiers``, ``max_load_tokens``, the p2p roles) and ``tiers``, a list in
        ``kv_load_tiers``' format (tier indexes, type names or labels, ``{medium, locality}``
        matchers) intersected with it. With several KV-cache groups exactly what a load would
        need is promoted (``kvtier.engine.groups``). Promotions are shared with loads of the
        same prefix (one per chunk, whoever asks first).

        Waits for the promotions until ``deadline_s`` (default: the engine's ``wait_timeout_s``);
        chunks still arriving then keep arriving in the background. ``evict=False`` promotes only
        into free host slots; with ``evict=True`` the host tier may evict unpinned chunks (never
        one a request pins), and never more than host memory can hold beside the prefix's own
        chunks. Returns a :class:`PrefetchOutcome` (``kvtier.engine.prefetch``).

        Arguments are checked at the call: ``token_ids`` and the extra keys as for :meth:`load`,
        ``tiers`` strictly (an entry that is malformed or matches none of this engine's tiers is
        a ``TypeError``/``ValueError`` naming it), ``deadline_s`` a finite number > 0, ``evict`` a
        bool. Raises :class:`kvtier.EngineClosedError` once the engine is closing.
        """
        self.gate.check_open("prefetch")
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        token_ids = int_ids(token_ids, "token_ids")
        tier_filter = check_tiers(tiers, self.tiers)
        deadline = check_deadline(deadline_s, self.wait_timeout_s)
        if not isinstance(evict, bool):
            raise TypeError(f"evict must be a bool, got {evict!r} ({type(evict).__name__})")
        fields = self.prefetcher.request_fields(params, tier_filter)
        async with self.gate.operation():
            return await self.prefetcher.prefetch(token_ids, fields, extras, deadline, evict)

    async def load(self, token_ids: Sequence[int], block_ids: BlockIds,
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

        **Several KV-cache groups** (a :class:`kvtier.KVModel`): ``block_ids`` holds one sequence
        per group (``block_ids[g][i]``: the device block of group ``g``'s token block ``i``). The
        result is the hit every group can serve (``kvtier.engine.groups``), a multiple of every
        group's chunk tokens; full-attention and MLA groups get every chunk from
        ``num_computed_tokens`` to it, a sliding-window group only the chunks overlapping the
        window before it, a state group only the block holding the state after its last token.

        Arguments are checked before any work is queued: ``token_ids`` and ``block_ids`` are
        sequences of ints (``TypeError`` otherwise: bool, float, str, None), token ids are >= 0,
        ``num_computed_tokens`` is an int >= 0, and the block ids this call may use — those of
        the chunks from ``num_computed_tokens`` to the end of ``token_ids`` — exist, lie in
        ``[0, number of device blocks)`` and are distinct (``ValueError`` naming the id); those
        of sliding-window and state groups once the hit is known, before any copy.
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
        self.gate.check_open("load")
        order = self.copies.capture_order(stream, after)
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return (await self._checked_load(token_ids, block_ids, params, num_computed_tokens, extras,
                                         order)).tokens

    async def load_with_sources(self, token_ids: Sequence[int], block_ids: BlockIds,
                                params: Mapping[str, Any] | None = None, *,
                                num_computed_tokens: int = 0, cache_salt: str | None = None,
                                lora_name: str | None = None, lora_path: str | None = None,
                                mm_items: Sequence[tuple[str, int, int]] | None = None,
                                prompt_embeds: torch.Tensor | None = None, stream: Any = None,
                                after: Any = None) -> LoadOutcome:
        """Like :meth:`load`, also reporting how many tokens came from each tier label."""
        self.gate.check_open("load_with_sources")
        order = self.copies.capture_order(stream, after)
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        return await self._checked_load(token_ids, block_ids, params, num_computed_tokens, extras, order)

    async def _checked_load(self, token_ids: Sequence[int], block_ids: BlockIds,
                            params: Mapping[str, Any] | None, num_computed_tokens: int,
                            extras: RequestExtraKeys, order: CopyOrder | None) -> LoadOutcome:
        token_ids = int_ids(token_ids, "token_ids")
        groups = group_ids(block_ids, len(self.model.groups))
        num_computed_tokens = count(num_computed_tokens, "num_computed_tokens")
        async with self.gate.operation():
            staged = await self.stager.stage(token_ids, groups, params, num_computed_tokens, extras)
            arrived = False
            try:
                if not staged.hit_keys:
                    return LoadOutcome(0, {})
                results = await self.copies.copy_groups(
                    "to_device", [(c.group, c.slot_ids, c.block_ids) for c in staged.copies if c.slot_ids], order)
                failed = [result for result in results if not result.success]
                if failed:
                    logger.error("host→device copy failed: %s", failed[0].error)
                    return LoadOutcome(0, {})
                arrived = True
                return LoadOutcome(staged.tokens, dict(staged.tokens_by_tier))
            finally:
                self.stager.finish(staged, arrived=arrived)

    async def store(self, token_ids: Sequence[int], block_ids: BlockIds,
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

        With several KV-cache groups ``block_ids`` holds one sequence per group (as for
        :meth:`load`) and each group stores what a later load can use (``kvtier.engine.groups``):
        full-attention and MLA groups every complete chunk, a sliding-window group the chunks
        covering its window before the hits a continuation or a repeat of the prompt would
        have, a state group the states at those hits; the result counts the first group's tokens.

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
        self.gate.check_open("store")
        order = self.copies.capture_order(stream, after)
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        token_ids = int_ids(token_ids, "token_ids")
        groups = group_ids(block_ids, len(self.model.groups))
        if num_prompt_tokens is not None:
            num_prompt_tokens = count(num_prompt_tokens, "num_prompt_tokens")
        async with self.gate.operation():
            return await self.storer.store(token_ids, groups, params, num_prompt_tokens, extras, order)

    async def reset_cache(self) -> None:
        """Drop every chunk from host memory (secondary tiers keep theirs), safely.

        New loads and stores wait; the ones running finish first (so no device copy can target
        a freed slot), then every tier job in flight is drained, then the host tier is reset.
        """
        self.gate.check_open("reset_cache")
        await self.gate.exclusive(self._reset)

    async def _reset(self) -> None:
        await self._drain()
        self.manager.reset_cache()
        self.parts.prefetches.clear()
        self.manager.on_reset_flushed()
        self.parts.relay.publish_cleared()

    async def drain(self) -> None:
        """Start the write-back of every chunk a ``write_back`` tier has not received yet, then
        wait until every job in flight (cascades and write-backs included) has been reported."""
        self.gate.check_open("drain")
        await self._drain()

    async def _drain(self) -> None:
        self.manager.flush_write_back()  # close, drain and reset lose no chunk a write-back tier waits for
        self.manager.on_schedule_end()
        while True:
            since = self.progress.mark()
            # Collect what arrived first: a result the drive task took after our last wake-up woke
            # nobody, and waiting for the next wake-up would then sleep the whole second.
            self._dispatch()
            if not self.manager.jobs_in_flight:
                return
            await self.progress.wait(anyio.current_time() + 1.0, since)

    def statistics(self) -> dict[str, Any]:
        """Snapshots of every component, keyed by tier label (also after close: the final counts)."""
        stats: dict[str, Any] = {PRIMARY_LABEL: self.host.statistics(), "manager": self.manager.statistics(),
                                 "copies": self.copies.statistics(), "loads": self.stager.statistics()}
        for tier in self.tiers:
            stats[tier.context.label] = tier.statistics()
        return stats

    def load_layerwise(self, token_ids: Sequence[int], block_ids: BlockIds,
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
        ``layers_per_group`` layers once its bytes are ready for the caller's next device work
        (copied; with CUDA, issued with the caller's stream waiting for them), in layer order. A
        failed copy raises :class:`kvtier.engine.layerwise.LayerwiseLoadError` from the iteration: recompute
        the whole prefix. Leaving the block waits for the copies in flight, then unpins.

        Arguments are checked at the call as for :meth:`load` (the block ids on entering), the
        extra keys included (see :class:`Engine`: only chunks stored with the same ones are
        found); ``layers_per_group`` is an int >= 1; an engine opened without ``device_kv``
        raises ``RuntimeError``; a closing engine :class:`kvtier.EngineClosedError`.
        ``stream``/``after`` order the copies as for :meth:`load`, captured at this call; each
        group's copy is handed over to ``stream`` as the group is yielded.
        """
        self.gate.check_open("load_layerwise")
        extras = extra_keys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)
        token_ids = int_ids(token_ids, "token_ids")
        groups = group_ids(block_ids, len(self.model.groups))
        num_computed_tokens = count(num_computed_tokens, "num_computed_tokens")
        layers_per_group = check_layers_per_group(layers_per_group)
        if self.copy_engine is None:
            raise RuntimeError("this engine was opened without device_kv; it cannot load KV layer-wise")
        order = self.copies.capture_order(stream, after)
        return LayerwiseLoad(self.gate, self.stager, self.copies, token_ids, groups, params, extras,
                             model=self.model, num_computed_tokens=num_computed_tokens,
                             layers_per_group=layers_per_group, order=order)

    # ------------------------------------------------------------------ shutdown
    async def _flush(self) -> None:
        """First step of close: wait up to ``flush_timeout_s`` for the tier jobs in flight.

        Not shielded: if the caller's scope is cancelled the wait ends at once (and the jobs are
        abandoned by :meth:`_aclose`, which logs them). Public methods refuse from here on.
        """
        self.gate.closing = True
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
        for label, dirty in self.manager.dirty_chunks_by_tier().items():
            if dirty:
                logger.warning("closing the kvtier engine (%s): %d chunks in host memory were never written to "
                               "write-back tier %s", self._flush_shortfall or "flushed", dirty, label)

    async def _aclose(self) -> None:
        """Close every component; all are attempted, the first error is re-raised."""
        self.gate.closing = True
        if self.gate.closed:
            return
        self.gate.closed = True
        if self._running:
            try:
                self._log_abandoned()
            except Exception:  # noqa: BLE001 - a report must never keep a component open
                logger.exception("counting the tier jobs abandoned at close failed")
        await self.parts.aclose()


@contextlib.asynccontextmanager
async def open(  # noqa: A001 - the public name is kvtier.open
    config: Mapping[str, Any] | EngineConfig,
    geometry: KVGeometry | KVModel,
    device_kv: DeviceKV | None = None,
    *,
    events: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    warmup: Mapping[str, Any] | None = None,
    tp_rank: int = 0,
    hash_algorithm: str = "sha256",
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
) -> AsyncIterator[Engine]:
    """Run a kvtier engine inside the caller's structured concurrency.

    ``config`` is the ``kv_connector_extra_config`` dictionary (or an ``EngineConfig``);
    ``events`` enables KV events and configures the ZMQ publisher; ``metrics={"port": P,
    "host": H}`` serves ``/metrics`` (the registry is ``engine.metrics.registry`` either way);
    ``warmup={"port": P, ...}`` serves the warm-up endpoint a router calls to prefetch a prefix
    (``docs/embedding.md``, "Warm-up endpoint"; ``engine.warmup_server``).
    ``tp_rank`` is this process's rank among the model's ``tp_size`` (``device_kv`` then holds its
    ``num_kv_heads // tp_size`` heads): a rank's host slots hold its own heads only, and at
    ``tp_size > 1`` its chunks go to a tree of its own (``docs/embedding.md``, "Tensor parallelism").
    Raises :class:`kvtier.ConfigError` for a bad configuration, an unusable tier, a host buffer
    the machine cannot allocate, an events endpoint, metrics port or warm-up endpoint that cannot
    be bound (all before yielding).

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
                await engine._start(tg, events, metrics, warmup)
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


def _device_block_size(model: KVModel, config: EngineConfig) -> int:
    """The device block size the ``block_size`` key is a multiple of: every group must share it
    (with ``blocks_per_chunk`` groups may differ)."""
    sizes = sorted({group.block_size for group in model.groups})
    if len(sizes) > 1 and config.block_size is not None:
        raise ConfigError(
            f"block_size: {config.block_size!r} needs every KV-cache group to share one block size, the "
            f"model's groups have {sizes}; set blocks_per_chunk instead"
        )
    return sizes[0]


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

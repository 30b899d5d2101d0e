"""Staging a load: everything before its host→device copy, and its end.

``Engine.load`` and the layer-wise load both start with :meth:`LoadStager.stage` and end with
:meth:`LoadStager.finish`; only their copies differ.

Semantics callers rely on:

* Staging keys ``token_ids`` with the request's extra keys, starts the request, takes the chunks
  from chunk ``num_computed_tokens // chunk_tokens`` on (capped by ``max_load_tokens``), checks
  the block ids they would use, resolves the prefix held in host memory — promotions and probes
  of secondary tiers are awaited up to ``wait_timeout_s``; the prefix ends at the first miss, or
  at a chunk still pending when the time is up — records its chunks for self-describing events
  and pins its host slots.
* The caller owns the :class:`StagedLoad` and hands it to :meth:`LoadStager.finish` exactly
  once, whatever happened to its copy. If staging raises (bad block ids, cancellation), it has
  finished the request itself and nothing stays pinned.
* Finishing unpins, counts the chunks as used (recency) only if every byte reached the device,
  finishes the request and publishes its events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.context import RequestContext
from kvtier.engine.arguments import check_block_ids
from kvtier.types import LookupResult

if TYPE_CHECKING:
    from kvtier.engine.event_relay import EventRelay
    from kvtier.engine.keying import RequestKeying
    from kvtier.engine.progress import Progress
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager

__all__ = ["StagedLoad", "LoadStager"]


@dataclass(slots=True)
class StagedLoad:
    """A load staged up to its host→device copy.

    ``hit_keys`` — the prefix to place, from chunk ``num_computed_tokens // chunk_tokens`` on —
    are pinned in host memory (``slot_ids``, co-indexed) until :meth:`LoadStager.finish`;
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


class LoadStager:
    """Stages and finishes the loads of one engine (module docstring); loop thread only."""

    def __init__(self, manager: TieringManager, keying: RequestKeying, relay: EventRelay,
                 progress: Progress, *, num_device_blocks: int | None, wait_timeout_s: float) -> None:
        self.manager = manager
        self.keying = keying
        self.relay = relay
        self.progress = progress
        self.num_device_blocks = num_device_blocks
        self.wait_timeout_s = wait_timeout_s

    async def stage(self, token_ids: Sequence[int], block_ids: Sequence[int], params: Mapping[str, Any] | None,
                    num_computed_tokens: int, extras: RequestExtraKeys) -> StagedLoad:
        """Everything a load does before its copy (module docstring); hand the result to :meth:`finish`."""
        hashes, keys = self.keying.hashes_and_keys(token_ids, extras)
        chunk_tokens = self.keying.chunk_tokens
        first = num_computed_tokens // chunk_tokens
        ctx = self.keying.context("load", params, keys[first:], first)
        self.manager.on_new_request(ctx)
        staged = StagedLoad(ctx)
        try:
            candidates = keys[first:]
            limit = ctx.params.max_load_tokens
            if limit is not None:
                candidates = candidates[: limit // chunk_tokens]
            bpc = self.keying.blocks_per_chunk
            check_block_ids(block_ids, first * bpc, (first + len(candidates)) * bpc, self.num_device_blocks)
            hit_keys = await self.resolve_prefix(candidates, ctx)
            if not hit_keys:
                return staged
            self.relay.remember_chunks(token_ids, hashes, hit_keys, extras, first)
            staged.slot_ids = self.manager.prepare_load(hit_keys, ctx)
            staged.hit_keys = hit_keys
            staged.block_ids = list(block_ids[first * bpc : (first + len(hit_keys)) * bpc])
            # Count only tokens beyond what the caller already had: the first chunk may start
            # before num_computed_tokens when that is not chunk-aligned.
            for i, key in enumerate(hit_keys, start=first):
                new_tokens = (i + 1) * chunk_tokens - max(i * chunk_tokens, num_computed_tokens)
                if new_tokens > 0:
                    label = self.manager.get_load_source(key, ctx)
                    staged.tokens_by_tier[label] = staged.tokens_by_tier.get(label, 0) + new_tokens
        except BaseException:
            self.finish(staged, arrived=False)
            raise
        return staged

    def finish(self, staged: StagedLoad, *, arrived: bool) -> None:
        """End a staged load: unpin its chunks, count them as used (recency) only if ``arrived``
        (every byte reached the device), finish the request and publish its events."""
        try:
            if staged.hit_keys:
                self.manager.complete_load(staged.hit_keys, staged.ctx)
                if arrived:
                    self.manager.touch(staged.hit_keys, staged.ctx)
        finally:
            self.manager.on_request_finished(staged.ctx)
            self.relay.publish()

    async def resolve_prefix(self, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
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
            if not await self.progress.wait(deadline):
                # Give up on what is still pending; a later request will find it.
                self.manager.on_schedule_end()
                return list(keys[:prefix])
            self.progress.step()

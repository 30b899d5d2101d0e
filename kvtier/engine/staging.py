"""Staging a load: everything before its host→device copy, and its end.

``Engine.load`` and the layer-wise load both start with :meth:`LoadStager.stage` and end with
:meth:`LoadStager.finish`; only their copies differ.

Semantics callers rely on:

* Staging keys ``token_ids`` with the request's extra keys, starts the request, finds the hit
  every KV-cache group can serve from ``num_computed_tokens`` on (capped by ``max_load_tokens``;
  ``kvtier.engine.groups``) — promotions and probes of secondary tiers are awaited up to
  ``wait_timeout_s``, then a chunk still pending counts as missing — checks the block ids the
  hit uses (those of prefix groups before any lookup), records its chunks for self-describing
  events and pins the host slots of exactly the chunks each group needs.
* The caller owns the :class:`StagedLoad` and hands it to :meth:`LoadStager.finish` exactly
  once, whatever happened to its copy. If staging raises (bad block ids, cancellation), it has
  finished the request itself and nothing stays pinned.
* Finishing unpins, counts the chunks as used (recency) only if every byte reached the device
  (and then tells the prefetch tracker which chunks were loaded), finishes the request and
  publishes its events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.context import RequestContext
from kvtier.engine.groups import BlockTables, GroupKeys, load_chunks, resolve_hit
from kvtier.types import LookupResult

if TYPE_CHECKING:
    from kvtier.engine.event_relay import EventRelay
    from kvtier.engine.keying import RequestKeying
    from kvtier.engine.prefetch_tracker import PrefetchTracker
    from kvtier.engine.progress import Progress
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager

__all__ = ["GroupCopy", "LoadStatistics", "StagedLoad", "LoadStager"]


@dataclass(frozen=True, slots=True)
class LoadStatistics:
    """What the loads of one engine waited for: ``wait_timeouts`` counts those whose promotions
    or probes were still pending at ``wait_timeout_s`` (the prefix then ended there)."""

    wait_timeouts: int


@dataclass(frozen=True, slots=True)
class GroupCopy:
    """The part of a staged load one KV-cache group copies: host slots and device blocks."""

    group: int
    slot_ids: list[int]
    block_ids: list[int]


@dataclass(slots=True)
class StagedLoad:
    """A load staged up to its host→device copies.

    ``hit_keys`` — the chunks to place, of every group (``kvtier.engine.groups``) — are pinned in
    host memory until :meth:`LoadStager.finish`; ``copies`` say, per group, which slots go to
    which device blocks. ``tokens_by_tier`` counts, per tier label, the tokens beyond
    ``num_computed_tokens`` the hit adds, attributed to the tier of the chunk holding each of them
    (the first group's chunks that cover it). Empty lists: a miss, nothing pinned.
    """

    ctx: RequestContext
    hit_keys: list[bytes] = field(default_factory=list)
    copies: list[GroupCopy] = field(default_factory=list)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """New tokens on the device once every chunk arrived (what ``load`` returns)."""
        return sum(self.tokens_by_tier.values())


class LoadStager:
    """Stages and finishes the loads of one engine (module docstring); loop thread only."""

    def __init__(self, manager: TieringManager, keying: RequestKeying, relay: EventRelay,
                 progress: Progress, *, group_blocks: Sequence[int] | None, wait_timeout_s: float,
                 prefetches: PrefetchTracker | None = None) -> None:
        self.manager = manager
        self.prefetches = prefetches
        self.keying = keying
        self.relay = relay
        self.progress = progress
        #: Where each group's chunks sit in a request's block tables (checked before copies).
        self.tables = BlockTables(keying.model, keying.blocks_per_chunk, group_blocks)
        self.wait_timeout_s = wait_timeout_s
        self._wait_timeouts = 0

    async def stage(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]],
                    params: Mapping[str, Any] | None, num_computed_tokens: int,
                    extras: RequestExtraKeys) -> StagedLoad:
        """Everything a load does before its copy (module docstring); hand the result to :meth:`finish`.

        ``block_ids`` holds one sequence per group (``block_ids[g][i]``: the device block of
        group ``g``'s token block ``i``).
        """
        keying = self.keying
        hashes = keying.hashes(token_ids, extras)
        groups = keying.groups(hashes)
        computed = num_computed_tokens
        ctx = keying.context("load", params)
        for group in groups:
            first = computed // group.chunk_tokens
            keying.place(ctx, group.keys[first:], first, group.index)
        self.manager.on_new_request(ctx)
        staged = StagedLoad(ctx)
        try:
            bound = len(token_ids)
            limit = ctx.params.max_load_tokens
            if limit is not None:
                bound = min(bound, computed + limit)
            # The blocks of every group that any hit up to ``bound`` could write, checked before
            # any lookup (a sliding window's and a state's only once the hit is known, below).
            for group in groups:
                if group.group.loads_prefix:
                    self.tables.check(block_ids, group.index, load_chunks(group.group, group.chunk_tokens, bound, computed))
            hit = await self.resolve(groups, bound, computed, ctx)
            if hit <= computed:
                return staged
            chunks = {g.index: load_chunks(g.group, g.chunk_tokens, hit, computed) for g in groups}
            for group in groups:
                self.tables.check(block_ids, group.index, chunks[group.index])
            for group in groups:
                span = chunks[group.index]
                self.relay.remember_chunks(token_ids, hashes, group.keys[span.start : span.stop], extras,
                                           span.start, group.index)
            keys = [group.keys[i] for group in groups for i in chunks[group.index]]
            slots = self.manager.prepare_load(keys, ctx)
            staged.hit_keys = keys
            at = 0
            for group in groups:
                span = chunks[group.index]
                blocks: list[int] = []
                for i in span:
                    blocks.extend(self.tables.chunk_blocks(block_ids[group.index], group.index, i))
                staged.copies.append(GroupCopy(group.index, list(slots[at : at + len(span)]), blocks))
                at += len(span)
            self._count_sources(staged, next(g for g in groups if g.index == 0), chunks[0], computed, hit)
        except BaseException:
            self.finish(staged, arrived=False)
            raise
        staged.copies.sort(key=lambda c: c.group)
        return staged

    def _count_sources(self, staged: StagedLoad, group: GroupKeys, chunks: range, computed: int,
                       hit: int) -> None:
        """Attribute the new tokens to tiers by the chunks of group 0 that hold them (a state
        group's single chunk holds them all)."""
        size = group.chunk_tokens
        if group.group.kind == "mamba" or group.group.kind == "sliding_window":
            label = self.manager.get_load_source(group.keys[hit // size - 1], staged.ctx)
            staged.tokens_by_tier[label] = hit - computed
            return
        for i in chunks:
            new_tokens = (i + 1) * size - max(i * size, computed)
            if new_tokens > 0:
                label = self.manager.get_load_source(group.keys[i], staged.ctx)
                staged.tokens_by_tier[label] = staged.tokens_by_tier.get(label, 0) + new_tokens

    def statistics(self) -> LoadStatistics:
        return LoadStatistics(self._wait_timeouts)

    def finish(self, staged: StagedLoad, *, arrived: bool) -> None:
        """End a staged load: unpin its chunks, count them as used (recency) only if ``arrived``
        (every byte reached the device), finish the request and publish its events."""
        try:
            if staged.hit_keys:
                self.manager.complete_load(staged.hit_keys, staged.ctx)
                if arrived:
                    self.manager.touch(staged.hit_keys, staged.ctx)
                    if self.prefetches is not None:
                        self.prefetches.on_loaded(staged.hit_keys)
                self.progress.wake()  # the slots are evictable again: a store may wait for room
        finally:
            self.manager.on_request_finished(staged.ctx)
            self.relay.publish()

    async def resolve(self, groups: Sequence[GroupKeys], bound: int, computed: int, ctx: RequestContext) -> int:
        """The hit every group serves (:func:`kvtier.engine.groups.resolve_hit`), awaiting
        promotions and probes up to ``wait_timeout_s``; then a pending chunk counts as missing."""
        deadline = anyio.current_time() + self.wait_timeout_s
        while True:
            since = self.progress.mark()  # before the lookups: their promotions may finish at once
            hit, waiting = resolve_hit(groups, bound, computed, lambda key: self.manager.lookup(key, ctx))
            if not waiting:
                return hit
            self.manager.on_schedule_end()
            if not await self.progress.wait(deadline, since):
                # Give up on what is still pending; a later request will find it.
                self._wait_timeouts += 1
                self.manager.on_schedule_end()
                return resolve_hit(groups, bound, computed, lambda key: _held_now(self.manager.lookup(key, ctx)))[0]
            self.progress.step()


def _held_now(verdict: LookupResult) -> LookupResult:
    """A verdict with everything still pending counted as a miss."""
    return verdict if verdict is LookupResult.HIT else LookupResult.MISS

"""Storing a request's chunks: what each KV-cache group offloads, its host slots, its copies.

``Engine.store`` hands its checked arguments to :meth:`Storer.store`.

Semantics callers rely on:

* The chunks stored are those a later load can use (``kvtier.engine.groups.store_chunks``), of the
  first ``limit`` tokens: ``token_ids``, capped by ``max_offload_tokens`` and, with
  ``offload_prompt_only``, by ``num_prompt_tokens``. Their device blocks are checked before any
  host slot is taken (``ValueError``).
* Host slots for every group are taken in one ``prepare_store``; when host memory has no room the
  store waits for progress up to ``wait_timeout_s``, then stores nothing (0, logged).
* One device→host copy per group, all submitted at once and awaited shielded; the chunks become
  loadable (and cascade) only if every copy succeeded. The result counts the first group's new
  tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from kvtier.engine.groups import store_chunks

if TYPE_CHECKING:
    from kvtier.engine.copies import DeviceCopies
    from kvtier.engine.event_relay import EventRelay
    from kvtier.engine.groups import BlockTables
    from kvtier.engine.keying import RequestKeying
    from kvtier.engine.progress import Progress
    from kvtier.host.copy_jobs import CopyOrder
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager

__all__ = ["Storer"]

logger = logging.getLogger("kvtier.engine.storing")


class Storer:
    """Runs the stores of one engine (module docstring); loop thread only."""

    def __init__(self, manager: TieringManager, keying: RequestKeying, relay: EventRelay, progress: Progress,
                 copies: DeviceCopies, tables: BlockTables, *, offload_prompt_only: bool,
                 wait_timeout_s: float) -> None:
        self.manager = manager
        self.keying = keying
        self.relay = relay
        self.progress = progress
        self.copies = copies
        self.tables = tables
        self.offload_prompt_only = offload_prompt_only
        self.wait_timeout_s = wait_timeout_s

    async def store(self, token_ids: Sequence[int], block_ids: Sequence[Sequence[int]],
                     params: Mapping[str, Any] | None, num_prompt_tokens: int | None,
                     extras: RequestExtraKeys, order: CopyOrder | None) -> int:
        keying = self.keying
        hashes = keying.hashes(token_ids, extras)
        ctx = keying.context("store", params)
        limit = len(token_ids)
        cap = ctx.params.max_offload_tokens
        if cap is not None:
            limit = min(limit, cap)
        if self.offload_prompt_only and num_prompt_tokens is not None:
            limit = min(limit, num_prompt_tokens)
        # Per group, the chunks a later load can use (kvtier.engine.groups), and where they are.
        where: dict[bytes, tuple[int, int]] = {}
        keys: list[bytes] = []
        for g, group in enumerate(self.keying.model.groups):
            group_keys = keying.group_keys(hashes, g)
            for i in store_chunks(group, keying.group_chunk_tokens[g], limit, keying.hit_alignment):
                keying.place(ctx, group_keys[i : i + 1], i, g)
                where[group_keys[i]] = (g, i)
                keys.append(group_keys[i])
        self.manager.on_new_request(ctx)
        try:
            if not keys:
                return 0
            for g in range(len(self.keying.model.groups)):
                self.tables.check(block_ids, g, [i for kg, i in where.values() if kg == g])
            deadline = anyio.current_time() + self.wait_timeout_s
            while True:
                since = self.progress.mark()  # before: the write-backs it starts may finish at once
                if (out := self.manager.prepare_store(keys, ctx)) is not None:
                    break
                if not await self.progress.wait(deadline, since):
                    logger.warning("no host slot became free within %.1fs; %d chunks not offloaded",
                                   self.wait_timeout_s, len(keys))
                    return 0
                self.progress.step()
            if not out.keys_to_store:
                return 0
            for g in range(len(self.keying.model.groups)):
                stored = [where[key][1] for key in out.keys_to_store if where[key][0] == g]
                if stored:
                    self.relay.remember_chunks(token_ids, hashes, [keying.group_keys(hashes, g)[i] for i in stored],
                                                     extras, stored[0], g)
            jobs: dict[int, tuple[list[int], list[int]]] = {}
            for key, slot in zip(out.keys_to_store, out.slot_ids):
                g, i = where[key]
                slots, blocks = jobs.setdefault(g, ([], []))
                slots.append(slot)
                blocks.extend(self.tables.chunk_blocks(block_ids[g], g, i))
            success = False
            try:
                results = await self.copies.copy_groups(
                    "to_host", [(g, slots, blocks) for g, (slots, blocks) in sorted(jobs.items())], order)
                success = all(result.success for result in results)
                for result in results:
                    if not result.success:
                        logger.error("device→host copy failed: %s", result.error)
            finally:
                self.manager.complete_store(out.keys_to_store, ctx, success)
                # Its chunks are loadable (or their slots free) now: wake whoever waits on them.
                self.progress.wake()
            if not success:
                return 0
            first = [where[key][1] for key in out.keys_to_store if where[key][0] == 0]
            return len(first) * keying.chunk_tokens
        finally:
            self.manager.on_request_finished(ctx)
            self.relay.publish()

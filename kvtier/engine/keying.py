"""How the engine keys a request: block hashes, chunk keys and the request's context.

Semantics callers rely on:

* A chunk's key is that of its last block (:func:`kvtier.keys.chunk_keys`); block hashes are
  chained from the start of ``token_ids`` and take the request's extra keys
  (:class:`kvtier.keys.RequestExtraKeys`), so a call finds only chunks stored with the same ones.
* The public engine methods take the extra keys as keyword arguments and turn them into one
  :class:`kvtier.keys.RequestExtraKeys` with :func:`extra_keys` (validated there); everything
  below them carries that one value.
* Every request the engine starts gets a context named ``<kind>-<n>`` (one counter for all
  kinds) whose offload keys know their token positions, which cache policies order by.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.context import RequestContext
from kvtier.engine.groups import GroupKeys, hit_alignment, scan_order
from kvtier.keys import NO_EXTRA_KEYS, BlockHasher, RequestExtraKeys, chunk_keys

if TYPE_CHECKING:
    import torch

    from kvtier.model import KVModel

__all__ = ["RequestKeying", "extra_keys"]


def extra_keys(cache_salt: str | None, lora_name: str | None, lora_path: str | None,
               mm_items: Sequence[tuple[str, int, int]] | None,
               prompt_embeds: torch.Tensor | None) -> RequestExtraKeys:
    """The extra keys of one call (validated: ``TypeError``/``ValueError`` at the call).

    A plain request (all ``None``) shares one empty value.
    """
    if cache_salt is None and lora_name is None and lora_path is None and mm_items is None \
            and prompt_embeds is None:
        return NO_EXTRA_KEYS
    return RequestExtraKeys(cache_salt, lora_name, lora_path, mm_items, prompt_embeds)


class RequestKeying:
    """Block hashes and per-group chunk keys of ``token_ids``, and request contexts, for one engine.

    Hashes are chained over ``model.hash_block_size`` tokens (the hasher's block size); chunk
    ``i`` of group ``g`` covers ``chunk_tokens[g]`` tokens and is keyed by the hash ending at its
    last token, followed by ``g`` (:mod:`kvtier.model`).
    """

    def __init__(self, hasher: BlockHasher, model: KVModel, blocks_per_chunk: int) -> None:
        if hasher.block_size != model.hash_block_size:
            raise ValueError(f"the hasher hashes {hasher.block_size} tokens a block, the model "
                             f"{model.hash_block_size}")
        self.hasher = hasher
        self.model = model
        self.blocks_per_chunk = blocks_per_chunk
        #: Tokens per chunk of each group.
        self.group_chunk_tokens = tuple(model.chunk_tokens(g, blocks_per_chunk) for g in range(len(model.groups)))
        #: Tokens per chunk of group 0 (the only group of a one-group model).
        self.chunk_tokens = self.group_chunk_tokens[0]
        #: Every hit is a multiple of this many tokens (``kvtier.engine.groups.hit_alignment``).
        self.hit_alignment = hit_alignment(self.group_chunk_tokens)
        self._hashes_per_chunk = tuple(t // hasher.block_size for t in self.group_chunk_tokens)
        self._scan_order = scan_order(model)
        self._req_ids = itertools.count()

    def hashes(self, token_ids: Sequence[int], extras: RequestExtraKeys) -> list[bytes]:
        """Chained block hashes of the complete hash blocks of ``token_ids``, keyed with ``extras``."""
        bs = self.hasher.block_size
        return self.hasher.hash_blocks(token_ids, extras.per_block(len(token_ids) // bs, bs))

    def group_keys(self, hashes: Sequence[bytes], group: int) -> list[bytes]:
        """Offload keys of the complete chunks of group ``group`` covered by ``hashes``."""
        return chunk_keys(hashes, self._hashes_per_chunk[group], group)

    def groups(self, hashes: Sequence[bytes]) -> list[GroupKeys]:
        """Every group's chunk keys for ``hashes``, in the order hits are resolved (``kvtier.engine.groups``)."""
        return [GroupKeys(g, self.model.groups[g], self.group_chunk_tokens[g], self.group_keys(hashes, g))
                for g in self._scan_order]

    def hashes_and_keys(self, token_ids: Sequence[int],
                        extras: RequestExtraKeys) -> tuple[list[bytes], list[bytes]]:
        """Block hashes of ``token_ids`` keyed with ``extras``, and group 0's chunk keys."""
        hashes = self.hashes(token_ids, extras)
        return hashes, self.group_keys(hashes, 0)

    def context(self, kind: str, params: Mapping[str, Any] | None = None, keys: Sequence[bytes] = (),
                first_chunk: int = 0, group: int = 0) -> RequestContext:
        """A new request context; ``keys`` are consecutive chunks of ``group`` from chunk ``first_chunk`` on."""
        ctx = RequestContext(f"{kind}-{next(self._req_ids)}", params)
        self.place(ctx, keys, first_chunk, group)
        return ctx

    def place(self, ctx: RequestContext, keys: Sequence[bytes], first_chunk: int = 0, group: int = 0) -> None:
        """Record the token position (end) of consecutive chunks of ``group`` from ``first_chunk`` on."""
        tokens = self.group_chunk_tokens[group]
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (first_chunk + i + 1) * tokens)

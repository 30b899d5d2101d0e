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
from kvtier.keys import NO_EXTRA_KEYS, BlockHasher, RequestExtraKeys, chunk_keys

if TYPE_CHECKING:
    import torch

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
    """Block hashes and chunk keys of ``token_ids``, and request contexts, for one engine."""

    def __init__(self, hasher: BlockHasher, blocks_per_chunk: int) -> None:
        self.hasher = hasher
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = hasher.block_size * blocks_per_chunk
        self._req_ids = itertools.count()

    def hashes_and_keys(self, token_ids: Sequence[int],
                        extras: RequestExtraKeys) -> tuple[list[bytes], list[bytes]]:
        """Block hashes of ``token_ids`` keyed with ``extras``, and the chunks' offload keys."""
        bs = self.hasher.block_size
        hashes = self.hasher.hash_blocks(token_ids, extras.per_block(len(token_ids) // bs, bs))
        return hashes, chunk_keys(hashes, self.blocks_per_chunk)

    def context(self, kind: str, params: Mapping[str, Any] | None = None, keys: Sequence[bytes] = (),
                first_chunk: int = 0) -> RequestContext:
        """A new request context; ``keys`` are consecutive chunks from chunk ``first_chunk`` on."""
        ctx = RequestContext(f"{kind}-{next(self._req_ids)}", params)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (first_chunk + i + 1) * self.chunk_tokens)
        return ctx

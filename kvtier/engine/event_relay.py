"""What an engine tells its KV-event publisher.

Semantics callers rely on:

* :meth:`EventRelay.publish` takes the manager's events after every step and every request,
  also without a publisher (they would pile up otherwise), and publishes them when there is one.
  It also hands them to the prefetch tracker, if any (``kvtier.engine.prefetch_tracker``): the
  host tier's removals are how it learns that a prefetched chunk left host memory unused.
* Self-describing events say, per chunk, which blocks, tokens and extra keys it holds: the
  engine tells the relay (:meth:`EventRelay.remember_chunks`) before a chunk can appear in an
  event. Without a publisher, or without ``self_describing_kv_events``, that is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.engine.prefetch_tracker import PrefetchTracker
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager
    from kvtier.model import KVModel

__all__ = ["EventRelay"]


class EventRelay:
    """The manager's events to the publisher (``None``: events are off) through the translator."""

    def __init__(self, manager: TieringManager, publisher: Any, translator: Any, *,
                 self_describing: bool, model: KVModel, blocks_per_chunk: int,
                 prefetches: PrefetchTracker | None = None) -> None:
        self.manager = manager
        self.prefetches = prefetches
        self.publisher = publisher
        self.translator = translator
        self._self_describing = self_describing
        self._model = model
        self._blocks_per_chunk = blocks_per_chunk

    def publish(self) -> None:
        events = self.manager.take_events()
        if self.prefetches is not None:
            self.prefetches.after_step(events)
        if self.publisher is None or not events:
            return
        self.publisher.publish(self.translator.translate(events))

    def publish_cleared(self) -> None:
        """Tell subscribers every chunk left host memory (after a reset)."""
        if self.publisher is not None:
            self.publisher.publish(self.translator.cleared())

    def remember_chunks(self, token_ids: Sequence[int], hashes: Sequence[bytes], keys: Sequence[bytes],
                        extras: RequestExtraKeys, first_chunk: int = 0, group: int = 0) -> None:
        """Give the event translator what self-describing events say about these chunks.

        ``keys`` are consecutive chunks of KV-cache group ``group`` from chunk ``first_chunk`` on;
        ``hashes`` are the request's block hashes (of ``hash_block_size`` tokens). A chunk's
        blocks are the group's (its ``block_size``), each named by the hash ending at its last
        token; each block carries the extra keys of that hash block (``None`` for a plain
        request), published untagged, as vLLM does. Only full-attention chunks are described:
        the others keep placeholder events (their keys alone), as in vLLM.
        """
        if self.translator is None or not self._self_describing or not keys:
            return
        spec = self._model.groups[group]
        if spec.kind != "full_attention":
            return
        from kvtier.events import ChunkMetadata  # loaded with the publisher, only when events are on

        bpc, block_size = self._blocks_per_chunk, spec.block_size
        step = block_size // self._model.hash_block_size  # hash blocks per group block
        tokens = bpc * block_size
        # Only the hash blocks up to the last chunk remembered (prompt-embeds digests cost a hash).
        per_hash = extras.per_block((first_chunk + len(keys)) * bpc * step, self._model.hash_block_size)
        for i, key in enumerate(keys, start=first_chunk):
            ends = [(i * bpc + b + 1) * step - 1 for b in range(bpc)]  # each block's last hash
            self.translator.remember_chunk(key, ChunkMetadata(
                block_hashes=[hashes[e] for e in ends],
                parent_block_hash=hashes[i * bpc * step - 1] if i else None,
                token_ids=token_ids[i * tokens : (i + 1) * tokens],
                block_size=block_size,
                lora_name=extras.lora_name,
                group_idx=group,
                extra_keys=None if per_hash is None else [per_hash[e] for e in ends],
            ))

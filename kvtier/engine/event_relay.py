"""What an engine tells its KV-event publisher.

Semantics callers rely on:

* :meth:`EventRelay.publish` takes the manager's events after every step and every request,
  also without a publisher (they would pile up otherwise), and publishes them when there is one.
* Self-describing events say, per chunk, which blocks, tokens and extra keys it holds: the
  engine tells the relay (:meth:`EventRelay.remember_chunks`) before a chunk can appear in an
  event. Without a publisher, or without ``self_describing_kv_events``, that is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.keys import RequestExtraKeys
    from kvtier.manager import TieringManager

__all__ = ["EventRelay"]


class EventRelay:
    """The manager's events to the publisher (``None``: events are off) through the translator."""

    def __init__(self, manager: TieringManager, publisher: Any, translator: Any, *,
                 self_describing: bool, block_size: int, blocks_per_chunk: int) -> None:
        self.manager = manager
        self.publisher = publisher
        self.translator = translator
        self._self_describing = self_describing
        self._block_size = block_size
        self._blocks_per_chunk = blocks_per_chunk

    def publish(self) -> None:
        events = self.manager.take_events()
        if self.publisher is None or not events:
            return
        self.publisher.publish(self.translator.translate(events))

    def publish_cleared(self) -> None:
        """Tell subscribers every chunk left host memory (after a reset)."""
        if self.publisher is not None:
            self.publisher.publish(self.translator.cleared())

    def remember_chunks(self, token_ids: Sequence[int], hashes: Sequence[bytes], keys: Sequence[bytes],
                        extras: RequestExtraKeys, first_chunk: int = 0) -> None:
        """Give the event translator what self-describing events say about these chunks.

        ``keys`` are consecutive chunks from chunk ``first_chunk`` on. Each chunk's metadata
        carries its blocks' slice of ``extras.per_block`` (``None`` for a plain request), which
        the translator publishes untagged, as vLLM does.
        """
        if self.translator is None or not self._self_describing or not keys:
            return
        from kvtier.events import ChunkMetadata  # loaded with the publisher, only when events are on

        bpc, block_size = self._blocks_per_chunk, self._block_size
        tokens = bpc * block_size
        # Only the blocks up to the last chunk remembered (prompt-embeds digests cost a hash).
        per_block = extras.per_block((first_chunk + len(keys)) * bpc, block_size)
        for i, key in enumerate(keys, start=first_chunk):
            self.translator.remember_chunk(key, ChunkMetadata(
                block_hashes=hashes[i * bpc : (i + 1) * bpc],
                parent_block_hash=hashes[i * bpc - 1] if i else None,
                token_ids=token_ids[i * tokens : (i + 1) * tokens],
                block_size=block_size,
                lora_name=extras.lora_name,
                extra_keys=None if per_block is None else per_block[i * bpc : (i + 1) * bpc],
            ))

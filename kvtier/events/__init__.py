"""KV-cache events: the wire structs, translation of residency changes, the ZMQ publisher.

Three layers, each usable alone:

* **Wire** (:mod:`kvtier.events.wire`): :class:`BlockStored`, :class:`BlockRemoved`,
  :class:`AllBlocksCleared` and :class:`KVEventBatch` are byte-compatible with vLLM's KV events:
  tagged msgspec structs (tag field ``type``, defaults omitted) inside an ``array_like`` batch
  ``[ts, [events…], data_parallel_rank]``. A consumer written for vLLM decodes kvtier's stream.
* **Translation** (:mod:`kvtier.events.translate`): :class:`EventTranslator` turns the tiers'
  :class:`~kvtier.types.OffloadingEvent` records into those structs, either as placeholders (one
  per offload key) or, in self-describing mode, with the chunk's constituent block hashes, parent
  hash, token ids, block size, LoRA name, per-block extra keys (:func:`event_extra_keys`) and
  group.
* **Publisher** (:mod:`kvtier.events.publisher`, :mod:`kvtier.events.replay`,
  :mod:`kvtier.events.endpoints`): :class:`ZmqEventPublisher` is an engine component that sends
  batches on a ZMQ PUB socket from a thread it owns, keeps a replay ring buffer behind an optional
  ROUTER socket, and never blocks the serving path (a full queue drops the batch and counts it).
  The replay socket is untrusted input: its work per turn of the thread is bounded, replays are
  rate-limited and malformed requests are counted and summarised in one log line per interval, so
  no peer can hold back live events.

The ``kvtier events`` subscriber that prints batches as JSON lines is
:mod:`kvtier.ops.events_cmd`. Everything here logs on the ``kvtier.events`` logger.
"""

from __future__ import annotations

from kvtier.events.endpoints import check_endpoint, offset_endpoint_for_rank
from kvtier.events.publisher import (
    DEFAULT_MAX_QUEUE_BYTES,
    PublisherStatistics,
    ZmqEventPublisher,
    estimated_batch_bytes,
    publisher_from_config,
)
from kvtier.events.replay import REPLAY_BURST, REPLAY_RATE_PER_S
from kvtier.events.translate import ChunkMetadata, EventTranslator, event_extra_keys
from kvtier.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    external_hash,
)

__all__ = [
    "ExternalBlockHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "KVEventBatch",
    "ChunkMetadata",
    "event_extra_keys",
    "EventTranslator",
    "external_hash",
    "PublisherStatistics",
    "ZmqEventPublisher",
    "publisher_from_config",
    "check_endpoint",
    "estimated_batch_bytes",
    "DEFAULT_MAX_QUEUE_BYTES",
    "REPLAY_RATE_PER_S",
    "REPLAY_BURST",
    "offset_endpoint_for_rank",
]

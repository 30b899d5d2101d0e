"""The KV event wire format: msgspec structs byte-compatible with vLLM's KV events.

:class:`BlockStored`, :class:`BlockRemoved` and :class:`AllBlocksCleared` are tagged msgspec
structs (tag field ``type``, defaults omitted) inside an ``array_like`` :class:`KVEventBatch`
``[ts, [events…], data_parallel_rank]``, as vLLM defines them in ``vllm/distributed/kv_events.py``:
a consumer written for vLLM decodes kvtier's stream.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = [
    "ExternalBlockHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "KVEventBatch",
    "END_OF_REPLAY_SEQ",
    "external_hash",
]

#: A block hash as published: the last 8 bytes as an unsigned int (default) or the raw bytes.
ExternalBlockHash = Union[bytes, int]

_HASH_MASK = 2**64 - 1
#: Frame sent after the last replayed batch: sequence -1 (8-byte signed big-endian).
END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)


# Field sets and order are vLLM's. Do not reorder: the events are keyed maps, but some consumers
# compare the encoded bytes with vLLM's.


class _KVCacheEvent(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    """Base of the KV events: encoded as a msgpack map tagged ``"type": <class name>``."""


class BlockStored(_KVCacheEvent):
    """Blocks became resident in ``medium``. The first seven fields are required on the wire."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: One entry per block of ``block_hashes``, untagged (:func:`event_extra_keys`), or ``None``.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(_KVCacheEvent):
    """Blocks left ``medium`` (evicted, deleted, found corrupt, or a failed store released)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    """Every block of the publisher was dropped (cache reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: msgpack array ``[ts, [events…], data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes, int_hashes: bool = True) -> ExternalBlockHash:
    """The published form of a hash: ``int.from_bytes(h, "big") & (2**64-1)`` or the raw bytes."""
    if int_hashes:
        return int.from_bytes(block_hash, "big") & _HASH_MASK
    return bytes(block_hash)

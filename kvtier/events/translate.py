"""Translation of the tiers' residency changes (:class:`~kvtier.types.OffloadingEvent`) into KV events.

:class:`EventTranslator` emits either placeholders (one per offload key) or, in self-describing
mode, the chunk's constituent block hashes, parent hash, token ids, block size, LoRA name,
per-block extra keys (:func:`event_extra_keys`) and group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEvent, external_hash
from kvtier.keys import split_offload_key
from kvtier.types import OffloadingEvent

__all__ = ["ChunkMetadata", "EventTranslator", "event_extra_keys"]


@dataclass(frozen=True, slots=True)
class ChunkMetadata:
    """What a self-describing event says about one chunk (``docs/events.md``, "Self-describing events").

    ``block_hashes`` are the chunk's constituent per-block hashes, ``parent_block_hash`` the hash
    preceding the chunk (``None`` for the first chunk of a sequence), ``token_ids`` the chunk's
    tokens and ``block_size`` the tokens per block. ``extra_keys`` are the chunk's blocks' extra
    keys as they were hashed (tagged: one entry per block hash, a tuple or ``None``; the chunk's
    slice of :meth:`kvtier.keys.RequestExtraKeys.per_block`), or ``None`` for a request without
    any; they are published untagged (:func:`event_extra_keys`).
    """

    block_hashes: Sequence[bytes]
    parent_block_hash: bytes | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    group_idx: int = 0
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None

    def __post_init__(self) -> None:
        # Snapshot the caller's lists: the translator may hold this long after the request ends.
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.block_size < 0 or self.group_idx < 0:
            raise ValueError("block_size and group_idx must be non-negative")
        if self.extra_keys is not None:
            extra_keys = tuple(self.extra_keys)
            if len(extra_keys) != len(self.block_hashes):
                raise ValueError(
                    f"extra_keys has {len(extra_keys)} entries for {len(self.block_hashes)} block hashes"
                )
            object.__setattr__(self, "extra_keys", extra_keys)


def event_extra_keys(
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """Per-block extra keys as vLLM 0.33 publishes them in ``BlockStored.extra_keys``: untagged.

    Each block's tagged entries (:mod:`kvtier.keys`) become, in the same order: the LoRA name
    for ``("lora", name, path)`` (the path is not published), ``(identifier, offset)`` for
    ``("mm", identifier, offset)``, the salt for ``("cache_salt", salt)`` and the digest bytes for
    ``("prompt_embeds", digest)``; a block without entries stays ``None``. ``None`` or an empty
    sequence gives ``None``; otherwise there is one entry per block, ``None`` ones included.
    """
    if not extra_keys:
        return None
    return [
        None if entries is None else tuple(entry[1:] if entry[0] == "mm" else entry[1] for entry in entries)
        for entries in extra_keys
    ]


@dataclass(slots=True)
class _Remembered:
    metadata: ChunkMetadata
    # (medium, ownership) pairs that currently hold the chunk, as seen in translated events.
    residencies: set[tuple[str | None, str | None]] = field(default_factory=set)


def _wire_str(value: object) -> str | None:
    """Enum members (``Medium.CPU``) publish as their value; plain strings pass through."""
    if value is None:
        return None
    return str(getattr(value, "value", value))


class EventTranslator:
    """Turns :class:`OffloadingEvent` records into KV event structs.

    Placeholder mode (``self_describing=False``, vLLM's default): one :class:`BlockStored` per
    offload key with ``block_hashes=[hash of the key]``, no parent, no tokens, ``block_size=0``;
    one :class:`BlockRemoved` per KV group per removal event. Consumers ignore unknown hashes.

    Self-describing mode: the engine calls :meth:`remember_chunk` when it stores or looks up a
    chunk; events for remembered keys carry the chunk's constituent hashes and payload, and a
    removal fans out to the same hashes. A chunk is forgotten when its last residency (medium,
    ownership) is removed, on :meth:`cleared`, or when the table exceeds ``max_chunks`` (oldest
    first; later events for it fall back to placeholders). Keys never remembered always get
    placeholders.

    In self-describing mode every :class:`BlockStored` also names its group's kind and sliding
    window (``group_specs``), placeholders included, as vLLM does; placeholder mode names neither.

    Events without keys are dropped (a ``metadata_only`` removal whose keys are all still held
    arrives empty). Not thread-safe: called from the engine's loop thread only.
    """

    def __init__(self, self_describing: bool, int_hashes: bool = True, *, max_chunks: int = 16384,
                 group_specs: Mapping[int, tuple[str, int | None]] | None = None) -> None:
        if max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")
        self.self_describing = self_describing
        #: Per KV-cache group, the ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)`` every
        #: stored event of the group carries in self-describing mode (placeholders too).
        self.group_specs = dict(group_specs or {})
        self.int_hashes = int_hashes
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, _Remembered] = OrderedDict()

    def __len__(self) -> int:
        """Number of remembered chunks (bounded by ``max_chunks``)."""
        return len(self._chunks)

    def remember_chunk(self, key: bytes, metadata: ChunkMetadata) -> None:
        """Record the payload of ``key`` (a no-op in placeholder mode)."""
        if not self.self_describing:
            return
        entry = self._chunks.get(key)
        if entry is None:
            self._chunks[key] = _Remembered(metadata)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        else:
            entry.metadata = metadata
            self._chunks.move_to_end(key)

    def translate(self, events: Iterable[OffloadingEvent]) -> list[KVEvent]:
        """Translate in order; the result may be empty."""
        out: list[KVEvent] = []
        for event in events:
            if not event.keys:
                continue
            medium = _wire_str(event.medium)
            locality = _wire_str(event.locality)
            ownership = event.ownership
            if event.removed:
                out.extend(self._removed(event.keys, medium, locality, ownership))
            else:
                out.extend(self._stored(event.keys, medium, locality, ownership))
        return out

    def cleared(self) -> list[KVEvent]:
        """Events for a cache reset; forgets every remembered chunk."""
        self._chunks.clear()
        return [AllBlocksCleared()]

    def _spec(self, group_idx: int) -> tuple[str | None, int | None]:
        return self.group_specs.get(group_idx, (None, None))

    def _hash(self, h: bytes) -> ExternalBlockHash:
        return external_hash(h, self.int_hashes)

    def _stored(
        self, keys: Sequence[bytes], medium: str | None, locality: str | None, ownership: str | None
    ) -> list[KVEvent]:
        out: list[KVEvent] = []
        for key in keys:
            entry = self._chunks.get(key) if self.self_describing else None
            if entry is not None:
                entry.residencies.add((medium, ownership))
                self._chunks.move_to_end(key)
                md = entry.metadata
                out.append(
                    BlockStored(
                        block_hashes=[self._hash(h) for h in md.block_hashes],
                        parent_block_hash=None if md.parent_block_hash is None else self._hash(md.parent_block_hash),
                        token_ids=list(md.token_ids),
                        block_size=md.block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=md.lora_name,
                        extra_keys=event_extra_keys(md.extra_keys),
                        group_idx=md.group_idx,
                        kv_cache_spec_kind=self._spec(md.group_idx)[0],
                        kv_cache_spec_sliding_window=self._spec(md.group_idx)[1],
                        locality=locality,
                        ownership=ownership,
                    )
                )
            else:
                block_hash, group_idx = split_offload_key(key)
                kind, window = self._spec(group_idx) if self.self_describing else (None, None)
                out.append(
                    BlockStored(
                        block_hashes=[self._hash(block_hash)],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                        group_idx=group_idx,
                        kv_cache_spec_kind=kind,
                        kv_cache_spec_sliding_window=window,
                        locality=locality,
                        ownership=ownership,
                    )
                )
        return out

    def _removed(
        self, keys: Sequence[bytes], medium: str | None, locality: str | None, ownership: str | None
    ) -> list[KVEvent]:
        by_group: dict[int, list[ExternalBlockHash]] = {}
        for key in keys:
            entry = self._chunks.get(key) if self.self_describing else None
            if entry is not None:
                by_group.setdefault(entry.metadata.group_idx, []).extend(
                    self._hash(h) for h in entry.metadata.block_hashes
                )
                entry.residencies.discard((medium, ownership))
                if not entry.residencies:
                    del self._chunks[key]
            else:
                block_hash, group_idx = split_offload_key(key)
                by_group.setdefault(group_idx, []).append(self._hash(block_hash))
        return [
            BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, locality=locality, ownership=ownership)
            for group, hashes in by_group.items()
        ]

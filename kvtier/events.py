"""KV-cache events: the wire structs, translation of residency changes, the ZMQ publisher, a CLI.

Three layers, each usable alone:

* **Structs** (:class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`,
  :class:`KVEventBatch`) are byte-compatible with vLLM's KV events (reference §6.1/§6.2): tagged
  msgspec structs (tag field ``type``, defaults omitted) inside an ``array_like`` batch
  ``[ts, [events…], data_parallel_rank]``. A consumer written for vLLM decodes kvtier's stream.
* :class:`EventTranslator` turns the tiers' :class:`~kvtier.types.OffloadingEvent` records into
  those structs, either as placeholders (one per offload key) or, in self-describing mode, with the
  chunk's constituent block hashes, parent hash, token ids, block size, LoRA name, per-block extra
  keys (:func:`event_extra_keys`) and group.
* :class:`ZmqEventPublisher` is an engine component that sends batches on a ZMQ PUB socket from a
  thread it owns, keeps a replay ring buffer behind an optional ROUTER socket, and never blocks the
  serving path (a full queue drops the batch and counts it). The replay socket is untrusted input:
  its work per turn of the thread is bounded, replays are rate-limited and malformed requests are
  counted and summarised in one log line per interval, so no peer can hold back live events.

:func:`run_events_cli` is the ``kvtier events`` subscriber that prints batches as JSON lines.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import queue
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TextIO, Union

import anyio
import msgspec
from anyio.abc import TaskStatus

from kvtier.errors import ConfigError
from kvtier.keys import split_offload_key
from kvtier.types import OffloadingEvent

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

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
    "run_events_cli",
]

logger = logging.getLogger(__name__)

#: A block hash as published: the last 8 bytes as an unsigned int (default) or the raw bytes.
ExternalBlockHash = Union[bytes, int]

_HASH_MASK = 2**64 - 1
#: Frame sent after the last replayed batch: sequence -1 (8-byte signed big-endian).
_END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)


# --------------------------------------------------------------------------------------------
# Wire structs (field sets and order are vLLM's; do not reorder: array-free maps are keyed, but
# the verified reference output lists fields in this order and some consumers compare bytes)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Translation of OffloadingEvent
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkMetadata:
    """What a self-describing event says about one chunk (reference §6.3).

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

    Events without keys are dropped (a ``metadata_only`` removal whose keys are all still held
    arrives empty). Not thread-safe: called from the engine's loop thread only.
    """

    def __init__(self, self_describing: bool, int_hashes: bool = True, *, max_chunks: int = 16384) -> None:
        if max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")
        self.self_describing = self_describing
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
                        locality=locality,
                        ownership=ownership,
                    )
                )
            else:
                block_hash, group_idx = split_offload_key(key)
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


# --------------------------------------------------------------------------------------------
# Publisher
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """Snapshot of a publisher. ``sequence`` is the number the next published batch will carry."""

    queue_depth: int
    published_batches: int
    dropped_batches: int
    sequence: int
    #: Well-formed replay requests answered with the buffered batches.
    replay_requests: int
    #: Estimated bytes held by the queued batches (bounded by ``max_queue_bytes``).
    queue_bytes: int = 0
    #: Well-formed replay requests refused (over the replay rate): answered with the end marker only.
    replay_requests_refused: int = 0
    #: Replay requests ignored because they were not ``[client, "", 8-byte seq]``.
    replay_requests_malformed: int = 0


_TCP_PORT = re.compile(r"^(tcp://.*):(\d+)$")


def offset_endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: TCP port + rank, ``inproc`` name + ``_dp<rank>``.

    Port 0, ``*`` ports, ``ipc://`` and rank 0 are returned unchanged.
    """
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    match = _TCP_PORT.match(endpoint)
    if match and int(match.group(2)) != 0:
        return f"{match.group(1)}:{int(match.group(2)) + rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any and local transports; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


#: Default bound of the publisher queue in (estimated) bytes.
DEFAULT_MAX_QUEUE_BYTES = 16 << 20
_STOP_POLL_S = 0.05  # how often the publisher thread looks at the stop flag and the replay socket
_DRAIN_ON_CLOSE_S = 0.5  # queued batches still sent on close, at most this long
_LINGER_MS = 200
_MAX_REPLAY_REQUEST_BYTES = 1024
#: Replays answered per second, over all clients (a token bucket holding up to REPLAY_BURST).
REPLAY_RATE_PER_S = 5.0
REPLAY_BURST = 10
# Per turn of the publisher thread, after the live batches: at most this many replay requests
# read (and at most _REPLAY_READS_PER_S on average; the rest wait in ZMQ and TCP buffers, which
# pushes back on the sender) and at most this many replayed batches sent.
_REPLAY_REQUESTS_PER_TURN = 64
_REPLAY_READS_PER_S = 2000.0
_REPLAY_SENDS_PER_TURN = 256
_LIVE_BATCHES_PER_TURN = 1024
_REPLAY_REPORT_INTERVAL_S = 10.0  # malformed and refused requests: one summary line at most this often
_MAX_CLI_MESSAGE_BYTES = 256 * 1024 * 1024


class ZmqEventPublisher:
    """Publishes KV event batches on a ZMQ PUB socket, compatible with vLLM's publisher.

    Each batch goes out as the multipart message ``(topic, seq as 8-byte big-endian, payload)``
    where ``payload`` is the msgpack ``[ts, [events…], data_parallel_rank]`` and ``seq`` counts
    published batches from 0. The PUB socket binds when the endpoint contains ``*``, ``::`` or is
    ``ipc://``/``inproc://`` and connects otherwise; endpoints are offset by
    ``data_parallel_rank`` (:func:`offset_endpoint_for_rank`). With ``replay_endpoint`` a ROUTER
    socket answers ``[client, "", start_seq]`` with every buffered batch (the last
    ``buffer_steps``, as they were when the request was read) whose seq ≥ start_seq as
    ``(client, "", topic, seq, payload)`` followed by the end marker ``(client, "", "", -1, "")``.

    The replay socket cannot hold back live events: each turn of the publisher thread first sends
    up to 1024 queued live batches, then reads at most 64 replay requests (2000 per second on
    average) and sends at most 256 replayed batches, round-robin over the replays in progress.
    Replays are rate-limited over all clients to :data:`REPLAY_RATE_PER_S` per second (bursts of
    :data:`REPLAY_BURST`, also the most replays in progress at once); a well-formed request beyond
    that is refused with the end marker alone — an empty replay, which keeps a REQ client able to
    ask again. Malformed requests are ignored. Refused and malformed requests are counted
    (:meth:`statistics`) and summarised in one WARNING line per 10 s at most (plus one on close),
    never one line per request.

    Back-pressure: :meth:`publish` never blocks. It enqueues onto a queue bounded by
    ``max_queue_size`` batches and by ``max_queue_bytes`` (an estimate of the memory the queued
    events hold, default 16 MiB; a batch larger than the whole bound is still taken when the
    queue is empty); a batch beyond either bound is dropped and counted. PUB itself drops
    messages for a slow subscriber beyond ``hwm``. Batches still queued when the publisher closes are sent for at
    most 0.5 s, the rest are counted as dropped, so after :meth:`aclose` every offered batch is
    either published or dropped.

    Endpoints are checked when the publisher is built (``tcp://HOST:PORT`` with a port in
    0..65535 or ``*`` and HOST ``*``, an IPv4/IPv6 literal or a host/interface name;
    ``ipc://PATH``; ``inproc://NAME``): a malformed one is a :class:`~kvtier.errors.ConfigError`
    naming ``events.endpoint`` / ``events.replay_endpoint``, and so is a bind or connect that
    fails when the publisher starts (an address in use, an unknown interface).

    Lifecycle: an engine component. ``await tg.start(publisher.run)`` creates the sockets in a
    thread the publisher owns (started with ``anyio.to_thread.run_sync``, so it is joined by the
    task group); ``started()`` is signalled once the sockets are bound, so :attr:`last_endpoint`
    is then the actual address; a socket that cannot be bound raises from ``tg.start``. :meth:`aclose` (or cancelling ``run``) stops the thread within
    about a second. pyzmq's async API is asyncio-only; the thread keeps the publisher usable on
    trio too.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10000,
        hwm: int = 100000,
        max_queue_size: int = 100000,
        topic: str = "",
        data_parallel_rank: int = 0,
        *,
        int_hashes: bool = True,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
    ) -> None:
        self.endpoint = offset_endpoint_for_rank(endpoint, data_parallel_rank)
        self.replay_endpoint = (
            None if replay_endpoint is None else offset_endpoint_for_rank(replay_endpoint, data_parallel_rank)
        )
        # Checked after the rank offset: a port pushed past 65535 is as bad as a typo.
        check_endpoint("events.endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("events.replay_endpoint", self.replay_endpoint)
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self.max_queue_bytes = max_queue_bytes
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        #: Not used on the wire by the publisher; read by the engine to build its EventTranslator.
        self.int_hashes = int_hashes
        #: Actual addresses once ``run`` has started (ephemeral ports resolved).
        self.last_endpoint: str | None = None
        self.last_replay_endpoint: str | None = None

        # Items are (ts, events, estimated bytes); the bytes are settled when an item leaves.
        self._queue: queue.Queue[tuple[float, list[KVEvent], int]] = queue.Queue(maxsize=max_queue_size)
        self._stop = threading.Event()
        self._closed = False
        self._finished: anyio.Event | None = None
        self._published = 0
        self._dropped = 0
        self._queued_bytes = 0
        self._seq = 0
        self._replays: _ReplayServer | None = None  # created by the publisher thread
        self._lock = threading.Lock()  # publish() may be called from several threads
        self._encoder = msgspec.msgpack.Encoder()

    def __repr__(self) -> str:
        return f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint={self.replay_endpoint!r})"

    # -- serving path -------------------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> bool:
        """Queue one batch without blocking; ``False`` if it was dropped (queue full or closed).

        An empty ``events`` is not a batch: nothing is queued and ``True`` is returned.
        Thread-safe.
        """
        if not events:
            return True
        if self._closed:
            self._count_dropped(1)
            return False
        nbytes = estimated_batch_bytes(events)
        with self._lock:
            # The queue's only other producer-side user is this lock's holder, so the check and
            # the put are one step; a batch bigger than the bound still goes into an empty queue.
            if self._queued_bytes and self._queued_bytes + nbytes > self.max_queue_bytes:
                self._dropped += 1
                return False
            try:
                self._queue.put_nowait((time.time() if ts is None else ts, list(events), nbytes))
            except queue.Full:
                self._dropped += 1
                return False
            self._queued_bytes += nbytes
        return True

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(
            queue_depth=self._queue.qsize(),
            queue_bytes=self._queued_bytes,
            published_batches=self._published,
            dropped_batches=self._dropped,
            sequence=self._seq,
            replay_requests=0 if self._replays is None else self._replays.answered,
            replay_requests_refused=0 if self._replays is None else self._replays.refused,
            replay_requests_malformed=0 if self._replays is None else self._replays.malformed,
        )

    def _count_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _take(self, timeout: float | None = None) -> tuple[float, list[KVEvent]] | None:
        """The next queued batch (waiting up to ``timeout``; ``None``: do not wait), or ``None``."""
        try:
            ts, events, nbytes = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return None
        with self._lock:
            self._queued_bytes -= nbytes
        return ts, events

    # -- lifecycle ------------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the publisher thread until :meth:`aclose` or cancellation.

        A socket that cannot be bound or connected raises :class:`~kvtier.errors.ConfigError`
        (unwrapped) before ``task_status.started()``.
        """
        if self._finished is not None or self._closed:
            raise RuntimeError("a ZmqEventPublisher runs once")
        self._finished = anyio.Event()
        ready = anyio.Event()
        thread_done = anyio.Event()

        async def run_thread() -> None:
            try:
                # abandon_on_cancel=False: the thread is always joined; the stop flag ends it.
                await anyio.to_thread.run_sync(self._thread_main, ready, abandon_on_cancel=False)
            finally:
                thread_done.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_thread)
                try:
                    await ready.wait()
                    task_status.started()
                    await thread_done.wait()
                finally:
                    # Cancellation (or aclose) reaches the thread only through this flag.
                    self._stop.set()
        except BaseExceptionGroup as group:
            # The thread's own failure (a socket that cannot bind) is the caller's ConfigError.
            if len(group.exceptions) == 1 and isinstance(group.exceptions[0], ConfigError):
                raise group.exceptions[0] from None
            raise
        finally:
            self._closed = True
            self._finished.set()

    async def aclose(self) -> None:
        """Stop publishing: new batches are dropped; queued ones get ≤ 0.5 s; waits for the thread."""
        self._closed = True
        self._stop.set()
        if self._finished is not None:
            await self._finished.wait()
        else:  # never ran: whatever is queued will never be sent
            self._count_dropped(self._drain_queue_count())

    def _drain_queue_count(self) -> int:
        n = 0
        while self._take() is not None:
            n += 1
        return n

    # -- the publisher thread -------------------------------------------------------------------

    def _thread_main(self, ready: anyio.Event) -> None:
        import zmq  # imported here so that importing kvtier.events stays cheap

        ctx = zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, _LINGER_MS)
            _attach(pub, "events.endpoint", self.endpoint, bind=_binds(self.endpoint))
            self.last_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
                # Requests are 8-byte sequence numbers; refuse anything large from the network.
                replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAY_REQUEST_BYTES)
                replay.setsockopt(zmq.LINGER, _LINGER_MS)
                _attach(replay, "events.replay_endpoint", self.replay_endpoint, bind=True)
                self.last_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replays = _ReplayServer(replay, self.topic.encode())
            anyio.from_thread.run_sync(ready.set)
            self._serve(pub)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close()
            ctx.term()

    def _serve(self, pub: Any) -> None:
        topic = self.topic.encode()
        ring: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        replays = self._replays
        while not self._stop.is_set():
            # Live batches first; the replay work after them is bounded, so whatever arrives on
            # the replay socket a live batch waits for at most one slice of it.
            wait = _STOP_POLL_S if replays is None else replays.idle_wait()
            item = self._take(timeout=wait)
            sent = 0
            while item is not None:
                self._send(pub, topic, ring, item)
                sent += 1
                item = self._take() if sent < _LIVE_BATCHES_PER_TURN else None
            if replays is not None:
                replays.turn(ring)
        if replays is not None:
            replays.report()
        deadline = time.monotonic() + _DRAIN_ON_CLOSE_S
        while time.monotonic() < deadline:
            item = self._take()
            if item is None:
                break
            self._send(pub, topic, ring, item)
        self._count_dropped(self._drain_queue_count())

    def _send(self, pub: Any, topic: bytes, ring: deque[tuple[int, bytes]], item: tuple[float, list[KVEvent]]) -> None:
        ts, events = item
        payload = self._encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=self.data_parallel_rank))
        seq = self._seq
        # PUB never blocks: beyond SNDHWM (or with no subscriber) ZMQ drops the message itself.
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
        ring.append((seq, payload))
        self._seq = seq + 1
        self._published += 1


class _TokenBucket:
    """``rate`` tokens per second, holding at most ``capacity``; starts full."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._tokens = capacity
        self._at = time.monotonic()

    def available(self, now: float) -> float:
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def take(self, now: float, n: float = 1.0) -> bool:
        if self.available(now) < n:
            return False
        self._tokens -= n
        return True


class _ReplayServer:
    """The replay ROUTER's side of the publisher thread: bounded work per :meth:`turn`.

    Counters are plain ints written by the publisher thread only (read by ``statistics()``).
    """

    def __init__(self, socket: Any, topic: bytes) -> None:
        self.socket = socket
        self.topic = topic
        self.answered = 0
        self.refused = 0
        self.malformed = 0
        self._replay_tokens = _TokenBucket(REPLAY_RATE_PER_S, REPLAY_BURST)
        self._read_tokens = _TokenBucket(_REPLAY_READS_PER_S, _REPLAY_REQUESTS_PER_TURN)
        # Replays in progress: (client, the batches still to send, oldest first).
        self._active: deque[tuple[bytes, deque[tuple[int, bytes]]]] = deque()
        self._reported_malformed = 0
        self._reported_refused = 0
        self._reported_at = time.monotonic()
        self._next_report = self._reported_at + _REPLAY_REPORT_INTERVAL_S

    def idle_wait(self) -> float | None:
        """How long the thread may wait for a live batch before the next turn (``None``: not at all)."""
        if self._active:
            return None
        # Read throttled: come back when a slice of reads is due (sooner if a live batch comes).
        short = _REPLAY_REQUESTS_PER_TURN - self._read_tokens.available(time.monotonic())
        return min(_STOP_POLL_S, max(short / _REPLAY_READS_PER_S, 0.001)) if short > 0 else _STOP_POLL_S

    def turn(self, ring: deque[tuple[int, bytes]]) -> None:
        now = time.monotonic()
        self._read(ring, now)
        self._send_slice()
        if now >= self._next_report:
            self.report()

    def _read(self, ring: deque[tuple[int, bytes]], now: float) -> None:
        import zmq

        reads = min(int(self._read_tokens.available(now)), _REPLAY_REQUESTS_PER_TURN)
        for _ in range(reads):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._read_tokens.take(now)
            # Untrusted input: anything but [client, "", 8-byte seq] is ignored (and counted).
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.malformed += 1
                continue
            client = frames[0]
            if len(self._active) >= REPLAY_BURST or not self._replay_tokens.take(now):
                self.refused += 1
                self._send(client, (b"", _END_OF_REPLAY_SEQ, b""))
                continue
            self.answered += 1
            start = int.from_bytes(frames[2], "big")
            # The ring's seqs are contiguous: skip straight to ``start``.
            skip = max(0, start - ring[0][0]) if ring else 0
            self._active.append((client, deque(islice(ring, skip, None))))

    def _send_slice(self) -> None:
        """Send up to _REPLAY_SENDS_PER_TURN replayed batches, round-robin over the replays."""
        budget = _REPLAY_SENDS_PER_TURN
        while self._active and budget > 0:
            client, pending = self._active.popleft()
            share = max(1, budget // (len(self._active) + 1))
            while pending and share > 0:
                seq, payload = pending.popleft()
                self._send(client, (self.topic, seq.to_bytes(8, "big"), payload))
                share -= 1
                budget -= 1
            if pending:
                self._active.append((client, pending))
            else:
                self._send(client, (b"", _END_OF_REPLAY_SEQ, b""))

    def _send(self, client: bytes, frames: tuple[bytes, bytes, bytes]) -> None:
        import zmq

        # A ROUTER never blocks: beyond the client's SNDHWM, or for a client gone, ZMQ drops.
        try:
            self.socket.send_multipart((client, b"", *frames), zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - only with ROUTER_MANDATORY, which is not set
            pass

    def report(self) -> None:
        """Log what was refused or ignored since the last report, in one line (if anything)."""
        now = time.monotonic()
        malformed = self.malformed - self._reported_malformed
        refused = self.refused - self._reported_refused
        if malformed or refused:
            logger.warning(
                "KV event replay endpoint: ignored %d malformed requests and refused %d over the rate "
                "limit (%g replays/s) in the last %.1f s",
                malformed, refused, REPLAY_RATE_PER_S, now - self._reported_at,
            )
        self._reported_malformed = self.malformed
        self._reported_refused = self.refused
        self._reported_at = now
        self._next_report = now + _REPLAY_REPORT_INTERVAL_S


def _attach(socket: Any, key: str, endpoint: str, *, bind: bool) -> None:
    """Bind or connect ``socket``; a refusal is a ConfigError naming ``key`` (publisher thread)."""
    import zmq

    try:
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        raise ConfigError(f"{key}: cannot {verb} {endpoint[:200]!r}: {exc}") from None


# Estimated memory of a queued batch: a fixed cost per batch and per event (the structs, their
# lists) plus one per list element (a pointer and, mostly, an int object of its own) and two per
# extra-keys entry (a tuple of its own; the strings and digests in it are shared). Close enough
# to bound memory; cheap enough for the serving path (three len() per event).
_BATCH_BYTES = 128
_EVENT_BYTES = 320
_ELEMENT_BYTES = 40


def estimated_batch_bytes(events: Sequence[KVEvent]) -> int:
    """Approximate bytes a queued batch of ``events`` keeps alive (what ``max_queue_bytes`` bounds)."""
    elements = 0
    for event in events:
        elements += len(getattr(event, "block_hashes", ())) + len(getattr(event, "token_ids", None) or ())
        elements += 2 * len(getattr(event, "extra_keys", None) or ())
    return _BATCH_BYTES + _EVENT_BYTES * len(events) + _ELEMENT_BYTES * elements


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_NUMERIC_HOST = re.compile(r"^[0-9.]+$")


def check_endpoint(key: str, endpoint: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``endpoint`` is a well-formed ZMQ endpoint.

    ``tcp://HOST:PORT`` (HOST ``*``, an IPv4 or ``[IPv6]`` literal, or a host or interface name;
    PORT 0..65535 or ``*``; an optional ``SOURCE;`` part of the same form), ``ipc://PATH`` or
    ``inproc://NAME`` (non-empty). Whether the address can be used is found out at bind time.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(f"{key}: expected a str endpoint, got {type(endpoint).__name__}")
    problem = _endpoint_problem(endpoint)
    if problem is not None:
        raise ConfigError(f"{key}: {endpoint[:80]!r} {problem}")


def _endpoint_problem(endpoint: str) -> str | None:
    if len(endpoint) > 1024:
        return "is longer than 1024 characters"
    if "\x00" in endpoint:
        return "contains a NUL character"
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return "is not a tcp://, ipc:// or inproc:// endpoint"
    if scheme != "tcp":
        return None if rest else f"has an empty {scheme} address"
    *source, address = rest.split(";")
    if len(source) > 1:
        return "has more than one ';' (tcp://[SOURCE;]HOST:PORT)"
    if source:  # a connect's source: an interface or address, with or without a port
        problem = _tcp_address_problem(source[0]) if ":" in source[0] else _host_problem(source[0])
        if problem is not None:
            return problem
    return _tcp_address_problem(address)


def _tcp_address_problem(address: str) -> str | None:
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "is not tcp://HOST:PORT"
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return f"has port {port!r}; expected 0..65535 or '*'"
    return _host_problem(host)


def _host_problem(host: str) -> str | None:
    if host == "*":
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            return f"has {host!r} in brackets, which is not an IPv6 address"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"has host {host!r}, which is not a valid IPv6 address"
        return None
    if _NUMERIC_HOST.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"has host {host!r}, which is not a valid IPv4 address"
        return None
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in name.split(".")):
        return f"has host {host[:80]!r}, which is not a valid host or interface name"
    return None


_PUBLISHER_KEYS: dict[str, tuple[type, ...]] = {
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "max_queue_bytes": (int,),
    "topic": (str,),
    "data_parallel_rank": (int,),
    "int_hashes": (bool,),
}
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "buffer_steps": (1, 10_000_000),
    "hwm": (0, 100_000_000),
    "max_queue_size": (1, 100_000_000),
    "max_queue_bytes": (1, 1 << 40),
    "data_parallel_rank": (0, 65535),
}


def publisher_from_config(events_cfg: Mapping[str, Any]) -> ZmqEventPublisher:
    """Validate the ``events`` dictionary of ``kvtier.open`` and build the publisher.

    Keys (all optional, defaults of :class:`ZmqEventPublisher`): ``endpoint`` (``tcp://*:5557``),
    ``replay_endpoint`` (none), ``buffer_steps`` (10000 batches kept for replay), ``hwm`` (ZMQ send
    high-water mark, 100000), ``max_queue_size`` (100000 batches) and ``max_queue_bytes``
    (16 MiB, estimated) bounding the queue in front of the socket thread, ``topic`` (``""``),
    ``data_parallel_rank`` (0), ``int_hashes`` (true). An unknown key or a bad value — including a
    malformed endpoint (see :func:`check_endpoint`) — raises :class:`~kvtier.errors.ConfigError`
    naming ``events.<key>``; an endpoint that cannot be bound does so when the publisher starts.
    """
    if not isinstance(events_cfg, Mapping):
        raise ConfigError(f"events must be a mapping, got {type(events_cfg).__name__}")
    kwargs: dict[str, Any] = {}
    for key, value in events_cfg.items():
        if key not in _PUBLISHER_KEYS:
            raise ConfigError(f"events.{key}: unknown key (allowed: {', '.join(sorted(_PUBLISHER_KEYS))})")
        allowed = _PUBLISHER_KEYS[key]
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"events.{key}: expected {names}, got {type(value).__name__}")
        if key in _INT_BOUNDS:
            low, high = _INT_BOUNDS[key]
            if not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"events.{key}: {value} is outside [{low}, {high}]")
        if key in ("endpoint", "replay_endpoint") and isinstance(value, str):
            check_endpoint(f"events.{key}", value)
        if key == "topic" and isinstance(value, str) and len(value.encode()) > 255:
            raise ConfigError("events.topic: longer than 255 bytes")
        kwargs[key] = value
    return ZmqEventPublisher(**kwargs)


# --------------------------------------------------------------------------------------------
# `kvtier events` CLI
# --------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _event_lines(seq: int, payload: bytes) -> list[str]:
    """JSON lines of one batch: ``{"seq", "ts", "data_parallel_rank", "type", <fields>…}``."""
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    ts = batch[0]
    dp_rank = batch[2] if len(batch) > 2 else None
    lines = []
    for event in batch[1]:
        record: dict[str, Any] = {"seq": seq, "ts": ts, "data_parallel_rank": dp_rank}
        if isinstance(event, dict):
            record.update(_jsonable(event))
        else:  # an array_like event from some other publisher: keep it, do not guess names
            record["event"] = _jsonable(event)
        lines.append(json.dumps(record))
    return lines


_EVENTS_EXIT_CODES = {
    0: "--count batches printed; or, without --count, --timeout passed without a batch after at "
       "least one batch; or interrupted (Ctrl-C)",
    1: "timed out: no batch within --wait (or --timeout), or fewer than --count batches before "
       "--timeout; the reason is printed on stderr",
    2: "bad arguments (an endpoint that is not tcp://HOST:PORT, ipc://PATH or inproc://NAME, a "
       "count below 1, ...)",
}
#: Default of ``kvtier events --wait``: how long to wait for the first batch.
DEFAULT_CLI_WAIT_S = 10.0


def _build_cli_parser() -> argparse.ArgumentParser:
    from kvtier.cli import CliParser, exit_codes_epilog

    parser = CliParser(
        prog="kvtier events",
        description="Subscribe to a kvtier (or vLLM) KV-event publisher and print one JSON line per "
        "event (byte hashes as hex).",
        epilog=exit_codes_epilog(_EVENTS_EXIT_CODES),
    )
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="publisher PUB endpoint to connect to")
    parser.add_argument("--topic", default="", help="topic to subscribe to (default: all topics)")
    parser.add_argument("--replay-endpoint", default=None,
                        help="publisher ROUTER endpoint: first print the buffered batches from --from-seq "
                        "(default: no replay)")
    parser.add_argument("--from-seq", type=int, default=0, help="first sequence number to replay")
    parser.add_argument("--count", type=int, default=None, help="stop after this many batches (default: no limit)")
    parser.add_argument("--wait", type=float, default=DEFAULT_CLI_WAIT_S,
                        help="give up (exit status 1) when no batch at all arrives within this many seconds; "
                        "0 waits forever")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop after this many seconds without a batch (default: no limit once a batch "
                        "arrived; also replaces --wait for the first batch)")
    return parser


def run_events_cli(argv: list[str], *, out: TextIO | None = None) -> int:
    """``kvtier events``: subscribe and print one JSON line per event (hashes in bytes as hex).

    With ``--replay-endpoint`` the buffered batches from ``--from-seq`` are printed first, then
    live ones (batches already replayed are skipped). Exit status: 0 on ``--count`` batches, on
    ``--timeout`` without ``--count`` once a batch was printed, or on Ctrl-C; 1 (with one line on
    stderr) when no batch arrives within ``--wait`` (default 10 s; ``--timeout`` when given) or
    ``--timeout`` expires before ``--count`` batches; 2 (one line on stderr) on bad arguments.
    """
    import zmq

    out = sys.stdout if out is None else out
    try:
        args = _build_cli_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    problems = []
    if args.count is not None and args.count < 1:
        problems.append(f"--count: {args.count} is invalid; expected an int >= 1")
    if args.from_seq < 0:
        problems.append(f"--from-seq: {args.from_seq} is invalid; expected an int >= 0")
    for name, value in (("--wait", args.wait), ("--timeout", args.timeout)):
        if value is not None and not (value >= 0 and value != float("inf")):
            problems.append(f"--{name.lstrip('-')}: {value} is invalid; expected a number of seconds >= 0")
    for name, endpoint in (("--endpoint", args.endpoint), ("--replay-endpoint", args.replay_endpoint)):
        if endpoint is not None:
            try:
                check_endpoint(name, endpoint)
            except ConfigError as exc:
                problems.append(f"{exc}")
    if problems:
        print(f"kvtier events: error: {problems[0]}", file=sys.stderr)
        return 2
    timeout_ms = None if args.timeout is None else max(int(args.timeout * 1000), 0)
    first_ms: int | None  # the poll timeout for the first batch (None: forever)
    if timeout_ms is not None:
        first_ms = timeout_ms
    else:
        first_ms = None if args.wait == 0 else max(int(args.wait * 1000), 1)
    seen = 0
    last_seq = -1

    def emit(seq: int, payload: bytes) -> None:
        nonlocal seen, last_seq
        try:
            lines = _event_lines(seq, payload)
        except (msgspec.DecodeError, ValueError) as exc:
            print(f"seq {seq}: undecodable batch ({exc})", file=sys.stderr)
            lines = []
        for line in lines:
            out.write(line + "\n")
        out.flush()
        seen += 1
        last_seq = seq

    def done() -> bool:
        return args.count is not None and seen >= args.count

    def timed_out(where: str) -> int:
        if seen == 0:
            waited = args.timeout if args.timeout is not None else args.wait
            print(f"kvtier events: timed out after {waited:g} s waiting for the first batch from {where}; "
                  "is a publisher running there? (--wait 0 waits forever)", file=sys.stderr)
            return 1
        if args.count is None:
            return 0
        print(f"kvtier events: timed out after {args.timeout:g} s without a batch from {where}; "
              f"got {seen} of --count {args.count}", file=sys.stderr)
        return 1

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, _MAX_CLI_MESSAGE_BYTES)  # bound what a peer can make us buffer
    dealer = None
    try:
        sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
        try:
            sub.connect(args.endpoint)
        except zmq.ZMQError as exc:
            print(f"kvtier events: error: --endpoint: cannot connect to {args.endpoint!r}: {exc}", file=sys.stderr)
            return 2
        if args.replay_endpoint:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_CLI_MESSAGE_BYTES)
            try:
                dealer.connect(args.replay_endpoint)
            except zmq.ZMQError as exc:
                print(f"kvtier events: error: --replay-endpoint: cannot connect to {args.replay_endpoint!r}: "
                      f"{exc}", file=sys.stderr)
                return 2
            dealer.send_multipart((b"", args.from_seq.to_bytes(8, "big")))
            while not done():
                if not dealer.poll(first_ms if seen == 0 else timeout_ms):
                    return timed_out(f"replay endpoint {args.replay_endpoint}")
                frames = dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == _END_OF_REPLAY_SEQ:
                    break
                emit(int.from_bytes(frames[2], "big"), frames[3])
        while not done():
            if not sub.poll(first_ms if seen == 0 else timeout_ms):
                return timed_out(args.endpoint)
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq <= last_seq:  # already printed from the replay
                continue
            emit(seq, frames[2])
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sub.close()
        if dealer is not None:
            dealer.close()
        ctx.term()

"""The KV event publisher: sends event batches on a ZMQ PUB socket from a thread it owns.

:class:`ZmqEventPublisher` is an engine component; it keeps a replay ring buffer behind an optional
ROUTER socket (:class:`~kvtier.events.replay.ReplayServer`) and never blocks the serving path: a
full queue drops the batch and counts it. :func:`publisher_from_config` builds one from the
``events`` dictionary of ``kvtier.open``.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import zmq
from anyio.abc import TaskStatus

from kvtier.errors import ConfigError
from kvtier.events.endpoints import binds, check_endpoint, offset_endpoint_for_rank
from kvtier.events.replay import ReplayServer
from kvtier.events.wire import KVEvent, KVEventBatch

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "PublisherStatistics",
    "ZmqEventPublisher",
    "publisher_from_config",
    "estimated_batch_bytes",
    "DEFAULT_MAX_QUEUE_BYTES",
]


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


#: Default bound of the publisher queue in (estimated) bytes.
DEFAULT_MAX_QUEUE_BYTES = 16 << 20
_STOP_POLL_S = 0.05  # how often the publisher thread looks at the stop flag and the replay socket
_DRAIN_ON_CLOSE_S = 0.5  # queued batches still sent on close, at most this long
_LINGER_MS = 200
_MAX_REPLAY_REQUEST_BYTES = 1024
_LIVE_BATCHES_PER_TURN = 1024


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
    Replays are rate-limited over all clients to
    :data:`~kvtier.events.replay.REPLAY_RATE_PER_S` per second (bursts of
    :data:`~kvtier.events.replay.REPLAY_BURST`, also the most replays in progress at once); a
    well-formed request beyond that is refused with the end marker alone — an empty replay, which
    keeps a REQ client able to ask again. Malformed requests are ignored. Refused and malformed
    requests are counted (:meth:`statistics`) and summarised in one WARNING line per 10 s at most
    (plus one on close), never one line per request.

    Back-pressure: :meth:`publish` never blocks. It enqueues onto a queue bounded by
    ``max_queue_size`` batches and by ``max_queue_bytes`` (an estimate of the memory the queued
    events hold, default 16 MiB; a batch larger than the whole bound is still taken when the
    queue is empty); a batch beyond either bound is dropped and counted. PUB itself drops
    messages for a slow subscriber beyond ``hwm``. Batches still queued when the publisher closes
    are sent for at most 0.5 s, the rest are counted as dropped, so after :meth:`aclose` every
    offered batch is either published or dropped.

    Endpoints are checked when the publisher is built (``tcp://HOST:PORT`` with a port in
    0..65535 or ``*`` and HOST ``*``, an IPv4/IPv6 literal or a host/interface name;
    ``ipc://PATH``; ``inproc://NAME``): a malformed one is a :class:`~kvtier.errors.ConfigError`
    naming ``events.endpoint`` / ``events.replay_endpoint``, and so is a bind or connect that
    fails when the publisher starts (an address in use, an unknown interface).

    Lifecycle: an engine component. ``await tg.start(publisher.run)`` creates the sockets in a
    thread the publisher owns (started with ``anyio.to_thread.run_sync``, so it is joined by the
    task group); ``started()`` is signalled once the sockets are bound, so :attr:`last_endpoint`
    is then the actual address; a socket that cannot be bound raises from ``tg.start``.
    :meth:`aclose` (or cancelling ``run``) stops the thread within about a second. pyzmq's async
    API is asyncio-only; the thread keeps the publisher usable on trio too.
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
        self._replays: ReplayServer | None = None  # created by the publisher thread
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
        ctx = zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, _LINGER_MS)
            _attach(pub, "events.endpoint", self.endpoint, bind=binds(self.endpoint))
            self.last_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
                # Requests are 8-byte sequence numbers; refuse anything large from the network.
                replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAY_REQUEST_BYTES)
                replay.setsockopt(zmq.LINGER, _LINGER_MS)
                _attach(replay, "events.replay_endpoint", self.replay_endpoint, bind=True)
                self.last_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replays = ReplayServer(replay, self.topic.encode())
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
            wait = _STOP_POLL_S if replays is None else replays.idle_wait(_STOP_POLL_S)
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


def _attach(socket: Any, key: str, endpoint: str, *, bind: bool) -> None:
    """Bind or connect ``socket``; a refusal is a ConfigError naming ``key`` (publisher thread)."""
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

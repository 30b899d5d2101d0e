"""``P2PTier``: KV chunks between kvtier instances — control over ZeroMQ, bytes over UCX.

The tier holds no storage of its own. As a **producer** it serves what the local stack holds:
chunks its requests cascade to it (``remote_decoder``: every chunk of the request, parked with
their host pins until the consumer's fetch binds them) and, for a peer's lookups
(``remote_kv_source``), whatever the rest of the stack finds (host memory, or an fs/obj tier
through a promotion). As a **consumer** it fetches a peer's chunks straight into the host slots
the manager allocated. Reference §5 is the behaviour it follows (keys, roles, message set,
flows); where it says nothing, every wait has a deadline and a failure costs a recompute.

Roles come from the request's ``kv_transfer_params`` (validated by
:class:`kvtier.config.RequestParams`):

* ``remote_decoder: {kv_request_id}`` — producer: ``on_new_request`` answers ``REQUEST_LEVEL`` and
  the cascaded store jobs are *parked* under the id. A consumer's ``Fetch`` binds the id; the
  chunks it asks for are sent from their host slots (``TransferDone`` when all are sent); parked
  jobs finish (pins released) once every one of their chunks was sent, at the empty terminal
  fetch, when the consumer's session dies, or once the id has been idle (no fetch of it waiting
  or sending) for ``unbound_store_timeout_s``, whatever the consumer did before (the id is then
  *reaped*: a late fetch is answered ``TransferDone(success=False)`` at once). Chunks a peer's
  ``Lookup`` found are parked (pinned) the same way, under the same timeout.
* ``remote_prefiller: {kv_request_id, remote_host, remote_port}`` — consumer, classic P/D: every
  key is a HIT (the prefiller holds the prompt); promotions become one ``Fetch`` per step.
* ``remote_kv_source`` (same fields) — consumer with probing: lookups answer RETRY while a
  ``Lookup`` is outstanding and resolve (HIT or MISS) within ``lookup_timeout_s``.

Sessions: a consumer opens one to each producer it uses (``Connect`` → ``ConnectAck`` carrying
the producer's UCX port and a per-session token; the consumer's UCX endpoint presents the token
first). Both ends check slot bytes, the run's config fingerprint and the ``NONE_HASH`` seed and
refuse a mismatch with a log line naming it. A dead peer (heartbeats, monitor events, a failed
transfer) has its sessions reaped: the consumer's pending loads fail as misses within
``load_timeout_s``; the producer's jobs bound to it are released. Reconnects back off (1 s
doubling to 60 s).

Bounds on what one consumer session may make the producer hold (each refusal is answered — a
lookup as MISS, a fetch as ``TransferDone(success=False)`` — counted in ``p2p_limit_refusals`` by
limit and logged at most once per peer and limit per minute): :data:`MAX_REQUESTS_PER_SESSION`
request ids looked up or fetched and not finished, :data:`MAX_PENDING_LOOKUP_KEYS` keys waiting
for an answer, :data:`MAX_FETCHES_PER_SESSION` fetches served at once, and pins: a session's
lookups may pin at most :data:`SESSION_PIN_SHARE` of the host slots, all sessions' lookups
together :data:`ALL_SESSIONS_PIN_SHARE` of them, so peers can never take the host tier from the
local requests.

Requires asyncio (ucxx's asynchronous API does): ``kvtier.open`` refuses it under trio.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
import anyio.abc
from anyio.abc import TaskStatus

from kvtier.context import RequestContext
from kvtier.keys import hash_seed
from kvtier.layout import run_fingerprint
from kvtier.throttled_log import ThrottledLog
from kvtier.tiers.base import ParentManager, SecondaryTier, TierContext, TransferJob, _JobRecord
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.control import ControlPlane, CurveKeys, PeerDown, PeerUnavailable
from kvtier.tiers.p2p.data import DataPlane, DataPlaneError, Link, chunk_tag
from kvtier.types import CacheHitSource, LookupResult, OffloadPolicy

__all__ = ["P2PTier"]

logger = logging.getLogger(__name__)

#: Producer: a peer's lookup of a chunk still being written or promoted is answered MISS after this.
LOOKUP_PENDING_TIMEOUT_S = 5.0
#: Producer: a bound fetch whose chunks do not all arrive (cascades) within this fails.
STORE_SERVE_TIMEOUT_S = 30.0
#: Consumer: after an AbortFetch, how long to wait for the AbortAck before failing anyway.
ABORT_ACK_TIMEOUT_S = 10.0
#: How long a reaped request id answers a late fetch with failure.
REAPED_ID_RETENTION_S = 60.0
#: Reconnect back-off after a session to a peer died: first retry after 1 s, doubling to 60 s.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0
#: Period of the housekeeping task (timeouts are checked this often).
HOUSEKEEPING_S = 0.2
#: Producer, per consumer session: request ids looked up or fetched and not finished, at most.
MAX_REQUESTS_PER_SESSION = 4096
#: Producer, per consumer session: looked-up keys waiting for their answer, at most.
MAX_PENDING_LOOKUP_KEYS = 4 * p.MAX_KEYS_PER_MESSAGE
#: Producer, per consumer session: fetches waiting for their chunks or sending them, at most.
MAX_FETCHES_PER_SESSION = 64
#: Producer: the share of the host slots one session's lookups may pin, and all sessions' together.
SESSION_PIN_SHARE, ALL_SESSIONS_PIN_SHARE = 0.25, 0.5
#: Labels of ``p2p_limit_refusals``: which of the bounds above refused.
LIMITS = ("requests", "lookup_keys", "fetches", "pins")


@dataclass(eq=False)
class _Parked:
    """A store job of a producer request, pinned until its chunks are sent or it is released."""

    record: _JobRecord
    unsent: set[bytes]
    parked_at: float
    owner: _Served | None = None  # the session whose lookup pinned it (None: a local request's)


@dataclass(eq=False)
class _Served:
    """Producer side of one consumer session."""

    peer_id: str
    token: bytes
    link: Link | None = None
    lookups: dict[str, _RemoteLookup] = field(default_factory=dict)  # kv_request_id -> state
    # kv_request_ids it looked up or fetched -> when last (bounded by MAX_REQUESTS_PER_SESSION);
    # those its fetches or lookup hits bound are also in P2PTier._bound.
    requests: dict[str, float] = field(default_factory=dict)
    fetching: dict[tuple[str, int], anyio.CancelScope] = field(default_factory=dict)
    pending_keys: int = 0  # keys in its lookups' queues
    pins: int = 0  # host slots its lookups' parked jobs pin
    last_activity: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _RemoteLookup:
    """A peer's lookups for one of its requests, resolved through the local stack."""

    ctx: RequestContext
    started: bool = False
    queue: list[tuple[bytes, float]] = field(default_factory=list)  # (key, give-up time)


@dataclass(eq=False)
class _Client:
    """Consumer side: our session to one producer."""

    peer_id: str
    host: str
    port: int
    connected_at: float = field(default_factory=time.monotonic)
    acked: anyio.Event = field(default_factory=anyio.Event)
    ack: p.ConnectAck | None = None
    link: Link | None = None
    dead: bool = False
    outbox: list[p.Message] = field(default_factory=list)  # until the ack arrives
    done_waiters: dict[tuple[str, int], anyio.Event] = field(default_factory=dict)
    done: dict[tuple[str, int], bool] = field(default_factory=dict)
    last_activity: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Probe:
    """Consumer side: one request's lookups sent to its ``remote_kv_source``."""

    peer_id: str
    verdicts: dict[bytes, bool] = field(default_factory=dict)
    batch: list[bytes] = field(default_factory=list)
    asked: dict[bytes, float] = field(default_factory=dict)  # key -> deadline
    round_seq: int = 0
    fetched: bool = False


class P2PTier(SecondaryTier):
    """Options (``config.options``): see the module docstring and README "Peer-to-peer tier"."""

    tier_type: ClassVar[str] = "p2p"
    medium = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    requires_asyncio: ClassVar[bool] = True
    request_level_only: ClassVar[bool] = True

    def __init__(self, config: Any, context: TierContext, **tunables: Any) -> None:
        options = config.options
        # Parked stores and fetches wait on peers, not on I/O: many may be open at once.
        tunables.setdefault("max_concurrent_loads", 1024)
        tunables.setdefault("max_concurrent_stores", 4096)
        super().__init__(config, context, **tunables)
        self.host: str = options["host"]
        self.port: int = options["port"]
        self.num_threads: int = options.get("num_threads", 4)
        #: Chunk transfers in flight per fetch, on each side.
        self.transfers_in_flight = 16 * self.num_threads
        self.unbound_store_timeout_s: float = options.get("unbound_store_timeout_s", 60.0)
        self.max_peers: int = options.get("max_peers", 128)
        self.handshake_timeout_s: float = options.get("handshake_timeout_s", 30.0)
        self.peer_lookup_timeout_s: float = options.get("lookup_timeout_s", 30.0)
        self.load_timeout_s: float = options.get("load_timeout_s", 30.0)
        self.idle_timeout_s: float = options.get("idle_timeout_s", 300.0)
        auth = options.get("auth")
        self.auth = CurveKeys(**dict(auth)) if auth else None
        self.peer_id = f"{self.host}:{self.port}"
        self.fingerprint = _fingerprint(context)
        self.seed = hash_seed(context.hash_algorithm)
        self._control: ControlPlane | None = None
        self._data: DataPlane | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # producer
        self._served: dict[str, _Served] = {}
        self._parked: dict[str, list[_Parked]] = {}  # kv_request_id -> parked store jobs
        self._bound: dict[str, str] = {}  # kv_request_id -> consumer peer id
        self._arrived: dict[str, anyio.Event] = {}  # kv_request_id -> set when a store is parked
        self._reaped: OrderedDict[str, float] = OrderedDict()  # kv_request_id -> until
        self._finish_later: list[RequestContext] = []  # remote lookup contexts to finish
        self._sending: dict[str, int] = {}  # kv_request_id -> fetches sending from its slots now
        self._release_after: dict[str, tuple[bool, str]] = {}  # releases waiting for those sends
        self._serving: dict[str, int] = {}  # kv_request_id -> fetches of it waiting or sending now
        self._lookup_pins = 0  # host slots pinned by every session's lookups
        self._limit_log = ThrottledLog(logger, interval_s=60.0)
        # consumer
        self._clients: dict[str, _Client] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # peer -> (retry at, next delay)
        self._probes: dict[str, _Probe] = {}  # kv_request_id -> probe state
        self._failed: OrderedDict[str, float] = OrderedDict()  # kv_request_ids whose peer failed
        self._rounds: dict[str, int] = {}
        self._declare_metrics()

    # --- metrics -------------------------------------------------------------------------------
    def _declare_metrics(self) -> None:
        self.m_peers = self.add_metric("p2p_peers", "gauge", "Peer sessions open, by role.", ("role",))
        self.m_refused = self.add_metric(
            "p2p_handshakes_refused", "counter", "Handshakes refused, by reason.", ("reason",))
        self.m_rejected = self.add_metric(
            "p2p_messages_rejected", "counter", "Control messages rejected, by reason.", ("reason",))
        self.m_bytes = self.add_metric("p2p_bytes", "counter", "Chunk bytes moved, by direction.", ("direction",))
        self.m_chunks = self.add_metric("p2p_chunks", "counter", "Chunks moved, by direction.", ("direction",))
        self.m_fetch = self.add_metric("p2p_fetch_latency_seconds", "histogram",
                                       "Consumer: Fetch sent to all chunks received, by outcome.", ("outcome",))
        self.m_lookups = self.add_metric("p2p_lookups", "counter",
                                         "Consumer: keys probed at a peer, by outcome (hit, miss, timed_out).",
                                         ("outcome",))
        self.m_open_requests = self.add_metric(
            "p2p_open_requests", "gauge",
            "Producer: request ids consumer sessions looked up or fetched and have not finished.")
        self.m_parked = self.add_metric("p2p_parked_batches", "gauge",
                                        "Producer: store jobs parked until a consumer fetches them.")
        self.m_waiting = self.add_metric("p2p_waiting_fetches", "gauge",
                                         "Producer: consumer fetches waiting for their chunks to be stored.")
        self.m_reaped = self.add_metric("p2p_reaped_ids", "counter",
                                        "Producer: request ids whose parked stores timed out unfetched.")
        self.m_refused_links = self.add_metric(
            "p2p_data_endpoints_refused", "counter",
            "Connections to the UCX data port closed: no, a bad or a reused token, another interface.")
        self.m_limits = self.add_metric(
            "p2p_limit_refusals", "counter",
            "Producer: lookups and fetches refused by a per-session bound, by limit.", ("limit",))
        self.m_connections_refused = self.add_metric(
            "p2p_connections_refused", "counter",
            "Producer: control connections refused (CurveZMQ key not trusted, handshake failed), by reason.",
            ("reason",))
        for limit in LIMITS:
            self.m_limits.inc(0, limit)
        for role in ("consumer", "producer"):
            self.m_peers.set(0, role)
        self.m_parked.set(0)
        self.m_open_requests.set(0)
        self.m_waiting.set(0)
        self._waiting_fetches = 0

    def _update_gauges(self) -> None:
        self.m_peers.set(sum(not c.dead for c in self._clients.values()), "consumer")
        self.m_peers.set(len(self._served), "producer")
        self.m_parked.set(sum(len(v) for v in self._parked.values()))
        self.m_open_requests.set(sum(len(served.requests) for served in self._served.values()))
        if self._control is not None:
            stats = self._control.statistics()
            for reason, count in stats.messages_rejected.items():
                self.m_rejected.values[(reason,)] = float(count)
            for reason, count in stats.connections_refused.items():
                self.m_connections_refused.values[(reason,)] = float(count)
        if self._data is not None:
            self.m_refused_links.values[()] = float(self._data.statistics().endpoints_refused)

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open both planes, serve until :meth:`aclose`, then release everything parked."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await super().run(task_status=task_status)
            finally:
                tg.cancel_scope.cancel()

    async def open(self) -> None:
        assert self._tg is not None
        data = DataPlane(host=self.host)
        control = ControlPlane(self.host, self.port, auth=self.auth)
        try:
            self.data_port = await data.start()
            await control.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await control.aclose()
                await data.aclose()
            raise
        self._data, self._control = data, control
        self._tg.start_soon(self._control_loop)
        self._tg.start_soon(self._housekeeping)
        self._tg.start_soon(data.guard)
        logger.info("tier %s: p2p control %s, UCX data port %d (listening on all interfaces: ucxx "
                    "takes no host; connections not on %s or without a token are closed)",
                    self.label, self.peer_id, self.data_port, self.host)

    async def close(self) -> None:
        # Everything parked or in flight is reported by the base (cancelled) once we return.
        for client in self._clients.values():
            if not client.dead and self._control is not None:
                self._control.send(client.peer_id, p.Disconnect(reason="shutdown"))
        if self._control is not None:
            await self._control.aclose()
        if self._data is not None:
            await self._data.aclose()
        self._parked.clear()

    # The per-chunk primitives are not used: loads and stores are whole fetches (see submit_*).
    async def write(self, key: bytes, src: memoryview) -> None:  # pragma: no cover - never called
        raise NotImplementedError("the p2p tier moves whole fetches, not single chunks")

    async def read(self, key: bytes, dst: memoryview) -> None:  # pragma: no cover - never called
        raise NotImplementedError("the p2p tier moves whole fetches, not single chunks")

    # --- roles ---------------------------------------------------------------------------------
    @staticmethod
    def _role(ctx: RequestContext | None) -> tuple[str, dict[str, Any]] | None:
        if ctx is None:
            return None
        params = ctx.params
        if params.remote_prefiller is not None:
            return "prefiller", dict(params.remote_prefiller)
        if params.remote_kv_source is not None:
            return "kv_source", dict(params.remote_kv_source)
        return None

    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy:
        role = self._role(ctx)
        if role is not None:
            self._client_for(role[1])  # start the handshake now, while the request is scheduled
        if ctx.params.remote_decoder is not None:
            return OffloadPolicy.REQUEST_LEVEL
        return OffloadPolicy.CHUNK_LEVEL

    # --- consumer: lookups ---------------------------------------------------------------------
    def lookup(self, key: bytes, ctx: RequestContext | None = None) -> LookupResult:
        role = self._role(ctx)
        if role is None or self._tier_closing:
            return LookupResult.MISS
        kind, fields = role
        rid = fields["kv_request_id"]
        if rid in self._failed:
            return LookupResult.MISS
        client = self._client_for(fields)
        if client is None or client.dead:
            return LookupResult.MISS
        if kind == "prefiller":
            return self._count_lookup(True, key, ctx)
        probe = self._probes.get(rid)
        if probe is None:
            probe = self._probes[rid] = _Probe(client.peer_id)
        verdict = probe.verdicts.get(key)
        if verdict is not None:
            return self._count_lookup(verdict, key, ctx)
        deadline = probe.asked.get(key)
        if deadline is None:
            probe.asked[key] = time.monotonic() + self.peer_lookup_timeout_s
            probe.batch.append(key)
        elif deadline < time.monotonic():
            probe.verdicts[key] = False
            self.m_lookups.inc(1, "timed_out")
            return self._count_lookup(False, key, ctx)
        return LookupResult.RETRY

    def on_schedule_end(self) -> None:
        """Send each probing request's new keys as one ``Lookup``."""
        for rid, probe in self._probes.items():
            if not probe.batch:
                continue
            batch, probe.batch = probe.batch, []
            for start in range(0, len(batch), p.MAX_KEYS_PER_MESSAGE):
                self._client_send(probe.peer_id, p.Lookup(
                    kv_request_id=rid, keys=batch[start:start + p.MAX_KEYS_PER_MESSAGE],
                    round_seq=probe.round_seq))
            probe.round_seq += 1

    def on_request_finished(self, ctx: RequestContext) -> None:
        role = self._role(ctx)
        if role is None:
            return
        rid = role[1]["kv_request_id"]
        probe = self._probes.pop(rid, None)
        peer = probe.peer_id if probe is not None else self._peer_of(role[1])
        # The terminal empty fetch: the producer releases whatever it still holds for the id.
        self._client_send(peer, p.Fetch(kv_request_id=rid, keys=[], block_indexes=[], round_seq=0))
        self._rounds.pop(rid, None)

    def has_pending_work(self) -> bool:
        return bool(self._unfinished or any(pr.batch or len(pr.asked) > len(pr.verdicts)
                                            for pr in self._probes.values()))

    # --- consumer: sessions --------------------------------------------------------------------
    @staticmethod
    def _peer_of(fields: dict[str, Any]) -> str:
        return f"{fields['remote_host']}:{fields['remote_port']}"

    def _client_for(self, fields: dict[str, Any]) -> _Client | None:
        """The session to the request's producer; opened (or re-opened after back-off) on demand."""
        peer = self._peer_of(fields)
        client = self._clients.get(peer)
        if client is not None and not client.dead:
            return client
        retry_at, _ = self._backoff.get(peer, (0.0, 0.0))
        if time.monotonic() < retry_at or self._control is None or self._tier_closing:
            return None
        if peer == self.peer_id:
            logger.warning("tier %s: a request names this instance (%s) as its KV source; ignored",
                           self.label, peer)
            return None
        if sum(not c.dead for c in self._clients.values()) >= self.max_peers:
            self.m_refused.inc(1, "max_peers")
            return None
        try:
            host, port = p.parse_peer_id(peer)
            self._control.connect(peer)
        except Exception as exc:
            logger.warning("tier %s: cannot open a session to %s: %s", self.label, peer, exc)
            self._client_died(peer, "connect_failed")
            return None
        client = self._clients[peer] = _Client(peer, host, port)
        self._control.send(peer, p.Connect(
            peer_id=self.peer_id, block_len=self.context.slot_bytes,
            num_blocks=self._num_slots(), config_fingerprint=self.fingerprint, hash_seed=self.seed))
        self._update_gauges()
        return client

    def _num_slots(self) -> int:
        host = self.context.host
        return max(1, getattr(host, "num_slots", 1)) if host is not None else 1

    def _client_send(self, peer: str, msg: p.Message) -> None:
        client = self._clients.get(peer)
        if client is None or client.dead or self._control is None:
            return
        if client.ack is None:
            client.outbox.append(msg)
            return
        if not self._control.send(peer, msg):
            self._client_died(peer, "send_failed")

    def _on_connect_ack(self, peer: str, msg: p.ConnectAck) -> None:
        client = self._clients.get(peer)
        if client is None or client.dead or client.ack is not None:
            self._violation(peer, "out_of_order")
            return
        problem = self._mismatch(msg)
        if problem is not None:
            logger.error("tier %s: producer %s refused: %s", self.label, peer, problem)
            self.m_refused.inc(1, problem.split(":", 1)[0])
            self._client_died(peer, "refused")
            return
        client.ack = msg
        client.last_activity = time.monotonic()
        assert self._tg is not None
        self._tg.start_soon(self._open_link, client)

    async def _open_link(self, client: _Client) -> None:
        assert self._data is not None and client.ack is not None
        try:
            client.link = await self._data.connect(client.host, client.ack.data_port, client.ack.token,
                                                   timeout=self.handshake_timeout_s)
        except (DataPlaneError, TimeoutError, OSError) as exc:
            logger.warning("tier %s: UCX link to %s failed: %s", self.label, client.peer_id, exc)
            self._client_died(client.peer_id, "link_failed")
            return
        self._backoff.pop(client.peer_id, None)
        client.acked.set()
        outbox, client.outbox = client.outbox, []
        for msg in outbox:
            self._client_send(client.peer_id, msg)

    def _client_died(self, peer: str, reason: str) -> None:
        """Reap a consumer session: its loads fail as misses, its probing requests answer MISS."""
        client = self._clients.get(peer)
        _, delay = self._backoff.get(peer, (0.0, 0.0))
        delay = BACKOFF_FIRST_S if delay == 0 else min(delay * 2, BACKOFF_MAX_S)
        self._backoff[peer] = (time.monotonic() + delay, delay)
        if client is None or client.dead:
            return
        client.dead = True
        logger.warning("tier %s: session to producer %s lost (%s); its requests recompute",
                       self.label, peer, reason)
        for key in client.done_waiters:
            client.done[key] = False
            client.done_waiters[key].set()
        client.acked.set()  # wake waiters; they see client.dead
        now = time.monotonic()
        for rid, probe in self._probes.items():
            if probe.peer_id == peer:
                self._failed[rid] = now + REAPED_ID_RETENTION_S
        if client.link is not None and self._tg is not None:
            self._tg.start_soon(_close_quietly, client.link)
        if self._control is not None and peer not in self._served:
            self._control.drop(peer)  # the DEALER also carries our answers while we serve the peer
        self._update_gauges()
        self._notify()

    # --- consumer: loads -----------------------------------------------------------------------
    def submit_load(self, job: TransferJob) -> None:
        record = _JobRecord(job, "load")
        self._register(record)
        role = self._role(job.ctx)
        if role is None or self._tg is None or self._tier_closing:
            self._fail(record, "closed" if self._tier_closing else "no_role")
            return
        client = self._client_for(role[1])
        if client is None:
            self._fail(record, "peer_unavailable")
            return
        self._tg.start_soon(self._guarded_load, record, client, role[1]["kv_request_id"])

    async def _guarded_load(self, record: _JobRecord, client: _Client, rid: str) -> None:
        try:
            await self._load(record, client, rid)
        except Exception:
            logger.exception("tier %s: load of request %s failed", self.label, rid)
            self._fail(record, "internal")  # no-op if it was reported already

    async def _load(self, record: _JobRecord, client: _Client, rid: str) -> None:
        job = record.job
        started = time.monotonic()
        round_seq = self._rounds.get(rid, 0)
        self._rounds[rid] = round_seq + 1
        host = self.context.host
        assert host is not None
        ok = False
        with anyio.move_on_after(self.load_timeout_s) as scope:
            await client.acked.wait()
            if client.dead or client.link is None:
                self._fail(record, "peer_lost")
                return
            views = host.views(job.slot_ids)
            done_key = (rid, round_seq)
            waiter = client.done_waiters[done_key] = anyio.Event()
            failures: list[BaseException] = []
            try:
                async with anyio.create_task_group() as outer:
                    link = client.link
                    limiter = anyio.Semaphore(self.transfers_in_flight)

                    async def receive(i: int) -> None:
                        async with limiter:
                            try:
                                await link.recv(views[i], chunk_tag(rid, round_seq, i))
                            except Exception as exc:  # DataPlaneError, or a bug: the load fails
                                failures.append(exc)
                                outer.cancel_scope.cancel()

                    async def watch() -> None:
                        # The producer gave up (TransferDone(success=False)) or the session died:
                        # stop waiting for chunks that will not come.
                        await waiter.wait()
                        if not client.done.get(done_key, False) or client.dead:
                            failures.append(_PeerGaveUp())
                            outer.cancel_scope.cancel()

                    outer.start_soon(watch)
                    async with anyio.create_task_group() as receives:
                        for i in range(len(views)):
                            receives.start_soon(receive, i)
                        self._client_send(client.peer_id, p.Fetch(
                            kv_request_id=rid, keys=list(job.keys), block_indexes=list(job.slot_ids),
                            round_seq=round_seq))
                    # Every chunk arrived whole (UCX matched each tag and size): the fetch is
                    # done; the producer's TransferDone only confirms it.
                    outer.cancel_scope.cancel()
                ok = not failures and not client.dead
            finally:
                client.done_waiters.pop((rid, round_seq), None)
                client.done.pop((rid, round_seq), None)
        elapsed = time.monotonic() - started
        if scope.cancelled_caught or not ok:
            if scope.cancelled_caught:
                # Tell the producer to stop; what it still sends goes nowhere (no recv posted).
                self._client_send(client.peer_id, p.AbortFetch(kv_request_id=rid, round_seq=round_seq))
            self.m_fetch.observe(elapsed, "timeout" if scope.cancelled_caught else "failure")
            self._fail(record, "timeout" if scope.cancelled_caught else
                       ("peer_lost" if client.dead else "peer_failed"))
            if client.link is not None and client.link.closed and not client.dead:
                # UCX cannot withdraw a posted receive: cancelling one closed the link. The
                # session starts over (new handshake, new token) for the next request.
                self._client_died(client.peer_id, "link_closed")
            return
        nbytes = len(job.keys) * self.context.slot_bytes
        self.m_fetch.observe(elapsed, "success")
        self.m_bytes.inc(nbytes, "received")
        self.m_chunks.inc(len(job.keys), "received")
        self._read_bytes_total += nbytes
        self._read_seconds_total += elapsed
        self._succeed(record, elapsed, nbytes)
        probe = self._probes.get(rid)
        if probe is not None:  # a re-scheduled request probes again (reference §5.5)
            probe.fetched = True
            for key in job.keys:
                probe.verdicts.pop(key, None)
                probe.asked.pop(key, None)

    def _on_transfer_done(self, peer: str, msg: p.TransferDone) -> None:
        client = self._clients.get(peer)
        key = (msg.kv_request_id, msg.round_seq)
        if client is None or key not in client.done_waiters:
            return  # a late answer to an aborted or finished fetch
        client.last_activity = time.monotonic()
        client.done[key] = msg.success
        client.done_waiters[key].set()

    def _on_lookup_resp(self, peer: str, msg: p.LookupResp) -> None:
        probe = self._probes.get(msg.kv_request_id)
        if probe is None or probe.peer_id != peer:
            return  # the request finished meanwhile
        client = self._clients.get(peer)
        if client is not None:
            client.last_activity = time.monotonic()
        for key, hit in zip(msg.keys, msg.hits, strict=True):
            if key in probe.asked and key not in probe.verdicts:
                probe.verdicts[key] = hit
                self.m_lookups.inc(1, "hit" if hit else "miss")
        self._notify()

    # --- producer: stores ----------------------------------------------------------------------
    def submit_store(self, job: TransferJob) -> None:
        record = _JobRecord(job, "store")
        self._register(record)
        decoder = job.ctx.params.remote_decoder if job.ctx is not None else None
        if decoder is None:
            self._fail(record, "no_request_id")
            return
        if self._tier_closing:
            self._fail(record, "closed")
            return
        rid = decoder["kv_request_id"]
        if rid in self._reaped:
            self._fail(record, "reaped")
            return
        self._park(rid, record)

    def _park(self, rid: str, record: _JobRecord, owner: _Served | None = None) -> None:
        self._parked.setdefault(rid, []).append(
            _Parked(record, set(record.job.keys), time.monotonic(), owner))
        event = self._arrived.pop(rid, None)
        if event is not None:
            event.set()
        self._update_gauges()

    def _release(self, rid: str, success: bool, reason: str) -> None:
        """Finish every parked job of ``rid`` (pins released by the manager).

        While a fetch of ``rid`` is sending from those slots, it is cancelled first and the jobs
        finish once its sends have stopped: a slot is never unpinned under a running send.
        """
        if self._sending.get(rid):
            self._release_after[rid] = (success, reason)
            peer = self._bound.get(rid)
            served = self._served.get(peer) if peer is not None else None
            if served is not None:
                for (fetch_rid, _round), scope in served.fetching.items():
                    if fetch_rid == rid:
                        scope.cancel()
            return
        for parked in self._parked.pop(rid, []):
            self._unpin(parked)
            if success:
                self._succeed(parked.record, time.monotonic() - parked.parked_at, 0)
            else:
                self._fail(parked.record, reason)
        self._update_gauges()

    def _unpin(self, parked: _Parked) -> None:
        """Account for a parked job that is about to finish (its pins go with it)."""
        if parked.owner is not None:
            count = len(parked.record.job.keys)
            parked.owner.pins -= count
            self._lookup_pins -= count

    def _succeed(self, record: _JobRecord, elapsed: float, nbytes: int) -> None:
        from kvtier.tiers.base import JobResult

        job = record.job
        self._post(record, JobResult(job_id=job.job_id, success=True, is_promotion=job.is_promotion,
                                     transfer_time=elapsed, transfer_bytes=nbytes))

    # --- producer: sessions and fetches ----------------------------------------------------------
    def _on_connect(self, peer: str, msg: p.Connect) -> None:
        assert self._control is not None and self._data is not None
        if msg.peer_id != peer:
            self._violation(peer, "identity_mismatch")
            return
        problem = self._mismatch(msg)
        old = self._served.get(peer)
        if problem is None and old is None and len(self._served) >= self.max_peers:
            problem = "max_peers: the session limit is reached"
        if problem is not None:
            logger.error("tier %s: consumer %s refused: %s", self.label, peer, problem)
            self.m_refused.inc(1, problem.split(":", 1)[0])
            with contextlib.suppress(Exception):
                self._control.connect(peer)
                self._control.send(peer, p.Disconnect(reason=problem[:200]))
                client = self._clients.get(peer)
                if client is None or client.dead:
                    self._control.drop(peer)  # closes after its linger: the Disconnect goes out
            return
        if old is not None:  # the consumer restarted: what it had bound is gone
            self._served_died(peer, "reconnected")
        try:
            self._control.connect(peer)
        except Exception as exc:
            logger.warning("tier %s: cannot answer consumer %s: %s", self.label, peer, exc)
            return
        token = self._data.issue_token(peer)
        served = self._served[peer] = _Served(peer, token)
        self._control.send(peer, p.ConnectAck(
            peer_id=self.peer_id, block_len=self.context.slot_bytes, num_blocks=self._num_slots(),
            config_fingerprint=self.fingerprint, hash_seed=self.seed, data_port=self.data_port, token=token))
        assert self._tg is not None
        self._tg.start_soon(self._accept_link, served)
        self._update_gauges()

    async def _accept_link(self, served: _Served) -> None:
        assert self._data is not None
        try:
            link = await self._data.accepted(served.peer_id, timeout=self.handshake_timeout_s)
        except (DataPlaneError, TimeoutError) as exc:
            logger.warning("tier %s: consumer %s did not open its UCX link: %s", self.label, served.peer_id, exc)
            self._served_died(served.peer_id, "no_link")
            return
        if self._served.get(served.peer_id) is not served:
            await _close_quietly(link)
            return
        served.link = link
        self._notify()

    def _served_of(self, peer: str) -> _Served | None:
        served = self._served.get(peer)
        if served is None:
            self._violation(peer, "out_of_order")  # no handshake first
        else:
            served.last_activity = time.monotonic()
        return served

    def _on_fetch(self, peer: str, msg: p.Fetch) -> None:
        served = self._served_of(peer)
        if served is None:
            return
        rid = msg.kv_request_id
        owner = self._bound.get(rid)
        if owner is not None and owner != peer:
            self._violation(peer, "foreign_request_id")
            return
        if not msg.keys:  # terminal: the consumer is done with this id
            if owner in (None, peer):
                self._release(rid, True, "")
                self._bound.pop(rid, None)
            served.requests.pop(rid, None)
            self._end_remote_lookup(served, rid)
            return
        failed = p.TransferDone(kv_request_id=rid, success=False, round_seq=msg.round_seq)
        if len(set(msg.keys)) != len(msg.keys) or (rid, msg.round_seq) in served.fetching:
            self._violation(peer, "duplicate_keys" if (rid, msg.round_seq) not in served.fetching
                            else "duplicate_round")
            self._control_send(peer, failed)
            return
        if rid in self._reaped:
            self._control_send(peer, failed)
            return
        if len(served.fetching) >= MAX_FETCHES_PER_SESSION:
            self._over_limit(served, "fetches")
            self._control_send(peer, failed)
            return
        if not self._admit_request(served, rid):
            self._control_send(peer, failed)
            return
        self._bound[rid] = peer
        assert self._tg is not None
        scope = anyio.CancelScope()
        served.fetching[(rid, msg.round_seq)] = scope
        self._serving[rid] = self._serving.get(rid, 0) + 1
        self._tg.start_soon(self._guarded_serve, served, msg, scope)

    async def _guarded_serve(self, served: _Served, msg: p.Fetch, scope: anyio.CancelScope) -> None:
        rid = msg.kv_request_id
        try:
            await self._serve_fetch(served, msg, scope)
        except Exception:
            logger.exception("tier %s: serving fetch %s failed", self.label, rid)
            served.fetching.pop((rid, msg.round_seq), None)
            self._control_send(served.peer_id, p.TransferDone(
                kv_request_id=rid, success=False, round_seq=msg.round_seq))
        finally:
            served.fetching.pop((rid, msg.round_seq), None)
            self._serving[rid] -= 1
            if not self._serving[rid]:
                del self._serving[rid]
                self._arrived.pop(rid, None)  # nobody waits for its stores any more
            if rid in served.requests:
                served.requests[rid] = time.monotonic()  # idle from now on
                if not self._serving.get(rid) and rid not in self._parked and rid not in served.lookups:
                    # Nothing held for it any more: it no longer counts against the session.
                    served.requests.pop(rid)
                    if self._bound.get(rid) == served.peer_id:
                        del self._bound[rid]

    async def _serve_fetch(self, served: _Served, msg: p.Fetch, scope: anyio.CancelScope) -> None:
        rid, round_seq = msg.kv_request_id, msg.round_seq
        wanted = {key: i for i, key in enumerate(msg.keys)}
        success = False
        started = time.monotonic()
        with scope:
            with anyio.move_on_after(STORE_SERVE_TIMEOUT_S):
                # Wait until the link is up and every wanted chunk has been parked (stores may
                # arrive after the fetch).
                self._waiting_fetches += 1
                self.m_waiting.set(self._waiting_fetches)
                try:
                    while served.link is None or not self._all_parked(rid, wanted):
                        event = self._arrived.setdefault(rid, anyio.Event())
                        with anyio.move_on_after(HOUSEKEEPING_S):
                            await event.wait()
                        if self._served.get(served.peer_id) is not served:
                            return
                        if rid in self._reaped:  # released meanwhile: this fetch cannot be served
                            scope.cancel()
                            break
                finally:
                    self._waiting_fetches -= 1
                    self.m_waiting.set(self._waiting_fetches)
                host = self.context.host
                assert host is not None and served.link is not None
                sources = self._sources(rid, wanted)
                limiter = anyio.Semaphore(self.transfers_in_flight)
                failures: list[BaseException] = []
                self._sending[rid] = self._sending.get(rid, 0) + 1
                try:
                    async with anyio.create_task_group() as tg:
                        async def send(key: bytes, slot: int) -> None:
                            async with limiter:
                                try:
                                    await served.link.send(host.view(slot), chunk_tag(rid, round_seq, wanted[key]))  # type: ignore[union-attr]
                                except Exception as exc:  # DataPlaneError, or a bug: the fetch fails
                                    failures.append(exc)
                                    tg.cancel_scope.cancel()

                        for key, slot in sources.items():
                            tg.start_soon(send, key, slot)
                    success = not failures
                finally:
                    self._sending[rid] -= 1
                    if not self._sending[rid]:
                        del self._sending[rid]
                        later = self._release_after.pop(rid, None)
                        if later is not None:
                            self._release(rid, *later)
                        elif rid in self._parked:
                            self._finish_sent(rid)  # jobs another round emptied meanwhile
        served.fetching.pop((rid, round_seq), None)
        if self._served.get(served.peer_id) is not served:
            return
        if served.link is not None and served.link.closed and self._served.get(served.peer_id) is served:
            # A cancelled or failed send closed the link (UCX cannot withdraw one): this session
            # is over; the consumer reconnects for its next request.
            self._served_died(served.peer_id, "link_closed")
            return
        if success:
            nbytes = len(wanted) * self.context.slot_bytes
            self.m_bytes.inc(nbytes, "sent")
            self.m_chunks.inc(len(wanted), "sent")
            self._written_bytes_total += nbytes
            self._written_seconds_total += time.monotonic() - started
            self._mark_sent(rid, set(wanted))
        elif not scope.cancel_called:
            logger.warning("tier %s: fetch %s round %d for %s failed", self.label, rid, round_seq, served.peer_id)
        if not scope.cancel_called:
            self._control_send(served.peer_id, p.TransferDone(kv_request_id=rid, success=success,
                                                              round_seq=round_seq))

    def _all_parked(self, rid: str, wanted: dict[bytes, int]) -> bool:
        have: set[bytes] = set()
        for parked in self._parked.get(rid, ()):
            have.update(parked.record.job.keys)
        return all(key in have for key in wanted)

    def _sources(self, rid: str, wanted: dict[bytes, int]) -> dict[bytes, int]:
        """Wanted key -> the host slot a parked (pinned) job holds it in."""
        sources: dict[bytes, int] = {}
        for parked in self._parked.get(rid, ()):
            job = parked.record.job
            for key, slot in zip(job.keys, job.slot_ids):
                if key in wanted and key not in sources:
                    sources[key] = slot
        return sources

    def _mark_sent(self, rid: str, sent: set[bytes]) -> None:
        """Parked jobs all of whose chunks were sent are done (their pins are released) — once no
        fetch of ``rid`` is still sending: another round may be reading the same slots."""
        for parked in self._parked.get(rid, []):
            parked.unsent -= sent
        self._finish_sent(rid)

    def _finish_sent(self, rid: str) -> None:
        if self._sending.get(rid):
            return  # the last sender of rid calls this again
        remaining: list[_Parked] = []
        for parked in self._parked.get(rid, []):
            if parked.unsent:
                remaining.append(parked)
            else:
                self._unpin(parked)
                self._succeed(parked.record, time.monotonic() - parked.parked_at, 0)
        if remaining:
            self._parked[rid] = remaining
        else:
            self._parked.pop(rid, None)
        self._update_gauges()

    def _on_abort(self, peer: str, msg: p.AbortFetch) -> None:
        served = self._served_of(peer)
        if served is None:
            return
        scope = served.fetching.pop((msg.kv_request_id, msg.round_seq), None)
        if scope is not None:
            scope.cancel()  # sends in flight are cancelled; the pins stay until released
        self._control_send(peer, p.AbortAck(kv_request_id=msg.kv_request_id, round_seq=msg.round_seq))

    def _served_died(self, peer: str, reason: str) -> None:
        served = self._served.pop(peer, None)
        if served is None:
            return
        logger.warning("tier %s: consumer %s gone (%s); releasing what it had bound", self.label, peer, reason)
        for scope in served.fetching.values():
            scope.cancel()
        for rid in list(served.requests):
            self._forget_request(served, rid, "peer_lost")
        link = self._data.revoke(peer) if self._data is not None else None
        for stale in {id(x): x for x in (link, served.link) if x is not None}.values():
            if self._tg is not None:
                self._tg.start_soon(_close_quietly, stale)
        client = self._clients.get(peer)
        if self._control is not None and (client is None or client.dead):
            self._control.drop(peer)  # the DEALER also carries our requests while we consume
        self._update_gauges()

    # --- producer: a peer's lookups ------------------------------------------------------------
    def _on_lookup(self, peer: str, msg: p.Lookup) -> None:
        served = self._served_of(peer)
        if served is None:
            return
        rid = msg.kv_request_id
        if rid in self._reaped or not self._admit_request(served, rid):
            self._answer_miss(served, rid, msg.keys)  # a reaped id is refused, as its fetches are
            return
        room = MAX_PENDING_LOOKUP_KEYS - served.pending_keys
        if room < len(msg.keys):
            self._over_limit(served, "lookup_keys", len(msg.keys) - max(0, room))
            self._answer_miss(served, rid, msg.keys[max(0, room):])
        keys = msg.keys[:max(0, room)]
        if not keys:
            return
        state = served.lookups.get(rid)
        if state is None:
            state = served.lookups[rid] = _RemoteLookup(RequestContext(f"p2p:{peer}:{rid}"))
        give_up = time.monotonic() + LOOKUP_PENDING_TIMEOUT_S
        state.queue.extend((key, give_up) for key in keys)
        served.pending_keys += len(keys)
        self._notify()  # the engine polls the manager, which calls serve_external_requests

    def _admit_request(self, served: _Served, rid: str) -> bool:
        """Note the session's activity on ``rid``; False if it is a new id over the session's bound."""
        if rid not in served.requests and len(served.requests) >= MAX_REQUESTS_PER_SESSION:
            self._over_limit(served, "requests")
            return False
        served.requests[rid] = time.monotonic()
        return True

    def _answer_miss(self, served: _Served, rid: str, keys: list[bytes]) -> None:
        if keys:
            self._control_send(served.peer_id, p.LookupResp(kv_request_id=rid, keys=list(keys),
                                                            hits=[False] * len(keys)))

    def serve_external_requests(self, parent: ParentManager) -> None:
        for ctx in self._finish_later:
            parent.on_request_finished(ctx)
        self._finish_later.clear()
        now = time.monotonic()
        for served in list(self._served.values()):
            for rid, state in list(served.lookups.items()):
                # An answer below can find the session dead (its queue full): it was reaped then,
                # and nothing may be pinned for it any more.
                if self._served.get(served.peer_id) is not served:
                    break
                if served.lookups.get(rid) is not state or not state.queue:
                    continue
                if not state.started:
                    parent.on_new_request(state.ctx)
                    state.started = True
                keys: list[bytes] = []
                hits: list[bool] = []
                waiting: list[tuple[bytes, float]] = []
                for key, give_up in state.queue:
                    verdict = parent.lookup(key, state.ctx)
                    if verdict is LookupResult.HIT:
                        keys.append(key)
                        hits.append(True)
                    elif verdict is LookupResult.MISS or give_up <= now:
                        keys.append(key)
                        hits.append(False)
                    else:  # HIT_PENDING (a promotion runs) or RETRY: answer once resolved
                        waiting.append((key, give_up))
                served.pending_keys -= len(state.queue) - len(waiting)
                state.queue = waiting
                self._pin_hits(parent, served, rid, state, keys, hits)
                if keys:
                    self._control_send(served.peer_id, p.LookupResp(kv_request_id=rid, keys=keys, hits=hits))

    def _pin_hits(self, parent: ParentManager, served: _Served, rid: str, state: _RemoteLookup,
                  keys: list[bytes], hits: list[bool]) -> None:
        """Pin the chunks found for a peer's lookup (they are served like a remote_decoder
        request's), within the pin bounds; a hit over them is answered MISS (in place)."""
        if self._bound.get(rid, served.peer_id) != served.peer_id or rid in self._reaped:
            hits[:] = [False] * len(hits)  # another consumer's request id, or one given up on
            return
        held = self._sources(rid, dict.fromkeys(k for k, h in zip(keys, hits) if h)) if rid in self._parked else {}
        slots = self._num_slots()
        room = min(int(slots * SESSION_PIN_SHARE) - served.pins, int(slots * ALL_SESSIONS_PIN_SHARE) - self._lookup_pins)
        new: list[bytes] = []
        refused = 0
        for i, (key, hit) in enumerate(zip(keys, hits)):
            if not hit or key in held:
                continue  # already pinned for this id by an earlier lookup: no second pin
            if len(new) < room:
                new.append(key)
                held[key] = -1
            else:
                hits[i] = False
                refused += 1
        if refused:
            self._over_limit(served, "pins", refused)
        if not new:
            return
        job = parent.create_store_job(new, state.ctx)
        record = _JobRecord(job, "store")
        self._register(record)
        self._bound[rid] = served.peer_id
        served.pins += len(new)
        self._lookup_pins += len(new)
        self._park(rid, record, owner=served)

    def _end_remote_lookup(self, served: _Served, rid: str) -> None:
        state = served.lookups.pop(rid, None)
        if state is None:
            return
        served.pending_keys -= len(state.queue)
        if state.started:
            self._finish_later.append(state.ctx)
            self._notify()

    def _forget_request(self, served: _Served, rid: str, reason: str) -> None:
        """The session is done with ``rid`` (died, or left it idle): what it bound is released
        (failed with ``reason``) and the id reaped; its lookups end."""
        served.requests.pop(rid, None)
        if self._bound.get(rid) == served.peer_id:
            self._release(rid, False, reason)  # while still bound: it finds the fetches to cancel
            del self._bound[rid]
            # Its consumer is gone or gave up: late stores fail instead of parking.
            self._reaped[rid] = time.monotonic() + REAPED_ID_RETENTION_S
            self._reaped.move_to_end(rid)
        self._end_remote_lookup(served, rid)

    def _over_limit(self, served: _Served, limit: str, count: int = 1) -> None:
        self.m_limits.inc(count, limit)
        self._limit_log(f"{served.peer_id} {limit}", "tier %s: consumer %s is over its %s bound; refused",
                        self.label, served.peer_id, limit)

    # --- control messages ----------------------------------------------------------------------
    async def _control_loop(self) -> None:
        assert self._control is not None
        handlers = {
            p.Connect: self._on_connect, p.ConnectAck: self._on_connect_ack, p.Lookup: self._on_lookup,
            p.LookupResp: self._on_lookup_resp, p.Fetch: self._on_fetch, p.TransferDone: self._on_transfer_done,
            p.AbortFetch: self._on_abort, p.AbortAck: _ignore, p.Disconnect: self._on_disconnect,
        }
        while True:
            try:
                item = await self._control.recv()
            except PeerUnavailable:  # the plane was closed
                return
            if isinstance(item, PeerDown):
                self._client_died(item.peer_id, item.reason)
                self._served_died(item.peer_id, item.reason)
                continue
            peer, msg = item
            try:
                handlers[type(msg)](peer, msg)
            except Exception:
                logger.exception("tier %s: handling %s from %s failed", self.label, type(msg).__name__, peer)
                self._violation(peer, "handler_error")

    def _on_disconnect(self, peer: str, msg: p.Disconnect) -> None:
        if peer in self._clients and self._clients[peer].ack is None and msg.reason:
            self.m_refused.inc(1, msg.reason.split(":", 1)[0][:32])
            logger.error("tier %s: producer %s refused the session: %s", self.label, peer, msg.reason)
        self._client_died(peer, f"disconnect: {msg.reason}" if msg.reason else "disconnect")
        self._served_died(peer, "disconnect")

    def _control_send(self, peer: str, msg: p.Message) -> None:
        if self._control is not None and not self._control.send(peer, msg):
            self._served_died(peer, "send_failed")

    def _violation(self, peer: str, reason: str) -> None:
        if self._control is not None:
            self._control.violation(peer, reason)

    def _mismatch(self, msg: p.Connect | p.ConnectAck) -> str | None:
        if msg.block_len != self.context.slot_bytes:
            return f"slot_bytes: peer {msg.block_len}, here {self.context.slot_bytes}"
        if msg.config_fingerprint and self.fingerprint and msg.config_fingerprint != self.fingerprint:
            return (f"config_fingerprint: peer {msg.config_fingerprint}, here {self.fingerprint} "
                    "(another model, dtype, block size or layout)")
        if msg.hash_seed != self.seed:
            return "hash_seed: the NONE_HASH seeds differ (set the same PYTHONHASHSEED on both)"
        return None

    # --- timeouts ------------------------------------------------------------------------------
    def _near_session_cap(self) -> bool:
        """Idle sessions are closed only when sessions run short (reference §5.6)."""
        live = sum(not c.dead for c in self._clients.values())
        return live >= self.max_peers - min(8, self.max_peers - 1)

    async def _housekeeping(self) -> None:
        while True:
            await anyio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            for peer, client in list(self._clients.items()):
                if client.dead:
                    if now >= self._backoff.get(peer, (0.0, 0.0))[0] + BACKOFF_MAX_S:
                        del self._clients[peer]
                elif client.ack is None and now - client.connected_at > self.handshake_timeout_s:
                    self.m_refused.inc(1, "handshake_timeout")
                    self._client_died(peer, "handshake_timeout")
                elif self.idle_timeout_s and now - client.last_activity > self.idle_timeout_s and \
                        not client.done_waiters and not any(pr.peer_id == peer for pr in self._probes.values()) \
                        and self._near_session_cap():
                    self._client_died(peer, "idle")
            for served in list(self._served.values()):
                for rid, touched in list(served.requests.items()):
                    state = served.lookups.get(rid)
                    if now - touched > self.unbound_store_timeout_s and not self._serving.get(rid) \
                            and not (state is not None and state.queue):
                        if rid in self._parked and self._bound.get(rid) == served.peer_id:
                            logger.warning("tier %s: consumer %s left request %s idle for %.0f s; "
                                           "releasing what it pinned", self.label, served.peer_id, rid,
                                           self.unbound_store_timeout_s)
                            self.m_reaped.inc()
                        self._forget_request(served, rid, "unbound_timeout")
            for rid, parked in list(self._parked.items()):
                if rid in self._bound:  # a consumer's fetch or lookup bound it: see above
                    continue
                if parked and now - min(x.parked_at for x in parked) > self.unbound_store_timeout_s:
                    logger.warning("tier %s: request %s was never fetched within %.0f s; releasing it",
                                   self.label, rid, self.unbound_store_timeout_s)
                    self._release(rid, False, "unbound_timeout")
                    self._reaped[rid] = now + REAPED_ID_RETENTION_S
                    self._reaped.move_to_end(rid)
                    self.m_reaped.inc()
            for expiring in (self._reaped, self._failed):
                while expiring and next(iter(expiring.values())) < now:
                    expiring.popitem(last=False)
            if any(state.queue for s in self._served.values() for state in s.lookups.values()):
                self._notify()  # pending remote lookups: have the engine serve them again
            if any(pr.asked for pr in self._probes.values()):
                self._notify()  # probe deadlines: let waiting loads re-check
            self._update_gauges()


def _fingerprint(context: TierContext) -> str:
    """16 hex of SHA-256 over the run fields (as the fs namespace) plus the page geometry.

    The run fields of reference §3.2 do not name the head count or size, and two geometries can
    round up to the same slot size: a peer whose pages hold other shapes must not pass.
    """
    fields: dict[str, Any] = dict(context.run_fields)
    geometry = context.geometry
    if geometry is not None:
        fields["kvtier_page_shape"] = list(geometry.page_shape)
        fields["kvtier_chunk_bytes"] = geometry.chunk_bytes(context.blocks_per_chunk)
    return run_fingerprint(fields).hex()[:16] if fields else ""


class _PeerGaveUp(Exception):
    """The producer answered TransferDone(success=False), or the session died, mid-fetch."""


def _ignore(peer: str, msg: p.Message) -> None:
    return None


async def _close_quietly(link: Link) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
        try:
            await link.close()
        except Exception:
            pass

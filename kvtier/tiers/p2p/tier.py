"""``P2PTier``: KV chunks between kvtier instances — control over ZeroMQ, bytes over UCX.

The tier holds no storage of its own. It composes two roles, each in its own module and each
handed only what it may call (:mod:`.roles`):

* the **producer** (:mod:`.producer`) serves what the local stack holds: chunks its
  ``remote_decoder`` requests cascade to it (parked with their host pins until the consumer's
  fetch binds them) and, for a peer's lookups (``remote_kv_source``), whatever the rest of the
  stack finds (host memory, or an fs/obj tier through a promotion);
* the **consumer** (:mod:`.consumer`) fetches a peer's chunks (``remote_prefiller``,
  ``remote_kv_source``) straight into the host slots the manager allocated.

Roles come from the request's ``kv_transfer_params`` (validated by
:class:`kvtier.config.RequestParams`). Every wait has a deadline and a failure costs a recompute.

Sessions: a consumer opens one to each producer it uses (``Connect`` → ``ConnectAck`` carrying
the producer's UCX port and a per-session token; the consumer's UCX endpoint presents the token
first). Both ends check slot bytes, the run's config fingerprint and the ``NONE_HASH`` seed and
refuse a mismatch with a log line naming it. A dead peer (heartbeats, monitor events, a failed
transfer) has its sessions reaped: the consumer's pending loads fail as misses within
``load_timeout_s``; the producer's jobs bound to it are released. Reconnects back off (1 s
doubling to 60 s). The producer's bounds on what one consumer session may make it hold are
stated in :mod:`.producer`.

Requires asyncio (ucxx's asynchronous API does): ``kvtier.open`` refuses it under trio.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import anyio
from anyio.abc import TaskStatus

from kvtier.context import RequestContext
from kvtier.keys import hash_seed
from kvtier.tiers.base import ParentManager, SecondaryTier, TierContext
from kvtier.tiers.jobs import TransferJob
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.consumer import Consumer
from kvtier.tiers.p2p.control import ControlPlane, CurveKeys, PeerDown, PeerUnavailable
from kvtier.tiers.p2p.data import DataPlane
from kvtier.tiers.p2p.producer import (
    MAX_FETCHES_PER_SESSION,
    MAX_PENDING_LOOKUP_KEYS,
    MAX_REQUESTS_PER_SESSION,
    SESSION_PIN_SHARE,
    Producer,
)
from kvtier.tiers.p2p.roles import (
    HOUSEKEEPING_S,
    LIMITS,
    LocalIdentity,
    P2PMetrics,
    P2POptions,
    Planes,
    RoleParts,
    TierHooks,
)
from kvtier.types import CacheHitSource, LookupResult, OffloadPolicy

__all__ = ["P2PTier", "LIMITS", "MAX_FETCHES_PER_SESSION", "MAX_PENDING_LOOKUP_KEYS", "MAX_REQUESTS_PER_SESSION",
           "SESSION_PIN_SHARE"]

logger = logging.getLogger(__name__)


class P2PTier(SecondaryTier):
    """Options (``config.options``): see the module docstring and README "Peer-to-peer tier".

    ``consumer`` and ``producer`` are the two roles; ``planes`` holds the control and data
    planes once the tier is open.
    """

    tier_type: ClassVar[str] = "p2p"
    medium = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    requires_asyncio: ClassVar[bool] = True
    request_level_only: ClassVar[bool] = True
    serves_external_requests: ClassVar[bool] = True

    def __init__(self, config: Any, context: TierContext, **tunables: Any) -> None:
        # Parked stores and fetches wait on peers, not on I/O: many may be open at once.
        tunables.setdefault("max_concurrent_loads", 1024)
        tunables.setdefault("max_concurrent_stores", 4096)
        super().__init__(config, context, **tunables)
        self.options = P2POptions.from_config(config)
        auth = config.options.get("auth")
        self.auth = CurveKeys(**dict(auth)) if auth else None
        self.host, self.port = self.options.host, self.options.port
        self.peer_id = f"{self.host}:{self.port}"
        self.identity = LocalIdentity.of(self.peer_id, context, hash_seed(context.hash_algorithm))
        self.planes = Planes()
        self.metrics = P2PMetrics(self.add_metric)
        hooks = TierHooks(
            label=self.label, open_job=self.open_job, succeed_job=self.succeed_job, fail_job=self.fail_job,
            record_transfer=self.record_transfer, count_lookup=self.count_lookup, notify=self.notify_manager,
            closing=lambda: self.closing, update_gauges=self._update_gauges,
        )
        parts = RoleParts(hooks, self.planes, self.identity, self.options, self.metrics)
        self.producer = Producer(parts, peer_consumed=lambda peer: self.consumer.has_session(peer))
        self.consumer = Consumer(parts, peer_served=self.producer.serves)

    def _update_gauges(self) -> None:
        metrics = self.metrics
        metrics.peers.set(self.consumer.live_sessions(), "consumer")
        metrics.peers.set(len(self.producer.served), "producer")
        metrics.parked.set(self.producer.parked_jobs())
        metrics.open_requests.set(self.producer.open_requests())
        control, data = self.planes.control, self.planes.data
        if control is not None:
            stats = control.statistics()
            for reason, count in stats.messages_rejected.items():
                metrics.rejected.values[(reason,)] = float(count)
            for reason, count in stats.connections_refused.items():
                metrics.connections_refused.values[(reason,)] = float(count)
        if data is not None:
            metrics.refused_links.values[()] = float(data.statistics().endpoints_refused)

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open both planes, serve until :meth:`aclose`, then release everything parked."""
        async with anyio.create_task_group() as tg:
            self.planes.tg = tg
            try:
                await super().run(task_status=task_status)
            finally:
                tg.cancel_scope.cancel()

    async def open(self) -> None:
        tg = self.planes.tg
        assert tg is not None
        data = DataPlane(host=self.host)
        control = ControlPlane(self.host, self.port, auth=self.auth)
        try:
            data_port = await data.start()
            await control.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await control.aclose()
                await data.aclose()
            raise
        self.planes.data, self.planes.control, self.planes.data_port = data, control, data_port
        tg.start_soon(self._control_loop)
        tg.start_soon(self._housekeeping)
        tg.start_soon(data.guard)
        logger.info("tier %s: p2p control %s, UCX data port %d (listening on all interfaces: ucxx "
                    "takes no host; connections not on %s or without a token are closed)",
                    self.label, self.peer_id, data_port, self.host)

    @property
    def data_port(self) -> int:
        """The UCX data plane's port (0 until the tier is open)."""
        return self.planes.data_port

    async def close(self) -> None:
        # Everything parked or in flight is reported by the base (cancelled) once we return.
        self.consumer.disconnect_all()
        if self.planes.control is not None:
            await self.planes.control.aclose()
        if self.planes.data is not None:
            await self.planes.data.aclose()
        self.producer.clear()

    # The per-chunk primitives are not used: loads and stores are whole fetches (see submit_*).
    async def write(self, key: bytes, src: memoryview) -> None:  # pragma: no cover - never called
        raise NotImplementedError("the p2p tier moves whole fetches, not single chunks")

    async def read(self, key: bytes, dst: memoryview) -> None:  # pragma: no cover - never called
        raise NotImplementedError("the p2p tier moves whole fetches, not single chunks")

    # --- requests ------------------------------------------------------------------------------
    def on_new_request(self, ctx: RequestContext) -> OffloadPolicy:
        self.consumer.on_new_request(ctx)
        if ctx.params.remote_decoder is not None:
            return OffloadPolicy.REQUEST_LEVEL
        return OffloadPolicy.CHUNK_LEVEL

    def lookup(self, key: bytes, ctx: RequestContext | None = None) -> LookupResult:
        return self.consumer.lookup(key, ctx)

    def on_schedule_end(self) -> None:
        """Send each probing request's new keys as one ``Lookup``."""
        self.consumer.on_schedule_end()

    def on_request_finished(self, ctx: RequestContext) -> None:
        self.consumer.on_request_finished(ctx)

    def has_pending_work(self) -> bool:
        return self.has_open_jobs or self.consumer.has_pending_probes()

    def submit_load(self, job: TransferJob) -> None:
        self.consumer.submit_load(job)

    def submit_store(self, job: TransferJob) -> None:
        self.producer.submit_store(job)

    def serve_external_requests(self, parent: ParentManager) -> None:
        self.producer.serve_external_requests(parent)

    # --- control messages ----------------------------------------------------------------------
    async def _control_loop(self) -> None:
        control = self.planes.control
        assert control is not None
        consumer, producer = self.consumer, self.producer
        handlers = {
            p.Connect: producer.on_connect, p.ConnectAck: consumer.on_connect_ack, p.Lookup: producer.on_lookup,
            p.LookupResp: consumer.on_lookup_resp, p.Fetch: producer.on_fetch,
            p.TransferDone: consumer.on_transfer_done, p.AbortFetch: producer.on_abort, p.AbortAck: _ignore,
            p.Disconnect: self._on_disconnect,
        }
        while True:
            try:
                item = await control.recv()
            except PeerUnavailable:  # the plane was closed
                return
            if isinstance(item, PeerDown):
                consumer.peer_gone(item.peer_id, item.reason)
                producer.peer_gone(item.peer_id, item.reason)
                continue
            peer, msg = item
            try:
                handlers[type(msg)](peer, msg)  # type: ignore[operator]
            except Exception:
                logger.exception("tier %s: handling %s from %s failed", self.label, type(msg).__name__, peer)
                self.planes.violation(peer, "handler_error")

    def _on_disconnect(self, peer: str, msg: p.Disconnect) -> None:
        self.consumer.on_disconnect(peer, msg)
        self.producer.peer_gone(peer, "disconnect")

    # --- timeouts ------------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        while True:
            await anyio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            self.consumer.housekeep(now)
            self.producer.housekeep(now)
            self.consumer.expire(now)
            if self.producer.has_queued_lookups():
                self.notify_manager()  # pending remote lookups: have the engine serve them again
            if self.consumer.waits_on_deadlines():
                self.notify_manager()  # probe deadlines: let waiting loads re-check
            self._update_gauges()


def _ignore(peer: str, msg: p.Message) -> None:
    return None

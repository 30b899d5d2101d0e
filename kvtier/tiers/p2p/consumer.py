"""The p2p tier's consumer role: sessions to producers, lookups at them, fetches from them.

A request names its producer in ``kv_transfer_params``:

* ``remote_prefiller: {kv_request_id, remote_host, remote_port}`` — classic P/D: every key is a
  HIT (the prefiller holds the prompt); promotions become one ``Fetch`` per step.
* ``remote_kv_source`` (same fields) — probing: lookups answer RETRY while a ``Lookup`` is
  outstanding and resolve (HIT or MISS) within the tier's ``lookup_timeout_s``.

Semantics callers rely on:

* Every load is reported exactly once (through :class:`~.roles.TierHooks`), within
  ``load_timeout_s``: a dead session, a producer that gives up or a timeout fail it
  (``peer_lost``, ``peer_failed``, ``timeout``) and the request recomputes.
* A session opens on demand (``Connect`` → ``ConnectAck`` with the producer's UCX port and a
  per-session token, presented first on the UCX link) and is refused on a slot size, run
  fingerprint or ``NONE_HASH`` seed mismatch. A dead session backs off before it reopens (1 s
  doubling to 60 s); the requests probing it answer MISS for a while.
* A request that finished sends the terminal empty ``Fetch``: the producer releases what it still
  holds for the id.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from kvtier.context import RequestContext
from kvtier.tiers.jobs import JobHandle, TransferJob
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.data import DataPlaneError, Link, chunk_tag
from kvtier.tiers.p2p.roles import (
    REAPED_ID_RETENTION_S,
    Role,
    RoleParts,
    close_quietly,
)
from kvtier.types import LookupResult

__all__ = ["Consumer", "request_role", "BACKOFF_FIRST_S", "BACKOFF_MAX_S"]

# Both roles log as the tier does: operators filter the p2p tier's records by that one name.
logger = logging.getLogger("kvtier.tiers.p2p.tier")

#: Reconnect back-off after a session to a peer died: first retry after 1 s, doubling to 60 s.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0


def request_role(ctx: RequestContext | None) -> tuple[str, dict[str, Any]] | None:
    """``("prefiller" | "kv_source", fields)`` when the request consumes from a peer, else None."""
    if ctx is None:
        return None
    params = ctx.params
    if params.remote_prefiller is not None:
        return "prefiller", dict(params.remote_prefiller)
    if params.remote_kv_source is not None:
        return "kv_source", dict(params.remote_kv_source)
    return None


def peer_of(fields: dict[str, Any]) -> str:
    return f"{fields['remote_host']}:{fields['remote_port']}"


@dataclass(eq=False)
class _Client:
    """Our session to one producer."""

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
    """One request's lookups sent to its ``remote_kv_source``."""

    peer_id: str
    verdicts: dict[bytes, bool] = field(default_factory=dict)
    batch: list[bytes] = field(default_factory=list)
    asked: dict[bytes, float] = field(default_factory=dict)  # key -> deadline
    round_seq: int = 0
    fetched: bool = False


class _PeerGaveUp(Exception):
    """The producer answered TransferDone(success=False), or the session died, mid-fetch."""


class Consumer(Role):
    """The consumer side of every session this instance opened (see the module docstring).

    ``peer_served(peer)`` tells whether the producer role serves ``peer`` too (the control
    connection to it is then kept when our session dies).
    """

    def __init__(self, parts: RoleParts, peer_served: Callable[[str], bool]) -> None:
        super().__init__(parts)
        self._peer_served = peer_served
        self._clients: dict[str, _Client] = {}
        self._backoff: dict[str, tuple[float, float]] = {}  # peer -> (retry at, next delay)
        self._probes: dict[str, _Probe] = {}  # kv_request_id -> probe state
        self._failed: OrderedDict[str, float] = OrderedDict()  # kv_request_ids whose peer failed
        self._rounds: dict[str, int] = {}

    # --- state the tier reads --------------------------------------------------------------------
    def has_session(self, peer: str) -> bool:
        """True while a session to ``peer`` is open (or opening)."""
        client = self._clients.get(peer)
        return client is not None and not client.dead

    def live_sessions(self) -> int:
        return sum(not c.dead for c in self._clients.values())

    def has_pending_probes(self) -> bool:
        """True while a probing request has keys to send or answers to wait for."""
        return any(pr.batch or len(pr.asked) > len(pr.verdicts) for pr in self._probes.values())

    # --- requests --------------------------------------------------------------------------------
    def on_new_request(self, ctx: RequestContext) -> None:
        role = request_role(ctx)
        if role is not None:
            self._client_for(role[1])  # start the handshake now, while the request is scheduled

    def lookup(self, key: bytes, ctx: RequestContext | None) -> LookupResult:
        role = request_role(ctx)
        if role is None or self._hooks.closing():
            return LookupResult.MISS
        kind, fields = role
        rid = fields["kv_request_id"]
        if rid in self._failed:
            return LookupResult.MISS
        client = self._client_for(fields)
        if client is None or client.dead:
            return LookupResult.MISS
        if kind == "prefiller":
            return self._hooks.count_lookup(True, key, ctx)
        probe = self._probes.get(rid)
        if probe is None:
            probe = self._probes[rid] = _Probe(client.peer_id)
        verdict = probe.verdicts.get(key)
        if verdict is not None:
            return self._hooks.count_lookup(verdict, key, ctx)
        deadline = probe.asked.get(key)
        if deadline is None:
            probe.asked[key] = time.monotonic() + self._options.peer_lookup_timeout_s
            probe.batch.append(key)
        elif deadline < time.monotonic():
            probe.verdicts[key] = False
            self._metrics.lookups.inc(1, "timed_out")
            return self._hooks.count_lookup(False, key, ctx)
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
        role = request_role(ctx)
        if role is None:
            return
        rid = role[1]["kv_request_id"]
        probe = self._probes.pop(rid, None)
        peer = probe.peer_id if probe is not None else peer_of(role[1])
        # The terminal empty fetch: the producer releases whatever it still holds for the id.
        self._client_send(peer, p.Fetch(kv_request_id=rid, keys=[], block_indexes=[], round_seq=0))
        self._rounds.pop(rid, None)

    # --- sessions --------------------------------------------------------------------------------
    def _client_for(self, fields: dict[str, Any]) -> _Client | None:
        """The session to the request's producer; opened (or re-opened after back-off) on demand."""
        peer = peer_of(fields)
        client = self._clients.get(peer)
        if client is not None and not client.dead:
            return client
        retry_at, _ = self._backoff.get(peer, (0.0, 0.0))
        control = self._planes.control
        if time.monotonic() < retry_at or control is None or self._hooks.closing():
            return None
        if peer == self._identity.peer_id:
            logger.warning("tier %s: a request names this instance (%s) as its KV source; ignored",
                           self._hooks.label, peer)
            return None
        if self.live_sessions() >= self._options.max_peers:
            self._metrics.refused.inc(1, "max_peers")
            return None
        try:
            host, port = p.parse_peer_id(peer)
            control.connect(peer)
        except Exception as exc:
            logger.warning("tier %s: cannot open a session to %s: %s", self._hooks.label, peer, exc)
            self.peer_gone(peer, "connect_failed")
            return None
        client = self._clients[peer] = _Client(peer, host, port)
        identity = self._identity
        control.send(peer, p.Connect(
            peer_id=identity.peer_id, block_len=identity.slot_bytes, num_blocks=identity.num_slots(),
            config_fingerprint=identity.fingerprint, hash_seed=identity.seed))
        self._hooks.update_gauges()
        return client

    def _client_send(self, peer: str, msg: p.Message) -> None:
        client = self._clients.get(peer)
        control = self._planes.control
        if client is None or client.dead or control is None:
            return
        if client.ack is None:
            client.outbox.append(msg)
            return
        if not control.send(peer, msg):
            self.peer_gone(peer, "send_failed")

    def on_connect_ack(self, peer: str, msg: p.ConnectAck) -> None:
        client = self._clients.get(peer)
        if client is None or client.dead or client.ack is not None:
            self._planes.violation(peer, "out_of_order")
            return
        problem = self._identity.mismatch(msg)
        if problem is not None:
            logger.error("tier %s: producer %s refused: %s", self._hooks.label, peer, problem)
            self._metrics.refused.inc(1, problem.split(":", 1)[0])
            self.peer_gone(peer, "refused")
            return
        client.ack = msg
        client.last_activity = time.monotonic()
        assert self._planes.tg is not None
        self._planes.tg.start_soon(self._open_link, client)

    async def _open_link(self, client: _Client) -> None:
        data = self._planes.data
        assert data is not None and client.ack is not None
        try:
            client.link = await data.connect(client.host, client.ack.data_port, client.ack.token,
                                             timeout=self._options.handshake_timeout_s)
        except (DataPlaneError, TimeoutError, OSError) as exc:
            logger.warning("tier %s: UCX link to %s failed: %s", self._hooks.label, client.peer_id, exc)
            self.peer_gone(client.peer_id, "link_failed")
            return
        self._backoff.pop(client.peer_id, None)
        client.acked.set()
        outbox, client.outbox = client.outbox, []
        for msg in outbox:
            self._client_send(client.peer_id, msg)

    def on_disconnect(self, peer: str, msg: p.Disconnect) -> None:
        """The producer closed the session (a refusal names its reason before the ack)."""
        if peer in self._clients and self._clients[peer].ack is None and msg.reason:
            self._metrics.refused.inc(1, msg.reason.split(":", 1)[0][:32])
            logger.error("tier %s: producer %s refused the session: %s", self._hooks.label, peer, msg.reason)
        self.peer_gone(peer, f"disconnect: {msg.reason}" if msg.reason else "disconnect")

    def peer_gone(self, peer: str, reason: str) -> None:
        """Reap the session to ``peer``: its loads fail as misses, its probing requests answer MISS."""
        client = self._clients.get(peer)
        _, delay = self._backoff.get(peer, (0.0, 0.0))
        delay = BACKOFF_FIRST_S if delay == 0 else min(delay * 2, BACKOFF_MAX_S)
        self._backoff[peer] = (time.monotonic() + delay, delay)
        if client is None or client.dead:
            return
        client.dead = True
        logger.warning("tier %s: session to producer %s lost (%s); its requests recompute",
                       self._hooks.label, peer, reason)
        for key in client.done_waiters:
            client.done[key] = False
            client.done_waiters[key].set()
        client.acked.set()  # wake waiters; they see client.dead
        now = time.monotonic()
        for rid, probe in self._probes.items():
            if probe.peer_id == peer:
                self._failed[rid] = now + REAPED_ID_RETENTION_S
        if client.link is not None and self._planes.tg is not None:
            self._planes.tg.start_soon(close_quietly, client.link)
        if self._planes.control is not None and not self._peer_served(peer):
            self._planes.control.drop(peer)  # the DEALER also carries our answers while we serve the peer
        self._hooks.update_gauges()
        self._hooks.notify()

    def disconnect_all(self) -> None:
        """Tell every producer the sessions end (the tier is closing)."""
        control = self._planes.control
        for client in self._clients.values():
            if not client.dead and control is not None:
                control.send(client.peer_id, p.Disconnect(reason="shutdown"))

    # --- loads -----------------------------------------------------------------------------------
    def submit_load(self, job: TransferJob) -> None:
        hooks = self._hooks
        record = hooks.open_job(job)
        role = request_role(job.ctx)
        if role is None or self._planes.tg is None or hooks.closing():
            hooks.fail_job(record, "closed" if hooks.closing() else "no_role")
            return
        client = self._client_for(role[1])
        if client is None:
            hooks.fail_job(record, "peer_unavailable")
            return
        self._planes.tg.start_soon(self._guarded_load, record, client, role[1]["kv_request_id"])

    async def _guarded_load(self, record: JobHandle, client: _Client, rid: str) -> None:
        try:
            await self._load(record, client, rid)
        except Exception:
            logger.exception("tier %s: load of request %s failed", self._hooks.label, rid)
            self._hooks.fail_job(record, "internal")  # no-op if it was reported already

    async def _load(self, record: JobHandle, client: _Client, rid: str) -> None:
        hooks, metrics = self._hooks, self._metrics
        job = record.job
        started = time.monotonic()
        round_seq = self._rounds.get(rid, 0)
        self._rounds[rid] = round_seq + 1
        host = self._identity.host
        assert host is not None
        ok = False
        with anyio.move_on_after(self._options.load_timeout_s) as scope:
            await client.acked.wait()
            if client.dead or client.link is None:
                hooks.fail_job(record, "peer_lost")
                return
            views = host.views(job.slot_ids)
            done_key = (rid, round_seq)
            waiter = client.done_waiters[done_key] = anyio.Event()
            failures: list[BaseException] = []
            try:
                async with anyio.create_task_group() as outer:
                    link = client.link
                    limiter = anyio.Semaphore(self._options.transfers_in_flight)

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
            metrics.fetch.observe(elapsed, "timeout" if scope.cancelled_caught else "failure")
            hooks.fail_job(record, "timeout" if scope.cancelled_caught else
                           ("peer_lost" if client.dead else "peer_failed"))
            if client.link is not None and client.link.closed and not client.dead:
                # UCX cannot withdraw a posted receive: cancelling one closed the link. The
                # session starts over (new handshake, new token) for the next request.
                self.peer_gone(client.peer_id, "link_closed")
            return
        nbytes = len(job.keys) * self._identity.slot_bytes
        metrics.fetch.observe(elapsed, "success")
        metrics.bytes.inc(nbytes, "received")
        metrics.chunks.inc(len(job.keys), "received")
        hooks.record_transfer("load", nbytes, elapsed)
        hooks.succeed_job(record, elapsed=elapsed, nbytes=nbytes)
        probe = self._probes.get(rid)
        if probe is not None:  # a re-scheduled request probes its keys again
            probe.fetched = True
            for key in job.keys:
                probe.verdicts.pop(key, None)
                probe.asked.pop(key, None)

    def on_transfer_done(self, peer: str, msg: p.TransferDone) -> None:
        client = self._clients.get(peer)
        key = (msg.kv_request_id, msg.round_seq)
        if client is None or key not in client.done_waiters:
            return  # a late answer to an aborted or finished fetch
        client.last_activity = time.monotonic()
        client.done[key] = msg.success
        client.done_waiters[key].set()

    def on_lookup_resp(self, peer: str, msg: p.LookupResp) -> None:
        probe = self._probes.get(msg.kv_request_id)
        if probe is None or probe.peer_id != peer:
            return  # the request finished meanwhile
        client = self._clients.get(peer)
        if client is not None:
            client.last_activity = time.monotonic()
        for key, hit in zip(msg.keys, msg.hits, strict=True):
            if key in probe.asked and key not in probe.verdicts:
                probe.verdicts[key] = hit
                self._metrics.lookups.inc(1, "hit" if hit else "miss")
        self._hooks.notify()

    # --- timeouts --------------------------------------------------------------------------------
    def _near_session_cap(self) -> bool:
        """Idle sessions are closed only when sessions run short."""
        max_peers = self._options.max_peers
        return self.live_sessions() >= max_peers - min(8, max_peers - 1)

    def housekeep(self, now: float) -> None:
        """Forget long-dead sessions, reap stalled handshakes and (near the cap) idle sessions."""
        options = self._options
        for peer, client in list(self._clients.items()):
            if client.dead:
                if now >= self._backoff.get(peer, (0.0, 0.0))[0] + BACKOFF_MAX_S:
                    del self._clients[peer]
            elif client.ack is None and now - client.connected_at > options.handshake_timeout_s:
                self._metrics.refused.inc(1, "handshake_timeout")
                self.peer_gone(peer, "handshake_timeout")
            elif options.idle_timeout_s and now - client.last_activity > options.idle_timeout_s and \
                    not client.done_waiters and not any(pr.peer_id == peer for pr in self._probes.values()) \
                    and self._near_session_cap():
                self.peer_gone(peer, "idle")

    def expire(self, now: float) -> None:
        """Forget failed request ids past their retention."""
        while self._failed and next(iter(self._failed.values())) < now:
            self._failed.popitem(last=False)

    def waits_on_deadlines(self) -> bool:
        """True while a probe has a deadline that a waiting load should re-check."""
        return any(pr.asked for pr in self._probes.values())

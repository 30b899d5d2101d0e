"""The p2p tier's producer role: it serves what the local stack holds to consumer sessions.

Chunks reach a consumer from two sources, both held *parked* (their host slots pinned) under the
request's ``kv_request_id`` until sent:

* ``remote_decoder: {kv_request_id}`` requests: the tier answers ``REQUEST_LEVEL`` and their
  cascaded store jobs are parked under the id;
* a consumer's ``Lookup`` (``remote_kv_source``): whatever the rest of the stack finds (host
  memory, or an fs/obj tier through a promotion) is pinned through the parent manager.

A consumer's ``Fetch`` binds the id to its session; the chunks it asks for are sent from their
host slots (``TransferDone`` when all are sent).

Semantics callers rely on:

* Every parked job is reported exactly once: done once every one of its chunks was sent or at
  the consumer's empty terminal fetch; failed when the consumer's session dies, or once the id
  has been idle (no fetch of it waiting or sending) for ``unbound_store_timeout_s``, whatever the
  consumer did before. The id is then *reaped*: a late fetch is answered
  ``TransferDone(success=False)`` at once and a late store fails.
* A slot is never unpinned under a running send: a release waits for the sends of the id to stop.
* Bounds on what one consumer session may make the producer hold (each refusal is answered — a
  lookup as MISS, a fetch as ``TransferDone(success=False)`` — counted in ``p2p_limit_refusals``
  by limit and logged at most once per peer and limit per minute): :data:`MAX_REQUESTS_PER_SESSION`
  request ids looked up or fetched and not finished, :data:`MAX_PENDING_LOOKUP_KEYS` keys waiting
  for an answer, :data:`MAX_FETCHES_PER_SESSION` fetches served at once, and pins: a session's
  lookups may pin at most :data:`SESSION_PIN_SHARE` of the host slots, all sessions' lookups
  together :data:`ALL_SESSIONS_PIN_SHARE` of them, so peers can never take the host tier from the
  local requests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import anyio

from kvtier.context import RequestContext
from kvtier.throttled_log import ThrottledLog
from kvtier.tiers.base import ParentManager
from kvtier.tiers.jobs import JobHandle, TransferJob
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.data import DataPlaneError, Link, chunk_tag
from kvtier.tiers.p2p.roles import (
    HOUSEKEEPING_S,
    REAPED_ID_RETENTION_S,
    Role,
    RoleParts,
    close_quietly,
)
from kvtier.types import LookupResult

__all__ = [
    "Producer", "LOOKUP_PENDING_TIMEOUT_S", "STORE_SERVE_TIMEOUT_S", "MAX_REQUESTS_PER_SESSION",
    "MAX_PENDING_LOOKUP_KEYS", "MAX_FETCHES_PER_SESSION", "SESSION_PIN_SHARE", "ALL_SESSIONS_PIN_SHARE",
]

# Both roles log as the tier does: operators filter the p2p tier's records by that one name.
logger = logging.getLogger("kvtier.tiers.p2p.tier")

#: A peer's lookup of a chunk still being written or promoted is answered MISS after this.
LOOKUP_PENDING_TIMEOUT_S = 5.0
#: A bound fetch whose chunks do not all arrive (cascades) within this fails.
STORE_SERVE_TIMEOUT_S = 30.0
#: Per consumer session: request ids looked up or fetched and not finished, at most.
MAX_REQUESTS_PER_SESSION = 4096
#: Per consumer session: looked-up keys waiting for their answer, at most.
MAX_PENDING_LOOKUP_KEYS = 4 * p.MAX_KEYS_PER_MESSAGE
#: Per consumer session: fetches waiting for their chunks or sending them, at most.
MAX_FETCHES_PER_SESSION = 64
#: The share of the host slots one session's lookups may pin, and all sessions' together.
SESSION_PIN_SHARE, ALL_SESSIONS_PIN_SHARE = 0.25, 0.5


@dataclass(eq=False)
class Parked:
    """A store job of a producer request, pinned until its chunks are sent or it is released."""

    record: JobHandle
    unsent: set[bytes]
    parked_at: float
    owner: Served | None = None  # the session whose lookup pinned it (None: a local request's)


@dataclass(eq=False)
class Served:
    """The producer side of one consumer session."""

    peer_id: str
    token: bytes
    link: Link | None = None
    lookups: dict[str, RemoteLookup] = field(default_factory=dict)  # kv_request_id -> state
    # kv_request_ids it looked up or fetched -> when last (bounded by MAX_REQUESTS_PER_SESSION);
    # those its fetches or lookup hits bound are also in Producer.bound.
    requests: dict[str, float] = field(default_factory=dict)
    fetching: dict[tuple[str, int], anyio.CancelScope] = field(default_factory=dict)
    pending_keys: int = 0  # keys in its lookups' queues
    pins: int = 0  # host slots its lookups' parked jobs pin
    last_activity: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class RemoteLookup:
    """A peer's lookups for one of its requests, resolved through the local stack."""

    ctx: RequestContext
    started: bool = False
    queue: list[tuple[bytes, float]] = field(default_factory=list)  # (key, give-up time)


class Producer(Role):
    """The producer side of every consumer session (see the module docstring).

    ``peer_consumed(peer)`` tells whether the consumer role has a session to ``peer`` too (the
    control connection to it is then kept when the peer's consumer session dies). The state
    attributes (``served``, ``parked``, ``bound``, ``lookup_pins``) are read-only for others.
    """

    def __init__(self, parts: RoleParts, peer_consumed: Callable[[str], bool]) -> None:
        super().__init__(parts)
        self._peer_consumed = peer_consumed
        self.served: dict[str, Served] = {}
        self.parked: dict[str, list[Parked]] = {}  # kv_request_id -> parked store jobs
        self.bound: dict[str, str] = {}  # kv_request_id -> consumer peer id
        self.lookup_pins = 0  # host slots pinned by every session's lookups
        self._arrived: dict[str, anyio.Event] = {}  # kv_request_id -> set when a store is parked
        self._reaped: OrderedDict[str, float] = OrderedDict()  # kv_request_id -> until
        self._finish_later: list[RequestContext] = []  # remote lookup contexts to finish
        self._sending: dict[str, int] = {}  # kv_request_id -> fetches sending from its slots now
        self._release_after: dict[str, tuple[bool, str]] = {}  # releases waiting for those sends
        self._serving: dict[str, int] = {}  # kv_request_id -> fetches of it waiting or sending now
        self._limit_log = ThrottledLog(logger, interval_s=60.0)
        self._waiting_fetches = 0

    # --- state the tier reads --------------------------------------------------------------------
    def serves(self, peer: str) -> bool:
        return peer in self.served

    def parked_jobs(self) -> int:
        return sum(len(v) for v in self.parked.values())

    def open_requests(self) -> int:
        return sum(len(served.requests) for served in self.served.values())

    def clear(self) -> None:
        """Forget what is parked (the tier is closing: the framework reports those jobs)."""
        self.parked.clear()

    # --- stores ----------------------------------------------------------------------------------
    def submit_store(self, job: TransferJob) -> None:
        hooks = self._hooks
        record = hooks.open_job(job)
        decoder = job.ctx.params.remote_decoder if job.ctx is not None else None
        if decoder is None:
            hooks.fail_job(record, "no_request_id")
            return
        if hooks.closing():
            hooks.fail_job(record, "closed")
            return
        rid = decoder["kv_request_id"]
        if rid in self._reaped:
            hooks.fail_job(record, "reaped")
            return
        self._park(rid, record)

    def _park(self, rid: str, record: JobHandle, owner: Served | None = None) -> None:
        self.parked.setdefault(rid, []).append(Parked(record, set(record.job.keys), time.monotonic(), owner))
        event = self._arrived.pop(rid, None)
        if event is not None:
            event.set()
        self._hooks.update_gauges()

    def _release(self, rid: str, success: bool, reason: str) -> None:
        """Finish every parked job of ``rid`` (pins released by the manager).

        While a fetch of ``rid`` is sending from those slots, the jobs finish once its sends have
        stopped: a slot is never unpinned under a running send. A failure cancels the sends first.
        A success (the consumer's terminal fetch: it holds every chunk) lets them complete: the
        completions of sends the consumer has already received can reach this loop after its
        terminal fetch, and cancelling a send would close the consumer's link.
        """
        if self._sending.get(rid):
            self._release_after[rid] = (success, reason)
            if success:
                return
            peer = self.bound.get(rid)
            served = self.served.get(peer) if peer is not None else None
            if served is not None:
                for (fetch_rid, _round), scope in served.fetching.items():
                    if fetch_rid == rid:
                        scope.cancel()
            return
        for parked in self.parked.pop(rid, []):
            self._unpin(parked)
            if success:
                self._hooks.succeed_job(parked.record, elapsed=time.monotonic() - parked.parked_at, nbytes=0)
            else:
                self._hooks.fail_job(parked.record, reason)
        self._hooks.update_gauges()

    def _unpin(self, parked: Parked) -> None:
        """Account for a parked job that is about to finish (its pins go with it)."""
        if parked.owner is not None:
            count = len(parked.record.job.keys)
            parked.owner.pins -= count
            self.lookup_pins -= count

    def _reap(self, rid: str, now: float) -> None:
        self._reaped[rid] = now + REAPED_ID_RETENTION_S
        self._reaped.move_to_end(rid)

    # --- sessions --------------------------------------------------------------------------------
    def _control_send(self, peer: str, msg: p.Message) -> None:
        control = self._planes.control
        if control is not None and not control.send(peer, msg):
            self.peer_gone(peer, "send_failed")

    def on_connect(self, peer: str, msg: p.Connect) -> None:
        control, data = self._planes.control, self._planes.data
        assert control is not None and data is not None
        if msg.peer_id != peer:
            self._planes.violation(peer, "identity_mismatch")
            return
        problem = self._identity.mismatch(msg)
        old = self.served.get(peer)
        if problem is None and old is None and len(self.served) >= self._options.max_peers:
            problem = "max_peers: the session limit is reached"
        if problem is not None:
            logger.error("tier %s: consumer %s refused: %s", self._hooks.label, peer, problem)
            self._metrics.refused.inc(1, problem.split(":", 1)[0])
            with contextlib.suppress(Exception):
                control.connect(peer)
                control.send(peer, p.Disconnect(reason=problem[:200]))
                if not self._peer_consumed(peer):
                    control.drop(peer)  # closes after its linger: the Disconnect goes out
            return
        if old is not None:  # the consumer restarted: what it had bound is gone
            self.peer_gone(peer, "reconnected")
        try:
            control.connect(peer)
        except Exception as exc:
            logger.warning("tier %s: cannot answer consumer %s: %s", self._hooks.label, peer, exc)
            return
        token = data.issue_token(peer)
        served = self.served[peer] = Served(peer, token)
        identity = self._identity
        control.send(peer, p.ConnectAck(
            peer_id=identity.peer_id, block_len=identity.slot_bytes, num_blocks=identity.num_slots(),
            config_fingerprint=identity.fingerprint, hash_seed=identity.seed, data_port=self._planes.data_port,
            token=token))
        assert self._planes.tg is not None
        self._planes.tg.start_soon(self._accept_link, served)
        self._hooks.update_gauges()

    async def _accept_link(self, served: Served) -> None:
        assert self._planes.data is not None
        try:
            link = await self._planes.data.accepted(served.peer_id, timeout=self._options.handshake_timeout_s)
        except (DataPlaneError, TimeoutError) as exc:
            logger.warning("tier %s: consumer %s did not open its UCX link: %s", self._hooks.label, served.peer_id, exc)
            self.peer_gone(served.peer_id, "no_link")
            return
        if self.served.get(served.peer_id) is not served:
            await close_quietly(link)
            return
        served.link = link
        self._hooks.notify()

    def _served_of(self, peer: str) -> Served | None:
        served = self.served.get(peer)
        if served is None:
            self._planes.violation(peer, "out_of_order")  # no handshake first
        else:
            served.last_activity = time.monotonic()
        return served

    def peer_gone(self, peer: str, reason: str) -> None:
        """Reap the consumer session of ``peer``: what it had bound is released (failed)."""
        served = self.served.pop(peer, None)
        if served is None:
            return
        logger.warning("tier %s: consumer %s gone (%s); releasing what it had bound", self._hooks.label, peer, reason)
        for scope in served.fetching.values():
            scope.cancel()
        for rid in list(served.requests):
            self._forget_request(served, rid, "peer_lost")
        data, tg = self._planes.data, self._planes.tg
        link = data.revoke(peer) if data is not None else None
        for stale in {id(x): x for x in (link, served.link) if x is not None}.values():
            if tg is not None:
                tg.start_soon(close_quietly, stale)
        if self._planes.control is not None and not self._peer_consumed(peer):
            self._planes.control.drop(peer)  # the DEALER also carries our requests while we consume
        self._hooks.update_gauges()

    # --- fetches ---------------------------------------------------------------------------------
    def on_fetch(self, peer: str, msg: p.Fetch) -> None:
        served = self._served_of(peer)
        if served is None:
            return
        rid = msg.kv_request_id
        owner = self.bound.get(rid)
        if owner is not None and owner != peer:
            self._planes.violation(peer, "foreign_request_id")
            return
        if not msg.keys:  # terminal: the consumer is done with this id
            if owner in (None, peer):
                self._release(rid, True, "")
                self.bound.pop(rid, None)
            served.requests.pop(rid, None)
            self._end_remote_lookup(served, rid)
            return
        failed = p.TransferDone(kv_request_id=rid, success=False, round_seq=msg.round_seq)
        if len(set(msg.keys)) != len(msg.keys) or (rid, msg.round_seq) in served.fetching:
            self._planes.violation(peer, "duplicate_keys" if (rid, msg.round_seq) not in served.fetching
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
        self.bound[rid] = peer
        assert self._planes.tg is not None
        scope = anyio.CancelScope()
        served.fetching[(rid, msg.round_seq)] = scope
        self._serving[rid] = self._serving.get(rid, 0) + 1
        self._planes.tg.start_soon(self._guarded_serve, served, msg, scope)

    async def _guarded_serve(self, served: Served, msg: p.Fetch, scope: anyio.CancelScope) -> None:
        rid = msg.kv_request_id
        try:
            await self._serve_fetch(served, msg, scope)
        except Exception:
            logger.exception("tier %s: serving fetch %s failed", self._hooks.label, rid)
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
                if not self._serving.get(rid) and rid not in self.parked and rid not in served.lookups:
                    # Nothing held for it any more: it no longer counts against the session.
                    served.requests.pop(rid)
                    if self.bound.get(rid) == served.peer_id:
                        del self.bound[rid]

    async def _serve_fetch(self, served: Served, msg: p.Fetch, scope: anyio.CancelScope) -> None:
        rid, round_seq = msg.kv_request_id, msg.round_seq
        wanted = {key: i for i, key in enumerate(msg.keys)}
        success = False
        started = time.monotonic()
        with scope:
            with anyio.move_on_after(STORE_SERVE_TIMEOUT_S):
                # Wait until the link is up and every wanted chunk has been parked (stores may
                # arrive after the fetch).
                self._waiting_fetches += 1
                self._metrics.waiting.set(self._waiting_fetches)
                try:
                    while served.link is None or not self._all_parked(rid, wanted):
                        event = self._arrived.setdefault(rid, anyio.Event())
                        with anyio.move_on_after(HOUSEKEEPING_S):
                            await event.wait()
                        if self.served.get(served.peer_id) is not served:
                            return
                        if rid in self._reaped:  # released meanwhile: this fetch cannot be served
                            scope.cancel()
                            break
                finally:
                    self._waiting_fetches -= 1
                    self._metrics.waiting.set(self._waiting_fetches)
                host = self._identity.host
                assert host is not None and served.link is not None
                sources = self._sources(rid, wanted)
                limiter = anyio.Semaphore(self._options.transfers_in_flight)
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
                        elif rid in self.parked:
                            self._finish_sent(rid)  # jobs another round emptied meanwhile
        served.fetching.pop((rid, round_seq), None)
        if self.served.get(served.peer_id) is not served:
            return
        if served.link is not None and served.link.closed and self.served.get(served.peer_id) is served:
            # A cancelled or failed send closed the link (UCX cannot withdraw one): this session
            # is over; the consumer reconnects for its next request.
            self.peer_gone(served.peer_id, "link_closed")
            return
        if success:
            nbytes = len(wanted) * self._identity.slot_bytes
            self._metrics.bytes.inc(nbytes, "sent")
            self._metrics.chunks.inc(len(wanted), "sent")
            self._hooks.record_transfer("store", nbytes, time.monotonic() - started)
            self._mark_sent(rid, set(wanted))
        elif not scope.cancel_called:
            logger.warning("tier %s: fetch %s round %d for %s failed", self._hooks.label, rid, round_seq, served.peer_id)
        if not scope.cancel_called:
            self._control_send(served.peer_id, p.TransferDone(kv_request_id=rid, success=success, round_seq=round_seq))

    def _all_parked(self, rid: str, wanted: dict[bytes, int]) -> bool:
        have: set[bytes] = set()
        for parked in self.parked.get(rid, ()):
            have.update(parked.record.job.keys)
        return all(key in have for key in wanted)

    def _sources(self, rid: str, wanted: Container[bytes]) -> dict[bytes, int]:
        """Wanted key -> the host slot a parked (pinned) job holds it in."""
        sources: dict[bytes, int] = {}
        for parked in self.parked.get(rid, ()):
            job = parked.record.job
            for key, slot in zip(job.keys, job.slot_ids):
                if key in wanted and key not in sources:
                    sources[key] = slot
        return sources

    def _mark_sent(self, rid: str, sent: set[bytes]) -> None:
        """Parked jobs all of whose chunks were sent are done (their pins are released) — once no
        fetch of ``rid`` is still sending: another round may be reading the same slots."""
        for parked in self.parked.get(rid, []):
            parked.unsent -= sent
        self._finish_sent(rid)

    def _finish_sent(self, rid: str) -> None:
        if self._sending.get(rid):
            return  # the last sender of rid calls this again
        remaining: list[Parked] = []
        for parked in self.parked.get(rid, []):
            if parked.unsent:
                remaining.append(parked)
            else:
                self._unpin(parked)
                self._hooks.succeed_job(parked.record, elapsed=time.monotonic() - parked.parked_at, nbytes=0)
        if remaining:
            self.parked[rid] = remaining
        else:
            self.parked.pop(rid, None)
        self._hooks.update_gauges()

    def on_abort(self, peer: str, msg: p.AbortFetch) -> None:
        served = self._served_of(peer)
        if served is None:
            return
        scope = served.fetching.pop((msg.kv_request_id, msg.round_seq), None)
        if scope is not None:
            scope.cancel()  # sends in flight are cancelled; the pins stay until released
        self._control_send(peer, p.AbortAck(kv_request_id=msg.kv_request_id, round_seq=msg.round_seq))

    # --- a peer's lookups ------------------------------------------------------------------------
    def on_lookup(self, peer: str, msg: p.Lookup) -> None:
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
            state = served.lookups[rid] = RemoteLookup(RequestContext(f"p2p:{peer}:{rid}"))
        give_up = time.monotonic() + LOOKUP_PENDING_TIMEOUT_S
        state.queue.extend((key, give_up) for key in keys)
        served.pending_keys += len(keys)
        self._hooks.notify()  # the engine polls the manager, which calls serve_external_requests

    def _admit_request(self, served: Served, rid: str) -> bool:
        """Note the session's activity on ``rid``; False if it is a new id over the session's bound."""
        if rid not in served.requests and len(served.requests) >= MAX_REQUESTS_PER_SESSION:
            self._over_limit(served, "requests")
            return False
        served.requests[rid] = time.monotonic()
        return True

    def _answer_miss(self, served: Served, rid: str, keys: list[bytes]) -> None:
        if keys:
            self._control_send(served.peer_id, p.LookupResp(kv_request_id=rid, keys=list(keys),
                                                            hits=[False] * len(keys)))

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer the queued lookups of every session through ``parent`` (the rest of the stack)."""
        for ctx in self._finish_later:
            parent.on_request_finished(ctx)
        self._finish_later.clear()
        now = time.monotonic()
        for served in list(self.served.values()):
            for rid, state in list(served.lookups.items()):
                # An answer below can find the session dead (its queue full): it was reaped then,
                # and nothing may be pinned for it any more.
                if self.served.get(served.peer_id) is not served:
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

    def _pin_hits(self, parent: ParentManager, served: Served, rid: str, state: RemoteLookup,
                  keys: list[bytes], hits: list[bool]) -> None:
        """Pin the chunks found for a peer's lookup (they are served like a remote_decoder
        request's), within the pin bounds; a hit over them is answered MISS (in place)."""
        if self.bound.get(rid, served.peer_id) != served.peer_id or rid in self._reaped:
            hits[:] = [False] * len(hits)  # another consumer's request id, or one given up on
            return
        held = self._sources(rid, dict.fromkeys(k for k, h in zip(keys, hits) if h)) if rid in self.parked else {}
        slots = self._identity.num_slots()
        room = min(int(slots * SESSION_PIN_SHARE) - served.pins, int(slots * ALL_SESSIONS_PIN_SHARE) - self.lookup_pins)
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
        record = self._hooks.open_job(job)
        self.bound[rid] = served.peer_id
        served.pins += len(new)
        self.lookup_pins += len(new)
        self._park(rid, record, owner=served)

    def _end_remote_lookup(self, served: Served, rid: str) -> None:
        state = served.lookups.pop(rid, None)
        if state is None:
            return
        served.pending_keys -= len(state.queue)
        if state.started:
            self._finish_later.append(state.ctx)
            self._hooks.notify()

    def _forget_request(self, served: Served, rid: str, reason: str) -> None:
        """The session is done with ``rid`` (died, or left it idle): what it bound is released
        (failed with ``reason``) and the id reaped; its lookups end."""
        served.requests.pop(rid, None)
        if self.bound.get(rid) == served.peer_id:
            self._release(rid, False, reason)  # while still bound: it finds the fetches to cancel
            del self.bound[rid]
            # Its consumer is gone or gave up: late stores fail instead of parking.
            self._reap(rid, time.monotonic())
        self._end_remote_lookup(served, rid)

    def _over_limit(self, served: Served, limit: str, count: int = 1) -> None:
        self._metrics.limits.inc(count, limit)
        self._limit_log(f"{served.peer_id} {limit}", "tier %s: consumer %s is over its %s bound; refused",
                        self._hooks.label, served.peer_id, limit)

    # --- timeouts --------------------------------------------------------------------------------
    def housekeep(self, now: float) -> None:
        """Release what idle sessions and never-fetched requests hold; forget old reaped ids."""
        timeout = self._options.unbound_store_timeout_s
        for served in list(self.served.values()):
            for rid, touched in list(served.requests.items()):
                state = served.lookups.get(rid)
                if now - touched > timeout and not self._serving.get(rid) and not (state is not None and state.queue):
                    if rid in self.parked and self.bound.get(rid) == served.peer_id:
                        logger.warning("tier %s: consumer %s left request %s idle for %.0f s; "
                                       "releasing what it pinned", self._hooks.label, served.peer_id, rid, timeout)
                        self._metrics.reaped.inc()
                    self._forget_request(served, rid, "unbound_timeout")
        for rid, parked in list(self.parked.items()):
            if rid in self.bound:  # a consumer's fetch or lookup bound it: see above
                continue
            if parked and now - min(x.parked_at for x in parked) > timeout:
                logger.warning("tier %s: request %s was never fetched within %.0f s; releasing it",
                               self._hooks.label, rid, timeout)
                self._release(rid, False, "unbound_timeout")
                self._reap(rid, now)
                self._metrics.reaped.inc()
        while self._reaped and next(iter(self._reaped.values())) < now:
            self._reaped.popitem(last=False)

    def has_queued_lookups(self) -> bool:
        """True while a peer's lookup waits for an answer (the engine should serve them again)."""
        return any(state.queue for s in self.served.values() for state in s.lookups.values())

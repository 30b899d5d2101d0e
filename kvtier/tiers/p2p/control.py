"""The p2p tier's control plane: ZeroMQ ROUTER in, one DEALER out per peer.

Topology: the plane binds one ROUTER on ``tcp://host:port`` (the configured host only; a wildcard
such as ``0.0.0.0`` only if that is what is configured). For every peer it talks to it opens one
DEALER connected to the peer's ROUTER, with ZeroMQ identity = the local ``"host:port"``. A peer
pair thus uses two one-directional DEALER→ROUTER channels; the ROUTER only receives, the DEALERs
only send. asyncio only (``zmq.asyncio``): the p2p tier needs asyncio because ucxx does.

One concept, one module: the sockets, their monitors, framing and the per-peer violation
accounting are each other's context (a monitor event ends a peer's DEALER and its counts), so the
plane stays whole at ~750 lines.

Semantics callers rely on:

* **Nothing blocks the event loop.** :meth:`ControlPlane.send` is synchronous and non-blocking
  (``zmq.NOBLOCK``); a DEALER queues at most ``send_hwm`` messages, and a full queue reports the
  peer down instead of waiting. :meth:`ControlPlane.recv` awaits readiness and then reads without
  blocking; it yields to the loop after a bounded run of rejected frames.
* **recv is cancellation-safe**: cancelled while waiting, it consumed nothing.
* **Strict inbound frames.** A ROUTER message must be exactly ``[identity, payload]``, the identity
  a valid ``"host:port"`` (:func:`~kvtier.tiers.p2p.protocol.parse_peer_id`), the payload a valid
  message (:func:`~kvtier.tiers.p2p.protocol.decode`). Anything else is dropped and counted in
  ``statistics().messages_rejected`` by reason; the loop never crashes on a peer's bytes. Frames
  over twice :data:`~kvtier.tiers.p2p.protocol.MAX_FRAME_BYTES` are cut by libzmq itself
  (``ZMQ_MAXMSGSIZE``: the connection is dropped, uncounted); between one and two times it they
  are counted as ``"oversized"``.
* **Violations disconnect.** Each rejected frame from a well-formed identity, and each
  :meth:`ControlPlane.violation` the session layer reports (an out-of-order message, a refused
  handshake), counts against that peer. At ``max_violations`` the peer is reported once as
  ``PeerDown(peer, "protocol_violation")``, its DEALER is closed, and its frames are ignored
  (counted as ``"banned"``) for ``violation_backoff_s``; :meth:`ControlPlane.connect` to it fails
  meanwhile. The count restarts when the back-off ends.
* **Peer down, once.** A DEALER's socket monitor turns DISCONNECTED, CLOSED and handshake-failure
  events into ``PeerDown(peer, reason)`` (reasons ``"disconnected"``, ``"closed"``,
  ``"handshake_failed"``; also ``"send_queue_full"`` and ``"protocol_violation"``). Every
  ``PeerDown`` means the plane has already closed and forgotten that DEALER: one notice per drop,
  later events of the dead socket are never seen, and :meth:`ControlPlane.connect` opens a fresh
  one (back-off is the session layer's job). Heartbeats (``ZMQ_HEARTBEAT_IVL/TIMEOUT/TTL`` on the
  ROUTER and the DEALERs) make a silent peer a DISCONNECTED event within ``heartbeat_timeout_s``.
  Liveness is observed on outbound DEALERs only: the session layer opens a DEALER back to every
  peer that talks to it, as vLLM does.
* **Authentication (kvtier addition; vLLM trusts every peer).** With :class:`CurveKeys` the ROUTER
  is a CurveZMQ server and a ZAP handler admits only clients whose public key is a ``*.key``
  certificate in ``trusted_public_keys_dir``; each DEALER is a CURVE client whose server key is
  read from ``<trusted_public_keys_dir>/<host>:<port>.key`` (the peer's identity, e.g.
  ``10.0.0.7:5710.key``, a ``zmq.auth.create_certificates`` public certificate). A frame is
  accepted only if its sender's CURVE key is the one in the file named after the identity it
  claims (else ``"identity_mismatch"``), so a trusted peer cannot speak for another. The directory
  is read at :meth:`ControlPlane.start`. Without ``auth`` the plane logs once that peers are
  unauthenticated. Secret key material is never logged or put in an error message.
* **Refusals are seen.** A connection the ROUTER refuses — a CURVE key not in the trusted
  directory (``"untrusted_key"``, the ZAP handler's verdict, with the client's address), or a
  failed handshake such as a plaintext client at a CURVE server (``"handshake_failed"``, from the
  ROUTER's socket monitor, which names no peer) — is counted in
  ``statistics().connections_refused`` by reason and logged at WARNING at most once per address
  (or reason) per minute, with the count of what the minute held back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtier.config.curve import load_certificate, require_curve
from kvtier.errors import ConfigError, KvtierError
from kvtier.throttled_log import ThrottledLog
from kvtier.tiers.p2p.protocol import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode, parse_peer_id

__all__ = ["ControlPlane", "ControlStatistics", "CurveKeys", "PeerDown", "PeerUnavailable"]

logger = logging.getLogger(__name__)
#: How long closing waits for the ZMQ context beyond the linger time.
_TERM_GRACE_S = 5.0

_MAX_LINGER_MS: Final = 500
_RECV_BUDGET: Final = 64  # rejected frames handled before recv() yields to the loop
_MAX_TRACKED_PEERS: Final = 4096  # bound on violation/ban bookkeeping for unknown senders
_DOWN_EVENTS: Final[dict[int, str]] = {
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_CLOSED: "closed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed",
}
_MONITORED_EVENTS: Final = sum(_DOWN_EVENTS)
# On the ROUTER: handshakes that failed before any message (ZAP denials are counted by the handler).
_REFUSED_EVENTS: Final = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_ZAP_DOMAIN: Final = "kvtier-p2p"

_warned_unauthenticated = False


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ key material, named as the tier's ``auth`` configuration keys.

    ``curve_secret_key_file``: this instance's certificate with its secret key (the
    ``.key_secret`` file of ``zmq.auth.create_certificates``); ``curve_public_key_file``: its
    public certificate; ``trusted_public_keys_dir``: public certificates of the peers allowed in,
    each named ``<host>:<port>.key`` after the peer's identity.
    """

    curve_secret_key_file: str
    curve_public_key_file: str
    trusted_public_keys_dir: str


class PeerDown(NamedTuple):
    """Notice from :meth:`ControlPlane.recv`: the DEALER to ``peer_id`` was closed for ``reason``."""

    peer_id: str
    reason: str


class PeerUnavailable(KvtierError):
    """:meth:`ControlPlane.connect` cannot open a channel to ``peer_id``.

    ``reason``: ``"no_key"`` (auth is on and the peer has no trusted certificate), ``"banned"``
    (the peer is in its protocol-violation back-off) or ``"closed"`` (the plane is closed).
    """

    def __init__(self, peer_id: str, reason: str) -> None:
        super().__init__(f"p2p peer {peer_id}: {reason}")
        self.peer_id = peer_id
        self.reason = reason


@dataclass(frozen=True)
class ControlStatistics:
    """Snapshot of a :class:`ControlPlane`'s counters (all cumulative except ``peers``/``banned``)."""

    identity: str
    peers: int
    """DEALERs open now."""
    banned: int
    """Peers in their protocol-violation back-off now."""
    messages_received: int
    messages_sent: int
    send_failures: int
    """Sends refused: peer not connected, or its queue full."""
    connects: int
    """DEALERs opened."""
    messages_rejected: dict[str, int] = field(default_factory=dict)
    """Inbound frames dropped and violations reported, by reason."""
    peers_down: dict[str, int] = field(default_factory=dict)
    """PeerDown notices, by reason."""
    connections_refused: dict[str, int] = field(default_factory=dict)
    """Inbound connections refused before any message: ``untrusted_key``, ``handshake_failed``."""


@dataclass
class _Dealer:
    socket: zmq.asyncio.Socket  # owner; closed by _close_dealer
    sender: zmq.Socket  # synchronous shadow of `socket`, for NOBLOCK sends
    monitor: zmq.asyncio.Socket
    monitor_reader: zmq.Socket  # synchronous shadow of `monitor`


@dataclass(frozen=True)
class _Keys:
    public: bytes  # z85
    secret: bytes  # z85; never logged
    trusted: dict[str, bytes]  # identity -> z85 public key, from <dir>/<identity>.key


class ControlPlane:
    """ROUTER/DEALER control channels of one kvtier instance; one owner closes it (:meth:`aclose`).

    ``host``/``port`` are the bind address and the identity peers dial back (``port=0`` binds an
    ephemeral port; :attr:`identity` is final after :meth:`start`). ``heartbeat_ivl_s`` /
    ``heartbeat_timeout_s`` set ZeroMQ heartbeats (TTL = timeout). ``max_violations`` /
    ``violation_backoff_s``: see the module docstring. ``send_hwm``: messages queued per DEALER.
    ``linger_s``: how long closing waits to flush queued messages (at most 0.5 s).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        auth: CurveKeys | None = None,
        heartbeat_ivl_s: float = 2.0,
        heartbeat_timeout_s: float = 10.0,
        max_violations: int = 5,
        violation_backoff_s: float = 30.0,
        send_hwm: int = 1000,
        linger_s: float = 0.5,
    ) -> None:
        if not (0 <= port <= 65535):
            raise ConfigError(f"p2p port {port!r} is not in 0..65535")
        self.identity = f"{host}:{port}"
        try:
            parse_peer_id(f"{host}:{port or 1}")
        except ValueError:
            raise ConfigError(
                f"p2p host {host[:64]!r} is not a hostname, IPv4 or bracketed IPv6 address"
            ) from None
        if not (heartbeat_ivl_s > 0 and heartbeat_timeout_s > 0):
            raise ConfigError("p2p heartbeat interval and timeout must be positive")
        if max_violations < 1 or send_hwm < 1:
            raise ConfigError("p2p max_violations and send_hwm must be at least 1")
        self._host = host
        self._port = port
        self._auth = auth
        self._heartbeat = (int(heartbeat_ivl_s * 1000), int(heartbeat_timeout_s * 1000))
        self._max_violations = max_violations
        self._backoff_s = violation_backoff_s
        self._send_hwm = send_hwm
        self._linger_ms = max(0, min(_MAX_LINGER_MS, int(linger_s * 1000)))

        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._router_reader: zmq.Socket | None = None
        self._wake_rx: zmq.asyncio.Socket | None = None
        self._wake_tx: zmq.asyncio.Socket | None = None
        self._wake_sender: zmq.Socket | None = None
        self._authenticator: object | None = None  # zmq.auth.asyncio.AsyncioAuthenticator
        self._router_monitor: zmq.asyncio.Socket | None = None
        self._router_monitor_reader: zmq.Socket | None = None
        self._refused: dict[str, int] = {}
        self._refusal_log = ThrottledLog(logger, interval_s=60.0)
        self._keys: _Keys | None = None
        self._dealers: dict[str, _Dealer] = {}
        self._notices: deque[PeerDown] = deque()
        self._violations: OrderedDict[str, int] = OrderedDict()
        self._banned_until: OrderedDict[str, float] = OrderedDict()
        self._closed = False

        self._received = 0
        self._sent = 0
        self._send_failures = 0
        self._connects = 0
        self._rejected: dict[str, int] = {}
        self._down: dict[str, int] = {}

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Load the keys (with ``auth``), start the ZAP handler and bind the ROUTER.

        Raises :class:`ConfigError` naming the address when the bind fails (port in use, host not
        local), naming the key when key material is missing or unreadable, and when ``auth`` is
        configured but the installed libzmq lacks CURVE.
        """
        if self._ctx is not None or self._closed:
            raise RuntimeError("ControlPlane.start() called twice")
        keys = _load_keys(self._auth) if self._auth is not None else None
        if keys is None:
            _warn_unauthenticated_once()
        self._keys = keys
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        try:
            if keys is not None:
                authenticator = _authenticator(ctx, self._on_zap_denied)
                authenticator.start()
                assert self._auth is not None
                # pyzmq's "*" only matches sockets without a zap_domain; name ours explicitly.
                authenticator.configure_curve(domain=_ZAP_DOMAIN, location=self._auth.trusted_public_keys_dir)
                self._authenticator = authenticator
            router = ctx.socket(zmq.ROUTER)
            self._router = router
            self._configure(router)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes its identity back
            router.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_FRAME_BYTES)
            self._router_monitor = router.get_monitor_socket(_REFUSED_EVENTS)
            self._router_monitor_reader = zmq.Socket.shadow(self._router_monitor.underlying)
            if keys is not None:
                router.curve_secretkey = keys.secret
                router.curve_publickey = keys.public
                router.curve_server = True
                router.zap_domain = _ZAP_DOMAIN.encode()
            try:
                router.bind(f"tcp://{self._host}:{self._port}")
            except zmq.ZMQError as exc:
                raise ConfigError(
                    f"p2p control plane cannot bind tcp://{self._host}:{self._port}: {exc.strerror}"
                ) from None
            if self._port == 0:
                endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._port = int(endpoint.rpartition(":")[2])
                self.identity = f"{self._host}:{self._port}"
            self._router_reader = zmq.Socket.shadow(router.underlying)
            self._wake_rx = ctx.socket(zmq.PAIR)
            self._wake_tx = ctx.socket(zmq.PAIR)
            address = f"inproc://kvtier-p2p-wake-{id(self)}"
            self._wake_rx.bind(address)
            self._wake_tx.connect(address)
            self._wake_sender = zmq.Socket.shadow(self._wake_tx.underlying)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close every socket (queued messages get at most ``linger_s`` to leave) and the context.

        Idempotent. A pending :meth:`recv` is woken and raises :class:`PeerUnavailable`
        (reason ``"closed"``); later calls do the same.
        """
        if self._closed:
            return
        self._closed = True
        self._wake()
        for peer_id in list(self._dealers):
            self._close_dealer(peer_id)
        if self._router is not None and self._router_monitor is not None:
            try:
                self._router.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self._router_monitor, self._router, self._wake_rx, self._wake_tx):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._router_reader = self._wake_rx = self._wake_tx = self._wake_sender = None
        self._router_monitor = self._router_monitor_reader = None
        if self._authenticator is not None:
            self._authenticator.stop()  # type: ignore[attr-defined]
            self._authenticator = None
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            # term() waits for lingering DEALERs (bounded by linger_s): off the event loop. Closing
            # never hangs on it: a term() that outlives that (a socket libzmq still holds) is left
            # to finish on its thread.
            term = asyncio.ensure_future(asyncio.to_thread(ctx.term))
            try:
                await asyncio.wait_for(asyncio.shield(term), self._linger_ms / 1000 + _TERM_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning("p2p control: the ZMQ context did not terminate within %.1f s of closing; "
                               "left to finish in the background", self._linger_ms / 1000 + _TERM_GRACE_S)

    # ------------------------------------------------------------------ peers

    def connect(self, peer_id: str) -> None:
        """Open (idempotently) the DEALER to ``peer_id`` (``"host:port"``); returns at once.

        The connection is made in the background; messages sent before it is up are queued
        (up to ``send_hwm``). Raises :class:`ValueError` for a malformed peer id and
        :class:`PeerUnavailable` (``"no_key"``, ``"banned"``, ``"closed"``) when it cannot open one.
        """
        host, _ = parse_peer_id(peer_id)
        if self._closed or self._ctx is None:
            raise PeerUnavailable(peer_id, "closed")
        if peer_id in self._dealers:
            return
        if self._is_banned(peer_id):
            raise PeerUnavailable(peer_id, "banned")
        server_key = None
        if self._keys is not None:
            server_key = self._keys.trusted.get(peer_id)
            if server_key is None:
                raise PeerUnavailable(peer_id, "no_key")
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            self._configure(dealer)
            dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
            dealer.setsockopt(zmq.SNDHWM, self._send_hwm)
            if host.startswith("["):
                dealer.setsockopt(zmq.IPV6, 1)
            if self._keys is not None and server_key is not None:
                dealer.curve_secretkey = self._keys.secret
                dealer.curve_publickey = self._keys.public
                dealer.curve_serverkey = server_key
            monitor = dealer.get_monitor_socket(_MONITORED_EVENTS)
            dealer.connect(f"tcp://{peer_id}")
        except BaseException:
            dealer.close(linger=0)
            raise
        self._dealers[peer_id] = _Dealer(
            socket=dealer,
            sender=zmq.Socket.shadow(dealer.underlying),
            monitor=monitor,
            monitor_reader=zmq.Socket.shadow(monitor.underlying),
        )
        self._connects += 1
        self._wake()  # a waiting recv() must watch the new monitor

    def drop(self, peer_id: str) -> None:
        """Close the DEALER to ``peer_id`` (queued messages get ``linger_s``) and forget it.

        No :class:`PeerDown` is reported for a drop; unknown peers are ignored.
        """
        self._close_dealer(peer_id)

    def connected(self, peer_id: str) -> bool:
        """Whether a DEALER to ``peer_id`` is open (not whether the peer is reachable)."""
        return peer_id in self._dealers

    def send(self, peer_id: str, msg: Message) -> bool:
        """Queue ``msg`` on the DEALER to ``peer_id`` without blocking.

        Returns False if there is no DEALER to that peer (call :meth:`connect`), or if its queue
        is full: then the peer is reported down (``"send_queue_full"``) and its DEALER closed.
        Raises :class:`ProtocolError` if ``msg`` itself is invalid (a local bug).
        """
        frame = encode(msg)
        dealer = self._dealers.get(peer_id)
        if dealer is None:
            self._send_failures += 1
            return False
        try:
            dealer.sender.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._send_failures += 1
            self._peer_down(peer_id, "send_queue_full")
            return False
        self._sent += 1
        return True

    def violation(self, peer_id: str, reason: str) -> None:
        """Record a protocol violation by ``peer_id`` found by the session layer (counted by
        ``reason``); at ``max_violations`` the peer is disconnected and backed off."""
        self._count_rejected(reason)
        self._add_violation(peer_id)
        self._wake()

    # ---------------------------------------------------------------- receive

    async def recv(self) -> tuple[str, Message] | PeerDown:
        """The next inbound message as ``(sender identity, message)``, or a :class:`PeerDown`.

        Notices come before messages that are already buffered. Cancellation-safe. Raises
        :class:`PeerUnavailable` (reason ``"closed"``) once the plane is closed.
        """
        while True:
            if self._closed or self._router_reader is None:
                raise PeerUnavailable(self.identity, "closed")
            self._drain_monitors()
            if self._notices:
                return self._notices.popleft()
            for _ in range(_RECV_BUDGET):
                parts = self._recv_parts()
                if parts is None:
                    break
                item = self._accept(parts)
                if item is not None:
                    self._received += 1
                    return item
                if self._notices:
                    return self._notices.popleft()
            else:
                await asyncio.sleep(0)  # a flood of rejected frames must not starve the loop
                continue
            await self._wait_readable()

    def statistics(self) -> ControlStatistics:
        """A snapshot of the counters (see :class:`ControlStatistics`)."""
        self._expire_bans()
        return ControlStatistics(
            identity=self.identity,
            peers=len(self._dealers),
            banned=len(self._banned_until),
            messages_received=self._received,
            messages_sent=self._sent,
            send_failures=self._send_failures,
            connects=self._connects,
            messages_rejected=dict(self._rejected),
            peers_down=dict(self._down),
            connections_refused=dict(self._refused),
        )

    # -------------------------------------------------------------- internals

    def _configure(self, sock: zmq.Socket) -> None:
        ivl_ms, timeout_ms = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms, 6_553_500))
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        if self._host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)

    def _wake(self) -> None:
        if self._wake_sender is not None:
            try:
                self._wake_sender.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    async def _wait_readable(self) -> None:
        assert self._router is not None and self._wake_rx is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._router_monitor is not None:
            poller.register(self._router_monitor, zmq.POLLIN)
        for dealer in self._dealers.values():
            poller.register(dealer.monitor, zmq.POLLIN)
        ready = asyncio.ensure_future(poller.poll())
        try:
            # asyncio.wait, not await: aclose() closing the sockets cancels the poll future, which
            # must wake this recv() (it then raises PeerUnavailable), not cancel its task.
            await asyncio.wait([ready])
        finally:
            if not ready.done():
                ready.cancel()
        error = None if ready.cancelled() else ready.exception()
        if error is not None and not self._closed:
            raise error
        wake_rx = self._wake_rx
        if wake_rx is not None and not wake_rx.closed:
            reader: zmq.Socket = zmq.Socket.shadow(wake_rx.underlying)
            while reader.poll(0, zmq.POLLIN):
                reader.recv(zmq.NOBLOCK)

    def _recv_parts(self) -> list[zmq.Frame] | None:
        """One whole inbound message without blocking; keeps at most 3 parts in memory."""
        assert self._router_reader is not None
        reader = self._router_reader
        try:
            first = reader.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        parts = [first]
        while reader.getsockopt(zmq.RCVMORE):
            part = reader.recv(zmq.NOBLOCK, copy=False)  # parts of one message arrive together
            if len(parts) < 3:
                parts.append(part)
        return parts

    def _accept(self, parts: list[zmq.Frame]) -> tuple[str, Message] | None:
        sender = _identity(parts[0].bytes)
        if sender is None:
            self._count_rejected("bad_identity")
            return None
        if self._is_banned(sender):
            self._count_rejected("banned")
            return None
        if len(parts) != 2:
            self._reject(sender, "bad_frames")
            return None
        payload = parts[1]
        if self._keys is not None:
            try:
                user_id = str(payload.get("User-Id"))
            except zmq.ZMQError:
                user_id = ""
            expected = self._keys.trusted.get(sender)
            if expected is None or user_id.encode() != expected:
                self._count_rejected("identity_mismatch")  # not the claimed peer: do not blame it
                return None
        try:
            msg = decode(payload.buffer)
        except ProtocolError as exc:
            self._reject(sender, exc.reason)
            return None
        return sender, msg

    def _reject(self, sender: str, reason: str) -> None:
        self._count_rejected(reason)
        self._add_violation(sender)

    def _count_rejected(self, reason: str) -> None:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _add_violation(self, peer_id: str) -> None:
        if self._is_banned(peer_id):
            return
        count = self._violations.pop(peer_id, 0) + 1
        if count < self._max_violations:
            self._violations[peer_id] = count
            while len(self._violations) > _MAX_TRACKED_PEERS:
                self._violations.popitem(last=False)
            return
        logger.warning("p2p peer %s disconnected after %d protocol violations", peer_id[:64], count)
        self._banned_until[peer_id] = _now() + self._backoff_s
        while len(self._banned_until) > _MAX_TRACKED_PEERS:
            self._banned_until.popitem(last=False)
        self._peer_down(peer_id, "protocol_violation", even_if_unconnected=True)

    def _is_banned(self, peer_id: str) -> bool:
        until = self._banned_until.get(peer_id)
        if until is None:
            return False
        if _now() < until:
            return True
        del self._banned_until[peer_id]
        return False

    def _expire_bans(self) -> None:
        now = _now()
        for peer_id in [p for p, until in self._banned_until.items() if until <= now]:
            del self._banned_until[peer_id]

    def _peer_down(self, peer_id: str, reason: str, *, even_if_unconnected: bool = False) -> None:
        had_dealer = self._close_dealer(peer_id)
        if had_dealer or even_if_unconnected:
            self._down[reason] = self._down.get(reason, 0) + 1
            self._notices.append(PeerDown(peer_id, reason))
            self._wake()

    def _on_zap_denied(self, address: str) -> None:
        self._count_refused("untrusted_key", address,
                            "p2p control: refused a connection from %s: its CURVE key is not trusted", address)

    def _count_refused(self, reason: str, key: str, msg: str, *args: object) -> None:
        self._refused[reason] = self._refused.get(reason, 0) + 1
        self._refusal_log(key, msg, *args)

    def _drain_monitors(self) -> None:
        reader = self._router_monitor_reader
        while reader is not None:
            try:
                frames = reader.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                event = parse_monitor_message(frames)
            except Exception:  # noqa: BLE001 - a garbled monitor frame is not a peer's doing
                continue
            endpoint = event.get("endpoint", b"")
            where = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint)
            self._count_refused("handshake_failed", "handshake_failed",
                                "p2p control: a connection to %s failed its handshake (a client "
                                "without CURVE, with another server key, or not ZeroMQ)", where[:80])
        for peer_id, dealer in list(self._dealers.items()):
            reason = _first_down_event(dealer.monitor_reader)
            if reason is not None:
                logger.info("p2p peer %s down: %s", peer_id, reason)
                self._peer_down(peer_id, reason)

    def _close_dealer(self, peer_id: str) -> bool:
        dealer = self._dealers.pop(peer_id, None)
        if dealer is None:
            return False
        try:
            dealer.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        dealer.monitor.close(linger=0)
        dealer.socket.close(linger=self._linger_ms)
        return True


def _authenticator(ctx: zmq.asyncio.Context, on_denied: Callable[[str], None]) -> Any:
    """pyzmq's asyncio ZAP handler, also reporting each denial's client address to ``on_denied``."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    class _ReportingAuthenticator(AsyncioAuthenticator):  # type: ignore[misc]
        _address = ""

        async def handle_zap_message(self, msg: list[bytes]) -> None:
            if len(msg) >= 4:
                self._address = bytes(msg[3]).decode("ascii", "replace")[:64]
            await super().handle_zap_message(msg)

        def _send_zap_reply(self, request_id: bytes, status_code: bytes, *args: Any, **kwargs: Any) -> None:
            if status_code != b"200":
                on_denied(self._address)
            super()._send_zap_reply(request_id, status_code, *args, **kwargs)

    return _ReportingAuthenticator(context=ctx)


def _identity(raw: bytes) -> str | None:
    try:
        peer_id = raw.decode("ascii")
        parse_peer_id(peer_id)
    except ValueError:  # UnicodeDecodeError included
        return None
    return peer_id


def _first_down_event(monitor: zmq.Socket) -> str | None:
    """Drain ``monitor`` without blocking; the reason of its first peer-down event, if any."""
    reason = None
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return reason
        try:
            event = int(parse_monitor_message(frames)["event"])
        except Exception:  # noqa: BLE001 - a garbled monitor frame is not a peer's doing
            continue
        if reason is None:
            reason = _DOWN_EVENTS.get(event)


def _now() -> float:
    return time.monotonic()


def _warn_unauthenticated_once() -> None:
    global _warned_unauthenticated
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        logger.warning(
            "p2p control plane has no 'auth': peers are unauthenticated and unencrypted; any host "
            "that can reach the port can connect (configure auth.curve_* keys to restrict it)"
        )


def _load_keys(auth: CurveKeys) -> _Keys:
    """Read and check the CURVE key material; ConfigError names the key, never a secret."""
    import zmq

    require_curve("auth.curve_secret_key_file")

    def certificate(key: str, path: str) -> tuple[bytes, bytes | None]:
        return load_certificate(f"auth.{key}", path)

    public_from_secret_file, secret = certificate("curve_secret_key_file", auth.curve_secret_key_file)
    if secret is None:
        raise ConfigError(
            f"auth.curve_secret_key_file: {auth.curve_secret_key_file!r} holds no secret-key "
            "(give the .key_secret certificate)"
        )
    public, _ = certificate("curve_public_key_file", auth.curve_public_key_file)
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        raise ConfigError(f"auth.curve_secret_key_file: {auth.curve_secret_key_file!r} holds an invalid secret key") from None
    if derived != public or public_from_secret_file != public:
        raise ConfigError(
            f"auth.curve_public_key_file: {auth.curve_public_key_file!r} does not match the key pair "
            f"of auth.curve_secret_key_file ({auth.curve_secret_key_file!r})"
        )
    directory = auth.trusted_public_keys_dir
    if not os.path.isdir(directory):
        raise ConfigError(f"auth.trusted_public_keys_dir: {directory!r} is not a directory")
    return _Keys(public=public, secret=secret, trusted=_trusted_keys(directory, os.listdir(directory)))


def _trusted_keys(directory: str, names: Iterable[str]) -> dict[str, bytes]:
    import zmq.auth

    trusted: dict[str, bytes] = {}
    for name in names:
        if not name.endswith(".key"):
            continue
        peer_id = name[: -len(".key")]
        if _identity(peer_id.encode("ascii", "replace")) is None:
            continue  # admitted by ZAP, but no identity may claim it
        try:
            public, _ = zmq.auth.load_certificate(os.path.join(directory, name))
        except (OSError, ValueError):
            logger.warning("p2p auth: skipping unreadable certificate %r", os.path.join(directory, name))
            continue
        trusted[peer_id] = public
    return trusted

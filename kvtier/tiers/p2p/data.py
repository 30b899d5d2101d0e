"""The p2p tier's data plane: zero-copy, tag-matched chunk transfers over UCX (ucxx).

The producer sends each chunk straight from its host slot and the consumer receives straight into
the host slot its manager allocated; Python never copies the bytes. The control plane (ZeroMQ,
authenticated when ``auth`` is configured) tells the consumer the producer's data port and a
32-byte per-session token; the UCX listener accepts only endpoints that present a token it issued.

Semantics callers rely on:

* **Asyncio only.** ucxx's asynchronous API runs on asyncio; every coroutine here must be awaited
  on the event loop that started the plane. Callers may wrap any await in ``anyio.fail_after``.
* **One error type.** Every transfer or connection failure (peer gone, link closed, token refused
  or malformed, deadline passed) raises :class:`DataPlaneError`; its ``reason`` is one of
  :data:`REASONS`. Misuse (a non-contiguous or read-only view) is a ``ValueError``/``TypeError``
  raised before anything is posted.
* **A link that failed once is closed.** After any error, a cancellation of one of its
  operations, :meth:`Link.close`, :meth:`DataPlane.revoke` of its session or
  :meth:`DataPlane.aclose`, the link's endpoint is closed and every other pending ``send``/``recv``
  on it fails with ``DataPlaneError("closed")`` (or ``"peer_gone"``): nothing waits forever.
* **Cancelling a pending ``send``/``recv`` closes its link.** UCX cannot withdraw one posted
  operation; only closing the endpoint cancels them. Keeping the link would let a receive that
  the caller abandoned write into a slot the caller already gave to someone else, or a send read
  a slot that was reused. Once the cancelled call has returned, UCX no longer touches its view.
  Callers that abort a fetch therefore open a new link.
* **Tags.** :func:`chunk_tag` names a chunk by (request, round, index), identically in every
  process. On the wire the tag is mixed with the view's byte length, and ucxx mixes it with the
  endpoint's private tag agreed at connection time: operations on different links never match
  each other, and a message whose size differs from the receiving view never matches it (the
  receive waits for the caller's deadline instead of filling part of the slot or truncating).
  Many sends and receives with distinct tags may be outstanding on one link at once, in any
  order; a send that arrives before its receive is posted is held by UCX until it is.
* **Tokens.** :meth:`DataPlane.issue_token` gives a session 32 random bytes; the connecting side
  sends them first and the listener answers with a one-byte acknowledgement, so
  :meth:`DataPlane.connect` returns only a link the producer accepted. An endpoint that presents
  no token, a wrong one, or one that already opened its link, within ``accept_timeout_s`` is
  closed and counted in ``endpoints_refused``. The token authenticates the endpoint; it does not
  encrypt the bytes that follow (UCX over TCP is cleartext).
* **Binding.** ucxx's listener takes no host argument: it listens on **all interfaces**
  (0.0.0.0) on a port the OS picks. With ``host`` given, :meth:`DataPlane.guard` closes every
  connection to that port that arrived on another address at once, and every connection that is
  not a session's link nor in its token handshake after ``accept_timeout_s`` (a raw TCP client
  never reaches the token check: UCX holds such a socket open for ever). At most
  :data:`MAX_UNPROVEN_CONNECTIONS` unproven connections are kept; beyond, the oldest are closed.
  All of these count in ``endpoints_refused``. UCX's transport (the sockets the bytes travel on)
  uses only the interfaces that hold ``host``'s addresses (``UCX_NET_DEVICES``, see
  :func:`net_devices`) unless the environment sets ``UCX_NET_DEVICES`` itself (an RDMA fabric names
  its devices there, e.g. ``mlx5_0:1``).

Process-global state (ucxx's, not ours): ucxx has one application context per process,
initialised on first use with a *progress mode* that cannot change afterwards. The first
:meth:`DataPlane.start` or :meth:`DataPlane.connect` initialises it with :data:`PROGRESS_MODE`
unless ``UCXPY_PROGRESS_MODE`` is set (then ucxx's own variable wins) or something else in the
process initialised ucxx already (then its choice stays). kvtier never calls ``ucxx.reset()``:
it would fail while any listener or endpoint exists. ucxx binds its progress to each event loop
that uses it, and in thread mode its completion-notifier thread to *one* loop: planes of one
process must share a loop at a time (a plane on a second loop while one is open on the first is
a ``RuntimeError``); sequential loops, as in tests, are fine — the notifier thread is rebound
when the first plane of a new loop starts, and stopped when the last plane closes (the non-daemon
thread would otherwise keep the process from exiting). Stopping it takes up to 1 s (its wait
period), joined off the loop: that is most of what :meth:`DataPlane.aclose` costs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

import anyio

from kvtier.errors import ConfigError, KvtierError
from kvtier.throttled_log import ThrottledLog
from kvtier.tiers.p2p.netif import (
    Connection,
    accepted_connections,
    addresses_of,
    host_addresses,
    net_devices,
    shut_down,
    ucp_library,
)

__all__ = [
    "DataPlane",
    "DataPlaneError",
    "DataPlaneStatistics",
    "Link",
    "PROGRESS_MODE",
    "REASONS",
    "TOKEN_BYTES",
    "chunk_tag",
    "progress_mode",
]

logger = logging.getLogger(__name__)

TOKEN_BYTES: Final = 32

#: ucxx progress mode set at initialisation unless ``UCXPY_PROGRESS_MODE`` says otherwise.
#: "thread" with Python futures: a C++ thread progresses the worker (blocking on its epoll fd when
#: there is nothing to do) and a notifier thread completes asyncio futures, so neither an idle
#: plane nor a receive waiting for a slow producer costs CPU. ucxx's "blocking" and "polling"
#: modes await each request by yielding to the loop in a busy loop: a pending receive keeps a
#: whole core busy, which a small serving host cannot spare while a producer waits for its
#: stores. See benchmarks/p2p_tier.py for the throughput.
PROGRESS_MODE: Final = "thread"

#: Every value ``DataPlaneError.reason`` takes.
REASONS: Final = frozenset({
    "closed",           # the link or the plane was closed (by this process), or an op was cancelled
    "peer_gone",        # the peer closed its endpoint, died or became unreachable
    "refused",          # connect(): the producer did not accept the token (or is not listening)
    "revoked",          # accepted(): the session's token was revoked while waiting
    "unknown_session",  # accepted(): no token was issued to this session
    "timeout",          # connect()/accepted() did not complete within `timeout`
    "bad_token",        # connect(): the token (from the peer's ConnectAck) is not TOKEN_BYTES long
})

_MASK64: Final = (1 << 64) - 1
# Wire tags of the two handshake messages (before a Link exists); never equal to a chunk's
# wire tag except by a 2**-64 accident.
_TOKEN_TAG: Final = 0x6B76_7469_6572_546B  # "kvtierTk"
_ACK_TAG: Final = 0x6B76_7469_6572_416B  # "kvtierAk"
_ACCEPTED: Final = b"\x01"
_DRAIN_S: Final = 2.0  # aclose(): the longest it waits for aborted operations to report
#: Connections to the data port that are neither a link nor in a token handshake, kept at most.
MAX_UNPROVEN_CONNECTIONS: Final = 128
_GUARD_PERIOD_MAX_S: Final = 1.0  # guard(): how often the port's connections are looked at, at most


class DataPlaneError(KvtierError):
    """A data-plane operation failed; ``reason`` (one of :data:`REASONS`) says how."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class DataPlaneStatistics:
    """A snapshot of one plane's counters (monotonic, except the two gauges at the end)."""

    endpoints_accepted: int
    endpoints_refused: int  # missing, wrong or reused token, or none within accept_timeout_s
    bytes_sent: int
    bytes_received: int
    links_open: int  # accepted and connected links not closed yet
    sessions: int  # tokens currently issued


def chunk_tag(kv_request_id: str, round_seq: int, index: int) -> int:
    """The 64-bit tag of chunk ``index`` of fetch round ``round_seq`` of a request.

    Stable across processes, platforms and Python versions (BLAKE2b of a length-prefixed
    encoding, no ``hash()``), so producer and consumer compute it independently. The top bit is
    always set: tags below ``2**63`` are left to the plane's own messages.
    """
    rid = kv_request_id.encode()
    digest = hashlib.blake2b(
        len(rid).to_bytes(4, "little") + rid + round_seq.to_bytes(8, "little") + index.to_bytes(8, "little"),
        digest_size=8, person=b"kvtier-p2p-tag",
    ).digest()
    return int.from_bytes(digest, "little") | 1 << 63


def _wire_tag(tag: int, nbytes: int) -> int:
    # Mixing the length in makes a size mismatch a non-match: UCX would otherwise fill a larger
    # receive buffer partially and report success (ucxx does not expose the received length).
    digest = hashlib.blake2b((tag & _MASK64).to_bytes(8, "little") + nbytes.to_bytes(8, "little"),
                             digest_size=8, person=b"kvtier-p2p-wire").digest()
    return int.from_bytes(digest, "little")


# -- ucxx, imported and initialised on first use --------------------------------------------------

_ucxx_module: Any = None
_net_devices: str | None = None  # UCX_NET_DEVICES of this process's ucxx context ("" = every device)
# With Python futures (thread mode), ucxx completes requests through one notifier thread bound to
# one event loop, and that non-daemon thread keeps the process from exiting until it is stopped.
# kvtier binds it to the loop of the planes in use and stops it when the last plane closes.
_notifier_loop: asyncio.AbstractEventLoop | None = None
_planes_in_use = 0
_notifier_lock = threading.Lock()  # ucxx's stop_notifier_thread() is not safe to call concurrently


def _ucxx(devices: str | None = None) -> Any:
    """Import ucxx and initialise its process-global context once (see the module docstring).

    ``devices``: the ``UCX_NET_DEVICES`` the first initialisation uses (None: every device),
    unless the environment sets ``UCX_NET_DEVICES`` (then it wins). The context cannot change
    afterwards: a later plane that wants other devices is told so in the log.
    """
    global _ucxx_module, _notifier_loop, _net_devices
    if _ucxx_module is None:
        # ucxx sets UCX_MEMTYPE_CACHE, which libucx >= 1.19 no longer knows: it would warn on stderr.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx  # type: ignore[import-untyped]
        except ImportError as exc:
            raise ConfigError(
                f"the p2p tier needs ucxx, which is not importable here ({exc}): "
                "pip install 'kvtier[p2p]'"
            ) from None

        mode = os.environ.get("UCXPY_PROGRESS_MODE") or PROGRESS_MODE
        futures = None if "UCXPY_ENABLE_PYTHON_FUTURE" in os.environ else mode.startswith("thread")
        chosen = os.environ.get("UCX_NET_DEVICES") or devices or ""
        try:
            ucxx.init(options={"NET_DEVICES": devices} if devices else {}, env_takes_precedence=True,
                      progress_mode=mode, enable_python_future=futures)
        except RuntimeError:  # "UCX is already initiated": someone else chose; keep it
            logger.info("ucxx was initialised elsewhere in this process; keeping its progress mode "
                        "and network devices")
            chosen = os.environ.get("UCX_NET_DEVICES", "")
        else:
            _notifier_loop = asyncio.get_running_loop()  # init started the notifier on this loop
            logger.info("ucxx initialised: progress mode %s, network devices %s", mode, chosen or "all")
        _net_devices = chosen
        _ucxx_module = ucxx
    elif devices and devices != _net_devices and not os.environ.get("UCX_NET_DEVICES"):
        logger.warning("ucxx in this process already uses network devices %s; a data plane that "
                       "asked for %s shares them", _net_devices or "all", devices)
    return _ucxx_module


def _acquire(devices: str | None) -> Any:
    """ucxx for a plane about to use it on the running loop (paired with :func:`_release`)."""
    global _notifier_loop, _planes_in_use
    ucxx = _ucxx(devices)
    context = ucxx.core._get_ctx()
    loop = asyncio.get_running_loop()
    if context.enable_python_future and _notifier_loop is not loop:
        if _planes_in_use:
            raise RuntimeError("ucxx's notifier thread serves one event loop: close the data planes "
                               "of the other loop first")
        _stop_notifier()
        context.start_notifier_thread()  # binds the new thread to the running loop
        _notifier_loop = loop
    _planes_in_use += 1
    return ucxx


async def _release() -> None:
    global _notifier_loop, _planes_in_use
    _planes_in_use -= 1
    if _planes_in_use == 0 and _notifier_loop is not None:
        _notifier_loop = None
        # Else the process cannot exit (ucxx's own warning). The thread notices within its 1 s
        # wait period; joining it off the loop keeps the loop serving meanwhile.
        await anyio.to_thread.run_sync(_stop_notifier)


def _stop_notifier() -> None:
    with _notifier_lock:
        _ucxx_module.stop_notifier_thread()


def progress_mode() -> str:
    """The progress mode of this process's ucxx context (initialising it if needed)."""
    ucxx = _ucxx()
    return str(ucxx.core._get_ctx().progress_mode)


def _view(buffer: Any, *, writable: bool) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("data-plane buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("recv needs a writable buffer")
    return view


# -- links -----------------------------------------------------------------------------------------


class Link:
    """One UCX endpoint between a consumer and a producer, after the token handshake.

    Made by :meth:`DataPlane.connect` (consumer) or returned by :meth:`DataPlane.accepted`
    (producer); owned by whoever got it, who calls :meth:`close` (the plane's ``aclose`` also
    closes it). ``send``/``recv`` may be called concurrently from many tasks.
    """

    def __init__(self, endpoint: Any, plane: DataPlane, session_id: str | None,
                 remote: tuple[str, int] | None = None) -> None:
        self._endpoint = endpoint
        self._plane = plane
        self._closed = False
        #: The session whose token opened the link (producer side); None on the consumer side.
        self.session_id = session_id
        #: Producer side: the consumer's address on the connection to the data port, if UCX told it.
        self.remote = remote

    @property
    def closed(self) -> bool:
        """True once the link was closed here or its endpoint reported an error (peer gone)."""
        return self._closed or bool(self._endpoint.closed)

    async def send(self, view: memoryview, tag: int) -> None:
        """Send the whole of ``view`` (zero-copy); returns when UCX no longer needs it.

        The receiver must post a ``recv`` of the same ``tag`` and exactly the same length.
        Raises :class:`DataPlaneError` if the link is closed or fails meanwhile; cancelling the
        call closes the link (see the module docstring).
        """
        src = _view(view, writable=False)
        await self._transfer(src, tag, sending=True)
        if self._endpoint.closed:
            # ucxx's Endpoint.send returns normally when UCX cancelled the request while the
            # endpoint object still exists (peer error): never report that as sent.
            self._abort()
            raise DataPlaneError("peer_gone", "the endpoint failed while sending")
        self._plane._bytes_sent += src.nbytes

    async def recv(self, view: memoryview, tag: int) -> None:
        """Receive the message sent with ``tag`` into ``view``, filling it exactly (zero-copy).

        A message of another length never matches (the length is part of the wire tag): the
        call then waits for the caller's deadline or the link's failure. Raises
        :class:`DataPlaneError` if the link is closed or fails meanwhile; cancelling the call
        closes the link, after which nothing is written into ``view``.
        """
        dst = _view(view, writable=True)
        await self._transfer(dst, tag, sending=False)
        self._plane._bytes_received += dst.nbytes

    async def _transfer(self, view: memoryview, tag: int, *, sending: bool) -> None:
        if self.closed:
            raise DataPlaneError("closed" if self._closed else "peer_gone")
        wire = _wire_tag(tag, view.nbytes)
        endpoint = self._endpoint
        plane = self._plane
        plane._in_flight += 1
        try:
            if sending:
                await endpoint.send(view, tag=wire)
            else:
                await endpoint.recv(view, tag=wire)
        except Exception as exc:
            closed_here = self._closed
            self._abort()
            raise DataPlaneError("closed" if closed_here else "peer_gone", f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancellation: only closing the endpoint withdraws the request
            self._abort()
            raise
        finally:
            plane._in_flight -= 1

    async def close(self) -> None:
        """Close the endpoint (idempotent); pending operations fail with ``DataPlaneError``."""
        if self._closed:
            return
        self._closed = True
        self._plane._forget(self)
        try:
            await self._endpoint.close()
        except Exception as exc:  # already failed: nothing left to flush
            logger.debug("closing a data link: %s", exc)
        finally:
            self._endpoint.abort()  # idempotent; covers a close() cancelled before it aborted

    def _abort(self) -> None:
        """Close at once without flushing (sync: from revoke, errors and cancellations)."""
        if not self._closed:
            self._closed = True
            self._plane._forget(self)
        self._endpoint.abort()


# -- the plane -------------------------------------------------------------------------------------


@dataclass
class _Session:
    token: bytes
    link: Link | None = None
    failure: str | None = None  # set when revoked or the plane closed
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class DataPlane:
    """One process's UCX listener, its issued tokens and every link it opened or accepted.

    Lifecycle: ``await start()`` (producer side; a consumer-only plane may skip it), then any of
    the methods, then ``await aclose()`` once, by the owner. ``issue_token``, ``revoke`` and
    ``statistics`` never block. A producer runs :meth:`guard` in its task group while it serves.

    ``host``: the address this instance serves on (the p2p tier's ``host``). UCX's transport is
    confined to its interfaces (:func:`net_devices`, when this plane initialises ucxx), and the
    guard closes connections to the data port that arrive on other addresses. None: no
    confinement (every interface), the guard only closes connections that present no token.
    """

    def __init__(self, *, host: str | None = None, accept_timeout_s: float = 5.0) -> None:
        if not accept_timeout_s > 0:
            raise ValueError(f"accept_timeout_s must be positive, not {accept_timeout_s!r}")
        self.accept_timeout_s = accept_timeout_s
        self.host = host
        self._addresses = host_addresses(host) if host is not None else frozenset()
        self._devices = net_devices(host) if host is not None else None
        self.port: int | None = None
        self._listener: Any = None
        self._closing = False
        self._sessions: dict[str, _Session] = {}
        self._by_token: dict[bytes, str] = {}
        self._links: set[Link] = set()
        # Endpoints that have not presented a token yet -> their connection's peer address.
        self._handshaking: dict[Any, tuple[str, int] | None] = {}
        self._refusals = ThrottledLog(logger, interval_s=10.0)
        self._accepted = 0
        self._refused = 0
        self._bytes_sent = 0
        self._bytes_received = 0
        self._in_flight = 0  # UCX operations awaited right now (links, handshakes, connects)
        self._ucxx: Any = None  # ucxx, once this plane acquired it

    def _use_ucxx(self) -> Any:
        if self._ucxx is None:
            self._ucxx = _acquire(self._devices)
        return self._ucxx

    def statistics(self) -> DataPlaneStatistics:
        return DataPlaneStatistics(
            endpoints_accepted=self._accepted, endpoints_refused=self._refused,
            bytes_sent=self._bytes_sent, bytes_received=self._bytes_received,
            links_open=sum(not link.closed for link in self._links), sessions=len(self._sessions))

    async def start(self) -> int:
        """Listen on a port the OS picks, **on all interfaces** (ucxx takes no host); return it."""
        if self._closing:
            raise DataPlaneError("closed", "the data plane is closed")
        if self._listener is not None:
            raise RuntimeError("DataPlane.start() was called twice")
        ucxx = self._use_ucxx()
        self._listener = ucxx.create_listener(self._on_endpoint, port=0,
                                              connect_timeout=self.accept_timeout_s)
        self.port = int(self._listener.port)
        return self.port

    def issue_token(self, session_id: str) -> bytes:
        """A fresh 32-byte token for ``session_id``, valid until revoked or reissued.

        Reissuing replaces the session's previous token and closes the link it opened.
        """
        self.revoke(session_id)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._sessions[session_id] = _Session(token)
        self._by_token[token] = session_id
        return token

    def revoke(self, session_id: str) -> Link | None:
        """Forget the session's token and close its link; a waiting ``accepted`` fails.

        Returns the link it closed (None if the session had none, or is unknown).
        """
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        self._by_token.pop(session.token, None)
        session.failure = "revoked"
        session.ready.set()
        if session.link is not None:
            session.link._abort()
        return session.link

    async def accepted(self, session_id: str, timeout: float) -> Link:
        """Producer: the link the consumer opened with this session's token.

        Waits up to ``timeout`` seconds for it; ``DataPlaneError`` with reason ``timeout``,
        ``revoked`` (revoked or reissued meanwhile), ``unknown_session`` or ``closed``.
        """
        session = self._sessions.get(session_id)
        if session is None:
            raise DataPlaneError("closed" if self._closing else "unknown_session", session_id)
        with anyio.move_on_after(timeout):
            await session.ready.wait()
        if session.link is not None:
            return session.link
        raise DataPlaneError(session.failure or "timeout", session_id)

    async def connect(self, host: str, port: int, token: bytes, timeout: float) -> Link:
        """Consumer: open an endpoint to ``host:port``, present ``token``, return the accepted link.

        ``DataPlaneError`` with reason ``refused`` (the token was not accepted, or nothing
        listens there), ``timeout``, ``closed`` or ``bad_token`` (not :data:`TOKEN_BYTES` long:
        the token comes from the peer, so this is the peer's fault, not a caller's bug).
        """
        if len(token) != TOKEN_BYTES:
            raise DataPlaneError("bad_token", f"a data-plane token has {TOKEN_BYTES} bytes, not {len(token)}")
        if self._closing:
            raise DataPlaneError("closed", "the data plane is closed")
        ucxx = self._use_ucxx()
        endpoint = None
        self._in_flight += 1
        try:
            with anyio.fail_after(timeout):
                endpoint = await ucxx.create_endpoint(host, port, connect_timeout=timeout)
                await endpoint.send(memoryview(bytes(token)), tag=_wire_tag(_TOKEN_TAG, TOKEN_BYTES))
                answer = bytearray(1)
                await endpoint.recv(answer, tag=_wire_tag(_ACK_TAG, 1))
                if bytes(answer) != _ACCEPTED or endpoint.closed:
                    raise DataPlaneError("refused", f"{host}:{port} answered {bytes(answer)!r}")
        except TimeoutError:
            if endpoint is not None:
                endpoint.abort()
            raise DataPlaneError("timeout", f"no accepted link to {host}:{port} within {timeout} s") from None
        except DataPlaneError:
            if endpoint is not None:
                endpoint.abort()
            raise
        except Exception as exc:  # ucxx errors: connection refused/reset, endpoint closed by the listener
            if endpoint is not None:
                endpoint.abort()
            raise DataPlaneError("refused", f"{host}:{port}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            if endpoint is not None:
                endpoint.abort()
            raise
        finally:
            self._in_flight -= 1
        if self._closing:  # closed while we connected
            endpoint.abort()
            raise DataPlaneError("closed", "the data plane is closed")
        link = Link(endpoint, self, None)
        self._links.add(link)
        return link

    async def aclose(self) -> None:
        """Stop listening, close every link and pending handshake; fail waiting ``accepted`` calls.

        Idempotent. Tokens are forgotten. The process's ucxx context stays (see module docstring).
        """
        self._closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for endpoint in list(self._handshaking):
            endpoint.abort()
        self._handshaking.clear()
        for session_id in list(self._sessions):
            self.revoke(session_id)
        for link in list(self._links):
            await link.close()
        # Let the aborted operations' waiters see their cancellation before the notifier thread
        # that completes them may stop (bounded: a waiter whose task never runs cannot block us).
        with anyio.move_on_after(_DRAIN_S, shield=True):
            while self._in_flight or (listener is not None and listener.active_clients):
                await asyncio.sleep(0.005)
        del listener  # only now: ucxx warns when a listener with live handlers is destroyed
        if self._ucxx is not None:
            self._ucxx = None
            with anyio.CancelScope(shield=True):
                await _release()

    async def guard(self) -> None:
        """Close the data port's connections that are not links; runs until cancelled.

        Every ``accept_timeout_s / 2`` (at most 1 s) it lists this process's connections to
        :attr:`port` (Linux ``/proc``, read on a worker thread) and shuts down, under UCX, each one
        that (a) arrived on an address that is not ``host``'s, at once; (b) is neither a link's
        nor an endpoint's in its token handshake, once it is ``accept_timeout_s`` old (ucxx's own
        exchange before the token is bounded by the same timeout); (c) is unproven beyond the
        newest :data:`MAX_UNPROVEN_CONNECTIONS`. Each counts in ``endpoints_refused``; the log
        says so at most once per 10 s per kind. Without ``/proc`` or ``ucp_ep_query`` (a link
        cannot be told from a stranger) it logs that once and returns.
        """
        if self.port is None:
            raise RuntimeError("DataPlane.guard() needs start() first")
        if ucp_library() is None or not os.path.isdir("/proc/self/fd"):
            logger.warning("data plane: cannot list or identify connections here; connections to "
                           "port %d that present no token are not closed", self.port)
            return
        period = min(_GUARD_PERIOD_MAX_S, self.accept_timeout_s / 2)
        first_seen: dict[int, float] = {}  # inode -> when the guard first saw it unproven
        shut: set[int] = set()  # inodes shut down, until UCX closes them
        while not self._closing:
            await anyio.sleep(period)
            try:
                connections = await anyio.to_thread.run_sync(accepted_connections, self.port)
            except Exception as exc:  # noqa: BLE001 - an unreadable /proc must not end serving
                self._refusals("listing", "data plane: cannot list the connections to port %d: %r",
                               self.port, exc)
                continue
            links = [link.remote for link in self._links if link.session_id is not None]
            unnamed_link = None in links
            if unnamed_link:
                # UCX did not name some link's connection: closing by age could cut that link.
                self._refusals("unnamed", "data plane: a link's connection is unknown to UCX; "
                               "connections to port %d are not closed by age meanwhile", self.port)
            proven = {remote for remote in (*links, *self._handshaking.values()) if remote is not None}
            now = time.monotonic()
            unproven: list[tuple[float, Connection]] = []
            for connection in connections:
                if connection.inode in shut:
                    continue
                if self._addresses and connection.local[0] not in self._addresses:
                    # Before anything else: a token does not make another interface acceptable.
                    self._refuse(connection, shut, "arrived on %s, not on the configured host %s",
                                 connection.local[0], self.host)
                    continue
                if connection.remote not in proven:
                    unproven.append((first_seen.setdefault(connection.inode, now), connection))
            unproven.sort(key=lambda item: item[0])
            excess = len(unproven) - MAX_UNPROVEN_CONNECTIONS
            for i, (seen, connection) in enumerate(unproven):
                if unnamed_link:
                    break
                if i < excess:
                    self._refuse(connection, shut, "was one of more than %d unproven connections",
                                 MAX_UNPROVEN_CONNECTIONS)
                elif now - seen >= self.accept_timeout_s:
                    self._refuse(connection, shut, "presented no token within %s s", self.accept_timeout_s)
            alive = {connection.inode for connection in connections}
            for inode in [inode for inode in first_seen if inode not in alive]:
                del first_seen[inode]
            shut &= alive

    def _refuse(self, connection: Connection, shut: set[int], why: str, *args: Any) -> None:
        if shut_down(connection):
            shut.add(connection.inode)
            self._refused += 1
            self._refusals(why, "data plane: closed a connection from %s that " + why,
                           f"{connection.remote[0]}:{connection.remote[1]}", *args)

    def _forget(self, link: Link) -> None:
        self._links.discard(link)

    async def _on_endpoint(self, endpoint: Any) -> None:
        """ucxx's listener callback (a task of its own, on our loop): check the token, then accept."""
        if self._closing:
            endpoint.abort()
            return
        local, remote = addresses_of(endpoint)
        if self._addresses and local is not None and local[0] not in self._addresses:
            endpoint.abort()
            self._refused += 1
            self._refusals("interface", "data plane: closed an endpoint from %s that arrived on %s, "
                           "not on the configured host %s", remote, local[0], self.host)
            return
        self._handshaking[endpoint] = remote
        self._in_flight += 1
        try:
            reason = await self._handshake(endpoint, remote)
        finally:
            self._in_flight -= 1
            self._handshaking.pop(endpoint, None)
        if reason is None:
            return
        endpoint.abort()
        if not self._closing:
            self._refused += 1
            self._refusals("endpoint", "data plane: closed an endpoint that %s", reason)

    async def _handshake(self, endpoint: Any, remote: tuple[str, int] | None) -> str | None:
        """Accept ``endpoint`` as a session's link; or return why it is refused."""
        token = bytearray(TOKEN_BYTES)
        try:
            await asyncio.wait_for(endpoint.recv(token, tag=_wire_tag(_TOKEN_TAG, TOKEN_BYTES)),
                                   self.accept_timeout_s)
        except asyncio.TimeoutError:
            return f"presented no token within {self.accept_timeout_s} s"
        except Exception as exc:
            return f"failed before presenting a token ({type(exc).__name__})"
        session_id = self._by_token.get(bytes(token))
        session = None if session_id is None else self._sessions.get(session_id)
        if session is None or session_id is None:
            return "presented an unknown or revoked token"
        if session.link is not None:
            return f"presented the token of session {session_id!r}, whose link is already open"
        try:
            await asyncio.wait_for(endpoint.send(memoryview(_ACCEPTED), tag=_wire_tag(_ACK_TAG, 1)),
                                   self.accept_timeout_s)
        except (asyncio.TimeoutError, Exception) as exc:
            return f"went away before the acknowledgement ({type(exc).__name__})"
        if self._sessions.get(session_id) is not session or self._closing:
            return "presented a token revoked during the handshake"
        link = Link(endpoint, self, session_id, remote)
        session.link = link
        self._links.add(link)
        self._accepted += 1
        session.ready.set()
        return None

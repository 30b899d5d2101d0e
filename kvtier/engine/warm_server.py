"""The warm-up endpoint: a ZeroMQ ROUTER a router calls to have the engine prefetch a prefix.

A request (:class:`~kvtier.engine.warm_protocol.Prefetch`) names a prompt's token ids, its extra
keys, the tiers to consult and a deadline; the server runs ``engine.prefetch`` for it and answers
with the outcome or an error (:mod:`kvtier.engine.warm_protocol`; ``docs/embedding.md``,
"Warm-up endpoint"). Opt-in: ``kvtier.open(..., warmup={...})`` starts one
(:func:`warmup_options` checks the dict).

Semantics callers rely on:

* **Runs on asyncio and trio.** The sockets live in a thread the server owns (pyzmq's async API is
  asyncio-only); the thread receives and validates requests and sends replies, and each accepted
  request runs as a task in the server's task group on the engine's event loop.
* **Bind only what is configured.** The ROUTER binds ``tcp://host:port``, ``host`` an IP literal
  (default ``127.0.0.1``); a wildcard (``0.0.0.0``, ``::``) only when configured so. ``port=0``
  binds an ephemeral port (:attr:`WarmupServer.port` once started).
* **Bounded.** A frame over ``max_request_bytes`` is answered ``too_large`` unread; one over twice
  that is cut by libzmq itself (``ZMQ_MAXMSGSIZE``: the connection is dropped, no reply). More than
  ``max_tokens`` token ids is ``too_large``; more than ``max_in_flight`` requests at once, the
  rest are answered ``busy`` at once. A request's deadline is capped at ``deadline_s``.
* **The engine never sees a bad request.** Malformed, oversized and unauthenticated requests are
  refused in the server thread; a request the engine refuses (``TypeError``/``ValueError``) is
  ``bad_request`` with the engine's message, ``EngineClosedError`` is ``closed``, anything else
  ``internal``. A reply never carries the request's ``cache_salt`` and nothing logs it.
* **Authentication.** With ``curve_secret_key_file``, ``curve_public_key_file`` and
  ``curve_allowed_clients_dir`` the ROUTER is a CurveZMQ server whose ZAP handler admits only
  clients whose public certificate (``*.key``) is in the directory, read at start; a client with
  another key, or without CURVE, is refused during the handshake (no reply is possible) and counted
  in ``statistics().connections_refused`` (``untrusted_key``, ``handshake_failed``). Without the
  keys, a server on a non-loopback address logs once that it is unauthenticated. Key material is
  read from files only and never logged.
* **Counted.** :meth:`WarmupServer.statistics`: messages received, prefetches answered,
  refusals by error code, connections refused.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio
import anyio.from_thread
import anyio.to_thread
import zmq
from anyio.abc import TaskGroup, TaskStatus
from zmq.utils.monitor import parse_monitor_message

from kvtier.config.curve import load_certificate, require_curve
from kvtier.config.schema import KeySpec, parse_section
from kvtier.engine.warm_protocol import (
    MAX_TOKENS_LIMIT,
    Error,
    Outcome,
    Prefetch,
    RequestRefused,
    decode_request,
    encode,
    scrubbed,
)
from kvtier.errors import ConfigError, EngineClosedError, trim_traceback
from kvtier.throttled_log import ThrottledLog

__all__ = ["WARMUP_SCHEMA", "WarmupTarget", "WarmupOptions", "WarmupServer", "WarmupStatistics", "warmup_options"]

logger = logging.getLogger(__name__)

_ZAP_DOMAIN: Final = "kvtier-warmup"
_POLL_MS: Final = 100  # how often the server thread looks at the stop flag without a wake-up
_RECV_BUDGET: Final = 64  # messages read before the thread sends replies again
_REPLY_HWM: Final = 1000
_DEADLINE_GRACE_S: Final = 5.0  # beyond its deadline, a prefetch that has not returned is abandoned
_REFUSED_EVENTS: Final[dict[int, str]] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "untrusted_key",  # the ZAP handler's verdict
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
}


def _ip_literal(value: Any) -> str | None:
    try:
        ipaddress.ip_address(value.removeprefix("[").removesuffix("]"))
    except ValueError:
        return "must be an IPv4 or IPv6 address literal (the one address the endpoint binds)"
    return None


def _no_nul(value: Any) -> str | None:
    return "must not contain NUL bytes" if "\x00" in value else None


_KEY_FILE = KeySpec("str", default=None, nullable=True, non_empty=True, max_len=4096, check=_no_nul)

#: The ``warmup`` dictionary of ``kvtier.open`` (``docs/embedding.md``, "Warm-up endpoint").
WARMUP_SCHEMA: Mapping[str, KeySpec] = {
    "host": KeySpec("str", default="127.0.0.1", non_empty=True, max_len=47, check=_ip_literal,
                    help="an IP literal; 0.0.0.0 or :: bind every interface"),
    "port": KeySpec("int", ge=0, le=65535, help="0: an ephemeral port"),
    "max_in_flight": KeySpec("int", default=8, ge=1, le=4096),
    "max_request_bytes": KeySpec("int", default=1 << 20, ge=1024, le=1 << 30),
    "max_tokens": KeySpec("int", default=1 << 20, ge=1, le=MAX_TOKENS_LIMIT),
    "deadline_s": KeySpec("float", default=10.0, gt=0, le=3600, help="the cap of a request's deadline"),
    "curve_secret_key_file": _KEY_FILE,
    "curve_public_key_file": _KEY_FILE,
    "curve_allowed_clients_dir": _KEY_FILE,
}
_CURVE_KEYS: Final = ("curve_secret_key_file", "curve_public_key_file", "curve_allowed_clients_dir")


@dataclass(frozen=True)
class WarmupOptions:
    """The checked ``warmup`` options (:data:`WARMUP_SCHEMA`); ``host`` without brackets."""

    port: int
    host: str = "127.0.0.1"
    max_in_flight: int = 8
    max_request_bytes: int = 1 << 20
    max_tokens: int = 1 << 20
    deadline_s: float = 10.0
    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    curve_allowed_clients_dir: str | None = None

    @property
    def curve(self) -> bool:
        return self.curve_secret_key_file is not None


def warmup_options(raw: Any) -> WarmupOptions:
    """Check the ``warmup`` dictionary of ``kvtier.open``.

    Raises :class:`~kvtier.errors.ConfigError` naming ``warmup.<key>`` for an unknown key, a bad
    value, a missing ``port``, or some but not all of the three ``curve_*`` keys. Key files are
    read when the server starts.
    """
    try:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"warmup must be a dict, got {type(raw).__name__}")
        values = parse_section(raw, WARMUP_SCHEMA, "warmup")
        given = [key for key in _CURVE_KEYS if values[key] is not None]
        if given and len(given) != len(_CURVE_KEYS):
            missing = next(key for key in _CURVE_KEYS if values[key] is None)
            raise ConfigError(f"missing key warmup.{missing}: CurveZMQ needs all of {', '.join(_CURVE_KEYS)}")
        values["host"] = values["host"].removeprefix("[").removesuffix("]")
        return WarmupOptions(**values)
    except ConfigError as exc:
        raise trim_traceback(exc)


@dataclass(frozen=True)
class WarmupStatistics:
    """Snapshot of a :class:`WarmupServer`'s counters (cumulative except ``in_flight``)."""

    requests: int
    """Messages received (well-formed or not)."""
    ok: int
    """Prefetches answered with an outcome."""
    in_flight: int
    """Requests being prefetched now."""
    refused: dict[str, int] = field(default_factory=dict)
    """Error replies, by code (``bad_request``, ``too_large``, ``busy``, ``closed``, ``internal``)."""
    connections_refused: dict[str, int] = field(default_factory=dict)
    """Connections refused in the handshake: ``untrusted_key``, ``handshake_failed``."""


class WarmupTarget(Protocol):
    """What the server needs of the engine: :meth:`kvtier.Engine.prefetch`."""

    async def prefetch(self, token_ids: Sequence[int], params: Mapping[str, Any] | None = None, *,
                       cache_salt: str | None = None, lora_name: str | None = None, lora_path: str | None = None,
                       mm_items: Sequence[tuple[str, int, int]] | None = None, prompt_embeds: Any = None,
                       tiers: Sequence[Any] | None = None, deadline_s: float | None = None,
                       evict: bool = True) -> Any: ...


@dataclass(frozen=True)
class _Job:
    identity: bytes
    envelope: tuple[bytes, ...]  # b"" for a REQ client's delimiter, nothing for a DEALER's
    request: Prefetch


@dataclass(frozen=True)
class _Keys:
    public: bytes
    secret: bytes  # never logged


class WarmupServer:
    """The warm-up endpoint of one engine; ``await tg.start(server.run)`` starts it.

    ``engine`` is anything with the engine's async ``prefetch`` (:class:`WarmupTarget`). :attr:`endpoint`
    and :attr:`port` are the bound address once ``run`` has signalled it started. :meth:`aclose`
    (or cancelling ``run``) stops the thread, closes the socket and cancels prefetches in flight.
    """

    def __init__(self, engine: WarmupTarget, options: WarmupOptions) -> None:
        self._engine = engine
        self.options = options
        self.port = options.port
        self.endpoint: str | None = None
        self._stop = threading.Event()
        self._replies: queue.SimpleQueue[tuple[_Job | None, bytes, tuple[bytes, ...], bytes]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # counters are written by the thread and the event loop
        self._requests = 0
        self._ok = 0
        self._refused: dict[str, int] = {}
        self._connections_refused: dict[str, int] = {}
        self._in_flight = 0  # written by the server thread only
        self._tg: TaskGroup | None = None
        self._wake_tx: zmq.Socket[bytes] | None = None  # event-loop side only
        self._started = False
        self._finished: anyio.Event | None = None
        self._thread_log = ThrottledLog(logger, interval_s=60.0)  # the server thread's
        self._loop_log = ThrottledLog(logger, interval_s=60.0)  # the event loop's

    def __repr__(self) -> str:
        return f"WarmupServer(endpoint={self.endpoint!r})"

    def statistics(self) -> WarmupStatistics:
        with self._lock:
            return WarmupStatistics(requests=self._requests, ok=self._ok, in_flight=self._in_flight,
                                    refused=dict(self._refused), connections_refused=dict(self._connections_refused))

    # ---------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, then serve until :meth:`aclose` or cancellation.

        Raises :class:`~kvtier.errors.ConfigError` before ``task_status.started()`` when a key
        file is missing or unusable (naming its key) or the address cannot be bound.
        """
        if self._started:
            raise RuntimeError("a WarmupServer runs once")
        self._started = True
        self._finished = anyio.Event()
        opts = self.options
        try:
            keys = _load_keys(opts) if opts.curve else None
        except BaseException:
            self._finished.set()
            raise
        if keys is None and not ipaddress.ip_address(opts.host).is_loopback:
            logger.warning("the warm-up endpoint on %s has no CurveZMQ keys: any host that can reach the port "
                           "can make this engine prefetch (configure warmup.curve_* to restrict it)", opts.host)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        authenticator: Any = None
        try:
            if keys is not None:
                from zmq.auth.thread import ThreadAuthenticator

                authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.auth"))
                authenticator.start()
                authenticator.configure_curve(domain=_ZAP_DOMAIN, location=opts.curve_allowed_clients_dir)
            router = ctx.socket(zmq.ROUTER)
            sockets.append(router)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, _REPLY_HWM)
            # Twice the bound: a frame between one and two times it is answered "too_large"; libzmq
            # drops the connection of a larger one before reading it whole.
            router.setsockopt(zmq.MAXMSGSIZE, 2 * opts.max_request_bytes)
            if ":" in opts.host:
                router.setsockopt(zmq.IPV6, 1)
            if keys is not None:
                router.curve_secretkey = keys.secret
                router.curve_publickey = keys.public
                router.curve_server = True
                router.zap_domain = _ZAP_DOMAIN.encode()
            monitor = router.get_monitor_socket(sum(_REFUSED_EVENTS))
            sockets.append(monitor)
            host = f"[{opts.host}]" if ":" in opts.host else opts.host
            try:
                router.bind(f"tcp://{host}:{opts.port}")
            except zmq.ZMQError as exc:
                # An address this machine does not have is the host's fault; a port in use, the port's.
                key = "warmup.host" if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) else "warmup.port"
                raise ConfigError(f"{key}: the warm-up endpoint cannot bind tcp://{host}:{opts.port}: "
                                  f"{exc.strerror}") from None
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.port = int(self.endpoint.rpartition(":")[2])
            wake_rx = ctx.socket(zmq.PAIR)
            sockets.append(wake_rx)
            wake_tx = ctx.socket(zmq.PAIR)
            sockets.append(wake_tx)
            address = f"inproc://kvtier-warmup-wake-{id(self)}"
            wake_rx.bind(address)
            wake_tx.connect(address)
            wake_tx.setsockopt(zmq.SNDHWM, 1)
            self._wake_tx = wake_tx
        except BaseException:
            for sock in sockets:
                sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            ctx.term()
            self._finished.set()
            raise
        thread_done = anyio.Event()

        async def run_thread() -> None:
            try:
                # abandon_on_cancel=False: the thread is always joined; the stop flag ends it.
                await anyio.to_thread.run_sync(self._thread_main, router, monitor, wake_rx,
                                               abandon_on_cancel=False)
            finally:
                thread_done.set()

        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(run_thread)
                logger.info("warm-up endpoint on %s (%s)", self.endpoint, "CurveZMQ" if keys else "no authentication")
                task_status.started()
                try:
                    await thread_done.wait()
                finally:
                    self._stop.set()
                    self._wake()
                    tg.cancel_scope.cancel()  # prefetches in flight: nobody will read their replies
        finally:
            self._tg = None
            self._wake_tx = None
            wake_tx.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            ctx.term()  # every other socket was closed by the thread
            self._finished.set()

    async def aclose(self) -> None:
        """Stop serving: no request is read any more, prefetches in flight are cancelled; waits for
        ``run`` to end. Idempotent."""
        self._stop.set()
        self._wake()
        if self._finished is not None:
            await self._finished.wait()

    def _wake(self) -> None:
        if self._wake_tx is not None:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    # ---------------------------------------------------------------- the event loop's side

    def _spawn(self, job: _Job) -> None:
        if self._tg is None or self._stop.is_set():
            raise EngineClosedError("the warm-up endpoint is closing")
        self._tg.start_soon(self._prefetch, job)

    async def _prefetch(self, job: _Job) -> None:
        request = job.request
        started = time.monotonic()
        deadline = min(request.deadline_s or math.inf, self.options.deadline_s)
        reply: Outcome | Error
        try:
            with anyio.fail_after(deadline + _DEADLINE_GRACE_S):
                outcome = await self._engine.prefetch(
                    request.token_ids,
                    None if request.max_load_tokens is None else {"max_load_tokens": request.max_load_tokens},
                    cache_salt=request.cache_salt, lora_name=request.lora_name, lora_path=request.lora_path,
                    mm_items=None if request.mm_items is None else list(request.mm_items),
                    tiers=None if request.tiers is None else [_tier_entry(entry) for entry in request.tiers],
                    deadline_s=deadline, evict=request.evict,
                )
            reply = Outcome(
                id=request.id, tokens=int(outcome.tokens), pending=int(outcome.pending),
                chunks_by_tier={str(label): int(n) for label, n in outcome.chunks_by_tier.items()},
                timed_out=bool(outcome.timed_out), seconds=time.monotonic() - started,
            )
        except EngineClosedError:
            reply = Error(id=request.id, code="closed", message="the engine is closing")
        except (TypeError, ValueError) as exc:
            reply = Error(id=request.id, code="bad_request", message=scrubbed(str(exc), request.cache_salt))
        except TimeoutError:
            reply = Error(id=request.id, code="internal",
                          message=f"the prefetch did not return within its deadline ({deadline:g} s) "
                                  f"and {_DEADLINE_GRACE_S:g} s more")
        except Exception as exc:  # noqa: BLE001 - one request's failure must not end the server
            message = scrubbed(f"{type(exc).__name__}: {exc}", request.cache_salt)
            self._loop_log("internal", "warm-up prefetch failed: %s", message)
            reply = Error(id=request.id, code="internal", message=f"the prefetch failed ({type(exc).__name__})")
        self._replies.put((job, job.identity, job.envelope, encode(reply)))
        self._count(reply)
        self._wake()

    # ---------------------------------------------------------------- the server thread

    def _thread_main(self, router: zmq.Socket[bytes], monitor: zmq.Socket[bytes], wake_rx: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        for sock in (router, monitor, wake_rx):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if wake_rx in ready:
                    while wake_rx.poll(0, zmq.POLLIN):
                        wake_rx.recv(zmq.NOBLOCK)
                self._send_replies(router)
                if monitor in ready:
                    self._drain_monitor(monitor)
                if router in ready:
                    for _ in range(_RECV_BUDGET):
                        parts = _recv_parts(router)
                        if parts is None:
                            break
                        self._on_message(router, parts)
        finally:
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
            for sock in (router, monitor, wake_rx):
                sock.close(linger=0)

    def _on_message(self, router: zmq.Socket[bytes], parts: list[zmq.Frame]) -> None:
        with self._lock:
            self._requests += 1
        identity = parts[0].bytes
        if len(parts) == 2:
            envelope: tuple[bytes, ...] = ()
        elif len(parts) == 3 and len(parts[1]) == 0:
            envelope = (b"",)  # a REQ client's delimiter, echoed in the reply
        else:
            self._refuse(router, identity, (), "bad_request",
                         "expected one frame (a DEALER client) or an empty frame and one frame (a REQ client)")
            return
        try:
            request = decode_request(parts[-1].buffer, max_bytes=self.options.max_request_bytes,
                                     max_tokens=self.options.max_tokens)
        except RequestRefused as exc:
            self._refuse(router, identity, envelope, exc.code, exc.message, exc.request_id)
            return
        if self._in_flight >= self.options.max_in_flight:
            self._refuse(router, identity, envelope, "busy",
                         f"{self.options.max_in_flight} warm-up requests are in flight; try again later", request.id)
            return
        job = _Job(identity, envelope, request)
        self._in_flight += 1
        try:
            anyio.from_thread.run_sync(self._spawn, job)
        except Exception:  # noqa: BLE001 - the event loop is gone or the server is closing
            self._in_flight -= 1
            self._refuse(router, identity, envelope, "closed", "the engine is closing", request.id)

    def _refuse(self, router: zmq.Socket[bytes], identity: bytes, envelope: tuple[bytes, ...], code: str,
                message: str, request_id: int | str | None = None) -> None:
        reply = Error(id=request_id, code=code, message=message)
        self._count(reply)
        self._thread_log(code, "warm-up endpoint refused a request (%s): %r", code, message[:120])
        _send(router, identity, envelope, encode(reply))

    def _send_replies(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                job, identity, envelope, payload = self._replies.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._in_flight -= 1
            _send(router, identity, envelope, payload)

    def _drain_monitor(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reason = _REFUSED_EVENTS.get(int(parse_monitor_message(frames)["event"]))
            except Exception:  # noqa: BLE001 - a garbled monitor frame is not a client's doing
                continue
            if reason is None:
                continue
            with self._lock:
                self._connections_refused[reason] = self._connections_refused.get(reason, 0) + 1
            self._thread_log(f"connection:{reason}", "warm-up endpoint refused a connection: %s", reason)

    def _count(self, reply: Outcome | Error) -> None:
        with self._lock:
            if isinstance(reply, Outcome):
                self._ok += 1
            else:
                self._refused[reply.code] = self._refused.get(reply.code, 0) + 1


def _recv_parts(router: zmq.Socket[bytes]) -> list[zmq.Frame] | None:
    """One whole inbound message without blocking; keeps at most 4 parts in memory."""
    try:
        first = router.recv(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    parts = [first]
    while router.getsockopt(zmq.RCVMORE):
        part = router.recv(zmq.NOBLOCK, copy=False)  # parts of one message arrive together
        if len(parts) < 4:  # a fourth part already makes the message malformed
            parts.append(part)
    return parts


def _send(router: zmq.Socket[bytes], identity: bytes, envelope: tuple[bytes, ...], payload: bytes) -> None:
    try:
        # ROUTER never blocks: a reply to a client that left, or beyond SNDHWM, is dropped by libzmq.
        router.send_multipart([identity, *envelope, payload], zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def _tier_entry(entry: Any) -> Any:
    """A ``tiers`` entry as ``kv_load_tiers`` takes it (a matcher as a dict of its given axes)."""
    if isinstance(entry, (int, str)):
        return entry
    return {axis: value for axis in ("medium", "locality") if (value := getattr(entry, axis)) is not None}


def _load_keys(opts: WarmupOptions) -> _Keys:
    """Read and check the CURVE key pair; ConfigError names the key, never shows a secret."""
    import zmq

    require_curve("warmup.curve_secret_key_file")
    assert opts.curve_secret_key_file and opts.curve_public_key_file and opts.curve_allowed_clients_dir

    def certificate(key: str, path: str) -> tuple[bytes, bytes | None]:
        return load_certificate(f"warmup.{key}", path)

    public_in_secret_file, secret = certificate("curve_secret_key_file", opts.curve_secret_key_file)
    if secret is None:
        raise ConfigError(f"warmup.curve_secret_key_file: {opts.curve_secret_key_file!r} holds no secret key "
                          "(give the .key_secret certificate)")
    public, _ = certificate("curve_public_key_file", opts.curve_public_key_file)
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError):
        raise ConfigError(f"warmup.curve_secret_key_file: {opts.curve_secret_key_file!r} holds an invalid "
                          "secret key") from None
    if derived != public or public_in_secret_file != public:
        raise ConfigError(f"warmup.curve_public_key_file: {opts.curve_public_key_file!r} does not match the key "
                          f"pair of warmup.curve_secret_key_file ({opts.curve_secret_key_file!r})")
    if not os.path.isdir(opts.curve_allowed_clients_dir):
        raise ConfigError(f"warmup.curve_allowed_clients_dir: {opts.curve_allowed_clients_dir!r} is not a directory")
    if not any(name.endswith(".key") for name in os.listdir(opts.curve_allowed_clients_dir)):
        logger.warning("warmup.curve_allowed_clients_dir %r holds no *.key certificate: every client is refused",
                       opts.curve_allowed_clients_dir)
    return _Keys(public=public, secret=secret)

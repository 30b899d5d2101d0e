"""``ObjectStoreTier``: chunks as objects in an S3-compatible bucket, through ``aiobotocore``.

**Requires asyncio.** aiobotocore is built on asyncio/aiohttp, so the tier sets
``requires_asyncio = True`` and ``kvtier.open`` refuses it under trio with a ``ConfigError``.

Keys. One object per chunk, named by the same run-digest namespace as the fs tier
(:func:`kvtier.layout.namespace` with ``prefix`` as the root)::

    <prefix>/<model>_<digest>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin

kvtier strips leading/trailing ``/`` from ``prefix`` and joins with a single ``/``; without a
prefix the key starts with the model segment. vLLM 0.33 literally produces ``/<model>_…`` (no
prefix) and ``<prefix>//<model>_…``. kvtier does NOT reproduce that by default:
empty path segments are normalised away or rejected by several S3-compatible stores and proxies,
and break ``aws s3 ls``-style tooling. :func:`object_key` keeps the quirk behind
``vllm_compatible=True`` (a future option; not yet a config key) for sharing a bucket with vLLM.

Bytes. An object is the slot's bytes followed by the trailer page of
:mod:`kvtier.tiers.integrity` (same format as the fs tier), which names the chunk's key and run.
A load verifies the trailer before reporting success: any other size, a bad trailer or checksum,
or an object that is another chunk's (copied or renamed over this key) is a miss: the object is
deleted, the rejection counted (``kvtier_tier_obj_rejected_chunks_total{tier, reason}``), the
slot zeroed and a removal event published. An object of exactly ``slot_bytes`` (vLLM writes them,
without a trailer) cannot prove anything: it is treated as absent unless the tier's
``accept_unverified_chunks`` option is on, and never deleted.

Requests. One aiobotocore client per tier (``max_pool_connections`` = 3 × ``io_threads``: loads,
stores and lookups each get ``io_threads`` concurrent requests). botocore's own retries are off
(``total_max_attempts=1``: one attempt per call, no hidden retry) so the deadline is this tier's:
network errors, 5xx and throttling (429/503 SlowDown) are retried with capped exponential
back-off and jitter until ``request_timeout_s`` after the first attempt, then the chunk fails
(load → miss, store → not stored) with reason ``"unavailable"``, ``"throttled"``,
``"server_error"`` or ``"timeout"``. 404 is :class:`ChunkNotFound`; 403 is ``"permission"``
and other 4xx ``"client_error"``, counted and not retried.

Outage. After ``breaker_threshold`` consecutive connection failures a circuit breaker fails
requests at once (reason ``"unavailable"``) for ``breaker_open_s``, then lets requests probe the
endpoint again; one success closes it. There is no permanent dead state: the tier recovers by
itself when the endpoint returns. Lookups during an outage answer MISS (the base turns a failed
``contains`` into misses), so the engine keeps serving from other tiers.

Start-up probe. :meth:`ObjectStoreTier.open` sends HEAD bucket (retrying connection errors for
at most ``probe_timeout_s``, 3 s); an unreachable endpoint, a missing bucket, bad credentials or
no credentials at all is a ``ConfigError`` naming endpoint and bucket — never a secret.

Credentials. Explicit ``access_key``/``secret_key``/``session_token`` are passed to the client
when given; otherwise the SDK's default chain applies. They never appear in ``repr``, errors,
metric labels or logs: every message this module builds is redacted, and while a tier is open a
filter on the ``botocore``/``aiobotocore`` loggers replaces the secret strings in their records
(botocore's DEBUG output includes signed headers such as the session token).

Transfers are zero-copy where the API allows: GET streams the body straight into the host slot's
``memoryview`` with ``readinto``. A PUT body must be one buffer (S3 ``PutObject`` takes a single
payload), so the slot bytes and the 4 KiB trailer page are joined once, into a ``bytearray``.
Not ``bytes``, deliberately: botocore wraps a ``bytes`` body in a ``BytesIO``, and a file-like
body costs three more passes over the chunk (SigV4 hashing by 1 MiB ``read`` copies, aiohttp's
``getbuffer`` un-sharing copy, 256 KiB ``read`` copies while sending) plus an
``Expect: 100-continue`` round trip per PUT. A ``bytearray`` is hashed in place and sent in one
request. (Not a ``memoryview`` either, though aiohttp would slice it without a copy: botocore
cannot rewind a view when it retries a failed send, and fails the request instead.) aiohttp
issues an advisory ``ResourceWarning`` for in-memory bodies over 1 MiB (ignored by Python's
default warning filters); the one ``transport.write`` it warns about is cheaper than the copies
the ``BytesIO`` route makes.
``benchmarks/obj_tier.py`` measures the store path against a raw PUT of the same bytes.

Compression and encryption (the ``compression`` / ``encryption`` options, :mod:`kvtier.tiers.codec`):
a store encodes the slot into the whole object (format version 3 of
:mod:`kvtier.tiers.integrity` when a codec applies) and PUTs that; a load reads the size first
(``ContentLength``): a plain size is read as above, any other loadable size is downloaded whole
and decoded into the slot. A tier that encrypts refuses plain objects without downloading them
(``unencrypted``). Objects refused for ``unencrypted`` or ``no_key`` (an encrypted chunk whose
key this tier lacks) are left in place, like trailer-less ones: they are another configuration's,
not damaged, and the next store of the chunk overwrites them.

The client is given a fixed ``User-Agent`` (:func:`_user_agent`, built at open) because
botocore otherwise rebuilds its structured user-agent string, character by character, twice per
request.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import anyio

from kvtier.config.tiers import tier_option
from kvtier.errors import ConfigError
from kvtier.layout import Namespace, namespace
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.codec import ChunkCodec, is_coded_file_size, is_plain_file_size
from kvtier.tiers.errors import ChunkCorrupt, ChunkNotFound, TierIOError
from kvtier.tiers.integrity import (
    REJECT_REASONS,
    TRAILER_PAGE,
    SizeClass,
    classify_size,
    identity,
    make_trailer_page,
    verify,
)
from kvtier.types import Medium

if TYPE_CHECKING:
    from kvtier.config import TierConfig

__all__ = ["ObjectStoreTier", "object_key", "CircuitBreaker"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes read from a GET body per ``readinto`` call (bounded memory per request, few loop turns).
READ_PIECE = 1 << 20
_BACKOFF_FIRST_S = 0.02
_BACKOFF_MAX_S = 0.5


def _user_agent() -> str:
    """``kvtier/<version> aiobotocore/<v> botocore/<v> Python/<v>`` (computed once, at open)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown"

    return (f"kvtier/{v('kvtier')} aiobotocore/{v('aiobotocore')} botocore/{v('botocore')} "
            f"Python/{platform.python_version()}")


def object_key(ns: Namespace, key: bytes, *, vllm_compatible: bool = False) -> str:
    """The object key of chunk ``key`` in namespace ``ns`` (built with the normalised prefix).

    ``vllm_compatible=True`` reproduces vLLM 0.33's literal keys: a leading ``/`` without a
    prefix, ``<prefix>//…`` with one (see the module docstring for why it is off by default).
    """
    path = ns.chunk_path(key)
    if not vllm_compatible:
        return path
    if ns.root:
        return f"{ns.root}//{path[len(ns.root) + 1:]}"
    return f"/{path}"


def _aiobotocore_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("aiobotocore") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return False


def _missing_aiobotocore(where: str) -> str:
    return (f"{where}.type: the 'obj' tier needs the aiobotocore package, which is not installed or "
            "cannot be imported; install the obj extra: pip install 'kvtier[obj]'")


# --- secret redaction ----------------------------------------------------------------------------
#: Secrets at least this long are replaced wherever they occur, also inside longer words (a real
#: credential: 20+ characters). Shorter ones (a test's "ab") only where they stand as a whole
#: token — not next to a letter, digit or ``_`` — so that they do not mangle unrelated words.
MIN_SUBSTRING_SECRET_LEN = 8
_WORD = "A-Za-z0-9_"


def _secret_pattern(secrets: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching every secret (longest first); ``None`` without secrets."""
    parts = []
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        part = re.escape(secret)
        if len(secret) < MIN_SUBSTRING_SECRET_LEN:
            if re.match(f"[{_WORD}]", secret[0]):
                part = f"(?<![{_WORD}])" + part
            if re.match(f"[{_WORD}]", secret[-1]):
                part += f"(?![{_WORD}])"
        parts.append(part)
    return re.compile("|".join(parts)) if parts else None


def redact_secrets(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each secret replaced by ``***`` (short secrets only as whole tokens; see
    :data:`MIN_SUBSTRING_SECRET_LEN`)."""
    pattern = _secret_pattern(secrets)
    return text if pattern is None else pattern.sub("***", text)


class _SecretRedactor(logging.Filter):
    """Replaces registered secret strings in records of the loggers it is attached to.

    A filter on a logger only sees records created at that logger, so it is attached to every
    existing ``botocore``/``aiobotocore`` logger (they are created at import, before any request).
    """

    _LOGGER_PREFIXES = ("botocore", "aiobotocore", "urllib3", "aiohttp", "s3transfer")

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # logging may happen on botocore's threads
        self._secrets: Counter[str] = Counter()
        self._pattern: re.Pattern[str] | None = None  # rebuilt on add/remove, read without the lock
        self._attached: list[logging.Logger] = []

    def add(self, secrets: Sequence[str]) -> None:
        with self._lock:
            self._secrets.update(s for s in secrets if s)
            self._pattern = _secret_pattern(self._secrets)
            self._attach()

    def remove(self, secrets: Sequence[str]) -> None:
        with self._lock:
            self._secrets.subtract(s for s in secrets if s)
            self._secrets = +self._secrets  # drop zero counts
            self._pattern = _secret_pattern(self._secrets)

    def redact(self, text: str) -> str:
        """``text`` with the registered secrets replaced (see :func:`redact_secrets`)."""
        pattern = self._pattern
        return text if pattern is None else pattern.sub("***", text)

    def _attach(self) -> None:
        manager = logging.Logger.manager
        names = [name for name in list(manager.loggerDict) if name.split(".")[0] in self._LOGGER_PREFIXES]
        for name in [*self._LOGGER_PREFIXES, *names]:
            log = logging.getLogger(name)
            if self not in log.filters:
                log.addFilter(self)
                self._attached.append(log)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to logging's own error path
            return True
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACTOR = _SecretRedactor()


# --- circuit breaker -----------------------------------------------------------------------------
class CircuitBreaker:
    """Fails fast for ``open_s`` seconds after ``threshold`` consecutive connection failures.

    Never permanently open: once ``open_s`` has passed requests go through again (half-open);
    a success closes it, a failure re-opens it at once.
    """

    def __init__(self, threshold: int = 3, open_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.open_s = open_s
        self._clock = clock
        self._consecutive = 0
        self._open_until = 0.0
        self.trips = 0

    @property
    def is_open(self) -> bool:
        return self._clock() < self._open_until

    def record_success(self) -> None:
        self._consecutive = 0
        self._open_until = 0.0

    def record_failure(self) -> None:
        self._consecutive += 1
        if self._consecutive >= self.threshold:
            if not self.is_open:
                self.trips += 1
            self._open_until = self._clock() + self.open_s


class _Retry(Exception):
    """Internal: an attempt failed in a way worth retrying, with the statistics reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# --- the tier ------------------------------------------------------------------------------------
class ObjectStoreTier(SecondaryTier):
    """Chunks as objects in an S3-compatible bucket (see the module docstring).

    Options (``config.options``): ``store_config`` {``bucket``, ``endpoint_override``, ``scheme``,
    ``access_key``, ``secret_key``, ``session_token``, ``region``, ``ca_bundle``}, ``prefix``,
    ``io_threads`` (4), ``request_timeout_s`` (10), ``lookup_timeout_s`` (5), ``accept_unverified_chunks``
    (False), ``compression`` and ``encryption`` (None; :mod:`kvtier.tiers.codec`).
    """

    tier_type: ClassVar[str] = "obj"
    medium: ClassVar[Medium | None] = Medium.STORAGE
    requires_asyncio: ClassVar[bool] = True
    probe_timeout_s: ClassVar[float] = 3.0
    breaker_threshold: ClassVar[int] = 3
    breaker_open_s: ClassVar[float] = 1.0

    def __init__(self, config: TierConfig, context: TierContext, **tunables: Any) -> None:
        options = config.options
        where = f"secondary_tiers[{context.index}]"
        if not _aiobotocore_installed():
            raise ConfigError(_missing_aiobotocore(where))
        store: Mapping[str, Any] | None = options.get("store_config")
        if store is None or not hasattr(store, "get"):
            raise ConfigError(f"{where}.store_config is required for an obj tier")
        self.bucket: str = str(store.get("bucket") or "")
        endpoint = str(store.get("endpoint_override") or "")
        if not self.bucket or not endpoint:
            raise ConfigError(f"{where}.store_config needs bucket and endpoint_override")
        scheme = str(store.get("scheme") or "http")
        if scheme not in ("http", "https"):
            raise ConfigError(f"{where}.store_config.scheme must be 'http' or 'https', got {scheme!r}")
        self.endpoint_url = f"{scheme}://{endpoint}"
        self.region: str = str(store.get("region") or "")
        self._ca_bundle: str = str(store.get("ca_bundle") or "")
        # Held privately; never formatted anywhere (repr is the base's label-only form).
        self._credentials = tuple(str(store.get(k) or "") for k in ("access_key", "secret_key", "session_token"))
        if bool(self._credentials[0]) != bool(self._credentials[1]):
            raise ConfigError(f"{where}.store_config: give both access_key and secret_key, or neither "
                              "(then the SDK's default credential chain applies)")
        self.prefix: str = str(tier_option(config, "prefix") or "").strip("/")
        self.io_threads = int(tier_option(config, "io_threads"))
        self.request_timeout_s = float(tier_option(config, "request_timeout_s"))
        self.accept_unverified_chunks = bool(tier_option(config, "accept_unverified_chunks"))
        tunables.setdefault("max_concurrent_loads", self.io_threads)
        tunables.setdefault("max_concurrent_stores", self.io_threads)
        tunables.setdefault("lookup_timeout_s", float(tier_option(config, "lookup_timeout_s")))
        self.codec = ChunkCodec.from_options(tier_option(config, "compression"), tier_option(config, "encryption"),
                                             dtype=ChunkCodec.dtype_of(context.run_fields),
                                             slot_bytes=context.slot_bytes, where=f"{where}.")
        super().__init__(config, context, **tunables)
        self.namespace: Namespace = namespace(self.prefix, context.run_fields, context.rank)
        self.breaker = CircuitBreaker(self.breaker_threshold, self.breaker_open_s)
        self._client: Any = None
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._head_limiter = anyio.CapacityLimiter(self.io_threads)
        # Encoding and decoding (zstd, AES-GCM: both release the GIL) run on worker threads, never
        # on the event loop: a compressed 512 KiB chunk is a millisecond of CPU.
        self._codec_limiter = anyio.CapacityLimiter(self.io_threads)
        self._rejected = self.add_metric(
            "obj_rejected_chunks", "counter",
            "Objects refused on load (and deleted, except trailer-less ones), by reason.",
            ("reason",),
        )
        for reason in REJECT_REASONS:
            self._rejected.values[(reason,)] = 0.0
        self._unverified = self.add_metric(
            "obj_unverified_loads", "counter",
            "Chunks loaded from objects without a trailer (written by vLLM; accept_unverified_chunks): "
            "size-checked only.",
        )
        self._retries = self.add_metric(
            "obj_request_retries", "counter",
            "Object requests retried after a transient failure, by reason.", ("reason",),
        )
        self._breaker_trips = self.add_metric(
            "obj_breaker_trips", "counter",
            "Times repeated connection failures opened the circuit breaker (fail fast for a while).",
        )

    def object_key(self, key: bytes) -> str:
        """The object key of chunk ``key`` in this tier's bucket."""
        return object_key(self.namespace, key)

    def _identity(self, key: bytes) -> bytes:
        """What the trailer of chunk ``key``'s object must name (its key and this run)."""
        return identity(key, self.namespace.fingerprint)

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Create the client and probe the bucket; ``ConfigError`` (within ~3 s) if unusable."""
        try:
            from aiobotocore.config import AioConfig
            from aiobotocore.session import get_session
        except ImportError as exc:  # installed, but broken or incomplete (botocore, aiohttp)
            raise ConfigError(f"{_missing_aiobotocore(f'secondary_tiers[{self.config.index}]')} ({exc})") from None

        _REDACTOR.add(self._credentials)
        config = AioConfig(
            retries={"total_max_attempts": 1, "mode": "standard"},  # the deadline is ours (see module doc)
            connect_timeout=min(2.0, self.request_timeout_s),
            read_timeout=self.request_timeout_s,
            max_pool_connections=3 * self.io_threads,
            s3={"addressing_style": "path"},  # custom endpoints rarely have per-bucket DNS
            # Every parameter is built by this module (bucket, key, a bytearray body): botocore's
            # per-request validation walk would only re-check our own code, on the hot path.
            parameter_validation=False,
            # Integrity is the trailer's job; a CRC per PUT/GET would be a second full pass.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # A supplied string is sent as is; without one botocore rebuilds (and sanitises, char
            # by char) its structured user agent twice per request, a CPU cost on every call.
            user_agent=_user_agent(),
        )
        kwargs: dict[str, Any] = {"endpoint_url": self.endpoint_url, "config": config}
        if self.region:
            kwargs["region_name"] = self.region
        if self._ca_bundle:
            kwargs["verify"] = self._ca_bundle
        access_key, secret_key, session_token = self._credentials
        if access_key:
            kwargs["aws_access_key_id"] = access_key
            kwargs["aws_secret_access_key"] = secret_key
            if session_token:
                kwargs["aws_session_token"] = session_token
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(get_session().create_client("s3", **kwargs))
            await self._probe_bucket()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            self._client = None
            _REDACTOR.remove(self._credentials)
            raise
        self._exit_stack = stack

    async def _probe_bucket(self) -> None:
        where = f"secondary_tiers[{self.context.index}] (obj)"
        target = f"bucket {self.bucket!r} at {self.endpoint_url}"
        try:
            await self._request(lambda: self._client.head_bucket(Bucket=self.bucket),
                                timeout=min(self.probe_timeout_s, self.request_timeout_s), what="probe")
        except ChunkNotFound:
            raise ConfigError(f"{where}: {target} does not exist") from None
        except TierIOError as exc:
            hint = {
                "permission": "access denied: check the credentials and the bucket policy",
                "no_credentials": "no credentials: set access_key/secret_key or configure the SDK's default chain",
            }.get(exc.reason, "check endpoint_override, scheme and network reachability")
            raise ConfigError(f"{where}: cannot use {target}: {self._redact(str(exc))}; {hint}") from None

    async def close(self) -> None:
        stack, self._exit_stack, self._client = self._exit_stack, None, None
        try:
            if stack is not None:
                await stack.aclose()
        finally:
            _REDACTOR.remove(self._credentials)

    # --- primitives ---------------------------------------------------------------------------
    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        """HEAD every key concurrently (at most ``io_threads`` at once).

        A key is present when its object exists with a loadable size (trailered, or raw with
        ``accept_unverified_chunks``, neither on a tier that encrypts; or a coded size). Any
        other failure of a HEAD makes the whole batch fail with that error (the base then answers
        MISS for all keys and counts it), so an outage never turns into a stale HIT.
        """
        present = [False] * len(keys)
        first_error: list[BaseException] = []
        deadline_s = min(self.request_timeout_s, self.lookup_timeout_s)

        async def head(i: int, key: bytes) -> None:
            try:
                async with self._head_limiter:
                    response = await self._request(
                        lambda: self._client.head_object(Bucket=self.bucket, Key=self.object_key(key)),
                        timeout=deadline_s, what="lookup")
                present[i] = self._loadable_size(int(response.get("ContentLength", -1)))
            except ChunkNotFound:
                present[i] = False
            except Exception as exc:  # kept so one failure does not become an ExceptionGroup
                if not first_error:
                    first_error.append(exc)

        async with anyio.create_task_group() as tg:
            for i, key in enumerate(keys):
                tg.start_soon(head, i, key)
        if first_error:
            raise first_error[0]
        return present

    def _loadable_size(self, size: int) -> bool:
        """Whether an object of ``size`` bytes may be a chunk this tier can load (by size alone)."""
        slot_bytes = self.context.slot_bytes
        if is_plain_file_size(size, slot_bytes):
            return not self.codec.encrypts and (size != slot_bytes or self.accept_unverified_chunks)
        return is_coded_file_size(size, slot_bytes)

    def _encode(self, key: bytes, src: memoryview) -> bytearray:
        """The object the codec makes of slot ``src`` as chunk ``key`` (a worker thread's job)."""
        body = bytearray(self.codec.max_file_bytes)
        with memoryview(body) as out:
            n = self.codec.encode_into(src, self._identity(key), out)
        del body[n:]
        return body

    async def write(self, key: bytes, src: memoryview) -> None:
        """PUT the slot bytes plus the trailer page (or the codec's object) under
        :meth:`object_key` (S3 PUTs are atomic)."""
        # One join into a bytearray, never bytes: botocore would wrap bytes in a BytesIO, which
        # costs three more copies and an Expect: 100-continue round trip (see the module docstring).
        if self.codec.active:
            body = await anyio.to_thread.run_sync(self._encode, key, src, limiter=self._codec_limiter)
        else:
            body = bytearray().join((src, make_trailer_page(src, self._identity(key))))
        name = self.object_key(key)
        await self._request(lambda: self._client.put_object(Bucket=self.bucket, Key=name, Body=body),
                            timeout=self.request_timeout_s, what="store")

    async def read(self, key: bytes, dst: memoryview) -> None:
        """GET the object into ``dst`` in pieces and verify it; raise unless ``dst`` is valid."""
        name = self.object_key(key)
        slot_bytes = len(dst)
        trailer = bytearray(TRAILER_PAGE)
        coded: list[bytearray] = []  # the whole object, when it is not a plain one

        async def get() -> SizeClass:
            response = await self._client.get_object(Bucket=self.bucket, Key=name)
            body = response["Body"]
            try:
                length = int(response.get("ContentLength", -1))
                if is_coded_file_size(length, slot_bytes):
                    image = bytearray(length)
                    await _read_exactly(body, memoryview(image))
                    coded.append(image)
                    return SizeClass.TRAILERED
                size = classify_size(length, slot_bytes)
                if size in (SizeClass.SHORT, SizeClass.LONG):
                    return size
                if self.codec.encrypts or (size is SizeClass.RAW and not self.accept_unverified_chunks):
                    return size  # refused below without downloading it
                await _read_exactly(body, dst)
                if size is SizeClass.TRAILERED:
                    await _read_exactly(body, memoryview(trailer))
                return size
            finally:
                body.close()

        size = await self._request(get, timeout=self.request_timeout_s, what="load")
        if coded:
            verdict = await anyio.to_thread.run_sync(self.codec.decode_into, memoryview(coded[0]), self._identity(key),
                                                     dst, limiter=self._codec_limiter)
            reason: str | None = verdict.reason
        elif size in (SizeClass.SHORT, SizeClass.LONG):
            reason = size.value
        elif self.codec.encrypts:
            reason = "unencrypted"
        else:
            reason = verify(dst, trailer if size is SizeClass.TRAILERED else None, self._identity(key),
                            accept_unverified=self.accept_unverified_chunks).reason
        if reason is None:
            if size is SizeClass.RAW:
                self._unverified.inc()
            return
        self._rejected.inc(1.0, reason)
        dst[:] = bytes(len(dst))  # never leave bytes that failed verification in a host slot
        if reason == "unverified":  # not ours to delete: vLLM may be using it
            raise ChunkNotFound(f"object {name} has no trailer; refused (accept_unverified_chunks is off)")
        if reason in ("unencrypted", "no_key", "no_codec"):  # not damaged, another configuration's: a store overwrites it
            raise ChunkNotFound(f"object {name} refused ({reason}); left in place")
        logger.warning("tier %s: object %s rejected (%s); deleting it", self.label, name, reason)
        try:
            await self.delete(key)
        except Exception as exc:
            logger.warning("tier %s: could not delete rejected object %s: %s", self.label, name,
                           self._redact(str(exc)))
        raise ChunkCorrupt(f"object {name}: {reason}")

    async def delete(self, key: bytes) -> None:
        """DELETE the object (absent objects are not an error: S3 deletes are idempotent)."""
        name = self.object_key(key)
        await self._request(lambda: self._client.delete_object(Bucket=self.bucket, Key=name),
                            timeout=self.request_timeout_s, what="delete")

    # --- requests -----------------------------------------------------------------------------
    async def _request(self, attempt: Callable[[], Awaitable[T]], *, timeout: float, what: str) -> T:
        """Run ``attempt`` until it succeeds, fails permanently, or ``timeout`` s have passed.

        Retries transient failures with capped, jittered exponential back-off. Raises
        :class:`ChunkNotFound` (404) or :class:`TierIOError` with the last failure's reason.
        Cancellation propagates untouched (nothing here catches ``BaseException``).
        """
        if self._client is None:
            raise TierIOError("closed", f"obj tier {self.label} is not open")
        deadline = time.monotonic() + timeout
        backoff = _BACKOFF_FIRST_S
        while True:
            if self.breaker.is_open:
                raise TierIOError("unavailable", f"{what}: {self.endpoint_url} is failing (circuit open)")
            remaining = deadline - time.monotonic()
            try:
                with anyio.fail_after(max(remaining, 0.0)):
                    result = await attempt()
            except TimeoutError:
                raise TierIOError("timeout", f"{what}: no answer from {self.endpoint_url} within {timeout:.1f} s") from None
            except Exception as exc:
                failure = self._classify(exc)
                if not isinstance(failure, _Retry):
                    raise failure from None
                self._retries.inc(1.0, failure.reason)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.breaker.is_open:
                    raise TierIOError(failure.reason, f"{what}: {failure}") from None
                await anyio.sleep(min(remaining, backoff * random.uniform(0.5, 1.0)))
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            self.breaker.record_success()
            return result

    def _classify(self, exc: Exception) -> Exception:
        """Map an SDK/transport exception to a final tier error or a :class:`_Retry`."""
        import aiohttp
        import botocore.exceptions as bx

        if isinstance(exc, bx.ClientError):
            self.breaker.record_success()  # the endpoint answered
            meta = exc.response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 0)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            detail = self._redact(f"HTTP {status} {code} from {self.endpoint_url}")
            if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
                return ChunkNotFound(detail)
            if status in (429, 503) or code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"):
                return _Retry("throttled", detail)
            if status >= 500:
                return _Retry("server_error", detail)
            if status in (401, 403):
                return TierIOError("permission", detail)
            return TierIOError("client_error", detail)
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return TierIOError("no_credentials", "no credentials found")
        if isinstance(exc, bx.HTTPClientError | bx.ConnectionError | aiohttp.ClientError | OSError
                      | bx.ResponseStreamingError):
            trips = self.breaker.trips
            self.breaker.record_failure()
            if self.breaker.trips != trips:
                self._breaker_trips.inc()
                logger.warning("tier %s: %s unreachable; failing fast for %.1f s", self.label,
                               self.endpoint_url, self.breaker.open_s)
            return _Retry("unavailable", self._redact(f"{type(exc).__name__} talking to {self.endpoint_url}"))
        if isinstance(exc, bx.BotoCoreError):
            return TierIOError("io_error", self._redact(f"{type(exc).__name__}: {exc}"))
        return exc  # a bug: the base counts it as "internal" and logs the traceback

    def _redact(self, text: str) -> str:
        return redact_secrets(text, self._credentials)


async def _read_exactly(body: Any, dst: memoryview) -> None:
    """Fill ``dst`` from a streaming body in pieces of at most :data:`READ_PIECE` bytes."""
    filled = 0
    total = len(dst)
    while filled < total:
        n = await body.readinto(dst[filled:min(total, filled + READ_PIECE)])
        if n == 0:
            raise TierIOError("short_read", f"object body ended after {filled} of {total} bytes")
        filled += n

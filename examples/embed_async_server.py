"""A small prefill server that embeds kvtier to skip recomputing cached prefixes.

The server owns a "device" block pool (CPU tensors standing in for GPU memory, handed out by a
free-list allocator) and a toy model whose per-token KV is a deterministic function of the token
*prefix* (a chained hash seeds each token's values), so the KV of a prefix is reusable exactly
when the prefix is identical, as in a real transformer, and every byte is checkable.

For each ``POST /prefill`` the server:

1. allocates device blocks for the prompt;
2. ``await engine.load(tokens[:-1], blocks)``: kvtier copies the cached prefix into the blocks
   (the last token is always computed, as a server must to sample from its logits);
3. computes the KV of the remaining tokens into the blocks (in a worker thread);
4. ``await engine.store(tokens, blocks)``: kvtier copies the complete chunks to host memory and
   returns once the blocks may be reused; only then are the blocks freed.

HTTP/1.1 with JSON bodies, one request per connection (``Connection: close``)::

    POST /prefill  {"tokens": [1, 2, 3]}
        200 {"cached_tokens": n, "computed_tokens": m, "ttft_ms": x, "kv_digest": "<sha256 of the KV>"}
    GET /stats     200 {"requests": ..., "cached_tokens": ..., "pool": {...}, "host_tier": {...}}

Inputs are bounded: headers ≤ 16 KiB (431), bodies ≤ 1 MiB (413), prompts ≤ ``--max-tokens``
tokens with ids in [0, 2**31) (400); bad JSON is a 400 naming the problem; a full block pool or
too many connections is a 503. The server runs on anyio streams, so it serves on asyncio (the
default) or trio (``--backend trio``).

Run plainly, it is a demo that ends by itself (in about a second): it serves on a free loopback
port, sends itself a few requests (a cold prompt, the same again, a shared prefix, concurrent
ones, malformed ones), prints each answer, checks every KV byte against a full recomputation and
exits (status 0 when every check passed, 1 otherwise). ``--serve`` keeps it up for your own
requests::

    python examples/embed_async_server.py                        # demo requests, checks, exit
    python examples/embed_async_server.py --backend trio
    python examples/embed_async_server.py --serve --port 8080    # until SIGINT (Ctrl-C) or SIGTERM
    curl -s localhost:8080/prefill -d '{"tokens": [1, 2, 3]}'
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402

GEOMETRY = KVGeometry("example/toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_size=16)
MAX_HEADER_BYTES = 16 << 10
MAX_BODY_BYTES = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1
REQUEST_TIMEOUT_S = 10.0  # a client that sends its request slower than this gets a 408
MAX_CONNECTIONS = 64

logger = logging.getLogger("embed_async_server")

# The client closed or reset the connection: there is nobody left to answer.
_CLIENT_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream,
                anyio.IncompleteRead, ConnectionError)

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Content Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable"}


# --- the device block pool -------------------------------------------------------------------------
class PoolExhausted(Exception):
    """Not enough free device blocks for a request right now."""


class BlockPool:
    """Device KV memory: one tensor per layer ``[num_blocks, 2, block_size, heads, dim]``.

    ``allocate`` takes blocks from a free list (all or nothing) and ``free`` returns them. Called
    only from the event-loop thread, so no lock. A block belongs to exactly one request from
    ``allocate`` to ``free``; the request's KV computation and kvtier's copies touch only it.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int) -> None:
        shape = (num_blocks, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        self.kv = [torch.zeros(shape, dtype=torch.float16) for _ in range(geometry.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = geometry.block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} blocks needed, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))

    def gather(self, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The KV of tokens ``0..num_tokens-1`` held in ``blocks``: ``[tokens, layers, 2, heads, dim]``."""
        block_idx, offset = _token_coordinates(blocks, 0, num_tokens, self.block_size)
        return torch.stack([layer[block_idx, :, offset] for layer in self.kv], dim=1)

    def scatter(self, blocks: Sequence[int], start: int, values: torch.Tensor) -> None:
        """Write ``values`` (``[tokens, layers, 2, heads, dim]``) as the KV of tokens ``start..``."""
        block_idx, offset = _token_coordinates(blocks, start, start + values.shape[0], self.block_size)
        for i, layer in enumerate(self.kv):
            layer[block_idx, :, offset] = values[:, i]


def _token_coordinates(blocks: Sequence[int], start: int, end: int,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, end)
    return torch.tensor(blocks, dtype=torch.long)[positions // block_size], positions % block_size


# --- the toy model ----------------------------------------------------------------------------------
class ToyModel:
    """Per-token KV that depends on the whole prefix, like a transformer's, but cheap and exact.

    Token ``t``'s KV is drawn from a generator seeded by a chained hash of ``tokens[:t+1]``; two
    prompts share the KV of a position exactly when they share the prefix up to it.
    """

    def __init__(self, geometry: KVGeometry) -> None:
        self.token_shape = (geometry.num_layers, 2, geometry.num_kv_heads, geometry.head_dim)
        self._values_per_token = math.prod(self.token_shape)

    @staticmethod
    def prefix_seeds(tokens: Sequence[int]) -> list[int]:
        seeds: list[int] = []
        state = b"toy-model"
        for token in tokens:
            state = hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=8).digest()
            seeds.append(int.from_bytes(state, "little") >> 1)  # manual_seed takes a signed 64-bit
        return seeds

    def compute_kv(self, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        """KV of tokens ``start..`` given the whole prompt: ``[len(tokens)-start, layers, 2, heads, dim]``."""
        out = torch.empty((len(tokens) - start, *self.token_shape), dtype=torch.float16)
        generator = torch.Generator()
        for i, seed in enumerate(self.prefix_seeds(tokens)[start:]):
            generator.manual_seed(seed)
            out[i] = torch.randn(self._values_per_token, generator=generator).view(self.token_shape)
        return out

    def prefill(self, pool: BlockPool, blocks: Sequence[int], tokens: Sequence[int], start: int) -> None:
        """Compute the KV of tokens ``start..`` into ``blocks`` (runs in a worker thread)."""
        if start < len(tokens):
            pool.scatter(blocks, start, self.compute_kv(tokens, start))


def kv_digest(kv: torch.Tensor) -> str:
    return hashlib.sha256(kv.contiguous().numpy().tobytes()).hexdigest()


# --- HTTP ----------------------------------------------------------------------------------------------
class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes


async def read_request(receive: BufferedByteReceiveStream) -> Request:
    """Parse one HTTP/1.x request; the head is bounded, and the body is read only once its
    declared length passed the limit."""
    head: bytes | None
    try:
        head = await receive.receive_until(b"\r\n\r\n", MAX_HEADER_BYTES)
    except anyio.DelimiterNotFound:
        head = None
    # receive_until stops reading at the limit, but one large receive may hold a delimiter past it.
    if head is None or len(head) > MAX_HEADER_BYTES:
        raise HTTPError(431, f"request head exceeds {MAX_HEADER_BYTES} bytes")
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise HTTPError(400, "malformed request line") from None
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HTTPError(400, f"unsupported protocol version {version[:16]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HTTPError(400, "malformed header line")
        name, value = name.lower(), value.strip()
        if name in headers and headers[name] != value:
            raise HTTPError(400, f"conflicting {name} headers")
        headers[name] = value
    if "transfer-encoding" in headers:
        raise HTTPError(501, "transfer-encoding is not supported; send Content-Length")
    length = headers.get("content-length", "0" if method == "GET" else None)
    if length is None:
        raise HTTPError(411, "Content-Length is required")
    if not length.isdigit() or len(length) > 12:
        raise HTTPError(400, "Content-Length must be a non-negative integer")
    if int(length) > MAX_BODY_BYTES:
        # Answered before reading the body, so an oversized upload costs the server nothing.
        raise HTTPError(413, f"body of {int(length)} bytes exceeds {MAX_BODY_BYTES} bytes")
    body = await receive.receive_exactly(int(length)) if int(length) else b""
    return Request(method, target.split("?", 1)[0], headers, body)


def encode_response(status: int, payload: Mapping[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def parse_prompt(body: bytes, max_tokens: int) -> list[int]:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HTTPError(400, f"body is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(document, dict) or set(document) != {"tokens"}:
        raise HTTPError(400, 'body must be a JSON object with exactly one key, "tokens"')
    tokens = document["tokens"]
    if not isinstance(tokens, list) or not tokens:
        raise HTTPError(400, '"tokens" must be a non-empty list of token ids')
    if len(tokens) > max_tokens:
        raise HTTPError(400, f'"tokens" has {len(tokens)} entries; at most {max_tokens} are allowed')
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise HTTPError(400, f'"tokens" entries must be ints in [0, {MAX_TOKEN_ID}]')
    return tokens


# --- the server ---------------------------------------------------------------------------------------
@dataclass
class PrefillResult:
    cached_tokens: int
    computed_tokens: int
    stored_tokens: int
    ttft_ms: float
    kv_digest: str


class PrefillServer:
    """Serves ``/prefill`` and ``/stats`` over one kvtier engine and one block pool.

    Back-pressure: at most ``MAX_CONNECTIONS`` connections are handled at once (more get a
    503 at once); a prompt whose blocks do not fit in the free pool gets a 503 rather than
    waiting, so a burst never queues unboundedly inside the server.
    """

    def __init__(self, engine: kvtier.Engine, pool: BlockPool, model: ToyModel, max_tokens: int) -> None:
        self.engine = engine
        self.pool = pool
        self.model = model
        self.max_tokens = max_tokens
        self._connections = anyio.Semaphore(MAX_CONNECTIONS)
        self._compute = anyio.CapacityLimiter(2)  # toy prefills in worker threads at once
        self.counters = {"requests": 0, "cached_tokens": 0, "computed_tokens": 0, "stored_tokens": 0}
        self.errors: dict[str, int] = {}

    async def serve(self, host: str, port: int, *,
                    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (0 = ephemeral); reports the bound port, serves until cancelled."""
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        async with listener:
            task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
            await listener.serve(self.handle_connection)

    async def handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            try:
                self._connections.acquire_nowait()
            except anyio.WouldBlock:
                await self._send(stream, 503, {"error": "too many connections"})
                return
            try:
                await self._serve_one(stream)
            except _CLIENT_GONE:
                pass  # the client went away; nothing to answer
            finally:
                self._connections.release()

    async def _serve_one(self, stream: anyio.abc.ByteStream) -> None:
        try:
            try:
                with anyio.fail_after(REQUEST_TIMEOUT_S):
                    request = await read_request(BufferedByteReceiveStream(stream))
            except TimeoutError:
                raise HTTPError(408, f"request not received within {REQUEST_TIMEOUT_S:.0f} s") from None
            status, payload = await self.route(request)
        except HTTPError as exc:
            status, payload = exc.status, {"error": exc.message}
        except _CLIENT_GONE:
            raise
        except Exception:  # noqa: BLE001 - one bad request must not take the server down
            logger.exception("request failed")
            status, payload = 500, {"error": "internal error"}
        if status != 200:
            self.errors[str(status)] = self.errors.get(str(status), 0) + 1
        await self._send(stream, status, payload)

    @staticmethod
    async def _send(stream: anyio.abc.ByteStream, status: int, payload: Mapping[str, Any]) -> None:
        await stream.send(encode_response(status, payload))

    async def route(self, request: Request) -> tuple[int, dict[str, Any]]:
        if request.path == "/prefill":
            if request.method != "POST":
                raise HTTPError(405, "use POST /prefill")
            result = await self.prefill(parse_prompt(request.body, self.max_tokens))
            return 200, {"cached_tokens": result.cached_tokens, "computed_tokens": result.computed_tokens,
                         "ttft_ms": round(result.ttft_ms, 3), "kv_digest": result.kv_digest}
        if request.path == "/stats":
            if request.method != "GET":
                raise HTTPError(405, "use GET /stats")
            return 200, self.stats()
        raise HTTPError(404, f"no route {request.path[:64]!r}; try POST /prefill or GET /stats")

    async def prefill(self, tokens: list[int]) -> PrefillResult:
        """Load the cached prefix, compute the rest, offload, then release the device blocks.

        Handlers are cancelled only when the server shuts down; the blocks are returned to the
        pool then too, and nothing allocates them afterwards.
        """
        try:
            blocks = self.pool.allocate(-(-len(tokens) // self.pool.block_size))
        except PoolExhausted as exc:
            raise HTTPError(503, f"device block pool exhausted: {exc}") from None
        try:
            started = time.perf_counter()
            # The last token is always computed: a real server needs its logits to sample.
            cached = await self.engine.load(tokens[:-1], blocks)
            await anyio.to_thread.run_sync(self.model.prefill, self.pool, blocks, tokens, cached,
                                           limiter=self._compute)
            ttft_ms = (time.perf_counter() - started) * 1000
            digest = kv_digest(self.pool.gather(blocks, len(tokens)))
            # store() returns once kvtier has copied the blocks out; only then may they be reused.
            stored = await self.engine.store(tokens, blocks)
        finally:
            self.pool.free(blocks)
        computed = len(tokens) - cached
        self.counters["requests"] += 1
        self.counters["cached_tokens"] += cached
        self.counters["computed_tokens"] += computed
        self.counters["stored_tokens"] += stored
        return PrefillResult(cached, computed, stored, ttft_ms, digest)

    def stats(self) -> dict[str, Any]:
        host = self.engine.statistics()["0:primary"]
        return {
            **self.counters,
            "errors": dict(self.errors),
            "pool": {"blocks": self.pool.num_blocks, "free_blocks": self.pool.free_blocks},
            "host_tier": {"slots": host.num_slots, "used_slots": host.used_slots,
                          "pinned_slots": host.pinned_slots, "evictions": host.evictions},
        }


def engine_config(host_slots: int) -> dict[str, Any]:
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": host_slots * GEOMETRY.slot_bytes(1)}


# --- the demo ------------------------------------------------------------------------------------------
def http_call(port: int, method: str, path: str, body: bytes | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """A plain ``http.client`` request (blocking: run it in a worker thread)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        if body is None and headers:  # headers only: lets the server refuse before any body
            conn.putrequest(method, path)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders()
        else:
            conn.request(method, path, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


class DemoCheckFailed(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise DemoCheckFailed(what)


async def demo(server: PrefillServer, port: int) -> None:
    """Send the demo requests to the server on ``port``, print the answers, check each one."""
    model = server.model

    async def prefill(tokens: list[int], label: str) -> dict[str, Any]:
        body = json.dumps({"tokens": tokens}).encode()
        status, reply = await anyio.to_thread.run_sync(http_call, port, "POST", "/prefill", body)
        check(status == 200, f"{label}: status {status} {reply}")
        kv_ok = reply["kv_digest"] == kv_digest(model.compute_kv(tokens))
        print(f"{label}: {len(tokens)} tokens -> cached {reply['cached_tokens']}, computed "
              f"{reply['computed_tokens']}, ttft {reply['ttft_ms']:.1f} ms, kv correct: {kv_ok}")
        check(kv_ok, f"{label}: the KV in the device blocks differs from a full recomputation")
        check(reply["cached_tokens"] + reply["computed_tokens"] == len(tokens), f"{label}: token counts")
        return reply

    block = GEOMETRY.block_size
    system = [(31 * i + 7) % 50_000 for i in range(10 * block)]  # a shared 160-token "system prompt"
    first = system + [11, 12, 13] * 13  # 199 tokens
    reply = await prefill(first, "cold prompt")
    check(reply["cached_tokens"] == 0, "a cold prompt cannot have cached tokens")
    reply = await prefill(first, "same prompt again")
    check(reply["cached_tokens"] == (len(first) - 1) // block * block, "the repeat must reuse every full block")
    reply = await prefill(system + [99] * 50, "shared prefix")
    check(reply["cached_tokens"] == len(system), "only the shared prefix may be reused")

    replies: list[dict[str, Any]] = []

    async def one(i: int) -> None:
        replies.append(await prefill(system + [1000 + i] * 40, f"concurrent #{i}"))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    check(all(r["cached_tokens"] >= len(system) for r in replies), "concurrent requests reuse the prefix")

    for label, body, headers, expected in (
        ("bad JSON", b"{not json", None, 400),
        ("wrong shape", b'{"tokens": "abc"}', None, 400),
        ("too many tokens", json.dumps({"tokens": [1] * (server.max_tokens + 1)}).encode(), None, 400),
        ("1 MiB + 1 body", None, {"Content-Length": str(MAX_BODY_BYTES + 1)}, 413),
    ):
        status, reply = await anyio.to_thread.run_sync(http_call, port, "POST", "/prefill", body, headers)
        print(f"{label}: {status} {reply['error']}")
        check(status == expected, f"{label}: expected {expected}, got {status}")
    status, stats = await anyio.to_thread.run_sync(http_call, port, "GET", "/stats")
    print(f"GET /stats: {status} {json.dumps(stats, sort_keys=True)}")
    check(status == 200 and stats["requests"] == 7 and stats["pool"]["free_blocks"] == stats["pool"]["blocks"],
          "stats: 7 prefills served and every device block released")
    check(stats["host_tier"]["pinned_slots"] == 0, "stats: no host slot left pinned")


# --- entry point -------------------------------------------------------------------------------------------
async def stop_on_signal(signals: Any, scope: anyio.CancelScope) -> None:
    """SIGINT or SIGTERM: stop serving; leaving ``kvtier.open`` then closes the engine."""
    async for signum in signals:
        print(f"{signal.Signals(signum).name}: shutting down", flush=True)
        scope.cancel()
        return


async def run(args: argparse.Namespace) -> int:
    pool = BlockPool(GEOMETRY, args.device_blocks)
    passed = True
    # Signals are received as events (installed before the banner), not as KeyboardInterrupt:
    # an interrupt landing anywhere in the loop could otherwise be lost in a shielded section.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with kvtier.open(engine_config(args.host_slots), GEOMETRY, pool.kv) as engine:
            server = PrefillServer(engine, pool, ToyModel(GEOMETRY), args.max_tokens)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signal, signals, tg.cancel_scope)
                port = await tg.start(server.serve, args.host, args.port if args.serve else 0)
                print(f"listening on http://{args.host}:{port} ({args.backend})", flush=True)
                # With --serve the task group waits on serve() until SIGINT or SIGTERM.
                if not args.serve:
                    try:
                        await demo(server, port)
                    except DemoCheckFailed as exc:
                        print(f"demo FAILED: {exc}")
                        passed = False
                    tg.cancel_scope.cancel()  # stop serving; leaving kvtier.open closes the engine
    if not args.serve and passed:
        print("demo passed: every answer checked; --serve keeps the server up for your own requests")
    return 0 if passed else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true",
                        help="serve until SIGINT or SIGTERM (default: answer the demo requests, then exit)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, help="with --serve: the port, 0 picks a free one (default 8080)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--device-blocks", type=int, default=512)
    parser.add_argument("--host-slots", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.port is not None and not args.serve:
        parser.error("--port applies only with --serve (the demo picks a free port)")
    if args.port is None:
        args.port = 8080
    if args.max_tokens < 1 or -(-args.max_tokens // GEOMETRY.block_size) > args.device_blocks:
        parser.error("--max-tokens must be >= 1 and fit in --device-blocks")
    try:
        sys.exit(anyio.run(run, args, backend=args.backend))
    except KeyboardInterrupt:
        print("shutting down")


if __name__ == "__main__":
    main()

"""The warm-up endpoint (kvtier.engine.warm_server): wire round trips, refusals, bounds, CurveZMQ.

Clients are blocking ZeroMQ sockets, so they run in worker threads while the server serves on the
test's event loop (asyncio and trio). The engine is a fake with the engine's async ``prefetch``
where a test needs to steer it, and a real ``kvtier.open`` engine with a memory tier where a test
proves the engine still serves loads after hostile requests.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
import torch
import zmq
import zmq.auth
from warm_fakes import FakeEngine, serving

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.engine.warm_protocol import MAX_MESSAGE_CHARS
from kvtier.engine.warm_server import WarmupServer, warmup_options
from kvtier.errors import EngineClosedError
from kvtier.ops.warm_cmd import WarmupError, warm

SALT = "tenant-secret-salt-1234"


def raw_exchange(endpoint: str, frames: list[bytes], *, socket_type: int = zmq.DEALER,
                 timeout_s: float = 5.0, curve: tuple[bytes, bytes, bytes] | None = None) -> dict[str, Any] | None:
    """Send ``frames`` as one message from a fresh socket; the decoded reply, or None without one."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = sock.recv_multipart()
        assert len(reply) == 1, reply
        return msgspec.msgpack.decode(reply[0])  # type: ignore[no-any-return]
    finally:
        ctx.destroy(linger=0)


async def exchange(endpoint: str, message: Any, **kwargs: Any) -> dict[str, Any] | None:
    frame = message if isinstance(message, bytes) else msgspec.msgpack.encode(message)
    return await anyio.to_thread.run_sync(lambda: raw_exchange(endpoint, [frame], **kwargs))


async def warm_in_thread(endpoint: str, token_ids: Any, **kwargs: Any) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(lambda: warm(endpoint, token_ids, **kwargs))


def request(**fields: Any) -> dict[str, Any]:
    return {"type": "prefetch", "id": 7, "token_ids": list(range(16)), **fields}


# ------------------------------------------------------------------------------ with a fake engine


@pytest.mark.anyio
async def test_round_trip_passes_every_field_to_the_engine_and_answers_the_outcome() -> None:
    engine = FakeEngine()
    async with serving(engine, deadline_s=2.0) as server:
        assert server.endpoint is not None and server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0
        reply = await warm_in_thread(
            server.endpoint, list(range(10)), cache_salt=SALT, lora_name="ad", lora_path="/a",
            mm_items=[("img", 0, 3)], tiers=[0, "1:memory", {"medium": "CPU"}], max_load_tokens=8,
            deadline_s=30.0, evict=False,
        )
        assert reply["type"] == "outcome" and reply["tokens"] == 8 and reply["chunks_by_tier"] == {"1:memory": 2}
        assert reply["pending"] == 0 and reply["timed_out"] is False and reply["seconds"] >= 0
        (call,) = engine.calls
        assert call == {
            "token_ids": list(range(10)), "params": {"max_load_tokens": 8}, "cache_salt": SALT, "lora_name": "ad",
            "lora_path": "/a", "mm_items": [("img", 0, 3)], "tiers": [0, "1:memory", {"medium": "CPU"}],
            "deadline_s": 2.0, "evict": False,  # the request's 30 s is capped at the server's 2 s
        }
        # A request without the optional fields: the engine gets None and the server's deadline.
        await warm_in_thread(server.endpoint, [1, 2, 3, 4])
        assert engine.calls[1]["params"] is None and engine.calls[1]["tiers"] is None
        assert engine.calls[1]["deadline_s"] == 2.0 and engine.calls[1]["evict"] is True
        stats = server.statistics()
        assert (stats.requests, stats.ok, stats.refused, stats.in_flight) == (2, 2, {}, 0)


@pytest.mark.anyio
async def test_a_req_client_gets_its_reply_and_the_id_is_echoed() -> None:
    async with serving(FakeEngine()) as server:
        assert server.endpoint is not None
        frame = msgspec.msgpack.encode(request(id="router-42"))
        reply = await anyio.to_thread.run_sync(
            lambda: raw_exchange(server.endpoint, [frame], socket_type=zmq.REQ))  # type: ignore[arg-type]
        assert reply is not None and reply["type"] == "outcome" and reply["id"] == "router-42"


@pytest.mark.anyio
@pytest.mark.parametrize("payload, where", [
    (b"\xc1 not msgpack", "not a MessagePack map"),
    (msgspec.msgpack.encode([1, 2, 3]), "Expected `object`"),
    (msgspec.msgpack.encode({"type": "evict_everything", "id": 7}), "$.type"),
    (msgspec.msgpack.encode(request(extra=1)), "unknown field `extra`"),
    (msgspec.msgpack.encode(request(token_ids=[1, -2, 3])), "$.token_ids[1]"),
    (msgspec.msgpack.encode(request(token_ids=[1, True])), "$.token_ids[1]"),
    (msgspec.msgpack.encode(request(token_ids=[1.5])), "$.token_ids[0]"),
    (msgspec.msgpack.encode(request(token_ids="abc")), "$.token_ids"),
    (msgspec.msgpack.encode(request(cache_salt=5)), "$.cache_salt"),
    (msgspec.msgpack.encode(request(deadline_s=-1.0)), "$.deadline_s"),
    (msgspec.msgpack.encode(request(deadline_s=math.inf)), "deadline_s must be finite"),
    (msgspec.msgpack.encode(request(evict="no")), "$.evict"),
    (msgspec.msgpack.encode(request(tiers=["../etc"])), "$.tiers[0]"),
    (msgspec.msgpack.encode(request(mm_items=[["h", 0, 0]])), "$.mm_items[0]"),
    (msgspec.msgpack.encode({"type": "prefetch", "token_ids": [1]}), "`id`"),
])
async def test_malformed_requests_get_a_clear_bad_request_and_never_reach_the_engine(payload: bytes, where: str) -> None:
    engine = FakeEngine()
    async with serving(engine) as server:
        assert server.endpoint is not None
        reply = await exchange(server.endpoint, payload)
        assert reply is not None and reply["type"] == "error" and reply["code"] == "bad_request", reply
        assert where in reply["message"] and len(reply["message"]) <= MAX_MESSAGE_CHARS
        assert SALT not in reply["message"]
        assert engine.calls == []
        assert (await warm_in_thread(server.endpoint, [1, 2, 3, 4]))["type"] == "outcome"
        stats = server.statistics()
        assert stats.refused == {"bad_request": 1} and stats.ok == 1 and stats.requests == 2


@pytest.mark.anyio
async def test_an_error_reply_carries_the_id_when_it_could_be_read() -> None:
    async with serving(FakeEngine()) as server:
        assert server.endpoint is not None
        reply = await exchange(server.endpoint, request(id=99, token_ids=[-1]))
        assert reply is not None and reply["id"] == 99
        reply = await exchange(server.endpoint, b"\x00\x01")
        assert reply is not None and reply["id"] is None


@pytest.mark.anyio
async def test_bad_envelopes_are_refused() -> None:
    async with serving(FakeEngine()) as server:
        endpoint = server.endpoint
        assert endpoint is not None
        frame = msgspec.msgpack.encode(request())
        for frames in ([b"x", frame], [b"", b"", frame], [frame, frame, frame, frame]):
            reply = await anyio.to_thread.run_sync(lambda f=frames: raw_exchange(endpoint, f))  # type: ignore[misc]
            assert reply is not None and reply["code"] == "bad_request" and "one frame" in reply["message"]
        assert server.statistics().refused == {"bad_request": 3}


@pytest.mark.anyio
async def test_oversized_frames_and_too_many_tokens_are_refused() -> None:
    engine = FakeEngine()
    async with serving(engine, max_request_bytes=4096, max_tokens=100) as server:
        assert server.endpoint is not None
        # Between one and two times max_request_bytes: answered, unread.
        reply = await exchange(server.endpoint, request(token_ids=[100_000] * 1200))
        assert reply is not None and reply["code"] == "too_large" and "4096" in reply["message"]
        # Over twice: libzmq drops the connection before reading it; no reply is possible.
        assert await exchange(server.endpoint, b"\x00" * 20_000, timeout_s=0.5) is None
        reply = await exchange(server.endpoint, request(token_ids=list(range(101))))
        assert reply is not None and reply["code"] == "too_large" and reply["id"] == 7
        assert "101 token ids" in reply["message"]
        assert engine.calls == []
        assert (await warm_in_thread(server.endpoint, list(range(100))))["tokens"] == 100
        assert server.statistics().refused == {"too_large": 2}


@pytest.mark.anyio
async def test_requests_beyond_max_in_flight_are_refused_at_once_as_busy() -> None:
    engine = FakeEngine()
    engine.gate = anyio.Event()
    async with serving(engine, max_in_flight=2) as server:
        endpoint = server.endpoint
        assert endpoint is not None
        replies: list[dict[str, Any]] = []
        async with anyio.create_task_group() as tg:
            for i in range(2):
                async def held(i: int = i) -> None:
                    replies.append(await warm_in_thread(endpoint, [1, 2, 3, 4]))
                tg.start_soon(held)
            with anyio.fail_after(10):
                while engine.entered < 2:
                    await anyio.sleep(0.01)
            assert server.statistics().in_flight == 2
            busy = await exchange(endpoint, request(id=3))
            assert busy is not None and busy["code"] == "busy" and busy["id"] == 3 and "2 warm-up" in busy["message"]
            assert engine.entered == 2
            engine.gate.set()
        assert [r["type"] for r in replies] == ["outcome", "outcome"]
        stats = server.statistics()
        assert (stats.ok, stats.refused, stats.in_flight) == (2, {"busy": 1}, 0)
        assert (await warm_in_thread(endpoint, [1]))["type"] == "outcome"  # the slots came back


@pytest.mark.anyio
async def test_engine_refusals_map_to_error_codes_without_the_salt() -> None:
    def behaviour(call: dict[str, Any]) -> Any:
        first = call["token_ids"][0]
        if first == 1:
            raise ValueError(f"tiers[0] = 'nvme' names no tier (salt was {call['cache_salt']})")
        if first == 2:
            raise EngineClosedError("prefetch: the engine is closed")
        raise RuntimeError(f"boom {call['cache_salt']}")

    async with serving(FakeEngine(behaviour)) as server:
        assert server.endpoint is not None
        codes = []
        for first in (1, 2, 3):
            with pytest.raises(WarmupError) as info:
                await warm_in_thread(server.endpoint, [first, 0, 0, 0], cache_salt=SALT)
            assert info.value.reply is not None and SALT not in info.value.reply["message"]
            assert SALT not in str(info.value)
            codes.append(info.value.code)
        assert codes == ["bad_request", "closed", "internal"]
        assert server.statistics().refused == {"bad_request": 1, "closed": 1, "internal": 1}


@pytest.mark.anyio
async def test_aclose_cancels_a_prefetch_in_flight_and_ends_run() -> None:
    engine = FakeEngine()
    engine.gate = anyio.Event()  # never set
    server = WarmupServer(engine, warmup_options({"port": 0}))
    endpoint = None
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            endpoint = server.endpoint
            assert endpoint is not None
            tg.start_soon(exchange, endpoint, request(), )
            while engine.entered < 1:
                await anyio.sleep(0.01)
            await server.aclose()
    await server.aclose()  # idempotent
    with pytest.raises(WarmupError) as info:
        await warm_in_thread(endpoint, [1], timeout_s=0.3)
    assert info.value.code == "no_reply"


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("raw, message", [
    ({}, "missing required key warmup.port"),
    ({"port": 0, "hots": "127.0.0.1"}, "warmup.hots"),
    ({"port": 0, "host": "localhost"}, "warmup.host"),
    ({"port": 70000}, "warmup.port"),
    ({"port": 0, "max_in_flight": 0}, "warmup.max_in_flight"),
    ({"port": 0, "max_tokens": True}, "warmup.max_tokens"),
    ({"port": 0, "deadline_s": math.nan}, "warmup.deadline_s"),
    ({"port": 0, "curve_secret_key_file": "/k.key_secret"}, "warmup.curve_public_key_file"),
    ([("port", 0)], "warmup must be a dict"),
])
def test_options_are_checked_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        warmup_options(raw)


def test_options_defaults_and_explicit_wildcards() -> None:
    opts = warmup_options({"port": 5720})
    assert (opts.host, opts.max_in_flight, opts.max_request_bytes, opts.max_tokens, opts.deadline_s, opts.curve) == (
        "127.0.0.1", 8, 1 << 20, 1 << 20, 10.0, False)
    assert warmup_options({"port": 0, "host": "0.0.0.0"}).host == "0.0.0.0"
    assert warmup_options({"port": 0, "host": "[::1]"}).host == "::1"


async def start_fails(**options: Any) -> str:
    """The ConfigError message of a server that cannot start (run raises before it is started)."""
    server = WarmupServer(FakeEngine(), warmup_options({"port": 0, **options}))
    with pytest.raises(ConfigError) as info:
        await server.run()
    with anyio.fail_after(5):
        await server.aclose()  # returns at once after a failed start
    return str(info.value)


@pytest.mark.anyio
async def test_a_port_in_use_and_unusable_key_files_fail_at_start(tmp_path: Path) -> None:
    async with serving(FakeEngine()) as server:
        assert "warmup.port: the warm-up endpoint cannot bind" in await start_fails(port=server.port)
    keys = curve_keys(tmp_path)
    options = {"curve_secret_key_file": str(tmp_path / "missing.key_secret"),
               "curve_public_key_file": keys["server_public"], "curve_allowed_clients_dir": keys["allowed"]}
    assert "warmup.curve_secret_key_file" in await start_fails(**options)
    options["curve_secret_key_file"] = keys["server_public"]  # a public certificate: no secret in it
    assert "holds no secret key" in await start_fails(**options)
    options.update(curve_secret_key_file=keys["server_secret"], curve_public_key_file=keys["client_public"])
    assert "warmup.curve_public_key_file" in await start_fails(**options)
    options.update(curve_public_key_file=keys["server_public"], curve_allowed_clients_dir=str(tmp_path / "nope"))
    assert "warmup.curve_allowed_clients_dir" in await start_fails(**options)


# ------------------------------------------------------------------------------ CurveZMQ


def curve_keys(root: Path) -> dict[str, str]:
    """A server pair, an allowed client (its public key in allowed/) and a stranger."""
    allowed = root / "allowed"
    private = root / "private"
    allowed.mkdir()
    private.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(private, "server")
    client_public, client_secret = zmq.auth.create_certificates(private, "client")
    _, stranger_secret = zmq.auth.create_certificates(private, "stranger")
    os.link(client_public, allowed / "client.key")
    return {"server_public": server_public, "server_secret": server_secret, "client_public": client_public,
            "client_secret": client_secret, "stranger_secret": stranger_secret, "allowed": str(allowed)}


@pytest.mark.anyio
async def test_curve_admits_only_allowed_clients(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = curve_keys(tmp_path)
    engine = FakeEngine()
    options = {"curve_secret_key_file": keys["server_secret"], "curve_public_key_file": keys["server_public"],
               "curve_allowed_clients_dir": keys["allowed"]}
    async with serving(engine, **options) as server:
        assert server.endpoint is not None
        reply = await warm_in_thread(server.endpoint, [1, 2, 3, 4], curve_secret_key_file=keys["client_secret"],
                                     curve_server_key_file=keys["server_public"])
        assert reply["type"] == "outcome"
        for client in ({"curve_secret_key_file": keys["stranger_secret"], "curve_server_key_file": keys["server_public"]},
                       {}):
            with pytest.raises(WarmupError) as info:
                await warm_in_thread(server.endpoint, [9, 9, 9, 9], timeout_s=1.0, **client)
            assert info.value.code == "no_reply" and info.value.reply is None
        assert [call["token_ids"] for call in engine.calls] == [[1, 2, 3, 4]]
        with anyio.fail_after(10):
            while sum(server.statistics().connections_refused.values()) < 2:
                await anyio.sleep(0.02)
        refused = server.statistics().connections_refused
        assert refused.get("untrusted_key", 0) >= 1 and refused.get("handshake_failed", 0) >= 1
        # The allowed client still works after the refusals.
        reply = await warm_in_thread(server.endpoint, [5, 6, 7, 8], curve_secret_key_file=keys["client_secret"],
                                     curve_server_key_file=keys["server_public"])
        assert reply["type"] == "outcome"
    secret = zmq.auth.load_certificate(keys["server_secret"])[1]
    assert secret is not None and secret.decode() not in caplog.text


# ------------------------------------------------------------------------------ with a real engine

BLOCK = 4
NUM_BLOCKS = 32


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, 2, 8), dtype=torch.float16) for _ in range(2)]


@pytest.mark.anyio
async def test_hostile_requests_leave_a_real_engine_serving_loads_and_warm_up_works() -> None:
    kv = device_kv()
    slot_bytes = geometry().slot_bytes(1)
    config = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * slot_bytes,
              "secondary_tiers": [{"type": "memory", "capacity_bytes": 1 << 24}]}
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 30_000) for _ in range(2 * BLOCK)] for _ in range(6)]
    async with kvtier.open(config, geometry(), kv) as engine:
        for i, tokens in enumerate(prompts):
            assert await engine.store(tokens, [2 * i, 2 * i + 1]) == 2 * BLOCK
        await engine.drain()
        server = WarmupServer(engine, warmup_options({"port": 0, "max_request_bytes": 4096, "max_tokens": 64}))
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            endpoint = server.endpoint
            assert endpoint is not None
            hostile: list[bytes] = [
                b"\xc1garbage", msgspec.msgpack.encode(request(token_ids=[-1])),
                msgspec.msgpack.encode(request(token_ids=[1] * 65)),
                msgspec.msgpack.encode(request(token_ids=[70_000] * 1500)),  # over max_request_bytes
                msgspec.msgpack.encode(request(tiers=["obj"])),  # the engine has no obj tier
            ]
            for frame in hostile:
                reply = await exchange(endpoint, frame)
                assert reply is not None and reply["type"] == "error", reply
                assert await engine.load(prompts[-1], [30, 31]) == 2 * BLOCK  # the engine still serves
            assert await exchange(endpoint, b"\x00" * 10_000, timeout_s=0.5) is None  # cut by libzmq
            assert await engine.load(prompts[-1], [30, 31]) == 2 * BLOCK
            # The first prompt was evicted from the 4 host slots long ago: warm-up brings it back.
            reply = await warm_in_thread(endpoint, prompts[0], deadline_s=5.0)
            assert reply["type"] == "outcome" and reply["tokens"] == 2 * BLOCK and not reply["timed_out"]
            assert reply["chunks_by_tier"].get("1:memory", 0) >= 1
            outcome = await engine.load_with_sources(prompts[0], [28, 29])
            assert outcome.tokens == 2 * BLOCK and set(outcome.tokens_by_tier) == {"0:primary"}
            stats = server.statistics()
            assert stats.ok == 1 and sum(stats.refused.values()) == len(hostile)
            await server.aclose()


@pytest.mark.anyio
async def test_open_serves_the_endpoint_with_warmup_and_counts_it_in_metrics() -> None:
    slot_bytes = geometry().slot_bytes(1)
    config = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * slot_bytes,
              "secondary_tiers": [{"type": "memory", "capacity_bytes": 1 << 24}]}
    prompt = [random.Random(4).randrange(1, 30_000) for _ in range(2 * BLOCK)]
    async with kvtier.open(config, geometry(), device_kv(), warmup={"port": 0}) as engine:
        assert engine.warmup_server is not None and engine.warmup_server.port > 0
        assert await engine.store(prompt, [0, 1]) == 2 * BLOCK
        await engine.drain()
        reply = await warm_in_thread(engine.warmup_server.endpoint, prompt, deadline_s=5.0)
        assert reply["type"] == "outcome" and reply["tokens"] == 2 * BLOCK
        bad = await exchange(engine.warmup_server.endpoint, b"\xc1garbage")
        assert bad is not None and bad["code"] == "bad_request"
        text = engine.metrics.render().decode()
    assert 'kvtier_warmup_requests_total{outcome="ok"} 1.0' in text
    assert 'kvtier_warmup_requests_total{outcome="bad_request"} 1.0' in text
    with pytest.raises(ConfigError, match="warmup.port"):
        async with kvtier.open(config, geometry(), device_kv(), warmup={"port": "x"}):
            pass

"""The p2p control plane (kvtier/tiers/p2p/control.py): two planes in one process on 127.0.0.1.

asyncio only: the p2p tier requires asyncio because ucxx does, so this module overrides the
``anyio_backend`` fixture instead of running on trio as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from kvtier.errors import ConfigError
from kvtier.tiers.p2p.control import ControlPlane, CurveKeys, PeerDown, PeerUnavailable
from kvtier.tiers.p2p.protocol import MAX_FRAME_BYTES, Disconnect, Lookup, encode

pytestmark = [pytest.mark.anyio, pytest.mark.ucxx]  # the data plane needs ucxx: see tests/conftest.py

KEY = b"\x02" * 32 + (0).to_bytes(4, "big")
HANG_GUARD_S = 10.0  # generous bound so a broken plane fails instead of hanging; never a timing claim


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def lookup(request_id: str = "req") -> Lookup:
    return Lookup(kv_request_id=request_id, keys=[KEY], round_seq=0)


def plane(port: int = 0, **kwargs: object) -> ControlPlane:
    settings: dict[str, object] = {"heartbeat_ivl_s": 0.1, "heartbeat_timeout_s": 0.5, "linger_s": 0.0}
    settings.update(kwargs)
    return ControlPlane("127.0.0.1", port, **settings)  # type: ignore[arg-type]


async def next_item(p: ControlPlane) -> tuple[str, object] | PeerDown:
    return await asyncio.wait_for(p.recv(), HANG_GUARD_S)


async def nothing_delivered(p: ControlPlane, for_s: float = 0.3) -> bool:
    """Run p's receive loop for a while; True if it delivered nothing."""
    try:
        item = await asyncio.wait_for(p.recv(), for_s)
    except asyncio.TimeoutError:
        return True
    raise AssertionError(f"unexpected delivery {item!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def pair() -> AsyncIterator[tuple[ControlPlane, ControlPlane]]:
    a, b = plane(), plane()
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture
async def raw_dealers() -> AsyncIterator[object]:
    ctx = zmq.asyncio.Context()
    sockets: list[zmq.asyncio.Socket] = []

    def make(endpoint: str, identity: bytes | None) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


async def test_messages_flow_both_ways(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = pair
    a.connect(b.identity)
    a.connect(b.identity)  # idempotent
    b.connect(a.identity)
    assert a.send(b.identity, lookup("from-a"))
    assert b.send(a.identity, lookup("from-b"))
    assert await next_item(b) == (a.identity, lookup("from-a"))
    assert await next_item(a) == (b.identity, lookup("from-b"))
    stats = a.statistics()
    assert (stats.peers, stats.connects, stats.messages_sent, stats.messages_received) == (1, 1, 1, 1)
    assert stats.identity == a.identity and a.identity.startswith("127.0.0.1:")


async def test_send_to_an_unconnected_peer_returns_false(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = pair
    assert not a.send(b.identity, lookup())
    assert a.statistics().send_failures == 1


async def test_connect_refuses_a_malformed_peer_id(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, _ = pair
    for bad in ["127.0.0.1", "*:5710", "tcp://h:1", "h:99999"]:
        with pytest.raises(ValueError):
            a.connect(bad)


async def test_malformed_frames_are_counted_and_good_traffic_continues(
    pair: tuple[ControlPlane, ControlPlane], raw_dealers: object
) -> None:
    a, _ = pair
    endpoint = f"tcp://{a.identity}"
    liar = raw_dealers(endpoint, b"127.0.0.1:9")  # type: ignore[operator]
    anonymous = raw_dealers(endpoint, None)  # type: ignore[operator]
    await liar.send(b"\xc1 not msgpack")
    await liar.send_multipart([b"two", b"parts"])
    await liar.send(b"\x00" * (MAX_FRAME_BYTES + 10))
    await liar.send(msgspec_map({"type": "pickle"}))
    await anonymous.send(encode(lookup()))  # ROUTER-assigned identity: not "host:port"
    await liar.send(encode(lookup("good")))
    assert await next_item(a) == ("127.0.0.1:9", lookup("good"))
    # The anonymous socket is a second connection: its frame may arrive after the liar's good
    # one (a busy machine). Keep the plane reading good traffic until it has been judged.
    for i in range(100):
        if a.statistics().messages_rejected.get("bad_identity"):
            break
        await liar.send(encode(lookup(f"more-{i}")))
        assert await next_item(a) == ("127.0.0.1:9", lookup(f"more-{i}"))
    assert a.statistics().messages_rejected == {
        "malformed": 1, "bad_frames": 1, "oversized": 1, "unknown_type": 1, "bad_identity": 1,
    }


def msgspec_map(obj: object) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(obj)


async def test_repeated_violations_disconnect_the_sender_once(raw_dealers: object) -> None:
    a = plane(max_violations=3)
    await a.start()
    try:
        sender = "127.0.0.1:9"
        liar = raw_dealers(f"tcp://{a.identity}", sender.encode())  # type: ignore[operator]
        for _ in range(5):
            await liar.send(b"garbage")
        await liar.send(encode(lookup("after-ban")))
        assert await next_item(a) == PeerDown(sender, "protocol_violation")
        assert await nothing_delivered(a)
        stats = a.statistics()
        assert stats.messages_rejected == {"malformed": 3, "banned": 3}
        assert stats.peers_down == {"protocol_violation": 1} and stats.banned == 1
        with pytest.raises(PeerUnavailable) as info:
            a.connect(sender)
        assert info.value.reason == "banned"
    finally:
        await a.aclose()


async def test_reported_violations_drop_the_dealer(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = pair
    a.connect(b.identity)
    for _ in range(5):
        a.violation(b.identity, "out_of_order")
    assert await next_item(a) == PeerDown(b.identity, "protocol_violation")
    assert not a.connected(b.identity) and not a.send(b.identity, lookup())
    assert a.statistics().messages_rejected == {"out_of_order": 5}


async def test_violation_backoff_ends(raw_dealers: object) -> None:
    a = plane(max_violations=1, violation_backoff_s=0.0)
    await a.start()
    try:
        liar = raw_dealers(f"tcp://{a.identity}", b"127.0.0.1:9")  # type: ignore[operator]
        await liar.send(b"garbage")
        assert await next_item(a) == PeerDown("127.0.0.1:9", "protocol_violation")
        await liar.send(encode(lookup("forgiven")))
        assert await next_item(a) == ("127.0.0.1:9", lookup("forgiven"))
    finally:
        await a.aclose()


async def test_a_closed_peer_is_reported_down_once(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = pair
    a.connect(b.identity)
    assert a.send(b.identity, lookup())
    assert await next_item(b) == (a.identity, lookup())  # the connection is up
    await b.aclose()
    down = await next_item(a)
    assert isinstance(down, PeerDown) and down.peer_id == b.identity
    assert down.reason in {"disconnected", "closed"}
    assert not a.connected(b.identity)
    assert await nothing_delivered(a)  # debounced: one notice per drop
    assert sum(a.statistics().peers_down.values()) == 1


async def test_drop_forgets_the_peer_without_a_notice(pair: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = pair
    a.connect(b.identity)
    assert a.send(b.identity, Disconnect(reason="bye"))
    assert await next_item(b) == (a.identity, Disconnect(reason="bye"))
    a.drop(b.identity)
    a.drop(b.identity)
    assert a.statistics().peers == 0
    assert await nothing_delivered(a)


async def test_recv_is_woken_by_close_and_close_is_idempotent() -> None:
    a = plane()
    await a.start()
    waiter = asyncio.ensure_future(a.recv())
    await asyncio.sleep(0.05)
    await a.aclose()
    await a.aclose()
    with pytest.raises(PeerUnavailable):
        await asyncio.wait_for(waiter, HANG_GUARD_S)
    with pytest.raises(PeerUnavailable):
        a.connect("127.0.0.1:9")


async def test_port_in_use_is_a_config_error() -> None:
    a = plane()
    await a.start()
    try:
        port = int(a.identity.rpartition(":")[2])
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
            await plane(port).start()
    finally:
        await a.aclose()


def test_a_bad_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="host"):
        ControlPlane("*", 5710)


# ------------------------------------------------------------------------------------- CURVE


def make_keys(tmp_path: Path, name: str, port: int) -> CurveKeys:
    """Own key pair in <name>/, an empty trusted dir <name>-trusted/; identity 127.0.0.1:<port>."""
    own, trusted = tmp_path / name, tmp_path / f"{name}-trusted"
    own.mkdir()
    trusted.mkdir()
    public, secret = zmq.auth.create_certificates(own, f"127.0.0.1:{port}")
    return CurveKeys(curve_secret_key_file=secret, curve_public_key_file=public, trusted_public_keys_dir=str(trusted))


def trust(keys: CurveKeys, other: CurveKeys) -> None:
    """Copy other's public certificate into keys' trusted dir, under other's identity."""
    source = Path(other.curve_public_key_file)
    (Path(keys.trusted_public_keys_dir) / source.name).write_bytes(source.read_bytes())


async def test_curve_serves_trusted_peers_and_refuses_others(tmp_path: Path) -> None:
    pa, pb, pc = free_port(), free_port(), free_port()
    ka, kb, kc = make_keys(tmp_path, "a", pa), make_keys(tmp_path, "b", pb), make_keys(tmp_path, "c", pc)
    trust(ka, kb)
    trust(kb, ka)
    trust(kc, ka)  # c knows a's key, but a does not trust c
    a, b, c = plane(pa, auth=ka), plane(pb, auth=kb), plane(pc, auth=kc)
    for p in (a, b, c):
        await p.start()
    try:
        c.connect(a.identity)
        assert c.send(a.identity, lookup("untrusted"))
        down = await next_item(c)
        assert down == PeerDown(a.identity, "handshake_failed")

        b.connect(a.identity)
        assert b.send(a.identity, lookup("trusted"))
        assert await next_item(a) == (b.identity, lookup("trusted"))
        a.connect(b.identity)
        assert a.send(b.identity, lookup("reply"))
        assert await next_item(b) == (a.identity, lookup("reply"))
        assert a.statistics().messages_received == 1
        with pytest.raises(PeerUnavailable) as info:
            a.connect(c.identity)
        assert info.value.reason == "no_key"
    finally:
        for p in (a, b, c):
            await p.aclose()


async def test_curve_peer_cannot_claim_another_identity(tmp_path: Path) -> None:
    pa, pb = free_port(), free_port()
    ka, kb = make_keys(tmp_path, "a", pa), make_keys(tmp_path, "b", pb)
    trust(ka, kb)
    a = plane(pa, auth=ka)
    await a.start()
    try:
        b_public, b_secret = zmq.auth.load_certificate(kb.curve_secret_key_file)
        a_public, _ = zmq.auth.load_certificate(ka.curve_public_key_file)
        ctx = zmq.asyncio.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"127.0.0.1:9")  # b's key, another identity
            sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = b_secret, b_public, a_public
            sock.connect(f"tcp://{a.identity}")
            await sock.send(encode(lookup("spoofed")))
            sock2 = ctx.socket(zmq.DEALER)
            sock2.setsockopt(zmq.IDENTITY, f"127.0.0.1:{pb}".encode())
            sock2.curve_secretkey, sock2.curve_publickey, sock2.curve_serverkey = b_secret, b_public, a_public
            sock2.connect(f"tcp://{a.identity}")
            await sock2.send(encode(lookup("genuine")))
            assert await next_item(a) == (f"127.0.0.1:{pb}", lookup("genuine"))
            # The spoofing socket's frame comes over another connection (its own CURVE and ZAP
            # handshake): read on until it has been judged; nothing may be delivered meanwhile.
            for _ in range(30):
                assert await nothing_delivered(a)
                if a.statistics().messages_rejected:
                    break
            assert a.statistics().messages_rejected == {"identity_mismatch": 1}
        finally:
            ctx.destroy(linger=0)
    finally:
        await a.aclose()


async def test_missing_curve_keys_are_config_errors(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, "a", 5710)
    secret_text = Path(keys.curve_secret_key_file).read_text()
    secret = next(line for line in secret_text.splitlines() if "secret-key" in line).split("=", 1)[1].strip(' "')
    cases = {
        "auth.curve_secret_key_file": CurveKeys(str(tmp_path / "nope"), keys.curve_public_key_file, keys.trusted_public_keys_dir),
        "auth.curve_public_key_file": CurveKeys(keys.curve_secret_key_file, str(tmp_path / "nope"), keys.trusted_public_keys_dir),
        "auth.trusted_public_keys_dir": CurveKeys(keys.curve_secret_key_file, keys.curve_public_key_file, str(tmp_path / "nope")),
    }
    other = make_keys(tmp_path, "b", 5711)
    cases["does not match"] = CurveKeys(keys.curve_secret_key_file, other.curve_public_key_file, keys.trusted_public_keys_dir)
    cases["holds no secret"] = CurveKeys(keys.curve_public_key_file, keys.curve_public_key_file, keys.trusted_public_keys_dir)
    for expected, auth in cases.items():
        with pytest.raises(ConfigError, match=expected) as info:
            await plane(auth=auth).start()
        assert secret not in str(info.value)


async def test_auth_without_curve_support_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(tmp_path, "a", 5710)
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="CURVE"):
        await plane(auth=keys).start()



async def test_refused_connections_are_counted_and_logged_once_per_address(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stranger's CURVE key (ZAP denial) and plaintext clients (failed handshake) are seen on the
    refusing side: counted by reason, and logged at WARNING once per address (or reason) per
    minute however often they retry (they used to leave no trace there)."""
    pa, pc = free_port(), free_port()
    ka, kc = make_keys(tmp_path, "a", pa), make_keys(tmp_path, "c", pc)
    trust(kc, ka)  # c knows a's key, but a does not trust c
    a, c = plane(pa, auth=ka), plane(pc, auth=kc)
    await a.start()
    await c.start()
    ctx = zmq.asyncio.Context()
    try:
        with caplog.at_level("WARNING", logger="kvtier.tiers.p2p.control"):
            c.connect(a.identity)
            assert c.send(a.identity, lookup("untrusted"))
            assert await next_item(c) == PeerDown(a.identity, "handshake_failed")
            for _ in range(3):  # plaintext clients at a CURVE server
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, f"127.0.0.1:{free_port()}".encode())
                sock.connect(f"tcp://{a.identity}")
                with contextlib.suppress(zmq.Again):  # the handshake is what a refuses; never wait to send
                    await sock.send(encode(lookup("plain")), zmq.NOBLOCK)
            for _ in range(100):  # a's receive loop sees the refusals; nothing is delivered
                assert await nothing_delivered(a, 0.1)
                refused = a.statistics().connections_refused
                if refused.get("untrusted_key", 0) >= 1 and refused.get("handshake_failed", 0) >= 3:
                    break
        refused = a.statistics().connections_refused
        assert refused.get("untrusted_key", 0) >= 1 and refused.get("handshake_failed", 0) >= 3, refused
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers.p2p.control"]
        assert sum("CURVE key is not trusted" in line and "127.0.0.1" in line for line in lines) == 1, lines
        assert sum("failed its handshake" in line for line in lines) == 1, lines
    finally:
        ctx.destroy(linger=0)
        await c.aclose()
        await a.aclose()

"""Hostile peers against a p2p producer: what one session may make it hold, and who may connect.

The producer is a real kvtier process (``tests/support/p2p_peer.py``). The hostile consumer runs in the
test process and is built from kvtier's own control and data planes, so it speaks the protocol
correctly (a handshake, a UCX link with its token) and then misbehaves: it looks up and never
fetches, floods lookups and fetches, opens raw TCP connections to the data port. asyncio only:
the p2p planes need it (ucxx).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from p2p_peer import SLOT_BYTES
from s3server import free_port
from test_p2p_tier import TOKENS, Peer, decoder, no_pins, p2p, prefiller

from kvtier.keys import hash_seed
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.control import ControlPlane
from kvtier.tiers.p2p.data import DataPlane, chunk_tag
from kvtier.tiers.p2p.producer import MAX_FETCHES_PER_SESSION, MAX_REQUESTS_PER_SESSION, SESSION_PIN_SHARE

pytestmark = [pytest.mark.anyio, pytest.mark.ucxx, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

SLOTS = 64  # the producer's host slots (p2p_peer's default)


class HostileConsumer:
    """A consumer session to ``producer`` that does only what the test tells it."""

    def __init__(self, producer: Peer) -> None:
        self.producer = f"127.0.0.1:{producer.port}"
        self.control = ControlPlane("127.0.0.1", 0, send_hwm=100_000)
        self.data = DataPlane()
        self.ack: p.ConnectAck | None = None
        self.inbox: list[p.Message] = []

    async def handshake(self) -> p.ConnectAck:
        await self.control.start()
        self.control.connect(self.producer)
        self.control.send(self.producer, p.Connect(
            peer_id=self.control.identity, block_len=SLOT_BYTES, num_blocks=SLOTS, hash_seed=hash_seed()))
        ack = await self.expect(p.ConnectAck)
        assert isinstance(ack, p.ConnectAck)
        self.ack = ack
        self.link = await self.data.connect("127.0.0.1", ack.data_port, ack.token, timeout=20)
        return ack

    def send(self, msg: p.Message) -> None:
        assert self.control.send(self.producer, msg)

    async def expect(self, kind: type, timeout: float = 30) -> p.Message:
        with anyio.fail_after(timeout):
            while True:
                item = await self.control.recv()
                assert isinstance(item, tuple), f"the producer dropped the session: {item}"
                if isinstance(item[1], kind):
                    return item[1]
                self.inbox.append(item[1])

    async def answers(self, kind: type, count: int, timeout: float = 60) -> list[Any]:
        got = [m for m in self.inbox if isinstance(m, kind)]
        self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        while len(got) < count:
            got.append(await self.expect(kind, timeout))
        return got

    async def aclose(self) -> None:
        await self.data.aclose()
        await self.control.aclose()


@pytest.fixture
def producer() -> Iterator[Peer]:
    peer = Peer("producer", [p2p(free_port(), unbound_store_timeout_s=2)])
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
async def hostile(producer: Peer) -> AsyncIterator[HostileConsumer]:
    consumer = HostileConsumer(producer)
    try:
        await consumer.handshake()
        yield consumer
    finally:
        await consumer.aclose()


def keys_of(peer: Peer, prompt: int) -> list[bytes]:
    return [bytes.fromhex(k) for k in peer.call("keys", prompt=prompt, tokens=TOKENS)["keys"]]


def p2p_metric(stats: dict[str, Any], name: str, label: str = "") -> float:
    return stats["p2p"][name].get(label, 0)


async def wait_stats(peer: Peer, predicate: Any, timeout: float = 30) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(lambda: peer.wait_stats(predicate, timeout))


async def test_pins_of_a_lookup_that_is_never_fetched_are_released(producer: Peer, hostile: HostileConsumer) -> None:
    """The session stays up and silent after its lookup: the pins still go after
    unbound_store_timeout_s (they used to stay for the session's whole life)."""
    producer.call("store", prompt=1, tokens=TOKENS)
    keys = keys_of(producer, 1)
    hostile.send(p.Lookup(kv_request_id="look-only", keys=keys, round_seq=0))
    (resp,) = await hostile.answers(p.LookupResp, 1)
    assert resp.hits == [True] * len(keys)
    assert producer.call("stats")["pinned_slots"] == len(keys)  # pinned for the fetch that never comes
    stats = await wait_stats(producer, no_pins)
    assert no_pins(stats)
    assert p2p_metric(stats, "p2p_reaped_ids") == 1
    assert p2p_metric(stats, "p2p_open_requests") == 0
    # The session itself is fine: a late fetch of that id is answered at once, as failed, and a
    # new lookup of it finds nothing (it would only pin chunks no fetch can take).
    hostile.send(p.Fetch(kv_request_id="look-only", keys=keys[:1], block_indexes=[0], round_seq=0))
    done = await hostile.expect(p.TransferDone)
    assert isinstance(done, p.TransferDone) and not done.success
    hostile.send(p.Lookup(kv_request_id="look-only", keys=keys, round_seq=1))
    (again,) = await hostile.answers(p.LookupResp, 1)
    assert again.hits == [False] * len(keys)
    assert producer.call("stats")["pinned_slots"] == 0


async def test_a_fetched_request_no_longer_counts_against_the_session() -> None:
    """Classic P/D: once every parked chunk was sent the id holds nothing, so it leaves the
    session's open ids without the terminal fetch (a busy decoder may send that late) — well
    before the idle timeout, which is long here so that it cannot be what frees it."""
    producer = Peer("producer", [p2p(free_port(), unbound_store_timeout_s=60)])
    hostile = HostileConsumer(producer)
    try:
        await hostile.handshake()
        producer.call("store", prompt=7, tokens=TOKENS, params=decoder("pd-open"))
        keys = keys_of(producer, 7)
        slots = [bytearray(SLOT_BYTES) for _ in keys]
        async with anyio.create_task_group() as tg:
            for i, slot in enumerate(slots):
                tg.start_soon(hostile.link.recv, memoryview(slot), chunk_tag("pd-open", 0, i))
            hostile.send(p.Fetch(kv_request_id="pd-open", keys=keys, block_indexes=list(range(len(keys))),
                                 round_seq=0))
            done = await hostile.expect(p.TransferDone)
        assert isinstance(done, p.TransferDone) and done.success
        stats = await wait_stats(producer, lambda s: no_pins(s) and p2p_metric(s, "p2p_open_requests") == 0)
        assert no_pins(stats) and p2p_metric(stats, "p2p_open_requests") == 0
        assert p2p_metric(stats, "p2p_reaped_ids") == 0  # not the idle timeout
    finally:
        await hostile.aclose()
        producer.close()


async def test_pins_after_a_partial_fetch_are_released_without_the_terminal_fetch(
        producer: Peer, hostile: HostileConsumer) -> None:
    producer.call("store", prompt=2, tokens=TOKENS)
    keys = keys_of(producer, 2)
    hostile.send(p.Lookup(kv_request_id="partial", keys=keys, round_seq=0))
    await hostile.answers(p.LookupResp, 1)
    slot = bytearray(SLOT_BYTES)
    async with anyio.create_task_group() as tg:
        tg.start_soon(hostile.link.recv, memoryview(slot), chunk_tag("partial", 0, 0))
        hostile.send(p.Fetch(kv_request_id="partial", keys=keys[:1], block_indexes=[0], round_seq=0))
        done = await hostile.expect(p.TransferDone)
    assert isinstance(done, p.TransferDone) and done.success
    # The lookup's job still holds the other chunks; without a terminal fetch they go by timeout.
    assert producer.call("stats")["pinned_slots"] == len(keys)
    assert no_pins(await wait_stats(producer, no_pins))


async def test_a_lookup_flood_is_bounded_per_session(producer: Peer, hostile: HostileConsumer) -> None:
    """Distinct request ids past MAX_REQUESTS_PER_SESSION are answered MISS and counted; the
    per-session state stays bounded."""
    flood = MAX_REQUESTS_PER_SESSION + 500
    key = bytes(36)
    sent = 0
    while sent < flood:
        batch = min(500, flood - sent)
        for i in range(sent, sent + batch):
            hostile.send(p.Lookup(kv_request_id=f"flood-{i}", keys=[key], round_seq=0))
        sent += batch
        await hostile.answers(p.LookupResp, batch)  # every lookup is answered, refused ones too
    stats = await wait_stats(producer, lambda s: p2p_metric(s, "p2p_open_requests") == MAX_REQUESTS_PER_SESSION)
    assert p2p_metric(stats, "p2p_open_requests") == MAX_REQUESTS_PER_SESSION  # the gauge lags ≤ 0.2 s
    assert p2p_metric(stats, "p2p_limit_refusals", "requests") == flood - MAX_REQUESTS_PER_SESSION
    # Idle ids are forgotten after unbound_store_timeout_s: the session may look up again.
    stats = await wait_stats(producer, lambda s: p2p_metric(s, "p2p_open_requests") == 0)
    assert p2p_metric(stats, "p2p_open_requests") == 0
    hostile.send(p.Lookup(kv_request_id="after-flood", keys=[key], round_seq=0))
    (resp,) = await hostile.answers(p.LookupResp, 1)
    assert resp.hits == [False]
    assert p2p_metric(producer.call("stats"), "p2p_limit_refusals", "requests") == flood - MAX_REQUESTS_PER_SESSION


async def test_lookups_cannot_pin_more_than_a_session_share_of_the_host(
        producer: Peer, hostile: HostileConsumer) -> None:
    cap = int(SLOTS * SESSION_PIN_SHARE)
    held: list[bytes] = []
    for prompt in (3, 4):
        producer.call("store", prompt=prompt, tokens=TOKENS)
        held += keys_of(producer, prompt)
    assert len(held) > cap
    hostile.send(p.Lookup(kv_request_id="greedy", keys=held, round_seq=0))
    (resp,) = await hostile.answers(p.LookupResp, 1)
    assert sum(resp.hits) == cap
    # Asking again pins nothing twice.
    hostile.send(p.Lookup(kv_request_id="greedy", keys=held[:cap], round_seq=1))
    (again,) = await hostile.answers(p.LookupResp, 1)
    assert again.hits == [True] * cap
    stats = producer.call("stats")
    assert stats["pinned_slots"] == cap
    assert p2p_metric(stats, "p2p_limit_refusals", "pins") == len(held) - cap


async def test_a_fetch_flood_is_bounded_per_session(producer: Peer, hostile: HostileConsumer) -> None:
    """Fetches of ids nobody stores wait for their chunks; past MAX_FETCHES_PER_SESSION at once
    they are answered failed at once."""
    extra = 20
    for i in range(MAX_FETCHES_PER_SESSION + extra):
        hostile.send(p.Fetch(kv_request_id=f"never-{i}", keys=[bytes(36)], block_indexes=[0], round_seq=0))
    failed = await hostile.answers(p.TransferDone, extra)
    assert all(not done.success for done in failed)
    stats = await wait_stats(producer, lambda s: p2p_metric(s, "p2p_waiting_fetches") == MAX_FETCHES_PER_SESSION)
    assert p2p_metric(stats, "p2p_waiting_fetches") == MAX_FETCHES_PER_SESSION
    assert p2p_metric(stats, "p2p_limit_refusals", "fetches") == extra


async def test_raw_tcp_connections_to_the_data_port_are_closed(producer: Peer, hostile: HostileConsumer) -> None:
    """Connections that never present a token (UCX alone keeps them for ever) are closed within
    the accept timeout; the producer's descriptors come back down and a real consumer is served."""
    assert hostile.ack is not None
    before = producer.call("stats")["fds"]
    raw = [socket.create_connection(("127.0.0.1", hostile.ack.data_port)) for _ in range(200)]
    try:
        for sock in raw:
            sock.settimeout(30)
        closed = await anyio.to_thread.run_sync(lambda: sum(sock.recv(1) == b"" for sock in raw))
        assert closed == len(raw)
        stats = await wait_stats(producer, lambda s: s["fds"] <= before + 10
                                 and p2p_metric(s, "p2p_data_endpoints_refused") >= len(raw))
        assert stats["fds"] <= before + 10, (before, stats["fds"])
        assert p2p_metric(stats, "p2p_data_endpoints_refused") >= len(raw)
    finally:
        for sock in raw:
            sock.close()
    # The hostile session's own link was never touched, and a real consumer is served.
    consumer = Peer("consumer", [p2p(free_port(), load_timeout_s=20)])
    try:
        producer.call("store", prompt=5, tokens=TOKENS, params=decoder("after-raw"))
        got = consumer.call("load", prompt=5, tokens=TOKENS, params=prefiller(producer, "after-raw"))
        assert got["loaded"] == TOKENS and got["ok"]
    finally:
        consumer.close()
    assert not hostile.link.closed


def _listening_addresses(pid: int) -> set[str]:
    """The local addresses of the TCP listening sockets process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in rows.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    addresses.add(fields[1].rpartition(":")[0])
    return addresses


def _other_address() -> str | None:
    """An address of this machine that is not loopback (None on a loopback-only machine)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


async def test_ucx_listens_and_serves_only_on_the_configured_host(producer: Peer, hostile: HostileConsumer) -> None:
    """A producer on 127.0.0.1: UCX's transport listens on loopback only (the data port itself is
    the wildcard ucxx insists on), and a connection to the data port through another address is
    closed at once."""
    pid = producer.call("stats") and producer.proc.pid
    loopback, wildcard = "0100007F", "00000000"
    specific = {a for a in _listening_addresses(pid) if set(a) - {"0"}}  # not a wildcard
    assert specific and all(a == loopback or a.endswith(loopback) for a in specific), specific
    assert wildcard in _listening_addresses(pid)  # the data port (ucxx takes no host)
    other = _other_address()
    if other is not None:  # on a loopback-only machine there is no other way in to try
        assert hostile.ack is not None
        with socket.create_connection((other, hostile.ack.data_port), timeout=30) as sock:
            started = time.monotonic()
            assert sock.recv(1) == b""
            assert time.monotonic() - started < 30


async def test_consumer_traffic_flows_over_loopback_only(producer: Peer) -> None:
    """Both peers on 127.0.0.1: the chunk bytes travel between loopback addresses (they used to
    go through the machine's external address)."""
    consumer = Peer("consumer", [p2p(free_port(), load_timeout_s=20)])
    try:
        producer.call("store", prompt=6, tokens=TOKENS, params=decoder("lo-1"))
        got = consumer.call("load", prompt=6, tokens=TOKENS, params=prefiller(producer, "lo-1"))
        assert got["loaded"] == TOKENS and got["ok"]
        for pid in (producer.proc.pid, consumer.proc.pid):
            assert all(a.endswith("0100007F") for a in _listening_addresses(pid) if set(a) - {"0"})
    finally:
        consumer.close()

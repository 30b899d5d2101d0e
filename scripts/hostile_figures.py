"""The figures behind docs/p2p-network.md: what hostile peers cost a producer and the events endpoint.

``python scripts/hostile_figures.py`` (needs the ``test`` extra: it reuses the hostile peers of
``tests/tiers/p2p/test_p2p_hostile.py`` and ``tests/events/test_events_hostile.py``) prints:

* how long after a lookup that is never fetched its pins are released (the session stays up);
* the producer's resident memory before and after 40,000 lookups of distinct request ids;
* the producer's open descriptors while 500 raw TCP connections sit on its data port, and after;
* the worst latency of live KV event batches while the replay endpoint takes 3 s of garbage.

Figures, not assertions: the tests assert the behaviour; this shows its size on this machine.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

for _tests in ("tests/support", "tests/events", "tests/tiers/p2p"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / _tests))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import zmq  # noqa: E402
from test_events_hostile import _FLOODER  # noqa: E402
from test_p2p_hostile import TOKENS, HostileConsumer, Peer, free_port, keys_of, p, p2p  # noqa: E402

from kvtier.events import BlockRemoved, ZmqEventPublisher  # noqa: E402

UNBOUND_S = 3.0


async def p2p_figures() -> None:
    producer = Peer("producer", [p2p(free_port(), unbound_store_timeout_s=UNBOUND_S)])
    hostile = HostileConsumer(producer)
    try:
        await hostile.handshake()
        producer.call("store", prompt=1, tokens=TOKENS)
        keys = keys_of(producer, 1)
        hostile.send(p.Lookup(kv_request_id="look-only", keys=keys, round_seq=0))
        await hostile.answers(p.LookupResp, 1)
        started = time.monotonic()
        pinned = producer.call("stats")["pinned_slots"]
        while producer.call("stats")["pinned_slots"]:
            await anyio.sleep(0.05)
        print(f"look-only session: {pinned} pins released {time.monotonic() - started:.2f} s after the lookup "
              f"(unbound_store_timeout_s={UNBOUND_S:g}); the session is still open")

        before = producer.call("stats")["rss_bytes"]
        flood, sent = 40_000, 0
        while sent < flood:
            batch = min(1000, flood - sent)
            for i in range(sent, sent + batch):
                hostile.send(p.Lookup(kv_request_id=f"flood-{i}", keys=[bytes(36)], round_seq=0))
            sent += batch
            await hostile.answers(p.LookupResp, batch)
        stats = producer.call("stats")
        print(f"{flood} lookups of distinct ids: producer RSS {before / 2**20:.1f} -> "
              f"{stats['rss_bytes'] / 2**20:.1f} MiB, {stats['p2p']['p2p_limit_refusals']['requests']:.0f} refused")

        assert hostile.ack is not None
        fds_before = producer.call("stats")["fds"]
        raw = [socket.create_connection(("127.0.0.1", hostile.ack.data_port)) for _ in range(500)]
        opened = time.monotonic()
        await anyio.sleep(1.0)
        fds_during = producer.call("stats")["fds"]
        for sock in raw:
            sock.settimeout(60)
        closed = await anyio.to_thread.run_sync(lambda: sum(sock.recv(1) == b"" for sock in raw))
        all_closed = time.monotonic() - opened
        for sock in raw:
            sock.close()
        await anyio.sleep(0.5)
        stats = producer.call("stats")
        print(f"500 raw TCP connections to the data port: producer descriptors {fds_before} -> {fds_during} "
              f"(1 s in) -> {stats['fds']}; {closed} closed by the producer, the last {all_closed:.1f} s "
              f"after opening; p2p_data_endpoints_refused {stats['p2p']['p2p_data_endpoints_refused']['']:.0f}")
    finally:
        await hostile.aclose()
        producer.close()


async def events_figures() -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    async with anyio.create_task_group() as tg:
        await tg.start(publisher.run)
        assert publisher.last_endpoint is not None and publisher.last_replay_endpoint is not None
        sub.connect(publisher.last_endpoint)
        while True:  # the subscription is up once a batch comes through
            publisher.publish([BlockRemoved([0], "CPU")])
            if sub.poll(20):
                break
        await anyio.sleep(0.2)
        while sub.poll(0):
            sub.recv_multipart()
        flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, publisher.last_replay_endpoint, "malformed", "3"],
                                   stdout=subprocess.DEVNULL)
        started, worst, count = time.monotonic(), 0.0, 0
        while time.monotonic() - started < 5:
            count += 1
            sent = time.monotonic()
            publisher.publish([BlockRemoved([count], "CPU")])
            assert sub.poll(30_000), "a live batch did not arrive within 30 s"
            sub.recv_multipart()
            worst = max(worst, time.monotonic() - sent)
            await anyio.sleep(0.05)
        flooder.wait()
        stats = publisher.statistics()
        print(f"3 s of malformed replay requests: {count} live batches over 5 s, worst latency "
              f"{worst * 1000:.1f} ms; {stats.replay_requests_malformed} malformed requests counted")
        await publisher.aclose()
        tg.cancel_scope.cancel()
    sub.close()
    ctx.term()


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # 500 client sockets
    asyncio.run(p2p_figures())
    asyncio.run(events_figures())


if __name__ == "__main__":
    main()

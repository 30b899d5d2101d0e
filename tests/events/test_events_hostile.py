"""Hostile peers on the KV event replay endpoint (kvtier.events.ZmqEventPublisher, kvtier.events.replay).

A peer that can reach ``events.replay_endpoint`` floods it with malformed frames or with valid
replay requests, over real ZMQ on 127.0.0.1. The publisher must keep publishing live events,
log a bounded number of lines, refuse requests beyond its replay rate with the end-of-replay
marker (which keeps REQ-style clients usable) and count all of it in its statistics.

Waits are guards against hanging (generous), never performance assertions.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time

import anyio
import msgpack
import pytest
import zmq

import kvtier.events.replay as replay_module
from kvtier.events import REPLAY_BURST, REPLAY_RATE_PER_S, AllBlocksCleared, BlockRemoved, ZmqEventPublisher

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
LOGGER = "kvtier.events"

# A separate process, as a hostile peer is: it sends as fast as ZMQ takes messages (never
# blocking, several connections) until killed or ``limit_s`` passes, and says "flooding" on
# stdout once 20000 messages are in flight. It never reads what the publisher answers.
_FLOODER = r"""
import sys, time, zmq
endpoint, kind, limit_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
messages = {
    "malformed": [[b"x"], [b"", b"abc"], [b"x", b"", bytes(8)]],
    "valid": [[b"", bytes(8)]],
}[kind]
ctx = zmq.Context()
sockets = []
for _ in range(4):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.connect(endpoint)
    sockets.append(s)
sent, announced = 0, False
deadline = time.monotonic() + limit_s
while time.monotonic() < deadline:
    for s in sockets:
        for m in messages:
            try:
                s.send_multipart(m, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
    if not announced and sent >= 20000:
        print("flooding", flush=True)
        announced = True
"""


def _report_counts(records: list[logging.LogRecord], what: str) -> list[int]:
    """The N of every "… N <what> …" periodic report line (one per logged record that has one)."""
    counts = []
    for record in records:
        match = re.search(rf"(\d+) {what}", record.getMessage())
        if match:
            counts.append(int(match.group(1)))
    return counts


def _publisher_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


async def _published(pub: ZmqEventPublisher, count: int) -> None:
    """Publish ``count`` batches (into the replay ring) and wait until the thread has sent them."""
    for i in range(count):
        pub.publish([BlockRemoved([i], "CPU")])
    with anyio.fail_after(10):
        while pub.statistics().published_batches < count:
            await anyio.sleep(0.005)


async def _subscribed(pub: ZmqEventPublisher, ctx: zmq.Context) -> zmq.Socket:
    """A SUB socket that has seen a batch (PUB/SUB slow joiner), drained of probes."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.last_endpoint)
    with anyio.fail_after(5):
        while True:
            pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                break
            await anyio.sleep(0)
    await anyio.sleep(0.1)
    while sub.poll(0):
        sub.recv_multipart()
    return sub


def _wait_for_batch(sub: zmq.Socket, block_hash: int, timeout_s: float) -> bool:
    """Whether a batch holding ``BlockRemoved([block_hash])`` arrives within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000) + 1):
            _, _, payload = sub.recv_multipart()
            if any(e.get("block_hashes") == [block_hash] for e in msgpack.unpackb(payload)[1]):
                return True
    return False


def _replay(dealer: zmq.Socket, start: int, timeout_s: float = 5.0) -> list[int]:
    """Send one replay request; the seqs answered before the end marker."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while True:
        assert dealer.poll(int(timeout_s * 1000)), "no end-of-replay marker within the guard timeout"
        frames = dealer.recv_multipart()
        if frames[2] == END_OF_REPLAY:
            assert frames == [b"", b"", END_OF_REPLAY, b""]
            return seqs
        seqs.append(int.from_bytes(frames[2], "big"))


@pytest.mark.anyio
async def test_a_malformed_replay_flood_is_counted_and_reported_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    # Single frames, a wrong-size sequence number, a missing delimiter and too many frames.
    garbage = [[b"x"], [b"", b"abc"], [b"", bytes(9)], [b"x", bytes(8)], [b"x", b"", bytes(8), b"y"]]
    per_kind = 1200
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            dealer.connect(pub.last_replay_endpoint)

            def flood() -> None:
                for _ in range(per_kind):
                    for frames in garbage:
                        dealer.send_multipart(frames)  # blocking: every one reaches the publisher

            await anyio.to_thread.run_sync(flood)
            with anyio.fail_after(15):  # a guard against hanging
                while pub.statistics().replay_requests_malformed < per_kind * len(garbage):
                    await anyio.sleep(0.02)
            # A well-formed request still gets its replay behind the garbage.
            pub.publish([BlockRemoved([7], "CPU")])
            seqs = await anyio.to_thread.run_sync(_replay, dealer, 0)
            assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            await pub.aclose()
    finally:
        dealer.close()
        ctx.term()
    stats = pub.statistics()
    assert stats.replay_requests_malformed == per_kind * len(garbage)
    assert (stats.replay_requests, stats.replay_requests_refused) == (1, 0)
    records = _publisher_records(caplog)
    # Within one report interval: a single summary line (flushed on close), never one per frame.
    assert len(records) == 1, [r.getMessage() for r in records]
    assert _report_counts(records, "malformed") == [per_kind * len(garbage)]


@pytest.mark.anyio
async def test_malformed_requests_are_reported_once_per_interval_without_further_input(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(replay_module, "_REPLAY_REPORT_INTERVAL_S", 0.3)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            dealer.connect(pub.last_replay_endpoint)
            for _ in range(100):
                dealer.send_multipart([b"x"])
            with anyio.fail_after(10):  # the report comes once the interval passes, no more input needed
                while not _publisher_records(caplog):
                    await anyio.sleep(0.02)
            await pub.aclose()
    finally:
        dealer.close()
        ctx.term()
    records = _publisher_records(caplog)
    assert sum(_report_counts(records, "malformed")) == 100
    assert len(records) <= 2  # at most the report and, if the frames straddled it, one on close


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["malformed", "valid"])
async def test_live_events_are_published_while_the_replay_endpoint_is_flooded(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    flooder = None
    sub = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            sub = await _subscribed(pub, ctx)
            flooder = subprocess.Popen(
                [sys.executable, "-c", _FLOODER, pub.last_replay_endpoint, kind, "15"],
                stdout=subprocess.PIPE, text=True,
            )
            with anyio.fail_after(15):  # a guard: the flooder starts and gets going
                line = await anyio.to_thread.run_sync(flooder.stdout.readline)
            assert line.strip() == "flooding"

            # The flood goes on; a live batch must still get through (a liveness bound, generous).
            pub.publish([BlockRemoved([424242], "CPU")])
            arrived = await anyio.to_thread.run_sync(_wait_for_batch, sub, 424242, 10.0)
            flooder.kill()
            flooder.wait()
            assert arrived, "a live event was held back by the replay flood"
            await pub.aclose()
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
            flooder.wait()
        if sub is not None:
            sub.close()
        ctx.term()
    stats = pub.statistics()
    if kind == "malformed":
        assert stats.replay_requests_malformed > 0 and stats.replay_requests == 0
    else:
        assert stats.replay_requests_refused > 0 and stats.replay_requests_malformed == 0
    assert len(_publisher_records(caplog)) <= 2


@pytest.mark.anyio
async def test_replay_requests_beyond_the_rate_get_only_the_end_marker_and_are_counted() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    requests = 2000
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    polite = ctx.socket(zmq.DEALER)
    for sock in (flood, polite):
        sock.setsockopt(zmq.LINGER, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            await _published(pub, 5)
            flood.connect(pub.last_replay_endpoint)
            polite.connect(pub.last_replay_endpoint)

            began = time.monotonic()

            def send_flood() -> None:
                for _ in range(requests):
                    flood.send_multipart([b"", (0).to_bytes(8, "big")])

            await anyio.to_thread.run_sync(send_flood)
            with anyio.fail_after(15):  # a guard against hanging
                while (s := pub.statistics()).replay_requests + s.replay_requests_refused < requests:
                    await anyio.sleep(0.02)
            elapsed = time.monotonic() - began
            stats = pub.statistics()
            # The token bucket: at most the burst plus the rate over the time the flood took.
            assert stats.replay_requests <= REPLAY_BURST + REPLAY_RATE_PER_S * elapsed + 1
            assert stats.replay_requests_refused == requests - stats.replay_requests > 0

            # Every request is answered by exactly one end marker; a refused one by nothing else.
            def read_answers() -> tuple[int, int]:
                markers = batches = 0
                while markers < requests:
                    assert flood.poll(5000), "the publisher stopped answering"
                    frames = flood.recv_multipart()
                    if frames[2] == END_OF_REPLAY:
                        markers += 1
                    else:
                        batches += 1
                return markers, batches

            markers, batches = await anyio.to_thread.run_sync(read_answers)
            assert (markers, batches) == (requests, 5 * stats.replay_requests)

            # A well-behaved client that retries when refused gets its replay once the rate allows.
            def polite_replay() -> list[int]:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    seqs = _replay(polite, 0)
                    if seqs:
                        return seqs
                    time.sleep(1 / REPLAY_RATE_PER_S)
                raise AssertionError("no replay within the guard timeout")

            assert await anyio.to_thread.run_sync(polite_replay) == [0, 1, 2, 3, 4]
            await pub.aclose()
    finally:
        flood.close()
        polite.close()
        ctx.term()


@pytest.mark.anyio
async def test_a_full_ring_replay_is_complete_and_in_order_while_live_batches_continue() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3000)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            await _published(pub, 4000)
            dealer.connect(pub.last_replay_endpoint)
            stop = threading.Event()

            def publish_meanwhile() -> None:
                while not stop.is_set():
                    pub.publish([BlockRemoved([1], "CPU")])
                    time.sleep(0.001)

            tg.start_soon(anyio.to_thread.run_sync, publish_meanwhile)
            try:
                seqs = await anyio.to_thread.run_sync(_replay, dealer, 0)
            finally:
                stop.set()
            # The ring as it was when the request was taken (full: 3000 batches, at least the
            # last 3000 of the first 4000), contiguous, then the marker.
            assert seqs[0] >= 1000 and seqs == list(range(seqs[0], seqs[0] + 3000))
            await pub.aclose()
    finally:
        dealer.close()
        ctx.term()

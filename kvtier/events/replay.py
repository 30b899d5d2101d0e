"""The replay side of the KV event publisher: answers ``[client, "", start_seq]`` on a ROUTER socket.

The replay socket is untrusted input, so its work per turn of the publisher thread is bounded:
requests are read at a bounded rate, replays are rate-limited over all clients and sent a slice at
a time, round-robin, and malformed or refused requests are counted and summarised in one log line
per interval. No peer can hold back live events.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import islice
from typing import Any

import zmq

from kvtier.events.wire import END_OF_REPLAY_SEQ

__all__ = ["ReplayServer", "REPLAY_RATE_PER_S", "REPLAY_BURST"]

# The events package logs under one name, whichever of its modules speaks.
logger = logging.getLogger("kvtier.events")

#: Replays answered per second, over all clients (a token bucket holding up to REPLAY_BURST).
REPLAY_RATE_PER_S = 5.0
REPLAY_BURST = 10
# Per turn of the publisher thread, after the live batches: at most this many replay requests
# read (and at most _REPLAY_READS_PER_S on average; the rest wait in ZMQ and TCP buffers, which
# pushes back on the sender) and at most this many replayed batches sent.
_REPLAY_REQUESTS_PER_TURN = 64
_REPLAY_READS_PER_S = 2000.0
_REPLAY_SENDS_PER_TURN = 256
_REPLAY_REPORT_INTERVAL_S = 10.0  # malformed and refused requests: one summary line at most this often


class _TokenBucket:
    """``rate`` tokens per second, holding at most ``capacity``; starts full."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._tokens = capacity
        self._at = time.monotonic()

    def available(self, now: float) -> float:
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def take(self, now: float, n: float = 1.0) -> bool:
        if self.available(now) < n:
            return False
        self._tokens -= n
        return True


class ReplayServer:
    """The replay ROUTER's side of the publisher thread: bounded work per :meth:`turn`.

    Counters are plain ints written by the publisher thread only (read by ``statistics()``).
    """

    def __init__(self, socket: Any, topic: bytes) -> None:
        self.socket = socket
        self.topic = topic
        self.answered = 0
        self.refused = 0
        self.malformed = 0
        self._replay_tokens = _TokenBucket(REPLAY_RATE_PER_S, REPLAY_BURST)
        self._read_tokens = _TokenBucket(_REPLAY_READS_PER_S, _REPLAY_REQUESTS_PER_TURN)
        # Replays in progress: (client, the batches still to send, oldest first).
        self._active: deque[tuple[bytes, deque[tuple[int, bytes]]]] = deque()
        self._reported_malformed = 0
        self._reported_refused = 0
        self._reported_at = time.monotonic()
        self._next_report = self._reported_at + _REPLAY_REPORT_INTERVAL_S

    def idle_wait(self, longest: float) -> float | None:
        """How long the thread may wait for a live batch before the next turn, at most ``longest``
        (``None``: not at all)."""
        if self._active:
            return None
        # Read throttled: come back when a slice of reads is due (sooner if a live batch comes).
        short = _REPLAY_REQUESTS_PER_TURN - self._read_tokens.available(time.monotonic())
        return min(longest, max(short / _REPLAY_READS_PER_S, 0.001)) if short > 0 else longest

    def turn(self, ring: deque[tuple[int, bytes]]) -> None:
        """Read the requests due, start the replays they ask for from ``ring`` (the buffered
        batches as they are now), send one slice of the replays in progress, report if due."""
        now = time.monotonic()
        self._read(ring, now)
        self._send_slice()
        if now >= self._next_report:
            self.report()

    def _read(self, ring: deque[tuple[int, bytes]], now: float) -> None:
        reads = min(int(self._read_tokens.available(now)), _REPLAY_REQUESTS_PER_TURN)
        for _ in range(reads):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._read_tokens.take(now)
            # Untrusted input: anything but [client, "", 8-byte seq] is ignored (and counted).
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.malformed += 1
                continue
            client = frames[0]
            if len(self._active) >= REPLAY_BURST or not self._replay_tokens.take(now):
                self.refused += 1
                self._send(client, (b"", END_OF_REPLAY_SEQ, b""))
                continue
            self.answered += 1
            start = int.from_bytes(frames[2], "big")
            # The ring's seqs are contiguous: skip straight to ``start``.
            skip = max(0, start - ring[0][0]) if ring else 0
            self._active.append((client, deque(islice(ring, skip, None))))

    def _send_slice(self) -> None:
        """Send up to _REPLAY_SENDS_PER_TURN replayed batches, round-robin over the replays."""
        budget = _REPLAY_SENDS_PER_TURN
        while self._active and budget > 0:
            client, pending = self._active.popleft()
            share = max(1, budget // (len(self._active) + 1))
            while pending and share > 0:
                seq, payload = pending.popleft()
                self._send(client, (self.topic, seq.to_bytes(8, "big"), payload))
                share -= 1
                budget -= 1
            if pending:
                self._active.append((client, pending))
            else:
                self._send(client, (b"", END_OF_REPLAY_SEQ, b""))

    def _send(self, client: bytes, frames: tuple[bytes, bytes, bytes]) -> None:
        # A ROUTER never blocks: beyond the client's SNDHWM, or for a client gone, ZMQ drops.
        try:
            self.socket.send_multipart((client, b"", *frames), zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - only with ROUTER_MANDATORY, which is not set
            pass

    def report(self) -> None:
        """Log what was refused or ignored since the last report, in one line (if anything)."""
        now = time.monotonic()
        malformed = self.malformed - self._reported_malformed
        refused = self.refused - self._reported_refused
        if malformed or refused:
            logger.warning(
                "KV event replay endpoint: ignored %d malformed requests and refused %d over the rate "
                "limit (%g replays/s) in the last %.1f s",
                malformed, refused, REPLAY_RATE_PER_S, now - self._reported_at,
            )
        self._reported_malformed = self.malformed
        self._reported_refused = self.refused
        self._reported_at = now
        self._next_report = now + _REPLAY_REPORT_INTERVAL_S

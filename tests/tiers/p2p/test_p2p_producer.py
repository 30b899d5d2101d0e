"""The p2p producer's bookkeeping in process, with a stand-in control plane and parent manager.

What a real pair of processes cannot stage on demand: a consumer's control queue filling up
exactly while its lookups are being answered.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.p2p import protocol as p
from kvtier.tiers.p2p.producer import Served
from kvtier.tiers.p2p.tier import P2PTier
from kvtier.types import LookupResult


def make_tier() -> P2PTier:
    host = types.SimpleNamespace(num_slots=64, view=lambda slot: memoryview(bytearray(8)))
    context = TierContext(index=0, label="0:p2p", slot_bytes=8, host=host, geometry=None,
                          blocks_per_chunk=1, run_fields={})
    config = types.SimpleNamespace(options={"host": "127.0.0.1", "port": 1}, index=0, type="p2p",
                                   module_path=None, locality=None, backpressure=None, enable_kv_events=False)
    return P2PTier(config, context)


class Parent:
    """Every key is held in host memory; store jobs count the pins they would take."""

    def __init__(self) -> None:
        self.pinned = 0
        self._ids = itertools.count()

    def lookup(self, key: bytes, ctx: Any) -> LookupResult:
        return LookupResult.HIT

    def on_new_request(self, ctx: Any) -> None:
        pass

    def on_request_finished(self, ctx: Any) -> None:
        pass

    def create_store_job(self, keys: list[bytes], ctx: Any) -> TransferJob:
        self.pinned += len(keys)
        return TransferJob(next(self._ids), list(keys), list(range(len(keys))), False, ctx=ctx)


class QueueFullAfter:
    """A control plane whose queue to the peer is full from the ``n``-th message on."""

    def __init__(self, n: int) -> None:
        self.sent: list[p.Message] = []
        self.n = n

    def send(self, peer: str, msg: p.Message) -> bool:
        self.sent.append(msg)
        return len(self.sent) < self.n

    def drop(self, peer: str) -> None:
        pass

    def statistics(self) -> Any:
        return types.SimpleNamespace(messages_rejected={}, connections_refused={})


def test_a_session_that_dies_while_its_lookups_are_answered_keeps_nothing_pinned() -> None:
    tier = make_tier()
    producer = tier.producer
    tier.planes.control = QueueFullAfter(2)  # type: ignore[assignment]
    producer.served["peer:1"] = Served("peer:1", b"t" * 32)
    for i in range(4):
        producer.on_lookup("peer:1", p.Lookup(kv_request_id=f"r{i}", keys=[bytes([i]) * 36], round_seq=0))
    tier.serve_external_requests(Parent())  # type: ignore[arg-type]
    assert not producer.serves("peer:1")  # the second answer found the queue full: session reaped
    assert producer.parked == {} and producer.bound == {} and producer.lookup_pins == 0
    assert not tier.has_open_jobs  # every store job it pinned was finished (pins released)


class Scope:
    """The cancel scope of a fetch that is sending."""

    cancel_called = False

    def cancel(self) -> None:
        self.cancel_called = True


def test_a_terminal_fetch_lets_the_sends_still_completing_finish() -> None:
    """The consumer has every chunk and sends its terminal fetch while the producer's send
    completions are still on their way: the sends are not cancelled (a cancelled send closes the
    consumer's link), the release waits for them. A failure still cancels them."""
    tier = make_tier()
    producer = tier.producer
    producer.served["peer:1"] = served = Served("peer:1", b"t" * 32)
    producer.bound["pd"] = "peer:1"
    served.fetching[("pd", 0)] = sending = Scope()  # type: ignore[assignment]
    producer._sending["pd"] = 1  # one fetch of "pd" is sending from its slots
    producer.on_fetch("peer:1", p.Fetch(kv_request_id="pd", keys=[], block_indexes=[], round_seq=1))
    assert not sending.cancel_called
    assert producer._release_after["pd"] == (True, "")  # released once the sends stop

    producer.bound["pd2"] = "peer:1"
    served.fetching[("pd2", 0)] = failing = Scope()  # type: ignore[assignment]
    producer._sending["pd2"] = 1
    producer._release("pd2", False, "peer_lost")
    assert failing.cancel_called

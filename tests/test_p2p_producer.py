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
from kvtier.tiers.p2p.tier import P2PTier, _Served
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
    tier._control = QueueFullAfter(2)  # type: ignore[assignment]
    tier._served["peer:1"] = _Served("peer:1", b"t" * 32)
    for i in range(4):
        tier._on_lookup("peer:1", p.Lookup(kv_request_id=f"r{i}", keys=[bytes([i]) * 36], round_seq=0))
    tier.serve_external_requests(Parent())  # type: ignore[arg-type]
    assert "peer:1" not in tier._served  # the second answer found the queue full: session reaped
    assert tier._parked == {} and tier._bound == {} and tier._lookup_pins == 0
    assert not tier._unfinished  # every store job it pinned was finished (pins released)

"""Warm-up from a p2p peer: ``Engine.prefetch`` with ``remote_kv_source`` promotes a peer's chunks.

The producer is a separate process (``tests/support/p2p_peer.py``) holding a prompt in its memory
tier only; the consumer is an engine in this process (asyncio: the p2p tier requires it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from p2p_peer import BLOCK, DIM, HEADS, LAYERS, NUM_BLOCKS, SLOT_BYTES, block_content, geometry, tokens_of
from s3server import free_port

import kvtier
from kvtier.engine.prefetch import PrefetchOutcome

pytestmark = pytest.mark.ucxx  # required: see tests/conftest.py

PEER = Path(__file__).resolve().parents[1] / "support" / "p2p_peer.py"
TOKENS = 64  # 16 chunks of one block


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the p2p tier runs on asyncio only


class Producer:
    """The peer process, driven one command at a time (its answers are the ``@@ `` lines)."""

    def __init__(self, tiers: list[dict[str, Any]]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), json.dumps({"tiers": tiers})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self._next().get("event") == "ready"

    def _next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])  # type: ignore[no-any-return]
        raise AssertionError("the producer exited")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": 0, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._next()
        assert "error" not in answer, answer
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def producer() -> Iterator[tuple[Producer, int]]:
    port = free_port()
    peer = Producer([{"type": "p2p", "host": "127.0.0.1", "port": port},
                     {"type": "memory", "capacity_bytes": 8 << 20}])
    try:
        yield peer, port
    finally:
        peer.close()


@pytest.mark.anyio
async def test_prefetch_from_a_peer_then_the_load_is_served_from_host_memory(producer: tuple[Producer, int]) -> None:
    peer, port = producer
    assert peer.call("store", prompt=40, tokens=TOKENS)["stored"] == TOKENS  # an ordinary request
    peer.call("drop_host")  # now only the producer's memory tier holds it
    kv = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]
    settings = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * SLOT_BYTES,
                "secondary_tiers": [{"type": "p2p", "host": "127.0.0.1", "port": free_port(), "lookup_timeout_s": 10}]}
    source = {"remote_kv_source": {"kv_request_id": "warm-1", "remote_host": "127.0.0.1", "remote_port": port}}
    tokens = tokens_of(40, TOKENS)
    async with kvtier.open(settings, geometry(), kv, flush_timeout_s=1.0) as engine:
        outcome = await engine.prefetch(tokens, source, deadline_s=20)
        assert outcome == PrefetchOutcome(TOKENS, {"1:p2p": TOKENS // BLOCK}, 0, False)
        loaded = await engine.load_with_sources(tokens, list(range(TOKENS // BLOCK)))  # no peer named
        assert loaded.tokens == TOKENS and loaded.tokens_by_tier == {"0:primary": TOKENS}
        assert all(torch.equal(kv[layer][b], content)
                   for b in range(TOKENS // BLOCK) for layer, content in enumerate(block_content(40, b)))
        # An unknown prefix: the peer answers misses, nothing is promoted, nothing hangs.
        other = {"remote_kv_source": {**source["remote_kv_source"], "kv_request_id": "warm-2"}}
        assert await engine.prefetch(tokens_of(41, TOKENS), other, deadline_s=20) == PrefetchOutcome(0, {}, 0, False)
        assert engine.statistics()["0:primary"].pinned_slots == 0

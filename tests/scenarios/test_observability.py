"""Observability end to end: KV events and Prometheus metrics of a real engine (``kvtier.open``).

Nothing here uses kvtier's own decoders or fake snapshots. The event tests read the publisher's
frames with a plain ``zmq.SUB`` socket (and replay them with a plain ``zmq.DEALER``) and decode
payloads with ``msgpack``; the metrics test scrapes ``/metrics`` over HTTP and parses it with
``prometheus_client``'s text parser. The workloads are scripted so that every event and every
counter value is known in advance.

Subscription handshake: a PUB socket drops what it sends before a subscriber's subscription has
arrived, so each event test first calls ``engine.reset_cache()`` (which publishes one
``AllBlocksCleared`` batch) until the SUB socket receives a batch; every later batch must then
arrive. A final ``reset_cache()`` is the end marker: batches are sent in order, so once its
batch arrived every batch of the workload has too.
"""

from __future__ import annotations

import hashlib
import random
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier import KVGeometry
from kvtier.keys import BlockHasher, split_offload_key
from kvtier.layout import namespace
from kvtier.tiers.integrity import stored_size

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 16
HASH_MASK = 2**64 - 1
TOPIC = b"kvtier-test"
#: Bound on any wait for a frame or a scrape; a correct engine answers in milliseconds.
GUARD_S = 10.0


# ------------------------------------------------------------------------------------------------
# engine helpers
# ------------------------------------------------------------------------------------------------


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.ones((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


SLOT_BYTES = geometry().slot_bytes(1)  # one chunk = one device block unless the config says otherwise
CHUNK_BYTES = geometry().chunk_bytes(1)  # what a device ↔ host copy of one chunk moves


def prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(tokens)] for _ in range(n)]


def fs_tier(root: Path, **over: Any) -> dict[str, Any]:
    tier: dict[str, Any] = {
        "type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2,
        "rescan_interval_s": 3600.0,  # no background rescan may race the scripted workload
    }
    tier.update(over)
    return tier


def tiering_config(host_slots: int, tiers: list[dict[str, Any]], slot_bytes: int = SLOT_BYTES,
                   **over: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": host_slots * slot_bytes,
        "secondary_tiers": tiers,
    }
    config.update(over)
    return config


def events_config(**over: Any) -> dict[str, Any]:
    # "*" makes the publisher bind (vLLM's rule); the port is ephemeral, read back from the publisher.
    cfg: dict[str, Any] = {
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": TOPIC.decode(),
    }
    cfg.update(over)
    return cfg


def h64(block_hash: bytes) -> int:
    """The published (default, integer) form of a hash, written out as the issue states it."""
    return int.from_bytes(block_hash, "big") & HASH_MASK


def key_hash(key: bytes) -> int:
    return h64(split_offload_key(key)[0])


# ------------------------------------------------------------------------------------------------
# plain ZMQ subscriber and replay client
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    seq: int
    payload: bytes

    @property
    def decoded(self) -> list[Any]:
        return msgpack.unpackb(self.payload, raw=False)

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.decoded[1]


class Subscriber:
    """A plain ``zmq.SUB`` socket, read without blocking the event loop."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)
        self.batches: list[Batch] = []

    async def receive(self, timeout_s: float) -> Batch | None:
        """The next batch, or None after ``timeout_s``; checks the frame shape of every message."""
        with anyio.move_on_after(timeout_s):
            while not self.sock.poll(0):
                await anyio.sleep(0.002)
            frames = self.sock.recv_multipart()
            assert len(frames) == 3, f"expected (topic, seq, payload), got {len(frames)} frames"
            topic, seq, payload = frames
            assert topic == TOPIC and len(seq) == 8
            batch = Batch(int.from_bytes(seq, "big"), payload)
            self.batches.append(batch)
            return batch
        return None

    def close(self) -> None:
        self.sock.close()


async def handshake(engine: Any, sub: Subscriber) -> int:
    """Publish ``AllBlocksCleared`` through the engine until ``sub`` gets one; returns how many."""
    with anyio.fail_after(GUARD_S):
        resets = 0
        while True:
            await engine.reset_cache()
            resets += 1
            if await sub.receive(0.05) is not None:
                return resets


async def end_marker(engine: Any, sub: Subscriber, resets: int) -> int:
    """Publish one last ``AllBlocksCleared`` and receive everything up to it; returns its seq.

    Handshake batches have ``seq < resets``; after them only this sentinel clears the cache.
    """
    await engine.reset_cache()
    with anyio.fail_after(GUARD_S):
        while True:
            batch = await sub.receive(GUARD_S)
            assert batch is not None
            if batch.seq >= resets and batch.events == [{"type": "AllBlocksCleared"}]:
                return batch.seq


def replay(endpoint: str, start_seq: int) -> list[Batch]:
    """Ask the ROUTER for every buffered batch from ``start_seq`` (blocking; run in a thread)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out: list[Batch] = []
        while True:
            if not dealer.poll(int(GUARD_S * 1000)):
                raise AssertionError("replay: no end marker")
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            _, topic, seq, payload = frames
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                return out
            assert topic == TOPIC
            out.append(Batch(int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()
        ctx.term()


@contextmanager
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.term()


def check_batch_shapes(batches: Sequence[Batch], t_start: float, t_end: float) -> None:
    """msgpack array ``[ts, [events…], data_parallel_rank]``, events non-empty maps tagged ``type``."""
    for batch in batches:
        decoded = batch.decoded
        assert isinstance(decoded, list) and len(decoded) == 3, decoded
        ts, events, dp_rank = decoded
        assert isinstance(ts, float) and t_start - 1.0 <= ts <= t_end + 1.0
        assert dp_rank == 0
        assert isinstance(events, list) and events, "an empty batch must never be published"
        for event in events:
            assert isinstance(event, dict)
            assert event["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def workload_events(batches: Sequence[Batch], first_seq: int, last_seq: int) -> list[dict[str, Any]]:
    return [e for b in batches if first_seq <= b.seq < last_seq for e in b.events]


def stored(hashes: list[int], medium: str, **extra: Any) -> dict[str, Any]:
    """A placeholder BlockStored as it appears on the wire (None-valued optionals omitted)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0, **extra}


def removed(hashes: list[int], medium: str, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0, **extra}


FS = {"locality": "LOCAL", "ownership": "1:fs"}


# ------------------------------------------------------------------------------------------------
# events
# ------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_published_events_match_stores_evictions_and_corrupt_removals(tmp_path: Path) -> None:
    # Host: 2 slots. fs: room for exactly 3 chunk files. Five single-chunk prompts are stored one
    # after the other (each cascade drained), so both tiers evict in a known order.
    tiers = [fs_tier(tmp_path, max_bytes=3 * stored_size(SLOT_BYTES), enable_kv_events=True, locality="LOCAL")]
    config = tiering_config(2, tiers)
    ps = prompts(5, BLOCK, seed=21)
    t_start = time.time()
    with zmq_context() as zctx:
        async with kvtier.open(config, geometry(), device_kv(), events=events_config()) as engine:
            pub = engine.publisher
            sub = Subscriber(zctx, pub.last_endpoint)
            try:
                resets = await handshake(engine, sub)
                keys = [engine.chunk_keys(p)[0] for p in ps]
                h = [key_hash(k) for k in keys]
                for i, p in enumerate(ps):
                    assert await engine.store(p, [i]) == BLOCK
                    await engine.drain()
                # Chunk 2 is now only on disk (host holds 3 and 4). Damage its file, then load it:
                # the fs tier must reject and remove it, and the load must recompute (0 tokens).
                ns = namespace(str(tmp_path), geometry().run_fields(1), 0)
                path = Path(ns.chunk_path(keys[2]))
                data = bytearray(path.read_bytes())
                data[100] ^= 0xFF
                path.write_bytes(bytes(data))
                assert await engine.load(ps[2], [10]) == 0
                assert not path.exists()
                # Chunk 3 was evicted from host memory to make room for that promotion; it comes
                # back from disk.
                assert await engine.load(ps[3], [11]) == BLOCK
                last = await end_marker(engine, sub, resets)
                replayed = await anyio.to_thread.run_sync(replay, pub.last_replay_endpoint, 0)
                tail = await anyio.to_thread.run_sync(replay, pub.last_replay_endpoint, last - 1)
            finally:
                sub.close()
    t_end = time.time()

    # Sequence numbers count batches from 0; the replay holds every one; live frames are a
    # contiguous run (the earliest may precede the subscription) equal byte for byte.
    assert [b.seq for b in replayed] == list(range(last + 1))
    assert [b.seq for b in tail] == [last - 1, last]
    live = sub.batches
    assert [b.seq for b in live] == list(range(live[0].seq, last + 1))
    assert live[0].seq < resets
    by_seq = {b.seq: b.payload for b in replayed}
    assert all(b.payload == by_seq[b.seq] for b in live + tail)
    check_batch_shapes(replayed, t_start, t_end)
    assert all(b.events == [{"type": "AllBlocksCleared"}] for b in replayed[:resets])

    assert workload_events(replayed, resets, last) == [
        stored([h[0]], "CPU"), stored([h[0]], "STORAGE", **FS),
        stored([h[1]], "CPU"), stored([h[1]], "STORAGE", **FS),
        # host full: the least recently used chunk makes room
        removed([h[0]], "CPU"), stored([h[2]], "CPU"), stored([h[2]], "STORAGE", **FS),
        # fs full too (max_bytes = 3 files): its oldest file is evicted before the new one is written
        removed([h[1]], "CPU"), stored([h[3]], "CPU"), removed([h[0]], "STORAGE", **FS), stored([h[3]], "STORAGE", **FS),
        removed([h[2]], "CPU"), stored([h[4]], "CPU"), removed([h[1]], "STORAGE", **FS), stored([h[4]], "STORAGE", **FS),
        # load of chunk 2: a host slot is freed for the promotion, the file is corrupt (removed from
        # STORAGE) and the promotion's slot is released again (a failed store, removed from CPU)
        removed([h[3]], "CPU"), removed([h[2]], "CPU"), removed([h[2]], "STORAGE", **FS),
        # load of chunk 3: promoted from disk back into host memory
        stored([h[3]], "CPU"),
    ]


@pytest.mark.anyio
async def test_self_describing_events_carry_block_hashes_parent_and_tokens(tmp_path: Path) -> None:
    # Offload blocks of 2 device blocks: every chunk is made of two block hashes.
    bpc = 2
    slot_bytes = geometry().slot_bytes(bpc)
    tiers = [fs_tier(tmp_path, enable_kv_events=True, locality="LOCAL")]
    config = tiering_config(2, tiers, slot_bytes=slot_bytes, block_size=bpc * BLOCK,
                            self_describing_kv_events=True)
    first, second = prompts(2, 2 * bpc * BLOCK, seed=33)
    second = second[: bpc * BLOCK]
    hasher = BlockHasher("sha256", BLOCK)
    a = [h64(x) for x in hasher.hash_blocks(first)]  # 4 block hashes: chunks [a0 a1] and [a2 a3]
    b = [h64(x) for x in hasher.hash_blocks(second)]  # 2 block hashes: one chunk
    with zmq_context() as zctx:
        async with kvtier.open(config, geometry(), device_kv(), events=events_config()) as engine:
            pub = engine.publisher
            sub = Subscriber(zctx, pub.last_endpoint)
            try:
                resets = await handshake(engine, sub)
                # a chunk's key is the offload key of its last block
                assert [key_hash(k) for k in engine.chunk_keys(first)] == [a[1], a[3]]
                assert await engine.store(first, [0, 1, 2, 3]) == 2 * bpc * BLOCK
                await engine.drain()
                # Host memory holds two chunks: storing a third evicts one of the first prompt's.
                assert await engine.store(second, [4, 5]) == bpc * BLOCK
                await engine.drain()
                last = await end_marker(engine, sub, resets)
                replayed = await anyio.to_thread.run_sync(replay, pub.last_replay_endpoint, 0)
            finally:
                sub.close()

    def described(hashes: list[int], parent: int | None, tokens: list[int], medium: str,
                  **extra: Any) -> dict[str, Any]:
        # Self-describing events name the group's kind, as vLLM's do (no window: full attention).
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": BLOCK, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention", **extra}

    events = workload_events(replayed, resets, last)
    chunk0 = described(a[0:2], None, first[0:8], "CPU")
    chunk1 = described(a[2:4], a[1], first[8:16], "CPU")
    assert events[:4] == [chunk0, chunk1, {**chunk0, "medium": "STORAGE", **FS}, {**chunk1, "medium": "STORAGE", **FS}]
    eviction, *rest = events[4:]
    # The removal fans out to the evicted chunk's constituent block hashes.
    assert eviction["type"] == "BlockRemoved" and eviction["medium"] == "CPU"
    assert eviction["block_hashes"] in (a[0:2], a[2:4])
    assert eviction == removed(eviction["block_hashes"], "CPU")
    assert rest == [described(b, None, second, "CPU"), described(b, None, second, "STORAGE", **FS)]


@pytest.mark.anyio
async def test_self_describing_events_carry_each_blocks_extra_keys_as_vllm_publishes_them() -> None:
    # Chunks of two blocks of BLOCK (4) tokens; every request is 16 tokens: two chunks.
    bpc = 2
    slot_bytes = geometry().slot_bytes(bpc)
    config = tiering_config(16, [], slot_bytes=slot_bytes, block_size=bpc * BLOCK, self_describing_kv_events=True)
    (prompt,) = prompts(1, 16, seed=44)
    embeds = torch.randn((16, 8), generator=torch.Generator().manual_seed(5))
    requests: dict[str, tuple[list[int], dict[str, Any]]] = {
        "plain": (prompt, {}),
        "salted": (prompt, {"cache_salt": "tenant-a"}),
        "lora": (prompt, {"lora_name": "sql", "lora_path": "/adapters/sql"}),
        # placeholder tokens [2, 10): blocks 0, 1 and 2 (offsets relative to each block's start)
        "mm": (prompt, {"mm_items": [("img-1", 2, 8)]}),
        # vLLM's token ids for a prompt given as embeddings: 0 at every position
        "embeds": ([0] * 16, {"prompt_embeds": embeds, "cache_salt": "tenant-a", "lora_name": "sql",
                              "lora_path": "/adapters/sql"}),
    }
    with zmq_context() as zctx:
        async with kvtier.open(config, geometry(), device_kv(), events=events_config()) as engine:
            pub = engine.publisher
            sub = Subscriber(zctx, pub.last_endpoint)
            try:
                resets = await handshake(engine, sub)
                chunk_of: dict[int, tuple[str, int]] = {}  # a chunk's key hash: its last block's hash
                for name, (tokens, extras) in requests.items():
                    for i, key in enumerate(engine.chunk_keys(tokens, **extras)):
                        chunk_of[key_hash(key)] = (name, i)
                    assert await engine.store(tokens, [0, 1, 2, 3], **extras) == 16
                last = await end_marker(engine, sub, resets)
                replayed = await anyio.to_thread.run_sync(replay, pub.last_replay_endpoint, 0)
            finally:
                sub.close()

    events = workload_events(replayed, resets, last)
    assert [e["type"] for e in events] == ["BlockStored"] * 10 and all(e["medium"] == "CPU" for e in events)
    by_request: dict[str, list[dict[str, Any]]] = {name: [{}, {}] for name in requests}
    for event in events:
        name, i = chunk_of[event["block_hashes"][-1]]
        by_request[name][i] = event
    digest = [hashlib.sha256(embeds[i : i + BLOCK].numpy().tobytes()).digest() for i in range(0, 16, BLOCK)]
    # msgpack decodes vLLM's tuples as lists and a digest as bytes; None-valued extra_keys are omitted.
    expected = {
        "plain": [None, None],
        "salted": [[["tenant-a"], None], [None, None]],
        "lora": [[["sql"], ["sql"]], [["sql"], ["sql"]]],
        "mm": [[[["img-1", 2]], [["img-1", -2]]], [[["img-1", -6]], None]],
        "embeds": [[["sql", "tenant-a", digest[0]], ["sql", digest[1]]],
                   [["sql", digest[2]], ["sql", digest[3]]]],
    }
    for name, chunks in expected.items():
        got = [event.get("extra_keys") for event in by_request[name]]
        assert got == chunks, name
        assert {event["lora_name"] for event in by_request[name]} == {"sql" if "lora_name" in requests[name][1] else None}



@pytest.mark.anyio
async def test_full_event_queue_drops_batches_without_blocking_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """No subscriber, a one-batch queue: stores never wait for the publisher; drops are counted.

    8 concurrent requests store 400 prompts of 256 chunks (over 100,000 events in all). Batches
    are offered faster than the publisher thread takes them (a store offers its evictions and its
    stored chunks, often in the same event-loop turn as other stores), so a one-batch queue
    overflows. The engine's ``publish`` calls are counted (the real method is still called) to check that every
    offered batch ends up published or dropped.
    """
    chunks = 256  # chunks per prompt: one BlockStored each, plus one BlockRemoved per eviction
    # Room for every worker's chunks at once: a store that found every slot still being written
    # would place fewer tokens, and this test counts them.
    config = {"cpu_bytes_to_use": 8 * 2 * chunks * SLOT_BYTES}
    # One distinct device block per chunk (a call's block ids must be distinct); the concurrent
    # stores share them, which is fine: stores only read device blocks.
    blocks = list(range(chunks))
    kv = [torch.ones((chunks, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]
    tokens = chunks * BLOCK
    all_prompts = [list(range(i * tokens + 1, (i + 1) * tokens + 1)) for i in range(400)]  # all distinct
    offered = {"batches": 0, "events": 0, "refused": 0}
    stored_tokens = 0
    async with kvtier.open(config, geometry(), kv, events=events_config(max_queue_size=1)) as engine:
        pub = engine.publisher
        real_publish = pub.publish

        def counting_publish(events: Sequence[Any], ts: float | None = None) -> bool:
            if events:
                offered["batches"] += 1
                offered["events"] += len(events)
            accepted = real_publish(events, ts)
            offered["refused"] += not accepted
            return accepted

        monkeypatch.setattr(pub, "publish", counting_publish)

        async def worker(mine: Sequence[list[int]]) -> None:
            nonlocal stored_tokens
            for p in mine:
                n = await engine.store(p, blocks)  # not `+= await`: that would read the total before awaiting
                stored_tokens += n

        async with anyio.create_task_group() as tg:
            for w in range(8):
                tg.start_soon(worker, all_prompts[w::8])
    stats = pub.statistics()
    assert stored_tokens == len(all_prompts) * chunks * BLOCK  # every store completed
    assert offered["events"] >= 100_000
    assert stats.dropped_batches > 0
    assert offered["refused"] > 0  # publish said so to the engine, without blocking it
    # After close every offered batch was either sent or dropped, never lost silently.
    assert stats.published_batches + stats.dropped_batches == offered["batches"]
    assert stats.queue_depth == 0 and stats.sequence == stats.published_batches


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """GET /metrics and index every sample by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=GUARD_S) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def tier_values(samples: Samples, tier: str) -> dict[str, float]:
    names = {
        "queries": "kvtier_kv_offload_tiering_chunk_queries_total",
        "hits": "kvtier_kv_offload_tiering_chunk_hits_total",
        "read_bytes": "kvtier_kv_offload_tiering_read_bytes_total",
        "write_bytes": "kvtier_kv_offload_tiering_write_bytes_total",
        "evictions": "kvtier_tier_evictions_total",
    }
    return {short: value(samples, name, tier=tier) for short, name in names.items()
            if (name, frozenset({("tier", tier)})) in samples}


@pytest.mark.anyio
async def test_scraped_metrics_count_the_scripted_workload_exactly(tmp_path: Path) -> None:
    """Exact per-tier counters after a known workload; a second engine has its own registry.

    fs lookups count once per resolved answer: a chunk promoted from disk is 1 query and 1 hit;
    a chunk found nowhere is 1 query (after the probe; the pending RETRY is not counted). The
    primary tier's query counting has its own test below.
    """
    ps = prompts(6, BLOCK, seed=41)
    unknown = prompts(1, BLOCK, seed=42)[0]
    config_a = tiering_config(4, [fs_tier(tmp_path)])
    config_b = {"cpu_bytes_to_use": 8 * SLOT_BYTES}
    async with (
        kvtier.open(config_a, geometry(), device_kv(), metrics={"host": "127.0.0.1", "port": 0}) as a,
        kvtier.open(config_b, geometry(), device_kv(), metrics={"host": "127.0.0.1", "port": 0}) as b,
    ):
        # Engine A: 6 stores (each cascaded to fs, drained so nothing is in flight) into 4 host slots.
        for i, p in enumerate(ps):
            assert await a.store(p, [i]) == BLOCK
            await a.drain()
        # host holds ps[2:6]; fs holds all six
        assert await a.load(ps[5], [8]) == BLOCK  # host hit
        assert await a.load(ps[4], [9]) == BLOCK  # host hit
        assert await a.load(ps[0], [10]) == BLOCK  # promoted from fs (evicts ps[2] from host)
        assert await a.load(ps[1], [11]) == BLOCK  # promoted from fs (evicts ps[3] from host)
        assert await a.load(unknown, [12]) == 0  # nowhere
        await a.drain()
        # Engine B: host only, 3 of 8 slots used.
        for i, p in enumerate(ps[:3]):
            assert await b.store(p, [i]) == BLOCK
        assert await b.load(ps[0], [8]) == BLOCK
        assert a.metrics_server.port != b.metrics_server.port
        samples_a = await anyio.to_thread.run_sync(scrape, a.metrics_server.port)
        samples_b = await anyio.to_thread.run_sync(scrape, b.metrics_server.port)

    assert value(samples_a, "kvtier_tier_evictions_total", tier="0:primary") == 4
    assert tier_values(samples_a, "1:fs") == {
        "queries": 3, "hits": 2, "read_bytes": 2 * SLOT_BYTES, "write_bytes": 6 * SLOT_BYTES, "evictions": 0,
    }
    assert value(samples_a, "kvtier_tier_info", tier="1:fs", type="fs") == 1
    assert value(samples_a, "kvtier_tier_stores_completed_total", tier="1:fs") == 6
    assert value(samples_a, "kvtier_tier_loads_completed_total", tier="1:fs") == 2
    assert value(samples_a, "kvtier_kv_offload_tiering_promotion_latency_seconds_count",
                 tier="1:fs", result="success") == 2
    assert value(samples_a, "kvtier_host_slots") == 4
    assert value(samples_a, "kvtier_host_slot_bytes") == SLOT_BYTES
    assert value(samples_a, "kvtier_host_used_slots") == 4
    assert value(samples_a, "kvtier_host_fill_ratio") == 1.0
    assert value(samples_a, "kvtier_host_pinned_slots") == 0
    assert value(samples_a, "kvtier_kv_offload_store_bytes_total") == 6 * CHUNK_BYTES
    assert value(samples_a, "kvtier_kv_offload_load_bytes_total") == 4 * CHUNK_BYTES
    assert value(samples_a, "kvtier_kv_offload_store_size_count") == 6
    assert value(samples_a, "kvtier_kv_offload_load_size_count") == 4

    # Engine B's registry knows nothing of engine A (no fs tier, its own counts).
    assert not any(dict(labels).get("tier") == "1:fs" for _, labels in samples_b)
    assert tier_values(samples_b, "0:primary") == {"queries": 1, "hits": 1, "evictions": 0}  # one host hit
    assert value(samples_b, "kvtier_host_slots") == 8
    assert value(samples_b, "kvtier_host_used_slots") == 3
    assert value(samples_b, "kvtier_host_fill_ratio") == 3 / 8
    assert value(samples_b, "kvtier_kv_offload_store_bytes_total") == 3 * CHUNK_BYTES
    assert value(samples_b, "kvtier_kv_offload_load_bytes_total") == 1 * CHUNK_BYTES


@pytest.mark.anyio
async def test_primary_chunk_queries_count_each_key_once_per_request(tmp_path: Path) -> None:
    """``0:primary`` queries/hits follow vLLM: each (tier, key) counted once per request.

    A load request asks the host tier about its chunk once, whatever the engine does while it
    waits (a promotion from disk, a probe of the fs tier): a chunk promoted from disk is one
    primary query that missed — its later HIT_PENDING/HIT re-lookups are not more queries nor a
    host hit — and a chunk found nowhere is one primary query, however many times the engine
    re-asks while the fs probe runs. Otherwise the primary hit rate counts promoted chunks as
    host hits and depends on how often a waiting request happens to be woken.
    """
    ps = prompts(2, BLOCK, seed=51)
    unknown = prompts(1, BLOCK, seed=52)[0]
    config = tiering_config(1, [fs_tier(tmp_path)])
    async with kvtier.open(config, geometry(), device_kv(), metrics={"host": "127.0.0.1", "port": 0}) as engine:
        for i, p in enumerate(ps):
            assert await engine.store(p, [i]) == BLOCK
            await engine.drain()
        # one host slot: ps[1] is in host memory, ps[0] only on disk
        assert await engine.load(ps[1], [4]) == BLOCK  # 1 primary query, 1 hit
        assert await engine.load(ps[0], [5]) == BLOCK  # 1 primary query (miss), 1 fs query + hit
        assert await engine.load(unknown, [6]) == 0  # 1 primary query (miss), 1 fs query (miss)
        samples = await anyio.to_thread.run_sync(scrape, engine.metrics_server.port)
    assert tier_values(samples, "1:fs") == {
        "queries": 2, "hits": 1, "read_bytes": SLOT_BYTES, "write_bytes": 2 * SLOT_BYTES, "evictions": 0,
    }
    # evictions: storing ps[1] evicted ps[0]; promoting ps[0] evicted ps[1]
    assert tier_values(samples, "0:primary") == {"queries": 3, "hits": 1, "evictions": 2}

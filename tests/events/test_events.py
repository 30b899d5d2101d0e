"""Specification of kvtier.events (wire structs, translation, the ZMQ publisher) and of the
``kvtier events`` command (kvtier.ops.events_cmd).

Frames are decoded with plain ``zmq`` sockets and ``msgpack``, never with kvtier's own decoder,
so the tests check compatibility with a vLLM-style consumer rather than a round trip.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import threading
import tracemalloc

import anyio
import msgpack
import msgspec
import pytest
import torch
import zmq

from kvtier.errors import ConfigError
from kvtier.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkMetadata,
    EventTranslator,
    KVEventBatch,
    ZmqEventPublisher,
    event_extra_keys,
    external_hash,
    offset_endpoint_for_rank,
    publisher_from_config,
)
from kvtier.keys import NO_EXTRA_KEYS, RequestExtraKeys, make_offload_key
from kvtier.ops.events_cmd import run_events_cli
from kvtier.types import Locality, Medium, OffloadingEvent

if sys.version_info < (3, 11):  # pragma: no cover - the builtin arrived in 3.11
    from exceptiongroup import BaseExceptionGroup

H1 = bytes(range(32))
H2 = bytes(range(100, 132))
H3 = bytes(range(200, 232))
K1 = make_offload_key(H1, 0)
K2 = make_offload_key(H2, 0)
K3 = make_offload_key(H3, 1)
MASK = 2**64 - 1


def as_int(h: bytes) -> int:
    return int.from_bytes(h, "big") & MASK


def cpu_stored(*keys: bytes) -> OffloadingEvent:
    return OffloadingEvent(keys=list(keys), medium="CPU", removed=False)


def cpu_evicted(*keys: bytes) -> OffloadingEvent:
    return OffloadingEvent(keys=list(keys), medium="CPU", removed=True, reason="evicted")


def fs_event(*keys: bytes, removed: bool = False, reason: str | None = None) -> OffloadingEvent:
    return OffloadingEvent(
        keys=list(keys), medium=Medium.STORAGE, removed=removed, locality=Locality.LOCAL, ownership="1:fs", reason=reason
    )


# ---------------------------------------------------------------------------------- structs


def test_batch_encodes_exactly_like_the_reference_example() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([123], None, [1, 2], 16, None, "CPU", None, group_idx=0),
            BlockRemoved([5], "STORAGE"),
        ],
        data_parallel_rank=0,
    )
    decoded = msgpack.unpackb(msgspec.msgpack.encode(batch))
    assert decoded == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [123],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 16,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "STORAGE"},
        ],
        0,
    ]
    assert list(decoded[1][0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "group_idx",
    ]


def test_all_blocks_cleared_is_a_bare_tagged_map() -> None:
    assert msgpack.unpackb(msgspec.msgpack.encode(AllBlocksCleared())) == {"type": "AllBlocksCleared"}


def test_external_hash_is_the_last_eight_bytes_as_unsigned_int_or_raw_bytes() -> None:
    assert external_hash(H1) == int.from_bytes(H1[-8:], "big")
    assert external_hash(b"\xff" * 32) == MASK
    assert external_hash(H1, int_hashes=False) == H1


# ------------------------------------------------------------------------------ translation


def test_placeholder_store_is_one_block_stored_per_key_with_group_from_the_key() -> None:
    events = EventTranslator(self_describing=False).translate([cpu_stored(K1, K3)])
    assert events == [
        BlockStored([as_int(H1)], None, [], 0, None, "CPU", None, group_idx=0),
        BlockStored([as_int(H3)], None, [], 0, None, "CPU", None, group_idx=1),
    ]


def test_placeholder_removal_is_one_block_removed_per_group() -> None:
    events = EventTranslator(self_describing=False).translate([cpu_evicted(K1, K3, K2)])
    assert events == [
        BlockRemoved([as_int(H1), as_int(H2)], "CPU", group_idx=0),
        BlockRemoved([as_int(H3)], "CPU", group_idx=1),
    ]


def test_storage_events_carry_medium_locality_and_ownership_as_plain_strings() -> None:
    stored, removed = EventTranslator(self_describing=False).translate(
        [fs_event(K1), fs_event(K1, removed=True, reason="corrupt")]
    )
    assert (stored.medium, stored.locality, stored.ownership) == ("STORAGE", "LOCAL", "1:fs")
    assert type(stored.medium) is str and type(stored.locality) is str
    assert removed == BlockRemoved([as_int(H1)], "STORAGE", group_idx=0, locality="LOCAL", ownership="1:fs")


def test_raw_byte_hashes_when_int_hashes_is_off() -> None:
    (event,) = EventTranslator(self_describing=False, int_hashes=False).translate([cpu_stored(K1)])
    assert event.block_hashes == [H1]


def test_events_without_keys_are_dropped_but_metadata_only_removals_with_keys_are_kept() -> None:
    translator = EventTranslator(self_describing=False)
    empty = OffloadingEvent(keys=[], medium="CPU", removed=True, metadata_only=True)
    failed = OffloadingEvent(keys=[K2], medium="CPU", removed=True, metadata_only=True, reason="failed_store")
    assert translator.translate([empty, cpu_stored()]) == []
    assert translator.translate([failed]) == [BlockRemoved([as_int(H2)], "CPU", group_idx=0)]


def _meta(first: bytes = H1) -> ChunkMetadata:
    return ChunkMetadata(
        block_hashes=[b"\x01" * 32, first], parent_block_hash=b"\x09" * 32, token_ids=[1, 2, 3, 4],
        block_size=2, lora_name="adapter", group_idx=0,
    )


def test_self_describing_store_carries_constituent_hashes_parent_tokens_and_lora() -> None:
    translator = EventTranslator(self_describing=True)
    translator.remember_chunk(K1, _meta())
    (event,) = translator.translate([cpu_stored(K1)])
    assert event == BlockStored(
        block_hashes=[as_int(b"\x01" * 32), as_int(H1)], parent_block_hash=as_int(b"\x09" * 32),
        token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="CPU", lora_name="adapter", group_idx=0,
    )


def test_event_extra_keys_are_vllms_untagged_per_block_entries() -> None:
    extras = RequestExtraKeys(cache_salt="t-1", lora_name="sql", lora_path="/adapters/sql",
                              mm_items=[("img", 2, 5)])
    # Per block, in vLLM's order: the LoRA name (not its path), (identifier, offset) per item,
    # the salt on block 0 only.
    assert event_extra_keys(extras.per_block(3, 4)) == [
        ("sql", ("img", 2), "t-1"), ("sql", ("img", -2)), ("sql",),
    ]
    embeds = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    digests = [hashlib.sha256(embeds[i : i + 2].numpy().tobytes()).digest() for i in (0, 2)]
    assert event_extra_keys(RequestExtraKeys(prompt_embeds=embeds).per_block(2, 2)) == [
        (digests[0],), (digests[1],),
    ]
    # A block without entries stays None; no per-block list at all publishes None.
    assert event_extra_keys(RequestExtraKeys(cache_salt="s").per_block(3, 4)) == [("s",), None, None]
    assert event_extra_keys(NO_EXTRA_KEYS.per_block(3, 4)) is None
    assert event_extra_keys([]) is None


def test_self_describing_store_publishes_the_chunks_extra_keys_as_vllm_encodes_them() -> None:
    translator = EventTranslator(self_describing=True)
    digest = bytes(range(32))
    keyed = (("lora", "sql", "/adapters/sql"), ("mm", "img", -3), ("cache_salt", "s"), ("prompt_embeds", digest))
    translator.remember_chunk(K1, ChunkMetadata(
        block_hashes=[b"\x01" * 32, H1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
        lora_name="sql", extra_keys=[keyed, None],
    ))
    translator.remember_chunk(K2, _meta(H2))  # no extra keys
    batch = KVEventBatch(ts=1.0, events=translator.translate([cpu_stored(K1, K2)]))
    keyed_event, plain_event = msgpack.unpackb(msgspec.msgpack.encode(batch))[1]
    # msgpack arrays for the tuples, bin for the digest; between lora_name and group_idx.
    assert keyed_event["extra_keys"] == [["sql", ["img", -3], "s", digest], None]
    assert list(keyed_event)[7:10] == ["lora_name", "extra_keys", "group_idx"]
    assert "extra_keys" not in plain_event  # None is omitted, as vLLM omits it


def test_chunk_metadata_needs_one_extra_keys_entry_per_block_hash() -> None:
    with pytest.raises(ValueError, match="extra_keys has 1 entries for 2 block hashes"):
        ChunkMetadata(block_hashes=[H1, H2], parent_block_hash=None, token_ids=[1, 2], block_size=1,
                      extra_keys=[None])


def test_self_describing_removal_fans_out_and_forgets_after_the_last_residency() -> None:
    translator = EventTranslator(self_describing=True)
    translator.remember_chunk(K1, _meta())
    translator.translate([cpu_stored(K1), fs_event(K1)])
    full = [as_int(b"\x01" * 32), as_int(H1)]
    assert translator.translate([cpu_evicted(K1)]) == [BlockRemoved(full, "CPU", group_idx=0)]
    assert len(translator) == 1  # still resident in 1:fs
    (gone,) = translator.translate([fs_event(K1, removed=True, reason="evicted")])
    assert gone.block_hashes == full
    assert len(translator) == 0
    # Forgotten: a later store of the same key is a placeholder again.
    (again,) = translator.translate([cpu_stored(K1)])
    assert again.block_hashes == [as_int(H1)] and again.block_size == 0


def test_self_describing_table_is_capped_oldest_first() -> None:
    translator = EventTranslator(self_describing=True, max_chunks=2)
    for key, h in ((K1, H1), (K2, H2), (K3, H3)):
        translator.remember_chunk(key, _meta(h))
    assert len(translator) == 2
    first, second = translator.translate([cpu_stored(K1, K2)])
    assert first.block_size == 0  # K1 was pushed out: placeholder
    assert second.block_size == 2


def test_remember_chunk_is_a_no_op_in_placeholder_mode() -> None:
    translator = EventTranslator(self_describing=False)
    translator.remember_chunk(K1, _meta())
    assert len(translator) == 0
    assert translator.translate([cpu_stored(K1)])[0].token_ids == []


def test_cleared_announces_all_blocks_cleared_and_forgets_every_chunk() -> None:
    translator = EventTranslator(self_describing=True)
    translator.remember_chunk(K1, _meta())
    assert translator.cleared() == [AllBlocksCleared()]
    assert len(translator) == 0


# ------------------------------------------------------------------------------ config


def test_publisher_from_config_applies_every_key() -> None:
    pub = publisher_from_config(
        {
            "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100", "buffer_steps": 5, "hwm": 7,
            "max_queue_size": 9, "topic": "kv", "data_parallel_rank": 2, "int_hashes": False,
            "max_queue_bytes": 4096,
        }
    )
    assert (pub.endpoint, pub.replay_endpoint) == ("tcp://*:6002", "tcp://*:6102")
    assert (pub.buffer_steps, pub.hwm, pub.max_queue_size, pub.topic) == (5, 7, 9, "kv")
    assert pub.max_queue_bytes == 4096
    assert pub.data_parallel_rank == 2 and pub.int_hashes is False


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"bogus": 1}, "events.bogus"),
        ({"buffer_steps": 0}, "events.buffer_steps"),
        ({"hwm": True}, "events.hwm"),
        ({"max_queue_size": "10"}, "events.max_queue_size"),
        ({"max_queue_bytes": "16MiB"}, "events.max_queue_bytes"),
        ({"max_queue_bytes": 0}, "events.max_queue_bytes"),
        ({"max_queue_bytes": True}, "events.max_queue_bytes"),
        ({"endpoint": "tcp://127.0.0.1:99999"}, "events.endpoint"),
        ({"endpoint": "tcp://300.1.1.1:5557"}, "events.endpoint"),
        ({"replay_endpoint": "ipc://"}, "events.replay_endpoint"),
        ({"endpoint": "http://x:1"}, "events.endpoint"),
        ({"int_hashes": 1}, "events.int_hashes"),
        ({"data_parallel_rank": -1}, "events.data_parallel_rank"),
    ],
)
def test_publisher_from_config_rejects_bad_keys_naming_them(cfg: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        publisher_from_config(cfg)


def test_endpoints_are_offset_by_data_parallel_rank() -> None:
    assert offset_endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_for_rank("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_for_rank("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"


# ------------------------------------------------------------------------------ publisher


def _recv(sock: zmq.Socket, timeout_ms: int = 2000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no message within the guard timeout"
    return sock.recv_multipart()


async def _wait_published(pub: ZmqEventPublisher, n: int) -> None:
    with anyio.fail_after(5):  # a guard against hanging, not a performance assertion
        while pub.statistics().published_batches < n:
            await anyio.sleep(0.005)


@pytest.mark.anyio
async def test_publisher_frames_decode_with_plain_zmq_and_msgpack_and_replay_from_zero() -> None:
    translator = EventTranslator(self_describing=False)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv", data_parallel_rank=0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(pub.run)
            assert pub.last_endpoint is not None and not pub.last_endpoint.endswith(":*")
            sub.connect(pub.last_endpoint)
            # PUB/SUB slow joiner: probe with AllBlocksCleared batches until one arrives.
            with anyio.fail_after(5):
                while True:
                    pub.publish([AllBlocksCleared()])
                    if sub.poll(20):
                        break
                    await anyio.sleep(0)

            batches = [
                translator.translate([cpu_stored(K1, K3)]),
                translator.translate([cpu_evicted(K1), fs_event(K2)]),
                translator.translate([fs_event(K2, removed=True, reason="corrupt")]),
            ]
            for batch in batches:
                assert pub.publish(batch)
            received = []
            while len(received) < 3:
                topic, seq, payload = _recv(sub)
                decoded = msgpack.unpackb(payload)
                if decoded[1] == [{"type": "AllBlocksCleared"}]:
                    continue  # a late probe
                assert topic == b"kv" and len(seq) == 8
                received.append((int.from_bytes(seq, "big"), decoded))

            seqs = [s for s, _ in received]
            assert seqs == list(range(seqs[0], seqs[0] + 3))
            for _, (ts, events, dp_rank) in received:
                assert isinstance(ts, float) and dp_rank == 0
            (_, (_, stored, _)), (_, (_, removed, _)), (_, (_, corrupt, _)) = received
            assert [e["block_hashes"] for e in stored] == [[as_int(H1)], [as_int(H3)]]
            assert [e["group_idx"] for e in stored] == [0, 1]
            assert all(e["type"] == "BlockStored" and e["medium"] == "CPU" for e in stored)
            assert removed == [
                {"type": "BlockRemoved", "block_hashes": [as_int(H1)], "medium": "CPU", "group_idx": 0},
                {
                    "type": "BlockStored", "block_hashes": [as_int(H2)], "parent_block_hash": None, "token_ids": [],
                    "block_size": 0, "lora_id": None, "medium": "STORAGE", "lora_name": None, "group_idx": 0,
                    "locality": "LOCAL", "ownership": "1:fs",
                },
            ]
            assert corrupt == [
                {"type": "BlockRemoved", "block_hashes": [as_int(H2)], "medium": "STORAGE", "group_idx": 0,
                 "locality": "LOCAL", "ownership": "1:fs"}
            ]

            # Replay from 0: the ring holds every batch, numbered from 0 without gaps, then the end marker.
            dealer.connect(pub.last_replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            while True:
                frames = _recv(dealer)
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    assert frames == [b"", b"", frames[2], b""]
                    break
                empty, topic, seq, payload = frames
                assert empty == b"" and topic == b"kv"
                replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
            # (late probes may still be published meanwhile, so the count is not known up front)
            assert [s for s, _ in replayed] == list(range(len(replayed)))
            assert [r for r in replayed if r[0] in seqs] == received
            assert pub.statistics().replay_requests == 1
            await pub.aclose()
    finally:
        sub.close()
        dealer.close()
        ctx.term()
    stats = pub.statistics()
    assert stats.sequence == stats.published_batches and stats.dropped_batches == 0


def _fresh_stored_batch(i: int, tokens: int = 256) -> list[BlockStored]:
    """One self-describing BlockStored with ``tokens`` token ids of its own (no shared ints)."""
    base = 1_000_000 + i * tokens
    return [BlockStored(block_hashes=[2**63 + i], parent_block_hash=None, token_ids=list(range(base, base + tokens)),
                        block_size=16, lora_id=None, medium="CPU", lora_name=None)]


def test_publisher_queue_is_bounded_by_bytes_and_counts_what_it_drops() -> None:
    bound = 64 << 10
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_bytes=bound)  # never started: nothing drains
    accepted = sum(pub.publish(_fresh_stored_batch(i, tokens=64)) for i in range(1000))
    stats = pub.statistics()
    assert 0 < accepted < 1000  # far below the 100000-batch count bound
    assert (stats.queue_depth, stats.dropped_batches) == (accepted, 1000 - accepted)
    assert 0 < stats.queue_bytes <= bound
    assert ZmqEventPublisher("tcp://127.0.0.1:*").max_queue_bytes == 16 << 20  # the default


def test_a_batch_larger_than_the_byte_bound_is_taken_by_an_empty_queue_only() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_bytes=1)
    assert pub.publish([AllBlocksCleared()])  # an empty queue takes any one batch
    assert not pub.publish([AllBlocksCleared()])
    assert (pub.statistics().queue_depth, pub.statistics().dropped_batches) == (1, 1)


def test_an_event_flood_without_reader_keeps_queue_memory_near_max_queue_bytes() -> None:
    """The estimate tracks real memory: 1500 batches of ~10 KiB offered, ~1 MiB kept."""
    bound = 1 << 20
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_bytes=bound)  # never started: nothing drains
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1500):
            pub.publish(_fresh_stored_batch(i))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stats = pub.statistics()
    assert stats.dropped_batches > 1000
    assert stats.queue_bytes <= bound
    assert held < 2 * bound  # without the byte bound: ~15 MiB


@pytest.mark.anyio
async def test_queue_bytes_are_released_as_batches_are_sent() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_bytes=1 << 20)
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        for i in range(50):
            pub.publish(_fresh_stored_batch(i, tokens=16))
        await pub.aclose()
    stats = pub.statistics()
    assert stats.published_batches + stats.dropped_batches == 50
    assert (stats.queue_depth, stats.queue_bytes) == (0, 0)


def test_publish_never_blocks_when_the_queue_is_full_and_counts_drops() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1000)  # never started: nothing drains
    accepted = sum(pub.publish([AllBlocksCleared()]) for _ in range(100_000))
    stats = pub.statistics()
    assert accepted == 1000
    assert (stats.queue_depth, stats.dropped_batches, stats.published_batches) == (1000, 99_000, 0)


@pytest.mark.anyio
async def test_publishing_100k_batches_without_subscriber_accounts_for_every_batch() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1000)
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        for _ in range(100_000):
            pub.publish([BlockRemoved([1], "CPU")])
        await pub.aclose()
    stats = pub.statistics()
    assert stats.published_batches + stats.dropped_batches == 100_000
    assert stats.queue_depth == 0
    assert stats.sequence == stats.published_batches


@pytest.mark.anyio
async def test_closed_publisher_drops_new_batches_and_never_run_queue_counts_as_dropped() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    assert pub.publish([AllBlocksCleared()])
    assert pub.publish([]) is True  # an empty step is not a batch
    await pub.aclose()
    assert pub.publish([AllBlocksCleared()]) is False
    stats = pub.statistics()
    assert (stats.dropped_batches, stats.queue_depth, stats.published_batches) == (2, 0, 0)


@pytest.mark.anyio
async def test_cancelling_run_stops_the_publisher_thread() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    threads_before = threading.active_count()
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        tg.cancel_scope.cancel()
    assert pub.publish([AllBlocksCleared()]) is False
    assert threading.active_count() <= threads_before + 1  # anyio may keep an idle worker


@pytest.mark.anyio
async def test_run_raises_a_config_error_when_the_endpoint_cannot_be_bound() -> None:
    with pytest.raises(ConfigError, match=r"events\.endpoint: 'tcp://\*:not-a-port' has port"):
        ZmqEventPublisher("tcp://*:not-a-port")  # malformed: refused when built
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        port = taken.bind_to_random_port("tcp://*")
        pub = ZmqEventPublisher(f"tcp://*:{port}")
        with pytest.raises(BaseExceptionGroup) as caught:  # the caller's task group wraps it
            async with anyio.create_task_group() as tg:
                await tg.start(pub.run)  # raises from start(), as one ConfigError
        assert len(caught.value.exceptions) == 1
        assert caught.group_contains(ConfigError, match=rf"events\.endpoint: cannot bind 'tcp://\*:{port}'")
    finally:
        taken.close()
        ctx.term()


# ------------------------------------------------------------------------------ CLI


@pytest.mark.anyio
async def test_cli_prints_replayed_batches_as_json_lines_with_hex_hashes() -> None:
    translator = EventTranslator(self_describing=False, int_hashes=False)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", data_parallel_rank=0)
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        pub.publish(translator.translate([cpu_stored(K1)]), ts=10.0)
        pub.publish(translator.translate([cpu_evicted(K1, K3)]), ts=11.0)
        pub.publish(translator.cleared(), ts=12.0)
        await _wait_published(pub, 3)
        out = io.StringIO()
        argv = ["--endpoint", pub.last_endpoint, "--replay-endpoint", pub.last_replay_endpoint,
                "--from-seq", "1", "--count", "2", "--timeout", "5"]
        rc = await anyio.to_thread.run_sync(lambda: run_events_cli(argv, out=out))
        await pub.aclose()
    assert rc == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [
        {"seq": 1, "ts": 11.0, "data_parallel_rank": 0, "type": "BlockRemoved", "block_hashes": [H1.hex()],
         "medium": "CPU", "group_idx": 0},
        {"seq": 1, "ts": 11.0, "data_parallel_rank": 0, "type": "BlockRemoved", "block_hashes": [H3.hex()],
         "medium": "CPU", "group_idx": 1},
        {"seq": 2, "ts": 12.0, "data_parallel_rank": 0, "type": "AllBlocksCleared"},
    ]


def test_cli_gives_up_after_timeout_without_the_requested_count() -> None:
    out = io.StringIO()
    rc = run_events_cli(["--endpoint", "tcp://127.0.0.1:1", "--count", "1", "--timeout", "0.1"], out=out)
    assert rc == 1 and out.getvalue() == ""


def test_cli_rejects_bad_arguments() -> None:
    assert run_events_cli(["--count", "0"], out=io.StringIO()) == 2
    assert run_events_cli(["--count", "x"], out=io.StringIO()) == 2

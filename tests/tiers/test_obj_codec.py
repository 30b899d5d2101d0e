"""Compression and encryption on the object-store tier, against a real S3 REST server (moto).

asyncio only, like every obj tier test (aiobotocore). Chunks round-trip byte-identical through
the primitives and through an engine; a plain object on an encrypting tier, an encrypted one on a
tier without its key, a corrupt or swapped one are misses, never garbage in the slot.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_blocks import block_equals, fill_block
from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.config import EngineConfig
from kvtier.host.slots import SlotBuffer
from kvtier.keys import make_offload_key
from kvtier.tiers.base import ChunkCorrupt, ChunkNotFound, TierContext
from kvtier.tiers.integrity import TRAILER_PAGE
from kvtier.tiers.obj import ObjectStoreTier

BLOCK = 16
LAYERS = 2
HEADS = 4
DIM = 64
NUM_BLOCKS = 16
HEX1 = "5a" * 32
HEX2 = "a5" * 32
ZSTD = {"codec": "zstd", "level": 1}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "keys"
    path.write_text(f"1:{HEX1}\n2:{HEX2}\n")
    os.chmod(path, 0o600)
    return str(path)


def geometry() -> KVGeometry:
    return KVGeometry("test/codec-model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="bfloat16", block_size=BLOCK)


def obj_entry(server: S3Server, bucket: str, **extra: Any) -> dict[str, Any]:
    store = {"bucket": bucket, "endpoint_override": server.endpoint, "scheme": "http",
             "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY, "region": "us-east-1"}
    return {"type": "obj", "store_config": store, "prefix": "kv/codec", "io_threads": 2,
            "request_timeout_s": 2.0, "lookup_timeout_s": 2.0, **extra}


def engine_config(server: S3Server, bucket: str, slots: int = 2, **extra: Any) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * geometry().slot_bytes(1),
            "secondary_tiers": [obj_entry(server, bucket, **extra)]}


def make_tier(server: S3Server, bucket: str, **extra: Any) -> ObjectStoreTier:
    tier_cfg = EngineConfig.from_dict(engine_config(server, bucket, **extra)).secondary_tiers[0]
    slot = geometry().slot_bytes(1)
    context = TierContext(index=0, label="1:obj", slot_bytes=slot, host=SlotBuffer(4, slot), geometry=geometry(),
                          blocks_per_chunk=1, run_fields=geometry().run_fields(1))
    return ObjectStoreTier(tier_cfg, context)


def chunk_key(i: int) -> bytes:
    return make_offload_key(random.Random(i).randbytes(32), 0)


def kv_fill(view: memoryview, seed: int) -> bytes:
    values = torch.randn(len(view) // 2, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    values[len(values) // 2 :] = 0  # unused block positions: compresses clearly below one slot
    data = values.view(torch.uint8).numpy().tobytes()
    view[:] = data
    return data


def options(mode: str, key_file: str) -> dict[str, Any]:
    return {"compression": ZSTD if "zstd" in mode else None,
            "encryption": {"key_file": key_file, "key_id": 1} if "aes" in mode else None}


def rejected(tier: ObjectStoreTier, reason: str) -> float:
    return tier._rejected.values[(reason,)]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["zstd", "aes", "zstd+aes"])
async def test_coded_objects_round_trip_byte_identical(s3_server: S3Server, s3_bucket: str, key_file: str,
                                                       mode: str) -> None:
    tier = make_tier(s3_server, s3_bucket, **options(mode, key_file))
    host = tier.context.host
    assert host is not None and tier.codec.active
    slot = tier.context.slot_bytes
    await tier.open()
    try:
        data = kv_fill(host.view(0), 1)
        await tier.write(chunk_key(1), host.view(0))
        size = s3_server.client().head_object(Bucket=s3_bucket, Key=tier.object_key(chunk_key(1)))["ContentLength"]
        if "zstd" in mode:
            assert size < slot  # stored compressed
        else:
            assert size == slot + 2 * TRAILER_PAGE
        assert list(await tier.contains([chunk_key(1), chunk_key(2)])) == [True, False]
        await tier.read(chunk_key(1), host.view(1))
        assert bytes(host.view(1)) == data
        # A plain reader (no options) reads compressed objects, refuses encrypted ones.
        reader = make_tier(s3_server, s3_bucket)
        await reader.open()
        try:
            reader_host = reader.context.host
            assert reader_host is not None
            if "aes" in mode:
                with pytest.raises(ChunkNotFound):
                    await reader.read(chunk_key(1), reader_host.view(0))
                assert bytes(reader_host.view(0)) == bytes(slot)
                assert rejected(reader, "no_key") == 1
                # left in place: another configuration's chunk, not a damaged one
                s3_server.client().head_object(Bucket=s3_bucket, Key=tier.object_key(chunk_key(1)))
            else:
                await reader.read(chunk_key(1), reader_host.view(0))
                assert bytes(reader_host.view(0)) == data
        finally:
            await reader.close()
    finally:
        await tier.close()


@pytest.mark.anyio
async def test_plain_objects_are_misses_on_an_encrypting_tier(s3_server: S3Server, s3_bucket: str, key_file: str) -> None:
    plain = make_tier(s3_server, s3_bucket)
    tier = make_tier(s3_server, s3_bucket, **options("aes", key_file))
    host = tier.context.host
    assert host is not None
    await plain.open()
    await tier.open()
    try:
        data = kv_fill(host.view(0), 2)
        await plain.write(chunk_key(3), host.view(0))
        assert list(await tier.contains([chunk_key(3)])) == [False]
        with pytest.raises(ChunkNotFound):
            await tier.read(chunk_key(3), host.view(1))
        assert bytes(host.view(1)) == bytes(len(data))
        assert rejected(tier, "unencrypted") == 1
        await tier.write(chunk_key(3), host.view(0))  # the rewrite: now encrypted
        await tier.read(chunk_key(3), host.view(1))
        assert bytes(host.view(1)) == data
    finally:
        await tier.close()
        await plain.close()


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["flip", "swap", "truncate"])
async def test_damaged_coded_objects_are_misses_deleted(s3_server: S3Server, s3_bucket: str, key_file: str,
                                                        damage: str) -> None:
    tier = make_tier(s3_server, s3_bucket, **options("zstd+aes", key_file))
    host = tier.context.host
    assert host is not None
    client = s3_server.client()
    await tier.open()
    try:
        kv_fill(host.view(0), 4)
        await tier.write(chunk_key(4), host.view(0))
        kv_fill(host.view(0), 5)
        await tier.write(chunk_key(5), host.view(0))
        name = tier.object_key(chunk_key(4))
        body = bytearray(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
        if damage == "flip":
            body[10] ^= 0x40
        elif damage == "swap":
            body = bytearray(client.get_object(Bucket=s3_bucket, Key=tier.object_key(chunk_key(5)))["Body"].read())
        else:
            body = body[:-TRAILER_PAGE]
        client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(body))
        host.view(1)[:] = b"\xff" * tier.context.slot_bytes
        with pytest.raises((ChunkCorrupt, ChunkNotFound)):
            await tier.read(chunk_key(4), host.view(1))
        assert bytes(host.view(1)) == bytes(tier.context.slot_bytes)
        assert list(await tier.contains([chunk_key(4)])) == [False]  # deleted
    finally:
        await tier.close()


def test_bad_key_file_fails_at_tier_construction(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    path = tmp_path / "open-keys"
    path.write_text(f"1:{HEX1}\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="group or others") as err:
        make_tier(s3_server, s3_bucket, encryption={"key_file": str(path), "key_id": 1})
    assert HEX1 not in str(err.value)


@pytest.mark.anyio
async def test_engine_round_trip_with_compression_and_encryption(s3_server: S3Server, s3_bucket: str,
                                                                  key_file: str) -> None:
    kv = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    chunks = [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(8)]
    expected = {}
    config = engine_config(s3_server, s3_bucket, slots=2, **options("zstd+aes", key_file))
    async with kvtier.open(config, geometry(), kv, wait_timeout_s=10) as engine:
        for i, tokens in enumerate(chunks):
            expected[i] = fill_block(kv, i, gen)
            assert await engine.store(tokens, [i]) == BLOCK
        await engine.drain()
        for layer in kv:
            layer.zero_()
        for i, tokens in enumerate(chunks):
            target = (i + 5) % NUM_BLOCKS
            outcome = await engine.load_with_sources(tokens, [target])
            assert outcome.tokens == BLOCK
            assert block_equals(kv, target, expected[i])

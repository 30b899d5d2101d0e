"""The compatibility manifest on the object-store tier (moto S3 server on 127.0.0.1, asyncio only:
the tier is built on aiobotocore): another ``model_revision`` is another key prefix, and the old
revision's objects are never read, not even when copied under the new revision's keys."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from kv_blocks import block_equals, fill_block
from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server

import kvtier
from kvtier import KVGeometry
from kvtier.layout import namespace

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 2, 2, 16, 32
PREFIX = "kv/cache"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def geometry(**extra: Any) -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16",
                      block_size=BLOCK, **extra)


def config(server: S3Server, bucket: str, **top: Any) -> dict[str, Any]:
    store = {"bucket": bucket, "endpoint_override": server.endpoint, "scheme": "http",
             "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY, "region": "us-east-1"}
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 * geometry().slot_bytes(1),
            "secondary_tiers": [{"type": "obj", "store_config": store, "prefix": PREFIX, "io_threads": 4,
                                 "request_timeout_s": 2.0, "lookup_timeout_s": 2.0}], **top}


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(n)]


async def read(cfg: dict[str, Any], model: KVGeometry, chunks: list[list[int]]) -> list[int]:
    async with kvtier.open(cfg, model, device_kv(), wait_timeout_s=10) as engine:
        return [await engine.load(tokens, [16 + i]) for i, tokens in enumerate(chunks)]


def keys(server: S3Server, bucket: str) -> list[str]:
    listing = server.client().list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listing.get("Contents", []))


@pytest.mark.anyio
async def test_a_new_revision_never_reads_the_old_revisions_chunks_on_the_obj_tier(
        s3_server: S3Server, s3_bucket: str) -> None:
    chunks = prompts(5)
    kv = device_kv()
    gen = torch.Generator().manual_seed(2)
    written = {}
    async with kvtier.open(config(s3_server, s3_bucket, model_revision="rev-a"), geometry(), kv) as engine:
        for i, tokens in enumerate(chunks):
            written[i] = fill_block(kv, i, gen)
            assert await engine.store(tokens, [i]) == BLOCK
        await engine.drain()
    rev_a = namespace(PREFIX, geometry(model_revision="rev-a").run_fields(1), 0)
    rev_b = namespace(PREFIX, geometry(model_revision="rev-b").run_fields(1), 0)
    plain = namespace(PREFIX, geometry().run_fields(1), 0)
    stored = [k for k in keys(s3_server, s3_bucket) if k.endswith(".bin")]
    assert len(stored) == 5 and all(k.startswith(rev_a.blocks_dir + "/") for k in stored)

    assert await read(config(s3_server, s3_bucket, model_revision="rev-b"), geometry(), chunks) == [0] * 5
    assert await read(config(s3_server, s3_bucket), geometry(model_revision="rev-b"), chunks) == [0] * 5
    assert await read(config(s3_server, s3_bucket), geometry(), chunks) == [0] * 5

    # The old revision's objects copied under the new revision's (and the plain run's) keys: the
    # trailers name the old run, so they are still never read.
    client = s3_server.client()
    for key in stored:
        for other in (rev_b, plain):
            client.copy_object(Bucket=s3_bucket, Key=other.blocks_dir + key.removeprefix(rev_a.blocks_dir),
                               CopySource={"Bucket": s3_bucket, "Key": key})
    assert await read(config(s3_server, s3_bucket, model_revision="rev-b"), geometry(), chunks) == [0] * 5
    assert await read(config(s3_server, s3_bucket), geometry(), chunks) == [0] * 5

    # The old revision reads its own: a read across revisions would have been seen.
    kv = device_kv()
    async with kvtier.open(config(s3_server, s3_bucket), geometry(model_revision="rev-a"), kv,
                           wait_timeout_s=10) as engine:
        for i, tokens in enumerate(chunks):
            assert await engine.load(tokens, [16 + i]) == BLOCK
            assert block_equals(kv, 16 + i, written[i])

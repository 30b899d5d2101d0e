"""The object-store tier against a real S3 REST server (moto) on 127.0.0.1.

These tests run on asyncio only: ``ObjectStoreTier`` is built on aiobotocore, which is
asyncio-only (``requires_asyncio = True``), so the module overrides ``anyio_backend``. The one
test that needs trio (``kvtier.open`` refusing the tier there) parametrizes it explicitly.
Nothing leaves the machine: the fixtures set dummy AWS credentials, disable metadata lookups,
and every tier gets explicit dummy credentials.
"""

from __future__ import annotations

import contextlib
import logging
import random
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from kv_blocks import block_equals, fill_block
from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.config import EngineConfig
from kvtier.host.slots import SlotBuffer
from kvtier.keys import make_offload_key
from kvtier.layout import namespace
from kvtier.tiers.base import ChunkCorrupt, ChunkNotFound, TierContext, TierIOError, TransferJob
from kvtier.tiers.integrity import TRAILER_PAGE, checksum
from kvtier.tiers.obj import CircuitBreaker, ObjectStoreTier, object_key
from kvtier.types import LookupResult

if sys.version_info < (3, 11):  # pragma: no cover - the builtin arrived in 3.11
    from exceptiongroup import BaseExceptionGroup

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 64
SESSION_TOKEN = "session-token-SHOULD-NEVER-BE-LOGGED-42"


@pytest.fixture
def anyio_backend() -> str:
    """aiobotocore is asyncio-only, so is this tier (see the module docstring)."""
    return "asyncio"


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def obj_entry(server: S3Server, bucket: str, **extra: Any) -> dict[str, Any]:
    store = {"bucket": bucket, "endpoint_override": server.endpoint, "scheme": "http",
             "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY, "region": "us-east-1"}
    store.update(extra.pop("store", {}))
    return {"type": "obj", "store_config": store, "prefix": "kv/cache", "io_threads": 4,
            "request_timeout_s": 1.0, "lookup_timeout_s": 1.0, **extra}


def engine_config(server: S3Server, bucket: str, slots: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": slots * geometry().slot_bytes(1),
        "secondary_tiers": [obj_entry(server, bucket, **extra)],
    }


def make_tier(server: S3Server, bucket: str, *, num_slots: int = 8, **extra: Any) -> ObjectStoreTier:
    tier_cfg = EngineConfig.from_dict(engine_config(server, bucket, **extra)).secondary_tiers[0]
    slot = geometry().slot_bytes(1)
    context = TierContext(index=0, label="1:obj", slot_bytes=slot, host=SlotBuffer(num_slots, slot),
                          geometry=geometry(), blocks_per_chunk=1, run_fields=geometry().run_fields(1))
    return ObjectStoreTier(tier_cfg, context)


def chunk_key(i: int) -> bytes:
    return make_offload_key(random.Random(i).randbytes(32), 0)


def fill(view: memoryview, seed: int) -> bytes:
    data = random.Random(seed).randbytes(len(view))
    view[:] = data
    return data


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(n)]


async def wait_for_results(tier: ObjectStoreTier, n: int, timeout: float = 10.0) -> list[Any]:
    results: list[Any] = []
    with anyio.fail_after(timeout):
        while len(results) < n:
            results.extend(tier.get_finished_jobs())
            await anyio.sleep(0.01)
    return results


async def resolve(tier: ObjectStoreTier, key: bytes, timeout: float = 10.0) -> LookupResult:
    with anyio.fail_after(timeout):
        while True:
            verdict = tier.lookup(key)
            if verdict is not LookupResult.RETRY:
                return verdict
            tier.on_schedule_end()
            await anyio.sleep(0.01)


@contextlib.contextmanager
def raises_config_error() -> Iterator[list[ConfigError]]:
    """Expect a ``ConfigError`` out of ``kvtier.open``: bare, or (while api.open does not unwrap
    start-up failures yet) as the single leaf of an exception group."""
    caught: list[ConfigError] = []
    try:
        yield caught
    except ConfigError as exc:
        caught.append(exc)
    except BaseExceptionGroup as group:
        matched, rest = group.split(ConfigError)
        if matched is None or rest is not None:
            raise
        while isinstance(matched, BaseExceptionGroup):
            matched = matched.exceptions[0]
        caught.append(matched)
    if not caught:
        pytest.fail("no ConfigError was raised")


# --- keys ----------------------------------------------------------------------------------------
def test_object_key_is_the_fs_namespace_under_the_prefix_without_vllm_slashes() -> None:
    fields = geometry().run_fields(1)
    key = make_offload_key(bytes(range(32)), 0)
    ns = namespace("kv/cache", fields, 0)
    name = object_key(ns, key)
    h = bytes(range(32)).hex()
    assert name == f"kv/cache/test_model_{ns.digest}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"
    assert "//" not in name and not name.startswith("/")
    # vLLM's literal quirk, reproduced only on request
    assert object_key(ns, key, vllm_compatible=True) == f"kv/cache//test_model_{ns.digest}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"
    bare = namespace("", fields, 0)
    assert object_key(bare, key, vllm_compatible=True) == "/" + object_key(bare, key)


def test_prefix_slashes_are_normalised_and_different_chunk_sizes_never_share_keys(s3_server: S3Server) -> None:
    tier = make_tier(s3_server, "some-bucket", prefix="/kv/cache/")
    assert tier.object_key(make_offload_key(b"\x01" * 32)).startswith("kv/cache/test_model_")
    fields2 = geometry().run_fields(2)
    assert namespace("kv/cache", fields2, 0).digest != tier.namespace.digest


# --- primitives ----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_write_then_read_is_byte_identical_and_object_carries_the_trailer(s3_server: S3Server, s3_bucket: str) -> None:
    tier = make_tier(s3_server, s3_bucket)
    host = tier.context.host
    assert host is not None
    await tier.open()
    try:
        data = fill(host.view(0), 1)
        await tier.write(chunk_key(1), host.view(0))
        head = s3_server.client().head_object(Bucket=s3_bucket, Key=tier.object_key(chunk_key(1)))
        assert head["ContentLength"] == len(data) + TRAILER_PAGE
        await tier.read(chunk_key(1), host.view(1))
        assert bytes(host.view(1)) == data
        with pytest.raises(ChunkNotFound):
            await tier.read(chunk_key(2), host.view(2))
        assert list(await tier.contains([chunk_key(1), chunk_key(2)])) == [True, False]
    finally:
        await tier.close()


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "bad_trailer", "swapped", "version_1"])
async def test_corrupt_object_is_a_miss_deleted_and_counted(s3_server: S3Server, s3_bucket: str, damage: str) -> None:
    tier = make_tier(s3_server, s3_bucket)
    host = tier.context.host
    assert host is not None
    client = s3_server.client()
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        fill(host.view(0), 2)
        fill(host.view(2), 4)
        tier.submit_store(TransferJob(1, [chunk_key(3), chunk_key(4)], [0, 2], is_promotion=False))
        [stored] = await wait_for_results(tier, 1)
        assert stored.success
        name = tier.object_key(chunk_key(3))
        blob = bytearray(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
        if damage == "flip_byte":
            blob[100] ^= 0xFF
        elif damage == "truncate":
            blob = blob[: len(blob) - 10]
        elif damage == "swapped":  # another chunk's valid object copied over this one's name
            other = tier.object_key(chunk_key(4))
            blob = bytearray(client.get_object(Bucket=s3_bucket, Key=other)["Body"].read())
        elif damage == "version_1":  # kvtier 0.1's trailer: intact bytes, but no identity to check
            payload = bytes(blob[:-TRAILER_PAGE])
            blob = bytearray(payload + bytes(TRAILER_PAGE - 32)
                             + struct.pack("<4sHHQQ8x", b"KVTR", 1, 0, len(payload), checksum(payload)))
        else:
            blob[-32:-28] = b"XXXX"
        client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(blob))
        tier.submit_load(TransferJob(2, [chunk_key(3)], [1], is_promotion=True))
        [loaded] = await wait_for_results(tier, 1)
        assert not loaded.success and loaded.failure_reason == "corrupt"
        assert loaded.successful_keys == []
        assert tier.lookup(chunk_key(3)) is LookupResult.MISS  # the failed load invalidated it
        with pytest.raises(client.exceptions.ClientError):
            client.head_object(Bucket=s3_bucket, Key=name)
        stats = tier.statistics()
        assert stats.failures[("load", "corrupt")] == 1
        rejected = next(m for m in stats.custom_metrics if m.name == "obj_rejected_chunks")
        expected_reason = {"flip_byte": "checksum", "truncate": "short", "bad_trailer": "bad_trailer",
                           "swapped": "wrong_chunk", "version_1": "old_version"}[damage]
        assert rejected.values[(expected_reason,)] == 1
        assert bytes(host.view(1)) == bytes(len(host.view(1)))  # rejected bytes never stay in a slot
        await tier.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("accept", [False, True], ids=["default", "accept_unverified_chunks"])
async def test_a_trailerless_object_is_refused_and_kept_unless_accepted(s3_server: S3Server, s3_bucket: str,
                                                                         accept: bool) -> None:
    tier = make_tier(s3_server, s3_bucket, accept_unverified_chunks=accept)
    host = tier.context.host
    assert host is not None
    client = s3_server.client()
    name = tier.object_key(chunk_key(7))
    data = random.Random(7).randbytes(len(host.view(0)))
    client.put_object(Bucket=s3_bucket, Key=name, Body=data)  # what vLLM writes: no trailer
    await tier.open()
    try:
        assert list(await tier.contains([chunk_key(7)])) == [accept]
        host.view(0)[:] = b"\xee" * len(host.view(0))
        if accept:
            await tier.read(chunk_key(7), host.view(0))
            assert bytes(host.view(0)) == data
        else:
            with pytest.raises(ChunkNotFound):
                await tier.read(chunk_key(7), host.view(0))
            assert bytes(host.view(0)) == bytes(len(data))
        client.head_object(Bucket=s3_bucket, Key=name)  # never deleted: it may be vLLM's
        metrics = {m.name: m for m in tier.statistics().custom_metrics}
        assert metrics["obj_unverified_loads"].values.get((), 0) == (1 if accept else 0)
        assert metrics["obj_rejected_chunks"].values[("unverified",)] == (0 if accept else 1)
    finally:
        await tier.close()


@pytest.mark.anyio
async def test_lookups_retry_then_resolve_from_one_concurrent_batch(s3_server: S3Server, s3_bucket: str) -> None:
    tier = make_tier(s3_server, s3_bucket, num_slots=16)
    host = tier.context.host
    assert host is not None
    heads_in_flight = 0
    peak = 0
    async with anyio.create_task_group() as tg:
        await tg.start(tier.run)
        for i in range(6):
            fill(host.view(i), 10 + i)
        tier.submit_store(TransferJob(1, [chunk_key(10 + i) for i in range(6)], list(range(6)), is_promotion=False))
        assert (await wait_for_results(tier, 1))[0].success
        # a second tier instance (another process, say) knows nothing yet: every lookup probes
        reader = make_tier(s3_server, s3_bucket, num_slots=16)

        async with anyio.create_task_group() as tg2:
            await tg2.start(reader.run)
            original = reader._client.head_object

            async def counting_head(**kwargs: Any) -> Any:
                nonlocal heads_in_flight, peak
                heads_in_flight += 1
                peak = max(peak, heads_in_flight)
                try:
                    await anyio.sleep(0.05)  # let the batch's HEADs overlap
                    return await original(**kwargs)
                finally:
                    heads_in_flight -= 1

            reader._client.head_object = counting_head
            keys = [chunk_key(10 + i) for i in range(6)] + [chunk_key(99)]
            assert [reader.lookup(k) for k in keys] == [LookupResult.RETRY] * 7
            reader.on_schedule_end()  # one batch for the step
            verdicts = [await resolve(reader, k) for k in keys]
            assert verdicts == [LookupResult.HIT] * 6 + [LookupResult.MISS]
            assert peak > 1, "the HEADs of one batch ran one after another"
            assert peak <= 4  # bounded by io_threads
            await reader.aclose()
        await tier.aclose()


# --- the engine end to end ------------------------------------------------------------------------
@pytest.mark.anyio
async def test_engine_round_trip_through_host_eviction_and_promotion_is_byte_identical(
        s3_server: S3Server, s3_bucket: str) -> None:
    kv = device_kv()
    gen = torch.Generator().manual_seed(1)
    expected = {}
    chunks = prompts(24, seed=3)
    async with kvtier.open(engine_config(s3_server, s3_bucket, slots=4), geometry(), kv, wait_timeout_s=10) as engine:
        for i, tokens in enumerate(chunks):
            expected[i] = fill_block(kv, i % NUM_BLOCKS, gen)
            assert await engine.store(tokens, [i % NUM_BLOCKS]) == BLOCK
        await engine.drain()
        for layer in kv:
            layer.zero_()
        sources: dict[str, int] = {}
        for i, tokens in enumerate(chunks):
            target = (i * 7 + 3) % NUM_BLOCKS
            outcome = await engine.load_with_sources(tokens, [target])
            assert outcome.tokens == BLOCK, f"chunk {i} not loaded"
            assert block_equals(kv, target, expected[i]), f"chunk {i} came back different"
            for label, count in outcome.tokens_by_tier.items():
                sources[label] = sources.get(label, 0) + count
        assert sources.get("1:obj", 0) >= (24 - 4) * BLOCK  # 4 host slots: most came from the bucket


@pytest.mark.anyio
async def test_two_engines_share_a_bucket(s3_server: S3Server, s3_bucket: str) -> None:
    writer_kv, reader_kv = device_kv(), device_kv()
    gen = torch.Generator().manual_seed(2)
    chunks = prompts(6, seed=4)
    async with kvtier.open(engine_config(s3_server, s3_bucket), geometry(), writer_kv) as writer:
        data = [fill_block(writer_kv, i, gen) for i in range(6)]
        for i, tokens in enumerate(chunks):
            await writer.store(tokens, [i])
        await writer.drain()
    async with kvtier.open(engine_config(s3_server, s3_bucket), geometry(), reader_kv, wait_timeout_s=10) as reader:
        for i, tokens in enumerate(chunks):
            assert await reader.load(tokens, [20 + i]) == BLOCK
            assert block_equals(reader_kv, 20 + i, data[i])


@pytest.mark.anyio
async def test_server_outage_gives_misses_and_failed_stores_then_recovers(s3_bucket: str) -> None:
    server = S3Server().start()
    try:
        bucket = server.create_bucket()
        tier = make_tier(server, bucket)
        host = tier.context.host
        assert host is not None
        async with anyio.create_task_group() as tg:
            await tg.start(tier.run)
            fill(host.view(0), 5)
            tier.submit_store(TransferJob(1, [chunk_key(50)], [0], is_promotion=False))
            assert (await wait_for_results(tier, 1))[0].success

            server.stop()
            fill(host.view(1), 6)
            tier.submit_store(TransferJob(2, [chunk_key(51)], [1], is_promotion=False))
            tier.submit_load(TransferJob(3, [chunk_key(50)], [2], is_promotion=True))
            results = {r.job_id: r for r in await wait_for_results(tier, 2)}
            assert not results[2].success and results[2].failure_reason in ("unavailable", "timeout")
            assert not results[3].success and results[3].successful_keys == []
            assert await resolve(tier, chunk_key(52)) is LookupResult.MISS
            assert tier.statistics().failures.get(("lookup", "unavailable"), 0) + \
                tier.statistics().failures.get(("lookup", "timeout"), 0) >= 1

            server.start()  # same port; moto kept the bucket in memory
            await anyio.sleep(tier.breaker.open_s)  # past the fail-fast window
            with anyio.fail_after(10):
                while True:
                    tier.submit_load(TransferJob(4, [chunk_key(50)], [3], is_promotion=True))
                    [result] = await wait_for_results(tier, 1)
                    if result.success:
                        break
                    await anyio.sleep(0.2)
            assert bytes(host.view(3)) == bytes(host.view(0))
            tier.submit_store(TransferJob(5, [chunk_key(51)], [1], is_promotion=False))
            assert (await wait_for_results(tier, 1))[0].success
            await tier.aclose()
    finally:
        server.stop()


@pytest.mark.anyio
async def test_engine_keeps_serving_while_the_endpoint_is_down(s3_bucket: str) -> None:
    server = S3Server().start()
    try:
        bucket = server.create_bucket()
        kv = device_kv()
        gen = torch.Generator().manual_seed(7)
        chunks = prompts(6, seed=8)
        async with kvtier.open(engine_config(server, bucket, slots=4), geometry(), kv, wait_timeout_s=10) as engine:
            server.stop()
            for i, tokens in enumerate(chunks):
                fill_block(kv, i, gen)
                assert await engine.store(tokens, [i]) == BLOCK  # the host tier takes it
            await engine.drain()
            # whatever the host still holds loads; nothing comes from (or hangs on) the bucket
            for i, tokens in enumerate(chunks):
                outcome = await engine.load_with_sources(tokens, [30 + i])
                assert outcome.tokens in (0, BLOCK)
                assert outcome.tokens_by_tier.get("1:obj", 0) == 0
            assert (await engine.load_with_sources(chunks[5], [40])).tokens == BLOCK
            failures = engine.tiers[0].statistics().failures
            assert sum(n for (direction, _), n in failures.items() if direction == "store") >= 1
    finally:
        server.stop()


# --- start-up ------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_unreachable_endpoint_is_a_config_error_within_5s(dummy_aws_env: None) -> None:
    dead = S3Server()  # never started: nothing listens on its port
    started = time.monotonic()
    with raises_config_error() as caught:
        async with kvtier.open(engine_config(dead, "some-bucket"), geometry(), device_kv()):
            pass
    assert time.monotonic() - started < 5.0
    message = str(caught[0])
    assert dead.endpoint in message and "some-bucket" in message
    assert DUMMY_SECRET_KEY not in message


@pytest.mark.anyio
async def test_missing_bucket_is_a_config_error_naming_it(s3_server: S3Server) -> None:
    started = time.monotonic()
    with raises_config_error() as caught:
        async with kvtier.open(engine_config(s3_server, "does-not-exist-bucket"), geometry(), device_kv()):
            pass
    assert time.monotonic() - started < 5.0
    assert "'does-not-exist-bucket'" in str(caught[0]) and "does not exist" in str(caught[0])
    assert s3_server.endpoint in str(caught[0])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_obj_tier_under_trio_is_a_config_error(s3_server: S3Server) -> None:
    with raises_config_error() as caught:
        async with kvtier.open(engine_config(s3_server, "any-bucket"), geometry(), device_kv()):
            pass
    assert "asyncio" in str(caught[0]) and "trio" in str(caught[0])


# --- secrets -------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_secrets_never_reach_logs_or_repr(s3_server: S3Server, s3_bucket: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "aiobotocore", "kvtier"):
        caplog.set_level(logging.DEBUG, logger=name)
    secret_key = "SeCrEt/key+that-must-not-leak-123456"
    entry_store = {"secret_key": secret_key, "session_token": SESSION_TOKEN}
    kv = device_kv()
    config = engine_config(s3_server, s3_bucket, store=entry_store)
    async with kvtier.open(config, geometry(), kv, wait_timeout_s=10) as engine:
        fill_block(kv, 0, torch.Generator().manual_seed(9))
        await engine.store(prompts(1, seed=9)[0], [0])
        await engine.drain()
        tier = engine.tiers[0] if hasattr(engine, "tiers") else None
        texts = [repr(engine), repr(EngineConfig.from_dict(config))]
        if tier is not None:
            texts += [repr(tier), str(tier.statistics())]
    with raises_config_error() as caught:
        async with kvtier.open(engine_config(s3_server, "no-such-bucket-x", store=entry_store), geometry(), kv):
            pass
    texts.append(str(caught[0]))
    assert any(r.name.startswith("botocore") for r in caplog.records), "botocore's DEBUG logs were not captured"
    texts += [r.getMessage() for r in caplog.records]
    for text in texts:
        assert secret_key not in text
        assert SESSION_TOKEN not in text


# --- request policy (no server needed) ------------------------------------------------------------
def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "code", "reason"), [(503, "SlowDown", "throttled"), (500, "InternalError", "server_error")])
async def test_throttling_and_5xx_are_retried_until_success(s3_server: S3Server, status: int, code: str, reason: str) -> None:
    tier = make_tier(s3_server, "any-bucket")
    tier._client = object()  # only checked for "open"
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise _client_error(status, code)
        return "ok"

    assert await tier._request(flaky, timeout=5.0, what="test") == "ok"
    assert calls == 3
    retries = next(m for m in tier.statistics().custom_metrics if m.name == "obj_request_retries")
    assert retries.values[(reason,)] == 2


@pytest.mark.anyio
async def test_retries_stop_at_the_deadline_with_the_last_reason(s3_server: S3Server) -> None:
    tier = make_tier(s3_server, "any-bucket")
    tier._client = object()

    async def always_throttled() -> None:
        raise _client_error(503, "SlowDown")

    started = time.monotonic()
    with pytest.raises(TierIOError) as info:
        await tier._request(always_throttled, timeout=0.3, what="test")
    assert info.value.reason == "throttled"
    assert time.monotonic() - started < 3.0


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "code", "reason"),
                         [(403, "AccessDenied", "permission"), (400, "InvalidRequest", "client_error")])
async def test_4xx_other_than_404_fail_at_once_without_retry(s3_server: S3Server, status: int, code: str, reason: str) -> None:
    tier = make_tier(s3_server, "any-bucket")
    tier._client = object()
    calls = 0

    async def rejected() -> None:
        nonlocal calls
        calls += 1
        raise _client_error(status, code)

    with pytest.raises(TierIOError) as info:
        await tier._request(rejected, timeout=5.0, what="test")
    assert info.value.reason == reason and calls == 1


def test_circuit_breaker_opens_after_repeated_failures_and_never_stays_open() -> None:
    now = [0.0]
    breaker = CircuitBreaker(threshold=3, open_s=1.0, clock=lambda: now[0])
    breaker.record_failure()
    breaker.record_failure()
    assert not breaker.is_open
    breaker.record_failure()
    assert breaker.is_open and breaker.trips == 1
    now[0] = 1.5
    assert not breaker.is_open  # half-open: requests probe again
    breaker.record_failure()
    assert breaker.is_open  # still failing: re-opened at once
    now[0] = 3.0
    breaker.record_success()
    breaker.record_failure()
    assert not breaker.is_open


def test_chunk_corrupt_and_not_found_are_tier_errors() -> None:
    assert ChunkCorrupt.reason == "corrupt" and ChunkNotFound.reason == "missing"

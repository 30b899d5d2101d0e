"""Object-store tier throughput vs raw aiobotocore, against one local moto S3 server.

Stores then loads ``--chunks`` chunks of 2 MiB through ``ObjectStoreTier`` (jobs submitted the
way the manager does, ``io_threads`` requests in flight per direction, trailer written and
verified) and through a raw aiobotocore client doing plain PUT/GET of the same bytes with the same
concurrency and client settings, in the same process. Prints MiB/s and the tier/raw ratio
(target ≥ 0.9). Alternates raw and tier rounds so server warm-up does not favour either.

    python benchmarks/obj_tier.py [--chunks 48] [--io-threads 8] [--rounds 3] [--in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "support")]
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, S3Server  # noqa: E402

from kvtier.config import EngineConfig  # noqa: E402
from kvtier.host.slots import SlotBuffer  # noqa: E402
from kvtier.keys import make_offload_key  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402
from kvtier.tiers.base import TierContext, TransferJob  # noqa: E402
from kvtier.tiers.obj import ObjectStoreTier  # noqa: E402

MIB = 1 << 20
# 32 layers x one 16-token block of 8 heads x 128 dims in fp16 = 2 MiB per chunk.
GEOMETRY = KVGeometry("bench/model", num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)


def make_tier(server: S3Server, bucket: str, io_threads: int, slots: int) -> ObjectStoreTier:
    entry = {"type": "obj", "io_threads": io_threads, "request_timeout_s": 30.0,
             "store_config": {"bucket": bucket, "endpoint_override": server.endpoint,
                              "access_key": DUMMY_ACCESS_KEY, "secret_key": DUMMY_SECRET_KEY,
                              "region": "us-east-1"}}
    cfg = EngineConfig.from_dict({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
                                  "secondary_tiers": [entry]}).secondary_tiers[0]
    slot = GEOMETRY.slot_bytes(1)
    ctx = TierContext(index=0, label="1:obj", slot_bytes=slot, host=SlotBuffer(slots, slot),
                      geometry=GEOMETRY, blocks_per_chunk=1, run_fields=GEOMETRY.run_fields(1))
    return ObjectStoreTier(cfg, ctx)


async def run_job(tier: ObjectStoreTier, job: TransferJob) -> float:
    # Woken by the tier's wakeup callback, as the engine is: no polling loop stealing CPU.
    done = asyncio.Event()
    tier.set_wakeup(done.set)
    started = time.perf_counter()
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    while True:
        await done.wait()
        done.clear()
        results = tier.get_finished_jobs()
        if results:
            assert results[0].success, results[0]
            return time.perf_counter() - started


async def raw_round(client: Any, bucket: str, payloads: list[bytes], io_threads: int, tag: str) -> tuple[float, float]:
    gate = asyncio.Semaphore(io_threads)

    async def put(i: int) -> None:
        async with gate:
            await client.put_object(Bucket=bucket, Key=f"raw/{tag}/{i}", Body=payloads[i])

    async def get(i: int) -> None:
        async with gate:
            response = await client.get_object(Bucket=bucket, Key=f"raw/{tag}/{i}")
            async with response["Body"] as body:
                await body.read()

    started = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(len(payloads))))
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    await asyncio.gather(*(get(i) for i in range(len(payloads))))
    return put_s, time.perf_counter() - started


class SubprocessS3Server(S3Server):
    """moto's server in a child process: in-process, its threads would share the GIL with the
    client being measured and the numbers would mostly measure GIL contention."""

    def start(self) -> SubprocessS3Server:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._server = self._proc
        self._wait_listening()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._server = None


async def main(args: argparse.Namespace) -> None:
    server = (S3Server() if args.in_process else SubprocessS3Server()).start()
    try:
        bucket = server.create_bucket()
        n = args.chunks
        tier = make_tier(server, bucket, args.io_threads, 2 * n)
        host = tier.context.host
        assert host is not None
        slot = tier.context.slot_bytes
        for i in range(n):
            host.view(i)[:] = os.urandom(slot)
        payloads = [bytes(host.view(i)) for i in range(n)]
        from aiobotocore.session import get_session

        raw = {"put": 0.0, "get": 0.0}
        ours = {"put": 0.0, "get": 0.0}
        async with asyncio.TaskGroup() as tg:
            tg.create_task(tier.run())
            while tier._client is None:  # started (bench only: peek at readiness)
                await asyncio.sleep(0.01)
            # The raw baseline uses the very client settings the tier uses (timeouts, pool,
            # checksums off, path addressing): the ratio measures the tier, not the config.
            async with get_session().create_client(
                "s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id=DUMMY_ACCESS_KEY,
                aws_secret_access_key=DUMMY_SECRET_KEY, config=tier._client.meta.config,
            ) as client:
                # One untimed round each first: connection pools, server threads and caches warm up.
                await raw_round(client, bucket, payloads, args.io_threads, "warmup")
                warm_keys = [make_offload_key(os.urandom(32)) for _ in range(n)]
                await run_job(tier, TransferJob(10**6, warm_keys, list(range(n)), False))
                await run_job(tier, TransferJob(10**6 + 1, warm_keys, list(range(n, 2 * n)), True))
                for r in range(args.rounds):
                    # Alternate who goes first: the server's state (objects held, memory) grows
                    # during a run, and the side measured second would pay for it every round.
                    keys = [make_offload_key(os.urandom(32)) for _ in range(n)]
                    for side in (("raw", "tier") if r % 2 == 0 else ("tier", "raw")):
                        if side == "raw":
                            put_s, get_s = await raw_round(client, bucket, payloads, args.io_threads, str(r))
                            raw["put"] += put_s
                            raw["get"] += get_s
                        else:
                            ours["put"] += await run_job(tier, TransferJob(2 * r, keys, list(range(n)), False))
                            ours["get"] += await run_job(
                                tier, TransferJob(2 * r + 1, keys, list(range(n, 2 * n)), True))
                            assert all(bytes(host.view(n + i)) == payloads[i] for i in range(n))
            await tier.aclose()
        total_mib = args.rounds * n * slot / MIB
        print(f"{n} chunks x {slot / MIB:.0f} MiB, io_threads={args.io_threads}, rounds={args.rounds}")
        print(f"{'op':<6}{'raw MiB/s':>12}{'tier MiB/s':>12}{'ratio':>8}")
        for op, label in (("put", "store"), ("get", "load")):
            raw_rate, tier_rate = total_mib / raw[op], total_mib / ours[op]
            print(f"{label:<6}{raw_rate:>12.1f}{tier_rate:>12.1f}{tier_rate / raw_rate:>8.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=48)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="run moto in this process (threads)")
    asyncio.run(main(parser.parse_args()))

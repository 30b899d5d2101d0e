"""Share a prompt's KV chunks between two engines through an S3-compatible bucket.

Engine A stores a prompt's chunks (device → host → bucket); engine B, with an empty host tier,
loads them back from the bucket and checks the bytes. Without ``--endpoint`` a local moto S3
server is started on 127.0.0.1 with dummy credentials (nothing leaves the machine).

    python examples/obj_tier.py                                   # local moto server
    python examples/obj_tier.py --endpoint s3.example.com --scheme https --bucket my-kv
        (credentials from the SDK's default chain, or --access-key/--secret-key)

Needs the ``obj`` extra (``pip install 'kvtier[obj]'``: aiobotocore); the local server needs moto's
server (``pip install 'moto[server]'``, part of the ``test`` extra). Runs from a checkout; pytest
is not needed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402
from kvtier import KVGeometry  # noqa: E402

BLOCK = 16
GEOMETRY = KVGeometry("example/model", num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_size=BLOCK)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((32, 2, BLOCK, 4, 64), dtype=torch.float16) for _ in range(GEOMETRY.num_layers)]


def config(store: dict[str, str]) -> dict:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8 * GEOMETRY.slot_bytes(1),
        "secondary_tiers": [{"type": "obj", "store_config": store, "prefix": "examples", "io_threads": 4}],
    }


async def run(store: dict[str, str]) -> bool:
    tokens = [random.Random(0).randrange(1, 32000) for _ in range(6 * BLOCK)]
    kv_a, kv_b = device_kv(), device_kv()
    for layer in kv_a:
        layer[:6].copy_(torch.randn(layer[:6].shape).to(layer.dtype))
    async with kvtier.open(config(store), GEOMETRY, kv_a) as engine_a:
        stored = await engine_a.store(tokens, list(range(6)))
        await engine_a.drain()  # wait until the chunks reached the bucket
        print(f"engine A stored {stored} tokens ({stored // BLOCK} chunks) in bucket {store['bucket']!r}")
    async with kvtier.open(config(store), GEOMETRY, kv_b) as engine_b:
        outcome = await engine_b.load_with_sources(tokens, list(range(10, 16)))
        same = all(torch.equal(a[:6], b[10:16]) for a, b in zip(kv_a, kv_b))
        print(f"engine B loaded {outcome.tokens} tokens, by tier {dict(outcome.tokens_by_tier)}; "
              f"bytes identical: {same}")
    return same and outcome.tokens == len(tokens)


def start_local_s3() -> Any:
    """moto's S3 server on a free loopback port, or exit with status 2 when moto is missing."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        print(f"obj_tier.py: the local S3 server needs moto's server, which is not installed ({exc}); "
              "pip install 'moto[server]' (part of kvtier[test]), or pass --endpoint HOST:PORT", file=sys.stderr)
        raise SystemExit(2) from None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        os.environ.setdefault(key, value)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    deadline = time.monotonic() + 5.0
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    server.endpoint = f"127.0.0.1:{port}"
    return server


async def create_bucket(store: dict[str, str]) -> None:
    from aiobotocore.session import get_session

    async with get_session().create_client(
        "s3", endpoint_url=f"http://{store['endpoint_override']}", region_name=store["region"],
        aws_access_key_id=store["access_key"], aws_secret_access_key=store["secret_key"],
    ) as client:
        await client.create_bucket(Bucket=store["bucket"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="host[:port] of an S3-compatible store (default: local moto)")
    parser.add_argument("--scheme", default="http", choices=("http", "https"))
    parser.add_argument("--bucket", default="kvtier-example")
    parser.add_argument("--region", default="")
    parser.add_argument("--access-key", default=os.environ.get("KVTIER_S3_ACCESS_KEY", ""))
    parser.add_argument("--secret-key", default=os.environ.get("KVTIER_S3_SECRET_KEY", ""))
    args = parser.parse_args()
    store = {"bucket": args.bucket, "scheme": args.scheme, "region": args.region,
             "access_key": args.access_key, "secret_key": args.secret_key}
    if importlib.util.find_spec("aiobotocore") is None:
        print("obj_tier.py: the obj tier needs aiobotocore, which is not installed; pip install 'kvtier[obj]'",
              file=sys.stderr)
        raise SystemExit(2)
    server = None
    if args.endpoint is None:
        server = start_local_s3()
        # dummy credentials: moto accepts any, and nothing leaves the machine
        store.update(endpoint_override=server.endpoint, scheme="http", region="us-east-1",
                     access_key="AKIDEXAMPLEDUMMY0001", secret_key="example-dummy-secret")
        try:
            asyncio.run(create_bucket(store))
        except BaseException:
            server.stop()
            raise
        print(f"started a local S3 server (moto) at http://{server.endpoint}")
    else:
        store["endpoint_override"] = args.endpoint
    try:
        ok = asyncio.run(run(store))
    finally:
        if server is not None:
            server.stop()
    if not ok:
        raise SystemExit("the chunks loaded by engine B differ from what engine A stored")


if __name__ == "__main__":
    main()

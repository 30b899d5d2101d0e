"""Two processes sharing one filesystem tier.

The first process ("writer") offloads a prompt's KV chunks: device → host → ``root_dir``. The
second ("reader"), a fresh process with an empty host cache, finds the same chunks on disk by
their content-addressed keys and loads them into its own device blocks, instead of recomputing
the prefill. Both use CPU tensors as the "device", so this runs anywhere::

    python examples/fs_tier.py            # runs both processes one after the other
    python examples/fs_tier.py writer DIR # or each role by hand
    python examples/fs_tier.py reader DIR
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402

GEOMETRY = KVGeometry("example/tiny-llama", num_layers=4, num_kv_heads=4, head_dim=64,
                      dtype="float16", block_size=16)
NUM_BLOCKS = 64
PROMPT = list(range(1000, 1000 + 16 * 12))  # 12 full blocks of 16 tokens


def config(root_dir: str) -> dict[str, object]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 32 * GEOMETRY.slot_bytes(1),
        "secondary_tiers": [{"type": "fs", "root_dir": root_dir, "n_read_threads": 2, "n_write_threads": 2}],
    }


def device_kv(fill: float) -> list[torch.Tensor]:
    shape = (NUM_BLOCKS, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    return [torch.full(shape, fill, dtype=torch.float16) for _ in range(GEOMETRY.num_layers)]


async def writer(root_dir: str) -> None:
    kv = device_kv(0.0)
    blocks = list(range(len(PROMPT) // GEOMETRY.block_size))
    for layer, tensor in enumerate(kv):
        for b in blocks:
            tensor[b].fill_(layer + b / 100)  # recognisable contents per layer and block
    async with kvtier.open(config(root_dir), GEOMETRY, kv) as engine:
        stored = await engine.store(PROMPT, blocks)
        # store() returns once the device blocks may be reused; wait for the cascade to disk.
        await engine.drain()
    print(f"writer: offloaded {stored} tokens ({len(blocks)} chunks) to {root_dir}")


async def reader(root_dir: str) -> None:
    kv = device_kv(-1.0)
    blocks = list(range(20, 20 + len(PROMPT) // GEOMETRY.block_size))  # different device blocks
    async with kvtier.open(config(root_dir), GEOMETRY, kv) as engine:
        loaded = await engine.load(PROMPT, blocks)
    ok = all(
        torch.all(kv[layer][dst] == torch.tensor(layer + src / 100, dtype=torch.float16)).item()
        for layer in range(GEOMETRY.num_layers)
        for src, dst in enumerate(blocks[: loaded // GEOMETRY.block_size])
    )
    print(f"reader: loaded {loaded} of {len(PROMPT)} prompt tokens from disk; contents match: {ok}")
    if loaded != len(PROMPT) or not ok:
        raise SystemExit(1)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("writer", "reader"):
        anyio.run(writer if sys.argv[1] == "writer" else reader, sys.argv[2])
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-fs-example-") as root_dir:
        for role in ("writer", "reader"):
            subprocess.run([sys.executable, __file__, role, root_dir], check=True)


if __name__ == "__main__":
    main()

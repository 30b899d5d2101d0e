"""The smallest complete kvtier program: host memory only, no secondary tier.

A prompt's KV blocks are offloaded from the "device" (CPU tensors standing in for GPU memory) to
kvtier's host tier, then loaded back into *different* device blocks and compared byte for byte.
The same round trip is done twice:

* with ``async with kvtier.open(...)`` inside an event loop (asyncio here; trio works the same),
* with ``kvtier.start_in_thread(...)``, the blocking facade for callers without an event loop
  (the engine runs on its own loop in a background thread; ``close()`` stops it).

::

    python examples/cpu_only.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402
from kvtier.layout import KVGeometry  # noqa: E402

GEOMETRY = KVGeometry("example/tiny", num_layers=2, num_kv_heads=2, head_dim=32,
                      dtype="float16", block_size=16)
NUM_DEVICE_BLOCKS = 32
PROMPT = [(7 * i + 3) % 32000 for i in range(16 * 6 + 5)]  # 6 full blocks and a partial one
FULL_BLOCKS = len(PROMPT) // GEOMETRY.block_size
SOURCE_BLOCKS = list(range(FULL_BLOCKS + 1))  # the partial block is never offloaded
TARGET_BLOCKS = list(range(16, 16 + FULL_BLOCKS + 1))

CONFIG = {
    # CPUOffloadingSpec (the default) is host memory only; 16 slots of one block each.
    "spec_name": "CPUOffloadingSpec",
    "cpu_bytes_to_use": 16 * GEOMETRY.slot_bytes(1),
}


def make_device_kv() -> list[torch.Tensor]:
    """One tensor per layer, ``[num_blocks, 2 (K/V), block_size, heads, head_dim]``, random contents."""
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_DEVICE_BLOCKS, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(GEOMETRY.num_layers)]


def blocks_match(kv: list[torch.Tensor], blocks: int) -> bool:
    """Do target blocks hold exactly what the source blocks held?"""
    return all(
        torch.equal(layer[SOURCE_BLOCKS[i]], layer[TARGET_BLOCKS[i]])
        for layer in kv
        for i in range(blocks)
    )


def report(mode: str, stored: int, loaded: int, ok: bool, stats: dict[str, Any]) -> None:
    host = stats["0:primary"]
    copies = stats["copies"]
    print(f"{mode}: stored {stored} tokens, loaded {loaded} of {len(PROMPT)} into other blocks; "
          f"contents match: {ok}")
    print(f"{mode}: host tier used_slots={host.used_slots}/{host.num_slots} "
          f"pinned_slots={host.pinned_slots} "
          f"bytes_to_host={copies.bytes_to_host} bytes_to_device={copies.bytes_to_device}")


async def with_event_loop() -> bool:
    kv = make_device_kv()
    async with kvtier.open(CONFIG, GEOMETRY, kv) as engine:
        stored = await engine.store(PROMPT, SOURCE_BLOCKS)
        cached = engine.cached_prefix_tokens(PROMPT)
        loaded = await engine.load(PROMPT, TARGET_BLOCKS)
        ok = loaded == cached == FULL_BLOCKS * GEOMETRY.block_size and blocks_match(kv, FULL_BLOCKS)
        report("kvtier.open", stored, loaded, ok, engine.statistics())
    return ok


def without_event_loop() -> bool:
    kv = make_device_kv()
    with kvtier.start_in_thread(CONFIG, GEOMETRY, kv) as engine:  # close() on exit stops the thread
        stored = engine.store(PROMPT, SOURCE_BLOCKS)
        loaded = engine.load(PROMPT, TARGET_BLOCKS)
        ok = loaded == FULL_BLOCKS * GEOMETRY.block_size and blocks_match(kv, FULL_BLOCKS)
        report("start_in_thread", stored, loaded, ok, engine.statistics())
    return ok


def main() -> None:
    ok = anyio.run(with_event_loop)
    ok = without_event_loop() and ok
    if not ok:
        raise SystemExit(1)
    print("cpu_only: all round trips byte-identical")


if __name__ == "__main__":
    main()

"""Random interleavings of store / load / touch / reset against failing tiers.

The invariants: a load never returns bytes other than what was stored for that prefix; every
tier job is reported exactly once; once everything finished no host slot stays pinned.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import anyio
import pytest
import torch

import kvtier
from kvtier import KVGeometry

BLOCK = 4
LAYERS = 2
HEADS = 1
DIM = 8
NUM_BLOCKS = 256
STEPS = 10_000
WORKERS = 4


def chunk_payload(prefix: tuple[int, ...]) -> list[torch.Tensor]:
    """Deterministic KV for a chunk, derived from its whole token prefix (content addressing)."""
    seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "big")
    gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return [torch.randn((2, BLOCK, HEADS, DIM), generator=gen).to(torch.float16) for _ in range(LAYERS)]


@pytest.mark.anyio
@pytest.mark.slow
async def test_random_interleavings_never_corrupt_leak_or_double_report() -> None:
    geometry = KVGeometry("stress/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                          dtype="float16", block_size=BLOCK)
    kv = [torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 12 * geometry.slot_bytes(1),
        "eviction_policy": "arc",
        "secondary_tiers": [
            {"type": "faulty", "capacity_bytes": 40 * geometry.slot_bytes(1),
             "fail_read_fraction": 0.2, "fail_write_fraction": 0.2, "seed": 7},
            {"type": "faulty", "capacity_bytes": 1 << 26, "fail_read_fraction": 0.1,
             "fail_write_fraction": 0.1, "seed": 8},
        ],
    }
    rng = random.Random(1234)
    # 30 conversations sharing a 2-chunk system prompt, each up to 5 chunks long.
    system = [rng.randrange(1, 1000) for _ in range(2 * BLOCK)]
    convs = [system + [rng.randrange(1, 1000) for _ in range(3 * BLOCK)] for _ in range(30)]
    free_blocks = list(range(NUM_BLOCKS))
    reported: Counter[tuple[str, int]] = Counter()
    checked_loads = 0

    async with kvtier.open(config, geometry, kv, wait_timeout_s=5) as engine:
        for tier in engine.tiers:
            original = tier.get_finished_jobs

            def recording(original=original, label=tier.context.label):  # noqa: ANN001
                results = original()
                for result in results:
                    reported[(label, result.job_id)] += 1
                return results

            tier.get_finished_jobs = recording  # type: ignore[method-assign]

        async def worker(seed: int) -> None:
            nonlocal checked_loads
            wrng = random.Random(seed)
            for _ in range(STEPS // WORKERS):
                tokens = convs[wrng.randrange(len(convs))][: wrng.randint(1, 5) * BLOCK]
                nchunks = len(tokens) // BLOCK
                blocks = [free_blocks.pop() for _ in range(nchunks)]
                try:
                    op = wrng.random()
                    if op < 0.45:
                        for c, block in enumerate(blocks):
                            for layer, data in zip(kv, chunk_payload(tuple(tokens[: (c + 1) * BLOCK]))):
                                layer[block].copy_(data)
                        await engine.store(tokens, blocks)
                    elif op < 0.95:
                        for block in blocks:
                            for layer in kv:
                                layer[block].fill_(float("nan"))
                        placed = await engine.load(tokens, blocks)
                        assert placed % BLOCK == 0 and placed <= len(tokens)
                        for c in range(placed // BLOCK):
                            expected = chunk_payload(tuple(tokens[: (c + 1) * BLOCK]))
                            for layer, data in zip(kv, expected):
                                assert torch.equal(layer[blocks[c]], data), "load returned wrong bytes"
                        checked_loads += 1
                    elif op < 0.99:
                        engine.manager.touch(engine.chunk_keys(tokens), kvtier.RequestContext("touch"))
                    else:
                        await engine.reset_cache()
                finally:
                    free_blocks.extend(blocks)

        async with anyio.create_task_group() as tg:
            for w in range(WORKERS):
                tg.start_soon(worker, 100 + w)
        await engine.drain()
        host = engine.statistics()["0:primary"]
        assert host.pinned_slots == 0
        assert engine.manager.jobs_in_flight == 0
    assert checked_loads > STEPS // 4
    assert reported and max(reported.values()) == 1, "a job was reported twice"

"""Tensor parallelism: each engine rank holds, stores and loads its own heads only.

Every rank of a TP group is its own process with its own ``kvtier.open``: its host slots hold
its heads densely (``KVModel.rank_local``), and its chunks go to a tree of its own, so that no
rank (nor a TP 1 engine of the same model) ever loads another rank's heads as its own.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.model import KVModel
from kvtier.tiers.base import TierContext
from kvtier.tiers.p2p.roles import fingerprint

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 16, 4, 8, 16


def geometry(tp_size: int) -> KVGeometry:
    return KVGeometry("test/tp-model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16",
                      block_size=BLOCK, tp_size=tp_size)


def config(root: Path, tp_size: int) -> dict:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * geometry(tp_size).slot_bytes(1),
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}


def device_kv(tp_size: int, fill: float) -> list[torch.Tensor]:
    return [torch.full((NUM_BLOCKS, 2, BLOCK, HEADS // tp_size, DIM), fill, dtype=torch.float16)
            for _ in range(LAYERS)]


@pytest.mark.anyio
async def test_each_rank_loads_back_its_own_heads_from_a_shared_root(tmp_path: Path) -> None:
    tokens = [random.Random(3).randrange(1, 50_000) for _ in range(2 * BLOCK)]
    for rank in range(2):  # each rank stores the same tokens, with its own heads
        async with kvtier.open(config(tmp_path, 2), geometry(2), device_kv(2, 1.0 + rank), tp_rank=rank) as engine:
            assert engine.slot_bytes == geometry(2).slot_bytes(1) // 2  # its heads only, no room for others
            assert await engine.store(tokens, [3, 4]) == 2 * BLOCK
            await engine.drain()
    files = sorted(tmp_path.rglob("*.bin"))
    assert len(files) == 4 and len({f.parent.parent.parent.name for f in files}) == 2  # a tree per rank
    # A file holds one rank's chunk (half the heads) and its trailer page, no padding for the others.
    assert {f.stat().st_size for f in files} == {geometry(2).slot_bytes(1) // 2 + 4096}
    for rank in range(2):  # fresh engines: every byte comes from the rank's own files
        kv = device_kv(2, 0.0)
        async with kvtier.open(config(tmp_path, 2), geometry(2), kv, tp_rank=rank) as engine:
            assert await engine.load(tokens, [6, 7]) == 2 * BLOCK
        for layer in kv:
            assert layer[6:8].eq(1.0 + rank).all() and not layer[:6].any()
    # A TP 1 engine of the same model does not mistake a rank's files for whole chunks.
    async with kvtier.open(config(tmp_path, 1), geometry(1), device_kv(1, 0.0)) as engine:
        assert await engine.load(tokens, [6, 7]) == 0


@pytest.mark.anyio
async def test_tp_rank_outside_the_models_tp_size_is_refused_at_the_call(tmp_path: Path) -> None:
    for rank in (2, -1, True, 1.0):
        with pytest.raises(ConfigError, match="tp_rank"):
            async with kvtier.open(config(tmp_path, 2), geometry(2), device_kv(2, 0.0), tp_rank=rank):
                pass


def test_a_p2p_peer_of_another_rank_has_another_identity() -> None:
    model = KVModel.of(geometry(2))

    def identity(rank: int, model: KVModel = model) -> str:
        return fingerprint(TierContext(index=0, label="1:p2p", slot_bytes=4096, host=None, geometry=model,
                                       blocks_per_chunk=1, run_fields=model.run_fields(1), rank=rank))

    assert identity(0) != identity(1)
    assert identity(1) == identity(1)
    whole = KVModel.of(geometry(1))
    assert identity(0, whole) == identity(1, whole)  # one tree for all ranks: the rank is not named

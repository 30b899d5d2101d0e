"""``scripts/gpu_check.py`` runs where there is no GPU to try it first: what of it runs on CPU is
checked here, so a session with a GPU lent does not spend its device time on a script error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from kvtier.model import KVModel

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["gpu_check"]
    return module


def test_the_script_imports_without_cuda_and_its_kv_writes_land_in_place() -> None:
    script = load_script()
    geo = script.geometry(layers=2, heads=8, tp=8)
    kv = [torch.zeros((6, 2, geo.block_size, 1, geo.head_dim), dtype=torch.float16) for _ in range(2)]
    script.write_blocks(kv, [1, 4], 7.0)
    for layer in kv:
        assert layer[[1, 4]].eq(7.0).all() and not layer[[0, 2, 3, 5]].any()
    # A TP 8 rank's slots (what the harness allocates): one eighth of a slot of every head.
    assert KVModel.of(geo).rank_local().slot_bytes(1) * 8 == geo.slot_bytes(1)

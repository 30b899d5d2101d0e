"""A hybrid model in kvtier: full attention, sliding-window attention and Mamba state side by side.

The model is described as a ``kvtier.KVModel`` with one ``kvtier.KVCacheGroup`` per kind of
layer, and its device memory (CPU tensors standing in for GPU memory) is a mapping from layer
name to tensor: ``[num_blocks, 2, block_size, heads, head_dim]`` for an attention layer, a tuple
of ``[num_blocks, *state_shape]`` tensors for a Mamba layer. ``block_ids`` holds one block table
per group. One prompt is stored, then loaded back into fresh blocks (filled with NaN), and the
example prints what each group got:

* full attention: every block of the prefix;
* sliding window: only the blocks of the last ``window`` tokens before the hit (the rest stay NaN);
* Mamba: only the block holding the state after the hit's last token.

::

    python examples/hybrid_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kvtier  # noqa: E402

BLOCK = 16
WINDOW = 32
NUM_BLOCKS = 16
MODEL = kvtier.KVModel("example/tiny-hybrid", "float16", groups=(
    kvtier.KVCacheGroup.full_attention(block_size=BLOCK, layer_names=["layers.0.attn", "layers.3.attn"],
                                       num_kv_heads=2, head_dim=32),
    kvtier.KVCacheGroup.sliding_window(window=WINDOW, block_size=BLOCK, layer_names=["layers.1.attn"],
                                       num_kv_heads=2, head_dim=32),
    kvtier.KVCacheGroup.mamba(block_size=BLOCK, layer_names=["layers.2.mixer"],
                              state_shapes=[(3, 64), (64,)], state_dtypes=["float32", "float32"]),
))
PROMPT = [(7 * i + 3) % 32000 for i in range(BLOCK * 6 + 5)]  # 6 full blocks and a partial one
TOKEN_BLOCKS = -(-len(PROMPT) // BLOCK)
# Each group's own block table: where its token blocks live on the device, before and after.
SOURCE = [list(range(TOKEN_BLOCKS)), list(range(8, 8 + TOKEN_BLOCKS)), list(range(1, 1 + TOKEN_BLOCKS))]
TARGET = [list(range(8, 8 + TOKEN_BLOCKS)), list(range(TOKEN_BLOCKS)), list(range(9, 9 + TOKEN_BLOCKS))]
CONFIG = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 * MODEL.slot_bytes(1)}


def make_device_kv() -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Per layer: K/V pages (attention) or state tensors (Mamba), random contents."""
    gen = torch.Generator().manual_seed(0)
    device_kv: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for group in MODEL.groups:
        for name in group.layer_names:
            if group.kind == "mamba":
                device_kv[name] = tuple(torch.randn(NUM_BLOCKS, *shape, generator=gen)
                                        for shape in group.state_shapes or ())
            else:
                shape = (NUM_BLOCKS, 2, BLOCK, group.num_kv_heads or 0, group.head_dim or 0)
                device_kv[name] = torch.randn(shape, generator=gen).to(torch.float16)
    return device_kv


def tensors(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def needed(kind: str, hit: int) -> list[int]:
    """The token blocks a load of ``hit`` tokens must place in a group of ``kind``."""
    if kind == "sliding_window":
        return list(range(max(0, hit - WINDOW) // BLOCK, hit // BLOCK))
    if kind == "mamba":
        return [hit // BLOCK - 1]
    return list(range(hit // BLOCK))


async def main() -> None:
    device_kv = make_device_kv()
    for g, group in enumerate(MODEL.groups):  # the target blocks start out as NaN: "nothing here"
        for name in group.layer_names:
            for tensor in tensors(device_kv[name]):
                tensor[TARGET[g]] = float("nan")
    async with kvtier.open(CONFIG, MODEL, device_kv) as engine:
        await engine.store(PROMPT, SOURCE, num_prompt_tokens=len(PROMPT))
        await engine.drain()
        hit = await engine.load(PROMPT, TARGET, num_computed_tokens=0)
        copied = engine.statistics()["copies"].bytes_to_device
    print(f"loaded {hit} of {len(PROMPT)} prompt tokens ({copied} bytes copied to the device)")
    ok = True
    for g, group in enumerate(MODEL.groups):
        loaded, untouched = [], []
        for i in range(TOKEN_BLOCKS):
            layers = [tensors(device_kv[name]) for name in group.layer_names]
            if all(torch.isnan(t[TARGET[g][i]]).all() for layer in layers for t in layer):
                untouched.append(i)
            elif all(torch.equal(t[TARGET[g][i]], t[SOURCE[g][i]]) for layer in layers for t in layer):
                loaded.append(i)
            else:
                ok = False
        ok = ok and loaded == needed(group.kind, hit)
        print(f"group {g} ({group.kind}, layers {', '.join(group.layer_names)}): token blocks {loaded} loaded, "
              f"{untouched} untouched")
    if not ok:
        raise SystemExit("hybrid_model: a group did not get exactly the blocks its load needs")
    print("hybrid_model: every group got exactly what a load at the hit needs, byte-identical")


if __name__ == "__main__":
    anyio.run(main)

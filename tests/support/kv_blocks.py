"""Test helpers: fill device KV blocks with random data and compare them afterwards."""

from __future__ import annotations

import torch


def fill_block(kv: list[torch.Tensor], block: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Write random values into ``block`` of every layer; return copies of what was written."""
    data = []
    for layer in kv:
        layer[block].copy_(torch.randn(layer[block].shape, generator=gen).to(layer.dtype))
        data.append(layer[block].clone())
    return data


def block_equals(kv: list[torch.Tensor], block: int, expected: list[torch.Tensor]) -> bool:
    """Whether ``block`` of every layer holds exactly ``expected`` (from :func:`fill_block`)."""
    return all(torch.equal(layer[block], exp) for layer, exp in zip(kv, expected))

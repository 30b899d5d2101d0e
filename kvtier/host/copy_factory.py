"""Pick the copy engine that fits a KV cache: :func:`make_copy_engine`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.host.copy_engine import CopyEngine
from kvtier.host.copy_plan import first_tensor
from kvtier.host.cpu_copy import CpuCopyEngine
from kvtier.host.cuda_copy import CudaCopyEngine

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry

__all__ = ["make_copy_engine"]


def make_copy_engine(
    device_kv: torch.Tensor | Sequence[torch.Tensor],
    geometry: KVGeometry,
    blocks_per_chunk: int,
    buffer: SlotBuffer,
    tp_rank: int = 0,
    **options: Any,
) -> CopyEngine:
    """The CUDA engine when ``device_kv`` lives on a CUDA device, the CPU engine otherwise."""
    if first_tensor(device_kv).device.type == "cuda":
        return CudaCopyEngine(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, **options)
    return CpuCopyEngine(device_kv, geometry, blocks_per_chunk, buffer, tp_rank, **options)

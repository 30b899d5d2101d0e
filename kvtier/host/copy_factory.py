"""Pick the copy engine that fits a KV cache: :func:`make_copy_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.host.copy_engine import CopyEngine
from kvtier.host.copy_plan import DeviceKV, first_tensor
from kvtier.host.cpu_copy import CpuCopyEngine
from kvtier.host.cuda_copy import CudaCopyEngine

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry
    from kvtier.model import KVModel

__all__ = ["make_copy_engine"]


def make_copy_engine(
    device_kv: DeviceKV,
    model: KVModel | KVGeometry,
    blocks_per_chunk: int,
    buffer: SlotBuffer,
    **options: Any,
) -> CopyEngine:
    """The CUDA engine when ``device_kv`` lives on a CUDA device, the CPU engine otherwise.

    ``device_kv`` takes the forms of :mod:`kvtier.host.copy_plan` (a list of per-layer tensors or
    a cross-layer tensor for a one-group model, else a mapping layer name → tensor(s)).
    """
    if first_tensor(device_kv).device.type == "cuda":
        return CudaCopyEngine(device_kv, model, blocks_per_chunk, buffer, **options)
    return CpuCopyEngine(device_kv, model, blocks_per_chunk, buffer, **options)

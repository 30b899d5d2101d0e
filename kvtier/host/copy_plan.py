"""The plan of one rank's copies: validated shapes plus the tensor views a job copies between.

Layouts (``docs/internals.md``): ``device_kv`` is either a list of per-layer tensors
``[num_blocks, 2, block_size, heads, head_dim]`` or one cross-layer tensor
``[num_blocks, num_layers, 2, block_size, heads, head_dim]``; ``heads`` is this TP rank's share.
A host slot is canonical and independent of TP: page ``(b, l)`` at ``(b * num_layers + l) *
page_bytes``, i.e. the slot viewed as ``[bpc, num_layers, 2, block_size, all_heads, head_dim]``.
A rank copies into its head slice of every page, so ``tp_size`` ranks together fill one slot.

Every copy engine builds one :class:`CopyPlan` and moves bytes only between the views it hands out;
which copy routine fits a job (:meth:`CopyPlan.gathers`, :meth:`CopyPlan.runs_contiguous`) is
decided here too, from the layout alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import ConfigError
from kvtier.host.copy_jobs import CopyJob

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer
    from kvtier.layout import KVGeometry

__all__ = ["CopyPlan", "first_tensor"]


def _head_slice(geometry: KVGeometry, tp_rank: int) -> tuple[int, int]:
    """(first head, head count) of ``tp_rank``'s KV heads inside a canonical page."""
    try:
        shard = geometry.shard(tp_rank)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return shard.heads_start, shard.heads_count


class CopyPlan:
    """Validated shapes plus the tensor views one job copies between.

    Built once per engine; :meth:`pairs` yields ``(host_view, device_view)`` tensor pairs for a
    job, coalescing runs of consecutive device blocks into one copy (with the cross-layer layout a
    run is one contiguous region on both sides when ``tp_size == 1``).
    """

    def __init__(
        self,
        device_kv: torch.Tensor | Sequence[torch.Tensor],
        geometry: KVGeometry,
        blocks_per_chunk: int,
        buffer: SlotBuffer,
        tp_rank: int,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ConfigError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.bpc = blocks_per_chunk
        self.num_layers = int(geometry.num_layers)
        two, block_size, all_heads, head_dim = (int(x) for x in geometry.page_shape)
        head_start, heads = _head_slice(geometry, tp_rank)
        dtype = geometry.torch_dtype
        self.dtype = dtype
        page = (two, block_size, heads, head_dim)

        if isinstance(device_kv, torch.Tensor):
            self.cross_layer = True
            tensors = [device_kv]
            expected: tuple[str | int, ...] = ("num_blocks", self.num_layers, *page)
            legend = "num_blocks, num_layers, K/V, block_size, this rank's kv heads, head_dim"
        else:
            self.cross_layer = False
            tensors = list(device_kv)
            if len(tensors) != self.num_layers:
                raise ConfigError(
                    f"device_kv has {len(tensors)} per-layer tensors, geometry has {self.num_layers} layers"
                )
            expected = ("num_blocks", *page)
            legend = "num_blocks, K/V, block_size, this rank's kv heads, head_dim"
        if not tensors:
            raise ConfigError("device_kv is empty")
        num_blocks = int(tensors[0].shape[0]) if tensors[0].dim() > 0 else 0
        device = tensors[0].device
        for idx, t in enumerate(tensors):
            where = "device_kv" if self.cross_layer else f"device_kv[{idx}]"
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"{where} is a {type(t).__name__}, expected a torch.Tensor")
            if tuple(t.shape[1:]) != tuple(expected[1:]) or t.dim() != len(expected):
                raise ConfigError(f"{where} has shape {tuple(t.shape)}, expected {expected} ({legend})")
            if t.shape[0] != num_blocks:
                raise ConfigError(f"{where} has {t.shape[0]} blocks, device_kv[0] has {num_blocks}")
            if t.dtype != dtype:
                raise ConfigError(f"{where} has dtype {t.dtype}, geometry says {dtype}")
            if t.device != device:
                raise ConfigError(f"{where} is on {t.device}, device_kv[0] is on {device}")
            if not t.is_contiguous():
                # Copies address blocks by offset (and the CPU engine views the bytes in place):
                # a transposed or sliced tensor would be read and written at the wrong places.
                raise ConfigError(
                    f"{where} must be contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)}); "
                    "pass the KV cache tensor itself, not a transposed or strided view of it"
                )
        if num_blocks < 1:
            raise ConfigError("device_kv has no blocks")
        self.device = device
        self.num_blocks = num_blocks
        self.device_kv = tensors

        page_bytes = int(geometry.page_bytes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if page_bytes != two * block_size * all_heads * head_dim * itemsize:
            raise ConfigError(f"geometry.page_bytes {page_bytes} does not match page_shape × itemsize")
        self.chunk_bytes = blocks_per_chunk * self.num_layers * page_bytes
        if buffer.slot_bytes < self.chunk_bytes:
            raise ConfigError(
                f"host slot of {buffer.slot_bytes} bytes cannot hold a chunk of {self.chunk_bytes} bytes"
            )
        self.buffer = buffer
        self.num_slots = buffer.num_slots
        # The whole host buffer as [num_slots, bpc, layers, 2, block_size, all_heads, head_dim]
        # (slot stride = slot_bytes, so padding is skipped), narrowed to this rank's heads.
        host = buffer.tensor
        if host.device.type != "cpu":  # pragma: no cover - SlotBuffer always lives on the host
            raise ConfigError("host buffer must be CPU memory")
        elems_per_slot = buffer.slot_bytes // itemsize
        full = host.view(-1).view(dtype)
        shape = (buffer.num_slots, blocks_per_chunk, self.num_layers, two, block_size, all_heads, head_dim)
        strides = [0] * len(shape)
        acc = 1
        for dim in range(len(shape) - 1, 0, -1):
            strides[dim] = acc
            acc *= shape[dim]
        strides[0] = elems_per_slot
        self.host = full.as_strided(shape, strides)[..., head_start : head_start + heads, :]
        # Bytes this rank moves per chunk (its head share of every page).
        self.rank_chunk_bytes = blocks_per_chunk * self.num_layers * two * block_size * heads * head_dim * itemsize
        #: This rank holds every head: its part of a host page is the whole page (contiguous).
        self.whole_pages = heads == all_heads

    def validate(self, job: CopyJob) -> str | None:
        """Why ``job`` cannot run, or ``None`` when it is well formed."""
        if job.direction not in ("to_host", "to_device"):
            return f"unknown direction {job.direction!r}"
        if job.layers is not None:
            start, stop = job.layers
            if not 0 <= start < stop <= self.num_layers:
                return f"layers {job.layers} is not a non-empty range inside [0, {self.num_layers})"
        if len(job.block_ids) != len(job.slot_ids) * self.bpc:
            return (
                f"{len(job.block_ids)} block ids for {len(job.slot_ids)} slots "
                f"(blocks_per_chunk={self.bpc})"
            )
        for s in job.slot_ids:
            if not 0 <= s < self.num_slots:
                return f"slot id {s} out of range [0, {self.num_slots})"
        for b in job.block_ids:
            if not 0 <= b < self.num_blocks:
                return f"block id {b} out of range [0, {self.num_blocks})"
        return None

    def layer_range(self, job: CopyJob) -> tuple[int, int]:
        """``(start, stop)`` of the layers ``job`` copies (all of them when ``job.layers`` is ``None``)."""
        return job.layers if job.layers is not None else (0, self.num_layers)

    def job_bytes(self, job: CopyJob) -> int:
        """Bytes this rank moves for ``job`` (its head share of the pages of the job's layers)."""
        start, stop = self.layer_range(job)
        return self.rank_chunk_bytes // self.num_layers * (stop - start) * len(job.slot_ids)

    def gathers(self, job: CopyJob) -> bool:
        """Whether :func:`kvtier.host.cuda_copy.copy_gathered` can move ``job``: the per-layer
        layout at TP 1, with every chunk's part of the host slot contiguous (all layers, or one
        block per chunk)."""
        return (not self.cross_layer and self.whole_pages
                and (job.layers is None or self.bpc == 1 or self.layer_range(job) == (0, self.num_layers)))

    def runs_contiguous(self, job: CopyJob) -> bool:
        """Whether each run of consecutive blocks of ``job`` is one contiguous range on both sides
        (the cross-layer layout at TP 1, all layers): :func:`kvtier.host.cuda_copy.copy_pairs`
        then copies one range per run."""
        return self.cross_layer and self.whole_pages and self.layer_range(job) == (0, self.num_layers)

    def pairs(
        self,
        job: CopyJob,
        host: Any = None,
        device_kv: Sequence[Any] | None = None,
        *,
        block_at_a_time: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """``(host_view, device_view)`` pairs covering the job, in chunk order.

        ``host``/``device_kv`` default to the torch views; the CPU engine passes numpy byte views
        of the same memory (indexed identically), which are far cheaper to slice.
        ``block_at_a_time`` splits per-layer runs into single blocks, so that (at TP 1) every
        host view is contiguous: a run of pages of one layer is strided in the host slot, and
        torch would stage a strided device↔host copy through a pageable temporary. The same
        holds for a run of a cross-layer job restricted to some layers (``job.layers``), while
        one block's pages of consecutive layers are contiguous on both sides.
        """
        host = self.host if host is None else host
        device_kv = self.device_kv if device_kv is None else device_kv
        bpc = self.bpc
        block_ids = job.block_ids
        first_layer, stop_layer = self.layer_range(job)
        all_layers = (first_layer, stop_layer) == (0, self.num_layers)
        layers = slice(first_layer, stop_layer)
        for i, slot in enumerate(job.slot_ids):
            host_chunk = host[slot]
            blocks = block_ids[i * bpc : (i + 1) * bpc]
            for first, start, n in _runs(blocks):
                host_run = host_chunk[first : first + n]
                if self.cross_layer and all_layers:
                    yield host_run, device_kv[0][start : start + n]
                elif self.cross_layer and block_at_a_time and n > 1:
                    for offset in range(n):
                        yield (host_run[offset : offset + 1, layers],
                               device_kv[0][start + offset : start + offset + 1, layers])
                elif self.cross_layer:
                    yield host_run[:, layers], device_kv[0][start : start + n, layers]
                elif block_at_a_time and n > 1:
                    for offset in range(n):
                        for layer in range(first_layer, stop_layer):
                            dev = device_kv[layer]
                            yield host_run[offset : offset + 1, layer], dev[start + offset : start + offset + 1]
                else:
                    for layer in range(first_layer, stop_layer):
                        yield host_run[:, layer], device_kv[layer][start : start + n]


def first_tensor(device_kv: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The cross-layer tensor, or the first per-layer one (whose device is every tensor's);
    ``ConfigError`` when ``device_kv`` is empty."""
    if isinstance(device_kv, torch.Tensor):
        return device_kv
    for tensor in device_kv:
        return tensor
    raise ConfigError("device_kv is empty")


def _runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in chunk, first device block, length) of each run of consecutive device blocks."""
    n = len(blocks)
    i = 0
    while i < n:
        j = i + 1
        while j < n and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield i, int(blocks[i]), j - i
        i = j

"""The plan of one rank's copies: validated device tensors plus the tensor views a job copies between.

The model is a :class:`kvtier.model.KVModel` (a :class:`kvtier.layout.KVGeometry` is its
one-group case). ``device_kv`` takes one of these forms:

* a list of per-layer tensors, or one cross-layer tensor ``[num_blocks, num_layers, *page]``:
  only for a model with one KV-cache group (the layer order is the group's);
* a mapping layer name → tensor for attention and MLA layers, layer name → sequence of tensors
  (one per state shape, in order) for Mamba layers, naming every layer of the model; an attention
  or MLA group may instead be given whole, as group index → one cross-layer tensor
  ``[num_blocks, group layers, *page]`` (in the group's layer order).

Per layer a full- or sliding-window-attention tensor is ``[num_blocks, 2, block_size,
num_kv_heads // tp_size, head_dim]`` (this rank's heads), an MLA tensor ``[num_blocks,
block_size, latent_dim]`` and Mamba state ``k`` ``[num_blocks, *state_shapes[k]]`` (in
``state_dtypes[k]``); MLA latents and Mamba state are whole on every rank. The tensors of one
group share ``num_blocks``; every tensor is contiguous and on one device.

A host slot holds one chunk of this rank's KV (``docs/internals.md``): a chunk of group ``g`` is
block-major, then the group's layers, then the group's page as this rank holds it
(:meth:`kvtier.model.KVModel.rank_local`: its parts at their offsets, an attention part with this
rank's ``num_kv_heads // tp_size`` heads), i.e. page ``(b, l)`` of the group at
``(b * num_layers + l) * page_bytes``. With one full-attention group this is the slot viewed as
``[bpc, num_layers, 2, block_size, rank_heads, head_dim]``: at any TP size a rank's slot is as
dense as a TP 1 slot, with no room for other ranks' heads.

:func:`plan_copies` validates ``device_kv`` against the model and returns :class:`CopyPlans`:
per group one :class:`CopyPlan` per page part, which hands out the views a job of that group
copies between. Which copy routine fits a part of a job (:meth:`CopyPlan.gathers`,
:meth:`CopyPlan.runs_contiguous`) is decided here too, from the layout and the job's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, Union

import torch

from kvtier.errors import ConfigError
from kvtier.host.copy_jobs import CopyJob
from kvtier.layout import KVGeometry, torch_dtype
from kvtier.model import KVCacheGroup, KVModel, PagePart

if TYPE_CHECKING:
    from kvtier.host.slots import SlotBuffer

__all__ = ["DeviceKV", "CopyPlan", "CopyPlans", "plan_copies", "first_tensor"]

#: What an engine is opened with (module docstring).
DeviceKV: TypeAlias = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, Union[torch.Tensor, Sequence[torch.Tensor]]]]


class CopyPlan:
    """The views one part of one group's pages is copied between, for one rank.

    ``part`` is the part as this rank holds it (:meth:`kvtier.model.KVModel.rank_local`).
    ``tensors`` are the group's device tensors of this part: one per layer ``[num_blocks,
    *part.shape]``, or one cross-layer tensor ``[num_blocks, num_layers, *part.shape]``
    (validated by :func:`plan_copies`). ``bpc`` is the device blocks one chunk of the group
    copies (``KVCacheGroup.blocks_per_slot``). :meth:`pairs` yields ``(host_view, device_view)``
    tensor pairs for a job, coalescing runs of consecutive device blocks into one copy (with the
    cross-layer layout a run is one contiguous region on both sides when the part is the whole
    page).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        part: PagePart,
        *,
        cross_layer: bool,
        num_layers: int,
        page_bytes: int,
        blocks_per_slot: int,
        buffer: SlotBuffer,
    ) -> None:
        if blocks_per_slot < 1:
            raise ConfigError(f"blocks_per_chunk must be >= 1, got {blocks_per_slot}")
        if not tensors:
            raise ConfigError("device_kv is empty")
        self.part = part
        self.bpc = blocks_per_slot
        self.num_layers = num_layers
        self.cross_layer = cross_layer
        self.device_kv = list(tensors)
        self.device = self.device_kv[0].device
        self.num_blocks = int(self.device_kv[0].shape[0])
        self.dtype = torch_dtype(part.dtype)
        itemsize = part.itemsize
        for name, value in (("page_bytes", page_bytes), ("part offset", part.offset), ("slot_bytes", buffer.slot_bytes)):
            if value % itemsize:
                raise ConfigError(f"{name} {value} is not a multiple of the {part.dtype} element size {itemsize}")
        self.buffer = buffer
        self.num_slots = buffer.num_slots
        # The whole host buffer as [num_slots, bpc, layers, *part.shape] over the slots' bytes (slot
        # stride = slot_bytes, page stride = page_bytes: padding and other parts are skipped).
        host = buffer.tensor
        if host.device.type != "cpu":  # pragma: no cover - SlotBuffer always lives on the host
            raise ConfigError("host buffer must be CPU memory")
        full = host.view(-1).view(self.dtype)
        shape = (buffer.num_slots, blocks_per_slot, num_layers, *part.shape)
        strides = [0] * len(shape)
        acc = 1
        for dim in range(len(shape) - 1, 2, -1):
            strides[dim] = acc
            acc *= shape[dim]
        strides[2] = page_bytes // itemsize
        strides[1] = num_layers * strides[2]
        strides[0] = buffer.slot_bytes // itemsize
        self.host = full.as_strided(shape, strides, part.offset // itemsize)
        #: The part is the whole page: one part, so a run of pages is one contiguous range.
        self.whole_pages = part.nbytes == page_bytes

    def layer_range(self, job: CopyJob) -> tuple[int, int]:
        """``(start, stop)`` of the layers ``job`` copies (all of them when ``job.layers`` is ``None``)."""
        return job.layers if job.layers is not None else (0, self.num_layers)

    def job_bytes(self, job: CopyJob) -> int:
        """Bytes this part of ``job`` moves (its share of the pages of the job's layers)."""
        start, stop = self.layer_range(job)
        return self.part.nbytes * self.bpc * (stop - start) * len(job.slot_ids)

    def gathers(self, job: CopyJob) -> bool:
        """Whether :func:`kvtier.host.cuda_copy.copy_gathered` moves ``job``: whole pages, every
        chunk's part of the host slot contiguous — the per-layer layout (all layers, or one block
        per chunk), or the cross-layer layout (all layers) when the job's blocks make more runs
        than it has chunks (one gather and a copy per chunk then beat a copy per run)."""
        if not self.whole_pages:
            return False
        if self.cross_layer:
            return self.layer_range(job) == (0, self.num_layers) and _run_count(job.block_ids, self.bpc) > len(job.slot_ids)
        return job.layers is None or self.bpc == 1 or self.layer_range(job) == (0, self.num_layers)

    def runs_contiguous(self, job: CopyJob) -> bool:
        """Whether each run of consecutive blocks of ``job`` is one contiguous range on both sides
        (the cross-layer layout with whole pages, all layers): :func:`kvtier.host.cuda_copy.copy_pairs`
        then copies one range per run (unless :meth:`gathers` says gathering takes fewer copies)."""
        return self.cross_layer and self.whole_pages and self.layer_range(job) == (0, self.num_layers)

    def pairs(
        self,
        job: CopyJob,
        host: Any = None,
        device_kv: Sequence[Any] | None = None,
        *,
        block_at_a_time: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """``(host_view, device_view)`` pairs covering this part of the job, in chunk order.

        ``host``/``device_kv`` default to the torch views; the CPU engine passes numpy byte views
        of the same memory (indexed identically), which are far cheaper to slice.
        ``block_at_a_time`` splits per-layer runs into single blocks, so that (with whole or
        contiguous pages) every host view is contiguous: a run of pages of one layer is strided in
        the host slot, and torch would stage a strided device↔host copy through a pageable
        temporary. The same holds for a run of a cross-layer job restricted to some layers
        (``job.layers``), while one block's pages of consecutive layers are contiguous on both sides.
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


class CopyPlans:
    """One rank's plans for every group of ``model``: ``groups[g]`` holds one :class:`CopyPlan`
    per part of group ``g``'s page, in page order. Built by :func:`plan_copies`."""

    def __init__(self, model: KVModel, blocks_per_chunk: int, groups: Sequence[Sequence[CopyPlan]]) -> None:
        self.model = model
        self.blocks_per_chunk = blocks_per_chunk
        self.groups = tuple(tuple(plans) for plans in groups)
        self.device = self.groups[0][0].device
        #: Device blocks of each group: a group's valid block ids are ``[0, group_blocks[g])``.
        self.group_blocks = tuple(plans[0].num_blocks for plans in self.groups)
        self._unwritten = tuple(_unwritten(model, g, blocks_per_chunk, plans[0].buffer.slot_bytes)
                                for g, plans in enumerate(self.groups))

    def clear_unwritten(self, job: CopyJob) -> None:
        """Zero the bytes of the job's slots that its copies do not write: the slot's tail past
        the group's chunk and the gaps between the parts of its pages. A slot that last held a
        larger chunk (of another group, perhaps another request's) then carries none of its bytes
        into this chunk, whose whole slot goes to storage. Run before a store's copies (host
        memory only: the copies write none of these bytes)."""
        unwritten = self._unwritten[job.group]
        if not unwritten:
            return
        array = self.groups[job.group][0].buffer.array
        chunk_bytes, page_bytes, gaps = unwritten
        for slot in job.slot_ids:
            row = array[slot]
            row[chunk_bytes:] = 0
            if gaps:
                pages = row[:chunk_bytes].reshape(-1, page_bytes)
                for start, stop in gaps:
                    pages[:, start:stop] = 0

    def validate(self, job: CopyJob) -> str | None:
        """Why ``job`` cannot run, or ``None`` when it is well formed."""
        if job.direction not in ("to_host", "to_device"):
            return f"unknown direction {job.direction!r}"
        if isinstance(job.group, bool) or not isinstance(job.group, int) or not 0 <= job.group < len(self.groups):
            return f"group {job.group!r} is not a KV-cache group of the model (it has {len(self.groups)})"
        plan = self.groups[job.group][0]
        of_group = f" of group {job.group}" if len(self.groups) > 1 else ""
        if job.layers is not None:
            start, stop = job.layers
            if not 0 <= start < stop <= plan.num_layers:
                return f"layers {job.layers} is not a non-empty range inside [0, {plan.num_layers}){of_group}"
        if len(job.block_ids) != len(job.slot_ids) * plan.bpc:
            per_chunk = (f"blocks_per_chunk={plan.bpc}" if plan.bpc == self.blocks_per_chunk
                         else f"group {job.group} copies {plan.bpc} block per chunk")
            return f"{len(job.block_ids)} block ids for {len(job.slot_ids)} slots ({per_chunk})"
        for s in job.slot_ids:
            if not 0 <= s < plan.num_slots:
                return f"slot id {s} out of range [0, {plan.num_slots})"
        for b in job.block_ids:
            if not 0 <= b < plan.num_blocks:
                return f"block id {b} out of range [0, {plan.num_blocks}){of_group}"
        return None

    def job_bytes(self, job: CopyJob) -> int:
        """Bytes ``job`` moves (every part of its group, this rank's share of it)."""
        return sum(plan.job_bytes(job) for plan in self.groups[job.group])


def plan_copies(
    device_kv: DeviceKV,
    model: KVModel | KVGeometry,
    blocks_per_chunk: int,
    buffer: SlotBuffer,
) -> CopyPlans:
    """Validate ``device_kv`` against ``model`` (module docstring) and build every group's plans,
    laid out as one rank holds the model (:meth:`kvtier.model.KVModel.rank_local`).

    ``ConfigError`` names what does not fit: the layer (its group index and kind), the shape got
    and the one expected with its legend, a dtype, a block count, a device, a non-contiguous tensor,
    layers missing from or unknown to the model, or a host slot too small for a chunk of a group.
    """
    model = KVModel.of(model)
    if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
        raise ConfigError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk!r}")
    cross_layers, layer_values = _layer_values(device_kv, model)
    # The list and cross-layer forms (one group) name tensors by position, a mapping by layer and group.
    positional = not isinstance(device_kv, Mapping)
    reference: tuple[str, torch.device] | None = None
    group_tensors: list[list[list[torch.Tensor]]] = []
    for g, (group, values, cross_layer) in enumerate(zip(model.groups, layer_values, cross_layers)):
        parts = group.parts(model.dtype)
        per_part: list[list[torch.Tensor]] = [[] for _ in parts]
        first_of_group: tuple[str, int] | None = None
        for label, value in values:
            for k, (what, tensor) in enumerate(_split_parts(label, value, g, group, parts, cross_layer)):
                where = what if positional else f"{what} (group {g}, {group.kind})"
                _check_tensor(where, tensor, parts[k], group, model.tp_size, cross_layer, positional)
                num_blocks = int(tensor.shape[0])
                if first_of_group is None:
                    first_of_group = (what, num_blocks)
                elif num_blocks != first_of_group[1]:
                    raise ConfigError(f"{where} has {num_blocks} blocks, {first_of_group[0]} has {first_of_group[1]} "
                                      "(the tensors of a group share its blocks)")
                if reference is None:
                    reference = (what, tensor.device)
                elif tensor.device != reference[1]:
                    raise ConfigError(f"{where} is on {tensor.device}, {reference[0]} is on {reference[1]} "
                                      "(every tensor must be on one device)")
                per_part[k].append(tensor)
        if first_of_group is not None and first_of_group[1] < 1:
            raise ConfigError("device_kv has no blocks")
        group_tensors.append(per_part)
    model = model.rank_local()  # validated above against the whole model, as the error messages say
    for g, group in enumerate(model.groups):
        need = model.chunk_bytes(g, blocks_per_chunk)
        if buffer.slot_bytes < need:
            of_group = f" of group {g} ({group.kind})" if len(model.groups) > 1 else ""
            raise ConfigError(f"host slot of {buffer.slot_bytes} bytes cannot hold a chunk{of_group} of {need} bytes")
    plans = [
        [
            CopyPlan(tensors, part, cross_layer=cross_layer, num_layers=group.num_layers,
                     page_bytes=group.page_bytes(model.dtype), blocks_per_slot=group.blocks_per_slot(blocks_per_chunk),
                     buffer=buffer)
            for part, tensors in zip(group.parts(model.dtype), per_part)
        ]
        for group, per_part, cross_layer in zip(model.groups, group_tensors, cross_layers)
    ]
    return CopyPlans(model, blocks_per_chunk, plans)


def _unwritten(model: KVModel, group: int, blocks_per_chunk: int,
               slot_bytes: int) -> tuple[int, int, list[tuple[int, int]]] | None:
    """What the copies of a chunk of ``group`` leave unwritten in its slot: ``(chunk_bytes,
    page_bytes, gaps)``, the gaps ``(start, stop)`` inside each page between its parts; ``None``
    when they write the whole slot."""
    g = model.groups[group]
    page_bytes = g.page_bytes(model.dtype)
    gaps = []
    end = 0
    for part in sorted(g.parts(model.dtype), key=lambda part: part.offset):
        if part.offset > end:
            gaps.append((end, part.offset))
        end = part.offset + part.nbytes
    if end < page_bytes:
        gaps.append((end, page_bytes))
    chunk_bytes = model.chunk_bytes(group, blocks_per_chunk)
    if not gaps and chunk_bytes == slot_bytes:
        return None
    return chunk_bytes, page_bytes, gaps


def first_tensor(device_kv: DeviceKV) -> torch.Tensor:
    """The cross-layer tensor, or the first tensor of the first layer (whose device is every
    tensor's); ``ConfigError`` when ``device_kv`` holds no tensor there."""
    value: Any = device_kv
    while not isinstance(value, torch.Tensor):
        if isinstance(value, Mapping):
            items = list(value.values())
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            items = list(value)
        else:
            raise ConfigError(f"device_kv holds a {type(value).__name__}, expected torch.Tensor values")
        if not items:
            raise ConfigError("device_kv is empty")
        value = items[0]
    return value


# --- validation ------------------------------------------------------------------------------


def _layer_values(device_kv: Any, model: KVModel) -> tuple[list[bool], list[list[tuple[str, Any]]]]:
    """``(per group: cross-layer?, per group: (label, value) of each layer in the group's order)``.

    In a mapping, a group index (an int) names one cross-layer tensor for the whole group (an
    attention or MLA group) in place of its layers' names.
    """
    groups = model.groups
    if isinstance(device_kv, torch.Tensor):
        _need_one_group(model, "a cross-layer device_kv tensor")
        return [True], [[("device_kv", device_kv)]]
    if isinstance(device_kv, Mapping):
        whole = {g for g in range(len(groups)) if g in device_kv and not isinstance(g, bool)}
        names = [name for g, group in enumerate(groups) if g not in whole for name in group.layer_names]
        known = set(names)
        missing = [name for name in names if name not in device_kv]
        unknown = [repr(key) for key in device_kv if key not in known and key not in whole]
        for g in whole:
            given = [name for name in groups[g].layer_names if name in device_kv]
            if given:
                unknown.append(f"{given[0]!r} (group {g} is given whole, as device_kv[{g}])")
            if groups[g].kind == "mamba":
                raise ConfigError(f"device_kv[{g}]: group {g} (mamba) is given per layer (a sequence of state "
                                  "tensors per layer name), not as one cross-layer tensor")
        if missing or unknown:
            problems = []
            if missing:
                problems.append(f"missing layers of the model: {', '.join(map(repr, missing))}")
            if unknown:
                problems.append(f"names not in the model: {', '.join(unknown)}")
            raise ConfigError(f"device_kv does not name the model's layers: {'; '.join(problems)}")
        return ([g in whole for g in range(len(groups))],
                [[(f"device_kv[{g}]", device_kv[g])] if g in whole
                 else [(f"device_kv[{name!r}]", device_kv[name]) for name in group.layer_names]
                 for g, group in enumerate(groups)])
    if isinstance(device_kv, (str, bytes)) or not isinstance(device_kv, Sequence):
        raise ConfigError(
            f"device_kv is a {type(device_kv).__name__}: expected a mapping layer name -> tensor(s), "
            "a list of per-layer tensors or a cross-layer tensor"
        )
    _need_one_group(model, "a list of per-layer device_kv tensors")
    values = list(device_kv)
    if len(values) != groups[0].num_layers:
        raise ConfigError(f"device_kv has {len(values)} per-layer tensors, the model has {groups[0].num_layers} layers")
    return [False], [[(f"device_kv[{i}]", value) for i, value in enumerate(values)]]


def _need_one_group(model: KVModel, form: str) -> None:
    if len(model.groups) != 1:
        kinds = ", ".join(group.kind for group in model.groups)
        raise ConfigError(
            f"{form} describes one KV-cache group, the model has {len(model.groups)} ({kinds}); "
            "pass a mapping layer name -> tensor (a sequence of state tensors for mamba layers)"
        )


def _split_parts(
    label: str, value: Any, g: int, group: KVCacheGroup, parts: Sequence[PagePart], cross_layer: bool
) -> list[tuple[str, Any]]:
    """``(label, tensor)`` of each part of one layer's (or the cross-layer) value."""
    where = f"{label} (group {g}, {group.kind})"
    if group.kind != "mamba":
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{where} is a {type(value).__name__}, expected a torch.Tensor")
        return [(label, value)]
    if cross_layer:
        if len(parts) != 1:
            raise ConfigError(
                f"{where}: a cross-layer tensor holds one state tensor per layer, the group has {len(parts)}; "
                "pass a mapping layer name -> sequence of state tensors"
            )
        return [(f"{label} {parts[0].legend}", value)]
    if isinstance(value, torch.Tensor) and len(parts) == 1:
        tensors: list[Any] = [value]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, torch.Tensor)):
        tensors = list(value)
    else:
        raise ConfigError(f"{where} is a {type(value).__name__}, expected a sequence of {len(parts)} state tensors")
    if len(tensors) != len(parts):
        raise ConfigError(f"{where} has {len(tensors)} state tensors, expected {len(parts)} (one per state shape)")
    return [(f"{label} {part.legend}", tensor) for part, tensor in zip(parts, tensors)]


def _check_tensor(where: str, tensor: Any, part: PagePart, group: KVCacheGroup, tp_size: int, cross_layer: bool,
                  positional: bool) -> None:
    """Shape, dtype and contiguity of one device tensor. ``positional`` (the list and cross-layer
    forms) spells the expected shape as a tuple with a ``'num_blocks'`` entry."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{where} is a {type(tensor).__name__}, expected a torch.Tensor")
    rank_shape = part.rank_shape(tp_size)
    dims = ((group.num_layers,) if cross_layer else ()) + rank_shape
    if tensor.dim() != len(dims) + 1 or tuple(tensor.shape[1:]) != dims:
        expected = repr(("num_blocks", *dims)) if positional else f"(num_blocks, {', '.join(map(str, dims))})"
        if group.kind != "mamba":  # a state tensor's label names it already; its dims have no names
            names = part.legend.split(", ")
            if part.shard_dim is not None and len(names) == len(part.shape):
                names[part.shard_dim] = f"this rank's {names[part.shard_dim]}"
            expected += f" ({', '.join(['num_blocks', *(['num_layers'] if cross_layer else []), *names])})"
        raise ConfigError(f"{where} has shape {tuple(tensor.shape)}, expected {expected}")
    dtype = torch_dtype(part.dtype)
    if tensor.dtype != dtype:
        raise ConfigError(f"{where} has dtype {tensor.dtype}, expected {dtype}")
    if not tensor.is_contiguous():
        # Copies address blocks by offset (and the CPU engine views the bytes in place):
        # a transposed or sliced tensor would be read and written at the wrong places.
        raise ConfigError(
            f"{where} must be contiguous (strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}); "
            "pass the KV cache tensor itself, not a transposed or strided view of it"
        )


def _run_count(block_ids: Sequence[int], bpc: int) -> int:
    """How many runs of consecutive device blocks the chunks of ``block_ids`` make (``bpc`` blocks
    per chunk; a run never spans two chunks)."""
    runs = 0
    for i, block in enumerate(block_ids):
        if i % bpc == 0 or block != block_ids[i - 1] + 1:
            runs += 1
    return runs


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

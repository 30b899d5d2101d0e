"""Specification of the copy engines for hybrid models (several KV-cache groups; ``kvtier/host/``:
``copy_plan``, ``copy_engine``, ``cpu_copy``, ``cuda_copy``, ``copy_factory``).

A model with full attention, sliding window, MLA and Mamba groups is opened with a mapping layer
name → tensor(s); a job copies chunks of one group (``CopyJob.group``) between that group's device
blocks and the shared host slots, laid out block-major, then layer, then the group's page parts.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from copy_runs import run_jobs

from kvtier.errors import ConfigError
from kvtier.host.copy_factory import make_copy_engine
from kvtier.host.copy_jobs import CopyJob
from kvtier.host.copy_plan import CopyPlans, plan_copies
from kvtier.host.cpu_copy import CpuCopyEngine, _copy_pairs_numpy
from kvtier.host.cuda_copy import copy_parts
from kvtier.host.slots import SlotBuffer
from kvtier.layout import KVGeometry
from kvtier.model import KVCacheGroup, KVModel

BPC = 2
#: Device blocks of each group of :func:`hybrid` (groups may differ).
BLOCKS = (12, 10, 9, 7)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def hybrid(tp_size: int = 1, mamba: bool = True) -> KVModel:
    """Full attention (layers 0, 2), sliding window (1, 5), MLA (3, 6) and — with ``mamba``, at TP 1
    only — Mamba (4, 7) with a bfloat16 state of 30 bytes (padded to 32 in the page) and a float32
    state."""
    groups = [
        KVCacheGroup.full_attention(block_size=4, layer_names=["model.layers.0.attn", "model.layers.2.attn"],
                                    num_kv_heads=4, head_dim=8),
        KVCacheGroup.sliding_window(window=8, block_size=4, layer_names=["model.layers.1.attn", "model.layers.5.attn"],
                                    num_kv_heads=2, head_dim=8),
        KVCacheGroup.mla(block_size=4, layer_names=["model.layers.3.mla", "model.layers.6.mla"], latent_dim=24),
    ]
    if mamba:
        groups.append(KVCacheGroup.mamba(block_size=8, layer_names=["model.layers.4.mixer", "model.layers.7.mixer"],
                                         state_shapes=[(3, 5), (4, 6)], state_dtypes=["bfloat16", "float32"]))
    return KVModel("test/hybrid", "bfloat16", tuple(groups), tp_size=tp_size)


def layer_shapes(model: KVModel, g: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape without num_blocks, dtype) of each tensor of one layer of group ``g`` on one rank."""
    group = model.groups[g]
    return [(part.rank_shape(model.tp_size), TORCH_DTYPES[part.dtype]) for part in group.parts(model.dtype)]


def make_kv(model: KVModel, seed: int = 0, zeros: bool = False, blocks: tuple[int, ...] = BLOCKS) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    kv: dict[str, Any] = {}
    for g, group in enumerate(model.groups):
        for name in group.layer_names:
            tensors = [
                torch.zeros((blocks[g], *shape), dtype=dtype) if zeros
                else torch.randn((blocks[g], *shape), generator=gen).to(dtype)
                for shape, dtype in layer_shapes(model, g)
            ]
            kv[name] = tensors if group.kind == "mamba" else tensors[0]
    return kv


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def block_bytes(kv: dict[str, Any], name: str, b: int) -> list[bytes]:
    """The bytes of device block ``b`` of layer ``name``, one entry per tensor."""
    return [t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors_of(kv[name])]


def moved_bytes(model: KVModel, g: int) -> int:
    """Bytes a TP 1 rank copies for one chunk of group ``g``: its parts, not the padding between them."""
    group = model.groups[g]
    return group.blocks_per_slot(BPC) * group.num_layers * sum(part.nbytes for part in group.parts(model.dtype))


def chunk_blocks(model: KVModel, g: int, chunks: int, first: int = 0) -> list[int]:
    """Block ids for ``chunks`` chunks of group ``g``, counting down from ``first`` (mod its blocks)."""
    n = model.groups[g].blocks_per_slot(BPC)
    return [(first - i) % BLOCKS[g] for i in range(chunks * n)]


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_every_group_round_trips_through_the_shared_slots_into_other_blocks() -> None:
    model = hybrid()
    src = make_kv(model, seed=1)
    buffer = SlotBuffer(8, model.slot_bytes(BPC), pin_memory=False)
    engine = make_copy_engine(src, model, BPC, buffer)
    assert isinstance(engine, CpuCopyEngine)
    assert engine.num_groups == 4 and engine.group_blocks == BLOCKS and engine.num_blocks == BLOCKS[0]
    assert engine.chunk_bytes == model.chunk_bytes(0, BPC)
    stores = [CopyJob(g, "to_host", [2 * g, 2 * g + 1], chunk_blocks(model, g, 2, first=BLOCKS[g] - 1), group=g)
              for g in range(4)]
    results = await run_jobs(engine, stores)
    assert [(r.success, r.nbytes) for r in results] == [(True, 2 * moved_bytes(model, g)) for g in range(4)]
    assert moved_bytes(model, 3) < model.chunk_bytes(3, BPC)  # the padding after the 30-byte state

    dst = make_kv(model, zeros=True)
    loads = [CopyJob(10 + g, "to_device", job.slot_ids, chunk_blocks(model, g, 2, first=0), group=g)
             for g, job in enumerate(stores)]
    loaded = await run_jobs(make_copy_engine(dst, model, BPC, buffer), loads)
    assert all(r.success for r in loaded)
    for g, group in enumerate(model.groups):
        moved = dict(zip(loads[g].block_ids, stores[g].block_ids))
        for name in group.layer_names:
            for b in range(BLOCKS[g]):
                if b in moved:
                    assert block_bytes(dst, name, b) == block_bytes(src, name, moved[b]), (name, b)
                else:  # blocks no chunk names stay untouched
                    assert not any(any(x) for x in block_bytes(dst, name, b)), (name, b)
    buffer.close()


@pytest.mark.anyio
async def test_a_host_slot_holds_a_group_chunk_block_major_then_layer_then_page_parts() -> None:
    model = hybrid()
    src = make_kv(model, seed=2)
    buffer = SlotBuffer(4, model.slot_bytes(BPC), pin_memory=False)
    jobs = [CopyJob(g, "to_host", [g], chunk_blocks(model, g, 1, first=5), group=g) for g in range(4)]
    await run_jobs(CpuCopyEngine(src, model, BPC, buffer), jobs)
    for g, group in enumerate(model.groups):
        slot = buffer.array[g]
        page_bytes = group.page_bytes(model.dtype)
        parts = group.parts(model.dtype)
        for b, device_block in enumerate(jobs[g].block_ids):
            for layer, name in enumerate(group.layer_names):
                page = (b * group.num_layers + layer) * page_bytes
                for part, got in zip(parts, block_bytes(src, name, device_block)):
                    start = page + part.offset
                    assert slot[start : start + part.nbytes].tobytes() == got, (g, b, layer)
        # Nothing beyond the group's chunk is written (padding, the rest of the slot).
        assert not slot[model.chunk_bytes(g, BPC) :].any()
    # Mamba: the 30-byte bfloat16 state is padded to 32 bytes, the float32 state follows.
    mamba = model.groups[3].parts(model.dtype)
    assert [p.offset for p in mamba] == [0, 32] and model.groups[3].page_bytes(model.dtype) == 128
    assert not buffer.array[3][30:32].any()
    buffer.close()


@pytest.mark.anyio
async def test_a_mamba_job_copies_one_block_per_chunk() -> None:
    model = hybrid()
    src = make_kv(model, seed=3)
    buffer = SlotBuffer(4, model.slot_bytes(BPC), pin_memory=False)
    engine = CpuCopyEngine(src, model, BPC, buffer)
    # BPC blocks per chunk is an attention chunk: refused for the Mamba group.
    engine.submit(CopyJob(0, "to_host", [0], [1, 2], group=3))
    [refused] = engine.get_finished()
    assert not refused.success and "1 block per chunk" in (refused.error or "")
    [stored] = await run_jobs(engine, [CopyJob(1, "to_host", [0, 1], [6, 2], group=3)])
    state_bytes = 30 + 4 * 6 * 4
    assert stored.success and stored.nbytes == 2 * model.groups[3].num_layers * state_bytes

    dst = make_kv(model, zeros=True)
    [loaded] = await run_jobs(CpuCopyEngine(dst, model, BPC, buffer), [CopyJob(2, "to_device", [1, 0], [0, 4], group=3)])
    assert loaded.success
    for name in model.groups[3].layer_names:
        assert block_bytes(dst, name, 0) == block_bytes(src, name, 2)
        assert block_bytes(dst, name, 4) == block_bytes(src, name, 6)
        for b in (1, 2, 3, 5, 6):
            assert not any(any(x) for x in block_bytes(dst, name, b))
    buffer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("g", [0, 1, 2, 3])
async def test_a_layer_range_is_a_range_of_the_groups_own_layers(g: int) -> None:
    model = hybrid()
    src = make_kv(model, seed=4)
    buffer = SlotBuffer(2, model.slot_bytes(BPC), pin_memory=False)
    blocks = chunk_blocks(model, g, 2, first=6)
    await run_jobs(CpuCopyEngine(src, model, BPC, buffer), [CopyJob(0, "to_host", [1, 0], blocks, group=g)])
    dst = make_kv(model, zeros=True)
    [result] = await run_jobs(CpuCopyEngine(dst, model, BPC, buffer),
                              [CopyJob(1, "to_device", [1, 0], blocks, layers=(1, 2), group=g)])
    assert result.success and result.nbytes == moved_bytes(model, g)  # 2 chunks, 1 of 2 layers
    first, second = model.groups[g].layer_names
    for b in blocks:
        assert block_bytes(dst, second, b) == block_bytes(src, second, b)
        assert not any(any(x) for x in block_bytes(dst, first, b))  # the group's other layer untouched
    buffer.close()


@pytest.mark.anyio
async def test_a_tp_rank_holds_its_own_heads_densely_and_the_whole_mla_latents() -> None:
    """At TP 2 a rank's slots are those of a TP 1 model with the rank's heads: its attention heads
    contiguous (no room for the other rank's), the replicated MLA latents whole."""
    model = hybrid(tp_size=2, mamba=False)
    local = model.rank_local()
    assert local.tp_size == 1 and [g.num_kv_heads for g in local.groups] == [2, 1, None]  # of 4 and 2
    assert local.chunk_bytes(0, BPC) == model.chunk_bytes(0, BPC) // 2
    assert local.chunk_bytes(2, BPC) == model.chunk_bytes(2, BPC)  # latents are whole on every rank
    blocks = (12, 10, 9)
    kv = make_kv(model, seed=10, blocks=blocks)
    buffer = SlotBuffer(3, local.slot_bytes(BPC), pin_memory=False)
    reference = SlotBuffer(3, local.slot_bytes(BPC), pin_memory=False)
    jobs = [CopyJob(g, "to_host", [g], [4, 8], group=g) for g in range(3)]
    results = await run_jobs(CpuCopyEngine(kv, model, BPC, buffer), jobs)
    assert [r.nbytes for r in results] == [local.chunk_bytes(g, BPC) for g in range(3)]
    await run_jobs(CpuCopyEngine(kv, local, BPC, reference), [CopyJob(g, "to_host", [g], [4, 8], group=g)
                                                              for g in range(3)])
    for g in range(3):
        assert np.array_equal(buffer.array[g], reference.array[g]), g
        assert not buffer.array[g][local.chunk_bytes(g, BPC):].any()  # nothing past the rank's chunk
    dst = make_kv(model, zeros=True, blocks=blocks)
    await run_jobs(CpuCopyEngine(dst, model, BPC, buffer),
                   [CopyJob(g, "to_device", [g], [0, 1], group=g) for g in range(3)])
    for g in range(3):
        for name in model.groups[g].layer_names:
            assert block_bytes(dst, name, 0) == block_bytes(kv, name, 4)
            assert block_bytes(dst, name, 1) == block_bytes(kv, name, 8)
    buffer.close()
    reference.close()


@pytest.mark.anyio
async def test_a_store_into_a_used_slot_leaves_nothing_of_the_chunk_before() -> None:
    """A slot that held a larger chunk (another group's) is stored into: what this chunk's copies
    do not write — the slot's tail, the gaps between the parts of a state page — is zeroed, so the
    slot (which goes to storage whole) is byte for byte what a store into a fresh slot gives."""
    model = hybrid()
    kv = make_kv(model, seed=3)
    used = SlotBuffer(1, model.slot_bytes(BPC), pin_memory=False)
    fresh = SlotBuffer(1, model.slot_bytes(BPC), pin_memory=False)
    try:
        sizes = [model.chunk_bytes(g, BPC) for g in range(4)]
        assert min(sizes) < model.slot_bytes(BPC) and model.groups[3].kind == "mamba"  # a tail, and gaps
        for g in (3, 1, 0, 2, 3):
            used.array[:] = 0xAB  # whatever the slot held before
            fresh.array[:] = 0
            job = CopyJob(g, "to_host", [0], chunk_blocks(model, g, 1, first=BLOCKS[g] - 1), group=g)
            for buffer in (used, fresh):
                [result] = await run_jobs(CpuCopyEngine(kv, model, BPC, buffer), [job])
                assert result.success
            assert np.array_equal(used.array, fresh.array), g
    finally:
        used.close()
        fresh.close()


# --- one group: the list and cross-layer forms are unchanged --------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["list", "cross_layer", "mapping"])
async def test_one_group_forms_write_the_bytes_of_the_geometry_engine(form: str) -> None:
    geo = KVGeometry(model_name="m", num_layers=3, num_kv_heads=4, head_dim=8, dtype="bfloat16", block_size=4)
    model = KVModel.of(geo)
    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn((8, 2, 4, 4, 8), generator=gen).bfloat16() for _ in range(3)]
    device_kv: Any = {
        "list": layers,
        "cross_layer": torch.stack(layers, dim=1).contiguous(),
        "mapping": dict(zip(geo.names_of_layers, layers)),
    }[form]
    buffers = [SlotBuffer(2, geo.slot_bytes(BPC), pin_memory=False) for _ in range(2)]
    job = CopyJob(0, "to_host", [1, 0], [3, 4, 7, 0])
    await run_jobs(CpuCopyEngine(layers, geo, BPC, buffers[0]), [job])
    [result] = await run_jobs(CpuCopyEngine(device_kv, model, BPC, buffers[1]), [job])
    assert result.nbytes == 2 * geo.chunk_bytes(BPC)
    assert np.array_equal(buffers[0].array, buffers[1].array)
    for buffer in buffers:
        buffer.close()


# --- validation -------------------------------------------------------------------------------


def open_plans(device_kv: Any, model: KVModel | KVGeometry, slot_bytes: int | None = None) -> CopyPlans:
    model_ = KVModel.of(model)
    buffer = SlotBuffer(2, slot_bytes or model_.slot_bytes(BPC), pin_memory=False)
    try:
        return plan_copies(device_kv, model, BPC, buffer)
    finally:
        buffer.close()


def test_a_mapping_must_name_exactly_the_models_layers() -> None:
    model = hybrid()
    kv = make_kv(model)
    missing = {k: v for k, v in kv.items() if k != "model.layers.6.mla"}
    with pytest.raises(ConfigError, match=r"missing layers of the model: 'model\.layers\.6\.mla'"):
        open_plans(missing, model)
    with pytest.raises(ConfigError, match=r"names not in the model: 'model\.layers\.9\.attn'"):
        open_plans(kv | {"model.layers.9.attn": kv["model.layers.0.attn"]}, model)


def test_a_state_tensor_of_the_wrong_shape_names_the_layer_group_and_expected_shape() -> None:
    model = hybrid()
    kv = make_kv(model)
    kv["model.layers.7.mixer"] = [kv["model.layers.7.mixer"][0], torch.zeros((7, 4, 5))]
    message = ("device_kv['model.layers.7.mixer'] state tensor 1 (group 3, mamba) has shape (7, 4, 5), "
               "expected (num_blocks, 4, 6)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_plans(kv, model)


@pytest.mark.parametrize(("layer", "bad", "expected"), [
    ("model.layers.5.attn", lambda t: t[:, :, :, :1], "(group 1, sliding_window) has shape (10, 2, 4, 1, 8), "
     "expected (num_blocks, 2, 4, 2, 8) (num_blocks, K/V, block_size, this rank's kv heads, head_dim)"),
    ("model.layers.3.mla", lambda t: t[:, :, :12].contiguous(), "(group 2, mla) has shape (9, 4, 12), "
     "expected (num_blocks, 4, 24) (num_blocks, block_size, latent_dim)"),
])
def test_an_attention_or_mla_tensor_of_the_wrong_shape_names_its_legend(layer: str, bad: Any, expected: str) -> None:
    model = hybrid()
    kv = make_kv(model)
    kv[layer] = bad(kv[layer]).contiguous()
    with pytest.raises(ConfigError, match=re.escape(f"device_kv[{layer!r}] {expected}")):
        open_plans(kv, model)


def test_mla_latents_are_never_head_sliced_and_attention_heads_are() -> None:
    model = hybrid(tp_size=2, mamba=False)
    kv = make_kv(model, blocks=(12, 10, 9))
    kv["model.layers.3.mla"] = torch.zeros((9, 4, 12), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=re.escape("expected (num_blocks, 4, 24)")):
        open_plans(kv, model)
    kv = make_kv(hybrid(mamba=False), blocks=(12, 10, 9))  # all heads: too many for a TP 2 rank
    with pytest.raises(ConfigError, match=re.escape("(group 0, full_attention) has shape (12, 2, 4, 4, 8), expected "
                                                    "(num_blocks, 2, 4, 2, 8) (num_blocks, K/V, block_size, "
                                                    "this rank's kv heads, head_dim)")):
        open_plans(kv, model)


def test_dtype_blocks_device_and_contiguity_are_checked_per_layer() -> None:
    model = hybrid()
    kv = make_kv(model)
    state = kv["model.layers.4.mixer"]
    with pytest.raises(ConfigError, match=re.escape("state tensor 1 (group 3, mamba) has dtype torch.bfloat16, "
                                                    "expected torch.float32")):
        open_plans(kv | {"model.layers.4.mixer": [state[0], state[1].bfloat16()]}, model)
    with pytest.raises(ConfigError, match=r"'model\.layers\.2\.attn'\] \(group 0, full_attention\) has 5 blocks"):
        open_plans(kv | {"model.layers.2.attn": kv["model.layers.2.attn"][:5].clone()}, model)
    meta = torch.empty(kv["model.layers.6.mla"].shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ConfigError, match=r"'model\.layers\.6\.mla'\] \(group 2, mla\) is on meta"):
        open_plans(kv | {"model.layers.6.mla": meta}, model)
    strided = torch.zeros((7, 6, 4), dtype=torch.float32).transpose(1, 2)
    with pytest.raises(ConfigError, match=r"state tensor 1 \(group 3, mamba\) must be contiguous"):
        open_plans(kv | {"model.layers.4.mixer": [state[0], strided]}, model)
    with pytest.raises(ConfigError, match=r"\(group 3, mamba\) has 1 state tensors, expected 2"):
        open_plans(kv | {"model.layers.4.mixer": [state[0]]}, model)
    with pytest.raises(ConfigError, match=r"\(group 0, full_attention\) is a list, expected a torch.Tensor"):
        open_plans(kv | {"model.layers.0.attn": [kv["model.layers.0.attn"]]}, model)


def test_groups_may_differ_in_blocks_but_each_group_agrees() -> None:
    model = hybrid()
    plans = open_plans(make_kv(model), model)
    assert plans.group_blocks == BLOCKS
    assert [len(parts) for parts in plans.groups] == [1, 1, 1, 2]


def test_the_list_and_cross_layer_forms_need_a_one_group_model() -> None:
    model = hybrid()
    kv = make_kv(model)
    layers = [kv[name] for name in model.groups[0].layer_names]
    with pytest.raises(ConfigError, match="one KV-cache group, the model has 4"):
        open_plans(layers, model)
    with pytest.raises(ConfigError, match="one KV-cache group, the model has 4"):
        open_plans(torch.stack(layers, dim=1), model)


def test_the_slot_must_hold_a_chunk_of_every_group() -> None:
    # The Mamba chunk (one block: 2 layers of a 5 KiB state) is larger than the attention chunk.
    model = KVModel("test/big-state", "float16", (
        KVCacheGroup.full_attention(block_size=4, layer_names=["a.0"], num_kv_heads=2, head_dim=8),
        KVCacheGroup.mamba(block_size=4, layer_names=["m.1", "m.2"], state_shapes=[(32, 40)], state_dtypes=["float32"]),
    ))
    assert model.chunk_bytes(0, BPC) <= 4096 < model.chunk_bytes(1, BPC)
    kv = make_kv(model, blocks=(4, 4))
    with pytest.raises(ConfigError, match="host slot of 4096 bytes cannot hold a chunk of group 1 "
                                          r"\(mamba\) of 10240 bytes"):
        open_plans(kv, model, slot_bytes=4096)
    assert open_plans(kv, model).group_blocks == (4, 4)


@pytest.mark.anyio
async def test_a_job_of_an_unknown_group_or_out_of_its_groups_range_is_invalid() -> None:
    model = hybrid()
    buffer = SlotBuffer(2, model.slot_bytes(BPC), pin_memory=False)
    engine = CpuCopyEngine(make_kv(model), model, BPC, buffer)
    engine.submit(CopyJob(0, "to_host", [0], [0, 1], group=4))
    engine.submit(CopyJob(1, "to_host", [0], [BLOCKS[3]], group=3))  # in group 0's range, not group 3's
    engine.submit(CopyJob(2, "to_host", [0], [0], layers=(1, 3), group=3))
    engine.submit(CopyJob(3, "to_host", [0], [0, BLOCKS[2]], group=2))
    errors = [r.error or "" for r in engine.get_finished()]
    assert len(errors) == 4 and all(e.startswith("invalid job") for e in errors)
    assert "group 4" in errors[0]
    assert f"block id {BLOCKS[3]} out of range [0, {BLOCKS[3]}) of group 3" in errors[1]
    assert "layers (1, 3)" in errors[2] and "of group 3" in errors[2]
    assert f"out of range [0, {BLOCKS[2]}) of group 2" in errors[3]
    await engine.aclose()
    buffer.close()


# --- the CUDA engine's routines, on CPU tensors ---------------------------------------------------


@pytest.mark.parametrize("layers", [None, (1, 2)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_cuda_engines_routines_move_the_bytes_of_the_cpu_engine(layers: tuple[int, int] | None,
                                                                    tp_size: int) -> None:
    """``copy_parts`` (each part with the routine the CUDA engine picks) writes the slots exactly as
    the CPU engine's numpy copies do, and loads them back, for every group, at TP 1 (with a Mamba
    group) and for a TP 2 rank."""
    model = hybrid() if tp_size == 1 else hybrid(tp_size=2, mamba=False)
    n = len(model.groups)
    src = make_kv(model, seed=7)
    buffers = [SlotBuffer(4, model.rank_local().slot_bytes(BPC), pin_memory=False) for _ in range(2)]
    targets = [make_kv(model, zeros=True) for _ in range(2)]
    try:
        for g in range(n):
            store = CopyJob(g, "to_host", [g, (g + 1) % n], chunk_blocks(model, g, 2, first=BLOCKS[g] - 2),
                            layers=layers, group=g)
            load = CopyJob(g, "to_device", store.slot_ids, chunk_blocks(model, g, 2, first=3), layers=layers, group=g)
            for which, (buffer, target) in enumerate(zip(buffers, targets)):
                for direction, job, kv in (("store", store, src), ("load", load, target)):
                    plans = plan_copies(kv, model, BPC, buffer)
                    if which == 0:
                        for plan in plans.groups[g]:
                            _copy_pairs_numpy(plan, job, plan.host.view(torch.uint8).numpy(),
                                              [t.view(torch.uint8).numpy() for t in plan.device_kv])
                    else:
                        nbytes, finish = copy_parts(plans.groups[g], job)
                        assert nbytes == plans.job_bytes(job), direction
                        if finish is not None:
                            assert direction == "store"
                            finish()
            assert np.array_equal(buffers[0].array, buffers[1].array), g
        for name in src:
            for a, b in zip(tensors_of(targets[0][name]), tensors_of(targets[1][name])):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        assert any(t.any() for name in src for t in tensors_of(targets[1][name]))
    finally:
        for buffer in buffers:
            buffer.close()


def test_the_copy_path_of_each_part_fits_its_layout() -> None:
    model = hybrid()
    plans = open_plans(make_kv(model), model)
    whole, some = CopyJob(0, "to_host", [0], [0, 1]), CopyJob(0, "to_host", [0], [0, 1], layers=(0, 1))
    for g in range(3):  # one whole part per page: gathered on the device, one DMA per chunk
        [plan] = plans.groups[g]
        assert plan.gathers(whole)
        assert not plan.gathers(some)  # a layer group of a two-block chunk: strided, staged
    state = CopyJob(0, "to_host", [0], [0], layers=(0, 1), group=3)
    for plan in plans.groups[3]:  # a part of a two-part page, strided in the slot: staged, no copy per page
        assert plan.bpc == 1 and not plan.gathers(state) and not plan.runs_contiguous(state)


# --- CUDA (skipped without a GPU) ------------------------------------------------------------


def to_device(kv: dict[str, Any], device: str) -> dict[str, Any]:
    return {name: value.to(device) if isinstance(value, torch.Tensor) else [t.to(device) for t in value]
            for name, value in kv.items()}


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("layers", [None, (1, 2)])
async def test_cuda_engine_moves_every_group_as_the_cpu_engine_does(layers: tuple[int, int] | None) -> None:
    model = hybrid()
    src = make_kv(model, seed=8)
    buffers = [SlotBuffer(4, model.slot_bytes(BPC), pin_memory=pinned) for pinned in (False, True)]
    stores = [CopyJob(g, "to_host", [g], chunk_blocks(model, g, 1, first=5), layers=layers, group=g) for g in range(4)]
    loads = [CopyJob(10 + g, "to_device", [g], chunk_blocks(model, g, 1, first=0), layers=layers, group=g)
             for g in range(4)]
    loaded = []
    for buffer, device in zip(buffers, ("cpu", "cuda")):
        stored = await run_jobs(make_copy_engine(to_device(src, device), model, BPC, buffer), stores)
        assert all(r.success for r in stored)
        dst = to_device(make_kv(model, zeros=True), device)
        results = await run_jobs(make_copy_engine(dst, model, BPC, buffer), loads)
        assert all(r.success for r in results)
        assert [r.nbytes for r in results] == [r.nbytes for r in stored]
        loaded.append(to_device(dst, "cpu"))
    assert np.array_equal(buffers[0].array, buffers[1].array)
    for name in src:
        for a, b in zip(tensors_of(loaded[0][name]), tensors_of(loaded[1][name])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for buffer in buffers:
        buffer.close()

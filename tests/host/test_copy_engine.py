"""Specification of the copy engines (``kvtier/host/``: ``copy_engine``, ``copy_plan``, ``cpu_copy``,
``cuda_copy``, ``copy_factory``).

The CPU engine is exercised everywhere; the tests marked ``gpu`` mirror the round trips on CUDA
and are skipped by conftest without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from copy_runs import run_jobs

from kvtier.errors import ConfigError
from kvtier.host.copy_factory import make_copy_engine
from kvtier.host.copy_jobs import CopyJob, CopyResult
from kvtier.host.copy_plan import CopyPlan, plan_copies
from kvtier.host.cpu_copy import CpuCopyEngine, _copy_pairs_numpy
from kvtier.host.cuda_copy import CudaCopyEngine, copy_gathered, copy_pairs, copy_staged
from kvtier.host.slots import SlotBuffer
from kvtier.layout import KVGeometry
from kvtier.model import KVModel

NUM_BLOCKS = 16


def geometry(dtype: str = "bfloat16", tp_size: int = 1, num_layers: int = 3) -> KVGeometry:
    return KVGeometry(
        model_name="test-model", num_layers=num_layers, num_kv_heads=4, head_dim=8,
        dtype=dtype, block_size=4, tp_size=tp_size,
    )


def random_kv(
    geo: KVGeometry, cross_layer: bool, device: str = "cpu", seed: int = 0
) -> torch.Tensor | list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    heads = geo.num_kv_heads // geo.tp_size
    page = (2, geo.block_size, heads, geo.head_dim)
    if cross_layer:
        t = torch.randn((NUM_BLOCKS, geo.num_layers, *page), generator=gen).to(geo.torch_dtype)
        return t.to(device)
    return [
        torch.randn((NUM_BLOCKS, *page), generator=gen).to(geo.torch_dtype).to(device)
        for _ in range(geo.num_layers)
    ]


def single_plan(device_kv, geo: KVGeometry, bpc: int, buffer: SlotBuffer) -> CopyPlan:
    """The plan of the one part of a one-group model's pages (what the engines copy through)."""
    [[plan]] = plan_copies(device_kv, geo, bpc, buffer).groups
    return plan


def block(kv: torch.Tensor | Sequence[torch.Tensor], b: int) -> torch.Tensor:
    """All layers of device block ``b`` as one [layers, 2, bs, heads, dim] tensor (on CPU)."""
    if isinstance(kv, torch.Tensor):
        return kv[b].cpu()
    return torch.stack([layer[b] for layer in kv]).cpu()


@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bpc", [1, 4])
async def test_store_then_load_into_other_blocks_round_trips_bytes(cross_layer: bool, dtype: str, bpc: int) -> None:
    geo = geometry(dtype)
    src = random_kv(geo, cross_layer, seed=1)
    buffer = SlotBuffer(4, geo.slot_bytes(bpc), pin_memory=False)
    engine = CpuCopyEngine(src, geo, bpc, buffer)
    # Two chunks; the second uses non-consecutive blocks so both the run and the scattered path run.
    store_blocks = list(range(bpc)) + [NUM_BLOCKS - 1 - 2 * i for i in range(bpc)]
    results = await run_jobs(engine, [CopyJob(1, "to_host", [2, 0], store_blocks)])
    assert results == [CopyResult(1, True, 2 * geo.chunk_bytes(bpc), results[0].seconds, None)]

    dst = random_kv(geo, cross_layer, seed=2)
    load_blocks = [NUM_BLOCKS - 1 - b for b in store_blocks]  # disjoint from the stored ones where it matters
    loader = CpuCopyEngine(dst, geo, bpc, buffer)
    [loaded] = await run_jobs(loader, [CopyJob(7, "to_device", [2, 0], load_blocks)])
    assert loaded.success and loaded.job_id == 7
    for s, d in zip(store_blocks, load_blocks):
        assert torch.equal(block(dst, d).view(torch.int16), block(src, s).view(torch.int16))
    buffer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
async def test_host_slot_holds_canonical_block_major_layout(cross_layer: bool) -> None:
    geo = geometry()
    bpc = 2
    src = random_kv(geo, cross_layer)
    buffer = SlotBuffer(2, geo.slot_bytes(bpc), pin_memory=False)
    await run_jobs(CpuCopyEngine(src, geo, bpc, buffer), [CopyJob(0, "to_host", [1], [5, 3])])
    slot = buffer.tensor[1]
    for b, device_block in enumerate([5, 3]):
        for layer in range(geo.num_layers):
            off = geo.page_offset(b, layer)
            page = slot[off : off + geo.page_bytes].view(geo.torch_dtype).view(geo.page_shape)
            assert torch.equal(page, block(src, device_block)[layer])
    # Padding after the payload is untouched (zero).
    assert not slot[geo.chunk_bytes(bpc) :].any()
    buffer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
async def test_a_tp_rank_slot_holds_its_own_heads_densely(cross_layer: bool) -> None:
    """At TP 2 a rank's slot is what a TP 1 model with the rank's two heads would hold: its own
    heads, contiguous, half the bytes of a slot of every head, nothing else written."""
    geo = geometry(tp_size=2, num_layers=16)
    local = KVGeometry(model_name="test-model", num_layers=16, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                       block_size=4)
    bpc = 2
    rank_slot = KVModel.of(geo).rank_local().slot_bytes(bpc)
    assert rank_slot == local.slot_bytes(bpc) and 2 * rank_slot == geo.slot_bytes(bpc)  # no room for other ranks
    kv = random_kv(geo, cross_layer, seed=10)
    buffer = SlotBuffer(3, rank_slot, pin_memory=False)
    reference = SlotBuffer(3, rank_slot, pin_memory=False)
    results = await run_jobs(CpuCopyEngine(kv, geo, bpc, buffer), [CopyJob(0, "to_host", [2], [4, 9])])
    assert results[0].success and results[0].nbytes == geo.chunk_bytes(bpc) // 2 == rank_slot
    await run_jobs(CpuCopyEngine(kv, local, bpc, reference), [CopyJob(0, "to_host", [2], [4, 9])])
    assert torch.equal(buffer.tensor[2], reference.tensor[2])
    assert buffer.tensor[2].any() and not buffer.tensor[0].any() and not buffer.tensor[1].any()

    dst = random_kv(geo, cross_layer, seed=99)
    await run_jobs(CpuCopyEngine(dst, geo, bpc, buffer), [CopyJob(1, "to_device", [2], [0, 1])])
    assert torch.equal(block(dst, 0).view(torch.int16), block(kv, 4).view(torch.int16))
    assert torch.equal(block(dst, 1).view(torch.int16), block(kv, 9).view(torch.int16))
    buffer.close()
    reference.close()


def test_device_kv_of_wrong_shape_is_a_config_error() -> None:
    geo = geometry()
    buffer = SlotBuffer(1, geo.slot_bytes(1), pin_memory=False)
    good = random_kv(geo, cross_layer=False)
    with pytest.raises(ConfigError, match="per-layer tensors"):
        CpuCopyEngine(good[:-1], geo, 1, buffer)
    with pytest.raises(ConfigError, match="shape"):
        CpuCopyEngine([t[:, :1] for t in good], geo, 1, buffer)
    with pytest.raises(ConfigError, match="dtype"):
        CpuCopyEngine([t.float() for t in good], geo, 1, buffer)
    with pytest.raises(ConfigError, match="blocks"):
        CpuCopyEngine([good[0][:3], *good[1:]], geo, 1, buffer)
    with pytest.raises(ConfigError, match="shape"):
        CpuCopyEngine(random_kv(geometry(tp_size=2), cross_layer=True), geo, 1, buffer)
    with pytest.raises(ConfigError, match="cannot hold"):
        CpuCopyEngine(good, geo, 4, buffer)
    buffer.close()


@pytest.mark.anyio
async def test_malformed_job_fails_immediately_and_exactly_once() -> None:
    geo = geometry()
    buffer = SlotBuffer(2, geo.slot_bytes(2), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 2, buffer)
    engine.submit(CopyJob(1, "to_host", [0], [1]))  # one block for a 2-block chunk
    engine.submit(CopyJob(2, "to_host", [5], [1, 2]))  # slot out of range
    engine.submit(CopyJob(3, "to_device", [0], [1, NUM_BLOCKS]))  # block out of range
    finished = engine.get_finished()
    assert [(r.job_id, r.success) for r in finished] == [(1, False), (2, False), (3, False)]
    assert all(r.error and r.error.startswith("invalid job") for r in finished)
    assert engine.get_finished() == []
    await engine.aclose()
    buffer.close()


@pytest.mark.anyio
async def test_full_queue_refuses_the_job_with_an_immediate_failed_result() -> None:
    geo = geometry()
    buffer = SlotBuffer(2, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 1, buffer, max_queued_jobs=2)
    wakeups = 0

    def wake() -> None:
        nonlocal wakeups
        wakeups += 1

    engine.set_wakeup(wake)
    for job_id in range(3):  # not running yet: nothing drains the queue
        engine.submit(CopyJob(job_id, "to_host", [0], [job_id]))
    assert engine.get_finished() == [CopyResult(2, False, 0, 0.0, "queue_full")]
    assert wakeups == 1
    # The two queued jobs still run once the engine starts.
    results = await run_jobs(engine, [], expect=2)
    assert sorted((r.job_id, r.success) for r in results) == [(0, True), (1, True)]
    buffer.close()


@pytest.mark.anyio
async def test_queued_jobs_run_when_the_engine_starts_later() -> None:
    geo = geometry()
    buffer = SlotBuffer(2, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 1, buffer)
    engine.submit(CopyJob(0, "to_host", [0], [3]))
    engine.submit(CopyJob(1, "to_host", [1], [4]))
    results = await run_jobs(engine, [CopyJob(2, "to_device", [0], [5])], expect=3)
    assert sorted((r.job_id, r.success) for r in results) == [(0, True), (1, True), (2, True)]
    buffer.close()


@pytest.mark.anyio
async def test_aclose_with_jobs_in_flight_reports_every_job_exactly_once() -> None:
    geo = geometry()
    buffer = SlotBuffer(8, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 1, buffer, max_concurrent_jobs=1)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        # More jobs than a worker takes per thread hop, so some are still queued at close.
        for job_id in range(32):
            engine.submit(CopyJob(job_id, "to_host", [job_id % 8], [job_id % 8]))
        await anyio.sleep(0)  # let the worker pick up (at most) one batch
        with anyio.fail_after(5):
            await engine.aclose()
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == list(range(32))
    assert any(r.error == "closed" for r in results)
    assert all(r.success or r.error == "closed" for r in results)
    # After close, submit fails at once.
    engine.submit(CopyJob(99, "to_host", [0], [0]))
    assert engine.get_finished() == [CopyResult(99, False, 0, 0.0, "closed")]
    buffer.close()


@pytest.mark.anyio
async def test_aclose_before_run_fails_queued_jobs() -> None:
    geo = geometry()
    buffer = SlotBuffer(2, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 1, buffer)
    engine.submit(CopyJob(5, "to_device", [1], [2]))
    await engine.aclose()
    assert engine.get_finished() == [CopyResult(5, False, 0, 0.0, "closed")]
    buffer.close()


@pytest.mark.anyio
async def test_make_copy_engine_picks_the_cpu_engine_for_cpu_tensors() -> None:
    geo = geometry()
    buffer = SlotBuffer(1, geo.slot_bytes(1), pin_memory=False)
    for cross_layer in (True, False):
        engine = make_copy_engine(random_kv(geo, cross_layer), geo, 1, buffer)
        assert type(engine) is CpuCopyEngine
        await engine.aclose()
    buffer.close()


def test_cuda_engine_refuses_cpu_tensors() -> None:
    geo = geometry()
    buffer = SlotBuffer(1, geo.slot_bytes(1), pin_memory=False)
    with pytest.raises(ConfigError):
        CudaCopyEngine(random_kv(geo, True), geo, 1, buffer)
    buffer.close()


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_torch_copy_path_of_the_cuda_engine_matches_the_cpu_engine(cross_layer: bool, tp_size: int) -> None:
    """The CUDA engine's copy plan (torch ``copy_``, one block at a time) runs on CPU tensors too."""
    geo = geometry(tp_size=tp_size)
    bpc = 4
    kv = random_kv(geo, cross_layer, seed=5)
    blocks = [3, 4, 5, 9, 0, 1, 2, 15]
    buffers = [SlotBuffer(3, geo.slot_bytes(bpc), pin_memory=False) for _ in range(2)]
    numpy_plan = single_plan(kv, geo, bpc, buffers[0])
    host_bytes = numpy_plan.host.view(torch.uint8).numpy()
    device_bytes = [t.view(torch.uint8).numpy() for t in numpy_plan.device_kv]
    _copy_pairs_numpy(numpy_plan, CopyJob(0, "to_host", [2, 0], blocks), host_bytes, device_bytes)
    copy_pairs(single_plan(kv, geo, bpc, buffers[1]), CopyJob(0, "to_host", [2, 0], blocks), non_blocking=True)
    assert torch.equal(buffers[0].tensor, buffers[1].tensor)
    dst = random_kv(geo, cross_layer, seed=6)
    load_plan = single_plan(dst, geo, bpc, buffers[1])
    copy_pairs(load_plan, CopyJob(1, "to_device", [2, 0], blocks), non_blocking=True)
    for b in blocks:
        assert torch.equal(block(dst, b).view(torch.int16), block(kv, b).view(torch.int16))
    for buffer in buffers:
        buffer.close()


# --- layer ranges and cancellation (layer-wise loading) ---------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
async def test_a_layer_range_job_copies_only_those_layers(cross_layer: bool) -> None:
    geo = geometry(num_layers=4)
    bpc = 2
    src = random_kv(geo, cross_layer, seed=3)
    buffer = SlotBuffer(2, geo.slot_bytes(bpc), pin_memory=False)
    blocks = [7, 8, 2, 11]  # one run and two single blocks
    await run_jobs(CpuCopyEngine(src, geo, bpc, buffer), [CopyJob(0, "to_host", [1, 0], blocks)])
    dst = random_kv(geo, cross_layer, seed=4)
    before = [block(dst, b).clone() for b in blocks]
    jobs = [CopyJob(1, "to_device", [1, 0], blocks, layers=(1, 3))]
    [result] = await run_jobs(CpuCopyEngine(dst, geo, bpc, buffer), jobs)
    assert result.success and result.nbytes == 2 * geo.chunk_bytes(bpc) * 2 // 4  # 2 chunks, 2 of 4 layers
    for b, old in zip(blocks, before):
        now, want = block(dst, b).view(torch.int16), block(src, b).view(torch.int16)
        assert torch.equal(now[1:3], want[1:3])
        assert torch.equal(now[[0, 3]], old.view(torch.int16)[[0, 3]])  # other layers untouched
    buffer.close()


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
def test_torch_copy_path_of_a_layer_range_matches_the_numpy_path(cross_layer: bool) -> None:
    """The CUDA engine's plan (one block at a time) restricted to layers, run on CPU tensors."""
    geo = geometry(num_layers=4)
    bpc = 4
    src = random_kv(geo, cross_layer, seed=7)
    buffer = SlotBuffer(2, geo.slot_bytes(bpc), pin_memory=False)
    blocks = [3, 4, 5, 9]
    plan = single_plan(src, geo, bpc, buffer)
    host_bytes = plan.host.view(torch.uint8).numpy()
    device_bytes = [t.view(torch.uint8).numpy() for t in plan.device_kv]
    _copy_pairs_numpy(plan, CopyJob(0, "to_host", [1], blocks), host_bytes, device_bytes)
    torch_dst, numpy_dst = random_kv(geo, cross_layer, seed=8), random_kv(geo, cross_layer, seed=8)
    job = CopyJob(1, "to_device", [1], [0, 1, 2, 12], layers=(2, 4))
    assert copy_pairs(single_plan(torch_dst, geo, bpc, buffer), job, non_blocking=True) == geo.chunk_bytes(bpc) // 2
    numpy_plan = single_plan(numpy_dst, geo, bpc, buffer)
    _copy_pairs_numpy(numpy_plan, job, host_bytes, [t.view(torch.uint8).numpy() for t in numpy_plan.device_kv])
    for b in range(NUM_BLOCKS):
        assert torch.equal(block(torch_dst, b).view(torch.int16), block(numpy_dst, b).view(torch.int16))
    for s, d in zip(blocks, [0, 1, 2, 12]):
        assert torch.equal(block(torch_dst, d)[2:].view(torch.int16), block(src, s)[2:].view(torch.int16))
    buffer.close()


@pytest.mark.anyio
async def test_a_layer_range_outside_the_model_is_an_invalid_job() -> None:
    geo = geometry(num_layers=3)
    buffer = SlotBuffer(1, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(random_kv(geo, True), geo, 1, buffer)
    for job_id, layers in enumerate([(0, 4), (2, 2), (-1, 1), (3, 4)]):
        engine.submit(CopyJob(job_id, "to_device", [0], [1], layers=layers))
    finished = engine.get_finished()
    assert [r.job_id for r in finished] == [0, 1, 2, 3]
    assert all(not r.success and "layers" in (r.error or "") for r in finished)
    await engine.aclose()
    buffer.close()


@pytest.mark.anyio
async def test_cancel_withdraws_a_queued_job_which_is_still_reported_once() -> None:
    geo = geometry()
    buffer = SlotBuffer(2, geo.slot_bytes(1), pin_memory=False)
    src = random_kv(geo, True, seed=1)
    engine = CpuCopyEngine(src, geo, 1, buffer)
    engine.submit(CopyJob(0, "to_host", [0], [3]))
    engine.submit(CopyJob(1, "to_host", [1], [4], layers=(0, 1)))
    engine.cancel(1)
    engine.cancel(99)  # unknown: ignored
    results = await run_jobs(engine, [], expect=2)
    assert sorted((r.job_id, r.success, r.error) for r in results) == [(0, True, None), (1, False, "cancelled")]
    assert not buffer.tensor[1].any()  # the withdrawn copy never ran
    engine.cancel(0)  # already reported: ignored, nothing more is reported
    assert engine.get_finished() == []
    buffer.close()


# --- CUDA (skipped without a GPU) ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bpc", [1, 4])
async def test_cuda_store_then_load_round_trips_bytes(cross_layer: bool, dtype: str, bpc: int) -> None:
    geo = geometry(dtype)
    src = random_kv(geo, cross_layer, device="cuda", seed=1)
    buffer = SlotBuffer(4, geo.slot_bytes(bpc), pin_memory=True)
    engine = make_copy_engine(src, geo, bpc, buffer)
    assert isinstance(engine, CudaCopyEngine)
    store_blocks = list(range(bpc)) + [NUM_BLOCKS - 1 - 2 * i for i in range(bpc)]
    [stored] = await run_jobs(engine, [CopyJob(1, "to_host", [2, 0], store_blocks)])
    assert stored.success and stored.nbytes == 2 * geo.chunk_bytes(bpc)

    dst = random_kv(geo, cross_layer, device="cuda", seed=2)
    load_blocks = [NUM_BLOCKS - 1 - b for b in store_blocks]
    [loaded] = await run_jobs(make_copy_engine(dst, geo, bpc, buffer), [CopyJob(2, "to_device", [2, 0], load_blocks)])
    assert loaded.success
    for s, d in zip(store_blocks, load_blocks):
        assert torch.equal(block(dst, d).view(torch.int16), block(src, s).view(torch.int16))
    buffer.close()


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross_layer", "per_layer"])
async def test_cuda_two_tp_ranks_match_the_cpu_engine(cross_layer: bool) -> None:
    geo = geometry(tp_size=2)
    bpc = 2
    rank_slot = KVModel.of(geo).rank_local().slot_bytes(bpc)
    cpu_buffer = SlotBuffer(2, rank_slot, pin_memory=False)
    cuda_buffer = SlotBuffer(2, rank_slot, pin_memory=True)
    kv = random_kv(geo, cross_layer, seed=1)
    await run_jobs(CpuCopyEngine(kv, geo, bpc, cpu_buffer), [CopyJob(0, "to_host", [1], [3, 7])])
    cuda_kv = kv.cuda() if isinstance(kv, torch.Tensor) else [t.cuda() for t in kv]
    await run_jobs(make_copy_engine(cuda_kv, geo, bpc, cuda_buffer), [CopyJob(0, "to_host", [1], [3, 7])])
    assert torch.equal(cpu_buffer.tensor[1], cuda_buffer.tensor[1])
    cpu_buffer.close()
    cuda_buffer.close()


@pytest.mark.parametrize(("bpc", "layers", "cross_layer"), [
    (1, None, False), (3, None, False), (1, (1, 3), False), (1, (0, 1), False), (2, None, True), (3, None, True)])
def test_gathered_copies_move_the_same_bytes_as_page_copies(bpc: int, layers: tuple[int, int] | None,
                                                             cross_layer: bool) -> None:
    """The CUDA engine's per-layer path (and the cross-layer one, for blocks scattered in more runs
    than chunks) gathers pages on the device and copies each chunk in one DMA
    (kvtier.host.cuda_copy.copy_gathered); on CPU tensors it must produce exactly the bytes of
    the page-by-page (run-by-run) copies it replaces, both ways, blocks in any order."""

    geo = KVGeometry("test/gather", num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
    gen = torch.Generator().manual_seed(bpc)
    layered = [torch.randn((24, 2, 4, 2, 8), generator=gen).half() for _ in range(4)]
    source: Any = torch.stack(layered, dim=1).contiguous() if cross_layer else layered
    blocks = [7, 2, 11, 5, 9, 0][: 2 * bpc]
    job = CopyJob(1, "to_host", [3, 1], blocks, layers=layers)
    outcomes = []
    for copy in (copy_pairs, copy_gathered):
        buffer = SlotBuffer(4, geo.slot_bytes(bpc), pin_memory=False)
        target: Any = torch.zeros_like(source) if cross_layer else [torch.zeros_like(t) for t in source]
        try:
            plan = single_plan(source, geo, bpc, buffer)
            assert plan.gathers(job)
            copy(plan, job)
            back = single_plan(target, geo, bpc, buffer)
            load = CopyJob(2, "to_device", [3, 1], list(reversed(blocks)), layers=layers)
            copy(back, load)
            outcomes.append((buffer.array.copy(), [t.clone() for t in ([target] if cross_layer else target)]))
        finally:
            buffer.close()
    (host_pages, loaded_pages), (host_gathered, loaded_gathered) = outcomes
    assert np.array_equal(host_pages, host_gathered)
    assert all(torch.equal(a, b) for a, b in zip(loaded_pages, loaded_gathered))
    assert host_gathered.any()  # something was copied


def test_each_job_takes_the_copy_path_that_fits_its_layout() -> None:

    def plan(tp: int, bpc: int, cross_layer: bool = False) -> CopyPlan:
        geo = KVGeometry("test/gather", num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16",
                         block_size=4, tp_size=tp)
        heads = 2 // tp
        kv: torch.Tensor | list[torch.Tensor] = (
            torch.zeros((8, 4, 2, 4, heads, 8), dtype=torch.float16) if cross_layer
            else [torch.zeros((8, 2, 4, heads, 8), dtype=torch.float16) for _ in range(4)])
        buffer = SlotBuffer(2, geo.slot_bytes(bpc), pin_memory=False)
        buffers.append(buffer)
        return single_plan(kv, geo, bpc, buffer)

    buffers: list[SlotBuffer] = []
    whole, group = CopyJob(1, "to_host", [0], [0, 1]), CopyJob(1, "to_host", [0], [0, 1], layers=(1, 2))
    try:
        assert plan(1, 2).gathers(whole)
        assert not plan(1, 2).gathers(group)  # strided in a two-block slot: page copies
        assert plan(2, 2).gathers(whole)  # TP 2: a rank's slot is as dense as at TP 1
        assert not plan(1, 2, cross_layer=True).gathers(whole)  # already one copy per run of blocks
        scattered = CopyJob(1, "to_host", [0, 1], [0, 5, 2, 7])  # four runs for two chunks: gathered
        assert plan(1, 2, cross_layer=True).gathers(scattered)
        assert plan(1, 2, cross_layer=True).runs_contiguous(whole)
        assert not plan(1, 2, cross_layer=True).runs_contiguous(group)  # a layer group: staged
        assert plan(2, 2, cross_layer=True).runs_contiguous(whole)  # TP 2 too
        assert not plan(1, 2).runs_contiguous(whole)  # per-layer: gathered
    finally:
        for buffer in buffers:
            buffer.close()


@pytest.mark.parametrize("cross_layer", [False, True])
@pytest.mark.parametrize("layers", [None, (1, 3)])
@pytest.mark.parametrize("tp", [4, 1])
def test_staged_copies_move_the_same_bytes_as_page_copies(
        cross_layer: bool, layers: tuple[int, int] | None, tp: int) -> None:
    """A layer group of a multi-block chunk is strided in its slot: the CUDA engine gathers it on
    the device and moves it through a contiguous staging buffer (kvtier.host.cuda_copy.copy_staged);
    on CPU tensors it must write exactly the bytes of the page copies it replaces, into those
    layers only, and load them back, both layouts, blocks in any order, for a TP 4 rank (its
    own heads) as for TP 1; without a layer range it moves every byte of the rank's chunk."""

    bpc = 2
    geo = KVGeometry("test/staged", num_layers=4, num_kv_heads=8, head_dim=8, dtype="float16", block_size=4,
                     tp_size=tp)
    heads = 8 // tp
    gen = torch.Generator().manual_seed(tp)

    def kv(fill: bool) -> torch.Tensor | list[torch.Tensor]:
        make = (lambda shape: torch.randn(shape, generator=gen).half()) if fill else (
            lambda shape: torch.zeros(shape, dtype=torch.float16))
        return make((16, 4, 2, 4, heads, 8)) if cross_layer else [make((16, 2, 4, heads, 8)) for _ in range(4)]

    def tensors(value: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
        return [value] if isinstance(value, torch.Tensor) else value

    source = kv(True)
    blocks = [9, 2, 14, 5]
    outcomes = []
    for staged in (False, True):
        buffer = SlotBuffer(3, KVModel.of(geo).rank_local().slot_bytes(bpc), pin_memory=False)
        buffer.array[:] = 0xAB  # other layers (and slots): must stay untouched
        target = kv(False)
        try:
            plan = single_plan(source, geo, bpc, buffer)
            back = single_plan(target, geo, bpc, buffer)
            store = CopyJob(1, "to_host", [2, 0], blocks, layers=layers)
            load = CopyJob(2, "to_device", [2, 0], list(reversed(blocks)), layers=layers)
            if staged:
                assert not plan.gathers(store) and not plan.runs_contiguous(store) or layers is None
                nbytes, finish = copy_staged(plan, store)
                assert finish is not None
                finish()
                assert copy_staged(back, load) == (nbytes, None)
            else:
                copy_pairs(plan, store)
                copy_pairs(back, load)
            outcomes.append((buffer.array.copy(), [t.clone() for t in tensors(target)]))
        finally:
            buffer.close()
    (host_pages, loaded_pages), (host_staged, loaded_staged) = outcomes
    assert np.array_equal(host_pages, host_staged)
    assert (host_staged != 0xAB).any()
    chunk = host_staged.reshape(3, -1)[2][: geo.chunk_bytes(bpc) // tp]
    if layers is not None:
        assert (chunk == 0xAB).any()  # its layers written, the rest not
    else:  # the rank's chunk is its blocks' bytes back to back: no other ranks' heads in between
        dense = torch.stack([torch.stack([t[b] for t in source]) if isinstance(source, list) else source[b]
                             for b in blocks[:bpc]])
        assert np.array_equal(chunk, dense.contiguous().view(torch.uint8).numpy().ravel())
    assert all(torch.equal(a, b) for a, b in zip(loaded_pages, loaded_staged))


@pytest.mark.parametrize("cross_layer", [False, True], ids=["per_layer", "cross_layer"])
@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_a_job_larger_than_the_scratch_goes_in_pieces_with_the_same_bytes(
        cross_layer: bool, layers: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA routines bound their device scratch (cuda_copy.SCRATCH_BYTES): a job of many
    chunks is moved in pieces of whole chunks, and the slots and blocks get exactly the bytes of
    one piece-less pass (the page copies), both ways."""
    from kvtier.host import cuda_copy

    geo = KVGeometry("test/pieces", num_layers=4, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
    bpc = 2
    gen = torch.Generator().manual_seed(11)
    layered = [torch.randn((24, 2, 4, 2, 8), generator=gen).half() for _ in range(4)]
    source: Any = torch.stack(layered, dim=1).contiguous() if cross_layer else layered
    blocks = [9, 2, 14, 5, 0, 7, 21, 3, 12, 18]  # five chunks of two blocks, scattered
    chunk_bytes = geo.chunk_bytes(bpc) * ((layers[1] - layers[0]) if layers else 4) // 4
    monkeypatch.setattr(cuda_copy, "SCRATCH_BYTES", 2 * chunk_bytes)  # pieces of two chunks: 2, 2, 1
    outcomes = []
    for piecewise in (False, True):
        buffer = SlotBuffer(6, geo.slot_bytes(bpc), pin_memory=False)
        target: Any = torch.zeros_like(source) if cross_layer else [torch.zeros_like(t) for t in source]
        try:
            store = CopyJob(1, "to_host", [5, 0, 3, 1, 4], blocks, layers=layers)
            load = CopyJob(2, "to_device", [5, 0, 3, 1, 4], list(reversed(blocks)), layers=layers)
            if piecewise:
                plans = plan_copies(source, geo, bpc, buffer).groups[0]
                assert len(list(cuda_copy._pieces(plans[0], store))) == 3
                nbytes, finish = cuda_copy.copy_parts(plans, store)
                if finish is not None:
                    finish()
                assert nbytes == 5 * chunk_bytes
                assert cuda_copy.copy_parts(plan_copies(target, geo, bpc, buffer).groups[0], load)[0] == nbytes
            else:
                copy_pairs(single_plan(source, geo, bpc, buffer), store)
                copy_pairs(single_plan(target, geo, bpc, buffer), load)
            outcomes.append((buffer.array.copy(), [t.clone() for t in ([target] if cross_layer else target)]))
        finally:
            buffer.close()
    (host_pages, loaded_pages), (host_pieces, loaded_pieces) = outcomes
    assert np.array_equal(host_pages, host_pieces) and host_pieces.any()
    assert all(torch.equal(a, b) for a, b in zip(loaded_pages, loaded_pieces))

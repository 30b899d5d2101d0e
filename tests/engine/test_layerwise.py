"""Specification of layer-wise loading (``kvtier/engine/layerwise.py``, ``Engine.load_layerwise``).

Runs on asyncio and trio with the CPU copy engine. Order is made observable without timing: a
hook in the CPU engine's copy function holds the copies of later layers at a gate, so a test can
look at the device while they are provably not in place yet. The ``gpu`` tests repeat the round
trip on CUDA (per-group events on the copy stream) and are skipped without it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import kvtier
from kvtier import EngineClosedError, KVGeometry
from kvtier.engine.layerwise import LayerGroup, LayerwiseLoadError
from kvtier.host import cpu_copy as cpu_copy_module
from kvtier.host.copy_engine import CopyEngine

BLOCK = 4
LAYERS = 4
HEADS = 2
DIM = 16
NUM_BLOCKS = 48
ALL_GROUPS = [LayerGroup(i, i + 1) for i in range(LAYERS)]


def geometry() -> KVGeometry:
    return KVGeometry("test/layerwise", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


def make_kv(cross_layer: bool, device: str = "cpu") -> torch.Tensor | list[torch.Tensor]:
    page = (2, BLOCK, HEADS, DIM)
    if cross_layer:
        return torch.zeros((NUM_BLOCKS, LAYERS, *page), dtype=torch.float16, device=device)
    return [torch.zeros((NUM_BLOCKS, *page), dtype=torch.float16, device=device) for _ in range(LAYERS)]


def page(kv: torch.Tensor | list[torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return kv[block, layer] if isinstance(kv, torch.Tensor) else kv[layer][block]


def fill(kv: torch.Tensor | list[torch.Tensor], blocks: list[int], seed: int) -> dict[tuple[int, int], torch.Tensor]:
    """Random pages for ``blocks``; returns {(layer, index in blocks): copy of the page}."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for i, block in enumerate(blocks):
        for layer in range(LAYERS):
            target = page(kv, layer, block)
            target.copy_(torch.randn(target.shape, generator=gen).to(target.dtype))
            written[(layer, i)] = target.clone()
    return written


def zero(kv: torch.Tensor | list[torch.Tensor]) -> None:
    for t in [kv] if isinstance(kv, torch.Tensor) else kv:
        t.zero_()


def layer_in_place(kv: Any, layer: int, blocks: list[int], written: dict[tuple[int, int], torch.Tensor]) -> bool:
    return all(torch.equal(page(kv, layer, b).cpu(), written[(layer, i)].cpu()) for i, b in enumerate(blocks))


def host_config(slots: int = 32) -> dict:
    return {"cpu_bytes_to_use": slots * geometry().slot_bytes(1)}


def prompt(chunks: int, extra: int = 0, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(chunks * BLOCK + extra)]


def pinned(engine: Any) -> int:
    return engine.statistics()["0:primary"].pinned_slots


class CopyHook:
    """Wraps the CPU engine's copy function: gates, fails or records jobs by their first layer."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate_from: int | None = None  # jobs whose layers start here or later wait for the gate
        self.fail_at: set[int] = set()  # jobs whose layers start here raise
        self.ran: list[tuple[int, int]] = []  # layer ranges of the layer-wise jobs that ran
        self._original = cpu_copy_module._copy_pairs_numpy

    def __call__(self, plan: Any, job: Any, host: Any, device_kv: Any) -> int:
        first = job.layers[0] if job.layers is not None else None
        if first is not None and self.gate_from is not None and first >= self.gate_from:
            self.gate.wait(30)  # longer than the tests' fail_after: a held copy never passes silently
        if first in self.fail_at:
            raise OSError("injected copy failure")
        if job.layers is not None:
            self.ran.append(job.layers)
        return self._original(plan, job, host, device_kv)


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyHook]:
    copy_hook = CopyHook()
    monkeypatch.setattr(cpu_copy_module, "_copy_pairs_numpy", copy_hook)
    try:
        yield copy_hook
    finally:
        copy_hook.gate.set()  # never leave a worker thread waiting


@pytest.fixture
def cancels(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Job ids passed to ``CopyEngine.cancel``, in order."""
    seen: list[int] = []
    original = CopyEngine.cancel

    def spy(self: CopyEngine, job_id: int) -> None:
        seen.append(job_id)
        original(self, job_id)

    monkeypatch.setattr(CopyEngine, "cancel", spy)
    return seen


async def open_gate_once_cancelled(engine: Any, hook: CopyHook, cancels: list[int], seen: dict) -> None:
    """Wait until leaving the load started withdrawing copies; note the pins; then open the gate."""
    with anyio.fail_after(10):
        while not cancels:
            await anyio.sleep(0.005)
    seen["pinned_while_copies_held"] = pinned(engine)
    hook.gate.set()


# --- order and bytes ---------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [False, True], ids=["per_layer", "cross_layer"])
async def test_each_group_is_in_place_when_yielded_while_later_layers_are_not(
    cross_layer: bool, hook: CopyHook
) -> None:
    kv = make_kv(cross_layer)
    tokens = prompt(3, extra=1)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        written = fill(kv, [0, 1, 2], seed=1)
        assert await engine.store(tokens, [0, 1, 2, 3]) == 3 * BLOCK
        zero(kv)
        target = [20, 31, 22]  # scattered device blocks
        hook.gate_from = 1  # layers 1.. are held until the test has looked at layer 0
        groups = []
        with anyio.fail_after(10):
            async with engine.load_layerwise(tokens[:-1], target + [23]) as layers:
                assert layers.tokens == 3 * BLOCK and layers.tokens_by_tier == {"0:primary": 3 * BLOCK}
                async for group in layers:
                    groups.append(group)
                    if group.start == 0:
                        assert layer_in_place(kv, 0, target, written)
                        assert not any(page(kv, 1, b).any() for b in target)  # layer 1 is held back
                        hook.gate.set()
                    for layer in range(group.stop):
                        assert layer_in_place(kv, layer, target, written)
        assert groups == ALL_GROUPS
        assert pinned(engine) == 0
        copies = engine.statistics()["copies"]
        assert copies.load_size.count == LAYERS and copies.failures == 0


@pytest.mark.anyio
@pytest.mark.parametrize(("per_group", "expected"), [
    (3, [LayerGroup(0, 3), LayerGroup(3, 4)]),
    (LAYERS + 5, [LayerGroup(0, LAYERS)]),
])
async def test_layers_per_group_sets_the_groups(per_group: int, expected: list[LayerGroup]) -> None:
    kv = make_kv(cross_layer=True)
    tokens = prompt(2)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        written = fill(kv, [0, 1], seed=2)
        await engine.store(tokens, [0, 1])
        zero(kv)
        async with engine.load_layerwise(tokens, [5, 6], layers_per_group=per_group) as layers:
            groups = []
            async for group in layers:
                groups.append(group)
                assert all(layer_in_place(kv, layer, [5, 6], written) for layer in range(*group))
        assert groups == expected


@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [False, True], ids=["per_layer", "cross_layer"])
async def test_places_what_load_places(cross_layer: bool) -> None:
    kv = make_kv(cross_layer)
    tokens = prompt(4, extra=2, seed=3)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        written = fill(kv, [0, 1, 2, 3], seed=3)
        assert await engine.store(tokens[: 3 * BLOCK], [0, 1, 2]) == 3 * BLOCK  # chunk 3 never stored
        cases = [  # (num_computed_tokens, params, chunks placed, tokens)
            (0, None, [0, 1, 2], 3 * BLOCK),
            (BLOCK + 1, None, [1, 2], 2 * BLOCK - 1),
            (0, {"max_load_tokens": 2 * BLOCK + 1}, [0, 1], 2 * BLOCK),
        ]
        a, b = [10, 11, 12, 13, 14], [30, 31, 32, 33, 34]
        for computed, params, placed, new_tokens in cases:
            zero(kv)
            expected = await engine.load_with_sources(tokens[:-1], a, params, num_computed_tokens=computed)
            assert expected.tokens == new_tokens
            async with engine.load_layerwise(tokens[:-1], b, params, num_computed_tokens=computed) as layers:
                assert (layers.tokens, layers.tokens_by_tier) == (expected.tokens, expected.tokens_by_tier)
                assert [g async for g in layers] == ALL_GROUPS
            for i in range(5):
                for layer in range(LAYERS):
                    for blocks in (a, b):
                        if i in placed:
                            assert torch.equal(page(kv, layer, blocks[i]), written[(layer, i)])
                        else:
                            assert not page(kv, layer, blocks[i]).any()
        assert pinned(engine) == 0


@pytest.mark.anyio
async def test_a_miss_yields_every_group_at_once_and_copies_nothing(hook: CopyHook) -> None:
    kv = make_kv(cross_layer=False)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        async with engine.load_layerwise(prompt(3, seed=4), [0, 1, 2]) as layers:
            assert layers.tokens == 0 and layers.tokens_by_tier == {}
            assert [g async for g in layers] == ALL_GROUPS
        assert hook.ran == [] and engine.statistics()["copies"].load_size.count == 0
        assert pinned(engine) == 0


@pytest.mark.anyio
async def test_extra_keys_key_the_load_and_its_event_metadata_as_load_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(2, seed=15)
    tenant = {"cache_salt": "tenant-a", "lora_name": "sql", "lora_path": "/adapters/sql"}
    config = {**host_config(), "self_describing_kv_events": True}
    async with kvtier.open(config, geometry(), kv, events={"endpoint": "tcp://127.0.0.1:*"}) as engine:
        written = fill(kv, [0, 1], seed=15)
        assert await engine.store(tokens, [0, 1], **tenant) == 2 * BLOCK
        zero(kv)
        for other in ({}, {**tenant, "cache_salt": "tenant-b"}):  # another tenant, or none: a miss
            async with engine.load_layerwise(tokens, [4, 5], **other) as layers:
                assert layers.tokens == 0 and [g async for g in layers] == ALL_GROUPS
        assert not any(page(kv, layer, b).any() for layer in range(LAYERS) for b in (4, 5))

        remembered: list[tuple[bytes, Any]] = []  # what self-describing events will say of the chunks
        monkeypatch.setattr(engine.translator, "remember_chunk", lambda key, md: remembered.append((key, md)))
        async with engine.load_layerwise(tokens, [4, 5], **tenant) as layers:
            assert layers.tokens == 2 * BLOCK
            assert [g async for g in layers] == ALL_GROUPS
        assert all(layer_in_place(kv, layer, [4, 5], written) for layer in range(LAYERS))
        by_layerwise = remembered[:]
        remembered.clear()
        assert await engine.load(tokens, [8, 9], **tenant) == 2 * BLOCK
        assert by_layerwise == remembered
        assert [key for key, _ in remembered] == engine.chunk_keys(tokens, **tenant)
        assert [md.lora_name for _, md in remembered] == ["sql", "sql"]
        assert pinned(engine) == 0


# --- failures ------------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [False, True], ids=["per_layer", "cross_layer"])
async def test_a_failed_group_copy_raises_recompute_and_unpins(cross_layer: bool, hook: CopyHook) -> None:
    kv = make_kv(cross_layer)
    tokens = prompt(2, seed=5)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        written = fill(kv, [0, 1], seed=5)
        await engine.store(tokens, [0, 1])
        zero(kv)
        hook.fail_at = {2}
        yielded = []
        with pytest.raises(LayerwiseLoadError, match="recompute") as caught:
            async with engine.load_layerwise(tokens, [8, 9]) as layers:
                assert layers.tokens == 2 * BLOCK
                async for group in layers:
                    yielded.append(group)
                    assert all(layer_in_place(kv, layer, [8, 9], written) for layer in range(*group))
        assert yielded == ALL_GROUPS[:2]  # the groups before the failed one, with correct bytes
        assert caught.value.group == LayerGroup(2, 3) and "copy_error" in (caught.value.reason or "")
        assert isinstance(caught.value, kvtier.errors.KvtierError)
        assert pinned(engine) == 0
        assert engine.statistics()["copies"].failures == 1
        # The chunks are intact in host memory: a later load places them.
        assert await engine.load(tokens, [8, 9]) == 2 * BLOCK


@pytest.mark.anyio
async def test_after_a_failure_every_step_raises_again(hook: CopyHook) -> None:
    kv = make_kv(cross_layer=True)
    tokens = prompt(1, seed=6)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        fill(kv, [0], seed=6)
        await engine.store(tokens, [0])
        hook.fail_at = {0}
        async with engine.load_layerwise(tokens, [3]) as layers:
            steps = aiter(layers)
            for _ in range(2):
                with pytest.raises(LayerwiseLoadError):
                    await anext(steps)
        assert pinned(engine) == 0


@pytest.mark.anyio
async def test_failed_promotion_cuts_the_prefix_before_the_first_group() -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(3, seed=7)
    config = {"spec_name": "TieringOffloadingSpec", **host_config(),
              "secondary_tiers": [{"type": "faulty", "capacity_bytes": 1 << 24}]}
    async with kvtier.open(config, geometry(), kv, wait_timeout_s=5) as engine:
        fill(kv, [0, 1, 2], seed=7)
        await engine.store(tokens, [0, 1, 2])
        await engine.drain()
        await engine.reset_cache()  # host memory forgets: every chunk must be promoted
        engine.tiers[0].fail_reads_of([engine.chunk_keys(tokens)[1]])
        async with engine.load_layerwise(tokens, [10, 11, 12]) as layers:
            assert layers.tokens == BLOCK and layers.tokens_by_tier == {"1:faulty": BLOCK}
            assert [g async for g in layers] == ALL_GROUPS
        assert await engine.load(tokens, [20, 21, 22]) == BLOCK  # load cuts it in the same place
        assert pinned(engine) == 0


@pytest.mark.anyio
async def test_promotions_from_fs_are_awaited_before_the_first_group(tmp_path: Path) -> None:
    kv = make_kv(cross_layer=True)
    tokens = prompt(3, extra=3, seed=8)
    config = {"spec_name": "TieringOffloadingSpec", **host_config(),
              "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}
    async with kvtier.open(config, geometry(), kv) as engine:
        written = fill(kv, [0, 1, 2], seed=8)
        await engine.store(tokens, [0, 1, 2, 3])
        await engine.drain()
        await engine.reset_cache()
        zero(kv)
        async with engine.load_layerwise(tokens, [40, 41, 42, 43]) as layers:
            assert layers.tokens == 3 * BLOCK and layers.tokens_by_tier == {"1:fs": 3 * BLOCK}
            async for group in layers:
                assert all(layer_in_place(kv, layer, [40, 41, 42], written) for layer in range(*group))
        assert pinned(engine) == 0


# --- leaving early -------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_break_withdraws_queued_copies_and_unpins_only_after_those_in_flight(
    hook: CopyHook, cancels: list[int]
) -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(2, seed=9)
    seen: dict[str, int] = {}
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        fill(kv, [0, 1], seed=9)
        await engine.store(tokens, [0, 1])
        hook.gate_from = 1  # the copy engine's two workers stall on layers 1 and 2
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_gate_once_cancelled, engine, hook, cancels, seen)
                async with engine.load_layerwise(tokens, [4, 5]) as layers:
                    async for _ in layers:
                        break
        assert seen["pinned_while_copies_held"] == 2  # still pinned while copies read the slots
        assert pinned(engine) == 0
        assert (3, 4) not in hook.ran  # never started: withdrawn
        assert hook.ran[0] == (0, 1)
        assert engine.statistics()["copies"].failures == 0  # a withdrawn copy is no failure


@pytest.mark.anyio
async def test_cancellation_mid_iteration_releases_the_slots(hook: CopyHook, cancels: list[int]) -> None:
    kv = make_kv(cross_layer=True)
    tokens = prompt(2, seed=10)
    seen: dict[str, int] = {}
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        fill(kv, [0, 1], seed=10)
        await engine.store(tokens, [0, 1])
        hook.gate_from = 1
        yielded = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_gate_once_cancelled, engine, hook, cancels, seen)
                with anyio.CancelScope() as scope:
                    async with engine.load_layerwise(tokens, [4, 5]) as layers:
                        async for group in layers:
                            yielded.append(group)
                            scope.cancel()  # the wait for the next (held) group is cancelled
        assert scope.cancelled_caught and yielded == ALL_GROUPS[:1]
        assert seen["pinned_while_copies_held"] == 2
        assert pinned(engine) == 0
        assert await engine.load(tokens, [4, 5]) == 2 * BLOCK  # the engine is unharmed


@pytest.mark.anyio
async def test_an_exception_in_the_body_releases_the_slots() -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(2, seed=11)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        fill(kv, [0, 1], seed=11)
        await engine.store(tokens, [0, 1])
        with pytest.raises(KeyError):
            async with engine.load_layerwise(tokens, [4, 5]):
                raise KeyError("the model failed")
        assert pinned(engine) == 0


# --- misuse --------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_misuse_raises_at_the_call() -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(2, seed=12)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        fill(kv, [0, 1], seed=12)
        await engine.store(tokens, [0, 1])
        with pytest.raises(ValueError, match="layers_per_group"):
            engine.load_layerwise(tokens, [4, 5], layers_per_group=0)
        for bad in ("1", True, 1.0):
            with pytest.raises(TypeError, match="layers_per_group"):
                engine.load_layerwise(tokens, [4, 5], layers_per_group=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="token_ids"):
            engine.load_layerwise([1.5], [4])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="out of range"):  # block ids: on entry, as load
            async with engine.load_layerwise(tokens, [4, NUM_BLOCKS]):
                pass  # pragma: no cover
        load = engine.load_layerwise(tokens, [4, 5])
        with pytest.raises(RuntimeError, match="inside its `async with`"):
            aiter(load)
        async with load as layers:
            with pytest.raises(RuntimeError, match="entered once"):
                await load.__aenter__()
            assert [g async for g in layers] == ALL_GROUPS
            with pytest.raises(RuntimeError, match="iterated once"):
                aiter(layers)
        with pytest.raises(RuntimeError, match="inside its `async with`"):
            await anext(layers)
        assert pinned(engine) == 0
        unused = engine.load_layerwise(tokens, [4, 5])
    with pytest.raises(EngineClosedError):
        engine.load_layerwise(tokens, [4, 5])
    with pytest.raises(EngineClosedError):
        async with unused:
            pass  # pragma: no cover


@pytest.mark.anyio
async def test_an_engine_without_device_kv_refuses() -> None:
    async with kvtier.open(host_config(), geometry()) as engine:
        with pytest.raises(RuntimeError, match="without device_kv"):
            engine.load_layerwise(prompt(1), [0])


# --- blocking facade ------------------------------------------------------------------------------
def test_threaded_engine_iterates_groups_blocking(hook: CopyHook) -> None:
    kv = make_kv(cross_layer=False)
    tokens = prompt(2, seed=13)
    engine = kvtier.start_in_thread(host_config(), geometry(), kv)
    try:
        written = fill(kv, [0, 1], seed=13)
        assert engine.store(tokens, [0, 1]) == 2 * BLOCK
        zero(kv)
        with engine.load_layerwise(tokens, [6, 7], layers_per_group=2) as layers:
            assert layers.tokens == 2 * BLOCK
            groups = []
            for group in layers:
                groups.append(group)
                assert all(layer_in_place(kv, layer, [6, 7], written) for layer in range(*group))
        assert groups == [LayerGroup(0, 2), LayerGroup(2, 4)]
        hook.fail_at = {2}
        with pytest.raises(LayerwiseLoadError):
            with engine.load_layerwise(tokens, [6, 7], layers_per_group=2) as layers:
                for _ in layers:
                    pass
        assert engine.statistics()["0:primary"].pinned_slots == 0
    finally:
        engine.close()
    with pytest.raises(EngineClosedError):
        engine.load_layerwise(tokens, [6, 7])


# --- CUDA (skipped without a GPU) ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("cross_layer", [False, True], ids=["per_layer", "cross_layer"])
async def test_cuda_groups_arrive_in_order_with_their_bytes(cross_layer: bool) -> None:
    kv = make_kv(cross_layer, device="cuda")
    tokens = prompt(3, seed=14)
    async with kvtier.open(host_config(), geometry(), kv) as engine:
        assert type(engine.copy_engine).__name__ == "CudaCopyEngine"
        written = fill(kv, [0, 1, 2], seed=14)
        assert await engine.store(tokens, [0, 1, 2]) == 3 * BLOCK
        zero(kv)
        torch.cuda.synchronize()
        async with engine.load_layerwise(tokens, [30, 12, 13], layers_per_group=3) as layers:
            assert layers.tokens == 3 * BLOCK
            groups = []
            async for group in layers:
                groups.append(group)
                # The group's event completed: its bytes are readable on the device now.
                assert all(layer_in_place(kv, layer, [30, 12, 13], written) for layer in range(*group))
        assert groups == [LayerGroup(0, 3), LayerGroup(3, 4)]
        assert pinned(engine) == 0

"""The ordering contract between a caller's device work and kvtier's copies (CPU-side logic).

``kvtier.host.copy_engine`` ("Ordering"): the event a copy waits for is recorded in the caller's
thread, on the caller's stream, when the caller's operation starts; a load hands its completion
over to that stream. A recording copy engine (the CPU engine with the two hooks observed) stands
in for CUDA, so the contract is checked where it is easy to get wrong: ``kvtier.open``'s engine
and the blocking facade, whose calls run on another thread than the caller's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio
import pytest
import torch

import kvtier
from kvtier import KVGeometry
from kvtier.host import copy_factory
from kvtier.host.copy_jobs import CopyJob, CopyOrder, CopyResult
from kvtier.host.cpu_copy import CpuCopyEngine

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS = 4, 2, 2, 16, 16
TOKENS = list(range(4 * BLOCK))


def geometry() -> KVGeometry:
    return KVGeometry("test/order", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16",
                      block_size=BLOCK)


def config() -> dict[str, Any]:
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 16 * geometry().slot_bytes(1)}


def device_kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), generator=gen).half() for _ in range(LAYERS)]


class RecordingEngine(CpuCopyEngine):
    """The CPU engine, with capture and hand-over observed as a CUDA engine would do them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[int, Any]] = []  # (thread, stream) of each event recorded
        self.jobs: list[CopyJob] = []
        self.handed_over: list[tuple[Any, int]] = []  # (stream, job id)

    def capture_order(self, stream: Any = None, after: Any = None) -> CopyOrder:
        stream = stream if stream is not None else f"current-stream-of-{threading.get_ident()}"
        if after is None:  # recording happens only here: what the caller gives is used as is
            self.recorded.append((threading.get_ident(), stream))
            after = ("event", stream, len(self.recorded))
        return CopyOrder(stream, after)

    def submit(self, job: CopyJob) -> None:
        self.jobs.append(job)
        super().submit(job)

    def get_finished(self) -> list[CopyResult]:  # a CUDA result carries its done event: a marker here
        return [dataclasses.replace(r, done=("done", r.job_id)) if r.success else r for r in super().get_finished()]

    def hand_over(self, order: CopyOrder | None, done: Any) -> None:
        assert order is not None and done[0] == "done"
        self.handed_over.append((order.stream, done[1]))


class RunAheadEngine(RecordingEngine):
    """Reports each layer-group load issued as a worker takes it (on the loop thread, after the
    withdrawn jobs were set aside), as the CUDA engine does once its copies are on the stream, and
    holds the copies themselves until ``release`` is set; ``fail_layers`` makes the copy of that
    layer range fail once released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.fail_layers: tuple[int, int] | None = None
        self.finished_ids: list[int] = []  # copied (worker thread)
        self.reported_ids: list[int] = []  # reported (loop thread)
        self._issued_now: list[tuple[int, Any]] = []

    def _report(self, result: CopyResult) -> None:
        self.reported_ids.append(result.job_id)
        super()._report(result)

    def _take_cancelled(self, jobs: list[CopyJob]) -> list[CopyJob]:
        runnable = super()._take_cancelled(jobs)
        for job in runnable:
            if job.layers is not None and job.direction == "to_device":
                self._issued_now.append((job.job_id, ("done", job.job_id)))
                if self._wakeup is not None:
                    self._wakeup()
        return runnable

    def get_issued(self) -> list[tuple[int, Any]]:
        issued, self._issued_now = self._issued_now, []
        return issued

    def _copy_batch(self, batch: list[CopyJob]) -> list[tuple[int, float, Exception | None]]:
        if any(job.layers is not None for job in batch):
            self.release.wait(10)  # set by the test (or its teardown); a failing test must not hang here
        outcomes = super()._copy_batch(batch)
        for i, job in enumerate(batch):
            if job.layers is not None and job.layers == self.fail_layers:
                outcomes[i] = (0, 0.0, RuntimeError("device error after the copy was issued"))
        self.finished_ids.extend(job.job_id for job in batch)
        return outcomes


E = TypeVar("E", bound=CpuCopyEngine)


def _engines_made(monkeypatch: pytest.MonkeyPatch, kind: type[E]) -> list[E]:
    """Every copy engine the engines opened from now on make is a ``kind``; the list of them."""
    made: list[E] = []

    def make(*args: Any, **kwargs: Any) -> E:
        engine = kind(*args, **kwargs)
        made.append(engine)
        return engine

    monkeypatch.setattr(copy_factory, "make_copy_engine", make)
    return made


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingEngine]:
    return _engines_made(monkeypatch, RecordingEngine)


@pytest.fixture
def running_ahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RunAheadEngine]]:
    made = _engines_made(monkeypatch, RunAheadEngine)
    yield made
    for engine in made:
        engine.release.set()


@pytest.mark.anyio
async def test_a_layer_group_is_yielded_once_issued_with_the_callers_stream_waiting_for_it(
        running_ahead: list[RunAheadEngine]) -> None:
    """As the CUDA engine reports a group's copies issued, the group is yielded and the caller's
    stream made to wait for them — before they finish: the host runs ahead of the copies."""
    blocks = list(range(len(TOKENS) // BLOCK))
    kv = device_kv()
    expected = [layer[blocks].clone() for layer in kv]
    async with kvtier.open(config(), geometry(), kv) as engine:
        (copies,) = running_ahead
        await engine.store(TOKENS, blocks)
        for layer in kv:
            layer.zero_()
        async with engine.load_layerwise(TOKENS, blocks, stream="compute") as layers:
            group_jobs = [job.job_id for job in copies.jobs if job.layers is not None]
            seen = 0
            async for _group in layers:
                assert copies.handed_over[-1] == ("compute", group_jobs[seen])
                assert group_jobs[seen] not in copies.finished_ids  # still copying
                seen += 1
            assert seen == LAYERS
            copies.release.set()
        # Leaving waited for the copies: every byte is there.
        assert all(torch.equal(layer[blocks], want) for layer, want in zip(kv, expected))


async def _until_reported(engine: Any, copies: RunAheadEngine, job_id: int) -> None:
    with anyio.fail_after(10):
        while job_id not in copies.reported_ids:
            await anyio.sleep(0.005)
    engine.copies.dispatch()  # handed to the load now, whether or not the drive task ran yet


@pytest.mark.anyio
async def test_a_copy_failing_after_its_group_was_yielded_fails_the_load_but_not_the_callers_error(
        running_ahead: list[RunAheadEngine]) -> None:
    """Group 0's copy fails after the group was yielded: leaving the block normally raises, a
    step taken once the failure is known raises, and an error of the caller's own stays its own."""
    blocks = list(range(len(TOKENS) // BLOCK))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        (copies,) = running_ahead
        await engine.store(TOKENS, blocks)
        copies.fail_layers = (0, 1)
        with pytest.raises(kvtier.LayerwiseLoadError) as raised:
            async with engine.load_layerwise(TOKENS, blocks) as layers:
                async for _group in layers:
                    pass  # every group is yielded: all were issued
                copies.release.set()
        assert (raised.value.group.start, raised.value.group.stop) == (0, 1)

        copies.release.clear()
        with pytest.raises(kvtier.LayerwiseLoadError) as raised:
            async with engine.load_layerwise(TOKENS, blocks) as layers:
                steps = aiter(layers)
                await anext(steps)  # group 0, issued, still copying
                first = [job.job_id for job in copies.jobs if job.layers == (0, 1)][-1]
                copies.release.set()
                await _until_reported(engine, copies, first)
                await anext(steps)  # group 0's copy failed meanwhile: this step says so
        assert (raised.value.group.start, raised.value.group.stop) == (0, 1)

        copies.release.clear()
        with pytest.raises(ValueError, match="the caller's own"):  # not replaced by the late failure
            async with engine.load_layerwise(TOKENS, blocks) as layers:
                async for _group in layers:
                    pass
                copies.release.set()
                raise ValueError("the caller's own error")
        assert engine.statistics()["0:primary"].pinned_slots == 0


@pytest.mark.anyio
async def test_copies_wait_for_the_callers_stream_captured_at_the_call(recording: list[RecordingEngine]) -> None:
    blocks = list(range(len(TOKENS) // BLOCK))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        (copies,) = recording
        caller = threading.get_ident()
        assert await engine.store(TOKENS, blocks, stream="compute") == len(TOKENS)
        assert copies.recorded == [(caller, "compute")]
        assert copies.jobs[-1].order is not None and copies.jobs[-1].order.ready == ("event", "compute", 1)
        assert await engine.load(TOKENS, blocks, stream="compute") == len(TOKENS)
        assert copies.recorded[-1] == (caller, "compute")
        load_job = copies.jobs[-1]
        assert load_job.direction == "to_device" and load_job.order is not None
        assert copies.handed_over == [("compute", load_job.job_id)]  # the stream waits for the load
        # Without a stream: the calling thread's current one, still recorded at the call.
        await engine.load(TOKENS, blocks)
        assert copies.recorded[-1] == (caller, f"current-stream-of-{caller}")
        # An event the caller recorded itself is used as is: nothing is recorded.
        before = len(copies.recorded)
        await engine.store(TOKENS + TOKENS, list(range(2 * len(blocks))), stream="s", after="my-event")
        assert len(copies.recorded) == before and copies.jobs[-1].order == CopyOrder("s", "my-event")


def test_the_blocking_facade_captures_in_the_calling_thread(recording: list[RecordingEngine]) -> None:
    """start_in_thread runs the engine on its own loop thread: the event must still be recorded in
    the thread that called store/load (its current stream is the caller's), not the loop's."""
    blocks = list(range(len(TOKENS) // BLOCK))
    engine = kvtier.start_in_thread(config(), geometry(), device_kv())
    try:
        (copies,) = recording
        caller = threading.get_ident()
        assert engine.store(TOKENS, blocks) == len(TOKENS)
        assert engine.load(TOKENS, blocks) == len(TOKENS)
        assert engine.load_with_sources(TOKENS, blocks, stream="side").tokens == len(TOKENS)
        assert [thread for thread, _ in copies.recorded] == [caller, caller, caller]
        assert [stream for _, stream in copies.recorded] == [f"current-stream-of-{caller}"] * 2 + ["side"]
        assert all(job.order is not None for job in copies.jobs)
        assert [stream for stream, _ in copies.handed_over] == [f"current-stream-of-{caller}", "side"]
        with engine.load_layerwise(TOKENS, blocks, stream="side") as layers:
            groups = list(layers)
        assert len(groups) == LAYERS and copies.recorded[-1] == (caller, "side")
        group_jobs = [job.job_id for job in copies.jobs if job.layers is not None]
        assert copies.handed_over[-LAYERS:] == [("side", job_id) for job_id in group_jobs]
    finally:
        engine.close()


@pytest.mark.anyio
async def test_layerwise_groups_are_handed_over_one_by_one(recording: list[RecordingEngine]) -> None:
    blocks = list(range(len(TOKENS) // BLOCK))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        (copies,) = recording
        await engine.store(TOKENS, blocks)
        async with engine.load_layerwise(TOKENS, blocks, stream="compute") as layers:
            seen = 0
            async for _group in layers:
                seen += 1
                assert len(copies.handed_over) == seen  # each group before the caller computes on it
        assert all(job.order is not None and job.order.stream == "compute" for job in copies.jobs if job.layers)


@pytest.mark.anyio
async def test_stream_or_after_with_cpu_tensors_is_a_value_error() -> None:
    blocks = list(range(len(TOKENS) // BLOCK))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        for kwargs in ({"stream": object()}, {"after": object()}):
            with pytest.raises(ValueError, match="CPU tensors"):
                await engine.store(TOKENS, blocks, **kwargs)
            with pytest.raises(ValueError, match="CPU tensors"):
                await engine.load(TOKENS, blocks, **kwargs)
            with pytest.raises(ValueError, match="CPU tensors"):
                engine.load_layerwise(TOKENS, blocks, **kwargs)
        assert await engine.store(TOKENS, blocks) == len(TOKENS)  # nothing was queued meanwhile
    async with kvtier.open(config(), geometry()) as engine:  # no device_kv at all
        with pytest.raises(ValueError, match="device_kv"):
            await engine.store(TOKENS, blocks, stream=object())


def test_the_blocking_facade_refuses_a_stream_for_cpu_tensors() -> None:
    engine = kvtier.start_in_thread(config(), geometry(), device_kv())
    try:
        with pytest.raises(ValueError, match="CPU tensors"):
            engine.store(TOKENS, [0, 1, 2, 3], stream=object())
    finally:
        engine.close()


@pytest.mark.anyio
async def test_a_job_without_an_order_still_runs(anyio_backend: str) -> None:
    """Direct users of a copy engine submit jobs without an order (the CUDA engine then waits for
    the submitting thread's stream); the CPU engine copies them as before."""
    from kvtier.host.slots import SlotBuffer

    geo = geometry()
    kv = device_kv()
    buffer = SlotBuffer(4, geo.slot_bytes(1), pin_memory=False)
    engine = CpuCopyEngine(kv, geo, 1, buffer)
    done = anyio.Event()
    engine.set_wakeup(done.set)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            engine.submit(CopyJob(1, "to_host", [0], [3]))
            with anyio.fail_after(10):
                await done.wait()
            (result,) = engine.get_finished()
            assert result.success and result.done is None
            await engine.aclose()
    finally:
        buffer.close()


@pytest.mark.anyio
async def test_the_host_buffer_is_kept_when_closing_could_not_fence_the_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy engine that reports copies possibly still running after its close (a hung GPU) must
    not have the host buffer freed under them: the engine keeps it."""

    class Unfenced(CpuCopyEngine):
        async def _finish_in_flight(self) -> None:
            self.fenced = False

    monkeypatch.setattr(copy_factory, "make_copy_engine", lambda *a, **k: Unfenced(*a, **k))
    blocks = list(range(len(TOKENS) // BLOCK))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        await engine.store(TOKENS, blocks)
        host = engine.host
    assert host._buffer is not None  # kept: a device copy might still use it

    monkeypatch.setattr(copy_factory, "make_copy_engine", lambda *a, **k: CpuCopyEngine(*a, **k))
    async with kvtier.open(config(), geometry(), device_kv()) as engine:
        await engine.store(TOKENS, blocks)
        host = engine.host
    assert host._buffer is None  # fenced: released as usual

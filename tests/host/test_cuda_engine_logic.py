"""The CUDA copy engine's own ordering and fencing code, run against a stand-in CUDA runtime.

No GPU is needed: ``torch.cuda``'s streams, events and stream contexts are replaced by recorders
(:class:`FakeCuda`), and the engine's plans are those of CPU tensors. What is checked is the
engine's code itself (``capture_order``, ``hand_over``, ``_issue``), not a re-implementation:
where the order event is recorded (the caller's thread, the caller's stream), that copies wait
for it, and that a job failing part-way is failed only after a fence behind its issued copies.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.host import cuda_copy
from kvtier.host.copy_jobs import CopyJob, CopyOrder
from kvtier.host.cpu_copy import CpuCopyEngine
from kvtier.host.cuda_copy import CudaCopyEngine
from kvtier.host.slots import SlotBuffer
from kvtier.layout import KVGeometry


class FakeCuda:
    """Stand-in streams, events and stream contexts that log what is done to them, and by which thread."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.local = threading.local()
        fake = self

        class Stream:
            def __init__(self, device: Any = "fake") -> None:
                self.device = device

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self, event))

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                self.blocking = blocking

            def record(self, stream: Any = None) -> None:
                fake.log.append(("record", self, stream if stream is not None else fake.current(),
                                 threading.current_thread().name))

            def synchronize(self) -> None:
                fake.log.append(("synchronize", self))

        self.Stream, self.Event = Stream, Event
        self.default = Stream()

    def current(self, device: Any = None) -> Any:
        return getattr(self.local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        previous = getattr(self.local, "stream", self.default)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = previous


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return fake


@pytest.fixture
def engine(fake_cuda: FakeCuda) -> Iterator[CudaCopyEngine]:
    """The CUDA engine's methods over the plans of CPU tensors (its constructor needs a GPU)."""
    geo = KVGeometry("m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
    kv = [torch.zeros((8, 2, 4, 2, 8), dtype=torch.float16) for _ in range(2)]
    buffer = SlotBuffer(2, geo.slot_bytes(1), pin_memory=False)
    engine = object.__new__(CudaCopyEngine)
    engine._plans = CpuCopyEngine(kv, geo, 1, buffer)._plans
    engine._cuda_device = "fake"
    engine._streams = {"to_host": fake_cuda.Stream(), "to_device": fake_cuda.Stream()}
    yield engine
    buffer.close()


def test_the_order_event_is_recorded_in_the_callers_thread_on_its_current_stream(
        fake_cuda: FakeCuda, engine: CudaCopyEngine) -> None:
    side = fake_cuda.Stream()
    orders: list[CopyOrder] = []

    def caller() -> None:
        with torch.cuda.stream(side):
            orders.append(engine.capture_order())

    thread = threading.Thread(target=caller, name="model-runner")
    thread.start()
    thread.join()
    [order] = orders
    assert order.stream is side
    assert fake_cuda.log == [("record", order.ready, side, "model-runner")]


def test_an_explicit_stream_or_event_is_what_copies_wait_for(fake_cuda: FakeCuda, engine: CudaCopyEngine) -> None:
    side = fake_cuda.Stream()
    order = engine.capture_order(stream=side)
    assert order.stream is side and fake_cuda.log[-1][:3] == ("record", order.ready, side)
    mine = fake_cuda.Event()
    fake_cuda.log.clear()
    assert engine.capture_order(stream=side, after=mine).ready is mine and not fake_cuda.log  # used as given
    with pytest.raises(TypeError, match="stream"):
        engine.capture_order(stream=object())
    with pytest.raises(ValueError, match="KV cache"):
        engine.capture_order(stream=fake_cuda.Stream(device="other"))
    with pytest.raises(TypeError, match="after"):
        engine.capture_order(after=object())


def test_copies_wait_for_the_order_and_a_load_is_handed_over_to_the_callers_stream(
        fake_cuda: FakeCuda, engine: CudaCopyEngine) -> None:
    order = engine.capture_order()
    fake_cuda.log.clear()
    issued = engine._issue(CopyJob(1, "to_device", [0], [3]), order.ready)
    copy_stream = engine._streams["to_device"]
    assert fake_cuda.log[0] == ("wait", copy_stream, order.ready)  # before anything is issued
    assert fake_cuda.log[-1][:3] == ("record", issued.done, copy_stream) and issued.done.blocking
    fake_cuda.log.clear()
    engine.hand_over(order, issued.done)
    assert fake_cuda.log == [("wait", order.stream, issued.done)]


def test_a_job_failing_part_way_is_failed_only_after_a_fence_behind_its_issued_copies(
        fake_cuda: FakeCuda, engine: CudaCopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def copy_some_then_fail(plans: Any, job: CopyJob, non_blocking: bool = False) -> Any:
        fake_cuda.log.append(("copy issued",))
        raise RuntimeError("the second copy could not be issued")

    monkeypatch.setattr(cuda_copy, "copy_parts", copy_some_then_fail)
    order = engine.capture_order()
    fake_cuda.log.clear()
    with pytest.raises(RuntimeError, match="second copy"):
        engine._issue(CopyJob(2, "to_host", [1], [5]), order.ready)
    copy_stream = engine._streams["to_host"]
    steps = [entry[0] for entry in fake_cuda.log]
    assert steps == ["wait", "record", "copy issued", "record", "synchronize"]
    fence = fake_cuda.log[3][1]
    assert fake_cuda.log[3][2] is copy_stream and fake_cuda.log[4] == ("synchronize", fence)


def test_a_store_zeroes_what_its_copies_do_not_write_before_issuing_them(
        fake_cuda: FakeCuda, engine: CudaCopyEngine) -> None:
    buffer = engine._plans.groups[0][0].buffer
    chunk_bytes = engine._plans.model.chunk_bytes(0, 1)
    assert chunk_bytes < buffer.slot_bytes  # a tail no copy writes
    buffer.array[:] = 0xAB  # whatever the slots held before
    engine._issue(CopyJob(3, "to_host", [0], [2]), engine.capture_order().ready)
    assert not buffer.array[0, chunk_bytes:].any()
    assert (buffer.array[1] == 0xAB).all()  # another slot is not touched

"""The host slot buffer (``kvtier/host/slots.py``), its pinned path driven through a fake CUDA runtime.

Without a GPU the pinned path is exercised with a recording stand-in for ``torch.cuda.cudart()``:
what matters here is what kvtier asks of the runtime — exactly the configured bytes, in bounded
whole-slot pieces, rolled back on failure and unregistered at close — not the driver's own work.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.host import slots
from kvtier.host.slots import PAGE_SIZE, SlotBuffer

SLOT = 3 * PAGE_SIZE


class FakeCudart:
    """Records cudaHostRegister/Unregister; fails the ``fail_at``-th registration (1-based)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes, currently registered
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", address, size))
        if self.fail_at is not None and sum(c[0] == "register" for c in self.calls) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        assert flags == 0
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address, self.registered.pop(address)))
        return 0

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return "out of memory"


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(slots, "_cuda_available", lambda: True)
    monkeypatch.setattr(slots, "_cuda_runtime", lambda: fake)
    monkeypatch.setattr(slots, "PIN_PIECE_BYTES", 4 * SLOT + 100)  # 4 whole slots per piece
    return fake


def test_pinned_buffer_registers_exactly_its_bytes_in_whole_slot_pieces(cudart: FakeCudart) -> None:
    buffer = SlotBuffer(10, SLOT, pin_memory=True)
    try:
        assert buffer.pinned and buffer.nbytes == 10 * SLOT
        start = buffer.array.ctypes.data
        assert start % PAGE_SIZE == 0
        pieces = sorted(cudart.registered.items())
        assert [size for _, size in pieces] == [4 * SLOT, 4 * SLOT, 2 * SLOT]  # never a slot split
        assert pieces[0][0] == start and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))
        assert sum(size for _, size in pieces) == buffer.nbytes  # no rounding up, nothing more
        assert not np.any(buffer.array)  # zero-filled: padding never carries stale memory
        buffer.view(9)[:] = b"\x07" * SLOT
        assert buffer.tensor[9].sum().item() == 7 * SLOT  # one memory for views and tensor
    finally:
        buffer.close()
    assert cudart.registered == {}  # unregistered at close
    assert [c[0] for c in cudart.calls] == ["register"] * 3 + ["unregister"] * 3


def test_a_failed_registration_unregisters_the_pieces_before_it(cudart: FakeCudart) -> None:
    cudart.fail_at = 3
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use.*pinned.*out of memory"):
        SlotBuffer(10, SLOT, pin_memory=True)
    assert cudart.registered == {}
    assert [c[0] for c in cudart.calls] == ["register"] * 3 + ["unregister"] * 2


def test_one_slot_larger_than_a_piece_is_one_piece(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudart) -> None:
    big = 2 * PAGE_SIZE * 1024
    monkeypatch.setattr(slots, "PIN_PIECE_BYTES", big // 2)
    buffer = SlotBuffer(3, big, pin_memory=True)
    try:
        assert sorted(cudart.registered.values()) == [big, big, big]
    finally:
        buffer.close()


def test_an_unpinned_buffer_never_touches_the_runtime(cudart: FakeCudart) -> None:
    buffer = SlotBuffer(4, SLOT, pin_memory=False)
    try:
        assert not buffer.pinned and cudart.calls == []
        assert len(buffer.views([0, 3])) == 2
    finally:
        buffer.close()


def test_pin_memory_without_cuda_is_refused() -> None:
    if slots._cuda_available():  # pragma: no cover - a GPU machine pins for real
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        SlotBuffer(1, SLOT, pin_memory=True)


def test_default_is_unpinned_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "_cuda_available", lambda: False)
    buffer = SlotBuffer(2, SLOT)
    try:
        assert not buffer.pinned
    finally:
        buffer.close()

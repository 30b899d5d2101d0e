"""The host slot buffer: one contiguous, page-aligned region of ``num_slots × slot_bytes``.

Pinned (page-locked) through ``torch`` when CUDA is available, so DMA copies run at full speed;
an anonymous ``mmap`` otherwise (page-aligned, lazily backed, so a large buffer costs nothing
until it is written). Secondary tiers see one writable ``memoryview`` row per slot; the copy
engines see the same bytes as a ``uint8`` tensor of shape ``[num_slots, slot_bytes]``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError

__all__ = ["SlotBuffer", "PAGE_SIZE"]

PAGE_SIZE = 4096


class SlotBuffer:
    """Owner of the host bytes. Close it with :meth:`close` once nothing reads it any more.

    A size the machine cannot allocate is a :class:`~kvtier.errors.ConfigError` naming
    ``cpu_bytes_to_use`` (the key the size comes from), never a raw ``OSError``.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, pin_memory: bool | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if slot_bytes <= 0 or slot_bytes % PAGE_SIZE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE_SIZE}, got {slot_bytes}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise RuntimeError("pin_memory=True needs CUDA; this torch has no usable accelerator")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin_memory
        self._mmap: mmap.mmap | None = None
        try:
            if pin_memory:
                # cudaHostAlloc returns page-aligned memory.
                self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=True)
                self.array = self.tensor.numpy()
            else:
                self._mmap = mmap.mmap(-1, num_slots * slot_bytes)
                self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_slots, slot_bytes)
                self.tensor = torch.from_numpy(self.array)
        except (OSError, MemoryError, RuntimeError, OverflowError) as exc:
            if self._mmap is not None:
                self._mmap.close()
            kind = "pinned (page-locked)" if pin_memory else "anonymous mmap"
            raise ConfigError(
                f"cpu_bytes_to_use: cannot allocate the host slot buffer of {num_slots * slot_bytes} bytes "
                f"({num_slots} slots of {slot_bytes} bytes, {kind}): {exc}; lower cpu_bytes_to_use"
            ) from None
        self._view = memoryview(self.array.reshape(-1).data).cast("B")

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def view(self, slot_id: int) -> memoryview:
        """A writable, page-aligned ``memoryview`` of exactly one slot (zero-copy)."""
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot {slot_id} out of range [0, {self.num_slots})")
        start = slot_id * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def views(self, slot_ids: Sequence[int]) -> list[memoryview]:
        """:meth:`view` of each slot (one range check for all: a job's slots, in its order)."""
        if slot_ids and not (0 <= min(slot_ids) and max(slot_ids) < self.num_slots):
            bad = next(s for s in slot_ids if not 0 <= s < self.num_slots)
            raise IndexError(f"slot {bad} out of range [0, {self.num_slots})")
        full, n = self._view, self.slot_bytes
        return [full[s * n : (s + 1) * n] for s in slot_ids]

    def close(self) -> None:
        """Release the buffer. Views handed out must no longer be used."""
        self._view.release()
        self.array = None  # type: ignore[assignment]
        self.tensor = None  # type: ignore[assignment]
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A numpy/torch view still exists somewhere; the mapping is freed with it.
                pass
            self._mmap = None

    def __repr__(self) -> str:
        return f"SlotBuffer(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, pinned={self.pinned})"

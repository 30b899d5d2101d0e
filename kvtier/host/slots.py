"""The host slot buffer: one contiguous, page-aligned region of ``num_slots × slot_bytes``.

Always an anonymous ``mmap`` of exactly that size (page-aligned, zero-filled: no slot, padding
included, ever holds stale process memory). Without CUDA it is lazily backed, so a large buffer
costs nothing until it is written. With CUDA it is pinned (page-locked) so DMA copies run at full
speed: mapped pre-faulted (``MAP_POPULATE``) and registered with ``cudaHostRegister`` in pieces
of at most :data:`PIN_PIECE_BYTES`, each a whole number of slots (no copy crosses a piece),
unregistered again at :meth:`SlotBuffer.close`. Not ``torch.empty(pin_memory=True)``: PyTorch's
caching host allocator rounds every block up to a power of two (100 GiB would lock 128 GiB) and
keeps it pinned in its cache after the buffer is dropped.

Secondary tiers see one writable ``memoryview`` row per slot; the copy engines see the same bytes
as a ``uint8`` tensor of shape ``[num_slots, slot_bytes]``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.errors import ConfigError

__all__ = ["SlotBuffer", "PAGE_SIZE", "PIN_PIECE_BYTES"]

PAGE_SIZE = 4096
#: Largest piece registered with one cudaHostRegister call (rounded down to whole slots, at least
#: one): a failure part-way unregisters what was registered, and no single call pins for long.
PIN_PIECE_BYTES = 1 << 30


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _cuda_runtime() -> Any:
    """torch's binding of the CUDA runtime (``cudaHostRegister``/``cudaHostUnregister``)."""
    return torch.cuda.cudart()


class _Pinning:
    """The pieces of one region registered with the CUDA runtime; unregistered by :meth:`release`."""

    def __init__(self, address: int, nbytes: int, slot_bytes: int) -> None:
        self._cudart = _cuda_runtime()
        self.pieces: list[tuple[int, int]] = []  # (address, bytes), registered
        piece = max(slot_bytes, PIN_PIECE_BYTES // slot_bytes * slot_bytes)
        try:
            for offset in range(0, nbytes, piece):
                size = min(piece, nbytes - offset)
                error = int(self._cudart.cudaHostRegister(address + offset, size, 0))
                if error:
                    raise RuntimeError(f"cudaHostRegister of {size} bytes at offset {offset} failed: "
                                       f"{self._error_text(error)}")
                self.pieces.append((address + offset, size))
        except BaseException:
            self.release()
            raise

    def _error_text(self, error: int) -> str:
        try:
            return f"{self._cudart.cudaGetErrorString(error)} (cudaError {error})"
        except Exception:  # noqa: BLE001 - the number is enough
            return f"cudaError {error}"

    def release(self) -> None:
        """Unregister every piece (last first); idempotent."""
        while self.pieces:
            address, _ = self.pieces.pop()
            self._cudart.cudaHostUnregister(address)


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
            pin_memory = _cuda_available()
        if pin_memory and not _cuda_available():
            raise RuntimeError("pin_memory=True needs CUDA; this torch has no usable accelerator")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin_memory
        self._mmap: mmap.mmap | None = None
        self._pinning: _Pinning | None = None
        nbytes = num_slots * slot_bytes
        try:
            flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS  # as mmap(-1, n): no copy-on-write in forks
            if pin_memory:
                flags |= getattr(mmap, "MAP_POPULATE", 0)  # fault every page in now, not on first copy
            self._mmap = mmap.mmap(-1, nbytes, flags=flags)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_slots, slot_bytes)
            if pin_memory:
                self._pinning = _Pinning(self.array.ctypes.data, nbytes, slot_bytes)
            self.tensor = torch.from_numpy(self.array)
        except (OSError, MemoryError, RuntimeError, OverflowError) as exc:
            self.array = None  # type: ignore[assignment]
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
        """Release the buffer (unpinned first). Views handed out must no longer be used, and no
        copy may still be reading or writing it (the copy engines fence before the engine
        closes the buffer)."""
        self._view.release()
        if self._pinning is not None:
            self._pinning.release()
            self._pinning = None
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

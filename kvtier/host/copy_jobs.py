"""What a caller hands a copy engine and what it gets back: :class:`CopyJob`, :class:`CopyOrder`,
:class:`CopyResult`.

The engine that takes them, and the guarantees around them (exactly-once results, who pins,
ordering with the caller's device work), is :class:`kvtier.host.copy_engine.CopyEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Direction", "CopyJob", "CopyOrder", "CopyResult"]

#: ``"to_host"``: device → host (a store); ``"to_device"``: host → device (a load).
Direction = Literal["to_host", "to_device"]


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """Where one caller's copies sit among its own device work (``kvtier.host.copy_engine``,
    "Ordering").

    ``stream`` is the caller's stream (a load hands its completion over to it); ``ready`` the
    event, recorded on it when the caller's operation started (or given by the caller), that the
    copies wait for.
    """

    stream: Any
    ready: Any


@dataclass(frozen=True, slots=True)
class CopyJob:
    """Copy ``len(slot_ids)`` chunks between device blocks and host slots.

    ``direction`` is ``"to_host"`` (device → host, a store) or ``"to_device"`` (host → device, a
    load) of KV-cache group ``group`` (index into ``KVModel.groups``). With ``n`` the blocks one
    chunk of that group copies (``KVCacheGroup.blocks_per_slot``: ``blocks_per_chunk``, or 1 for a
    Mamba group, whose chunk is the state at its end), chunk ``i`` uses device blocks
    ``block_ids[i*n:(i+1)*n]`` and host slot ``slot_ids[i]``; so ``len(block_ids) ==
    len(slot_ids) * n``. ``layers`` ``(start, stop)`` copies only the group's own layers
    ``start <= l < stop`` of every page (``None``: all of them).
    ``order`` is the caller's :meth:`~kvtier.host.copy_engine.CopyEngine.capture_order`
    (``None``: the CUDA engine waits for the current stream of the thread that submits, the
    engine's loop thread).
    """

    job_id: int
    direction: Direction
    slot_ids: Sequence[int]
    block_ids: Sequence[int]
    layers: tuple[int, int] | None = None
    order: CopyOrder | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class CopyResult:
    """Outcome of one job. ``nbytes`` counts bytes this rank copied (0 on failure);
    ``seconds`` is issue → observed completion; ``error`` names the failure (``None`` on success);
    ``done`` is the CUDA event recorded after the job's copies (``None`` without CUDA), which
    :meth:`~kvtier.host.copy_engine.CopyEngine.hand_over` makes the caller's stream wait for
    (the same event :meth:`~kvtier.host.copy_engine.CopyEngine.get_issued` gave)."""

    job_id: int
    success: bool
    nbytes: int
    seconds: float
    error: str | None = None
    done: Any = None

"""The records of a transfer between host slots and a secondary tier.

A :class:`TransferJob` goes in (``submit_store`` / ``submit_load``), exactly one
:class:`JobResult` comes out (``get_finished_jobs``). A :class:`JobHandle` is the tier's own
receipt for a job it has not reported yet (see ``SecondaryTier.open_job``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvtier.context import RequestContext

__all__ = ["TransferJob", "JobResult", "JobHandle"]


@dataclass
class TransferJob:
    """One batch of chunks to move between host slots and a tier.

    ``is_promotion``: True = load (tier → host slots, already allocated by the manager), False =
    store/cascade (host slots → tier). ``slot_ids[i]`` is the host slot of ``keys[i]``; the
    manager keeps every slot pinned until the job's :class:`JobResult` is collected.
    ``submit_time`` is the creation stamp (``time.monotonic``) the job latency is measured from.
    """

    job_id: int
    keys: list[bytes]
    slot_ids: list[int]
    is_promotion: bool
    ctx: RequestContext | None = None
    submit_time: float = field(default_factory=time.monotonic)

    @property
    def chunk_ids(self) -> list[int]:
        """vLLM's name for :attr:`slot_ids`."""
        return self.slot_ids


@dataclass
class JobResult:
    """The outcome of one :class:`TransferJob`, reported exactly once.

    ``success`` is True only if every chunk succeeded. ``successful_keys`` is ``None`` when all
    keys share ``success``; for a partially failed promotion it lists the keys that did load (in
    job order, possibly empty). Stores never report a subset. ``transfer_bytes`` counts the
    succeeded chunks × ``slot_bytes``; ``transfer_time`` is the wall time of the job's I/O.
    """

    job_id: int
    success: bool
    is_promotion: bool
    successful_keys: list[bytes] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    failure_reason: str | None = None


@dataclass(eq=False)
class JobHandle:
    """An open job of one tier: reported once, through the tier that opened it.

    Compared by identity: the same :class:`TransferJob` submitted twice is two jobs, each
    reported once.
    """

    job: TransferJob
    direction: str  # "load" | "store"

"""``FaultyTier``: a TEST tier — a :class:`MemoryTier` that fails and stalls on purpose.

Used by the test suite and the examples to exercise the failure paths of the framework and the
manager (exactly-once results, partial promotions, invalidated verdicts, cancellation). Never
configure it for real traffic: it loses data by design.

Options (besides ``capacity_bytes``, default 1 GiB here): ``fail_read_fraction`` and
``fail_write_fraction`` (0.0–1.0, probability that one chunk read/write raises
``TierIOError("io_error")``), ``seed`` (int or None; fixes the failure sequence), ``latency_s``
(sleep before each chunk operation; cancellable, so ``latency_s`` huge = I/O that never ends).
Specific keys can be made to fail with :meth:`fail_reads_of` / :meth:`fail_writes_of`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from kvtier.errors import ConfigError
from kvtier.tiers.base import TierContext, TierIOError
from kvtier.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from kvtier.config import TierConfig

__all__ = ["FaultyTier"]

class FaultyTier(MemoryTier):
    """A memory tier with injected failures and latency. FOR TESTS ONLY."""

    tier_type: ClassVar[str] = "faulty"
    default_capacity_bytes: ClassVar[int | None] = 1 << 30

    def __init__(self, config: TierConfig, context: TierContext, **tunables: Any) -> None:
        super().__init__(config, context, **tunables)
        options = config.options
        prefix = f"secondary_tiers[{config.index}]"
        self.fail_read_fraction = _fraction(options.get("fail_read_fraction", 0.0), f"{prefix}.fail_read_fraction")
        self.fail_write_fraction = _fraction(options.get("fail_write_fraction", 0.0), f"{prefix}.fail_write_fraction")
        latency = options.get("latency_s", 0.0)
        if not isinstance(latency, (int, float)) or isinstance(latency, bool) or not latency >= 0:
            raise ConfigError(f"{prefix}.latency_s: must be a number >= 0, got {latency!r}")
        self.latency_s = float(latency)
        seed = options.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"{prefix}.seed: must be an int or null, got {seed!r}")
        self._random = random.Random(seed)
        self._failing_reads: dict[bytes, str] = {}
        self._failing_writes: dict[bytes, str] = {}

    def fail_reads_of(self, keys: Iterable[bytes], reason: str = "io_error") -> None:
        """Every later read of these keys raises ``TierIOError(reason)``."""
        self._failing_reads.update(dict.fromkeys(keys, reason))

    def fail_writes_of(self, keys: Iterable[bytes], reason: str = "io_error") -> None:
        """Every later write of these keys raises ``TierIOError(reason)``."""
        self._failing_writes.update(dict.fromkeys(keys, reason))

    def heal(self) -> None:
        """Forget the per-key failures (fractions and latency stay)."""
        self._failing_reads.clear()
        self._failing_writes.clear()

    async def _inject(self, key: bytes, failing: dict[bytes, str], fraction: float) -> None:
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        reason = failing.get(key)
        if reason is not None:
            raise TierIOError(reason, "injected failure")
        if fraction and self._random.random() < fraction:
            raise TierIOError("io_error", "injected random failure")

    async def write(self, key: bytes, src: memoryview) -> None:
        await self._inject(key, self._failing_writes, self.fail_write_fraction)
        await super().write(key, src)

    async def read(self, key: bytes, dst: memoryview) -> None:
        await self._inject(key, self._failing_reads, self.fail_read_fraction)
        await super().read(key, dst)


def _fraction(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{where}: must be a number in [0, 1], got {value!r}")
    return float(value)

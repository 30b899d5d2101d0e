"""``FaultyTier``: a TEST wrapper that makes any tier fail and stall on purpose.

Used by the test suite and the examples to exercise the failure paths of the framework and the
manager (exactly-once results, partial promotions, invalidated verdicts, cancellation). Never
configure it for real traffic: it loses data by design.

The wrapper is a tier of its own (its own jobs, verdicts and statistics) whose primitives are the
wrapped tier's, with faults injected in front of ``write``/``read`` (and of each item of
``write_many``/``read_many``). What the wrapped tier reports on its own (removals, evictions,
usage, its metrics) is reported by the wrapper. Only the primitives of the wrapped tier run: a
tier that adds background work to its ``run`` (the fs tier's start-up scan) runs without it, and
learns what it holds from its own writes and probes.

``type: "faulty"`` wraps a :class:`MemoryTier`. Options (besides ``capacity_bytes`` of that
memory tier, default 1 GiB here): ``fail_read_fraction`` and ``fail_write_fraction`` (0.0–1.0,
probability that one chunk read/write raises ``TierIOError("io_error")``), ``seed`` (int or
None; fixes the failure sequence), ``latency_s`` (sleep before each chunk operation, once per
batch for the batch hooks; cancellable, so ``latency_s`` huge = I/O that never ends). Specific
keys can be made to fail with :meth:`FaultyTier.fail_reads_of` / :meth:`FaultyTier.fail_writes_of`.
:meth:`FaultyTier.around` wraps any other tier with the same options.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio

from kvtier.context import RequestContext
from kvtier.errors import ConfigError
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.errors import TierIOError
from kvtier.tiers.memory import MemoryTier
from kvtier.types import Medium

if TYPE_CHECKING:
    from kvtier.config import TierConfig

__all__ = ["FaultyTier"]

#: Capacity of the memory tier ``type: "faulty"`` wraps when the options omit ``capacity_bytes``.
DEFAULT_CAPACITY_BYTES = 1 << 30


class FaultyTier(SecondaryTier):
    """Fault injection in front of another tier's primitives. FOR TESTS ONLY.

    ``FaultyTier(config, context)`` wraps a new :class:`MemoryTier` (``type: "faulty"``);
    ``inner=`` wraps the given tier instead (not yet running: the wrapper opens and closes it).
    The wrapper takes the wrapped tier's medium, cache-hit source and capabilities; its
    ``tier_type`` stays ``"faulty"``. The fault options are read from ``config.options``.
    """

    tier_type: ClassVar[str] = "faulty"
    medium: ClassVar[Medium | None] = Medium.CPU  # the wrapped memory tier's, by default
    # Each instance takes the wrapped tier's capabilities; these are the memory tier's.
    supports_delete: ClassVar[bool] = True
    supports_touch: ClassVar[bool] = True
    batched_writes: ClassVar[bool] = False
    batched_reads: ClassVar[bool] = False

    def __init__(self, config: TierConfig, context: TierContext, *, inner: SecondaryTier | None = None,
                 **tunables: Any) -> None:
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
        if inner is None:
            if "capacity_bytes" not in options:
                config = dataclasses.replace(config, options={**options, "capacity_bytes": DEFAULT_CAPACITY_BYTES})
            inner = MemoryTier(config, context)
        #: The wrapped tier (its primitives run under this wrapper; it is never run itself).
        self.inner = inner
        self.medium = inner.medium  # type: ignore[misc]
        self.cache_hit_source = inner.cache_hit_source  # type: ignore[misc]
        self.requires_asyncio = inner.requires_asyncio  # type: ignore[misc]
        self.request_level_only = inner.request_level_only  # type: ignore[misc]
        self.supports_delete = inner.supports_delete  # type: ignore[misc]
        self.supports_touch = inner.supports_touch  # type: ignore[misc]
        self.batched_writes = inner.batched_writes  # type: ignore[misc]
        self.batched_reads = inner.batched_reads  # type: ignore[misc]
        inner.report_to(self)

    @classmethod
    def around(cls, inner: SecondaryTier, **faults: Any) -> FaultyTier:
        """Wrap ``inner`` (not yet running) with the fault options ``faults`` (the module's
        options, without ``capacity_bytes``); the wrapper shares its config and context."""
        config = dataclasses.replace(inner.config, options={**inner.config.options, **faults})
        return cls(config, inner.context, inner=inner)

    # --- the faults ------------------------------------------------------------------------------
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

    def _fault(self, key: bytes, failing: dict[bytes, str], fraction: float) -> TierIOError | None:
        reason = failing.get(key)
        if reason is not None:
            return TierIOError(reason, "injected failure")
        if fraction and self._random.random() < fraction:
            return TierIOError("io_error", "injected random failure")
        return None

    async def _inject(self, key: bytes, failing: dict[bytes, str], fraction: float) -> None:
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        fault = self._fault(key, failing, fraction)
        if fault is not None:
            raise fault

    async def _inject_many(self, items: Sequence[tuple[bytes, memoryview]], failing: dict[bytes, str],
                           fraction: float, hook: Any) -> list[BaseException | None]:
        if self.latency_s:
            await anyio.sleep(self.latency_s)
        outcomes: list[BaseException | None] = [self._fault(key, failing, fraction) for key, _ in items]
        passed = [i for i, fault in enumerate(outcomes) if fault is None]
        if passed:
            for i, outcome in zip(passed, await hook([items[i] for i in passed])):
                outcomes[i] = outcome
        return outcomes

    # --- the wrapped tier's primitives -----------------------------------------------------------
    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        return await self.inner.contains(keys)

    def known(self, key: bytes) -> bool | None:
        return self.inner.known(key)

    async def write(self, key: bytes, src: memoryview) -> None:
        await self._inject(key, self._failing_writes, self.fail_write_fraction)
        await self.inner.write(key, src)

    async def read(self, key: bytes, dst: memoryview) -> None:
        await self._inject(key, self._failing_reads, self.fail_read_fraction)
        await self.inner.read(key, dst)

    async def write_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        return await self._inject_many(items, self._failing_writes, self.fail_write_fraction, self.inner.write_many)

    async def read_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Sequence[BaseException | None]:
        return await self._inject_many(items, self._failing_reads, self.fail_read_fraction, self.inner.read_many)

    async def delete(self, key: bytes) -> None:
        await self.inner.delete(key)

    def touch(self, keys: Sequence[bytes], ctx: RequestContext | None = None) -> None:
        self.inner.touch(keys, ctx)

    def __getattr__(self, name: str) -> Any:
        # What the wrapped tier offers beyond the contract (MemoryTier.num_chunks, …).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _fraction(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{where}: must be a number in [0, 1], got {value!r}")
    return float(value)

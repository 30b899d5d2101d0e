"""What became of the chunks prefetches promoted: landed, later loaded (a hit) or evicted unused.

Semantics callers rely on (``docs/metrics.md``, "Prefetch"):

* A prefetch registers every chunk whose promotion it starts (:meth:`PrefetchTracker.promoting`).
  At every engine step (:meth:`PrefetchTracker.after_step`) a registered chunk that is now ready
  in host memory counts as *prefetched* (``chunks`` per source tier) and is watched from then on;
  one whose promotion failed is forgotten.
* A watched chunk that a load places on the device (:meth:`PrefetchTracker.on_loaded`, every
  byte arrived) counts as a *hit*, once; one that leaves host memory first counts as *wasted*.
  Removals are learnt from the host tier's eviction events when KV events are on, otherwise
  by checking the watched chunks whenever the host tier's eviction count moved. A reset of the
  host tier forgets every chunk without counting it.
* Memory is bounded: at most ``limit`` chunks are watched (the host tier's slots: more cannot be
  resident); beyond that the oldest is forgotten without being counted.

Loop thread only; :meth:`PrefetchTracker.statistics` returns a plain snapshot any thread may read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.types import LookupResult, OffloadingEvent

if TYPE_CHECKING:
    from kvtier.host.tier import HostTier

__all__ = ["PrefetchStatistics", "PrefetchTracker"]


@dataclass(frozen=True, slots=True)
class PrefetchStatistics:
    """Cumulative prefetch counters (read by ``kvtier.metrics``)."""

    requests: int = 0
    #: Chunks promoted by prefetches that reached host memory, per source tier label.
    chunks: dict[str, int] = field(default_factory=dict)
    #: Prompt tokens prefetches made loadable from host memory (beyond what it held at the call).
    tokens: int = 0
    hits: int = 0
    wasted: int = 0


class PrefetchTracker:
    """The fate of prefetched chunks and the prefetch counters of one engine (module docstring)."""

    def __init__(self, host: HostTier, *, host_events: bool, limit: int | None = None) -> None:
        self._host = host
        self._host_events = host_events
        self._limit = max(1, limit if limit is not None else host.num_slots)
        self._promoting: dict[bytes, str] = {}  # promotion started: key -> source tier label
        self._resident: dict[bytes, None] = {}  # landed, not yet loaded; insertion order = age
        self._evictions = host.statistics().evictions
        self.requests = 0
        self.tokens = 0
        self._chunks: dict[str, int] = {}
        self._hits = 0
        self._wasted = 0

    # ------------------------------------------------------------------ the prefetch side
    def promoting(self, key: bytes, label: str) -> None:
        """A prefetch started promoting ``key`` from the tier labelled ``label``."""
        self._resident.pop(key, None)
        self._promoting[key] = label

    def counted_request(self, tokens: int) -> None:
        """One prefetch call ended, having made ``tokens`` more prompt tokens loadable."""
        self.requests += 1
        self.tokens += max(0, tokens)

    @property
    def watched(self) -> int:
        """Chunks registered and not yet settled (promoting or resident and unused)."""
        return len(self._promoting) + len(self._resident)

    # ------------------------------------------------------------------ the engine side
    def on_loaded(self, keys: Sequence[bytes]) -> None:
        """``keys`` reached the device by a load (every byte arrived): hits for the watched ones."""
        if not self._promoting and not self._resident:
            return
        for key in keys:
            if key in self._resident:
                del self._resident[key]
                self._hits += 1
            else:
                label = self._promoting.pop(key, None)
                if label is not None:  # landed since the last step: a load placed it
                    self._chunks[label] = self._chunks.get(label, 0) + 1
                    self._hits += 1

    def after_step(self, events: Iterable[OffloadingEvent]) -> None:
        """One engine step: settle promotions that ended, learn removals (module docstring)."""
        if self._promoting:
            self._settle()
        if not self._resident:
            return
        if self._host_events:
            for event in events:
                if event.removed and event.ownership is None and not event.metadata_only:
                    self._removed(event.keys)
            return
        # The count may be stale from before the first chunk landed: one needless check at most.
        evictions = self._host.statistics().evictions
        if evictions != self._evictions:
            self._evictions = evictions
            lookup = self._host.lookup
            self._removed([key for key in self._resident if lookup(key) is LookupResult.MISS])

    def clear(self) -> None:
        """The host tier was reset: forget every chunk, uncounted."""
        self._promoting.clear()
        self._resident.clear()
        self._evictions = self._host.statistics().evictions

    def statistics(self) -> PrefetchStatistics:
        return PrefetchStatistics(requests=self.requests, chunks=dict(self._chunks), tokens=self.tokens,
                                  hits=self._hits, wasted=self._wasted)

    # ------------------------------------------------------------------ internals
    def _settle(self) -> None:
        lookup = self._host.lookup
        landed: list[tuple[bytes, str]] = []
        gone: list[bytes] = []
        for key, label in self._promoting.items():
            verdict = lookup(key)
            if verdict is LookupResult.HIT:
                landed.append((key, label))
            elif verdict is LookupResult.MISS:
                gone.append(key)  # the promotion failed: nothing was prefetched
        for key in gone:
            del self._promoting[key]
        for key, label in landed:
            del self._promoting[key]
            self._chunks[label] = self._chunks.get(label, 0) + 1
            self._resident[key] = None
        while len(self._resident) > self._limit:
            del self._resident[next(iter(self._resident))]

    def _removed(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key in self._resident:
                del self._resident[key]
                self._wasted += 1

"""Write policies of the secondary tiers: the books of which chunks each tier still has to get.

A tier's ``write_policy`` says when a chunk stored into host memory is written to it:
``write_through`` at once, ``write_back`` when the host tier needs the chunk's slot, ``selective``
once requests have hit the chunk ``min_hits`` times while it is in host memory. The tiering manager
(``kvtier/manager.py``, whose docstring states the rules) submits the writes; :class:`WriteLedger`
only keeps the books. It is synchronous and called from the engine's event-loop thread only.

Semantics callers rely on:

* A chunk enters the ledger when its store into host memory completes (:meth:`WriteLedger.stored`):
  it is *dirty* for each write-back tier named there and *unwritten* for each selective one. A
  chunk already in the ledger is left as it is, so a duplicate completion changes nothing.
* :meth:`WriteLedger.take_dirty` hands out dirty chunks, least recently hit first, each with every
  write-back tier it is owed to; a chunk handed out is *cleaning* until each of those tiers has
  settled it (:meth:`WriteLedger.settled`: written, failed or skipped alike), and is returned by
  the call that settles its last tier, exactly once, so the caller releases its hold on it.
* :meth:`WriteLedger.hit` counts at most one hit per request and chunk, and returns per selective
  tier the chunks that reached the tier's ``min_hits`` with this call (each chunk once per tier).
* :meth:`WriteLedger.evicted` forgets chunks that left host memory (a selective tier never gets
  them then); :meth:`WriteLedger.clear` forgets everything and says what was dropped unwritten.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config.tiers import DEFAULT_MIN_HITS, SELECTIVE, WRITE_BACK, WRITE_THROUGH
from kvtier.context import RequestContext

__all__ = ["WritePolicy", "WriteLedger", "WriteTierStatistics"]


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """One tier's write policy: ``name`` (``write_through``, ``write_back``, ``selective``) and
    ``min_hits`` (``selective`` only)."""

    name: str = WRITE_THROUGH
    min_hits: int = DEFAULT_MIN_HITS

    @classmethod
    def of(cls, config: Any) -> WritePolicy:
        """The policy a tier's configuration states; a configuration without the keys writes through."""
        return cls(getattr(config, "write_policy", WRITE_THROUGH), getattr(config, "min_hits", DEFAULT_MIN_HITS))


@dataclass(frozen=True, slots=True)
class WriteTierStatistics:
    """What one tier's write policy did (counters cumulative; ``dirty_chunks`` and
    ``selective_unwritten`` are gauges). Chunks written are those of successful store jobs."""

    policy: str
    #: Written at store: every chunk of a write-through tier, and chunks a request asked the tier
    #: for (``REQUEST_LEVEL``) whatever its policy.
    chunks_written_through: int = 0
    chunks_written_back: int = 0
    chunks_written_selective: int = 0
    #: In host memory and not yet written to this write-back tier (write-backs in flight included).
    dirty_chunks: int = 0
    write_backs_evict: int = 0  # write-backs started because the host tier needed room
    write_backs_flush: int = 0  # write-backs started by a flush
    write_backs_failed: int = 0  # the tier failed or refused the job: the chunk is not in it
    write_backs_skipped: int = 0  # shed by back-pressure: never written
    write_backs_dropped: int = 0  # dirty when the host tier was reset: lost
    #: In host memory and hit fewer than ``min_hits`` times (not written to this selective tier yet).
    selective_unwritten: int = 0
    selective_evicted_unwritten: int = 0  # left host memory before reaching ``min_hits``
    selective_skipped: int = 0  # reached ``min_hits`` but shed by back-pressure


@dataclass(slots=True)
class _Counts:
    written: dict[str, int] = field(default_factory=lambda: dict.fromkeys((WRITE_THROUGH, WRITE_BACK, SELECTIVE), 0))
    dirty: int = 0
    evict: int = 0
    flush: int = 0
    failed: int = 0
    skipped: int = 0
    dropped: int = 0
    unwritten: int = 0
    evicted_unwritten: int = 0
    selective_skipped: int = 0


@dataclass(slots=True)
class _RequestHits:
    """The chunks one request has hit (a request counts once per chunk)."""

    keys: set[bytes] = field(default_factory=set)


class WriteLedger:
    """The books of the write-back and selective tiers (``policies[i]`` is tier ``i``'s)."""

    def __init__(self, policies: Sequence[WritePolicy]) -> None:
        self.policies = tuple(policies)
        self.write_back_tiers = tuple(i for i, p in enumerate(self.policies) if p.name == WRITE_BACK)
        self.selective_tiers = tuple(i for i, p in enumerate(self.policies) if p.name == SELECTIVE)
        #: chunk -> write-back tiers it has not been settled for (dirty or cleaning)
        self._owed: dict[bytes, set[int]] = {}
        #: chunks none of whose write-backs is submitted yet, least recently hit first
        self._dirty: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        #: chunk -> hits so far, and the selective tiers it has not been written to
        self._hits: dict[bytes, int] = {}
        self._unwritten: dict[bytes, list[int]] = {}
        self._counts = [_Counts() for _ in self.policies]

    @property
    def defers_writes(self) -> bool:
        """Whether any tier writes later than at store."""
        return bool(self.write_back_tiers or self.selective_tiers)

    def deferred(self, tier: int) -> bool:
        return self.policies[tier].name != WRITE_THROUGH

    # --- entering ------------------------------------------------------------------------------
    def stored(self, keys: Iterable[bytes], tiers: Iterable[int]) -> list[bytes]:
        """``keys`` are ready in host memory; ``tiers`` (write-back or selective) get them later.

        Returns the chunks that became dirty (the caller holds them in host memory until
        :meth:`settled` returns them).
        """
        tiers = list(tiers)
        back = {t for t in tiers if self.policies[t].name == WRITE_BACK}
        selective = [t for t in tiers if self.policies[t].name == SELECTIVE]
        dirty: list[bytes] = []
        for key in keys:
            if back and key not in self._owed:
                self._owed[key] = set(back)
                self._dirty[key] = None
                for t in back:
                    self._counts[t].dirty += 1
                dirty.append(key)
            if selective and key not in self._unwritten:
                self._unwritten[key] = list(selective)
                self._hits[key] = 0
                for t in selective:
                    self._counts[t].unwritten += 1
        return dirty

    # --- write-back -----------------------------------------------------------------------------
    @property
    def num_dirty(self) -> int:
        """Chunks none of whose write-backs has been submitted."""
        return len(self._dirty)

    @property
    def num_cleaning(self) -> int:
        """Chunks whose write-backs are all submitted and not all settled."""
        return len(self._owed) - len(self._dirty)

    def take_dirty(self, limit: int | None, *, reason: str) -> dict[int, list[bytes]]:
        """Up to ``limit`` (``None``: all) dirty chunks, least recently hit first, grouped by the
        write-back tier each is owed to; counted as started by ``reason`` (``"evict"``/``"flush"``)."""
        out: dict[int, list[bytes]] = {}
        taken = 0
        while self._dirty and (limit is None or taken < limit):
            key, _ = self._dirty.popitem(last=False)
            taken += 1
            for t in sorted(self._owed[key]):
                out.setdefault(t, []).append(key)
        for t, keys in out.items():
            counts = self._counts[t]
            if reason == "flush":
                counts.flush += len(keys)
            else:
                counts.evict += len(keys)
        return out

    def settled(self, tier: int, keys: Iterable[bytes], outcome: str) -> list[bytes]:
        """Tier ``tier``'s write-back of ``keys`` ended: ``"written"``, ``"failed"`` or ``"skipped"``.

        Either way the chunks are clean for that tier. Returns those now clean for every tier.
        """
        counts = self._counts[tier]
        clean: list[bytes] = []
        for key in keys:
            owed = self._owed.get(key)
            if owed is None or tier not in owed:
                continue
            owed.discard(tier)
            counts.dirty -= 1
            if outcome == "written":
                counts.written[WRITE_BACK] += 1
            elif outcome == "skipped":
                counts.skipped += 1
            else:
                counts.failed += 1
            if not owed:
                del self._owed[key]
                self._dirty.pop(key, None)
                clean.append(key)
        return clean

    # --- hits and selective writes ----------------------------------------------------------------
    def hit(self, keys: Sequence[bytes], ctx: RequestContext | None) -> dict[int, list[bytes]]:
        """A request hit ``keys`` in host memory. Dirty ones become the most recently hit; returns,
        per selective tier, the chunks due to be written to it now."""
        for key in keys:
            if key in self._dirty:
                self._dirty.move_to_end(key)
        if not self._hits:
            return {}
        seen: set[bytes] | None = None
        if ctx is not None:
            record = ctx.get_state(_RequestHits)
            if record is None:
                record = _RequestHits()
                ctx.set_state(record)
            seen = record.keys
        due: dict[int, list[bytes]] = {}
        for key in keys:
            count = self._hits.get(key)
            if count is None or (seen is not None and key in seen):
                continue
            if seen is not None:
                seen.add(key)
            count += 1
            remaining: list[int] = []
            for t in self._unwritten[key]:
                if count >= self.policies[t].min_hits:
                    due.setdefault(t, []).append(key)
                    self._counts[t].unwritten -= 1
                else:
                    remaining.append(t)
            if remaining:
                self._hits[key] = count
                self._unwritten[key] = remaining
            else:
                del self._hits[key]
                del self._unwritten[key]
        return due

    def selective_skipped(self, tier: int, num_chunks: int) -> None:
        """Chunks due to selective tier ``tier`` were shed by back-pressure (never written)."""
        self._counts[tier].selective_skipped += num_chunks

    # --- leaving ---------------------------------------------------------------------------------
    def evicted(self, keys: Iterable[bytes]) -> None:
        """``keys`` left host memory: selective tiers that did not get them never will."""
        if not self._hits:
            return
        for key in keys:
            if self._hits.pop(key, None) is None:
                continue
            for t in self._unwritten.pop(key):
                self._counts[t].unwritten -= 1
                self._counts[t].evicted_unwritten += 1

    def clear(self) -> dict[int, int]:
        """Forget every chunk (the host tier was reset); returns the dirty chunks dropped per tier."""
        dropped: dict[int, int] = {}
        for owed in self._owed.values():
            for t in owed:
                dropped[t] = dropped.get(t, 0) + 1
        for t, n in dropped.items():
            self._counts[t].dropped += n
            self._counts[t].dirty -= n
        for t in self.selective_tiers:
            self._counts[t].unwritten = 0
        self._owed.clear()
        self._dirty.clear()
        self._hits.clear()
        self._unwritten.clear()
        return dropped

    # --- statistics ------------------------------------------------------------------------------
    def count_written(self, tier: int, kind: str, num_chunks: int) -> None:
        """``num_chunks`` were written to ``tier`` at store (``write_through``) or when due
        (``selective``); write-backs are counted by :meth:`settled`."""
        self._counts[tier].written[kind] += num_chunks

    def unstarted_by_tier(self) -> dict[int, int]:
        """Per write-back tier: dirty chunks whose write-back to it has not started."""
        counts = dict.fromkeys(self.write_back_tiers, 0)
        for key in self._dirty:
            for t in self._owed[key]:
                counts[t] += 1
        return counts

    def statistics(self, tier: int) -> WriteTierStatistics:
        c = self._counts[tier]
        return WriteTierStatistics(
            policy=self.policies[tier].name,
            chunks_written_through=c.written[WRITE_THROUGH],
            chunks_written_back=c.written[WRITE_BACK],
            chunks_written_selective=c.written[SELECTIVE],
            dirty_chunks=c.dirty,
            write_backs_evict=c.evict,
            write_backs_flush=c.flush,
            write_backs_failed=c.failed,
            write_backs_skipped=c.skipped,
            write_backs_dropped=c.dropped,
            selective_unwritten=c.unwritten,
            selective_evicted_unwritten=c.evicted_unwritten,
            selective_skipped=c.selective_skipped,
        )

"""The fs tier's chunk index: what one process knows is on disk under its block tree.

Sized for trees of millions of chunk files (a 2 TB cache holds 10^6 files of 2 MiB, or
8·10^6 of 256 KiB): an entry costs about 80 bytes — no Python object per chunk — and every
operation the event loop runs is O(1) or bounded:

* **Entries** live in parallel typed arrays indexed by a slot number: the key's bytes, its file
  size, when it was stored (wall clock, float32 seconds from the index's creation), when this
  process last confirmed it (monotonic), and three links.
* **Lookup**: an open-addressing table of slot numbers, linear probing, deletion by backward
  shift (no tombstones). It grows by doubling and migrates a few old buckets per insert, so no
  single operation rehashes the whole table.
* **Recency**: the *hot* list is least- to most-recently used (doubly linked, O(1) touch). Chunks
  an initial scan found and nobody used since are *cold*: they sit in buckets by file age (eight
  per doubling of the age, so a bucket spans ~9% of it). Eviction takes cold chunks oldest bucket
  first, then the hot list's head — the order a sort by mtime would give at start-up, to within a
  bucket, without sorting (the scan that finds them arrives in directory order).
* **Leaves**: every entry is also chained into its shard directory's list (``<hhh>/<hh>_g<group>``,
  a "leaf"), so a rescan that re-lists one changed directory reconciles only that directory.

Loop-thread only: no locks. ``used`` counts a chunk from its reservation on, so it bounds the
bytes this process's chunks take on disk from above.
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence

from kvtier.policies.quotas import DEFAULT_POOL, TenantQuotas
from kvtier.tiers.errors import TierIOError
from kvtier.tiers.fs.tree import LEAVES_PER_TOP, MAX_KEY_BYTES, TOPS, leaf_of

__all__ = ["ChunkIndex", "TenantChunkIndex", "MAX_REMOVAL_RECORDS"]

_EMPTY = -1
_HOT = 0  # slot 0: the hot list's sentinel
_BUCKETS = 256  # cold buckets, slots 1.._BUCKETS: bucket b holds ages in [2^(b/8), 2^((b+1)/8)) seconds
_MIGRATE_PER_INSERT = 8
_MAX_LOAD = 0.6  # of the lookup table: linear probing stays short (~1.75 probes for a hit)
#: How many recent removals the index remembers for the scans in flight (see :meth:`forget_removals_before`).
MAX_REMOVAL_RECORDS = 1 << 16
_RECORD_BYTES = sys.getsizeof(bytes(MAX_KEY_BYTES)) + sys.getsizeof(0.0)  # a record's key and time


class ChunkIndex:
    """Known chunks, their sizes and recency (see the module docstring).

    ``capacity`` is ``max_bytes`` (None: unbounded). ``expected_entries`` sizes the lookup table
    up front (a bounded tier knows about how many chunks fit). While ``complete`` is False (an
    initial scan is under way) the unscanned part of the tree is assumed to fill the cap: a
    reservation must free as many bytes as it takes, so the disk never grows past ``max_bytes``
    even though usage is not known yet.
    """

    def __init__(self, capacity: int | None, *, expected_entries: int = 0) -> None:
        self.capacity = capacity
        self.used = 0
        self.complete = True
        self._epoch = time.time()
        self._n = 0  # live entries
        self._slots = 0  # slots handed out (entries, run sentinels, free ones)
        self._free = _EMPTY  # free slots, chained through _next
        # Sized up front for the chunks expected (a bounded tier knows): growing copies every
        # array, which at millions of entries holds the loop for tens of milliseconds.
        size = max(64, expected_entries + _BUCKETS + 1)
        self._keys = bytearray(size * MAX_KEY_BYTES)
        self._klen = bytearray(size)  # 0: not an entry (free slot or sentinel)
        self._size = array("q", bytes(8 * size))
        self._stored = array("f", bytes(4 * size))
        self._seen = array("d", bytes(8 * size))
        self._prev = array("i", bytes(4 * size))
        self._next = array("i", bytes(4 * size))
        self._lnext = array("i", bytes(4 * size))
        buckets = 64
        while buckets * _MAX_LOAD < expected_entries:
            buckets *= 2
        self._table = array("i", [_EMPTY]) * buckets
        self._old: array[int] | None = None
        self._old_done = self._old_start = 0
        # Per group, per top directory: the first slot of each of its leaves (an array made when
        # the top first holds a chunk; one array for the whole group would be 4 MiB to fill on
        # the event loop at the group's first chunk).
        self._leaf_heads: dict[int, list[array[int] | None]] = {}
        self._top_counts: dict[int, array[int]] = {}  # chunks per top directory, per group
        self._cold_top = 0  # no cold bucket above this one holds a chunk
        self._busy: dict[bytes, int] = {}
        # key -> when this process dropped it (evicted, deleted, rejected): a listing taken before
        # that moment must not bring it back.
        self._removed_at: dict[bytes, float] = {}
        for sentinel in range(_BUCKETS + 1):  # the hot list, then the cold buckets
            assert self._new_slot() == sentinel
            self._prev[sentinel] = self._next[sentinel] = sentinel

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: bytes) -> bool:
        return self._find(key) >= 0

    def size_of(self, key: bytes) -> int | None:
        """The bytes recorded for ``key``, or None when it is not in the index."""
        slot = self._find(key)
        return None if slot < 0 else self._size[slot]

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used (O(n): for tests and tools)."""
        return [self._key(s) for s in self._lru_order()]

    def leaf_keys(self, group: int, leaf: int) -> list[bytes]:
        """Keys indexed in one shard directory."""
        tops = self._leaf_heads.get(group)
        heads = None if tops is None else tops[leaf >> 8]
        out: list[bytes] = []
        slot = _EMPTY if heads is None else heads[leaf & 0xFF]
        while slot != _EMPTY:
            out.append(self._key(slot))
            slot = self._lnext[slot]
        return out

    def leaves_in_top(self, group: int, top: int) -> list[int]:
        """Leaves of top directory ``top`` (12 bits) holding indexed chunks of ``group``."""
        tops = self._leaf_heads.get(group)
        heads = None if tops is None else tops[top]
        if heads is None or not self._top_counts[group][top]:
            return []
        base = top << 8
        return [base | i for i, head in enumerate(heads) if head != _EMPTY]

    def held_tops(self) -> set[int]:
        """Top directories (12 bits each) holding an indexed chunk of any group."""
        held: set[int] = set()
        for tops in self._leaf_heads.values():
            held.update(top for top, heads in enumerate(tops) if heads is not None)
        counts = self._top_counts
        return {top for top in held if any(c[top] for c in counts.values())}

    @property
    def groups(self) -> list[int]:
        return list(self._leaf_heads)

    def nbytes(self) -> int:
        """Bytes the index takes: its arrays, and the removal records (up to
        ``MAX_REMOVAL_RECORDS`` of them, several MiB, while evictions outpace the scans)."""
        arrays: list[array[int] | array[float]] = [
            self._size, self._stored, self._seen, self._prev, self._next, self._lnext, self._table,
            *(heads for tops in self._leaf_heads.values() for heads in tops if heads is not None),
            *self._top_counts.values()]
        total = len(self._keys) + len(self._klen) + sum(len(a) * a.itemsize for a in arrays)
        if self._old is not None:
            total += len(self._old) * self._old.itemsize
        records = self._removed_at
        return total + sys.getsizeof(records) + len(records) * _RECORD_BYTES

    # ------------------------------------------------------------------ changes
    def add(self, key: bytes, size: int, stored_at: float | None = None) -> None:
        """Record ``key`` as present and most recently used; replaces a previous size."""
        slot = self._find(key)
        if slot >= 0:
            self.used += size - self._size[slot]
            self._size[slot] = size
            self._unlink(slot)
        else:
            slot = self._insert(key, size)
        self._stored[slot] = (time.time() if stored_at is None else stored_at) - self._epoch
        self._seen[slot] = time.monotonic()
        self._push_hot(slot)

    def add_cold(self, chunks: Iterable[tuple[bytes, int, float]]) -> None:
        """Add chunks an initial scan found, ``(key, size, mtime)``, as cold: older than
        anything used since, evicted oldest first (by bucket of age). Known keys are kept as they
        are. (The start-up scan's hot path: one probe of the table per chunk.)"""
        now, epoch = time.monotonic(), self._epoch
        keys, klen, width = self._keys, self._klen, MAX_KEY_BYTES
        stored, seen, prev, nxt = self._stored, self._seen, self._prev, self._next
        for chunk in chunks:
            key = chunk[0]
            table = self._table
            if self._old is None and self._n + 1 <= _MAX_LOAD * len(table):
                mask = len(table) - 1
                i = hash(key) & mask
                n = len(key)
                while True:
                    slot = table[i]
                    if slot == _EMPTY or (klen[slot] == n and keys.startswith(key, slot * width)):
                        break
                    i = (i + 1) & mask
                if slot != _EMPTY:
                    continue  # known
                slot = self._new_entry(key, chunk[1])
                table[i] = slot
            elif self._find(key) >= 0:
                continue
            else:
                slot = self._insert(key, chunk[1])
            mtime = chunk[2]
            stored[slot] = mtime - epoch
            seen[slot] = now
            age = epoch - mtime
            bucket = 1 + (min(_BUCKETS - 1, int(8 * math.log2(age))) if age > 1.0 else 0)
            last = prev[bucket]
            nxt[last] = slot
            prev[slot] = last
            nxt[slot] = bucket
            prev[bucket] = slot
            if bucket > self._cold_top:
                self._cold_top = bucket

    def touch(self, key: bytes) -> None:
        slot = self._find(key)
        if slot >= 0:
            self._unlink(slot)
            self._push_hot(slot)

    def touch_or_add(self, keys: Iterable[bytes], size: int) -> None:
        """Each key becomes the most recent; one not in the index yet is added with ``size``."""
        for key in keys:
            slot = self._find(key)
            if slot >= 0:
                self._unlink(slot)
                self._push_hot(slot)
            else:
                self.add(key, size)

    def remove(self, key: bytes) -> bool:
        slot = self._find(key)
        if slot < 0:
            return False
        self._drop(slot, key)
        removed_at = self._removed_at
        removed_at.pop(key, None)  # re-inserted last: the dict stays in time order
        removed_at[key] = time.monotonic()
        if len(removed_at) > MAX_REMOVAL_RECORDS:  # bounded; the oldest go first
            del removed_at[next(iter(removed_at))]
        return True

    def note_removed(self, keys: Iterable[bytes]) -> None:
        """``keys`` (out of the index) were removed from disk just now: a listing taken before
        this moment must not bring them back."""
        removed_at, now = self._removed_at, time.monotonic()
        for key in keys:
            if self._find(key) < 0:  # not stored again meanwhile
                removed_at.pop(key, None)
                removed_at[key] = now
        while len(removed_at) > MAX_REMOVAL_RECORDS:
            del removed_at[next(iter(removed_at))]

    def removed_any_since(self, when: float) -> bool:
        """Whether this process dropped any key at or after monotonic time ``when``."""
        removed_at = self._removed_at
        return bool(removed_at) and removed_at[next(reversed(removed_at))] >= when

    def removed_since(self, key: bytes, when: float) -> bool:
        """Whether this process dropped ``key`` at or after monotonic time ``when``."""
        at = self._removed_at.get(key)
        return at is not None and at >= when

    def forget_removals_before(self, when: float) -> None:
        """Removal records older than ``when`` can mislead no listing taken since: drop them."""
        removed_at = self._removed_at
        while removed_at:
            key = next(iter(removed_at))
            if removed_at[key] >= when:
                break
            del removed_at[key]

    def confirmed_since(self, key: bytes, when: float) -> bool:
        """Whether this process confirmed ``key`` (stored, loaded, added) at or after ``when``."""
        slot = self._find(key)
        return slot >= 0 and self._seen[slot] >= when

    # ------------------------------------------------------------------ pins
    def pin(self, key: bytes) -> None:
        self._busy[key] = self._busy.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        """The read or write of ``key`` is over; if the key is (still) indexed that confirms it
        now, so a listing taken before this moment cannot drop it."""
        self.unpin_all((key,))

    def pin_all(self, keys: Iterable[bytes]) -> None:
        busy = self._busy
        for key in keys:
            busy[key] = busy.get(key, 0) + 1

    def unpin_all(self, keys: Iterable[bytes], touch_or_add: int | None = None) -> None:
        """:meth:`unpin` each key; with ``touch_or_add``, also :meth:`touch_or_add` them with that
        size (a finished load: one lookup per key for both).

        Every chunk a load moved passes here on the event loop, so :meth:`_locate` (its probe of
        the current table) is written out inline, and the keys are made the most recent in *runs*:
        keys that already follow one another in the recency lists (a job's chunks were stored, and
        are loaded again, together) move to the hot list's end as one block, one comparison per
        key instead of a relink per key. The order is the one touching each key in turn gives.
        A subclass that keeps more lists than the hot one (:class:`TenantChunkIndex`) has each key
        moved by its own :meth:`_unlink` and :meth:`_push_hot`."""
        busy, now, seen, nxt = self._busy, time.monotonic(), self._seen, self._next
        entries, klen, width = self._keys, self._klen, MAX_KEY_BYTES
        table = self._table
        mask = len(table) - 1
        blocks = touch_or_add is not None and self._touch_inline
        first = last = _EMPTY  # the run of keys not moved yet: from ``first`` to ``last``, linked
        for key in keys:
            left = busy[key] - 1
            if left:
                busy[key] = left
            else:
                del busy[key]
            n = len(key)
            i = hash(key) & mask
            while True:
                slot = table[i]
                if slot == _EMPTY or (klen[slot] == n and entries.startswith(key, slot * width)):
                    break
                i = (i + 1) & mask
            if slot == _EMPTY and self._old is not None:  # not migrated to the current table yet
                slot = self._find(key)
            if slot >= 0:
                seen[slot] = now
                if blocks:
                    if last != _EMPTY and nxt[last] == slot:
                        last = slot  # the run goes on
                        continue
                    if last != _EMPTY:
                        self._move_hot(first, last)
                    first = last = slot
                elif touch_or_add is not None:
                    self._unlink(slot)
                    self._push_hot(slot)
            elif touch_or_add is not None:
                if last != _EMPTY:  # the keys before this one are more recent than the rest
                    self._move_hot(first, last)
                    first = last = _EMPTY
                self.add(key, touch_or_add)
                table = self._table  # adding may have grown it
                mask = len(table) - 1
        if last != _EMPTY:
            self._move_hot(first, last)

    def _move_hot(self, first: int, last: int) -> None:
        """Move the linked run ``first`` … ``last`` to the hot list's end, keeping its order."""
        prev, nxt = self._prev, self._next
        before, after = prev[first], nxt[last]
        nxt[before] = after
        prev[after] = before
        end = prev[_HOT]
        nxt[end] = first
        prev[first] = end
        nxt[last] = _HOT
        prev[_HOT] = last

    def is_busy(self, key: bytes) -> bool:
        return key in self._busy

    # ------------------------------------------------------------------ capacity
    def reserve(self, key: bytes, size: int) -> list[tuple[bytes, float]]:
        """Count ``size`` bytes for ``key`` now and pick victims so that ``used ≤ capacity``
        (and, while the index is not ``complete``, so that at least ``size`` bytes are freed).

        Victims (``(key, stored_at)``, least recent first) are already removed from the index;
        the caller deletes their files. Raises ``TierIOError("no_space")`` (reserving nothing)
        when the idle chunks known cannot make the room.
        """
        victims: list[tuple[bytes, float]] = []
        if self.capacity is not None:
            current = self.size_of(key) or 0
            excess = self.used + size - current - self.capacity
            if not self.complete:
                excess = max(excess, size - current)
            if excess > 0:
                picked = self._pick_victims(excess, exclude=key)
                if picked is None:
                    raise TierIOError(
                        "no_space",
                        f"max_bytes={self.capacity} is held by chunks in use" if self.complete else
                        f"max_bytes={self.capacity}: the start-up scan has not found enough idle chunks to evict yet")
                victims = picked
        self.add(key, size)
        return victims

    #: Whether :meth:`reserve_all` counts a key that fits without victims itself, with the lookup it
    #: made (a subclass whose :meth:`reserve` does more sends every key there).
    _reserve_inline = True
    #: Whether :meth:`unpin_all` may move keys in runs on the hot list alone (a subclass that keeps
    #: more recency lists, through :meth:`_unlink` and :meth:`_push_hot`, must say False).
    _touch_inline = True

    def _keep_held(self, key: bytes, slot: int) -> None:
        """:meth:`reserve_all` for ``key``, held already at ``slot``: it becomes the most recent."""
        self._unlink(slot)
        self._push_hot(slot)

    def reserve_all(self, keys: Sequence[bytes], size: int, *, held_at_any_size: bool = False
                    ) -> tuple[list[bool | TierIOError], list[tuple[bytes, float]]]:
        """A store job's bookkeeping before its I/O, in one call: per key in job order, ``False``
        when the key is held at ``size`` already — at any size with ``held_at_any_size`` (a tier
        whose files' sizes vary: the write finds the file there, or replaces it and then counts
        its size with :meth:`add`) — (it becomes the most recent), ``True`` when :meth:`reserve`
        counted it now, or the ``TierIOError`` that reservation raised. Every key not failed is
        pinned. Also returns the victims of all the reservations (see :meth:`reserve`)."""
        outcomes: list[bool | TierIOError] = []
        victims: list[tuple[bytes, float]] = []
        busy, sizes, capacity = self._busy, self._size, self.capacity
        stored_at: float | None = None
        seen = 0.0
        for key in keys:
            slot, i = self._locate(key)  # a miss ends on the bucket the key then takes
            if slot >= 0 and (sizes[slot] == size or held_at_any_size):
                self._keep_held(key, slot)
                outcomes.append(False)
            elif self._reserve_inline and (capacity is None or (
                    self.complete and self.used + size - (sizes[slot] if slot >= 0 else 0) <= capacity)):
                # Room without victims: reserve() amounts to add(), done here with one lookup.
                if stored_at is None:
                    stored_at, seen = time.time() - self._epoch, time.monotonic()
                if slot >= 0:
                    self.used += size - sizes[slot]
                    sizes[slot] = size
                    self._unlink(slot)
                elif self._old is None and self._n + 1 <= _MAX_LOAD * len(self._table):
                    slot = self._table[i] = self._new_entry(key, size)  # where the probe ended
                else:
                    slot = self._insert(key, size)
                self._stored[slot] = stored_at
                self._seen[slot] = seen
                self._push_hot(slot)
                outcomes.append(True)
            else:
                try:
                    victims.extend(self.reserve(key, size))
                except TierIOError as exc:
                    outcomes.append(exc)
                    continue
                outcomes.append(True)
            busy[key] = busy.get(key, 0) + 1
        return outcomes, victims

    def over_capacity_victims(self, limit: int | None = None) -> list[tuple[bytes, float]]:
        """Pick (and remove) least recent idle chunks until ``used ≤ capacity``, at most
        ``limit`` of them (a caller on the event loop takes them in bounded batches)."""
        if self.capacity is None or self.used <= self.capacity:
            return []
        return self._pick_victims(self.used - self.capacity, limit=limit, partial=True) or []

    def _pick_victims(self, excess: int, *, exclude: bytes | None = None, limit: int | None = None,
                      partial: bool = False) -> list[tuple[bytes, float]] | None:
        chosen: list[int] = []
        freed = 0
        for slot in self._lru_order():
            if freed >= excess or (limit is not None and len(chosen) >= limit):
                break
            key = self._key(slot)
            if key == exclude or key in self._busy:
                continue
            chosen.append(slot)
            freed += self._size[slot]
        if freed < excess and not partial and (limit is None or len(chosen) < limit):
            return None
        victims = [(self._key(s), self._stored[s] + self._epoch) for s in chosen]
        for key, _ in victims:
            self.remove(key)
        return victims

    def _lru_order(self) -> Iterator[int]:
        """Slots from least recently used on: cold buckets oldest first, then the hot list.
        Lazy (a caller stops after a few); the lists must not change while it runs."""
        nxt = self._next
        while self._cold_top and nxt[self._cold_top] == self._cold_top:
            self._cold_top -= 1  # emptied by evictions and uses since
        for bucket in range(self._cold_top, 0, -1):
            if nxt[bucket] != bucket:
                yield from self._walk(bucket)
        yield from self._walk(_HOT)

    # ------------------------------------------------------------------ internals: slots
    def _key(self, slot: int) -> bytes:
        start = slot * MAX_KEY_BYTES
        return bytes(self._keys[start : start + self._klen[slot]])

    def _walk(self, sentinel: int) -> Iterator[int]:
        nxt = self._next
        slot = nxt[sentinel]
        while slot != sentinel:
            following = nxt[slot]  # read first: the caller may unlink ``slot`` meanwhile
            yield slot
            slot = following

    def _new_slot(self) -> int:
        slot = self._free
        if slot != _EMPTY:
            self._free = self._next[slot]
            return slot
        slot = self._slots
        if slot == len(self._klen):
            self._grow()
        self._slots += 1
        return slot

    def _release_slot(self, slot: int) -> None:
        self._klen[slot] = 0
        self._next[slot] = self._free
        self._free = slot

    def _grow(self) -> None:
        n = len(self._klen)
        self._keys.extend(bytes(n * MAX_KEY_BYTES))
        self._klen.extend(bytes(n))
        for arr in (self._size, self._stored, self._seen, self._prev, self._next, self._lnext):
            arr.extend(array(arr.typecode, bytes(n * arr.itemsize)))

    def _insert(self, key: bytes, size: int) -> int:
        slot = self._new_entry(key, size)
        self._table_insert(key, slot)
        return slot

    def _new_entry(self, key: bytes, size: int) -> int:
        """A slot holding ``key`` (not in the lookup table yet), chained into its leaf."""
        n = len(key)
        if not 4 < n <= MAX_KEY_BYTES:
            raise ValueError(f"an offload key has 5 to {MAX_KEY_BYTES} bytes, not {n}")
        slot = self._new_slot()
        start = slot * MAX_KEY_BYTES
        self._keys[start : start + n] = key
        self._klen[slot] = n
        self._size[slot] = size
        group, leaf = leaf_of(key)
        tops = self._leaf_heads.get(group)
        if tops is None:
            tops = self._leaf_heads[group] = [None] * TOPS
            self._top_counts[group] = array("i", bytes(4 * TOPS))
        top = leaf >> 8
        heads = tops[top]
        if heads is None:
            heads = tops[top] = array("i", [_EMPTY]) * LEAVES_PER_TOP
        leaf &= 0xFF
        self._lnext[slot] = heads[leaf]
        heads[leaf] = slot
        self._top_counts[group][top] += 1
        self._n += 1
        self.used += size
        return slot

    def _drop(self, slot: int, key: bytes) -> None:
        self._unlink(slot)
        self._table_delete(key)
        group, leaf = leaf_of(key)
        heads = self._leaf_heads[group][leaf >> 8]
        assert heads is not None
        self._top_counts[group][leaf >> 8] -= 1
        leaf &= 0xFF
        lnext = self._lnext
        if heads[leaf] == slot:
            heads[leaf] = lnext[slot]
        else:
            prev = heads[leaf]
            while lnext[prev] != slot:
                prev = lnext[prev]
            lnext[prev] = lnext[slot]
        self._n -= 1
        self.used -= self._size[slot]
        self._release_slot(slot)

    def _unlink(self, slot: int) -> None:
        prev, nxt = self._prev[slot], self._next[slot]
        self._next[prev] = nxt
        self._prev[nxt] = prev

    def _push_hot(self, slot: int) -> None:
        last = self._prev[_HOT]
        self._next[last] = slot
        self._prev[slot] = last
        self._next[slot] = _HOT
        self._prev[_HOT] = slot

    # ------------------------------------------------------------------ internals: the table
    def _probe(self, table: array[int], key: bytes) -> int:
        """Bucket of ``key`` in ``table``, or -1."""
        mask = len(table) - 1
        i = hash(key) & mask
        keys, klen, width = self._keys, self._klen, MAX_KEY_BYTES
        while True:  # ends: a table is at most 60% full
            slot = table[i]
            if slot == _EMPTY:
                return -1
            if klen[slot] == len(key) and keys.startswith(key, slot * width):  # no slice made
                return i
            i = (i + 1) & mask

    def _find(self, key: bytes) -> int:
        """Slot of ``key``, or -1."""
        return self._locate(key)[0]

    def _locate(self, key: bytes) -> tuple[int, int]:
        """``(slot, bucket)``: the slot of ``key`` (-1 when absent) and the bucket of the current
        table its probe ended on — where a new key goes when the table needs neither growing nor
        migrating (-1 when the key was found in the old table)."""
        table = self._table
        mask = len(table) - 1
        i = hash(key) & mask
        keys, klen, width, n = self._keys, self._klen, MAX_KEY_BYTES, len(key)
        while True:  # ends: a table is at most 60% full
            slot = table[i]
            if slot == _EMPTY:
                break
            if klen[slot] == n and keys.startswith(key, slot * width):
                return slot, i
            i = (i + 1) & mask
        old = self._old
        if old is not None:
            j = self._probe(old, key)
            if j >= 0:
                return old[j], -1
        return -1, i

    def _table_insert(self, key: bytes, slot: int) -> None:
        if self._old is not None:
            self._migrate(_MIGRATE_PER_INSERT)
        elif self._n + 1 > _MAX_LOAD * len(self._table):
            old = self._old = self._table
            self._table = array("i", [_EMPTY]) * (2 * len(old))
            self._old_done, self._old_start = 0, old.index(_EMPTY)
            self._migrate(_MIGRATE_PER_INSERT)
        self._place(self._table, key, slot)

    @staticmethod
    def _place(table: array[int], key: bytes, slot: int) -> None:
        mask = len(table) - 1
        i = hash(key) & mask
        while table[i] != _EMPTY:
            i = (i + 1) & mask
        table[i] = slot

    def _migrate(self, buckets: int) -> None:
        """Move at least ``buckets`` buckets of the old table to the new one, whole clusters at a
        time (from an empty bucket to the next), so every probe chain left in the old table stays
        intact and a lookup there never walks what was moved."""
        old = self._old
        assert old is not None
        mask, n = len(old) - 1, len(old)
        done, start, seen = self._old_done, self._old_start, 0
        while done < n:
            i = (start + done) & mask
            slot = old[i]
            if slot == _EMPTY:
                if seen >= buckets:
                    break
            else:
                self._place(self._table, self._key(slot), slot)
                old[i] = _EMPTY
            done += 1
            seen += 1
        self._old_done = done
        if done == n:
            self._old = None

    def _table_delete(self, key: bytes) -> None:
        table = self._table
        i = self._probe(table, key)
        if i < 0:  # not migrated yet
            assert self._old is not None
            table = self._old
            i = self._probe(table, key)
        # Backward-shift deletion: pull later members of the probe chain into the hole.
        mask = len(table) - 1
        j = i
        while True:
            j = (j + 1) & mask
            slot = table[j]
            if slot == _EMPTY:
                break
            home = hash(self._key(slot)) & mask
            # Move the entry at j to the hole at i unless its home lies cyclically in (i, j].
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                table[i] = slot
                i = j
        table[i] = _EMPTY


_UNLINKED = -2  # in _tprev: the entry is in no pool's list (it is cold, or not linked yet)


class TenantChunkIndex(ChunkIndex):
    """A :class:`ChunkIndex` that charges every chunk to a tenant pool and keeps per-pool budgets
    (the fs ``tenant_bytes`` option; the rules are :mod:`kvtier.policies.quotas`').

    A chunk is charged to the pool :meth:`note_writers` named for its key when a store job was
    submitted (its request's tenant), else to ``"default"``: chunks a scan, a probe or a load
    found are of unknown origin. The pool of each entry costs one byte; each pool's recently used
    chunks are also chained in a list of their own (two more ints per entry), so a pool's least
    recently used chunks are found without walking other pools'. Cold chunks (found by the
    start-up scan, unused since) are all ``"default"``'s and are its least recent.

    :meth:`reserve` applies the budget before the capacity: a pool whose chunk would take it past
    its budget evicts its own least recent idle chunks, and when they are too few the chunk is
    refused (``TierIOError("tenant_quota")``, counted per pool) — with free room on the disk or
    not. Then the room ``max_bytes`` lacks comes from :meth:`TenantQuotas.donors`.
    :meth:`over_capacity_victims` also brings pools over their budget back to it.
    """

    #: Store jobs' pools remembered between submission and reservation, at most (the oldest go first:
    #: a chunk whose entry is gone is charged to ``"default"``).
    MAX_PENDING_WRITERS = 1 << 16

    def __init__(self, capacity: int | None, quotas: TenantQuotas, *, expected_entries: int = 0) -> None:
        super().__init__(capacity, expected_entries=expected_entries)
        self.quotas = quotas
        size = len(self._klen)
        self._tenant = bytearray(size)
        self._tprev = array("i", [_UNLINKED]) * size
        self._tnext = array("i", [_EMPTY]) * size
        self._thead = [_EMPTY] * len(quotas)
        self._ttail = [_EMPTY] * len(quotas)
        self._charging = DEFAULT_POOL  # the pool new entries are charged to
        self._writers: dict[bytes, int] = {}

    # ------------------------------------------------------------------ pools
    def note_writers(self, keys: Iterable[bytes], pool: int) -> None:
        """Chunks ``keys`` are about to be stored for ``pool`` (a submitted store job). A later job's
        note replaces an earlier one's (``"default"`` included), so a job that never ran charges
        nothing to its tenant once another has been submitted for the key."""
        writers = self._writers
        for key in keys:
            writers.pop(key, None)
            writers[key] = pool
        while len(writers) > self.MAX_PENDING_WRITERS:
            del writers[next(iter(writers))]

    def pool_of(self, key: bytes) -> int | None:
        """The pool ``key``'s chunk is charged to, or None when it is not in the index."""
        slot = self._find(key)
        return None if slot < 0 else self._tenant[slot]

    def pool_keys(self, pool: int) -> list[bytes]:
        """``pool``'s keys from least to most recently used (O(n): for tests and tools)."""
        return [self._key(s) for s in self._pool_order(pool)]

    # ------------------------------------------------------------------ capacity
    def add(self, key: bytes, size: int, stored_at: float | None = None) -> None:
        slot = self._find(key)
        if slot >= 0 and size != self._size[slot]:
            self.quotas.charge(self._tenant[slot], size - self._size[slot])
        super().add(key, size, stored_at)

    def reserve(self, key: bytes, size: int, pool: int | None = None) -> list[tuple[bytes, float]]:
        """:meth:`ChunkIndex.reserve` with the budget of the chunk's pool applied first (see the
        class docstring); ``pool`` defaults to the writer :meth:`note_writers` recorded."""
        writer = self._writers.pop(key, DEFAULT_POOL)
        slot = self._find(key)
        owner = self._tenant[slot] if slot >= 0 else (writer if pool is None else pool)  # first writer wins
        growth = size - (self._size[slot] if slot >= 0 else 0)
        quotas = self.quotas
        skip: set[int] = set()
        chosen: list[int] = []
        own = quotas.own_excess(owner, growth) if growth > 0 else 0
        if own > 0:
            picked = self._choose([(owner, None)], own, key, skip)
            if picked is None:
                quotas.count_refused(owner)
                raise TierIOError("tenant_quota", f"tenant {quotas.labels[owner]!r} is at its budget of "
                                  f"{quotas.budgets[owner]} bytes on this tier, held by chunks in use")
            chosen = picked
            skip.update(chosen)
        if self.capacity is not None:
            freed = sum(self._size[s] for s in chosen)
            excess = self.used - freed + growth - self.capacity
            if not self.complete:
                excess = max(excess, growth - freed)
            if excess > 0:
                more = self._choose(quotas.donors(owner), excess, key, skip)
                if more is None:
                    raise TierIOError(
                        "no_space",
                        f"max_bytes={self.capacity} is held by chunks in use" if self.complete else
                        f"max_bytes={self.capacity}: the start-up scan has not found enough idle chunks to evict yet")
                chosen.extend(more)
        victims = self._take(chosen)
        self._charging = owner
        try:
            self.add(key, size)
        finally:
            self._charging = DEFAULT_POOL
        return victims

    # reserve_all: every key not held goes through this class's reserve (pools, budgets).
    _reserve_inline = False
    # unpin_all: each touched key moves in its pool's list too.
    _touch_inline = False

    def _keep_held(self, key: bytes, slot: int) -> None:
        self._writers.pop(key, None)  # held already: charged where it is
        super()._keep_held(key, slot)

    def over_capacity_victims(self, limit: int | None = None) -> list[tuple[bytes, float]]:
        """Pools over their budget back to it (their own least recent idle chunks), then the tier
        back under ``max_bytes`` (as :meth:`TenantQuotas.donors` orders it), ``limit`` chunks at most."""
        quotas = self.quotas
        chosen: list[int] = []
        skip: set[int] = set()
        for pool, budget in enumerate(quotas.budgets):
            if budget is not None and quotas.used[pool] > budget:
                left = None if limit is None else limit - len(chosen)
                picked = self._choose([(pool, None)], quotas.used[pool] - budget, None, skip, limit=left, partial=True)
                chosen.extend(picked or ())
                skip.update(chosen)
        if self.capacity is not None:
            excess = self.used - sum(self._size[s] for s in chosen) - self.capacity
            if excess > 0 and (limit is None or len(chosen) < limit):
                left = None if limit is None else limit - len(chosen)
                chosen.extend(self._choose(quotas.donors(-1), excess, None, skip, limit=left, partial=True) or ())
        return self._take(chosen)

    def _choose(self, donors: Sequence[tuple[int, int | None]], excess: int, exclude: bytes | None,
                skip: set[int], *, limit: int | None = None, partial: bool = False) -> list[int] | None:
        """Idle slots worth at least ``excess`` bytes, from ``donors`` in order (each pool's least
        recent first, at most its cap), not ``exclude`` nor in ``skip``; None when too few
        (unless ``partial``). Nothing is removed."""
        chosen: list[int] = []
        taken: set[int] = set()
        freed = 0
        sizes, busy = self._size, self._busy
        for pool, cap in donors:
            from_pool = 0
            for slot in self._pool_order(pool):
                if freed >= excess or (limit is not None and len(chosen) >= limit):
                    break
                if cap is not None and from_pool >= cap:
                    break
                if slot in skip or slot in taken:
                    continue
                key = self._key(slot)
                if key == exclude or key in busy:
                    continue
                chosen.append(slot)
                taken.add(slot)
                freed += sizes[slot]
                from_pool += sizes[slot]
            if freed >= excess or (limit is not None and len(chosen) >= limit):
                break
        if freed < excess and not partial and (limit is None or len(chosen) < limit):
            return None
        return chosen

    def _take(self, slots: Sequence[int]) -> list[tuple[bytes, float]]:
        """Remove the chosen slots as evictions (counted per pool); ``(key, stored_at)`` each."""
        victims: list[tuple[bytes, float]] = []
        for slot in slots:
            self.quotas.count_evictions(self._tenant[slot])
            victims.append((self._key(slot), self._stored[slot] + self._epoch))
        for key, _ in victims:
            self.remove(key)
        return victims

    def _pool_order(self, pool: int) -> Iterator[int]:
        """``pool``'s slots from least recently used on ("default": the cold chunks first). Lazy;
        the lists must not change while it runs."""
        if pool == DEFAULT_POOL:
            nxt = self._next
            while self._cold_top and nxt[self._cold_top] == self._cold_top:
                self._cold_top -= 1
            for bucket in range(self._cold_top, 0, -1):
                if nxt[bucket] != bucket:
                    yield from self._walk(bucket)
        tnext = self._tnext
        slot = self._thead[pool]
        while slot != _EMPTY:
            following = tnext[slot]
            yield slot
            slot = following

    # ------------------------------------------------------------------ internals
    def _grow(self) -> None:
        n = len(self._klen)
        super()._grow()
        self._tenant.extend(bytes(n))
        self._tprev.extend(array("i", [_UNLINKED]) * n)
        self._tnext.extend(array("i", [_EMPTY]) * n)

    def _new_entry(self, key: bytes, size: int) -> int:
        slot = super()._new_entry(key, size)
        self._tenant[slot] = self._charging
        self._tprev[slot] = _UNLINKED
        self.quotas.charge(self._charging, size)
        return slot

    def _drop(self, slot: int, key: bytes) -> None:
        pool, size = self._tenant[slot], self._size[slot]
        super()._drop(slot, key)
        self.quotas.discharge(pool, size)

    def _unlink(self, slot: int) -> None:
        super()._unlink(slot)
        prev = self._tprev[slot]
        if prev == _UNLINKED:
            return
        nxt, pool = self._tnext[slot], self._tenant[slot]
        if prev == _EMPTY:
            self._thead[pool] = nxt
        else:
            self._tnext[prev] = nxt
        if nxt == _EMPTY:
            self._ttail[pool] = prev
        else:
            self._tprev[nxt] = prev
        self._tprev[slot] = _UNLINKED

    def _push_hot(self, slot: int) -> None:
        super()._push_hot(slot)
        pool = self._tenant[slot]
        tail = self._ttail[pool]
        self._tprev[slot] = tail
        self._tnext[slot] = _EMPTY
        if tail == _EMPTY:
            self._thead[pool] = slot
        else:
            self._tnext[tail] = slot
        self._ttail[pool] = slot

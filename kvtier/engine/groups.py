"""What each KV-cache group of a request loads and stores (``docs/hybrid-models.md``).

Semantics callers rely on (positions in tokens; ``C`` is a group's chunk tokens):

* **The hit** of a load is the largest boundary ``h <= bound`` that every group can serve, found
  as vLLM finds it: prefix groups (full attention, MLA) first, then sliding-window groups (largest
  window first), then state groups; each may lower the bound to one of its own chunk boundaries,
  and the pass repeats until no group lowers it, so ``h`` is a multiple of every group's ``C``.

  * a prefix group serves ``h`` when every chunk from ``computed // C`` to ``h`` is held;
  * a sliding-window group when the chunks overlapping ``[h - window, h)`` (from
    ``computed // C`` on) are held: a suffix scan from ``h`` down, moving ``h`` below the highest
    chunk missing; chunks before the window are never looked up;
  * a state group when the chunk ending at ``h`` (the state after token ``h``) is held; otherwise
    ``h`` moves one chunk down, and so on: a state never comes from another position.

  A verdict still pending (``HIT_PENDING``, ``RETRY``) counts as held while scanning (so later
  probes start now) and makes the caller wait and scan again.
* **A load places** exactly the chunks :func:`load_chunks` names for ``h``. **A store writes**
  the chunks :func:`store_chunks` names: whatever the load path can use to continue the request
  or to repeat its prompt (the window before those hits, the states at them), nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.engine.arguments import check_block_ids
from kvtier.model import KVCacheGroup, KVModel
from kvtier.types import LookupResult

__all__ = ["BlockTables", "GroupKeys", "hit_alignment", "load_chunks", "store_boundaries", "store_chunks",
           "resolve_hit", "scan_order"]


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """One group of one request: its index, description, chunk tokens and chunk keys in order."""

    index: int
    group: KVCacheGroup
    chunk_tokens: int
    keys: Sequence[bytes]


def scan_order(model: KVModel) -> list[int]:
    """Group indices in scan order: prefix groups, sliding windows (largest first), state groups."""
    def rank(g: int) -> tuple[int, int]:
        group = model.groups[g]
        if group.loads_prefix:
            return (0, 0)
        if group.kind == "sliding_window":
            return (1, -(group.window or 0))
        return (2, 0)
    return sorted(range(len(model.groups)), key=rank)


def load_chunks(group: KVCacheGroup, chunk_tokens: int, hit: int, computed: int) -> range:
    """Chunk indices of ``group`` a load with hit ``hit`` places, the caller holding ``computed`` tokens."""
    first = computed // chunk_tokens
    end = hit // chunk_tokens
    if hit <= computed:
        return range(0)
    if group.kind == "sliding_window":
        assert group.window is not None
        return range(max(first, max(0, hit - group.window) // chunk_tokens), end)
    if group.kind == "mamba":
        return range(end - 1, end)
    return range(first, end)


def hit_alignment(chunk_tokens: Sequence[int]) -> int:
    """Every hit is a multiple of this: the least common multiple of the groups' chunk tokens."""
    return math.lcm(*chunk_tokens)


def store_boundaries(limit: int, alignment: int) -> list[int]:
    """The hits a store of ``limit`` tokens prepares for, highest first: ``limit`` aligned down, and
    one alignment lower when ``limit`` is aligned (what a repeat of the prompt without its last
    token hits). Continuations of the request hit at or above the first."""
    top = limit // alignment * alignment
    return [b for b in (top, top - alignment if top == limit else -1) if b > 0]


def store_chunks(group: KVCacheGroup, chunk_tokens: int, limit: int, alignment: int) -> list[int]:
    """Chunk indices of ``group`` a store of the first ``limit`` tokens writes (ascending).

    Prefix groups: every complete chunk. A sliding-window group: the chunks overlapping the
    window before the lowest of :func:`store_boundaries`, up to the last complete chunk. A state
    group: the chunk ending at each of :func:`store_boundaries`.
    """
    end = limit // chunk_tokens
    if group.loads_prefix:
        return list(range(end))
    boundaries = store_boundaries(limit, alignment)
    if not boundaries:
        return []
    if group.kind == "sliding_window":
        assert group.window is not None
        return list(range(max(0, min(boundaries) - group.window) // chunk_tokens, end))
    return sorted(b // chunk_tokens - 1 for b in boundaries)


def resolve_hit(groups: Sequence[GroupKeys], bound: int, computed: int,
                verdict: Callable[[bytes], LookupResult]) -> tuple[int, bool]:
    """``(hit, waiting)``: the converged hit (module docstring) and whether a verdict was pending.

    ``groups`` come in scan order; ``verdict`` is asked at most once per key. A hit at or below
    ``computed`` means nothing to load.
    """
    seen: dict[bytes, LookupResult] = {}
    waiting = False

    def held(key: bytes) -> bool:
        nonlocal waiting
        result = seen.get(key)
        if result is None:
            result = seen[key] = verdict(key)
        if result is LookupResult.MISS:
            return False
        if result is not LookupResult.HIT:
            waiting = True
        return True

    while bound > computed:
        before = bound
        for group in groups:
            bound = _tighten(group, bound, computed, held)
            if bound <= computed:
                return computed, waiting
        if bound == before:
            break
    return max(bound, computed), waiting


def _tighten(group: GroupKeys, bound: int, computed: int, held: Callable[[bytes], bool]) -> int:
    """The largest boundary ``<= bound`` that ``group`` serves (``<= computed`` if none)."""
    size = group.chunk_tokens
    boundary = bound // size * size
    keys = group.keys
    kind = group.group.kind
    if group.group.loads_prefix:
        for index in range(computed // size, boundary // size):
            if not held(keys[index]):
                return index * size
        return boundary
    if kind == "sliding_window":
        window = group.group.window or 0
        while boundary > computed:
            lowest = max(computed // size, max(0, boundary - window) // size)
            missing = next((i for i in range(boundary // size - 1, lowest - 1, -1) if not held(keys[i])), None)
            if missing is None:
                return boundary
            boundary = missing * size
        return boundary
    while boundary > computed:  # a state group: the state at the boundary itself
        if held(keys[boundary // size - 1]):
            return boundary
        boundary -= size
    return boundary


class BlockTables:
    """Where the chunks of each group sit in a request's block tables, and their checks.

    ``block_ids[g][i]`` is the device block of group ``g``'s token block ``i``; chunk ``c`` of a
    group covers blocks ``c * blocks_per_chunk`` up to the next chunk, and copies all of them, or
    the last one for a state group (the state after the chunk's last token). ``group_blocks`` are
    the device blocks of each group (``None``: unknown, ranges unchecked).
    """

    def __init__(self, model: KVModel, blocks_per_chunk: int, group_blocks: Sequence[int] | None) -> None:
        self.model = model
        self.blocks_per_chunk = blocks_per_chunk
        self.group_blocks = group_blocks

    def chunk_blocks(self, group_block_ids: Sequence[int], group: int, chunk: int) -> Sequence[int]:
        """The device blocks chunk ``chunk`` of ``group`` copies."""
        bpc = self.blocks_per_chunk
        per_chunk = self.model.groups[group].blocks_per_slot(bpc)
        return group_block_ids[(chunk + 1) * bpc - per_chunk : (chunk + 1) * bpc]

    def check(self, block_ids: Sequence[Sequence[int]], group: int, chunks: Sequence[int]) -> None:
        """The device blocks that ``chunks`` (ascending) of ``group`` use exist, are in range and
        distinct (ValueError naming the id)."""
        if not chunks:
            return
        bpc = self.blocks_per_chunk
        per_chunk = self.model.groups[group].blocks_per_slot(bpc)
        name = "block_ids" if len(self.model.groups) == 1 else f"block_ids[{group}]"
        num_blocks = None if self.group_blocks is None else self.group_blocks[group]
        ids = block_ids[group]
        if per_chunk == bpc and chunks[-1] - chunks[0] == len(chunks) - 1:  # one run of chunks
            check_block_ids(ids, chunks[0] * bpc, (chunks[-1] + 1) * bpc, num_blocks, name)
        else:
            for i in chunks:
                check_block_ids(ids, (i + 1) * bpc - per_chunk, (i + 1) * bpc, num_blocks, name)

"""What each KV-cache group loads and stores (``kvtier/engine/groups.py``), without an engine."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from kvtier.engine.groups import GroupKeys, hit_alignment, load_chunks, resolve_hit, store_chunks
from kvtier.model import KVCacheGroup
from kvtier.types import LookupResult

FULL = KVCacheGroup.full_attention(block_size=4, layer_names=["a"], num_kv_heads=1, head_dim=4)
SWA = KVCacheGroup.sliding_window(window=8, block_size=4, layer_names=["b"], num_kv_heads=1, head_dim=4)
STATE = KVCacheGroup.mamba(block_size=8, layer_names=["c"], state_shapes=[(4,)], state_dtypes=["float32"])


def keys(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def groups(n_tokens: int = 64) -> list[GroupKeys]:
    return [GroupKeys(0, FULL, 4, keys("f", n_tokens // 4)), GroupKeys(1, SWA, 4, keys("w", n_tokens // 4)),
            GroupKeys(2, STATE, 8, keys("s", n_tokens // 8))]


class Oracle:
    """Answers HIT for the keys it holds, a pending verdict for ``pending``, MISS otherwise; records lookups."""

    def __init__(self, held: Collection[bytes], pending: Collection[bytes] = ()) -> None:
        self.held = set(held)
        self.pending = set(pending)
        self.asked: list[bytes] = []

    def __call__(self, key: bytes) -> LookupResult:
        self.asked.append(key)
        if key in self.pending:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if key in self.held else LookupResult.MISS


def everything(n_tokens: int = 64) -> set[bytes]:
    return {k for g in groups(n_tokens) for k in g.keys}


def test_every_group_holding_everything_gives_the_largest_common_boundary() -> None:
    oracle = Oracle(everything())
    assert resolve_hit(groups(), 63, 0, oracle) == (56, False)
    assert len(oracle.asked) == len(set(oracle.asked))  # each key asked at most once


def test_the_window_scan_never_looks_before_the_window() -> None:
    oracle = Oracle(everything())
    resolve_hit(groups(), 64, 0, oracle)
    window_keys = [k for k in oracle.asked if k.startswith(b"w")]
    assert window_keys == [b"w15", b"w14"]  # tokens 56..64: two chunks, from the top


def test_a_missing_window_chunk_moves_the_hit_below_it() -> None:
    oracle = Oracle(everything() - {b"w14"})
    hit, _ = resolve_hit(groups(), 64, 0, oracle)
    # The window before 64 needs chunk 14 (tokens 56..60): the hit moves to 56, whose window
    # (chunks 12, 13) is held, as is the state at 56.
    assert hit == 56
    assert b"w11" not in oracle.asked


def test_a_missing_state_moves_the_hit_to_the_next_state_held() -> None:
    held = everything() - {b"s7", b"s6"}
    assert resolve_hit(groups(), 64, 0, Oracle(held))[0] == 48


def test_groups_tighten_each_other_until_the_bound_converges() -> None:
    # Full attention stops at 36 (chunk 9 missing); the state at 32 is missing too, at 24 held;
    # the window before 24 (chunks 4, 5) is held.
    held = everything() - {b"f9", b"s3"}
    assert resolve_hit(groups(), 64, 0, Oracle(held))[0] == 24


def test_pending_verdicts_count_as_held_and_ask_the_caller_to_wait() -> None:
    oracle = Oracle(everything() - {b"f3"}, pending={b"f3"})
    assert resolve_hit(groups(), 64, 0, oracle) == (64, True)


def test_nothing_to_load_below_what_the_caller_holds() -> None:
    assert resolve_hit(groups(), 64, 64, Oracle(everything()))[0] == 64
    assert resolve_hit(groups(), 64, 0, Oracle(set()))[0] == 0


@pytest.mark.parametrize(("group", "size", "hit", "computed", "expected"), [
    (FULL, 4, 32, 10, range(2, 8)),
    (SWA, 4, 32, 0, range(6, 8)),
    (SWA, 4, 32, 28, range(7, 8)),
    (STATE, 8, 32, 0, range(3, 4)),
    (STATE, 8, 32, 32, range(0)),
])
def test_a_load_places_only_what_each_group_needs(group: KVCacheGroup, size: int, hit: int, computed: int,
                                                  expected: range) -> None:
    assert load_chunks(group, size, hit, computed) == expected


def test_a_store_keeps_what_a_continuation_or_a_repeat_can_load() -> None:
    alignment = hit_alignment([4, 4, 8])
    assert alignment == 8
    assert store_chunks(FULL, 4, 35, alignment) == list(range(8))
    # 35 tokens: hits at 32 (both a continuation and the prompt without its last token).
    assert store_chunks(SWA, 4, 35, alignment) == [6, 7]
    assert store_chunks(STATE, 8, 35, alignment) == [3]
    # 32 tokens: a repeat hits 24, a continuation 32.
    assert store_chunks(SWA, 4, 32, alignment) == [4, 5, 6, 7]
    assert store_chunks(STATE, 8, 32, alignment) == [2, 3]
    assert store_chunks(STATE, 8, 7, alignment) == []

"""Specification of kvtier.keys: chained block hashes, NONE_HASH seeding and offload keys.

Expected values are recomputed here from the documented construction (hashlib/xxhash/cbor2 over
``(parent, tuple(tokens), extra_keys)``), never taken from the module under test.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import keys
from kvtier.errors import ConfigError
from kvtier.keys import BlockHasher, chunk_keys, make_offload_key, none_hash, split_offload_key

# Literal values for sha256 with the default seed, computed once with an independent snippet:
#   nh = sha256(pickle.dumps("vllm-none-hash", protocol=5)); h0 = sha256(pickle.dumps((nh, tuple(range(16)), None), 5))
NONE_HASH_SHA256_HEX = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
BLOCK0_SHA256_HEX = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
BLOCK1_SHA256_HEX = "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"


def reference_hash(algorithm: str, obj: object) -> bytes:
    """The documented hash_fn, written out independently of kvtier."""
    if algorithm.endswith("_cbor"):
        data = cbor2.dumps(obj, canonical=True)
    else:
        data = pickle.dumps(obj, protocol=5)
    if algorithm.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def reference_chain(algorithm, seed, tokens, block_size, extra_keys=None):
    parent = reference_hash(algorithm, seed)
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = None if extra_keys is None else extra_keys[i]
        parent = reference_hash(algorithm, (parent, block, extra))
        out.append(parent)
    return out


@pytest.fixture
def no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


ALGORITHMS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def test_default_sha256_none_hash_is_hash_of_fixed_seed_string(no_hash_seed: None) -> None:
    assert keys.hash_seed("sha256") == "vllm-none-hash"
    assert none_hash() == bytes.fromhex(NONE_HASH_SHA256_HEX)
    assert none_hash() == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def test_default_sha256_block_hashes_match_literal_vectors(no_hash_seed: None) -> None:
    hashes = BlockHasher("sha256", 16).hash_blocks(list(range(40)))
    assert [h.hex() for h in hashes] == [BLOCK0_SHA256_HEX, BLOCK1_SHA256_HEX]
    # The literals are exactly the documented construction.
    nh = bytes.fromhex(NONE_HASH_SHA256_HEX)
    h0 = hashlib.sha256(pickle.dumps((nh, tuple(range(16)), None), protocol=5)).digest()
    h1 = hashlib.sha256(pickle.dumps((h0, tuple(range(16, 32)), None), protocol=5)).digest()
    assert [h0, h1] == hashes


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_block_hashes_follow_documented_chain_without_extra_keys(algorithm: str, no_hash_seed: None) -> None:
    tokens = [7, 3, 99999, 0, 12, 5, 5, 5, 1, 2, 3, 4, 8]
    hasher = BlockHasher(algorithm, 4)
    seed = keys.hash_seed(algorithm)
    assert hasher.hash_blocks(tokens) == reference_chain(algorithm, seed, tokens, 4)
    assert all(len(h) == keys.digest_size(algorithm) for h in hasher.hash_blocks(tokens))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_block_hashes_include_per_block_extra_keys(algorithm: str, no_hash_seed: None) -> None:
    tokens = list(range(100, 112))
    extra = [("lora", "adapter", "/p"), None, ("cache_salt", "s")]
    hasher = BlockHasher(algorithm, 4)
    seed = keys.hash_seed(algorithm)
    with_extra = hasher.hash_blocks(tokens, extra_keys=extra)
    assert with_extra == reference_chain(algorithm, seed, tokens, 4, extra)
    assert with_extra[0] != hasher.hash_blocks(tokens)[0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pythonhashseed_selects_the_seed_string(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert keys.hash_seed(algorithm) == "1234"
    assert none_hash(algorithm) == reference_hash(algorithm, "1234")
    tokens = list(range(8))
    assert BlockHasher(algorithm, 4).hash_blocks(tokens) == reference_chain(algorithm, "1234", tokens, 4)


def test_none_hash_follows_environment_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "a")
    first = none_hash("sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "b")
    assert none_hash("sha256") != first
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash("sha256") == bytes.fromhex(NONE_HASH_SHA256_HEX)


def test_xxhash_seed_without_pythonhashseed_is_random_but_stable_in_process(no_hash_seed: None) -> None:
    seed = keys.hash_seed("xxhash")
    assert len(seed) == 64 and int(seed, 16) >= 0
    assert keys.hash_seed("xxhash") == seed == keys.hash_seed("xxhash_cbor")
    assert none_hash("xxhash") == reference_hash("xxhash", seed)


_CHILD = (
    "from kvtier.keys import hash_seed, none_hash;"
    "print(hash_seed('xxhash'), none_hash('xxhash').hex())"
)


def _child_output(env_seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


def test_xxhash_seed_differs_across_processes_unless_pythonhashseed_is_set() -> None:
    assert _child_output(None) != _child_output(None)
    assert _child_output("42") == _child_output("42")
    assert _child_output("42").split()[0] == "42"


def test_unknown_algorithm_is_a_config_error_listing_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="sha256_cbor") as info:
        BlockHasher("md5")
    assert "xxhash_cbor" in str(info.value)
    with pytest.raises(ConfigError):
        none_hash("sha1")


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher(block_size=16)
    assert hasher.hash_blocks(list(range(15))) == []
    assert len(hasher.hash_blocks(list(range(47)))) == 2


def test_parent_continues_a_chain() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(16))
    whole = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(tokens[8:], parent=whole[1]) == whole[2:]


def test_numpy_and_tuple_tokens_hash_like_python_ints() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(30, 42))
    expected = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(np.array(tokens, dtype=np.int64)) == expected
    assert hasher.hash_blocks(tuple(tokens)) == expected


def test_invalid_arguments_are_rejected() -> None:
    hasher = BlockHasher(block_size=4)
    with pytest.raises(ValueError):
        hasher.hash_blocks(list(range(8)), extra_keys=[None])
    with pytest.raises(ValueError):
        hasher.hash_blocks(list(range(8)), parent=b"short")
    with pytest.raises(ConfigError):
        BlockHasher(block_size=0)


token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=80)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, cut=st.integers(min_value=0, max_value=80))
def test_hashes_are_deterministic_and_prefix_closed(tokens: list[int], cut: int) -> None:
    hasher = BlockHasher(block_size=4)
    hashes = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(list(tokens)) == hashes
    prefix = hasher.hash_blocks(tokens[:cut])
    assert hashes[: len(prefix)] == prefix


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=4, max_size=80), data=st.data())
def test_changing_one_token_changes_its_block_and_every_later_hash(tokens: list[int], data: st.DataObject) -> None:
    hasher = BlockHasher(block_size=4)
    full = len(tokens) // 4 * 4
    pos = data.draw(st.integers(0, full - 1))
    changed = list(tokens)
    changed[pos] += 1
    before, after = hasher.hash_blocks(tokens), hasher.hash_blocks(changed)
    block = pos // 4
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def test_offload_key_is_hash_plus_big_endian_group() -> None:
    h = bytes(range(32))
    key = make_offload_key(h, 0x01020304)
    assert key == h + b"\x01\x02\x03\x04"
    assert split_offload_key(key) == (h, 0x01020304)
    assert make_offload_key(h) == h + b"\x00\x00\x00\x00"
    assert split_offload_key(make_offload_key(h, 2**32 - 1)) == (h, 2**32 - 1)


@pytest.mark.parametrize("group", [-1, 2**32])
def test_offload_key_group_out_of_range_is_rejected(group: int) -> None:
    with pytest.raises(ValueError):
        make_offload_key(bytes(16), group)


def test_split_rejects_keys_without_a_hash() -> None:
    with pytest.raises(ValueError):
        split_offload_key(b"\x00\x00\x00\x01")


def test_chunk_keys_use_the_last_hash_of_each_complete_chunk() -> None:
    hashes = [bytes([i]) * 16 for i in range(7)]
    assert chunk_keys(hashes, 3, group_idx=1) == [
        make_offload_key(hashes[2], 1),
        make_offload_key(hashes[5], 1),
    ]
    assert chunk_keys(hashes, 1) == [make_offload_key(h) for h in hashes]
    assert chunk_keys(hashes[:2], 3) == []
    with pytest.raises(ValueError):
        chunk_keys(hashes, 0)

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
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import keys
from kvtier.errors import ConfigError
from kvtier.keys import (
    NO_EXTRA_KEYS,
    BlockHasher,
    MultimodalItem,
    RequestExtraKeys,
    chunk_keys,
    make_offload_key,
    none_hash,
    split_offload_key,
)

# Literal values for sha256 with the default seed, computed once with an independent snippet:
#   nh = sha256(pickle.dumps("vllm-none-hash", protocol=5)); h0 = sha256(pickle.dumps((nh, tuple(range(16)), None), 5))
NONE_HASH_SHA256_HEX = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
BLOCK0_SHA256_HEX = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
BLOCK1_SHA256_HEX = "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"


# Requests keyed with extra keys (block size 4), and the block hashes vLLM 0.33.0 computes for them
# (sha256, PYTHONHASHSEED unset): printed by its own ``get_request_block_hasher`` on real
# ``vllm.v1.request.Request`` objects with
#   env -u PYTHONHASHSEED /work/vllm-venv/bin/python tests/integrations/test_keys_vllm.py
# (that file also checks these literals, and every algorithm and random requests, against vLLM live).
EXTRA_KEY_BLOCK_SIZE = 4
_SALT = "tenant-a"
_LORA = {"lora_name": "sql-adapter", "lora_path": "/adapters/sql"}
_MM = [("img-a", 2, 7), ("img-b", 9, 2), ("aud-c", 12, 4)]  # a spans blocks 0-2, b and c one each
_EMBEDS = (torch.arange(10 * 8, dtype=torch.float32).reshape(10, 8) / 8).to(torch.float16)
EXTRA_KEY_CASES: dict[str, dict] = {
    "unsalted": {"tokens": list(range(1000, 1012))},
    "salted": {"tokens": list(range(1000, 1012)), "cache_salt": _SALT},
    "lora": {"tokens": list(range(1000, 1012)), **_LORA},
    "salted_lora": {"tokens": list(range(1000, 1012)), "cache_salt": _SALT, **_LORA},
    "multimodal": {"tokens": list(range(2000, 2016)), "mm_items": _MM},
    "everything": {"tokens": list(range(2000, 2016)), "mm_items": _MM, "cache_salt": _SALT, **_LORA},
    # one image twice in block 0: pickle must see two string objects, as vLLM's engine core does
    "image_twice": {"tokens": list(range(3000, 3008)), "mm_items": [("img-x", 1, 1), ("img-x", 3, 2)]},
    # 10 prompt rows, then 2 generated tokens: block 2 hashes rows 8:10 only, as vLLM does.
    "prompt_embeds": {"tokens": [0] * 10 + [5, 6], "prompt_embeds": _EMBEDS},
}
EXTRA_KEY_VECTORS: dict[str, list[str]] = {
    "unsalted": [
        "63dba3bfc8235753fca2ec71e462bd173be1ebdbda88a101479c72328add6e0d",
        "052638339b15fe5a5fbdbbc2fd655d33be76724724e11e730c3b2a300e93b652",
        "d0121c43b046f5f23b2e1a67b294267bc8fdaab9a5383b9ce1e37e19d1926bf9",
    ],
    "salted": [
        "c0d91fb737fbc3e2a7bb158b67859e35281eb92af6a570d8a4a26d170cd3d49c",
        "ff0fff968af54436d62096a1fb4ee7a7b109e0e5cba1cb5fef31b4499e2adc90",
        "a7a7d71e762f0b2aec30817b9c9613f180b46881bf413250061c7a7ace5ce3a6",
    ],
    "lora": [
        "3468e7db02203ce55faaa762c0101721fe737fdd1fd7cc840b770152bb9391a0",
        "aedc83be73faa95442d14c569c337913ff88c0d5a533482f62eea194d35f5285",
        "91a574eea7ff958cfc12df01ce9ccc8e41f2229c6600ec516b7b6933d6f404db",
    ],
    "salted_lora": [
        "b475f2047284a790a926166542f9df94f4d0827131bf0c19966461f0e6a8ae7c",
        "26f287783fe0527451cd3807098e94bf5261214db902192fabb4b66aad52defb",
        "375aeca97cc9c7c373cef07bbf32f06151404df5cccb7aca26f50086ec333390",
    ],
    "multimodal": [
        "b11cdda6d2e29bd9d7de597615db7ea91b8890dfe2d24fd5289a952edcc97da5",
        "a5e48fb38aebcd7c2b0586c8012c85713c63a24f8acb3ecdf19c493edad59b41",
        "fd64ee4b71ef7c11cf56a4d389fcf22cb4a4245f84ba777c43988a9ab756ba1b",
        "32d7b54049783eb4dde51e54d6adf8e69fdf731d390c5fd97d27653e30950d67",
    ],
    "everything": [
        "6356672be5f25c36e6ee4044bff71553de1d197b9c623b36fe0a2c66d3fe9638",
        "e460c4fc030ff87aa7970454e295127f8efabc245533a138db0df24a0dabd29c",
        "d7e03127204bfed8c827157783cca64abda488cb83180c2d65251b8ece0d31c9",
        "e2721f2c712420fda98038830411863973c43d1f2dc1bec3ce54d5a35b9793bd",
    ],
    "image_twice": [
        "102ef7c244709a8778113b75ab3271fd45f1675ab16126c6b919ce70362d7634",
        "1cd3b3981cb01ebcd78532bd4cdd1d3f0518272c3443b02659f948c18aa1116f",
    ],
    "prompt_embeds": [
        "ff3de5e1162d574ea2f85e78d194e3f0818dc95ab8e01a40cb655cbd98166c4a",
        "0e49657e1fd4fd910b347bde3b81fe5fad7fa26f3b8bcaecdfeb5a0d4412b1c3",
        "7856838d1c8cfaf61052ab82aced6af339c0d0c3ce9c2d74ce3df757e602df29",
    ],
}


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


# ------------------------------------------------------------------------------ extra keys


def extras_of(case: dict) -> RequestExtraKeys:
    return RequestExtraKeys(**{k: v for k, v in case.items() if k != "tokens"})


@pytest.mark.parametrize("name", sorted(EXTRA_KEY_CASES))
def test_extra_keyed_hashes_are_vllms_literal_vectors(name: str, no_hash_seed: None) -> None:
    case = EXTRA_KEY_CASES[name]
    tokens, bs = case["tokens"], EXTRA_KEY_BLOCK_SIZE
    hashes = BlockHasher("sha256", bs).hash_blocks(tokens, extras_of(case).per_block(len(tokens) // bs, bs))
    assert [h.hex() for h in hashes] == EXTRA_KEY_VECTORS[name]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_keyed_variant_differs_in_every_block(algorithm: str, no_hash_seed: None) -> None:
    """One prompt keyed four ways (plain, salted, LoRA, both): no chunk key of one variant is the
    key of another, in any block, so no variant ever reads another's chunks."""
    variants = ["unsalted", "salted", "lora", "salted_lora"]
    bs = EXTRA_KEY_BLOCK_SIZE
    keys_of = {}
    for name in variants:
        case = EXTRA_KEY_CASES[name]
        tokens = case["tokens"]
        hashes = BlockHasher(algorithm, bs).hash_blocks(tokens, extras_of(case).per_block(len(tokens) // bs, bs))
        keys_of[name] = chunk_keys(hashes, 1)
    assert all(len(keys) == 3 for keys in keys_of.values())
    for i in range(3):
        assert len({keys_of[name][i] for name in variants}) == len(variants), i


def test_per_block_entries_in_vllms_order() -> None:
    embeds = torch.zeros((16, 2))
    extras = RequestExtraKeys(cache_salt="s", lora_name="n", lora_path="/p", mm_items=_MM, prompt_embeds=embeds)
    zeros = hashlib.sha256(bytes(4 * 2 * 4)).digest()  # four rows of two float32 zeros
    lora, salt, pe = ("lora", "n", "/p"), ("cache_salt", "s"), ("prompt_embeds", zeros)
    assert extras.per_block(4, 4) == [
        (lora, ("mm", "img-a", 2), salt, pe),  # the salt goes into block 0 only
        (lora, ("mm", "img-a", -2), pe),  # img-a began 2 tokens before this block
        (lora, ("mm", "img-a", -6), ("mm", "img-b", 1), pe),  # img-a ends here, img-b is inside
        (lora, ("mm", "aud-c", 0), pe),
    ]


def test_plain_requests_have_no_extra_keys() -> None:
    assert NO_EXTRA_KEYS.empty and NO_EXTRA_KEYS.per_block(3, 4) is None
    assert RequestExtraKeys(mm_items=[]).per_block(3, 4) is None
    # Blocks no entry applies to are None, not an empty tuple (so they hash as plain blocks).
    assert RequestExtraKeys(cache_salt="s").per_block(3, 4) == [(("cache_salt", "s"),), None, None]
    assert RequestExtraKeys(mm_items=[("x", 5, 1)]).per_block(3, 4) == [None, (("mm", "x", 1),), None]


def test_the_salt_enters_block_zero_but_changes_every_hash() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(16))
    salted = hasher.hash_blocks(tokens, RequestExtraKeys(cache_salt="t").per_block(4, 4))
    plain = hasher.hash_blocks(tokens)
    assert all(s != p for s, p in zip(salted, plain, strict=True))
    # From block 1 on it is the plain chain continued from the salted block 0.
    assert hasher.hash_blocks(tokens[4:], parent=salted[0]) == salted[1:]


def test_prompt_embeds_digest_is_raw_bytes_of_the_blocks_rows() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    keys_of = lambda t: RequestExtraKeys(prompt_embeds=t).per_block(2, 4)  # noqa: E731
    first = keys_of(base)
    assert first is not None
    assert first[0] == (("prompt_embeds", hashlib.sha256(base[0:4].numpy().tobytes()).digest()),)
    # Block 1 has only rows 4:6 (tokens past the prompt have no embeddings): those rows are hashed.
    assert first[1] == (("prompt_embeds", hashlib.sha256(base[4:6].numpy().tobytes()).digest()),)
    # Layout does not matter, the dtype does.
    assert keys_of(base.t().contiguous().t()) == first
    assert keys_of(base.to(torch.float16)) != first


@settings(max_examples=80, deadline=None)
@given(data=st.data(), block_size=st.integers(1, 6), num_blocks=st.integers(0, 8))
def test_mm_entries_are_the_items_overlapping_each_block(data: st.DataObject, block_size: int,
                                                         num_blocks: int) -> None:
    items, position = [], data.draw(st.integers(0, 4))
    for n in range(data.draw(st.integers(0, 5))):
        length = data.draw(st.integers(1, 10))
        items.append((f"item{n}", position, length))
        position += length + data.draw(st.integers(0, 6))
    per_block = RequestExtraKeys(mm_items=items).per_block(num_blocks, block_size)
    expected = []
    for b in range(num_blocks):
        start, end = b * block_size, (b + 1) * block_size
        entries = tuple(("mm", ident, off - start) for ident, off, n in items if off < end and off + n > start)
        expected.append(entries or None)
    assert per_block == (expected if items else None)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"cache_salt": 5}, TypeError, "cache_salt"),
    ({"cache_salt": ""}, ValueError, "cache_salt"),
    ({"lora_name": "a"}, ValueError, "lora_path"),
    ({"lora_path": "/p"}, ValueError, "lora_name"),
    ({"lora_name": b"a", "lora_path": "/p"}, TypeError, "lora_name"),
    ({"mm_items": "abc"}, TypeError, "mm_items"),
    ({"mm_items": [("a", 0)]}, TypeError, r"mm_items\[0\]"),
    ({"mm_items": [("", 0, 1)]}, ValueError, "identifier"),
    ({"mm_items": [("a", 0.0, 1)]}, TypeError, "offset"),
    ({"mm_items": [("a", True, 1)]}, TypeError, "offset"),
    ({"mm_items": [("a", -1, 1)]}, ValueError, "offset"),
    ({"mm_items": [("a", 0, 0)]}, ValueError, "length"),
    ({"mm_items": [("a", 4, 2), ("b", 5, 1)]}, ValueError, "overlap"),
    ({"mm_items": [("a", 4, 2), ("b", 0, 1)]}, ValueError, "order"),
    ({"prompt_embeds": [[0.0]]}, TypeError, "prompt_embeds"),
    ({"prompt_embeds": torch.zeros(4)}, TypeError, "2-D"),
])
def test_bad_extra_keys_are_rejected_naming_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        RequestExtraKeys(**kwargs)


def test_extra_key_inputs_are_normalised_to_plain_values() -> None:
    class Name(str):
        pass

    extras = RequestExtraKeys(cache_salt=Name("s"), mm_items=[MultimodalItem("a", np.int64(1), 2)])
    assert type(extras.cache_salt) is str
    assert extras.mm_items == (MultimodalItem("a", 1, 2),) and type(extras.mm_items[0].offset) is int

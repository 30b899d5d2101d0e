"""kvtier's block hashes with extra keys are vLLM 0.33's own, checked live against vLLM.

vLLM's side is a real ``vllm.v1.request.Request`` hashed by
``vllm.v1.core.kv_cache_utils.get_request_block_hasher`` (which calls
``generate_block_hash_extra_keys`` and ``hash_block_tokens``) after ``init_none_hash``; kvtier's
side is :class:`kvtier.keys.BlockHasher` fed :meth:`kvtier.keys.RequestExtraKeys.per_block`.

Run as a script in the vLLM virtualenv, this file prints the literal vectors of
``tests/test_keys.py`` (SHA-256, default seed)::

    env -u PYTHONHASHSEED /work/vllm-venv/bin/python tests/integrations/test_keys_vllm.py
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for test_keys as a script

from test_keys import EXTRA_KEY_BLOCK_SIZE, EXTRA_KEY_CASES, EXTRA_KEY_VECTORS  # noqa: E402

from kvtier.keys import BlockHasher, RequestExtraKeys  # noqa: E402

ALGORITHMS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def received(value: str) -> str:
    """``value`` as vLLM's engine core holds it: decoded from msgpack, a string object of its own."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))  # type: ignore[no-any-return]


def vllm_request(case: dict[str, Any], block_hasher: Any = None) -> Any:
    """A real ``vllm.v1.request.Request`` with ``case``'s inputs (strings as vLLM's engine core
    receives them), its generated tokens appended; hashed by ``block_hasher`` if given."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    embeds = case.get("prompt_embeds")
    prompt_len = len(embeds) if embeds is not None else len(case["tokens"])
    lora = None
    if case.get("lora_name") is not None:
        lora = LoRARequest(received(case["lora_name"]), 1, received(case["lora_path"]))
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=received(identifier),
                              mm_position=PlaceholderRange(offset=offset, length=length))
        for identifier, offset, length in case.get("mm_items") or ()
    ]
    request = Request(
        "r", None if embeds is not None else list(case["tokens"][:prompt_len]),
        SamplingParams(max_tokens=1), None, prompt_embeds=embeds, mm_features=features or None,
        lora_request=lora, cache_salt=case.get("cache_salt") and received(case["cache_salt"]),
        block_hasher=block_hasher,
    )
    if len(case["tokens"]) > prompt_len:  # generated tokens after the prompt
        request.append_output_token_ids(list(case["tokens"][prompt_len:]))
    return request


def vllm_hashes(case: dict[str, Any], algorithm: str, block_size: int) -> list[bytes]:
    """The block hashes vLLM computes for a request with these inputs."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    request = vllm_request(case, kv_cache_utils.get_request_block_hasher(block_size, hash_fn))
    assert list(request.all_token_ids) == list(case["tokens"])
    return list(request.block_hashes)


def kvtier_hashes(case: dict[str, Any], algorithm: str, block_size: int) -> list[bytes]:
    tokens = case["tokens"]
    extras = RequestExtraKeys(
        cache_salt=case.get("cache_salt"), lora_name=case.get("lora_name"),
        lora_path=case.get("lora_path"), mm_items=case.get("mm_items"),
        prompt_embeds=case.get("prompt_embeds"),
    )
    hasher = BlockHasher(algorithm, block_size)
    return hasher.hash_blocks(tokens, extras.per_block(len(tokens) // block_size, block_size))


@pytest.fixture
def vllm_none_hash(monkeypatch: pytest.MonkeyPatch, vllm_globals: None) -> None:
    """A fixed PYTHONHASHSEED: without it the xxhash seed is random per process."""
    monkeypatch.setenv("PYTHONHASHSEED", "kvtier-test-seed")


def test_literal_vectors_are_what_vllm_computes(monkeypatch: pytest.MonkeyPatch, vllm_globals: None) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for name, case in EXTRA_KEY_CASES.items():
        got = [h.hex() for h in vllm_hashes(case, "sha256", EXTRA_KEY_BLOCK_SIZE)]
        assert got == EXTRA_KEY_VECTORS[name], name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", sorted(EXTRA_KEY_CASES))
def test_cases_match_vllm_for_every_algorithm(name: str, algorithm: str, vllm_none_hash: None) -> None:
    case = EXTRA_KEY_CASES[name]
    expected = vllm_hashes(case, algorithm, EXTRA_KEY_BLOCK_SIZE)
    assert expected and kvtier_hashes(case, algorithm, EXTRA_KEY_BLOCK_SIZE) == expected


def random_case(rng: random.Random) -> tuple[dict[str, Any], int]:
    block_size = rng.choice([1, 2, 3, 4, 16])
    length = rng.randrange(block_size, 12 * block_size)
    case: dict[str, Any] = {"tokens": [rng.randrange(0, 200_000) for _ in range(length)]}
    if rng.random() < 0.5:
        case["cache_salt"] = rng.choice(["a", "tenant-7", "ünïcødé salt", "x" * 300])
    if rng.random() < 0.5:
        case["lora_name"] = f"adapter-{rng.randrange(5)}"
        case["lora_path"] = f"/adapters/{rng.randrange(5)}"
    if rng.random() < 0.6:
        # A small pool of string objects: an item repeated in one block is one object here.
        pool = [f"mm-{rng.randrange(1 << 30):x}" for _ in range(3)]
        items, position = [], rng.randrange(0, 5)
        while position < length and len(items) < 6:
            size = rng.randrange(1, 3 * block_size + 2)
            items.append((rng.choice(pool), position, size))
            position += size + rng.randrange(0, 2 * block_size)
        case["mm_items"] = items
    if rng.random() < 0.25:
        case["tokens"] = [0] * length
        rows = rng.randrange(1, length + 1)  # tokens past the rows are generated ones
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        case["prompt_embeds"] = torch.randn((rows, 8), generator=torch.Generator().manual_seed(
            rng.randrange(1 << 30))).to(dtype)
    return case, block_size


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_random_requests_match_vllm(algorithm: str, vllm_none_hash: None) -> None:
    rng = random.Random(f"kvtier-keys-{algorithm}")
    for _ in range(60):
        case, block_size = random_case(rng)
        assert kvtier_hashes(case, algorithm, block_size) == vllm_hashes(case, algorithm, block_size), case


if __name__ == "__main__":
    import vllm

    if "PYTHONHASHSEED" in os.environ:
        sys.exit("unset PYTHONHASHSEED: the vectors are for the default seed")
    print(f"# vLLM {vllm.__version__}, sha256, default seed, block size {EXTRA_KEY_BLOCK_SIZE}")
    for name, case in EXTRA_KEY_CASES.items():
        print(f"    {name!r}: [")
        for h in vllm_hashes(case, "sha256", EXTRA_KEY_BLOCK_SIZE):
            print(f'        "{h.hex()}",')
        print("    ],")

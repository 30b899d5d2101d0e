"""Self-describing events publish each block's extra keys exactly as vLLM 0.33 does, checked live.

vLLM's side: a real ``vllm.v1.request.Request``, its per-block keys from
``generate_block_hash_extra_keys`` (walked block by block as ``BlockPool`` does for its events),
converted by ``to_event_extra_keys`` and put in vLLM's own ``BlockStored``. kvtier's side:
:meth:`kvtier.keys.RequestExtraKeys.per_block`, sliced per chunk, converted by
:func:`kvtier.events.event_extra_keys` and put in kvtier's ``BlockStored``. The msgpack bytes
must be equal.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from test_keys_vllm import EXTRA_KEY_BLOCK_SIZE, EXTRA_KEY_CASES, random_case, vllm_request

from kvtier import events
from kvtier.keys import RequestExtraKeys


def vllm_per_block(case: dict[str, Any], block_size: int) -> list[Any]:
    """vLLM's tagged extra keys of every full block, as its block pool computes them for events."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    request = vllm_request(case)
    out, mm_idx = [], 0
    for i in range(len(case["tokens"]) // block_size):
        keys, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        out.append(keys)
    return out


def kvtier_per_block(case: dict[str, Any], block_size: int) -> list[Any] | None:
    extras = RequestExtraKeys(
        cache_salt=case.get("cache_salt"), lora_name=case.get("lora_name"),
        lora_path=case.get("lora_path"), mm_items=case.get("mm_items"),
        prompt_embeds=case.get("prompt_embeds"),
    )
    return extras.per_block(len(case["tokens"]) // block_size, block_size)


def check_case(case: dict[str, Any], block_size: int, blocks_per_chunk: int) -> None:
    from vllm.distributed import kv_events as vllm_events
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    theirs = vllm_per_block(case, block_size)
    ours = kvtier_per_block(case, block_size)
    if ours is None:
        # A request without extra keys: kvtier publishes None, as vLLM's offloading connector
        # does; vLLM's GPU block pool publishes one None per block. Consumers read both as "none".
        assert all(keys is None for keys in theirs)
        return
    tokens = case["tokens"]
    for start in range(0, len(theirs) - blocks_per_chunk + 1, blocks_per_chunk):
        stop = start + blocks_per_chunk
        expected = to_event_extra_keys(theirs[start:stop])
        published = events.event_extra_keys(ours[start:stop])
        assert published == expected, (case, start)
        fields: dict[str, Any] = dict(
            block_hashes=list(range(start, stop)), parent_block_hash=start - 1 if start else None,
            token_ids=list(tokens[start * block_size : stop * block_size]), block_size=block_size,
            lora_id=None, medium="CPU", lora_name=case.get("lora_name"), group_idx=0,
        )
        vllm_bytes = msgspec.msgpack.encode(vllm_events.BlockStored(**fields, extra_keys=expected))
        kvtier_bytes = msgspec.msgpack.encode(events.BlockStored(**fields, extra_keys=published))
        assert kvtier_bytes == vllm_bytes, (case, start)


@pytest.mark.parametrize("name", sorted(EXTRA_KEY_CASES))
def test_literal_cases_publish_vllms_extra_keys(name: str) -> None:
    for blocks_per_chunk in (1, 2, 3):
        check_case(EXTRA_KEY_CASES[name], EXTRA_KEY_BLOCK_SIZE, blocks_per_chunk)


def test_random_requests_publish_vllms_extra_keys() -> None:
    rng = random.Random("kvtier-event-extra-keys")
    for _ in range(80):
        case, block_size = random_case(rng)
        check_case(case, block_size, rng.choice([1, 2, 4]))

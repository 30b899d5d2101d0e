"""kvtier's per-group chunk keys and run namespace for hybrid models are vLLM 0.33's own, checked live.

Each layout is described once, as kvtier's :class:`kvtier.model.KVModel`, and turned into vLLM's
``KVCacheConfig`` (one ``KVCacheGroupSpec`` per group, same order, block sizes and layer names).
Everything compared is then computed by vLLM's own code, as its scheduler does:

* hash granularity, parallelism rule, groups: ``build_offloading_config`` (which calls
  ``resolve_kv_cache_block_sizes``);
* chunk keys: ``SchedulerOffloadConfig.from_spec`` and ``RequestOffloadState.update_offload_keys``
  over a real ``Request`` hashed by ``get_request_block_hasher``;
* run fields, directory and chunk paths: ``FileMapper.from_offloading_spec`` as the ``fs`` tier
  calls it, and ``config.json`` as a real ``fs`` tier writes it.

vLLM's ``ModelConfig`` cannot be built in this CPU virtualenv (it imports the model's class to
inspect it); the offloading code reads five facts from it, which :class:`ModelFacts` gives.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    RequestOffloadState,
    SchedulerOffloadConfig,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.context import RequestContext
from kvtier.engine.keying import RequestKeying
from kvtier.keys import NO_EXTRA_KEYS, BlockHasher, RequestExtraKeys
from kvtier.layout import namespace
from kvtier.model import KVCacheGroup, KVModel

MODEL = "acme/hybrid-test"
ROOT = "/data/kv"
CPU_BYTES = 1 << 24


def _layers(*indices: int, kind: str = "self_attn.attn") -> list[str]:
    return [f"model.layers.{i}.{kind}" for i in indices]


def gpt_oss_like(tp_size: int = 1) -> KVModel:
    """Full attention and sliding window, both block 16 (gpt-oss)."""
    return KVModel(MODEL, "bfloat16", (
        KVCacheGroup.full_attention(block_size=16, layer_names=_layers(0, 2), num_kv_heads=8, head_dim=64),
        KVCacheGroup.sliding_window(window=128, block_size=16, layer_names=_layers(1, 3), num_kv_heads=8,
                                    head_dim=64),
    ), tp_size=tp_size)


def mamba_hybrid(tp_size: int = 1) -> KVModel:
    """Full attention block 32 and Mamba state block 64: hashes every 32 tokens."""
    return KVModel(MODEL, "float16", (
        KVCacheGroup.full_attention(block_size=32, layer_names=_layers(3), num_kv_heads=4, head_dim=64),
        KVCacheGroup.mamba(block_size=64, layer_names=_layers(0, 1, 2, kind="mixer"), state_shapes=[(4, 32)],
                           state_dtypes=["float32"]),
    ), tp_size=tp_size)


def three_sizes(tp_size: int = 1) -> KVModel:
    """Full attention 16, sliding window 32, Mamba 64: hashes every 16 tokens."""
    return KVModel(MODEL, "bfloat16", (
        KVCacheGroup.full_attention(block_size=16, layer_names=_layers(0), num_kv_heads=2, head_dim=64),
        KVCacheGroup.sliding_window(window=100, block_size=32, layer_names=_layers(1, 2), num_kv_heads=2,
                                    head_dim=64),
        KVCacheGroup.mamba(block_size=64, layer_names=_layers(3, kind="mixer"), state_shapes=[(4, 32), (8,)],
                           state_dtypes=["float32", "bfloat16"]),
    ), tp_size=tp_size)


def mla_sliding(tp_size: int = 1) -> KVModel:
    """MLA block 64 and sliding-window attention block 64 (DeepSeek-V4-like)."""
    return KVModel(MODEL, "bfloat16", (
        KVCacheGroup.mla(block_size=64, layer_names=_layers(0, 1), latent_dim=576),
        KVCacheGroup.sliding_window(window=128, block_size=64, layer_names=_layers(2), num_kv_heads=4,
                                    head_dim=64),
    ), tp_size=tp_size)


LAYOUTS = {"gpt-oss-like": gpt_oss_like, "mamba-hybrid": mamba_hybrid, "three-sizes": three_sizes,
           "mla-sliding": mla_sliding}
#: Layouts kvtier accepts at TP 2 (it refuses a Mamba group with tp_size > 1).
TP2_LAYOUTS = ["gpt-oss-like", "mla-sliding"]


class ModelFacts:
    """What the offloading code reads of vLLM's ``ModelConfig`` (see the module docstring)."""

    def __init__(self, model: KVModel) -> None:
        self.model = model.model_name
        self.dtype = getattr(torch, model.dtype)
        self.use_mla = any(group.kind == "mla" for group in model.groups)
        self.max_model_len = 4096
        self._heads = max(group.num_kv_heads or 1 for group in model.groups)

    def get_total_num_kv_heads(self) -> int:
        return self._heads


def vllm_layer_spec(group: KVCacheGroup, dtype: torch.dtype, tp_size: int) -> KVCacheSpec:
    """vLLM's per-layer spec of a kvtier group (attention heads per rank, as vLLM's workers hold them)."""
    if group.kind in ("full_attention", "sliding_window"):
        assert group.num_kv_heads is not None and group.head_dim is not None
        heads = group.num_kv_heads // tp_size
        if group.kind == "full_attention":
            return FullAttentionSpec(block_size=group.block_size, num_kv_heads=heads, head_size=group.head_dim,
                                     dtype=dtype)
        return SlidingWindowSpec(block_size=group.block_size, num_kv_heads=heads, head_size=group.head_dim,
                                 dtype=dtype, sliding_window=group.window)
    if group.kind == "mla":
        return MLAAttentionSpec(block_size=group.block_size, num_kv_heads=1, head_size=group.latent_dim, dtype=dtype)
    assert group.state_shapes is not None and group.state_dtypes is not None
    return MambaSpec(block_size=group.block_size, shapes=group.state_shapes,
                     dtypes=tuple(getattr(torch, d) for d in group.state_dtypes), mamba_cache_mode="align")


@dataclass
class VllmSide:
    """vLLM's configuration objects for one kvtier model, as its scheduler builds them."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    offloading_config: OffloadingConfig
    spec: TieringOffloadingSpec


def vllm_side(model: KVModel, blocks_per_chunk: int, *, rank: int = 0, secondary_tiers: Sequence[dict[str, Any]] = (),
              kv_tp_replicas: int = 1) -> VllmSide:
    """vLLM's configuration for ``model`` on worker ``rank`` (``kv_tp_replicas``: TP ranks holding
    identical KV, as vLLM's engine core finds for a pure-MLA model)."""
    dtype = getattr(torch, model.dtype)
    mamba = any(group.kind == "mamba" for group in model.groups)
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES, "blocks_per_chunk": blocks_per_chunk,
             "secondary_tiers": [dict(t) for t in secondary_tiers]}
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=model.groups[0].block_size, enable_prefix_caching=True,
                                 mamba_cache_mode="align" if mamba else "none"),
        parallel_config=ParallelConfig(tensor_parallel_size=model.tp_size, pipeline_parallel_size=model.pp_size,
                                       rank=rank, distributed_executor_backend="mp"),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra),
    )
    object.__setattr__(config, "model_config", ModelFacts(model))
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_tp_replicas=kv_tp_replicas, kv_cache_groups=[
        KVCacheGroupSpec(list(group.layer_names), vllm_layer_spec(group, dtype, model.tp_size))
        for group in model.groups
    ])
    offloading_config = build_offloading_config(config, kv_cache_config)
    return VllmSide(config, kv_cache_config, offloading_config, TieringOffloadingSpec(offloading_config))


# ---------------------------------------------------------------- hashes and keys

@pytest.fixture
def vllm_none_hash(monkeypatch: pytest.MonkeyPatch, vllm_globals: None) -> None:
    """A fixed PYTHONHASHSEED: without it the xxhash seed is random per process."""
    monkeypatch.setenv("PYTHONHASHSEED", "kvtier-hybrid-seed")


def token_ids(n: int) -> list[int]:
    return [(i * 7919 + 13) % 50_000 for i in range(n)]


def vllm_group_keys(side: VllmSide, tokens: list[int], algorithm: str,
                    cache_salt: str | None) -> tuple[list[bytes], list[list[bytes]], ReqContext]:
    """vLLM's block hashes of a request, the offload keys of each group, and its request context."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(hash_fn)
    _, hash_block_size = kv_cache_utils.resolve_kv_cache_block_sizes(side.kv_cache_config, side.vllm_config)
    request = Request("r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                      block_hasher=kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn))
    scheduler_config = SchedulerOffloadConfig.from_spec(side.spec, side.vllm_config, side.kv_cache_config)
    ctx = ReqContext(req_id="r", kv_transfer_params=None)
    state = RequestOffloadState(config=scheduler_config, req=request, req_context=ctx,
                                offloading_context=RequestOffloadingContext())
    state.update_offload_keys()
    return list(request.block_hashes), [list(group.offload_keys) for group in state.group_states], ctx


KEY_CASES = [
    ("gpt-oss-like", 1, "sha256", None),
    ("gpt-oss-like", 2, "sha256", None),
    ("gpt-oss-like", 2, "xxhash", "tenant-7"),
    ("gpt-oss-like", 1, "sha256_cbor", "tenant-7"),
    ("mamba-hybrid", 1, "sha256", None),
    ("mamba-hybrid", 2, "sha256", "tenant-7"),
    ("mamba-hybrid", 1, "xxhash", None),
    ("mamba-hybrid", 3, "xxhash_cbor", "ünïcødé salt"),
    ("three-sizes", 1, "sha256", None),
    ("three-sizes", 2, "xxhash", "tenant-7"),
    ("mla-sliding", 1, "sha256", "tenant-7"),
    ("mla-sliding", 2, "xxhash", None),
]


@pytest.mark.parametrize(("layout", "blocks_per_chunk", "algorithm", "cache_salt"), KEY_CASES)
def test_group_keys_match_vllm(layout: str, blocks_per_chunk: int, algorithm: str, cache_salt: str | None,
                               vllm_none_hash: None) -> None:
    model = LAYOUTS[layout]()
    side = vllm_side(model, blocks_per_chunk)
    assert model.hash_block_size == side.offloading_config.cache.tokens_per_hash
    # A partial chunk at the end for every group: keys exist only for complete chunks.
    tokens = token_ids(5 * 64 * blocks_per_chunk + 17)
    hashes, expected, vllm_ctx = vllm_group_keys(side, tokens, algorithm, cache_salt)

    keying = RequestKeying(BlockHasher(algorithm, model.hash_block_size), model, blocks_per_chunk)
    extras = NO_EXTRA_KEYS if cache_salt is None else RequestExtraKeys(cache_salt=cache_salt)
    ours = keying.hashes(tokens, extras)
    assert ours == hashes
    assert len(expected) == len(model.groups)
    for g, vllm_keys in enumerate(expected):
        keys = keying.group_keys(ours, g)
        assert vllm_keys and keys == vllm_keys, f"group {g}"
        assert len(keys) == len(tokens) // model.chunk_tokens(g, blocks_per_chunk)
        # The token position each key ends at, which cache policies order by.
        ctx = RequestContext("r")
        keying.place(ctx, keys, group=g)
        assert [ctx.get_offload_key_position(k) for k in keys] == \
            [vllm_ctx.get_offload_key_position(k) for k in vllm_keys], f"group {g}"


def test_groups_with_the_same_block_size_differ_only_in_the_group_suffix(vllm_none_hash: None) -> None:
    model = gpt_oss_like()
    side = vllm_side(model, 2)
    _, (full, window), _ = vllm_group_keys(side, token_ids(200), "sha256", None)
    assert [k[:-4] for k in full] == [k[:-4] for k in window]
    keying = RequestKeying(BlockHasher("sha256", model.hash_block_size), model, 2)
    hashes = keying.hashes(token_ids(200), NO_EXTRA_KEYS)
    assert keying.group_keys(hashes, 0) == full and keying.group_keys(hashes, 1) == window


# ---------------------------------------------------------------- run fields, paths, config.json

NAMESPACE_CASES = [(layout, 1, 0) for layout in LAYOUTS] + [(layout, 2, 1) for layout in TP2_LAYOUTS]


@pytest.mark.parametrize("v2_model_runner", ["1", "0"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
@pytest.mark.parametrize(("layout", "tp_size", "rank"), NAMESPACE_CASES)
def test_run_fields_and_paths_match_file_mapper(layout: str, tp_size: int, rank: int, blocks_per_chunk: int,
                                                v2_model_runner: str, monkeypatch: pytest.MonkeyPatch,
                                                vllm_none_hash: None) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_model_runner)  # a hybrid's run is named alike under both
    model = LAYOUTS[layout](tp_size)
    side = vllm_side(model, blocks_per_chunk, rank=rank)
    # As the fs tier builds it: it asks for a shared tree, granted only to an agnostic run.
    mapper = FileMapper.from_offloading_spec(ROOT, side.spec, blocks_per_file=side.spec.blocks_per_chunk,
                                             parallel_agnostic=True)
    assert model.parallel_agnostic is side.offloading_config.parallel.is_parallelism_agnostic is False

    fields = model.run_fields(blocks_per_chunk, inference_engine="vllm")
    assert fields == mapper.get_run_config()
    assert list(fields) == list(mapper.get_run_config())  # same insertion order too
    ns = namespace(ROOT, fields, rank)
    assert ns.base_dir == mapper.base_path
    assert ns.rank == mapper.rank == rank

    _, groups, _ = vllm_group_keys(side, token_ids(3 * 64 * blocks_per_chunk), "sha256", None)
    for keys in groups:
        assert keys
        for key in keys:
            assert ns.chunk_path(key) == mapper.get_file_name(key)


def test_tp_sizes_and_ranks_get_their_own_trees() -> None:
    """A hybrid's TP size is in its digest, and its rank in the chunk tree, in both libraries."""
    names = set()
    for tp_size, rank in [(1, 0), (2, 0), (2, 1)]:
        model = gpt_oss_like(tp_size)
        mapper = FileMapper.from_offloading_spec(ROOT, vllm_side(model, 2, rank=rank).spec, blocks_per_file=2,
                                                 parallel_agnostic=True)
        ns = namespace(ROOT, model.run_fields(2, inference_engine="vllm"), rank)
        assert (ns.base_dir, ns.blocks_dir) == (mapper.base_path, f"{mapper.base_path}_r{mapper.rank}")
        names.add(ns.blocks_dir)
    assert len(names) == 3


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_config_json_is_what_vllms_fs_tier_writes(layout: str, tmp_path: Path) -> None:
    model = LAYOUTS[layout]()
    side = vllm_side(model, 2, secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}])
    manager = side.spec.get_manager()
    try:
        (config_dir,) = [p for p in tmp_path.iterdir() if (p / "config.json").exists()]
        ns = namespace(str(tmp_path), model.run_fields(2, inference_engine="vllm"), 0)
        assert str(config_dir) == ns.base_dir
        written = (config_dir / "config.json").read_text()
        assert json.loads(written) == dict(ns.fields)
        assert written == json.dumps(model.run_fields(2, inference_engine="vllm"), indent=2, sort_keys=True)
    finally:
        manager.shutdown()


# ---------------------------------------------------------------- one-group models, for contrast

def test_a_lone_full_attention_group_is_agnostic_as_in_vllms_v1_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM names a lone full-attention group's run without its topology only under the V1 model
    runner (``VLLM_USE_V2_MODEL_RUNNER=0``); kvtier's one-group model is that run at TP 1. At
    TP > 1 vLLM's ranks share one host region and write whole pages, so vLLM keeps the run
    agnostic; each kvtier engine rank persists its own heads only, so kvtier names the sizes and
    gives each rank its own tree (never vLLM's, whose files hold every head)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    for tp_size, rank in [(1, 0), (2, 1), (4, 3)]:
        model = KVModel(MODEL, "float16", (KVCacheGroup.full_attention(
            block_size=16, layer_names=_layers(0, 1, 2), num_kv_heads=8, head_dim=128),), tp_size=tp_size)
        side = vllm_side(model, 4, rank=rank)
        assert side.offloading_config.parallel.is_parallelism_agnostic is True
        mapper = FileMapper.from_offloading_spec(ROOT, side.spec, blocks_per_file=4, parallel_agnostic=True)
        fields = model.run_fields(4, inference_engine="vllm")
        ns = namespace(ROOT, fields, rank)
        if tp_size == 1:
            assert model.parallel_agnostic is True
            assert fields == mapper.get_run_config()
            assert (ns.base_dir, ns.rank) == (mapper.base_path, mapper.rank)
        else:
            assert model.parallel_agnostic is False
            assert (fields["tp_size"], fields["parallel_agnostic"]) == (tp_size, False)
            assert ns.base_dir != mapper.base_path and ns.blocks_dir.endswith(f"_r{rank}")


def test_a_lone_replicated_mla_group_shares_one_tree_as_in_vllm() -> None:
    """At TP 2 every rank holds the same latents: vLLM's replicated layout, rank 0's tree for all."""
    model = KVModel(MODEL, "bfloat16", (KVCacheGroup.mla(block_size=64, layer_names=_layers(0, 1), latent_dim=576),),
                    tp_size=2)
    side = vllm_side(model, 2, rank=1, kv_tp_replicas=2)
    assert side.offloading_config.replicated_layout
    mapper = FileMapper.from_offloading_spec(ROOT, side.spec, blocks_per_file=2, parallel_agnostic=True)
    fields = model.run_fields(2, inference_engine="vllm")
    assert fields == mapper.get_run_config()
    ns = namespace(ROOT, fields, 1)
    assert (ns.base_dir, ns.rank) == (mapper.base_path, mapper.rank) == (mapper.base_path, 0)


def test_a_lone_mla_group_at_tp_1_names_its_sizes_as_in_vllm() -> None:
    """vLLM's replicated layout needs several ranks: at TP 1 a lone MLA group's run is not agnostic."""
    model = KVModel(MODEL, "bfloat16", (KVCacheGroup.mla(block_size=64, layer_names=_layers(0, 1), latent_dim=576),))
    side = vllm_side(model, 2)
    assert not side.offloading_config.replicated_layout
    assert side.offloading_config.parallel.is_parallelism_agnostic is model.parallel_agnostic is False
    mapper = FileMapper.from_offloading_spec(ROOT, side.spec, blocks_per_file=2, parallel_agnostic=True)
    fields = model.run_fields(2, inference_engine="vllm")
    assert fields == mapper.get_run_config()
    assert (namespace(ROOT, fields, 0).base_dir, 0) == (mapper.base_path, mapper.rank)

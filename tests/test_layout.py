"""Specification of kvtier.layout: byte geometry, shard layouts, run digest and namespaces.

Digests are recomputed here from the documented construction (SHA-256 of sorted compact JSON).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.keys import make_offload_key
from kvtier.layout import KVGeometry, Namespace, namespace, run_digest
from kvtier.model import KVModel
from kvtier.tiers.fs.tree import config_path, config_text, key_from_relpath

MODEL = "meta-llama/Llama-3-8B"


def geometry(**overrides: object) -> KVGeometry:
    args: dict[str, object] = dict(
        model_name=MODEL, num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", block_size=16
    )
    args.update(overrides)
    return KVGeometry(**args)  # type: ignore[arg-type]


def expected_digest(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


# --- geometry ---------------------------------------------------------------------------------


def test_geometry_sizes() -> None:
    g = geometry()
    assert g.itemsize == 2
    assert g.page_shape == (2, 16, 8, 64)
    assert g.page_bytes == 2 * 16 * 8 * 64 * 2 == 32768
    assert g.chunk_bytes(3) == 3 * 4 * 32768
    assert g.slot_bytes(3) == g.chunk_bytes(3)  # already a multiple of 4096
    assert g.kv_bytes_per_token == 2 * 4 * 8 * 64 * 2
    assert g.kv_bytes_per_token * g.block_size * 3 == g.chunk_bytes(3)


def test_slot_bytes_round_up_to_4096() -> None:
    g = geometry(num_layers=3, num_kv_heads=1, head_dim=5, dtype="float32", block_size=7)
    assert g.chunk_bytes(1) == 3 * 2 * 7 * 5 * 4 == 840
    assert g.slot_bytes(1) == 4096
    assert g.slot_bytes(5) == 8192  # 4200 bytes


def test_page_offsets_are_block_major_then_layer() -> None:
    g = geometry()
    assert g.page_offset(0, 0) == 0
    assert g.page_offset(0, 3) == 3 * g.page_bytes
    assert g.page_offset(2, 1) == (2 * 4 + 1) * g.page_bytes
    with pytest.raises(ValueError):
        g.page_offset(0, 4)


@pytest.mark.parametrize(
    ("dtype", "name", "itemsize", "torch_dtype"),
    [
        ("half", "float16", 2, torch.float16),
        ("torch.float16", "float16", 2, torch.float16),
        ("torch.bfloat16", "bfloat16", 2, torch.bfloat16),
        ("float", "float32", 4, torch.float32),
        ("fp8", "fp8", 1, torch.uint8),
        ("fp8_e4m3", "fp8_e4m3", 1, torch.uint8),
        ("fp8_e5m2", "fp8_e5m2", 1, torch.uint8),
    ],
)
def test_dtype_names_are_normalized(dtype: str, name: str, itemsize: int, torch_dtype: torch.dtype) -> None:
    g = geometry(dtype=dtype)
    assert (g.dtype, g.itemsize, g.torch_dtype) == (name, itemsize, torch_dtype)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 0},
        {"block_size": 0},
        {"tp_size": 0},
        {"num_kv_heads": 6, "tp_size": 4},
        {"dtype": "int4"},
        {"dtype": "auto"},
        {"model_name": ""},
        {"layer_names": ["a", "b"]},
        {"num_layers": True},
    ],
)
def test_invalid_geometry_is_a_config_error(overrides: dict) -> None:
    with pytest.raises(ConfigError):
        geometry(**overrides)


# --- run fields and digest --------------------------------------------------------------------


def test_run_fields_of_a_parallel_agnostic_run() -> None:
    g = geometry(tp_size=2, pp_size=2)
    fields = g.run_fields(4, parallel_agnostic=True)  # as vLLM names it (its ranks share one region)
    assert fields == {
        "model_name": MODEL,
        "tokens_per_hash": 16,
        "blocks_per_file": 4,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "bfloat16",
        "kv_cache_groups": [
            {
                "tokens_per_block": 16,
                "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(4)],
            }
        ],
        "inference_engine": "kvtier",
    }


def test_run_fields_of_a_topology_bound_run_carry_sizes_and_flag() -> None:
    fields = geometry(tp_size=2, layer_names=("l0", "l1", "l2", "l3")).run_fields(
        2, inference_engine="vllm", parallel_agnostic=False
    )
    assert fields["tp_size"] == 2 and fields["parallel_agnostic"] is False
    assert fields["kv_cache_groups"][0]["layer_names"] == ["l0", "l1", "l2", "l3"]
    assert fields["inference_engine"] == "vllm"


def test_run_digest_is_sha256_of_sorted_compact_json() -> None:
    fields = geometry().run_fields(1)
    assert run_digest(fields) == expected_digest(fields)
    assert len(run_digest(fields)) == 12
    # Key order does not matter; every field does.
    assert run_digest(dict(reversed(list(fields.items())))) == run_digest(fields)
    assert run_digest(geometry().run_fields(2)) != run_digest(fields)


def test_run_digest_rejects_unserializable_fields() -> None:
    with pytest.raises(ConfigError):
        run_digest({"model_name": "m", "x": object()})


# --- namespace --------------------------------------------------------------------------------


def test_namespace_of_tp1_run() -> None:
    fields = geometry().run_fields(4)
    ns = namespace("/data/kv", fields, rank=0)
    digest = expected_digest(fields)
    assert ns.digest == digest
    assert ns.base_dir == f"/data/kv/meta-llama_Llama-3-8B_{digest}"
    assert ns.blocks_dir == f"/data/kv/meta-llama_Llama-3-8B_{digest}_r0"
    assert config_path(ns) == f"{ns.base_dir}/config.json"


def test_namespace_of_tp2_topology_bound_run_is_per_rank() -> None:
    fields = geometry(tp_size=2).run_fields(4, parallel_agnostic=False)
    digest = expected_digest(fields)
    manual = dict(geometry().run_fields(4), tp_size=2, parallel_agnostic=False)
    assert digest == expected_digest(manual)
    ns1 = namespace("/data/kv", fields, rank=1)
    assert ns1.blocks_dir == f"/data/kv/meta-llama_Llama-3-8B_{digest}_r1"
    assert namespace("/data/kv", fields, rank=0).blocks_dir.endswith("_r0")
    assert ns1.base_dir == f"/data/kv/meta-llama_Llama-3-8B_{digest}"


def test_parallel_agnostic_namespace_is_shared_by_all_ranks() -> None:
    g = geometry(tp_size=2)
    agnostic = [namespace("/r", g.run_fields(4, parallel_agnostic=True), rank=r) for r in range(2)]
    assert agnostic[0].blocks_dir == agnostic[1].blocks_dir
    assert agnostic[1].blocks_dir.endswith("_r0")
    assert agnostic[0].digest == expected_digest(geometry().run_fields(4))  # TP does not matter
    assert agnostic[0].digest != namespace("/r", g.run_fields(4, parallel_agnostic=False), 0).digest


def test_by_default_a_tp_rank_names_the_sizes_and_gets_a_tree_of_its_own() -> None:
    """kvtier's engine ranks each persist their own heads: at TP > 1 the default fields are not
    agnostic (those the engine uses, KVModel.run_fields), at TP 1 they are."""
    g = geometry(tp_size=2)
    assert g.run_fields(4) == g.run_fields(4, parallel_agnostic=False) == KVModel.of(g).run_fields(4)
    trees = {namespace("/r", g.run_fields(4), rank=r).blocks_dir for r in range(2)}
    assert len(trees) == 2
    assert geometry().run_fields(4) == geometry().run_fields(4, parallel_agnostic=True)


def test_empty_root_gives_relative_paths() -> None:
    fields = geometry().run_fields(1)
    ns = namespace("", fields, 0)
    assert ns.base_dir == f"meta-llama_Llama-3-8B_{expected_digest(fields)}"
    assert not ns.chunk_path(make_offload_key(bytes(16))).startswith("/")


def test_chunk_paths_shard_by_hash_prefix_and_group() -> None:
    ns = namespace("/r", geometry().run_fields(1), 0)
    h = bytes.fromhex("abcdef0123456789" * 4)
    key = make_offload_key(h, 7)
    assert ns.chunk_relpath(key) == f"abc/de_g7/{h.hex()}.bin"
    assert ns.chunk_path(key) == f"{ns.blocks_dir}/abc/de_g7/{h.hex()}.bin"


@settings(max_examples=60, deadline=None)
@given(h=st.binary(min_size=16, max_size=32), group=st.integers(0, 2**32 - 1))
def test_key_from_relpath_inverts_chunk_relpath(h: bytes, group: int) -> None:
    key = make_offload_key(h, group)
    assert key_from_relpath(Namespace.chunk_relpath(key)) == key


@settings(max_examples=60, deadline=None)
@given(hashes=st.lists(st.binary(min_size=3, max_size=60), max_size=8), lengths_vary=st.booleans(),
       groups=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=2))
def test_chunk_relpaths_are_chunk_relpath_encoded(hashes: list[bytes], lengths_vary: bool, groups: list[int]) -> None:
    width = max((len(h) for h in hashes), default=0)
    keys = [make_offload_key(h if lengths_vary else h.ljust(width, b"\0"), groups[i % len(groups)])
            for i, h in enumerate(hashes)]
    assert Namespace.chunk_relpaths(keys) == [Namespace.chunk_relpath(key).encode() for key in keys]


@pytest.mark.parametrize("keys", [[b"abcd"], [make_offload_key(b"ab")], [make_offload_key(bytes(32)), "x" * 36],
                                  [bytearray(make_offload_key(bytes(32)))]])
def test_chunk_relpaths_refuse_what_chunk_relpath_refuses(keys: list[bytes]) -> None:
    with pytest.raises((ValueError, TypeError)):
        Namespace.chunk_relpath(keys[-1])
    with pytest.raises((ValueError, TypeError)):
        Namespace.chunk_relpaths(keys)


@pytest.mark.parametrize(
    "relpath",
    [
        "abc/de_g0/abcdef0123.bin.tmp",
        "abc/de_g0/ABCDEF0123.bin",
        "abd/de_g0/abcdef0123.bin",
        "abc/df_g0/abcdef0123.bin",
        "abc/de_g01/abcdef0123.bin",
        "abc/de_g4294967296/abcdef0123.bin",
        "abc/de_g0/abcdef012.bin",
        "./abc/de_g0/abcdef0123.bin",
        "x/abc/de_g0/abcdef0123.bin",
        "abc/de_g0/abcdef0123.bin/",
        "config.json",
        "",
    ],
)
def test_key_from_relpath_rejects_malformed_paths(relpath: str) -> None:
    assert key_from_relpath(relpath) is None


def test_namespace_config_json_is_indented_and_sorted() -> None:
    fields = geometry().run_fields(2)
    ns = namespace("/r", fields, 0)
    assert config_text(ns) == json.dumps(fields, indent=2, sort_keys=True)
    assert json.loads(config_text(ns)) == fields
    fields["model_name"] = "mutated"  # the namespace keeps its own copy
    assert json.loads(config_text(ns))["model_name"] == MODEL


@pytest.mark.parametrize("model", ["model\x00x", "", "m" * 201])
def test_model_names_no_directory_entry_can_hold_are_rejected(model: str) -> None:
    fields = dict(geometry().run_fields(1), model_name=model)
    with pytest.raises(ConfigError):
        namespace("/r", fields, 0)


@pytest.mark.parametrize(
    ("model", "leaf"),
    [
        ("/models/llama-3", "_models_llama-3"),  # vLLM's name for a local model
        ("../etc", ".._etc"),
        ("a/../../b", "a_.._.._b"),
        ("..", ".."),
        ("a\\..\\b", "a\\..\\b"),
    ],
)
def test_every_model_name_stays_one_segment_inside_the_root(model: str, leaf: str) -> None:
    """As vLLM's FileMapper: "/" becomes "_", and the digest suffix makes ".." harmless."""
    ns = namespace("/r", dict(geometry().run_fields(1), model_name=model), 0)
    assert ns.base_dir == f"/r/{leaf}_{ns.digest}"
    assert ns.blocks_dir == f"/r/{leaf}_{ns.digest}_r0"
    assert os.path.dirname(os.path.normpath(ns.blocks_dir)) == "/r"


@pytest.mark.parametrize("root", ["/r/../x", "..", "pre\x00fix", "a\\b"])
def test_roots_that_could_escape_are_rejected(root: str) -> None:
    with pytest.raises(ConfigError):
        namespace(root, geometry().run_fields(1), 0)


def test_model_name_becomes_a_single_path_segment() -> None:
    ns = namespace("/r", geometry(model_name="org/sub/model").run_fields(1), 0)
    assert ns.base_dir.count("/") == 2
    assert ns.base_dir.startswith("/r/org_sub_model_")


def test_negative_rank_is_rejected() -> None:
    with pytest.raises(ConfigError):
        namespace("/r", geometry().run_fields(1), -1)

"""Specification of kvtier.config: validation, defaults, redaction, per-request parameters."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any

import pytest

from kvtier.config import (
    ENGINE_SCHEMA,
    STORE_CONFIG_SCHEMA,
    TIER_COMMON_SCHEMA,
    TIER_SCHEMAS,
    EngineConfig,
    KeySpec,
    RequestParams,
    TierConfig,
    TierFilter,
    TierMatcher,
)
from kvtier.config.schema import convert
from kvtier.errors import ConfigError, RequestError
from kvtier.types import Locality, Medium

GiB = 1 << 30
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzz"
TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token"
ACCESS = "AKIAIOSFODNN7EXAMPLE"


def tiering(*tiers: Any, **engine: Any) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": GiB,
        "secondary_tiers": list(tiers),
        **engine,
    }


def fs(**kw: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": "/var/cache/kv", **kw}


def obj(store: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    store_config = {"bucket": "kv", "endpoint_override": "127.0.0.1:9000", **(store or {})}
    return {"type": "obj", "store_config": store_config, **kw}


def p2p(**kw: Any) -> dict[str, Any]:
    return {"type": "p2p", **kw}


def memory(**kw: Any) -> dict[str, Any]:
    return {"type": "memory", "capacity_bytes": 1 << 20, **kw}


def cpu(**engine: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": GiB, **engine}


NAN = float("nan")

# (id, config, key path that must appear, value text that must appear or None)
INVALID: list[tuple[str, Any, str, str | None]] = [
    ("list_input", [("cpu_bytes_to_use", 1)], "config", None),
    ("none_input", None, "config", "None"),
    ("string_input", "cpu_bytes_to_use=1", "config", "'cpu_bytes_to_use=1'"),
    ("cpu_bytes_missing", {}, "cpu_bytes_to_use", None),
    ("cpu_bytes_zero", cpu(cpu_bytes_to_use=0), "cpu_bytes_to_use", "0"),
    ("cpu_bytes_negative", cpu(cpu_bytes_to_use=-5), "cpu_bytes_to_use", "-5"),
    ("cpu_bytes_bool", cpu(cpu_bytes_to_use=True), "cpu_bytes_to_use", "True"),
    ("cpu_bytes_float", cpu(cpu_bytes_to_use=1.5e9), "cpu_bytes_to_use", "1500000000.0"),
    ("cpu_bytes_string", cpu(cpu_bytes_to_use="1G"), "cpu_bytes_to_use", "'1G'"),
    ("unknown_engine_key", cpu(blok_size=16), "blok_size", None),
    ("block_size_and_bpc", cpu(block_size=64, blocks_per_chunk=4), "blocks_per_chunk", "4"),
    ("block_size_zero", cpu(block_size=0), "block_size", "0"),
    ("bpc_negative", cpu(blocks_per_chunk=-2), "blocks_per_chunk", "-2"),
    ("bpc_float", cpu(blocks_per_chunk=1.0), "blocks_per_chunk", "1.0"),
    ("store_threshold_tiering", tiering(store_threshold=2), "store_threshold", "2"),
    ("store_threshold_negative", cpu(store_threshold=-1), "store_threshold", "-1"),
    ("max_tracker_zero", cpu(max_tracker_size=0), "max_tracker_size", "0"),
    ("offload_prompt_only_str", cpu(offload_prompt_only="yes"), "offload_prompt_only", "'yes'"),
    ("self_describing_int", cpu(self_describing_kv_events=1), "self_describing_kv_events", "1"),
    ("spec_name_unknown", cpu(spec_name="MySpec"), "spec_name", "'MySpec'"),
    ("spec_name_empty", cpu(spec_name=""), "spec_name", "''"),
    ("spec_module_path_bad", cpu(spec_name="X", spec_module_path="not a path!"),
     "spec_module_path", "'not a path!'"),
    ("cache_policy_module_int", cpu(cache_policy_module_path=3), "cache_policy_module_path", "3"),
    ("eviction_policy_empty", cpu(eviction_policy=""), "eviction_policy", "''"),
    ("poll_interval_zero", tiering(tier_poll_interval_s=0), "tier_poll_interval_s", "0"),
    ("poll_interval_nan", tiering(tier_poll_interval_s=NAN), "tier_poll_interval_s", "nan"),
    ("sync_budget_negative", tiering(sync_load_budget_bytes=-1), "sync_load_budget_bytes", "-1"),
    ("canonical_layout_str", tiering(canonical_layout="false"), "canonical_layout", "'false'"),
    # vLLM's keys for machinery kvtier does not have: only their defaults load (a value could not act).
    ("poll_interval_not_default", tiering(tier_poll_interval_s=0.01), "tier_poll_interval_s", "0.01"),
    ("sync_budget_not_default", tiering(sync_load_budget_bytes=1 << 20), "sync_load_budget_bytes", "1048576"),
    ("canonical_layout_true", tiering(canonical_layout=True), "canonical_layout", "True"),
    ("backpressure_not_dict", tiering(backpressure="ema"), "backpressure", "'ema'"),
    ("backpressure_no_cls", tiering(backpressure={"high_water_s": 0.01}),
     "backpressure.backpressure_cls", None),
    ("backpressure_cls_int", tiering(backpressure={"backpressure_cls": 3}),
     "backpressure.backpressure_cls", "3"),
    ("backpressure_arg_list", tiering(backpressure={"backpressure_cls": "ema", "alpha": [1]}),
     "backpressure.alpha", "[1]"),
    ("tiers_not_list", {**tiering(), "secondary_tiers": "fs"}, "secondary_tiers", "'fs'"),
    ("tiers_dict", {**tiering(), "secondary_tiers": fs()}, "secondary_tiers", None),
    ("tier_not_dict", tiering(3), "secondary_tiers[0]", "3"),
    ("tier_list_entry", tiering(fs(), ["fs"]), "secondary_tiers[1]", "['fs']"),
    ("tiers_with_cpu_spec", cpu(secondary_tiers=[fs()]), "secondary_tiers", None),
    ("too_many_tiers", tiering(*[memory()] * 65), "secondary_tiers", None),
    ("tier_type_missing", tiering({"root_dir": "/x"}), "secondary_tiers[0].type", None),
    ("tier_type_unknown", tiering({"type": "s3"}), "secondary_tiers[0].type", "'s3'"),
    ("tier_type_int", tiering({"type": 5}), "secondary_tiers[0].type", "5"),
    ("tier_module_path_bad", tiering({"type": "X", "module_path": "a b"}),
     "secondary_tiers[0].module_path", "'a b'"),
    ("locality_unknown", tiering(fs(locality="nearby")), "secondary_tiers[0].locality",
     "'nearby'"),
    ("locality_int", tiering(fs(locality=1)), "secondary_tiers[0].locality", "1"),
    ("enable_kv_events_str", tiering(fs(enable_kv_events="true")),
     "secondary_tiers[0].enable_kv_events", "'true'"),
    ("tier_non_string_key", tiering({"type": "fs", "root_dir": "/x", 7: 1}),
     "secondary_tiers[0]", "7"),
    ("fs_root_missing", tiering({"type": "fs"}), "secondary_tiers[0].root_dir", None),
    ("fs_root_empty", tiering(fs(root_dir="")), "secondary_tiers[0].root_dir", "''"),
    ("fs_root_nul", tiering(fs(root_dir="/tmp/a\x00b")), "secondary_tiers[0].root_dir", "\\x00"),
    ("fs_root_list", tiering(fs(root_dir=["/a"])), "secondary_tiers[0].root_dir", "['/a']"),
    ("fs_read_threads_zero", tiering(memory(), fs(n_read_threads=0)),
     "secondary_tiers[1].n_read_threads", "0"),
    ("fs_write_threads_huge", tiering(fs(n_write_threads=2000)),
     "secondary_tiers[0].n_write_threads", "2000"),
    ("fs_read_threads_bool", tiering(fs(n_read_threads=True)),
     "secondary_tiers[0].n_read_threads", "True"),
    ("fs_max_bytes_zero", tiering(fs(max_bytes=0)), "secondary_tiers[0].max_bytes", "0"),
    ("fs_grace_negative", tiering(fs(stale_tmp_grace_s=-1)),
     "secondary_tiers[0].stale_tmp_grace_s", "-1"),
    ("fs_rescan_zero", tiering(fs(rescan_interval_s=0)),
     "secondary_tiers[0].rescan_interval_s", "0"),
    ("fs_unknown_key", tiering(fs(n_read_thread=4)), "secondary_tiers[0].n_read_thread", None),
    ("fs_obj_key", tiering(fs(io_threads=4)), "secondary_tiers[0].io_threads", None),
    ("memory_capacity_missing", tiering({"type": "memory"}),
     "secondary_tiers[0].capacity_bytes", None),
    ("memory_capacity_zero", tiering(memory(capacity_bytes=0)),
     "secondary_tiers[0].capacity_bytes", "0"),
    ("obj_store_config_missing", tiering({"type": "obj"}), "secondary_tiers[0].store_config",
     None),
    ("obj_store_config_str", tiering({"type": "obj", "store_config": "s3://kv"}),
     "secondary_tiers[0].store_config", "'s3://kv'"),
    ("obj_bucket_missing", tiering({"type": "obj", "store_config": {"endpoint_override": "h"}}),
     "secondary_tiers[0].store_config.bucket", None),
    ("obj_endpoint_missing", tiering({"type": "obj", "store_config": {"bucket": "kv"}}),
     "secondary_tiers[0].store_config.endpoint_override", None),
    ("obj_endpoint_empty", tiering(obj({"endpoint_override": ""})),
     "secondary_tiers[0].store_config.endpoint_override", "''"),
    ("obj_endpoint_with_scheme", tiering(obj({"endpoint_override": "http://h:9000"})),
     "secondary_tiers[0].store_config.endpoint_override", "'http://h:9000'"),
    ("obj_scheme_ftp", tiering(obj({"scheme": "ftp"})),
     "secondary_tiers[0].store_config.scheme", "'ftp'"),
    ("obj_store_unknown_key", tiering(obj({"buckett": "x"})),
     "secondary_tiers[0].store_config.buckett", None),
    ("obj_region_int", tiering(obj({"region": 1})), "secondary_tiers[0].store_config.region", "1"),
    ("obj_prefix_dotdot", tiering(obj(prefix="../escape")), "secondary_tiers[0].prefix",
     "'../escape'"),
    ("obj_prefix_inner_dotdot", tiering(obj(prefix="a/../b")), "secondary_tiers[0].prefix",
     "'a/../b'"),
    ("obj_prefix_nul", tiering(obj(prefix="a\x00")), "secondary_tiers[0].prefix", "\\x00"),
    ("obj_io_threads_zero", tiering(obj(io_threads=0)), "secondary_tiers[0].io_threads", "0"),
    ("obj_io_threads_huge", tiering(obj(io_threads=257)), "secondary_tiers[0].io_threads", "257"),
    ("obj_request_timeout_zero", tiering(obj(request_timeout_s=0)),
     "secondary_tiers[0].request_timeout_s", "0"),
    ("obj_lookup_timeout_str", tiering(obj(lookup_timeout_s="5")),
     "secondary_tiers[0].lookup_timeout_s", "'5'"),
    ("p2p_timeout_zero", tiering(p2p(unbound_store_timeout_s=0)),
     "secondary_tiers[0].unbound_store_timeout_s", "0"),
    ("p2p_timeout_negative", tiering(p2p(unbound_store_timeout_s=-1.5)),
     "secondary_tiers[0].unbound_store_timeout_s", "-1.5"),
    ("p2p_timeout_nan", tiering(p2p(unbound_store_timeout_s=NAN)),
     "secondary_tiers[0].unbound_store_timeout_s", "nan"),
    ("p2p_timeout_inf", tiering(p2p(unbound_store_timeout_s=math.inf)),
     "secondary_tiers[0].unbound_store_timeout_s", "inf"),
    ("p2p_timeout_str", tiering(p2p(unbound_store_timeout_s="60")),
     "secondary_tiers[0].unbound_store_timeout_s", "'60'"),
    ("p2p_port_zero", tiering(p2p(port=0)), "secondary_tiers[0].port", "0"),
    ("p2p_port_huge", tiering(p2p(port=70000)), "secondary_tiers[0].port", "70000"),
    ("p2p_backends_str", tiering(p2p(backends="UCX")), "secondary_tiers[0].backends", "'UCX'"),
    ("p2p_backends_empty", tiering(p2p(backends=[])), "secondary_tiers[0].backends", "[]"),
    ("p2p_backends_int_item", tiering(p2p(backends=["UCX", 1])),
     "secondary_tiers[0].backends[1]", "1"),
    ("p2p_num_threads_zero", tiering(p2p(num_threads=0)), "secondary_tiers[0].num_threads", "0"),
    ("p2p_host_empty", tiering(p2p(host="")), "secondary_tiers[0].host", "''"),
    ("p2p_backpressure", tiering(p2p(backpressure={"backpressure_cls": "ema"})),
     "secondary_tiers[0].backpressure", None),
    ("p2p_with_global_backpressure", tiering(fs(), p2p(), backpressure={"backpressure_cls": "e"}),
     "secondary_tiers[1]", None),
    ("tier_backpressure_without_cls", tiering(fs(backpressure={"alpha": 0.2})),
     "secondary_tiers[0].backpressure.backpressure_cls", None),
    ("tier_backpressure_none", tiering(fs(backpressure=None)),
     "secondary_tiers[0].backpressure", "None"),
]


def test_the_invalid_table_is_large_and_ids_are_unique() -> None:
    ids = [case[0] for case in INVALID]
    assert len(ids) >= 40
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("config", "path", "shown"), [c[1:] for c in INVALID],
                         ids=[c[0] for c in INVALID])
def test_invalid_config_raises_config_error_naming_key_and_value(
    config: Any, path: str, shown: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(config)
    message = str(info.value)
    assert path in message
    if shown is not None:
        assert shown in message
    assert isinstance(info.value, ValueError)


def test_config_error_message_states_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"expected an integer in 1\.\.1024"):
        EngineConfig.from_dict(tiering(fs(n_read_threads=0)))
    with pytest.raises(ConfigError, match=r"one of 'http', 'https'"):
        EngineConfig.from_dict(tiering(obj({"scheme": "ftp"})))
    with pytest.raises(ConfigError, match=r"missing required key cpu_bytes_to_use"):
        EngineConfig.from_dict({})


def test_long_values_are_truncated_in_messages() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(cpu(eviction_policy=123, spec_name="x" * 5000))
    assert len(str(info.value)) < 400


# --- defaults ---------------------------------------------------------------------------------

ENGINE_DEFAULTS = {
    "spec_name": "CPUOffloadingSpec",
    "spec_module_path": None,
    "block_size": None,
    "blocks_per_chunk": None,
    "eviction_policy": "lru",
    "cache_policy_module_path": None,
    "store_threshold": 0,
    "max_tracker_size": 64000,
    "secondary_tiers": (),
    "offload_prompt_only": True,
    "self_describing_kv_events": False,
    "tier_poll_interval_s": 0.001,
    "sync_load_budget_bytes": 0,
    "canonical_layout": False,
    "backpressure": None,
    "model_revision": None,
    "namespace_tag": None,
    "tenant_cpu_bytes": None,
}

TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "fs": {
        "root_dir": "/var/cache/kv",
        "n_read_threads": 16,
        "n_write_threads": 16,
        "max_bytes": None,
        "eviction_policy": "lru",
        "stale_tmp_grace_s": 3600.0,
        "rescan_interval_s": None,
        "accept_unverified_chunks": False,
        "file_mode": 0o600,
        "dir_mode": 0o700,
        "compression": None,
        "encryption": None,
        "tenant_bytes": None,
    },
    "memory": {"capacity_bytes": 1 << 20},
    "obj": {
        "store_config": {
            "bucket": "kv",
            "endpoint_override": "127.0.0.1:9000",
            "scheme": "http",
            "access_key": "",
            "secret_key": "",
            "session_token": "",
            "region": "",
            "ca_bundle": "",
        },
        "prefix": "",
        "io_threads": 4,
        "request_timeout_s": 10.0,
        "lookup_timeout_s": 5.0,
        "accept_unverified_chunks": False,
        "compression": None,
        "encryption": None,
    },
    "p2p": {
        "host": "localhost",
        "port": 5710,
        "backends": ("UCX",),
        "num_threads": 4,
        "unbound_store_timeout_s": 60.0,
        "max_peers": 128,
        "handshake_timeout_s": 30.0,
        "lookup_timeout_s": 30.0,
        "load_timeout_s": 30.0,
        "idle_timeout_s": 300.0,
        "auth": None,
    },
}


def test_every_engine_key_has_its_documented_default() -> None:
    config = EngineConfig.from_dict({"cpu_bytes_to_use": 4096})
    assert config.cpu_bytes_to_use == 4096
    for key, default in ENGINE_DEFAULTS.items():
        assert getattr(config, key) == default, key
    assert set(ENGINE_DEFAULTS) | {"cpu_bytes_to_use"} == set(ENGINE_SCHEMA) | {"secondary_tiers"}
    assert not config.is_tiering


@pytest.mark.parametrize("tier_type", sorted(TIER_DEFAULTS))
def test_every_tier_key_has_its_documented_default(
    tier_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_P2P_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_P2P_SIDE_CHANNEL_PORT", raising=False)
    entry = {"fs": fs(), "memory": memory(), "obj": obj(), "p2p": p2p()}[tier_type]
    tier = EngineConfig.from_dict(tiering(entry)).secondary_tiers[0]
    assert tier.type == tier_type
    assert tier.index == 0
    assert tier.module_path is None
    assert tier.locality is None
    assert tier.enable_kv_events is False
    assert tier.backpressure is None
    assert dict(tier.options) == TIER_DEFAULTS[tier_type]
    assert set(tier.options) == set(TIER_SCHEMAS[tier_type])


def test_every_schema_default_satisfies_its_own_rule() -> None:
    tables = [ENGINE_SCHEMA, TIER_COMMON_SCHEMA, STORE_CONFIG_SCHEMA, *TIER_SCHEMAS.values()]
    for table in tables:
        for key, spec in table.items():
            assert spec.describe()
            if spec.required or spec.env_default is not None or spec.default is None:
                continue
            assert convert(spec, spec.default, key) == spec.default, key


def test_p2p_host_and_port_default_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_HOST", "10.0.0.7")
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "6000")
    tier = EngineConfig.from_dict(tiering(p2p())).secondary_tiers[0]
    assert (tier.options["host"], tier.options["port"]) == ("10.0.0.7", 6000)
    explicit = EngineConfig.from_dict(tiering(p2p(host="h", port=7000))).secondary_tiers[0]
    assert (explicit.options["host"], explicit.options["port"]) == ("h", 7000)


def test_invalid_p2p_port_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "not-a-port")
    with pytest.raises(ConfigError, match=r"\$VLLM_P2P_SIDE_CHANNEL_PORT") as info:
        EngineConfig.from_dict(tiering(p2p()))
    assert "secondary_tiers[0].port" in str(info.value)
    assert "'not-a-port'" in str(info.value)


# --- valid configs --------------------------------------------------------------------------


def test_full_fs_tier_config_is_normalised() -> None:
    config = EngineConfig.from_dict(tiering(fs(
        n_read_threads=8, n_write_threads=4, max_bytes=10 * GiB, eviction_policy="arc",
        stale_tmp_grace_s=0, rescan_interval_s=5, locality="remote", enable_kv_events=True,
        backpressure={"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.01},
    ), block_size=256, eviction_policy="arc", offload_prompt_only=False,
        self_describing_kv_events=True, tier_poll_interval_s=0.001, sync_load_budget_bytes=0,
        canonical_layout=False, store_threshold=1, max_tracker_size=10))
    tier = config.secondary_tiers[0]
    assert config.is_tiering
    assert config.block_size == 256 and config.blocks_per_chunk is None
    assert tier.locality is Locality.REMOTE
    assert tier.enable_kv_events is True
    assert tier.label == "1:fs"
    assert tier.options["stale_tmp_grace_s"] == 0.0
    assert isinstance(tier.options["stale_tmp_grace_s"], float)  # ints accepted where floats are
    assert tier.options["max_bytes"] == 10 * GiB
    assert dict(tier.backpressure or {})["high_water_s"] == 0.01


def test_full_obj_tier_config_is_normalised() -> None:
    config = EngineConfig.from_dict(tiering(obj(
        {"scheme": "HTTPS", "access_key": ACCESS, "secret_key": SECRET, "session_token": TOKEN,
         "region": "eu-west-1", "ca_bundle": "/etc/ssl/ca.pem"},
        prefix="team/a", io_threads=16, request_timeout_s=2.5, lookup_timeout_s=1,
        locality="LOCAL",
    )))
    tier = config.secondary_tiers[0]
    store = tier.options["store_config"]
    assert store["scheme"] == "https"
    assert store["secret_key"] == SECRET  # the tier gets the real credential
    assert store["region"] == "eu-west-1"
    assert tier.options["prefix"] == "team/a"
    assert tier.options["lookup_timeout_s"] == 1.0
    assert tier.locality is Locality.LOCAL


def test_full_p2p_and_memory_tier_configs_are_normalised() -> None:
    config = EngineConfig.from_dict(tiering(
        memory(capacity_bytes=123, locality="Local"),
        p2p(host="10.1.2.3", port=6000, backends=["ucx"], num_threads=8,
            unbound_store_timeout_s=5, max_peers=4, load_timeout_s=2,
            auth={"curve_secret_key_file": "/k/me.key_secret", "curve_public_key_file": "/k/me.key",
                  "trusted_public_keys_dir": "/k/trusted"}),
    ))
    mem, peer = config.secondary_tiers
    assert mem.options == {"capacity_bytes": 123}
    assert mem.locality is Locality.LOCAL
    assert peer.label == "2:p2p"
    assert peer.options["backends"] == ("ucx",)
    assert peer.options["unbound_store_timeout_s"] == 5.0
    assert peer.options["max_peers"] == 4 and peer.options["load_timeout_s"] == 2.0
    assert peer.options["auth"]["trusted_public_keys_dir"] == "/k/trusted"


@pytest.mark.parametrize(("entry", "key"), [
    ({"backends": ["UCX", "GDS"]}, "backends"),  # only UCX moves kvtier's bytes: not accepted and ignored
    ({"max_peers": 0}, "max_peers"),
    ({"load_timeout_s": 0}, "load_timeout_s"),
    ({"idle_timeout_s": -1}, "idle_timeout_s"),
    ({"auth": {"curve_secret_key_file": "/a"}}, "auth.curve_public_key_file"),
    ({"auth": {"curve_secret_key_file": "/a", "curve_public_key_file": "/b", "trusted_public_keys_dir": "/c",
               "extra": 1}}, "auth.extra"),
])
def test_bad_p2p_keys_are_config_errors_naming_the_key(entry: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"secondary_tiers[0].{key}")):
        EngineConfig.from_dict(tiering(p2p(**entry)))


def test_p2p_env_defaults_for_the_new_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_P2P_MAX_PEERS", "7")
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("VLLM_P2P_IDLE_TIMEOUT_S", "0")
    tier = EngineConfig.from_dict(tiering(p2p())).secondary_tiers[0]
    assert (tier.options["max_peers"], tier.options["handshake_timeout_s"], tier.options["idle_timeout_s"]) == (7, 2.5, 0.0)
    monkeypatch.setenv("VLLM_P2P_MAX_PEERS", "many")
    with pytest.raises(ConfigError, match="VLLM_P2P_MAX_PEERS"):
        EngineConfig.from_dict(tiering(p2p()))


def test_out_of_tree_tier_keys_pass_through_unvalidated() -> None:
    entry = {"type": "RedisTier", "module_path": "my_pkg.tiers", "url": "redis://x", "n": [1, 2],
             "locality": "remote"}
    tier = EngineConfig.from_dict(tiering(entry)).secondary_tiers[0]
    assert tier.type == "RedisTier" and tier.module_path == "my_pkg.tiers"
    assert dict(tier.options) == {"url": "redis://x", "n": [1, 2]}
    assert tier.locality is Locality.REMOTE
    assert not tier.is_builtin


def test_custom_spec_with_module_path_is_accepted_and_tiering_when_it_has_tiers() -> None:
    config = EngineConfig.from_dict(tiering(fs(), spec_name="MySpec", spec_module_path="pkg.spec"))
    assert config.is_tiering and config.spec_module_path == "pkg.spec"
    bare = EngineConfig.from_dict(cpu(spec_name="MySpec", spec_module_path="pkg.spec"))
    assert not bare.is_tiering


def test_store_threshold_up_to_one_is_allowed_with_tiering_and_any_with_cpu_spec() -> None:
    assert EngineConfig.from_dict(tiering(store_threshold=1)).store_threshold == 1
    assert EngineConfig.from_dict(cpu(store_threshold=5)).store_threshold == 5


def test_null_optional_keys_mean_not_given() -> None:
    config = EngineConfig.from_dict(tiering(fs(locality=None, module_path=None, max_bytes=None),
                                            secondary_tiers=None, block_size=None))
    assert config.secondary_tiers == ()


def test_to_dict_round_trips_through_from_dict() -> None:
    config = EngineConfig.from_dict(tiering(fs(locality="remote"), obj(prefix="p"), p2p(port=1),
                                            memory(), blocks_per_chunk=2))
    again = EngineConfig.from_dict(config.to_dict())
    assert again == config
    assert again.to_dict() == config.to_dict()


def test_coerce_returns_configs_unchanged_and_parses_mappings() -> None:
    config = EngineConfig.from_dict(cpu())
    assert EngineConfig.coerce(config) is config
    assert EngineConfig.coerce(cpu()) == config
    with pytest.raises(ConfigError):
        EngineConfig.coerce([1, 2])  # type: ignore[arg-type]


def test_config_objects_are_frozen() -> None:
    config = EngineConfig.from_dict(tiering(fs()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cpu_bytes_to_use = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.secondary_tiers[0].type = "obj"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.secondary_tiers[0].options["root_dir"] = "/"  # type: ignore[index]


def test_backpressure_merges_tier_fields_over_top_level() -> None:
    config = EngineConfig.from_dict(tiering(
        fs(backpressure={"high_water_s": 0.5}), obj(),
        backpressure={"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.1},
    ))
    first, second = (config.backpressure_for(t) for t in config.secondary_tiers)
    assert first == {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.5}
    assert second == {"backpressure_cls": "EMABackpressureDetector", "high_water_s": 0.1}
    plain = EngineConfig.from_dict(tiering(fs()))
    assert plain.backpressure_for(plain.secondary_tiers[0]) is None


# --- derived values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "device_block_size", "expected"),
    [({}, 16, 1), ({"blocks_per_chunk": 3}, 16, 3), ({"block_size": 64}, 16, 4),
     ({"block_size": 16}, 16, 1)],
)
def test_resolve_blocks_per_chunk(extra: dict[str, int], device_block_size: int,
                                  expected: int) -> None:
    assert EngineConfig.from_dict(cpu(**extra)).resolve_blocks_per_chunk(device_block_size) == (
        expected
    )


def test_resolve_blocks_per_chunk_rejects_block_size_not_multiple_of_device_block() -> None:
    config = EngineConfig.from_dict(cpu(block_size=40))
    with pytest.raises(ConfigError, match=r"block_size = 40.*multiple.*16"):
        config.resolve_blocks_per_chunk(16)
    with pytest.raises(ConfigError, match="device_block_size"):
        config.resolve_blocks_per_chunk(0)


def test_num_slots_is_whole_slots_of_cpu_bytes() -> None:
    assert EngineConfig.from_dict(cpu(cpu_bytes_to_use=10_000)).num_slots(4096) == 2
    assert EngineConfig.from_dict(cpu(cpu_bytes_to_use=4096)).num_slots(4096) == 1


def test_num_slots_below_one_slot_is_a_config_error() -> None:
    config = EngineConfig.from_dict(cpu(cpu_bytes_to_use=4000))
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use = 4000.*4096"):
        config.num_slots(4096)
    with pytest.raises(ConfigError, match="slot_bytes"):
        config.num_slots(0)


# --- secrets --------------------------------------------------------------------------------


def secret_obj(**store: Any) -> dict[str, Any]:
    return obj({"access_key": ACCESS, "secret_key": SECRET, "session_token": TOKEN, **store})


def assert_no_secret(text: str) -> None:
    for secret in (SECRET, TOKEN, ACCESS):
        assert secret not in text
        assert secret[:12] not in text


@pytest.mark.parametrize(
    "config",
    [
        tiering(secret_obj(bucket="")),                      # neighbour key invalid
        tiering(secret_obj(scheme="gopher")),
        tiering(secret_obj(endpoint_override="")),
        tiering(secret_obj(), io_threads=0),
        tiering({**secret_obj(), "io_threads": 0}),          # sibling of store_config invalid
        tiering(secret_obj(secret_kye=SECRET)),             # misspelt key: value never shown
        tiering(obj({"secret_key": 12345678901234567890, "session_token": TOKEN})),
        {**tiering(), "secondary_tiers": secret_obj()},      # whole dict shown as bad value
        tiering([secret_obj()]),                             # tier entry is a list
        cpu(secondary_tiers=[secret_obj()]),                 # tiers with the CPU spec
        tiering(secret_obj(), store_threshold=3),
    ],
    ids=["bucket", "scheme", "endpoint", "io_threads_kw", "io_threads", "misspelt", "secret_int",
         "tiers_dict", "tier_list", "cpu_spec", "threshold"],
)
def test_secrets_never_appear_in_error_messages(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(config)
    assert_no_secret(str(info.value))
    assert "12345678901234567890" not in str(info.value)


def test_wrong_type_secret_is_shown_as_stars() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(tiering(obj({"secret_key": 1234567})))
    assert "secondary_tiers[0].store_config.secret_key" in str(info.value)
    assert "'***'" in str(info.value) and "1234567" not in str(info.value)


def test_secrets_never_appear_in_repr_str_or_to_dict() -> None:
    config = EngineConfig.from_dict(tiering(secret_obj(), fs()))
    tier = config.secondary_tiers[0]
    texts = [repr(config), str(config), repr(tier), str(tier), repr(tier.options),
             str(tier.options), repr(tier.options["store_config"]), repr(config.to_dict()),
             repr(tier.to_dict())]
    for text in texts:
        assert_no_secret(text)
    assert "'***'" in repr(tier)
    assert config.to_dict()["secondary_tiers"][0]["store_config"]["secret_key"] == "***"
    assert tier.options["store_config"]["access_key"] == ACCESS


def test_out_of_tree_tier_secrets_are_redacted_in_repr() -> None:
    entry = {"type": "Vault", "module_path": "pkg.vault", "secret_key": SECRET}
    config = EngineConfig.from_dict(tiering(entry))
    assert_no_secret(repr(config))
    assert config.secondary_tiers[0].options["secret_key"] == SECRET


# --- did you mean ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "suggestion"),
    [
        (cpu(blok_size=16), "'block_size'"),
        (cpu(cpu_byte_to_use=1), "'cpu_bytes_to_use'"),
        (tiering(fs(n_read_thread=4)), "'n_read_threads'"),
        (tiering(obj({"secret_kye": SECRET})), "'secret_key'"),
        (tiering(p2p(unbound_store_timeout=3)), "'unbound_store_timeout_s'"),
        (tiering({"type": "fss", "root_dir": "/x"}), "'fs'"),
        (tiering(spec_name="TieringOffloadSpec"), "'TieringOffloadingSpec'"),
        (tiering(fs(localty="LOCAL")), "'locality'"),
    ],
)
def test_unknown_names_get_a_did_you_mean_suggestion(config: dict[str, Any],
                                                     suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        EngineConfig.from_dict(config)


def test_no_suggestion_when_nothing_is_close() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(cpu(zzzzzz=1))
    assert "did you mean" not in str(info.value)
    assert "allowed keys" in str(info.value)


# --- per-request parameters --------------------------------------------------------------------


def test_request_params_default_is_no_caps_all_tiers_no_roles() -> None:
    for params in (RequestParams(), RequestParams.from_kv_transfer_params(None),
                   RequestParams.from_kv_transfer_params({})):
        assert params.max_load_tokens is None and params.max_offload_tokens is None
        assert params.load_tier_filter is TierFilter.ALL
        assert params.remote_decoder is params.remote_prefiller is params.remote_kv_source is None


def test_request_params_unknown_keys_are_ignored_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({"do_remote_prefill": True, "x": [1]})
    assert params == RequestParams()
    assert caplog.records == []


def test_request_params_non_mapping_warns_and_uses_defaults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params([1])  # type: ignore[arg-type]
    assert params == RequestParams()
    assert len(caplog.records) == 1


@pytest.mark.parametrize("key", ["max_load_tokens", "max_offload_tokens"])
@pytest.mark.parametrize("value", [0, 1, 4096])
def test_token_caps_accept_non_negative_ints(key: str, value: int,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({key: value})
    assert getattr(params, key) == value
    assert caplog.records == []


@pytest.mark.parametrize("key", ["max_load_tokens", "max_offload_tokens"])
@pytest.mark.parametrize("value", [True, False, -1, 1.5, 16.0, "16", [16]])
def test_bad_token_caps_warn_and_mean_no_cap(key: str, value: Any,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({key: value})
    assert getattr(params, key) is None
    assert len(caplog.records) == 1
    assert key in caplog.records[0].getMessage()
    assert caplog.records[0].name == "kvtier.config"


def test_null_max_offload_tokens_is_no_cap_without_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({"max_offload_tokens": None})
    assert params.max_offload_tokens is None and caplog.records == []


PEER = {"kv_request_id": "req-1", "remote_host": "10.0.0.2", "remote_port": 5710}


@pytest.mark.parametrize(
    "params",
    [
        {"remote_decoder": {"kv_request_id": "req-1"}},
        {"remote_prefiller": PEER},
        {"remote_kv_source": PEER},
        {"remote_decoder": {"kv_request_id": "req-1"}, "remote_kv_source": PEER},
        {"remote_prefiller": PEER, "remote_decoder": None},
    ],
)
def test_allowed_role_combinations_are_parsed(params: dict[str, Any]) -> None:
    parsed = RequestParams.from_kv_transfer_params(params)
    for key in ("remote_decoder", "remote_prefiller", "remote_kv_source"):
        if params.get(key) is None:
            assert getattr(parsed, key) is None
        else:
            assert getattr(parsed, key) == params[key]


@pytest.mark.parametrize(
    "params",
    [
        {"remote_prefiller": PEER, "remote_decoder": {"kv_request_id": "a"}},
        {"remote_prefiller": PEER, "remote_kv_source": PEER},
        {"remote_prefiller": PEER, "remote_kv_source": PEER,
         "remote_decoder": {"kv_request_id": "a"}},
    ],
    ids=["prefiller+decoder", "prefiller+kv_source", "all_three"],
)
def test_forbidden_role_combinations_raise_request_error(params: dict[str, Any]) -> None:
    with pytest.raises(RequestError, match="remote_prefiller"):
        RequestParams.from_kv_transfer_params(params)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_decoder", "req-1"),
        ("remote_decoder", {}),
        ("remote_decoder", {"kv_request_id": 7}),
        ("remote_decoder", {"kv_request_id": ""}),
        ("remote_prefiller", {**PEER, "remote_port": True}),
        ("remote_prefiller", {**PEER, "remote_port": 0}),
        ("remote_prefiller", {**PEER, "remote_port": "5710"}),
        ("remote_kv_source", {**PEER, "remote_host": 10}),
        ("remote_kv_source", {**PEER, "remote_host": "a b"}),
        ("remote_kv_source", {"kv_request_id": "r", "remote_host": "h"}),
    ],
)
def test_malformed_role_dicts_warn_and_are_dropped(key: str, value: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({key: value})
    assert getattr(params, key) is None
    assert len(caplog.records) == 1 and key in caplog.records[0].getMessage()


def test_role_dicts_keep_only_their_validated_fields() -> None:
    params = RequestParams.from_kv_transfer_params({"remote_kv_source": {**PEER, "extra": 1}})
    assert params.remote_kv_source == PEER


# --- kv_load_tiers -> TierFilter ---------------------------------------------------------------

# (index, type, medium, locality) of a typical tier list
TIERS = [
    (0, "fs", Medium.STORAGE, Locality.LOCAL),
    (1, "obj", Medium.STORAGE, Locality.REMOTE),
    (2, "p2p", None, None),
    (3, "memory", Medium.CPU, None),
]


def allowed(value: Any) -> list[str]:
    filt = RequestParams.from_kv_transfer_params({"kv_load_tiers": value}).load_tier_filter
    return [name for index, name, medium, loc in TIERS if filt.allows(index, name, medium, loc)]


@pytest.mark.parametrize(
    ("kv_load_tiers", "expected"),
    [
        ([{"medium": "storage"}], ["fs", "obj", "p2p"]),
        ([{}], ["fs", "obj", "p2p", "memory"]),
        ([{"medium": "storage", "locality": "local"}], ["fs", "p2p"]),
        ([{"medium": "cpu"}, {"medium": "storage"}], ["fs", "obj", "p2p", "memory"]),
        ([{"locality": "REMOTE"}], ["obj", "p2p", "memory"]),
        ([], []),
        ([1], ["obj"]),
        ([0, 2], ["fs", "p2p"]),
        (["fs"], ["fs"]),
        (["FS", "memory"], ["fs", "memory"]),
        (["2:obj"], ["obj"]),
        (["1:obj"], []),
        ([7], []),
    ],
)
def test_kv_load_tiers_forms_select_tiers(kv_load_tiers: list[Any], expected: list[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        assert allowed(kv_load_tiers) == expected
    assert caplog.records == []


@pytest.mark.parametrize("value", ["fs", 0, {"medium": "storage"}])
def test_kv_load_tiers_not_a_list_is_all_with_warning(value: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        filt = RequestParams.from_kv_transfer_params({"kv_load_tiers": value}).load_tier_filter
    assert filt is TierFilter.ALL
    assert len(caplog.records) == 1


def test_kv_load_tiers_invalid_entries_are_skipped_with_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entries = [0, "no spaces allowed", {"medium": "gpu"}, {"locality": "moon"}, True, -1, 1.5,
               {"medium": "cpu", "tier": 1}]
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        assert allowed(entries) == ["fs"]
    assert len(caplog.records) == len(entries) - 1


def test_kv_load_tiers_all_invalid_is_all(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        filt = TierFilter.from_kv_load_tiers([{"medium": "gpu"}, None])
    assert filt is TierFilter.ALL
    assert len(caplog.records) == 3  # two entries + the fallback


def test_tier_filter_all_and_empty() -> None:
    assert all(TierFilter.ALL.allows(*tier) for tier in TIERS)
    assert not any(TierFilter().allows(*tier) for tier in TIERS)


def test_tier_matcher_treats_unknown_tier_axes_as_matching() -> None:
    matcher = TierMatcher(Medium.STORAGE, Locality.LOCAL)
    assert matcher.matches(None, None)
    assert matcher.matches(Medium.STORAGE, None)
    assert not matcher.matches(Medium.CPU, None)
    assert not matcher.matches(None, Locality.REMOTE)


def test_key_spec_describes_ranges_in_words() -> None:
    assert KeySpec("int", ge=1, le=1024).describe() == "an integer in 1..1024"
    assert KeySpec("float", gt=0).describe() == "a finite number > 0"
    assert KeySpec("int", default=None, nullable=True, gt=0).describe() == (
        "an integer > 0, or null"
    )


def test_tier_config_label_is_one_based_index_and_type() -> None:
    assert TierConfig(index=2, type="obj").label == "3:obj"

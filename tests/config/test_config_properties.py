"""Property tests of configuration and per-request parsing (kvtier/config/).

Whatever a user or a request puts in the dictionaries, parsing either succeeds with values inside
the documented ranges or fails with the documented error type naming a key — never another
exception, never a value that was accepted and then ignored.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import TIER_SCHEMAS, EngineConfig, RequestParams
from kvtier.errors import ConfigError, RequestError

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)

ENGINE_KEYS = ["spec_name", "cpu_bytes_to_use", "block_size", "blocks_per_chunk", "eviction_policy",
               "store_threshold", "max_tracker_size", "offload_prompt_only", "self_describing_kv_events",
               "secondary_tiers", "cache_policy_module_path", "spec_module_path"]
TIER_TYPES = sorted(TIER_SCHEMAS)


def plausible(key: str) -> st.SearchStrategy[Any]:
    """Values near the valid ones for ``key`` (so parsing gets past the first check), or anything."""
    near = {
        "spec_name": st.sampled_from(["CPUOffloadingSpec", "TieringOffloadingSpec", "", "Nope"]),
        "cpu_bytes_to_use": st.integers(min_value=-5, max_value=1 << 40),
        "block_size": st.one_of(st.none(), st.integers(min_value=-2, max_value=64)),
        "blocks_per_chunk": st.one_of(st.none(), st.integers(min_value=-2, max_value=8)),
        "eviction_policy": st.sampled_from(["lru", "arc", "LRU", "", "fifo"]),
        "store_threshold": st.integers(min_value=-1, max_value=3),
        "offload_prompt_only": st.booleans(),
    }.get(key)
    return values if near is None else st.one_of(near, values)


@st.composite
def tier_entries(draw: st.DrawFn) -> dict[str, Any]:
    tier_type = draw(st.sampled_from(TIER_TYPES + ["bogus"]))
    entry: dict[str, Any] = {"type": tier_type}
    schema = TIER_SCHEMAS.get(tier_type, {})
    for key in draw(st.lists(st.sampled_from(sorted(schema) or ["x"]), max_size=4, unique=True)):
        entry[key] = draw(values)
    if draw(st.booleans()):
        entry[draw(st.text(max_size=6))] = draw(values)
    return entry


@st.composite
def engine_dicts(draw: st.DrawFn) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(ENGINE_KEYS), max_size=6, unique=True)):
        raw[key] = draw(st.lists(tier_entries(), max_size=3)) if key == "secondary_tiers" else draw(plausible(key))
    if draw(st.booleans()):
        raw[draw(st.text(max_size=10))] = draw(values)
    return raw


@PROPERTY
@given(engine_dicts())
def test_any_engine_dict_parses_or_is_a_config_error_naming_a_key(raw: dict[str, Any]) -> None:
    try:
        config = EngineConfig.from_dict(raw)
    except ConfigError as exc:
        assert str(exc)  # the message names the key path (checked by tests/config/test_config.py per key)
        return
    assert isinstance(config.cpu_bytes_to_use, int) and config.cpu_bytes_to_use > 0
    assert config.store_threshold >= 0
    for tier in config.secondary_tiers:
        assert tier.type == raw["secondary_tiers"][tier.index]["type"]


@PROPERTY
@given(st.one_of(st.none(), values, st.dictionaries(
    st.sampled_from(["max_load_tokens", "max_offload_tokens", "kv_load_tiers", "remote_decoder",
                     "remote_prefiller", "remote_kv_source", "other"]),
    values, max_size=5)))
def test_any_kv_transfer_params_parse_to_documented_values_or_a_request_error(params: Any) -> None:
    try:
        parsed = RequestParams.from_kv_transfer_params(params)
    except RequestError as exc:
        assert "forbidden combination" in str(exc)
        return
    for cap in (parsed.max_load_tokens, parsed.max_offload_tokens):
        assert cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0)
    if isinstance(params, dict):
        raw_cap = params.get("max_load_tokens")
        if isinstance(raw_cap, int) and not isinstance(raw_cap, bool) and raw_cap >= 0:
            assert parsed.max_load_tokens == raw_cap  # a valid value is never dropped
    filt = parsed.load_tier_filter
    assert filt.allow_all or all(i >= 0 for i in filt.indexes)


@pytest.mark.parametrize("tier_type", ["fs", "obj"])
def test_accept_unverified_chunks_takes_only_a_boolean(tier_type: str) -> None:
    entry: dict[str, Any] = {"type": tier_type, "accept_unverified_chunks": "yes"}
    if tier_type == "fs":
        entry["root_dir"] = "/tmp/x"
    else:
        entry["store_config"] = {"bucket": "b", "endpoint_override": "127.0.0.1:9"}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.accept_unverified_chunks"):
        EngineConfig.from_dict({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                                "secondary_tiers": [entry]})
    entry["accept_unverified_chunks"] = True
    config = EngineConfig.from_dict({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                                     "secondary_tiers": [entry]})
    assert config.secondary_tiers[0].options["accept_unverified_chunks"] is True

"""The keys of shared caches: manifest, tenant budgets, file modes, compression, encryption."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config.engine import EngineConfig
from kvtier.errors import ConfigError

FS = {"type": "fs", "root_dir": "/var/cache/kv"}
OBJ = {"type": "obj", "store_config": {"bucket": "kv", "endpoint_override": "127.0.0.1:9000"}}


def tiering(**tier: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 1 << 30, "spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}


def test_manifest_keys_are_kept_as_given() -> None:
    config = EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 30, "model_revision": "refs/pr/7 abc",
                                     "namespace_tag": "prod.v2_a-1"})
    assert (config.model_revision, config.namespace_tag) == ("refs/pr/7 abc", "prod.v2_a-1")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("model_revision", "", "non-empty"),
    ("model_revision", "a\nb", "printable"),
    ("model_revision", "x" * 257, "256"),
    ("namespace_tag", "a/b", "letters, digits"),
    ("namespace_tag", "x" * 65, "64"),
    ("namespace_tag", 7, "string"),
])
def test_bad_manifest_values_are_refused(key: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=key) as info:
        EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 30, key: value})
    assert words in str(info.value)


def test_tenant_budgets_parse() -> None:
    config = EngineConfig.from_dict({**tiering(**FS, tenant_bytes={"a": 10, "default": 5}),
                                     "tenant_cpu_bytes": {"alice": 1 << 20, "b.2_x-y": 3}})
    assert dict(config.tenant_cpu_bytes or {}) == {"alice": 1 << 20, "b.2_x-y": 3}
    assert dict(config.secondary_tiers[0].options["tenant_bytes"]) == {"a": 10, "default": 5}


@pytest.mark.parametrize(("budgets", "words"), [
    ({"Alice": 1}, "invalid tenant label 'Alice'"),
    ({"-a": 1}, "invalid tenant label"),
    ({"a" * 33: 1}, "invalid tenant label"),
    ({"a": 0}, "tenant_cpu_bytes.a = 0"),
    ({"a": True}, "tenant_cpu_bytes.a"),
    ({}, "tenant_cpu_bytes"),
    ({f"t{i}": 1 for i in range(65)}, "at most 64"),
    ([1, 2], "tenant_cpu_bytes"),
])
def test_bad_tenant_budgets_are_refused(budgets: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 30, "tenant_cpu_bytes": budgets})
    assert words in str(info.value)


def test_tenant_budgets_are_refused_where_no_eviction_keeps_them() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].tenant_bytes.*no tenant_bytes on the obj tier"):
        EngineConfig.from_dict(tiering(**OBJ, tenant_bytes={"a": 1}))


def test_file_modes_default_to_owner_only_and_take_octal_strings() -> None:
    options = EngineConfig.from_dict(tiering(**FS)).secondary_tiers[0].options
    assert (options["file_mode"], options["dir_mode"]) == (0o600, 0o700)
    options = EngineConfig.from_dict(tiering(**FS, file_mode="0640", dir_mode="0o750")).secondary_tiers[0].options
    assert (options["file_mode"], options["dir_mode"]) == (0o640, 0o750)
    options = EngineConfig.from_dict(tiering(**FS, file_mode=0o660, dir_mode=0o770)).secondary_tiers[0].options
    assert (options["file_mode"], options["dir_mode"]) == (0o660, 0o770)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("file_mode", 0o644, "(within 0o660); got 0o644"),
    ("file_mode", 0o400, "owner read and write"),
    ("file_mode", 0o700, "got 0o700"),
    ("file_mode", "rw-r-----", "octal string"),
    ("file_mode", "0999", "octal string"),
    ("dir_mode", 0o755, "(within 0o770); got 0o755"),
    ("dir_mode", 0o760, "group search"),
    ("dir_mode", 0o600, "owner rwx"),
    ("dir_mode", -1, "permission bits"),
])
def test_bad_modes_are_refused(key: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\]\.{key}") as info:
        EngineConfig.from_dict(tiering(**FS, **{key: value}))
    assert words in str(info.value)


@pytest.mark.parametrize("tier", [FS, OBJ])
def test_codec_keys_fill_their_defaults(tier: dict[str, Any]) -> None:
    options = EngineConfig.from_dict(tiering(**tier, compression={}, encryption={"key_file": "/k", "key_id": 3})
                                     ).secondary_tiers[0].options
    assert dict(options["compression"]) == {"codec": "zstd", "level": 1, "transform": "byte_planes"}
    assert dict(options["encryption"]) == {"key_file": "/k", "key_id": 3}


@pytest.mark.parametrize(("section", "value", "words"), [
    ("compression", {"codec": "lz4"}, "compression.codec"),
    ("compression", {"level": 23}, "compression.level"),
    ("compression", {"transform": "shuffle"}, "compression.transform"),
    ("compression", {"levle": 3}, "did you mean 'level'"),
    ("encryption", {"key_id": 1}, "encryption.key_file"),
    ("encryption", {"key_file": "/k"}, "encryption.key_id"),
    ("encryption", {"key_file": "/k", "key_id": 0}, "encryption.key_id"),
    ("encryption", {"key": "00" * 32, "key_file": "/k", "key_id": 1}, "unknown key"),
])
def test_bad_codec_values_are_refused(section: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(tiering(**FS, **{section: value}))
    assert words in str(info.value)
    assert "00" * 32 not in str(info.value)  # a key pasted into the config is never echoed


@pytest.mark.parametrize(("key", "value"), [("namespace_tag", "tag\n"), ("tenant_cpu_bytes", {"a\n": 1})])
def test_a_trailing_newline_is_not_a_valid_label(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        EngineConfig.from_dict({"cpu_bytes_to_use": 1 << 30, key: value})


def test_unverified_chunks_cannot_be_accepted_by_a_tier_that_encrypts() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.accept_unverified_chunks.*encrypts"):
        EngineConfig.from_dict(tiering(**FS, accept_unverified_chunks=True, encryption={"key_file": "/k", "key_id": 1}))
    # Decrypt-only (key_id null) writes plain chunks and may read trailer-less ones.
    EngineConfig.from_dict(tiering(**FS, accept_unverified_chunks=True, encryption={"key_file": "/k", "key_id": None}))

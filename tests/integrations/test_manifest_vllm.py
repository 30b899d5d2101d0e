"""The compatibility manifest inside vLLM: ``model_revision`` and ``namespace_tag`` at the top level
of ``kv_connector_extra_config`` move kvtier's tiers to a namespace of their own; without them
the namespace is vLLM's exact one (tests/integrations/test_vllm_adapter.py checks that tree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import Driver, chunk_keys, payload, tiering_spec
from vllm.v1.kv_offload.file_mapper import FileMapper

import kvtier
from kvtier.integrations.vllm import register
from kvtier.layout import run_digest

register()

ROW = 64 * 1024  # the harness's row (slot) size


def store(root: Path, keys: list[bytes], **extra: object) -> None:
    d = Driver(tiering_spec([{"type": "kvtier_fs", "root_dir": str(root)}], **extra))
    try:
        d.store(keys)
    finally:
        d.shutdown()


def load(root: Path, keys: list[bytes], **extra: object) -> list[bytes | None]:
    d = Driver(tiering_spec([{"type": "kvtier_fs", "root_dir": str(root)}], **extra))
    try:
        return d.load(keys)
    finally:
        d.shutdown()


def run_configs(root: Path) -> dict[str, dict]:
    return {p.name: json.loads((p / "config.json").read_text()) for p in root.iterdir() if (p / "config.json").exists()}


def test_a_revision_is_a_namespace_of_its_own_and_absent_is_vllms(tmp_path: Path) -> None:
    keys = chunk_keys("manifest", 4)
    store(tmp_path, keys, model_revision="rev-a", namespace_tag="blue")
    ((name, fields),) = run_configs(tmp_path).items()
    assert fields["model_revision"] == "rev-a" and fields["namespace_tag"] == "blue"
    assert name.endswith("_" + run_digest(fields))
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path)}])
    vllm_fields = FileMapper.from_offloading_spec(root_dir="", offloading_spec=spec, blocks_per_file=4,
                                                  parallel_agnostic=True).get_run_config()
    assert {k: v for k, v in fields.items() if k not in ("model_revision", "namespace_tag")} == vllm_fields

    assert load(tmp_path, keys, model_revision="rev-b", namespace_tag="blue") == [None] * 4
    assert load(tmp_path, keys) == [None] * 4  # vLLM's own namespace holds none of them
    assert load(tmp_path, keys, model_revision="rev-a", namespace_tag="blue") == \
        [payload(k, ROW).tobytes() for k in keys]
    # Without the keys: exactly vLLM's namespace (its config.json, its digest).
    store(tmp_path, keys)
    assert any(f == vllm_fields for f in run_configs(tmp_path).values())


@pytest.mark.parametrize("key, value", [("model_revision", "two\nlines"), ("namespace_tag", "a b")])
def test_a_bad_manifest_value_fails_vllm_start_up(tmp_path: Path, key: str, value: str) -> None:
    spec = tiering_spec([{"type": "kvtier_fs", "root_dir": str(tmp_path)}], **{key: value})
    with pytest.raises(kvtier.ConfigError, match=key):
        spec.get_manager()

"""Configuration edges: secrets in any container shape, what an fs ``root_dir`` creates, host
bytes that are not a whole number of slots, internal tier types, and short tracebacks for
configuration errors at the public entry points."""

from __future__ import annotations

import logging
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.config import BUILTIN_TIER_TYPES, SECRET_KEYS, EngineConfig, RequestParams, TierConfig, redact
from kvtier.tiers.factory import SecondaryTierFactory

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzz"
GiB = 1 << 30


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)


SLOT = geometry().slot_bytes(1)


def device_kv() -> list[torch.Tensor]:
    return [torch.zeros((8, 2, 4, 2, 16), dtype=torch.float16) for _ in range(2)]


def tiering(*tiers: Any, **engine: Any) -> dict[str, Any]:
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": GiB, "secondary_tiers": list(tiers),
            **engine}


def obj_with_store(store_config: Any) -> dict[str, Any]:
    return {"type": "obj", "store_config": store_config}


def assert_no_secret(text: str) -> None:
    assert SECRET not in text
    assert SECRET[:8] not in text and SECRET[-8:] not in text


# --------------------------------------------------------------------------- 7: secrets, any shape

# Every way a credential can be written in the wrong container: none of them may be echoed.
STORE_CONFIG_SHAPES: dict[str, Any] = {
    "list_of_tuples": [("bucket", "kv"), ("secret_key", SECRET)],
    "list_of_lists": [["bucket", "kv"], ["secret_key", SECRET]],
    "tuple_of_tuples": (("secret_key", SECRET),),
    "nested_lists": [[["session_token", SECRET]]],
    "flat_list": ["bucket", "kv", "secret_key", SECRET],
    "pair_with_container_value": [("access_key", [SECRET])],
    "dict_inside_list": [{"secret_key": SECRET}],
    "set_of_pairs": {("secret_key", SECRET)},
    "string_assignment": f"secret_key={SECRET}",
    "string_uppercase": f"SECRET_KEY: {SECRET}",
    "json_string": f'{{"bucket": "kv", "secret_key": "{SECRET}"}}',
    "object_attribute": types.SimpleNamespace(secret_key=SECRET),
    "bytes_key_dict": {b"secret_key": SECRET},
    "spaced_key": {"Secret-Key": SECRET},
}


@pytest.mark.parametrize("store_config", list(STORE_CONFIG_SHAPES.values()), ids=list(STORE_CONFIG_SHAPES))
def test_a_wrongly_typed_store_config_never_echoes_its_secret(store_config: Any) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(tiering(obj_with_store(store_config)))
    message = str(info.value)
    assert "secondary_tiers[0].store_config" in message
    assert_no_secret(message)


@pytest.mark.parametrize(
    "config",
    [
        tiering([("type", "obj"), ("store_config", {"secret_key": SECRET})]),  # tier entry as pairs
        {**tiering(), "secondary_tiers": {"store_config": [("secret_key", SECRET)]}},
        tiering(obj_with_store({"bucket": "kv", "endpoint_override": "h:1", "secret_key": [SECRET]})),
        tiering(obj_with_store({"bucket": "kv", "endpoint_override": "h:1", "secret_key": {"v": SECRET}})),
        tiering({"type": "fs", "root_dir": "/x", "backpressure": {"password": [SECRET]}}),
        tiering({"type": "fs", "root_dir": "/x", "backpressure": {"backpressure_cls": "x",
                                                                  "token": {"session_token": SECRET}}}),
        tiering({"type": "fs", "root_dir": "/x", "n_read_threads": [("secret_key", SECRET)]}),
        {**tiering(), ("secret_key", SECRET): 1},                                  # a non-string key
    ],
    ids=["tier_pairs", "tiers_not_a_list", "secret_list", "secret_dict", "backpressure_secret_list",
         "backpressure_nested", "neighbour_key", "tuple_key"],
)
def test_secrets_never_appear_in_errors_whatever_the_container(config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(config)
    assert_no_secret(str(info.value))


@pytest.mark.parametrize("value", list(STORE_CONFIG_SHAPES.values()), ids=list(STORE_CONFIG_SHAPES))
def test_redact_removes_secrets_from_every_shape(value: Any) -> None:
    assert_no_secret(repr(redact(value)))


def test_redact_hides_every_secret_key_and_keeps_what_is_not_secret() -> None:
    for key in SECRET_KEYS:
        assert redact({key: SECRET, key.upper(): SECRET}) == {key: "***", key.upper(): "***"}
    assert redact([("bucket", "kv"), ("secret_key", SECRET)]) == [("bucket", "kv"), ("secret_key", "***")]
    assert redact({"root_dir": "/mnt/password/kv", "curve_secret_key_file": "/k/a.key"}) == {
        "root_dir": "/mnt/password/kv", "curve_secret_key_file": "/k/a.key"}
    assert redact("secret_key") == "secret_key"  # a key name alone is no secret


def test_request_warnings_never_show_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        RequestParams.from_kv_transfer_params({
            "kv_load_tiers": [("secret_key", SECRET)],
            "remote_decoder": [("session_token", SECRET)],
            "max_load_tokens": f"password={SECRET}",
        })
    assert caplog.records
    assert_no_secret(caplog.text)


def test_repr_and_str_of_configs_never_show_secrets_in_any_container() -> None:
    entry = {
        "type": "Vault", "module_path": "pkg.vault",
        "creds": [("secret_key", SECRET)],
        "more": [["session_token", SECRET]],
        "nested": {"a": ({"access_key": SECRET},)},
        "dsn": f"password={SECRET}",
        "flat": ["secret_key", SECRET],
    }
    config = EngineConfig.from_dict(tiering(entry))
    tier = config.secondary_tiers[0]
    for text in (repr(config), str(config), repr(tier), str(tier), repr(tier.options), str(tier.options),
                 repr(config.to_dict()), repr(tier.to_dict())):
        assert_no_secret(text)
    assert tier.options["creds"] == [("secret_key", SECRET)]  # the tier itself gets the real values
    assert tier.options["dsn"] == f"password={SECRET}"


# --------------------------------------------------------------------------- 10a: fs root_dir


@pytest.mark.anyio
async def test_fs_root_dir_whose_parent_is_missing_is_a_config_error(tmp_path: Path) -> None:
    missing_parent = tmp_path / "mnt" / "nvme"
    root = missing_parent / "kv"
    config = tiering({"type": "fs", "root_dir": str(root)}, cpu_bytes_to_use=16 * SLOT)
    with pytest.raises(ConfigError) as info:
        async with kvtier.open(config, geometry(), device_kv()):
            pass  # pragma: no cover
    message = str(info.value)
    assert "secondary_tiers[0].root_dir" in message
    assert str(missing_parent) in message
    assert "create it first" in message
    assert not (tmp_path / "mnt").exists()  # nothing was created on the wrong filesystem


@pytest.mark.anyio
async def test_fs_root_dir_is_created_when_its_parent_exists(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    config = tiering({"type": "fs", "root_dir": str(root)}, cpu_bytes_to_use=16 * SLOT)
    async with kvtier.open(config, geometry(), device_kv()):
        assert root.is_dir()


# --------------------------------------------------------------------------- 10b: whole slots


@pytest.mark.anyio
async def test_host_bytes_not_a_whole_number_of_slots_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    configured = 16 * SLOT + 100
    with caplog.at_level(logging.INFO, logger="kvtier"):
        async with kvtier.open({"cpu_bytes_to_use": configured}, geometry(), device_kv()) as engine:
            assert engine.host_bytes == 16 * SLOT
            host = engine.statistics()["0:primary"]
            assert host.num_slots * host.slot_bytes == 16 * SLOT
    records = [r for r in caplog.records if "cpu_bytes_to_use" in r.getMessage()]
    assert len(records) == 1
    record = records[0]
    assert record.levelno == logging.INFO  # 100 of ~262 kB unused: worth knowing, not a problem
    text = record.getMessage()
    for figure in (configured, SLOT, 16, 100):
        assert str(figure) in text


@pytest.mark.anyio
async def test_a_large_unused_share_of_host_bytes_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    configured = SLOT + SLOT // 2
    with caplog.at_level(logging.INFO, logger="kvtier"):
        async with kvtier.open({"cpu_bytes_to_use": configured}, geometry(), device_kv()) as engine:
            assert engine.host_bytes == SLOT
    records = [r for r in caplog.records if "cpu_bytes_to_use" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert str(SLOT // 2) in records[0].getMessage()


@pytest.mark.anyio
async def test_whole_slots_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier"):
        async with kvtier.open({"cpu_bytes_to_use": 16 * SLOT}, geometry(), device_kv()) as engine:
            assert engine.host_bytes == 16 * SLOT
    assert not [r for r in caplog.records if "cpu_bytes_to_use" in r.getMessage()]


# --------------------------------------------------------------------------- 10c: internal tier types


def test_the_internal_test_tier_is_not_advertised() -> None:
    assert "faulty" not in BUILTIN_TIER_TYPES
    messages = []
    for config in (tiering({"type": "bogus"}), tiering({"type": "faultyy"}), tiering({"root_dir": "/x"})):
        with pytest.raises(ConfigError) as info:
            EngineConfig.from_dict(config)
        messages.append(str(info.value))
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.get_class("bogus")
    messages.append(str(info.value))
    for message in messages:
        assert "faulty" not in message.replace("faultyy", ""), message
        assert "'fs'" in message and "'memory'" in message


def test_the_internal_test_tier_is_still_constructible() -> None:
    tier = TierConfig.from_dict({"type": "faulty", "fail_read_fraction": 0.5}, 0)
    assert tier.options["fail_read_fraction"] == 0.5
    assert SecondaryTierFactory.get_class("faulty").__name__ == "FaultyTier"


# --------------------------------------------------------------------------- 12: short tracebacks

BAD = tiering({"type": "fs", "root_dir": "/x", "n_read_threads": "many"})
BAD_MESSAGE = "invalid secondary_tiers[0].n_read_threads = 'many': expected an integer in 1..1024"


def kvtier_frames(tb: Any) -> list[str]:
    package = str(Path(kvtier.__file__).parent)
    return [f"{Path(frame.filename).relative_to(package)}:{frame.name}" for frame in traceback.extract_tb(tb)
            if frame.filename.startswith(package)]


@pytest.mark.anyio
async def test_a_config_error_from_open_ends_at_the_public_call() -> None:
    with pytest.raises(ConfigError) as info:
        async with kvtier.open(BAD, geometry(), device_kv()):
            pass  # pragma: no cover
    assert str(info.value) == BAD_MESSAGE
    assert kvtier_frames(info.tb) == ["engine/engine.py:open"]


@pytest.mark.anyio
async def test_a_config_error_from_a_tier_start_ends_at_the_public_call(tmp_path: Path) -> None:
    config = tiering({"type": "fs", "root_dir": str(tmp_path / "no" / "kv")}, cpu_bytes_to_use=16 * SLOT)
    with pytest.raises(ConfigError) as info:
        async with kvtier.open(config, geometry(), device_kv()):
            pass  # pragma: no cover
    assert kvtier_frames(info.tb) == ["engine/engine.py:open"]


@pytest.mark.anyio
async def test_a_config_error_from_the_engine_geometry_ends_at_the_public_call() -> None:
    with pytest.raises(ConfigError, match="at least one chunk slot") as info:
        async with kvtier.open({"cpu_bytes_to_use": SLOT - 1}, geometry(), device_kv()):
            pass  # pragma: no cover
    assert kvtier_frames(info.tb) == ["engine/engine.py:open"]


def test_a_config_error_from_start_in_thread_ends_at_the_public_call() -> None:
    with pytest.raises(ConfigError) as info:
        kvtier.start_in_thread(BAD, geometry(), device_kv())
    assert str(info.value) == BAD_MESSAGE
    assert kvtier_frames(info.tb) == ["engine/threaded.py:start_in_thread"]


def test_a_config_error_from_from_dict_shows_one_frame_of_kvtier() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(BAD)
    assert str(info.value) == BAD_MESSAGE
    assert kvtier_frames(info.tb) == ["config/engine.py:from_dict"]
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({"type": "fs"}, 0)
    assert kvtier_frames(info.tb) == ["config/tiers.py:from_dict"]


def test_the_bench_cli_prints_a_config_error_as_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"spec_name": "TieringOffloadingSpec", "secondary_tiers": '
                   f'[{{"type": "obj", "store_config": [["secret_key", "{SECRET}"]]}}]}}')
    assert main(["bench", "--quick", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "secondary_tiers[0].store_config" in err
    assert "Traceback" not in err
    assert_no_secret(err)


@pytest.mark.anyio
async def test_a_trimmed_config_error_keeps_its_cause() -> None:
    config = {"cpu_bytes_to_use": 16 * SLOT, "spec_name": "MySpec", "spec_module_path": "kvtier_no_such_module"}
    with pytest.raises(ConfigError, match="spec_module_path: cannot import") as info:
        async with kvtier.open(config, geometry(), device_kv()):
            pass  # pragma: no cover
    assert kvtier_frames(info.tb) == ["engine/engine.py:open"]
    assert isinstance(info.value.__cause__, ModuleNotFoundError)  # the module's own error, still shown

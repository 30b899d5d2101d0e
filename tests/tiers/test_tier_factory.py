"""Specification of ``SecondaryTierFactory``: built-ins, registration, out-of-tree classes, errors."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import TierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.base import TierContext
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.memory import MemoryTier

OUT_OF_TREE = '''
from kvtier.tiers.memory import MemoryTier


class MyTier(MemoryTier):
    tier_type = "MyTier"


class NotATier:
    pass
'''


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(SecondaryTierFactory, "_registry", dict(SecondaryTierFactory._registry))
    monkeypatch.setattr(SecondaryTierFactory, "_warned_out_of_tree", set())
    yield


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "kvtier_test_plugin_tiers.py").write_text(textwrap.dedent(OUT_OF_TREE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kvtier_test_plugin_tiers"


def context() -> TierContext:
    return TierContext(index=0, label="1:x", slot_bytes=4096, host=None, geometry=None,
                       blocks_per_chunk=1, run_fields={})


def config(type_: str, module_path: str | None = None, **options: object) -> TierConfig:
    return TierConfig(index=0, type=type_, module_path=module_path, options=options)


def test_builtin_memory_and_faulty_types() -> None:
    assert type(SecondaryTierFactory.create(config("memory", capacity_bytes=4096), context())) is MemoryTier
    assert type(SecondaryTierFactory.create(config("faulty"), context())) is FaultyTier
    assert {"memory", "faulty", "fs", "obj"} <= set(SecondaryTierFactory.registered_types())


def test_out_of_tree_class_is_loaded_from_module_path_with_one_warning(
    plugin_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.factory"):
        first = SecondaryTierFactory.create(config("MyTier", plugin_module, capacity_bytes=4096), context())
        second = SecondaryTierFactory.create(config("MyTier", plugin_module, capacity_bytes=4096), context())
    assert type(first).__name__ == "MyTier" and type(second) is type(first)
    assert isinstance(first, MemoryTier)
    assert sum("out-of-tree" in rec.getMessage() for rec in caplog.records) == 1


def test_registered_name_resolves_to_its_class(plugin_module: str) -> None:
    SecondaryTierFactory.register("mine", plugin_module, "MyTier")
    tier = SecondaryTierFactory.create(config("mine", capacity_bytes=4096), context())
    assert type(tier).__name__ == "MyTier"


def test_duplicate_registration_is_rejected() -> None:
    SecondaryTierFactory.register("mine", "somewhere", "Mine")
    with pytest.raises(ValueError, match="mine"):
        SecondaryTierFactory.register("mine", "elsewhere", "Mine")
    with pytest.raises(ValueError, match="memory"):
        SecondaryTierFactory.register("memory", "elsewhere", "Mine")


def test_unimportable_module_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="kvtier_no_such_module_xyz"):
        SecondaryTierFactory.create(config("MyTier", "kvtier_no_such_module_xyz"), context())


def test_class_that_is_not_a_secondary_tier_is_a_config_error(plugin_module: str) -> None:
    with pytest.raises(ConfigError, match="not a SecondaryTier subclass"):
        SecondaryTierFactory.create(config("NotATier", plugin_module), context())


def test_missing_class_is_a_config_error(plugin_module: str) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        SecondaryTierFactory.create(config("Absent", plugin_module), context())


def test_unknown_type_without_module_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.type"):
        SecondaryTierFactory.create(config("nope"), context())


def test_p2p_is_a_built_in_type() -> None:
    from kvtier.tiers.p2p.tier import P2PTier

    assert SecondaryTierFactory.get_class("p2p", where="secondary_tiers[0]") is P2PTier
    assert "p2p" in SecondaryTierFactory.registered_types()

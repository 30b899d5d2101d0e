"""The tier keys ``write_policy`` and ``min_hits``: defaults, normalisation, errors naming the key."""

from __future__ import annotations

from typing import Any

import pytest
from test_config import fs, memory, obj, p2p, tiering

from kvtier.config import EngineConfig
from kvtier.errors import ConfigError


def out_of_tree(**kw: Any) -> dict[str, Any]:
    return {"type": "MyTier", "module_path": "my_tiers", **kw}


@pytest.mark.parametrize("entry", [fs(), memory(), obj(), p2p(port=5000), out_of_tree()],
                         ids=["fs", "memory", "obj", "p2p", "out_of_tree"])
def test_every_tier_writes_through_by_default(entry: dict[str, Any]) -> None:
    tier = EngineConfig.from_dict(tiering(entry)).secondary_tiers[0]
    assert tier.write_policy == "write_through"
    assert tier.min_hits == 2
    assert "write_policy" not in tier.options and "min_hits" not in tier.options


@pytest.mark.parametrize("entry", [fs, memory, obj, out_of_tree], ids=["fs", "memory", "obj", "out_of_tree"])
@pytest.mark.parametrize("policy", ["write_through", "write_back", "selective", "Write_Back"])
def test_every_policy_is_accepted_by_every_tier_type_case_insensitively(entry: Any, policy: str) -> None:
    tier = EngineConfig.from_dict(tiering(entry(write_policy=policy))).secondary_tiers[0]
    assert tier.write_policy == policy.lower()


def test_selective_takes_min_hits() -> None:
    tier = EngineConfig.from_dict(tiering(memory(write_policy="selective", min_hits=5))).secondary_tiers[0]
    assert (tier.write_policy, tier.min_hits) == ("selective", 5)


@pytest.mark.parametrize(("entry", "path", "shown"), [
    (memory(write_policy="sometimes"), "secondary_tiers[1].write_policy", "'sometimes'"),
    (memory(write_policy=3), "secondary_tiers[1].write_policy", "3"),
    (memory(write_policy=None), "secondary_tiers[1].write_policy", "None"),
    (memory(write_policy="selective", min_hits=0), "secondary_tiers[1].min_hits", "0"),
    (memory(write_policy="selective", min_hits=True), "secondary_tiers[1].min_hits", "True"),
    (memory(write_policy="selective", min_hits=1.5), "secondary_tiers[1].min_hits", "1.5"),
    (memory(min_hits=3), "secondary_tiers[1].min_hits", "3"),
    (memory(write_policy="write_back", min_hits=3), "secondary_tiers[1].min_hits", "3"),
    (p2p(port=5000, write_policy="write_back"), "secondary_tiers[1].write_policy", "'write_back'"),
    (p2p(port=5000, write_policy="selective"), "secondary_tiers[1].write_policy", "'selective'"),
])
def test_bad_values_raise_naming_the_key(entry: dict[str, Any], path: str, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(tiering(fs(), entry))
    message = str(info.value)
    assert f"invalid {path} = {shown}:" in message


def test_the_error_says_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="'write_through', 'write_back', 'selective'"):
        EngineConfig.from_dict(tiering(memory(write_policy="lazy")))
    with pytest.raises(ConfigError, match='"selective" only'):
        EngineConfig.from_dict(tiering(memory(min_hits=2)))


def test_a_p2p_tier_may_say_write_through() -> None:
    tier = EngineConfig.from_dict(tiering(p2p(port=5000, write_policy="write_through"))).secondary_tiers[0]
    assert tier.write_policy == "write_through"


def test_to_dict_round_trips_the_policies() -> None:
    config = EngineConfig.from_dict(tiering(
        fs(), memory(write_policy="write_back"), memory(write_policy="selective", min_hits=4)))
    tiers = config.to_dict()["secondary_tiers"]
    assert [t["write_policy"] for t in tiers] == ["write_through", "write_back", "selective"]
    assert [t.get("min_hits") for t in tiers] == [None, None, 4]
    again = EngineConfig.from_dict(config.to_dict())
    assert again == config
    assert "write_policy='selective', min_hits=4" in repr(config.secondary_tiers[2])

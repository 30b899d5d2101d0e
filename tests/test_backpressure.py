"""Back-pressure: the detector, its policies, its configuration, and the engine
shedding stores to a slow tier.

Time is a :class:`FakeClock` everywhere: unit tests move it by hand; in the engine tests the slow
test tier moves it by a fixed amount per chunk it writes, so every latency sample the detector
sees is exact (no wall-clock assertion anywhere).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import anyio
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier import ConfigError, KVGeometry
from kvtier.backpressure import (
    BackpressureDetector,
    BackpressurePolicy,
    BackpressureStatistics,
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
    build_detectors,
)
from kvtier.config import EngineConfig
from kvtier.specs import load_spec
from kvtier.tiers.memory import MemoryTier

MIB = 1 << 20


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def detector(clock: FakeClock, **over: Any) -> EMABackpressureDetector:
    args: dict[str, Any] = dict(high_water_s=1.0, low_water_s=0.25, alpha=1.0, warmup_completions=1,
                                decay_half_life_s=2.0, cooldown_s=1.0)
    args.update(over)
    return EMABackpressureDetector(**args, clock=clock)


def sample(det: BackpressureDetector, s_per_mib: float, times: int = 1) -> None:
    """Completions of 1-MiB stores that took ``s_per_mib`` seconds each."""
    for _ in range(times):
        det.on_store_completed(s_per_mib, MIB)


def decisions(det: BackpressureDetector, n: int, num_blocks: int = 1) -> list[bool]:
    return [det.should_store(num_blocks) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# The EMA detector
# ------------------------------------------------------------------------------------------------


def test_warmup_seeds_the_ema_with_the_mean_and_never_signals_pressure() -> None:
    det = detector(FakeClock(), warmup_completions=10, alpha=0.5)
    sample(det, 10.0, times=9)  # ten times the high water mark, but still warming up
    assert det.store_latency_ema == 0.0 and not det.is_under_pressure()
    assert det.should_store(1)
    sample(det, 0.5)  # the tenth: EMA = mean of the ten samples, still no verdict
    assert det.store_latency_ema == pytest.approx((9 * 10.0 + 0.5) / 10)
    assert not det.is_under_pressure()
    sample(det, 10.0)  # the first EMA update after warm-up
    assert det.store_latency_ema == pytest.approx(0.5 * 10.0 + 0.5 * 9.05)
    assert det.is_under_pressure()


def test_high_and_low_water_marks_form_a_hysteresis_band() -> None:
    det = detector(FakeClock(), alpha=0.5)
    sample(det, 0.5)  # seeds the EMA at 0.5: between the marks
    assert not det.is_under_pressure()
    sample(det, 2.5)  # 1.5 > high
    assert det.is_under_pressure()
    sample(det, 0.5)  # 1.0: not above high, not below low -> still pressured
    assert det.is_under_pressure() and det.store_latency_ema == pytest.approx(1.0)
    sample(det, 0.0)  # 0.5: inside the band
    assert det.is_under_pressure()
    sample(det, 0.0)  # 0.25: not below low yet
    assert det.is_under_pressure()
    sample(det, 0.0)  # 0.125 < low -> clears
    assert not det.is_under_pressure()
    sample(det, 0.5)  # 0.3125: inside the band again, stays clear
    assert not det.is_under_pressure()


def test_update_normalises_latency_to_seconds_per_mib_and_ignores_empty_jobs() -> None:
    clock = FakeClock()
    det = detector(clock)
    submitted = clock()
    clock.advance(0.5)
    det.update(submitted, 0)  # moved nothing: no sample
    assert det.store_latency_ema == 0.0
    det.update(submitted, 2 * MIB)  # 0.5 s for 2 MiB
    assert det.store_latency_ema == pytest.approx(0.25)


def test_idle_decay_clears_pressure_of_a_tier_that_gets_no_stores() -> None:
    clock = FakeClock()
    det = detector(clock)
    sample(det, 0.5)
    sample(det, 4.0)  # pressured at 4.0 s/MiB
    assert det.is_under_pressure()
    clock.advance(2.0)  # one half-life
    assert det.is_under_pressure() and det.store_latency_ema == 2.0
    clock.advance(4.0)
    assert det.is_under_pressure() and det.store_latency_ema == 0.5
    clock.advance(2.0)  # exactly low water: not below it
    assert det.is_under_pressure() and det.store_latency_ema == 0.25
    clock.advance(0.5)
    assert not det.is_under_pressure()


def test_idle_decay_is_applied_only_while_pressured() -> None:
    clock = FakeClock()
    det = detector(clock)
    sample(det, 0.5)
    clock.advance(100.0)
    assert not det.is_under_pressure()
    assert det.store_latency_ema == 0.5


def test_cooldown_after_pressure_clears_drops_every_second_store() -> None:
    clock = FakeClock()
    det = detector(clock, policy=DropStorePolicy())
    sample(det, 0.5)
    sample(det, 4.0)
    assert decisions(det, 3) == [False, False, False]
    clock.advance(9.0)  # decays below low: pressure clears now, cooldown starts
    assert decisions(det, 6, num_blocks=2) == [True, False, True, False, True, False]
    assert det.pop_stores_dropped() == (3 + 3, 3 + 3 * 2)
    clock.advance(1.0)  # cooldown over
    assert decisions(det, 4) == [True] * 4
    assert det.pop_stores_dropped() == (0, 0)


def test_ten_healthy_completions_bypass_the_policy() -> None:
    class Refuse(BackpressurePolicy):
        def should_store(self, detector: BackpressureDetector) -> bool:
            return False

    det = detector(FakeClock(), policy=Refuse())
    sample(det, 0.1)  # warm-up seed (no streak)
    sample(det, 0.1, times=9)
    assert not det.should_store(1)  # nine sub-low completions: the policy is still asked
    sample(det, 0.1)
    assert decisions(det, 3) == [True] * 3
    sample(det, 0.5)  # inside the band: the streak ends
    assert not det.should_store(1)


def test_consecutive_failures_trip_pressure_even_during_warmup() -> None:
    clock = FakeClock()
    det = detector(clock, warmup_completions=10, failure_threshold=3)
    det.on_store_failed()
    det.on_store_failed()
    assert not det.is_under_pressure()
    det.on_store_failed()
    assert det.is_under_pressure()
    assert det.statistics() == BackpressureStatistics(
        under_pressure=True, failure_tripped=True, store_latency_ema=4.0, consecutive_failures=3)
    assert decisions(det, 3) == [False] * 3  # 4 x high: the throttled policy drops everything
    clock.advance(2 * 4.5)  # 4.0 decays below low 0.25 after four half-lives
    assert det.should_store(1)  # a probe store goes through


def test_failure_trip_keeps_a_higher_ema_and_a_success_resets_the_streak() -> None:
    det = detector(FakeClock(), failure_threshold=2)
    sample(det, 0.5)
    sample(det, 9.0)
    det.on_store_failed()
    sample(det, 9.0)  # success: the failure streak starts again
    det.on_store_failed()
    assert det.statistics().consecutive_failures == 1 and not det.statistics().failure_tripped
    det.on_store_failed()
    assert det.statistics().failure_tripped
    assert det.store_latency_ema == 9.0  # max(ema, 4 x high)


def test_failures_are_ignored_without_a_threshold() -> None:
    det = detector(FakeClock())
    for _ in range(50):
        det.on_store_failed()
    assert not det.is_under_pressure()


def test_reset_forgets_samples_pressure_and_drop_counts() -> None:
    det = detector(FakeClock(), policy=DropStorePolicy(), warmup_completions=2)
    sample(det, 4.0, times=3)
    assert not det.should_store(5)
    det.reset()
    assert not det.is_under_pressure() and det.store_latency_ema == 0.0
    assert det.pop_stores_dropped() == (0, 0)
    sample(det, 4.0)  # warm-up again
    assert not det.is_under_pressure()


# ------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------


def pressured(ema: float, policy: BackpressurePolicy | None = None) -> EMABackpressureDetector:
    """Under pressure with EMA exactly ``ema`` (alpha 1: the EMA is the last sample)."""
    det = detector(FakeClock(), policy=policy, cooldown_s=0.0)
    sample(det, 2.0)
    sample(det, ema)
    assert det.is_under_pressure() and det.store_latency_ema == ema
    return det


def test_drop_store_policy_drops_everything_while_pressured() -> None:
    det = pressured(1.25, DropStorePolicy())
    assert decisions(det, 5, num_blocks=3) == [False] * 5
    assert det.pop_stores_dropped() == (5, 15)
    assert det.pop_stores_dropped() == (0, 0)


def test_throttled_policy_drops_a_share_growing_with_the_overshoot() -> None:
    # overshoot 0.5 / ramp 2 = every fourth store
    det = pressured(1.5)
    assert decisions(det, 8, num_blocks=4) == [True, True, True, False] * 2
    assert det.pop_stores_dropped() == (2, 8)
    # three times the high water mark and beyond: everything
    assert decisions(pressured(3.0), 4) == [False] * 4
    # pressured but back inside the band: overshoot 0, everything stored
    det = pressured(2.0)
    sample(det, 0.5)
    assert det.is_under_pressure() and decisions(det, 4) == [True] * 4


def test_throttled_policy_carries_the_accumulator_fraction() -> None:
    # rate 0.375: drops when the running sum crosses 1, 2, 3 -> the 3rd, 6th and 8th stores
    det = pressured(1.75)
    assert decisions(det, 8) == [True, True, False, True, True, False, True, False]


def test_throttled_policy_with_a_detector_without_overshoot_drops_while_pressured() -> None:
    class Flag(BackpressureDetector):
        def __init__(self, policy: BackpressurePolicy | None = None) -> None:
            super().__init__(policy)
            self.on = False

        def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None: ...
        def is_under_pressure(self) -> bool: return self.on
        def reset(self) -> None: self.on = False
        def statistics(self) -> BackpressureStatistics:
            return BackpressureStatistics(self.on, False, None, 0)

    det = Flag(ThrottledDropPolicy())
    assert det.should_store(1)
    det.on = True
    assert decisions(det, 3) == [False] * 3


# ------------------------------------------------------------------------------------------------
# Validation and defaults
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("over", "path"), [
    ({"alpha": 0.0}, "backpressure.alpha"),
    ({"alpha": 1.5}, "backpressure.alpha"),
    ({"low_water_s": 2.0}, "backpressure.low_water_s"),
    ({"high_water_s": 0.0}, "backpressure.high_water_s"),
    ({"high_water_s": float("nan")}, "backpressure.high_water_s"),
    ({"failure_threshold": 0}, "backpressure.failure_threshold"),
    ({"failure_threshold": 2.5}, "backpressure.failure_threshold"),
    ({"warmup_completions": -1}, "backpressure.warmup_completions"),
    ({"cooldown_s": True}, "backpressure.cooldown_s"),
])
def test_detector_arguments_are_validated(over: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match=rf"invalid {path} = "):
        detector(FakeClock(), **over)


def test_ramp_factor_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="ramp_factor"):
        ThrottledDropPolicy(ramp_factor=0)


@pytest.mark.parametrize(("tier_type", "locality", "expected"), [
    ("fs", None, {"high_water_s": 0.010, "low_water_s": 0.002, "failure_threshold": 3}),
    ("fs", "REMOTE", {"high_water_s": 0.050, "low_water_s": 0.010, "failure_threshold": 3}),
    ("obj", None, {"high_water_s": 0.050, "low_water_s": 0.010, "failure_threshold": 3}),
    ("memory", None, {"high_water_s": 0.010, "low_water_s": 0.002}),
    ("MyTier", "remote", {"high_water_s": 0.050, "low_water_s": 0.010}),
])
def test_default_config_by_tier_type_and_locality(tier_type: str, locality: str | None,
                                                  expected: dict[str, Any]) -> None:
    assert EMABackpressureDetector.default_config(tier_type, locality) == expected


# ------------------------------------------------------------------------------------------------
# Configuration: class resolution, merging, bad values
# ------------------------------------------------------------------------------------------------


class RecordingDetector(EMABackpressureDetector):
    """An out-of-tree detector (resolved by dotted path)."""


class NeverPolicy(BackpressurePolicy):
    def should_store(self, detector: BackpressureDetector) -> bool:
        return False


class NeedsArgumentPolicy(DropStorePolicy):
    def __init__(self, level: int) -> None:
        super().__init__()


NOT_A_CLASS = 42


def engine_config(tiers: list[dict[str, Any]], **top: Any) -> EngineConfig:
    return EngineConfig.from_dict({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
                                   "secondary_tiers": tiers, **top})


def fs(**over: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": "/tmp/unused-kvtier-bp", **over}


def test_short_names_defaults_and_tier_fields_over_top_level_ones() -> None:
    config = engine_config(
        [fs(backpressure={"policy_cls": "DropStorePolicy", "alpha": 0.5}),
         {"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h:1"}},
         {"type": "memory", "capacity_bytes": 1 << 20, "locality": "REMOTE"}],
        backpressure={"backpressure_cls": "EMABackpressureDetector", "alpha": 0.25},
    )
    first, second, third = build_detectors(config)
    assert isinstance(first, EMABackpressureDetector) and isinstance(first.policy, DropStorePolicy)
    assert (first.alpha, first.high_water_s, first.low_water_s, first.failure_threshold) == (0.5, 0.010, 0.002, 3)
    assert isinstance(second, EMABackpressureDetector) and isinstance(second.policy, ThrottledDropPolicy)
    assert (second.alpha, second.high_water_s, second.failure_threshold) == (0.25, 0.050, 3)
    assert isinstance(third, EMABackpressureDetector)
    assert (third.high_water_s, third.failure_threshold) == (0.050, None)


def test_a_tier_without_backpressure_settings_gets_no_detector() -> None:
    config = engine_config([fs(), fs(root_dir="/tmp/other", backpressure={"backpressure_cls": "EMABackpressureDetector"})])
    assert [type(d) for d in build_detectors(config)] == [type(None), EMABackpressureDetector]


def test_dotted_paths_name_out_of_tree_detector_and_policy_classes() -> None:
    config = engine_config([fs(backpressure={"backpressure_cls": f"{__name__}.RecordingDetector",
                                             "policy_cls": f"{__name__}.NeverPolicy", "high_water_s": 7.0})])
    (det,) = build_detectors(config)
    assert type(det) is RecordingDetector and type(det.policy) is NeverPolicy
    assert det.high_water_s == 7.0 and det.low_water_s == 0.002


class KeywordDefaultsDetector(EMABackpressureDetector):
    """Declares its defaults as vLLM's detectors do: ``locality`` keyword-only."""

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any]:
        return {"high_water_s": 3.0 if locality == "REMOTE" else 2.0, "low_water_s": 1.0}


class NoDefaultsDetector(EMABackpressureDetector):
    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> None:  # type: ignore[override]
        return None  # vLLM's base class answer: no defaults


def test_default_config_is_called_with_locality_by_keyword_and_may_return_none() -> None:
    config = engine_config([
        fs(backpressure={"backpressure_cls": f"{__name__}.KeywordDefaultsDetector"}),
        fs(root_dir="/tmp/other", locality="REMOTE",
           backpressure={"backpressure_cls": f"{__name__}.KeywordDefaultsDetector"}),
        fs(root_dir="/tmp/third", backpressure={"backpressure_cls": f"{__name__}.NoDefaultsDetector",
                                                "high_water_s": 5.0, "low_water_s": 0.5}),
    ])
    local, remote, bare = build_detectors(config)
    assert isinstance(local, EMABackpressureDetector) and local.high_water_s == 2.0
    assert isinstance(remote, EMABackpressureDetector) and remote.high_water_s == 3.0
    assert isinstance(bare, EMABackpressureDetector)
    assert (bare.high_water_s, bare.failure_threshold) == (5.0, None)


@pytest.mark.parametrize(("tier_bp", "top_bp", "message"), [
    ({"backpressure_cls": "EMA"}, None,
     r"invalid secondary_tiers\[0\]\.backpressure\.backpressure_cls = 'EMA': expected one of 'EMABackpressureDetector'"),
    (None, {"backpressure_cls": "no_such_module_kvtier_bp.Detector"},
     r"invalid backpressure\.backpressure_cls = .*cannot import 'no_such_module_kvtier_bp'"),
    ({"backpressure_cls": f"{__name__}.NOT_A_CLASS"}, None,
     r"backpressure\.backpressure_cls = .*NOT_A_CLASS is not a BackpressureDetector subclass"),
    ({"backpressure_cls": f"{__name__}.Missing"}, None, r"Missing does not exist"),
    ({"backpressure_cls": f"{__name__}.FakeClock"}, None, r"FakeClock is not a BackpressureDetector subclass"),
    ({"policy_cls": f"{__name__}.RecordingDetector"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"secondary_tiers\[0\]\.backpressure\.policy_cls = .*is not a BackpressurePolicy subclass"),
    ({"policy_cls": f"{__name__}.NeedsArgumentPolicy"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"secondary_tiers\[0\]\.backpressure\.policy_cls = .*with no arguments failed"),
    ({"policy_cls": "Drop"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"policy_cls = 'Drop': expected one of 'DropStorePolicy', 'ThrottledDropPolicy'"),
    ({"alpah": 0.2}, {"backpressure_cls": "EMABackpressureDetector"},
     r"unknown key secondary_tiers\[0\]\.backpressure\.alpah for EMABackpressureDetector; allowed keys: .*alpha"),
    (None, {"backpressure_cls": "EMABackpressureDetector", "ramp_factor": 3.0},
     r"unknown key backpressure\.ramp_factor"),
    ({"alpha": 0}, {"backpressure_cls": "EMABackpressureDetector"},
     r"invalid secondary_tiers\[0\]\.backpressure\.alpha = 0: expected a finite number > 0 and <= 1"),
    (None, {"backpressure_cls": "EMABackpressureDetector", "low_water_s": 0.5},
     r"invalid backpressure\.low_water_s = 0\.5: expected a number <= high_water_s"),
    ({"failure_threshold": 0}, {"backpressure_cls": "EMABackpressureDetector"},
     r"invalid secondary_tiers\[0\]\.backpressure\.failure_threshold = 0: expected an integer >= 1"),
    ({"warmup_completions": "ten"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"invalid secondary_tiers\[0\]\.backpressure\.warmup_completions = 'ten'"),
    ({"policy": "DropStorePolicy"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"invalid key secondary_tiers\[0\]\.backpressure\.policy: name the policy with policy_cls"),
    ({"clock": "wall"}, {"backpressure_cls": "EMABackpressureDetector"},
     r"invalid key secondary_tiers\[0\]\.backpressure\.clock"),
])
def test_bad_backpressure_settings_raise_config_errors_naming_the_key(
        tier_bp: dict[str, Any] | None, top_bp: dict[str, Any] | None, message: str) -> None:
    tier = fs() if tier_bp is None else fs(backpressure=tier_bp)
    config = engine_config([tier], **({} if top_bp is None else {"backpressure": top_bp}))
    with pytest.raises(ConfigError, match=message):
        build_detectors(config)
    with pytest.raises(ConfigError, match=message):  # the engine's spec fails before any tier opens
        load_spec(config)


# ------------------------------------------------------------------------------------------------
# The engine: a slow tier sheds stores, everything else keeps working
# ------------------------------------------------------------------------------------------------

BLOCK = 4
LAYERS = 2
HEADS = 2
DIM = 16
NUM_BLOCKS = 32

#: The test clock of the engine tests: the slow tier advances it, the detector reads it.
CLOCK = FakeClock()


class FakeClockDetector(EMABackpressureDetector):
    """The EMA detector on :data:`CLOCK` (configured by dotted path)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, clock=CLOCK, **kwargs)


class SlowTier(MemoryTier):
    """A memory tier whose every chunk write takes ``seconds_per_chunk`` of :data:`CLOCK`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds_per_chunk = float(self.config.options.get("seconds_per_chunk", 0.0))

    async def write(self, key: bytes, src: memoryview) -> None:
        CLOCK.advance(self.seconds_per_chunk)
        await super().write(key, src)


def geometry() -> KVGeometry:
    return KVGeometry("test/model", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                      dtype="float16", block_size=BLOCK)


SLOT_BYTES = geometry().slot_bytes(1)  # 4096: one chunk is 1/256 MiB
#: Slow-tier write time per chunk making one sample exactly 4.0 s/MiB.
SLOW_S = 4.0 * SLOT_BYTES / MIB
SLOW = "1:SlowTier"


def device_kv() -> list[torch.Tensor]:
    return [torch.ones((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.float16) for _ in range(LAYERS)]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50_000) for _ in range(BLOCK)] for _ in range(n)]  # one chunk each


def slow_engine_config(second_tier: dict[str, Any] | None = None, slots: int = 4) -> dict[str, Any]:
    slow = {
        "type": "SlowTier", "module_path": __name__, "capacity_bytes": 1 << 24, "seconds_per_chunk": SLOW_S,
        "backpressure": {"backpressure_cls": f"{__name__}.FakeClockDetector", "high_water_s": 1.0,
                         "low_water_s": 0.25, "alpha": 1.0, "warmup_completions": 2, "cooldown_s": 0.0},
    }
    tiers = [slow] + ([second_tier] if second_tier is not None else [])
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": slots * SLOT_BYTES, "secondary_tiers": tiers}


def scrape(engine: kvtier.Engine) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(engine.metrics.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def bp_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.manager" and "back-pressure" in r.getMessage()]


def cascade_jobs(engine: kvtier.Engine, label: str) -> int:
    return engine.manager.jobs_in_flight_by_tier()[label].cascade_jobs


@pytest.mark.anyio
async def test_a_slow_tier_sheds_stores_without_jobs_or_pins_and_still_serves_loads(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.manager")
    fast = {"type": "memory", "capacity_bytes": 1 << 24}
    work = prompts(12, seed=3)
    async with kvtier.open(slow_engine_config(fast), geometry(), device_kv()) as engine:
        slow_tier = engine.tiers[0]
        # Warm-up (2 samples) and one more admitted store: 4.0 s/MiB > high water 1.0.
        for i in range(3):
            assert await engine.store(work[i], [i]) == BLOCK
            assert cascade_jobs(engine, SLOW) == 1  # admitted: a job, pinning the chunk
            await engine.drain()
        assert slow_tier.statistics().stores_completed == 3
        assert bp_messages(caplog) == [f"tier {SLOW}: back-pressure on (store latency EMA 4 s/MiB); "
                                       "stores to it are shed"]

        # Under pressure: the slow tier gets no job and holds no host slot; the fast tier gets its own.
        for i in range(3, 8):
            assert await engine.store(work[i], [i]) == BLOCK
            assert cascade_jobs(engine, SLOW) == 0
            assert cascade_jobs(engine, "2:memory") == 1
            assert engine.host.statistics().pinned_slots == 1  # the fast tier's read pin only
            await engine.drain()
        assert slow_tier.statistics().stores_completed == 3
        assert engine.tiers[1].statistics().stores_completed == 8

        # Host hits keep being served, and a load still promotes from the pressured tier.
        assert await engine.load(work[7], [20]) == BLOCK
        outcome = await engine.load_with_sources(work[0], [21])  # evicted from the 4-slot host tier
        assert outcome.tokens == BLOCK and outcome.tokens_by_tier == {SLOW: BLOCK}

        p = scrape(engine)
        tier = frozenset({("tier", SLOW)})
        assert p[("kvtier_kv_offload_tiering_backpressure_stores_dropped_total", tier)] == 5
        assert p[("kvtier_kv_offload_tiering_backpressure_blocks_dropped_total", tier)] == 5
        assert p[("kvtier_kv_offload_tiering_backpressure_store_latency_ema", tier)] == 4.0
        assert p[("kvtier_tier_backpressure_active", tier)] == 1
        assert ("kvtier_tier_backpressure_active", frozenset({("tier", "2:memory")})) not in p

        # The tier recovers: silence decays the EMA (2 s half-life) below low water, stores resume.
        slow_tier.seconds_per_chunk = 0.0
        CLOCK.advance(9.0)
        assert await engine.store(work[8], [8]) == BLOCK
        assert cascade_jobs(engine, SLOW) == 1
        await engine.drain()
        assert slow_tier.statistics().stores_completed == 4
        assert scrape(engine)[("kvtier_tier_backpressure_active", tier)] == 0
    messages = bp_messages(caplog)
    assert len(messages) == 2 and messages[1].startswith(f"tier {SLOW}: back-pressure off")


@pytest.mark.anyio
async def test_failing_stores_trip_back_pressure_once_and_reset_cache_clears_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.manager")
    config = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "secondary_tiers": [{"type": "faulty", "fail_write_fraction": 1.0, "backpressure": {
            "backpressure_cls": "EMABackpressureDetector", "failure_threshold": 2, "decay_half_life_s": 0.0}}],
    }
    work = prompts(6, seed=4)
    async with kvtier.open(config, geometry(), device_kv()) as engine:
        faulty = engine.tiers[0]
        for i in range(2):
            assert await engine.store(work[i], [i]) == BLOCK
            await engine.drain()
        assert engine.manager.statistics().cascade_job_failures["1:faulty"] == 2
        for i in range(2, 5):
            assert await engine.store(work[i], [i]) == BLOCK
            assert cascade_jobs(engine, "1:faulty") == 0 and engine.host.statistics().pinned_slots == 0
        await engine.drain()
        assert faulty.statistics().failures == {("store", "io_error"): 2}
        assert await engine.load(work[4], [10]) == BLOCK  # the host tier keeps serving
        stats = engine.manager.statistics()
        assert stats.backpressure_stores_dropped == {"1:faulty": 3}
        assert stats.backpressure_active == {"1:faulty": True}
        assert stats.backpressure_store_latency_ema == {"1:faulty": pytest.approx(4 * 0.010)}

        await engine.reset_cache()
        assert engine.manager.statistics().backpressure_active == {"1:faulty": False}
        assert await engine.store(work[5], [5]) == BLOCK
        assert cascade_jobs(engine, "1:faulty") == 1  # warm-up again: the store is tried
    messages = bp_messages(caplog)
    assert len(messages) == 2
    assert messages[0] == ("tier 1:faulty: back-pressure on after 2 consecutive failed stores "
                           "(latency EMA 0.04 s/MiB); stores to it are shed")
    assert messages[1].startswith("tier 1:faulty: back-pressure off")


@pytest.mark.anyio
async def test_a_tier_that_keeps_failing_is_reported_once_until_a_store_succeeds(
        caplog: pytest.LogCaptureFixture) -> None:
    # DropStorePolicy: idle decay clears the pressure (8 s from 4 x high to below low), one probe
    # store goes through and fails, pressure is back. Those cycles must not be logged each time.
    caplog.set_level(logging.INFO, logger="kvtier.manager")
    config = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "secondary_tiers": [{"type": "faulty", "fail_write_fraction": 1.0, "backpressure": {
            "backpressure_cls": f"{__name__}.FakeClockDetector", "policy_cls": "DropStorePolicy",
            "high_water_s": 1.0, "low_water_s": 0.25, "failure_threshold": 2, "cooldown_s": 0.0}}],
    }
    work = prompts(10, seed=6)
    async with kvtier.open(config, geometry(), device_kv()) as engine:
        faulty = engine.tiers[0]
        for i in range(2):
            assert await engine.store(work[i], [i]) == BLOCK
            await engine.drain()
        for i in range(2, 8, 2):  # three decay/probe cycles
            assert await engine.store(work[i], [i]) == BLOCK
            assert cascade_jobs(engine, "1:faulty") == 0  # shed
            CLOCK.advance(9.0)
            assert await engine.store(work[i + 1], [i + 1]) == BLOCK
            assert cascade_jobs(engine, "1:faulty") == 1  # the probe
            await engine.drain()
        assert engine.manager.statistics().cascade_job_failures["1:faulty"] == 5
        assert engine.manager.statistics().backpressure_active == {"1:faulty": True}
        assert bp_messages(caplog) == ["tier 1:faulty: back-pressure on after 2 consecutive failed stores "
                                       "(latency EMA 4 s/MiB); stores to it are shed"]

        faulty.fail_write_fraction = 0.0  # the disk has room again
        CLOCK.advance(9.0)
        assert await engine.store(work[8], [8]) == BLOCK
        await engine.drain()
        assert faulty.statistics().stores_completed == 1  # successful store jobs
        messages = bp_messages(caplog)
        assert len(messages) == 2 and messages[1].startswith("tier 1:faulty: back-pressure off")
        # Failing again later is a new episode: reported again.
        faulty.fail_write_fraction = 1.0
        for i in (9, 0):
            assert await engine.store(work[i], [i % 8 + 16]) == BLOCK
            await engine.drain()
    assert len(bp_messages(caplog)) == 3 and bp_messages(caplog)[2].startswith(
        "tier 1:faulty: back-pressure on after 2 consecutive failed stores")


class StuckTier(MemoryTier):
    """A memory tier whose writes never finish (until the engine closes and cancels them)."""

    async def write(self, key: bytes, src: memoryview) -> None:
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_stores_cancelled_by_close_do_not_count_as_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.manager")
    config = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 * SLOT_BYTES,
        "secondary_tiers": [{"type": "StuckTier", "module_path": __name__, "capacity_bytes": 1 << 24,
                             "backpressure": {"backpressure_cls": "EMABackpressureDetector",
                                              "failure_threshold": 1}}],
    }
    work = prompts(3, seed=7)
    async with kvtier.open(config, geometry(), device_kv(), flush_timeout_s=0) as engine:
        for i, tokens in enumerate(work):
            assert await engine.store(tokens, [i]) == BLOCK
        assert cascade_jobs(engine, "1:StuckTier") == 3
        (detector,) = engine.manager.backpressure_detectors
    assert engine.manager.statistics().cascade_job_failures["1:StuckTier"] == 3  # seen, as cancelled
    assert detector is not None and detector.statistics().consecutive_failures == 0
    assert bp_messages(caplog) == []


@pytest.mark.anyio
async def test_without_backpressure_settings_every_store_reaches_the_tier() -> None:
    config = slow_engine_config()
    del config["secondary_tiers"][0]["backpressure"]
    work = prompts(6, seed=5)
    async with kvtier.open(config, geometry(), device_kv()) as engine:
        assert engine.manager.backpressure_detectors == (None,)
        for i, tokens in enumerate(work):
            assert await engine.store(tokens, [i]) == BLOCK
            assert cascade_jobs(engine, SLOW) == 1
            await engine.drain()
        assert engine.tiers[0].statistics().stores_completed == 6
        assert not any("backpressure" in name for name, _ in scrape(engine))

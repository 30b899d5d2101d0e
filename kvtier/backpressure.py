"""Back-pressure: shed cascade stores to a secondary tier that cannot keep up.

Semantics callers rely on:

* A detector watches ONE secondary tier. The manager asks :meth:`BackpressureDetector.should_store`
  once per store job it is about to submit to that tier; ``False`` means the job is not created at
  all: no job, no pinned host slot, that tier simply does not get those chunks (the host copy and
  the other tiers are unaffected). Loads are never throttled.
* Every store job of the tier that the manager sees finish feeds the detector: a success as
  seconds per MiB from submit to the result (:meth:`~BackpressureDetector.update`), a failure
  through :meth:`~BackpressureDetector.on_store_failed`.
* Every time the detector reads comes from its ``clock`` (``time.monotonic`` unless one is
  given); ``update``'s ``submit_time`` must come from the same clock. Tests pass a fake clock.
* Detectors and policies are NOT thread-safe: they are driven from the engine's loop thread.
  :meth:`~BackpressureDetector.statistics` only reads plain fields (no decay, no side effect), so a
  metrics scrape may call it from another thread.
* Configuration (``backpressure`` at the top level and per tier, merged field by field, tier
  wins): ``backpressure_cls`` names the detector, ``policy_cls`` optionally the policy — a short
  name from this module or a dotted path ``pkg.mod.Class`` to a subclass of
  :class:`BackpressureDetector` / :class:`BackpressurePolicy`; every other field is a detector
  argument, the detector's :meth:`~BackpressureDetector.default_config` filling the ones not given.
  A field no detector argument takes is a :class:`~kvtier.errors.ConfigError` naming its key path,
  never accepted and ignored.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.config import EngineConfig, TierConfig

__all__ = [
    "BackpressureDetector",
    "BackpressurePolicy",
    "BackpressureStatistics",
    "DropStorePolicy",
    "EMABackpressureDetector",
    "ThrottledDropPolicy",
    "build_detector",
    "build_detectors",
]

_MIB = 1 << 20
_DOTTED_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
#: Constructor arguments a configuration cannot set (objects, not scalars).
_NOT_FROM_CONFIG = frozenset({"policy", "clock"})


# --------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------


class _ArgumentError(ConfigError):
    """A detector or policy argument is invalid; ``key`` is the argument's name, so a builder
    can re-raise it naming the full key path (``secondary_tiers[0].backpressure.alpha``)."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(_message(f"backpressure.{key}", value, allowed))


def _message(path: str, value: Any, allowed: str) -> str:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"invalid {path} = {shown}: expected {allowed}"


def _number(key: str, value: Any, *, gt: float | None = None, ge: float | None = None,
            le: float | None = None) -> float:
    """``value`` as a finite float within the bounds, else :class:`_ArgumentError`."""
    bounds = " and ".join(f"{op} {bound:g}" for op, bound in ((">", gt), (">=", ge), ("<=", le))
                          if bound is not None)
    allowed = "a finite number" + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _ArgumentError(key, value, allowed)
    if (gt is not None and not value > gt) or (ge is not None and not value >= ge) or (
            le is not None and not value <= le):
        raise _ArgumentError(key, value, allowed)
    return float(value)


def _count(key: str, value: Any, *, ge: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < ge:
        raise _ArgumentError(key, value, f"an integer >= {ge}")
    return value


# --------------------------------------------------------------------------------------------
# Policies: what to do with a store while the detector reports pressure
# --------------------------------------------------------------------------------------------


class BackpressurePolicy(abc.ABC):
    """Decides, store by store, whether a store goes ahead while its tier is under pressure.

    The detector tells the policy about every store it drops (:meth:`on_store_skipped`, including
    the drops of its own cooldown); :meth:`pop_stores_dropped` returns ``(stores, blocks)`` dropped
    since the last call and resets them. A subclass implements :meth:`should_store`; one with
    state of its own extends :meth:`reset` (calling ``super().reset()``). Subclasses are built
    with no arguments when named by ``policy_cls``.
    """

    def __init__(self) -> None:
        self._stores_dropped = 0
        self._blocks_dropped = 0

    @abc.abstractmethod
    def should_store(self, detector: BackpressureDetector) -> bool:
        """Whether the next store to the detector's tier goes ahead."""

    def on_store_skipped(self, num_blocks: int) -> None:
        """Count one dropped store of ``num_blocks`` blocks (chunks, one key each)."""
        self._stores_dropped += 1
        self._blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        """``(stores, blocks)`` dropped since the last call; both counters restart at zero."""
        counts = (self._stores_dropped, self._blocks_dropped)
        self._stores_dropped = self._blocks_dropped = 0
        return counts

    def reset(self) -> None:
        self._stores_dropped = self._blocks_dropped = 0


class DropStorePolicy(BackpressurePolicy):
    """Drop every store while the tier is under pressure."""

    def should_store(self, detector: BackpressureDetector) -> bool:
        return not detector.is_under_pressure()


class ThrottledDropPolicy(BackpressurePolicy):
    """Drop a share of stores that grows with how far the tier is past its high water mark.

    ``drop_rate = min(1, overshoot / ramp_factor)`` with ``overshoot`` from
    :meth:`BackpressureDetector.overshoot` (``(ema - high) / high`` for the EMA detector): with the
    default ``ramp_factor=2.0`` nothing is dropped at the high water mark and everything at three
    times it. In between, the rates of successive decisions add up in an accumulator and a store
    is dropped each time it reaches one (the fraction carries over), so a rate of 0.25 drops
    exactly every fourth store. A detector without an overshoot makes this policy drop every store
    while pressured (as :class:`DropStorePolicy`).
    """

    def __init__(self, ramp_factor: float = 2.0) -> None:
        super().__init__()
        self.ramp_factor = _number("ramp_factor", ramp_factor, gt=0)
        self._drop_accumulator = 0.0

    def should_store(self, detector: BackpressureDetector) -> bool:
        if not detector.is_under_pressure():
            return True
        overshoot = detector.overshoot()
        if overshoot is None:
            return False
        drop_rate = min(1.0, overshoot / self.ramp_factor)
        if drop_rate <= 0.0:
            return True
        if drop_rate >= 1.0:
            return False
        self._drop_accumulator += drop_rate
        if self._drop_accumulator >= 1.0:
            self._drop_accumulator -= 1.0
            return False
        return True

    def reset(self) -> None:
        super().reset()
        self._drop_accumulator = 0.0


# --------------------------------------------------------------------------------------------
# Detectors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackpressureStatistics:
    """A detector's state as the metrics and the manager's log lines show it."""

    under_pressure: bool
    #: Pressure was forced by consecutive failed stores (not by latency).
    failure_tripped: bool
    #: Seconds per MiB; ``None`` for a detector that keeps no latency average.
    store_latency_ema: float | None
    consecutive_failures: int


class BackpressureDetector(abc.ABC):
    """Watches one tier's store completions and says whether the next store goes ahead.

    A subclass implements :meth:`on_store_completed`, :meth:`is_under_pressure`, :meth:`reset` and
    :meth:`statistics`; it may treat failures as pressure (:meth:`on_store_failed`), give the
    severity the throttling policy scales with (:meth:`overshoot`) and per-tier defaults of its
    arguments (:meth:`default_config`). ``policy`` defaults to :class:`ThrottledDropPolicy`;
    ``clock`` to ``time.monotonic``.
    """

    def __init__(self, policy: BackpressurePolicy | None = None, *,
                 clock: Callable[[], float] | None = None) -> None:
        if policy is not None and not isinstance(policy, BackpressurePolicy):
            raise TypeError(f"policy must be a BackpressurePolicy, got {type(policy).__name__}")
        self._policy = policy if policy is not None else ThrottledDropPolicy()
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    @classmethod
    def default_config(cls, tier_type: str, locality: str | None = None) -> dict[str, Any]:
        """Arguments used for fields the configuration leaves out, for a tier of ``tier_type``
        (``"fs"``, ``"obj"``, a class name) at ``locality`` (``"LOCAL"``, ``"REMOTE"`` or None)."""
        return {}

    @abc.abstractmethod
    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """A store of ``num_bytes`` (> 0) succeeded ``elapsed_s`` seconds after its submit."""

    def on_store_failed(self) -> None:
        """A store failed. Ignored unless the detector treats failures as pressure."""

    @abc.abstractmethod
    def is_under_pressure(self) -> bool:
        """Whether stores are being throttled now (may apply time-based recovery first)."""

    def overshoot(self) -> float | None:
        """How far past its high water mark the tier is, relative (0 = at the mark), or ``None``
        when the detector has no such measure."""
        return None

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything observed (``reset_cache``); the policy's state included."""

    @abc.abstractmethod
    def statistics(self) -> BackpressureStatistics:
        """The current state, without side effects (callable from another thread)."""

    def update(self, submit_time: float, num_bytes: int) -> None:
        """A store submitted at ``submit_time`` (this detector's :attr:`clock`) succeeded now,
        having moved ``num_bytes``; a job that moved no bytes tells nothing and is ignored."""
        if num_bytes <= 0:
            return
        self.on_store_completed(max(0.0, self.clock() - submit_time), num_bytes)

    def should_store(self, num_blocks: int) -> bool:
        """Whether a store of ``num_blocks`` blocks goes ahead; a dropped one is counted."""
        if self._policy.should_store(self):
            return True
        self._policy.on_store_skipped(num_blocks)
        return False

    def pop_stores_dropped(self) -> tuple[int, int]:
        """``(stores, blocks)`` dropped since the last call (the policy's counters, reset)."""
        return self._policy.pop_stores_dropped()


class EMABackpressureDetector(BackpressureDetector):
    """An exponential moving average of store latency in seconds per MiB, with hysteresis.

    * Each successful store gives one sample, ``elapsed_since_submit / (bytes / 2**20)``, so jobs
      of any size compare. The first ``warmup_completions`` samples are only collected; the EMA
      starts at their mean and no latency pressure is signalled before.
    * Then ``ema = alpha * sample + (1 - alpha) * ema``. Above ``high_water_s`` the tier is under
      pressure; below ``low_water_s`` pressure clears (between the two the state holds). Ten
      consecutive samples that leave the EMA below ``low_water_s`` make the tier *healthy*:
      :meth:`should_store` then answers True without asking the policy.
    * While under pressure and no sample arrives (its stores are being dropped), the EMA halves
      every ``decay_half_life_s`` seconds (applied when pressure is checked); once below
      ``low_water_s`` pressure clears, so a silent tier gets probe stores again.
    * For ``cooldown_s`` after pressure clears, every second store is dropped, so the backlog
      does not return at once.
    * With ``failure_threshold`` (default 3 for ``fs`` and ``obj`` tiers, else off), that many
      consecutive failed stores force pressure, warm-up or not, and raise the EMA to at least four
      times ``high_water_s`` (all stores dropped under the default policy until decay lets a probe
      through). A success resets the streak.

    Defaults (:meth:`default_config`): a LOCAL tier (``fs`` without ``locality: REMOTE``, and any
    other type) ``high_water_s=0.010``, ``low_water_s=0.002`` s/MiB; a NETWORK tier (``obj``, or
    ``locality: REMOTE``) ``0.050`` and ``0.010``.
    """

    HEALTHY_STREAK = 10
    FAILURE_EMA_FACTOR = 4.0
    LOCAL_WATER_S = (0.010, 0.002)
    NETWORK_WATER_S = (0.050, 0.010)
    NETWORK_TIER_TYPES = frozenset({"obj"})
    STORAGE_TIER_TYPES = frozenset({"fs", "obj"})
    DEFAULT_FAILURE_THRESHOLD = 3

    @classmethod
    def default_config(cls, tier_type: str, locality: str | None = None) -> dict[str, Any]:
        remote = locality is not None and str(locality).upper() == "REMOTE"
        high, low = cls.NETWORK_WATER_S if remote or tier_type in cls.NETWORK_TIER_TYPES else cls.LOCAL_WATER_S
        config: dict[str, Any] = {"high_water_s": high, "low_water_s": low}
        if tier_type in cls.STORAGE_TIER_TYPES:
            config["failure_threshold"] = cls.DEFAULT_FAILURE_THRESHOLD
        return config

    def __init__(
        self,
        high_water_s: float,
        low_water_s: float,
        alpha: float = 0.15,
        warmup_completions: int = 10,
        decay_half_life_s: float = 2.0,
        cooldown_s: float = 1.0,
        failure_threshold: int | None = None,
        policy: BackpressurePolicy | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(policy, clock=clock)
        self.high_water_s = _number("high_water_s", high_water_s, gt=0)
        self.low_water_s = _number("low_water_s", low_water_s, ge=0)
        if self.low_water_s > self.high_water_s:
            raise _ArgumentError("low_water_s", low_water_s, f"a number <= high_water_s ({high_water_s})")
        self.alpha = _number("alpha", alpha, gt=0, le=1)
        self.warmup_completions = _count("warmup_completions", warmup_completions, ge=0)
        self.decay_half_life_s = _number("decay_half_life_s", decay_half_life_s, ge=0)
        self.cooldown_s = _number("cooldown_s", cooldown_s, ge=0)
        self.failure_threshold = (
            None if failure_threshold is None else _count("failure_threshold", failure_threshold, ge=1)
        )
        self._init_state()

    def _init_state(self) -> None:
        self._ema = 0.0
        self._under_pressure = False
        self._completions = 0
        self._warmup_samples: list[float] = []
        self._last_update = self.clock()
        self._healthy_streak = 0
        self._cleared_at: float | None = None  # when pressure last cleared (cooldown start)
        self._cooldown_count = 0
        self._consecutive_failures = 0
        self._failure_tripped = False

    @property
    def store_latency_ema(self) -> float:
        """The EMA in seconds per MiB (0.0 until warm-up ends)."""
        return self._ema

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        if num_bytes <= 0:
            return
        now = self.clock()
        sample = elapsed_s / (num_bytes / _MIB)
        self._consecutive_failures = 0
        self._completions += 1
        if self._completions <= self.warmup_completions:
            self._warmup_samples.append(sample)
            if self._completions == self.warmup_completions:
                self._ema = sum(self._warmup_samples) / len(self._warmup_samples)
                self._last_update = now
            return
        self._ema = self.alpha * sample + (1.0 - self.alpha) * self._ema
        self._last_update = now
        if self._ema > self.high_water_s:
            self._under_pressure = True
            self._cleared_at = None
            self._healthy_streak = 0
        elif self._ema < self.low_water_s:
            if self._under_pressure:
                self._clear(now)
            self._failure_tripped = False
            self._healthy_streak += 1
        else:
            self._healthy_streak = 0

    def on_store_failed(self) -> None:
        if self.failure_threshold is None:
            return
        self._consecutive_failures += 1
        self._healthy_streak = 0
        if self._consecutive_failures < self.failure_threshold:
            return
        self._ema = max(self._ema, self.FAILURE_EMA_FACTOR * self.high_water_s)
        self._last_update = self.clock()
        self._under_pressure = True
        self._failure_tripped = True
        self._cleared_at = None

    def _clear(self, now: float) -> None:
        self._under_pressure = False
        self._failure_tripped = False
        self._cleared_at = now
        self._cooldown_count = 0

    def is_under_pressure(self) -> bool:
        if self._under_pressure and (self._completions >= self.warmup_completions or self._failure_tripped):
            now = self.clock()
            dt = now - self._last_update
            if dt > 0 and self.decay_half_life_s > 0:
                self._ema *= 0.5 ** (dt / self.decay_half_life_s)
                self._last_update = now
            if self._ema < self.low_water_s:
                self._clear(now)
        return self._under_pressure

    def overshoot(self) -> float:
        return max(0.0, self._ema - self.high_water_s) / self.high_water_s

    def should_store(self, num_blocks: int) -> bool:
        pressured = self.is_under_pressure()
        if not pressured and self._healthy_streak >= self.HEALTHY_STREAK:
            return True
        if not pressured and self._cleared_at is not None and self.clock() - self._cleared_at < self.cooldown_s:
            self._cooldown_count += 1
            if self._cooldown_count % 2 == 0:
                self._policy.on_store_skipped(num_blocks)
                return False
        return super().should_store(num_blocks)

    def reset(self) -> None:
        self._init_state()
        self._policy.reset()

    def statistics(self) -> BackpressureStatistics:
        return BackpressureStatistics(
            under_pressure=self._under_pressure,
            failure_tripped=self._failure_tripped,
            store_latency_ema=self._ema,
            consecutive_failures=self._consecutive_failures,
        )


# --------------------------------------------------------------------------------------------
# Building detectors from the configuration
# --------------------------------------------------------------------------------------------

#: Short names accepted by ``backpressure_cls`` and ``policy_cls``.
DETECTORS: Mapping[str, type[BackpressureDetector]] = {"EMABackpressureDetector": EMABackpressureDetector}
POLICIES: Mapping[str, type[BackpressurePolicy]] = {
    "DropStorePolicy": DropStorePolicy,
    "ThrottledDropPolicy": ThrottledDropPolicy,
}

_T = TypeVar("_T")


def _resolve(name: str, base: type, short_names: Mapping[str, type[_T]], path: str) -> type[_T]:
    """The class ``name`` denotes: a short name of ``short_names`` or a dotted ``pkg.mod.Class``
    path to a subclass of ``base``; anything else is a :class:`ConfigError` naming ``path``."""
    if name in short_names:
        return short_names[name]
    allowed = (f"one of {', '.join(map(repr, short_names))} or a dotted path pkg.module.Class "
               f"to a {base.__name__} subclass")
    if not _DOTTED_RE.match(name):
        raise ConfigError(_message(path, name, allowed))
    module_name, _, class_name = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise ConfigError(
            f"{_message(path, name, allowed)}; cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        problem = "does not exist" if cls is None else f"is not a {base.__name__} subclass"
        raise ConfigError(f"{_message(path, name, allowed)}; {module_name}.{class_name} {problem}")
    return cast("type[_T]", cls)


def build_detector(
    settings: Mapping[str, Any],
    *,
    tier_type: str,
    locality: str | None = None,
    key_path: Callable[[str], str] = lambda key: f"backpressure.{key}",
) -> BackpressureDetector:
    """A detector from one tier's merged ``backpressure`` settings.

    ``key_path`` names the configuration path of a field (for error messages). Fields the
    settings leave out come from the detector's ``default_config(tier_type, locality=locality)``.
    """
    if "backpressure_cls" not in settings:
        raise ConfigError(f"missing required key {key_path('backpressure_cls')}: expected a non-empty string")
    detector_cls = _resolve(str(settings["backpressure_cls"]), BackpressureDetector, DETECTORS,
                            key_path("backpressure_cls"))
    policy: BackpressurePolicy | None = None
    policy_name = settings.get("policy_cls")
    if policy_name is not None:
        policy_cls = _resolve(str(policy_name), BackpressurePolicy, POLICIES, key_path("policy_cls"))
        try:
            policy = policy_cls()
        except Exception as exc:
            raise ConfigError(
                f"invalid {key_path('policy_cls')} = {policy_name!r}: constructing it with no "
                f"arguments failed ({type(exc).__name__}: {exc})"
            ) from exc

    given = {k: v for k, v in settings.items() if k not in ("backpressure_cls", "policy_cls")}
    parameters = inspect.signature(detector_cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = {
        name for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    } - _NOT_FROM_CONFIG
    for key in given:
        if key in _NOT_FROM_CONFIG:
            hint = "name the policy with policy_cls" if key == "policy" else "it is not a configuration value"
            raise ConfigError(f"invalid key {key_path(key)}: {hint}")
        if not takes_any and key not in accepted:
            raise ConfigError(
                f"unknown key {key_path(key)} for {detector_cls.__name__}; allowed keys: "
                f"{', '.join(sorted({'backpressure_cls', 'policy_cls', *accepted}))}"
            )
    # By keyword, as vLLM calls it: a subclass written for vLLM declares ``*, locality``; a
    # ``None`` answer (vLLM's base class) means no defaults.
    kwargs = dict(detector_cls.default_config(tier_type, locality=locality) or {})
    kwargs.update(given)
    for name, p in parameters.items():
        if (p.default is inspect.Parameter.empty and name not in kwargs and name not in _NOT_FROM_CONFIG
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)):
            raise ConfigError(f"missing required key {key_path(name)} for {detector_cls.__name__}")
    try:
        return detector_cls(policy=policy, **kwargs)
    except _ArgumentError as exc:
        raise ConfigError(_message(key_path(exc.key), exc.value, exc.allowed)) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"invalid {key_path('backpressure_cls')} = {settings['backpressure_cls']!r}: "
            f"{detector_cls.__name__} rejected its arguments ({type(exc).__name__}: {exc})"
        ) from exc


def build_detectors(config: EngineConfig) -> tuple[BackpressureDetector | None, ...]:
    """One detector per ``config.secondary_tiers`` entry (``None`` for a tier with no
    back-pressure settings), from the settings :meth:`EngineConfig.backpressure_for` merges."""
    detectors: list[BackpressureDetector | None] = []
    for tier in config.secondary_tiers:
        settings = config.backpressure_for(tier)
        if settings is None:
            detectors.append(None)
            continue
        locality = tier.locality.value if tier.locality is not None else None
        detectors.append(build_detector(settings, tier_type=tier.type, locality=locality,
                                        key_path=_key_path(tier)))
    return tuple(detectors)


def _key_path(tier: TierConfig) -> Callable[[str], str]:
    """Where a merged field came from: the tier's own dict wins over the top-level one."""
    own = tier.backpressure or {}

    def path(key: str) -> str:
        if key in own:
            return f"secondary_tiers[{tier.index}].backpressure.{key}"
        return f"backpressure.{key}"

    return path

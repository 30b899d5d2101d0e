"""The engine configuration: the ``kv_connector_extra_config`` dictionary as an EngineConfig.

:meth:`EngineConfig.from_dict` checks the engine keys (:data:`ENGINE_SCHEMA`), then each
``secondary_tiers`` entry (:class:`~kvtier.config.tiers.TierConfig`), then the rules that join
them (the spec, the chunk size, back-pressure). ``docs/configuration.md`` ("Engine keys")
describes every key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config.redaction import redact_plain
from kvtier.config.schema import (
    DEFAULT_TENANT,
    MODULE_PATH_SPEC,
    FrozenOptions,
    KeySpec,
    did_you_mean,
    invalid,
    parse_section,
    show_value,
)
from kvtier.config.tiers import TierConfig
from kvtier.errors import ConfigError, trim_traceback

__all__ = [
    "EngineConfig",
    "ENGINE_SCHEMA",
    "CPU_SPEC",
    "TIERING_SPEC",
    "BUILTIN_SPECS",
    "MAX_SECONDARY_TIERS",
]

CPU_SPEC = "CPUOffloadingSpec"
TIERING_SPEC = "TieringOffloadingSpec"
BUILTIN_SPECS: tuple[str, ...] = (CPU_SPEC, TIERING_SPEC)

#: Most ``secondary_tiers`` entries, so a hostile or mistaken config cannot make start-up explode.
MAX_SECONDARY_TIERS = 64

_TAG_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def _printable_line(value: Any) -> str | None:
    return None if value.isprintable() else "must be printable, on one line"


def _tag(value: Any) -> str | None:
    return None if _TAG_RE.fullmatch(value) else "may hold letters, digits, '.', '_' and '-' only"


#: Engine keys (vLLM's ``CPUOffloadingSpec`` keys and those ``TieringOffloadingSpec`` adds).
#: ``secondary_tiers`` is parsed separately (each entry by :class:`TierConfig`).
ENGINE_SCHEMA: Mapping[str, KeySpec] = {
    "spec_name": KeySpec("str", default=CPU_SPEC, non_empty=True, max_len=256),
    "spec_module_path": MODULE_PATH_SPEC,
    "cpu_bytes_to_use": KeySpec("int", gt=0, help="total host bytes across all workers"),
    "block_size": KeySpec("int", default=None, nullable=True, gt=0, help="tokens per chunk"),
    "blocks_per_chunk": KeySpec("int", default=None, nullable=True, gt=0),
    "eviction_policy": KeySpec("str", default="lru", non_empty=True, max_len=256),
    "cache_policy_module_path": MODULE_PATH_SPEC,
    "store_threshold": KeySpec("int", default=0, ge=0),
    "max_tracker_size": KeySpec("int", default=64000, gt=0),
    "offload_prompt_only": KeySpec("bool", default=True),
    "self_describing_kv_events": KeySpec("bool", default=False),
    "tier_poll_interval_s": KeySpec("float", default=0.001, gt=0),
    "sync_load_budget_bytes": KeySpec("int", default=0, ge=0),
    "canonical_layout": KeySpec("bool", default=False),
    "backpressure": KeySpec("backpressure", default=None, nullable=True),
    "model_revision": KeySpec("str", default=None, nullable=True, non_empty=True, max_len=256,
                              check=_printable_line, help="part of the run's namespace when set"),
    "namespace_tag": KeySpec("str", default=None, nullable=True, non_empty=True, max_len=64,
                             check=_tag, help="part of the run's namespace when set"),
    "tenant_cpu_bytes": KeySpec("budgets", default=None, nullable=True,
                                help=f"host-memory budget per tenant; {DEFAULT_TENANT!r}: every other request"),
}


#: vLLM keys that tune machinery kvtier does not have: accepted at vLLM's default, so that a vLLM
#: configuration loads unchanged, and refused otherwise (a value that could not act).
_VLLM_ONLY: Mapping[str, str] = {
    "tier_poll_interval_s": "kvtier has no tier-poll thread (tiers wake the engine as soon as a job "
                            "or a lookup verdict arrives), so there is no interval to set",
    "sync_load_budget_bytes": "every kvtier load is awaited by its caller until its bytes are on the "
                              "device, so there is no asynchronous step for a budget to save",
    "canonical_layout": "kvtier's host pages have one layout of their own (a rank's own heads, "
                        "docs/internals.md), not vLLM's canonical format",
}


@dataclass(frozen=True, slots=True, repr=False)
class EngineConfig:
    """The validated engine configuration.

    Build it with :meth:`from_dict` (or :meth:`coerce`); the constructor itself does not
    validate. Immutable: components may share one instance freely.
    """

    cpu_bytes_to_use: int
    spec_name: str = CPU_SPEC
    spec_module_path: str | None = None
    block_size: int | None = None
    blocks_per_chunk: int | None = None
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64000
    secondary_tiers: tuple[TierConfig, ...] = ()
    offload_prompt_only: bool = True
    self_describing_kv_events: bool = False
    tier_poll_interval_s: float = 0.001
    sync_load_budget_bytes: int = 0
    canonical_layout: bool = False
    backpressure: Mapping[str, Any] | None = None
    model_revision: str | None = None
    namespace_tag: str | None = None
    tenant_cpu_bytes: Mapping[str, int] | None = None

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any) -> EngineConfig:
        """Validate ``d`` (the ``kv_connector_extra_config`` mapping) into an ``EngineConfig``.

        Raises :class:`ConfigError` for the first problem found: its message names the key
        path, the offending value (secrets as ``'***'``) and what is allowed; its traceback ends
        here, not in the schema machinery.
        """
        try:
            return cls._from_dict(d)
        except ConfigError as exc:
            raise trim_traceback(exc)

    @classmethod
    def _from_dict(cls, d: Any) -> EngineConfig:
        if not isinstance(d, Mapping):
            raise invalid("config", d, "a mapping (the kv_connector_extra_config dict)")
        values = parse_section(d, ENGINE_SCHEMA, "", extra_allowed=("secondary_tiers",))

        spec_name = values["spec_name"]
        if spec_name not in BUILTIN_SPECS and values["spec_module_path"] is None:
            raise ConfigError(
                f"invalid spec_name = {show_value(spec_name)}: unknown spec"
                f"{did_you_mean(spec_name, BUILTIN_SPECS)}; expected "
                f"{' or '.join(map(repr, BUILTIN_SPECS))}, or give spec_module_path for a "
                "custom spec class"
            )
        if values["block_size"] is not None and values["blocks_per_chunk"] is not None:
            raise ConfigError(
                f"invalid blocks_per_chunk = {show_value(values['blocks_per_chunk'])} together with "
                f"block_size = {show_value(values['block_size'])}: expected only one of block_size "
                "and blocks_per_chunk"
            )

        for key, why in _VLLM_ONLY.items():
            if values[key] != ENGINE_SCHEMA[key].default:
                raise ConfigError(f"invalid {key} = {show_value(values[key])}: {why}; leave the key out "
                                  f"(or at vLLM's default {show_value(ENGINE_SCHEMA[key].default)})")

        raw_tiers = d.get("secondary_tiers", [])
        if raw_tiers is None:
            raw_tiers = []
        if not isinstance(raw_tiers, (list, tuple)):
            raise invalid("secondary_tiers", raw_tiers, "a list of tier dicts")
        if len(raw_tiers) > MAX_SECONDARY_TIERS:
            raise invalid(
                "secondary_tiers", raw_tiers, f"a list of at most {MAX_SECONDARY_TIERS} tier dicts"
            )
        if raw_tiers and spec_name == CPU_SPEC:
            raise invalid(
                "secondary_tiers", raw_tiers,
                f"an empty list with spec_name {CPU_SPEC!r}; use spec_name {TIERING_SPEC!r} "
                "for secondary tiers",
            )
        tiers = tuple(TierConfig.from_dict(raw, i) for i, raw in enumerate(raw_tiers))

        config = cls(secondary_tiers=tiers, **values)
        if config.is_tiering and config.store_threshold >= 2:
            raise invalid(
                "store_threshold", config.store_threshold,
                f"0 or 1 with {TIERING_SPEC} (the lookup-count threshold is host-only)",
            )
        for tier in tiers:
            if config.backpressure is not None and tier.is_builtin and tier.type == "p2p":
                # The top-level dict applies to every tier, and p2p refuses any detector.
                raise ConfigError(
                    f"invalid backpressure together with {_tier_path(tier)}.type = 'p2p': "
                    "expected no top-level backpressure when a p2p tier is configured"
                )
            merged = config.backpressure_for(tier)
            if merged is not None and "backpressure_cls" not in merged:
                raise ConfigError(
                    f"missing required key {_tier_path(tier)}.backpressure.backpressure_cls: "
                    "expected a non-empty string (here or in the top-level backpressure)"
                )
        return config

    @classmethod
    def coerce(cls, obj: EngineConfig | Mapping[str, Any]) -> EngineConfig:
        """``obj`` itself when already an ``EngineConfig``, else ``from_dict(obj)``."""
        if isinstance(obj, EngineConfig):
            return obj
        return cls.from_dict(obj)

    # --- derived values ----------------------------------------------------------------------
    @property
    def is_tiering(self) -> bool:
        """Whether secondary tiers are in play: the tiering spec, or a custom spec with tiers."""
        if self.spec_name == TIERING_SPEC:
            return True
        return self.spec_name != CPU_SPEC and bool(self.secondary_tiers)

    def resolve_blocks_per_chunk(self, device_block_size: int) -> int:
        """Chunk size in accelerator blocks for a device with ``device_block_size`` tokens per
        block: ``block_size // device_block_size`` when ``block_size`` was given (it must be a
        positive multiple), else ``blocks_per_chunk`` (default 1)."""
        if isinstance(device_block_size, bool) or not isinstance(device_block_size, int) or (
            device_block_size <= 0
        ):
            raise invalid("device_block_size", device_block_size, "an integer > 0")
        if self.block_size is not None:
            if self.block_size % device_block_size != 0:
                raise invalid(
                    "block_size", self.block_size,
                    f"a positive multiple of the accelerator block size {device_block_size}",
                )
            return self.block_size // device_block_size
        return self.blocks_per_chunk if self.blocks_per_chunk is not None else 1

    def num_slots(self, slot_bytes: int) -> int:
        """Whole host slots of ``slot_bytes`` in ``cpu_bytes_to_use``; fewer than one is an
        error (the host tier cannot hold a single chunk)."""
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise invalid("slot_bytes", slot_bytes, "an integer > 0")
        slots = self.cpu_bytes_to_use // slot_bytes
        if slots < 1:
            raise invalid(
                "cpu_bytes_to_use", self.cpu_bytes_to_use,
                f"at least one chunk slot of {slot_bytes} bytes",
            )
        return slots

    def backpressure_for(self, tier: TierConfig) -> Mapping[str, Any] | None:
        """Merged back-pressure settings of ``tier``: the top-level dict, then the tier's own
        fields over it, field by field; ``None`` when neither gives any."""
        if self.backpressure is None and tier.backpressure is None:
            return None
        merged = dict(self.backpressure or {})
        merged.update(tier.backpressure or {})
        return FrozenOptions(merged)

    # --- text forms ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The normalised configuration as a plain dict with every key (defaults included) and
        secrets redacted; ``from_dict`` accepts it back when no secret was set."""
        out: dict[str, Any] = {}
        for key in ENGINE_SCHEMA:
            out[key] = redact_plain(getattr(self, key))
        out["secondary_tiers"] = [t.to_dict() for t in self.secondary_tiers]
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"EngineConfig({fields})"

    __str__ = __repr__


def _tier_path(tier: TierConfig) -> str:
    return f"secondary_tiers[{tier.index}]"

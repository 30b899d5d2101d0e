"""Parse and validate kvtier's configuration and per-request parameters.

``EngineConfig.from_dict`` reads the dictionary vLLM users write in ``kv_connector_extra_config``
(``docs/configuration.md`` describes every key). Anything wrong raises
:class:`kvtier.errors.ConfigError` at start-up with a message naming the key path
(``secondary_tiers[1].n_read_threads``), the offending value (truncated, secrets shown as
``'***'``) and what is allowed — never a silent default. A :class:`ConfigError` from
``from_dict`` has its traceback end there, not in the schema machinery.

Per-request fields (``kv_transfer_params``) are the exception: a bad value there is logged as a
warning on the ``kvtier.config`` logger and ignored; only a forbidden combination of P/D role keys
raises :class:`kvtier.errors.RequestError`.

Secrets (``access_key``, ``secret_key``, ``session_token``) are kept as plain strings for the
tier that needs them, but no ``repr``/``str``/``to_dict``/error message or warning of this package
shows them, whatever container they were written in (:func:`redact`).

The modules, one concept each: :mod:`~kvtier.config.redaction` (hiding credentials),
:mod:`~kvtier.config.schema` (one :class:`KeySpec` per key and the checks that apply it),
:mod:`~kvtier.config.tiers` (``secondary_tiers`` entries), :mod:`~kvtier.config.engine`
(:class:`EngineConfig`) and :mod:`~kvtier.config.request` (:class:`RequestParams`).
"""

from __future__ import annotations

from kvtier.config.engine import BUILTIN_SPECS, ENGINE_SCHEMA, EngineConfig
from kvtier.config.redaction import SECRET_KEYS, redact
from kvtier.config.request import RequestParams, TierFilter, TierMatcher
from kvtier.config.schema import KeySpec
from kvtier.config.tiers import (
    BUILTIN_TIER_TYPES,
    INTERNAL_TIER_TYPES,
    STORE_CONFIG_SCHEMA,
    TIER_COMMON_SCHEMA,
    TIER_SCHEMAS,
    TierConfig,
)

__all__ = [
    "EngineConfig",
    "TierConfig",
    "TierFilter",
    "TierMatcher",
    "RequestParams",
    "KeySpec",
    "SECRET_KEYS",
    "BUILTIN_SPECS",
    "BUILTIN_TIER_TYPES",
    "INTERNAL_TIER_TYPES",
    "ENGINE_SCHEMA",
    "TIER_COMMON_SCHEMA",
    "STORE_CONFIG_SCHEMA",
    "TIER_SCHEMAS",
    "redact",
]

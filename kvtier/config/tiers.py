"""Secondary tier entries: the keys every tier takes, the keys of each built-in type, TierConfig.

A ``secondary_tiers`` entry is checked in two parts: the keys common to every tier
(:data:`TIER_COMMON_SCHEMA`), then the type's own keys (:data:`TIER_SCHEMAS`) with their defaults
filled in. An out-of-tree tier (``module_path`` given) owns its keys: they are passed through
unchecked. ``docs/configuration.md`` ("Tier keys") describes every key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config.redaction import redact_plain
from kvtier.config.schema import (
    DEFAULT_TENANT,
    MODULE_PATH_SPEC,
    FrozenOptions,
    KeySpec,
    check_keys,
    did_you_mean,
    invalid,
    join_path,
    parse_section,
    show_value,
)
from kvtier.errors import ConfigError, trim_traceback
from kvtier.types import Locality

__all__ = [
    "TierConfig",
    "TIER_COMMON_SCHEMA",
    "STORE_CONFIG_SCHEMA",
    "P2P_AUTH_SCHEMA",
    "COMPRESSION_SCHEMA",
    "ENCRYPTION_SCHEMA",
    "DEFAULT_FILE_MODE",
    "DEFAULT_DIR_MODE",
    "TIER_SCHEMAS",
    "INTERNAL_TIER_TYPES",
    "BUILTIN_TIER_TYPES",
    "WRITE_POLICIES",
    "WRITE_THROUGH",
    "WRITE_BACK",
    "SELECTIVE",
    "DEFAULT_MIN_HITS",
    "tier_option",
]


# --------------------------------------------------------------------------------------------
# Value checks and environment defaults of the tier keys
# --------------------------------------------------------------------------------------------


def _no_nul(value: Any) -> str | None:
    return "must not contain NUL bytes" if "\x00" in value else None


def _safe_prefix(value: Any) -> str | None:
    if "\x00" in value:
        return "must not contain NUL bytes"
    if ".." in value.replace("\\", "/").split("/"):
        return "must not contain '..' path segments"
    return None


def _endpoint(value: Any) -> str | None:
    if "://" in value:
        return "give host[:port] only; the scheme goes in store_config.scheme"
    return _no_nul(value)


def _env_host() -> tuple[Any, str]:
    return os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST") or "localhost", "VLLM_P2P_SIDE_CHANNEL_HOST"


def _env_port() -> tuple[Any, str]:
    raw = os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT")
    if raw is None or raw == "":
        return 5710, "VLLM_P2P_SIDE_CHANNEL_PORT"
    try:
        return int(raw), "VLLM_P2P_SIDE_CHANNEL_PORT"
    except ValueError:
        return raw, "VLLM_P2P_SIDE_CHANNEL_PORT"  # rejected by the int rule, with the var named


def _env_number(var: str, default: float, kind: type) -> Callable[[], tuple[Any, str]]:
    """An ``env_default``: ``$var`` parsed as ``kind`` (left unparsed when it is not a number,
    so the key's own rule rejects it, naming the variable), else ``default``."""

    def read() -> tuple[Any, str]:
        raw = os.environ.get(var)
        if raw is None or raw == "":
            return default, var
        try:
            return kind(raw), var
        except ValueError:
            return raw, var

    return read


def _only_ucx(value: Any) -> str | None:
    if tuple(b.upper() for b in value) != ("UCX",):
        return "kvtier's p2p data plane is UCX (ucxx); only [\"UCX\"] is supported"
    return None


# --------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------

_THREADS = KeySpec("int", default=16, ge=1, le=1024)

#: When a chunk stored into host memory is written to a tier (``write_policy``; the tiering
#: manager's docstring states each rule): at once, when the host tier needs its slot, or once
#: requests have hit it ``min_hits`` times.
WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"
SELECTIVE = "selective"
WRITE_POLICIES: tuple[str, ...] = (WRITE_THROUGH, WRITE_BACK, SELECTIVE)
DEFAULT_MIN_HITS = 2

#: Keys every tier entry may carry, whatever its type.
TIER_COMMON_SCHEMA: Mapping[str, KeySpec] = {
    "type": KeySpec("str", non_empty=True, max_len=256),
    "module_path": MODULE_PATH_SPEC,
    "locality": KeySpec("locality", default=None, nullable=True),
    "enable_kv_events": KeySpec("bool", default=False),
    "backpressure": KeySpec("backpressure_override", default=None),
    "write_policy": KeySpec("str", default=WRITE_THROUGH, choices=WRITE_POLICIES),
    "min_hits": KeySpec("int", default=DEFAULT_MIN_HITS, ge=1, help='with write_policy "selective" only'),
}

_SECRET = KeySpec("str", default="", secret=True, max_len=4096)

#: ``store_config`` of an obj tier: the S3-compatible store and its credentials.
STORE_CONFIG_SCHEMA: Mapping[str, KeySpec] = {
    "bucket": KeySpec("str", non_empty=True, max_len=255, check=_no_nul),
    "endpoint_override": KeySpec("str", non_empty=True, max_len=1024, check=_endpoint,
                                 help="host[:port]"),
    "scheme": KeySpec("str", default="http", choices=("http", "https")),
    "access_key": _SECRET,
    "secret_key": _SECRET,
    "session_token": _SECRET,
    "region": KeySpec("str", default="", max_len=256),
    "ca_bundle": KeySpec("str", default="", max_len=4096, check=_no_nul),
}

_KEY_FILE = KeySpec("str", non_empty=True, max_len=4096, check=_no_nul)
#: ``auth`` of a p2p tier: CurveZMQ on the control plane, which is unauthenticated without it.
P2P_AUTH_SCHEMA: Mapping[str, KeySpec] = {
    "curve_secret_key_file": _KEY_FILE,
    "curve_public_key_file": _KEY_FILE,
    "trusted_public_keys_dir": _KEY_FILE,
}

#: ``compression`` of a storage tier: lossless, opt-in (docs/shared-caches.md).
COMPRESSION_SCHEMA: Mapping[str, KeySpec] = {
    "codec": KeySpec("str", default="zstd", choices=("zstd",)),
    "level": KeySpec("int", default=1, ge=-7, le=22, help="zstd level; negative: faster, larger"),
    "transform": KeySpec("str", default="byte_planes", choices=("byte_planes", "none"),
                         help="byte_planes: 16-bit elements split into high and low byte planes first"),
}
#: ``encryption`` of a storage tier: AES-256-GCM at rest, keys from a file (docs/shared-caches.md).
ENCRYPTION_SCHEMA: Mapping[str, KeySpec] = {
    "key_file": KeySpec("str", non_empty=True, max_len=4096, check=_no_nul,
                        help="lines '<key_id>:<64 hex digits>', owner-only"),
    "key_id": KeySpec("int", nullable=True, ge=1, le=0xFFFFFFFF,
                      help="the key that encrypts new chunks; null: decrypt only, new chunks are written plain"),
}
#: Modes the fs tier creates chunk files and directories with: owner-only unless configured.
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


def _file_mode(value: Any) -> str | None:
    if value & ~0o660 or value & 0o600 != 0o600:
        return f"owner read and write (0o600), plus group read/write bits at most (within 0o660); got {value:#o}"
    return None


def _dir_mode(value: Any) -> str | None:
    if value & ~0o770 or value & 0o700 != 0o700:
        return f"owner rwx (0o700), plus group bits at most (within 0o770); got {value:#o}"
    if value & 0o070 and not value & 0o010:
        return f"group bits need group search (x, 0o010) to reach the files; got {value:#o}"
    return None


_COMPRESSION = KeySpec("mapping", default=None, nullable=True, schema=COMPRESSION_SCHEMA)
_ENCRYPTION = KeySpec("mapping", default=None, nullable=True, schema=ENCRYPTION_SCHEMA)

#: Type-specific keys of the built-in tiers.
TIER_SCHEMAS: Mapping[str, Mapping[str, KeySpec]] = {
    "fs": {
        "root_dir": KeySpec("str", non_empty=True, max_len=4096, check=_no_nul),
        "n_read_threads": _THREADS,
        "n_write_threads": _THREADS,
        "max_bytes": KeySpec("int", default=None, nullable=True, gt=0),
        "eviction_policy": KeySpec("str", default="lru", non_empty=True, max_len=256),
        "stale_tmp_grace_s": KeySpec("float", default=3600.0, ge=0),
        "rescan_interval_s": KeySpec("float", default=None, nullable=True, gt=0,
                                     help="seconds between re-syncs with the disk; null (default): 30, "
                                          "stretched so that a re-sync takes at most 5% of a core"),
        "accept_unverified_chunks": KeySpec("bool", default=False,
                                            help="load trailer-less (vLLM-written) chunks with no integrity check"),
        "file_mode": KeySpec("mode", default=DEFAULT_FILE_MODE, check=_file_mode),
        "dir_mode": KeySpec("mode", default=DEFAULT_DIR_MODE, check=_dir_mode),
        "compression": _COMPRESSION,
        "encryption": _ENCRYPTION,
        "tenant_bytes": KeySpec("budgets", default=None, nullable=True,
                                help=f"this tier's byte budget per tenant; {DEFAULT_TENANT!r}: every other request"),
    },
    "memory": {
        "capacity_bytes": KeySpec("int", gt=0),
    },
    # A test tier (kvtier.tiers.faulty): a memory tier that fails and stalls on purpose. Internal:
    # constructible, never offered (INTERNAL_TIER_TYPES).
    "faulty": {
        "capacity_bytes": KeySpec("int", default=1 << 30, gt=0),
        "fail_read_fraction": KeySpec("float", default=0.0, ge=0, le=1),
        "fail_write_fraction": KeySpec("float", default=0.0, ge=0, le=1),
        "seed": KeySpec("int", default=None, nullable=True),
        "latency_s": KeySpec("float", default=0.0, ge=0),
    },
    "obj": {
        "store_config": KeySpec("mapping", schema=STORE_CONFIG_SCHEMA),
        "prefix": KeySpec("str", default="", max_len=1024, check=_safe_prefix),
        "io_threads": KeySpec("int", default=4, ge=1, le=256),
        "request_timeout_s": KeySpec("float", default=10.0, gt=0),
        "lookup_timeout_s": KeySpec("float", default=5.0, gt=0),
        "accept_unverified_chunks": KeySpec("bool", default=False,
                                            help="load trailer-less (vLLM-written) chunks with no integrity check"),
        "compression": _COMPRESSION,
        "encryption": _ENCRYPTION,
    },
    "p2p": {
        "host": KeySpec("str", non_empty=True, max_len=255, check=_no_nul, env_default=_env_host),
        "port": KeySpec("int", ge=1, le=65535, env_default=_env_port),
        "backends": KeySpec("str_list", default=("UCX",), check=_only_ucx),
        "num_threads": KeySpec("int", default=4, ge=1, le=256,
                               help="a fetch keeps 16 x this chunk transfers in flight"),
        "unbound_store_timeout_s": KeySpec("float", default=60.0, gt=0),
        "max_peers": KeySpec("int", ge=1, le=4096, env_default=_env_number("VLLM_P2P_MAX_PEERS", 128, int)),
        "handshake_timeout_s": KeySpec("float", gt=0, env_default=_env_number(
            "VLLM_P2P_HANDSHAKE_TIMEOUT_S", 30.0, float)),
        "lookup_timeout_s": KeySpec("float", default=30.0, gt=0),
        "load_timeout_s": KeySpec("float", default=30.0, gt=0),
        "idle_timeout_s": KeySpec("float", ge=0, env_default=_env_number("VLLM_P2P_IDLE_TIMEOUT_S", 300.0, float),
                                  help="0 disables idle reaping"),
        "auth": KeySpec("mapping", default=None, nullable=True, schema=P2P_AUTH_SCHEMA),
    },
}
#: Built-in types for kvtier's own tests: constructible, never listed to users.
INTERNAL_TIER_TYPES: frozenset[str] = frozenset({"faulty"})
#: The built-in tier types users are offered (in error messages and documentation).
BUILTIN_TIER_TYPES: tuple[str, ...] = tuple(sorted(set(TIER_SCHEMAS) - INTERNAL_TIER_TYPES))


def tier_option(config: Any, name: str) -> Any:
    """The value of a built-in tier's key ``name``: as given in ``config.options``, else the default
    :data:`TIER_SCHEMAS` states for ``config.type`` (an environment default is read now).

    The schema is the one statement of each built-in type's keys and defaults: a tier reads its
    options through this and never restates a default. ``config`` is a :class:`TierConfig` or
    anything with its ``type`` and ``options``. Raises :class:`ConfigError` for a required key
    that is absent, ``KeyError`` for a key the type does not have (a bug in the caller).
    """
    if name in config.options:
        return config.options[name]
    spec = TIER_SCHEMAS[config.type][name]
    if spec.env_default is not None:
        return spec.env_default()[0]
    if spec.required:
        raise ConfigError(f"the {config.type} tier needs {name!r}")
    return spec.default


# --------------------------------------------------------------------------------------------
# TierConfig
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class TierConfig:
    """One validated ``secondary_tiers`` entry.

    ``options`` holds the type-specific keys with defaults filled in (read-only). For an
    out-of-tree tier (``module_path`` given) they are passed through unvalidated: the tier class
    owns them. ``backpressure`` is the tier's own back-pressure dict (``None`` when absent); see
    :meth:`EngineConfig.backpressure_for` for the merged settings. ``write_policy`` is one of
    :data:`WRITE_POLICIES`; ``min_hits`` matters to ``"selective"`` only.
    """

    index: int
    type: str
    module_path: str | None = None
    locality: Locality | None = None
    enable_kv_events: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: FrozenOptions({}))
    backpressure: Mapping[str, Any] | None = None
    write_policy: str = WRITE_THROUGH
    min_hits: int = DEFAULT_MIN_HITS

    @property
    def label(self) -> str:
        """The tier's metric label and event ownership: ``"<index+1>:<type>"``."""
        return f"{self.index + 1}:{self.type}"

    @property
    def is_builtin(self) -> bool:
        return self.module_path is None and self.type in TIER_SCHEMAS

    def to_dict(self) -> dict[str, Any]:
        """The normalised entry as a plain dict (``from_dict`` accepts it), secrets redacted."""
        out: dict[str, Any] = {"type": self.type}
        if self.module_path is not None:
            out["module_path"] = self.module_path
        out["locality"] = self.locality.value if self.locality is not None else None
        out["enable_kv_events"] = self.enable_kv_events
        if self.backpressure is not None:
            out["backpressure"] = redact_plain(self.backpressure)
        out["write_policy"] = self.write_policy
        if self.write_policy == SELECTIVE:
            out["min_hits"] = self.min_hits
        out.update(redact_plain(self.options))
        return out

    def __repr__(self) -> str:
        return (
            f"TierConfig(index={self.index}, type={self.type!r}, module_path={self.module_path!r}, "
            f"locality={self.locality!r}, enable_kv_events={self.enable_kv_events}, "
            f"options={redact_plain(self.options)!r}, backpressure={redact_plain(self.backpressure)!r}, "
            f"write_policy={self.write_policy!r}, min_hits={self.min_hits})"
        )

    __str__ = __repr__

    @classmethod
    def from_dict(cls, raw: Any, index: int, *, path: str | None = None) -> TierConfig:
        """Validate one tier entry (``path`` defaults to ``secondary_tiers[<index>]``).

        Raises :class:`ConfigError` for the first problem found; its traceback ends here, not in
        the schema machinery.
        """
        try:
            return cls._from_dict(raw, index, path=path)
        except ConfigError as exc:
            raise trim_traceback(exc)  # the message says it all: no frames of the schema machinery

    @classmethod
    def _from_dict(cls, raw: Any, index: int, *, path: str | None = None) -> TierConfig:
        path = path if path is not None else f"secondary_tiers[{index}]"
        if not isinstance(raw, Mapping):
            raise invalid(path, raw, "a dict with at least a 'type' key")
        check_keys(raw, raw.keys(), path)  # string keys only
        if "type" not in raw:
            raise ConfigError(
                f"missing required key {join_path(path, 'type')}: expected one of "
                f"{', '.join(map(repr, BUILTIN_TIER_TYPES))} or a class name with module_path"
            )
        if raw["type"] == "p2p" and "backpressure" in raw and raw.get("module_path") is None:
            raise invalid(
                join_path(path, "backpressure"), raw["backpressure"],
                "no backpressure key: p2p tiers do not support back-pressure",
            )
        common_raw = {k: v for k, v in raw.items() if k in TIER_COMMON_SCHEMA}
        if raw.get("accept_unverified_chunks") is True and isinstance(raw.get("encryption"), Mapping) \
                and raw["encryption"].get("key_id") is not None:
            raise invalid(join_path(path, "accept_unverified_chunks"), True,
                          "false with encryption: a tier that encrypts loads only chunks that authenticate, "
                          "never a trailer-less one")
        rest = {k: v for k, v in raw.items() if k not in TIER_COMMON_SCHEMA}
        common = parse_section(common_raw, TIER_COMMON_SCHEMA, path)
        type_name: str = common["type"]
        _check_write_policy(raw, common, path)
        if common["module_path"] is not None:
            # Out-of-tree tier: the class named ``type`` in ``module_path`` owns its keys.
            options = dict(rest)
        elif type_name in TIER_SCHEMAS:
            schema = TIER_SCHEMAS[type_name]
            if "tenant_bytes" in rest and "tenant_bytes" not in schema:
                raise invalid(join_path(path, "tenant_bytes"), rest["tenant_bytes"],
                              f"no tenant_bytes on the {type_name} tier: tenant budgets apply to tiers that evict "
                              "to stay within a byte capacity (host memory: tenant_cpu_bytes; fs tiers)")
            check_keys(rest, set(schema) | set(TIER_COMMON_SCHEMA), path)
            options = parse_section(rest, schema, path)
        else:
            raise ConfigError(
                f"invalid {join_path(path, 'type')} = {show_value(type_name)}: unknown tier type"
                f"{did_you_mean(type_name, BUILTIN_TIER_TYPES)}; expected one of "
                f"{', '.join(map(repr, BUILTIN_TIER_TYPES))}, or give module_path for an "
                "out-of-tree tier class"
            )
        return cls(
            index=index,
            type=type_name,
            module_path=common["module_path"],
            locality=common["locality"],
            enable_kv_events=common["enable_kv_events"],
            options=FrozenOptions(options),
            backpressure=common["backpressure"],
            write_policy=common["write_policy"],
            min_hits=common["min_hits"],
        )


def _check_write_policy(raw: Mapping[str, Any], common: Mapping[str, Any], path: str) -> None:
    """``min_hits`` only with ``"selective"``; a built-in p2p tier only writes through (it sends
    the chunks of the requests that ask for them, at once, whatever the policy)."""
    policy = common["write_policy"]
    if "min_hits" in raw and policy != SELECTIVE:
        raise invalid(join_path(path, "min_hits"), raw["min_hits"],
                      f'no min_hits: it applies to write_policy "selective" only (this tier\'s is {policy!r})')
    if policy != WRITE_THROUGH and common["type"] == "p2p" and common["module_path"] is None:
        raise invalid(join_path(path, "write_policy"), raw["write_policy"],
                      f"{WRITE_THROUGH!r}: a p2p tier sends a request's chunks when the request asks for them")

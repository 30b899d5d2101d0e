"""Parse and validate kvtier's configuration and per-request parameters.

``EngineConfig.from_dict`` reads the dictionary vLLM users write in ``kv_connector_extra_config``
(``shared/design/CONFIG.md`` is the reference of every key). Validation is table-driven: each key
has one :class:`KeySpec` (type, default, range or choices, required) in a schema table, so every
rule is stated once. Anything wrong raises :class:`kvtier.errors.ConfigError` at start-up with
a message naming the key path (``secondary_tiers[1].n_read_threads``), the offending value
(truncated, secrets shown as ``'***'``) and what is allowed — never a silent default.

Per-request fields (``kv_transfer_params``) are the exception: a bad value there is logged as a
warning on the ``kvtier.config`` logger and ignored; only a forbidden combination of P/D role keys
raises :class:`kvtier.errors.RequestError`.

Secrets (``access_key``, ``secret_key``, ``session_token``) are kept as plain strings for the
tier that needs them, but no ``repr``/``str``/``to_dict``/error message or warning of this module
shows them, whatever container they were written in (:func:`redact`). A :class:`ConfigError`
from ``from_dict`` has its traceback end there, not in the schema machinery.
"""

from __future__ import annotations

import difflib
import enum
import logging
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtier.errors import ConfigError, RequestError, trim_traceback
from kvtier.types import Locality, Medium

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
    "redact",
]

logger = logging.getLogger("kvtier.config")

#: Keys whose values are credentials: shown as ``'***'`` everywhere (messages, repr, to_dict).
SECRET_KEYS: frozenset[str] = frozenset({"access_key", "secret_key", "session_token"})
_REDACTED = "***"

CPU_SPEC = "CPUOffloadingSpec"
TIERING_SPEC = "TieringOffloadingSpec"
BUILTIN_SPECS: tuple[str, ...] = (CPU_SPEC, TIERING_SPEC)

#: Bounds on list inputs, so a hostile or mistaken config cannot make start-up explode.
MAX_SECONDARY_TIERS = 64
MAX_BACKENDS = 16
_MAX_SHOWN_CHARS = 80

_MODULE_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


# --------------------------------------------------------------------------------------------
# Redaction and message helpers
# --------------------------------------------------------------------------------------------


# A credential's name however it is written: any case, ``_``/``-``/space separated, ending a
# longer name (``aws_secret_access_key``) but not inside one (``curve_secret_key_file`` is a path).
# It covers more than SECRET_KEYS on purpose: a value wrongly hidden only costs a ``***``.
_SECRET_NAME = (r"(?:secret[_\- ]?(?:access[_\- ]?)?key|access[_\- ]?key|session[_\- ]?token"
                r"|password|passwd)(?![A-Za-z0-9_])")
_SECRET_NAME_RE = re.compile(_SECRET_NAME, re.IGNORECASE)
_SECRET_KEY_RE = re.compile(r"[A-Za-z0-9_\- ]*" + _SECRET_NAME, re.IGNORECASE)
# What joins a name to its value in text: a closing quote, then ``=``/``:``/``,``, or spaces
# (``secret_key=x``, ``"secret_key": "x"``, ``('secret_key', 'x')``, ``password x``).
_SECRET_JOIN_RE = re.compile(r"""['"]?\s*[:=,]\s*|\s+""")
# A value beside a name that shows nothing: already redacted, or empty.
_NOTHING_SHOWN_RE = re.compile(r"""(?:'\*\*\*'|"\*\*\*"|\*\*\*|''|""|None)(?![A-Za-z0-9_])""")
_MAX_REDACT_DEPTH = 8


def _is_secret_name(key: Any) -> bool:
    """Whether ``key`` (a mapping key, or an item of a sequence) names a credential."""
    if isinstance(key, (bytes, bytearray)):
        key = bytes(key).decode("latin-1")
    return isinstance(key, str) and _SECRET_KEY_RE.fullmatch(key.strip()) is not None


def _secret_value(value: Any) -> Any:
    """What is shown for the value of a secret key: ``'***'``, unless it is empty (nothing to hide,
    and ``to_dict`` output with unset credentials stays acceptable to ``from_dict``)."""
    return value if value is None or (isinstance(value, (str, bytes)) and not value) else _REDACTED


def _scrub_text(text: str) -> str:
    """``text`` cut short after the first credential name written with a value beside it
    (``"secret_key=x"`` → ``"secret_key=***"``); a bare name, or one already followed by
    ``***``, is kept."""
    pos = 0
    while (name := _SECRET_NAME_RE.search(text, pos)) is not None:
        join = _SECRET_JOIN_RE.match(text, name.end())
        pos = name.end()
        if join is None or join.end() >= len(text):
            continue
        shown = _NOTHING_SHOWN_RE.match(text, join.end())
        if shown is None:
            return text[: join.end()] + _REDACTED
        pos = shown.end()
    return text


class _Shown:
    """Stands for an object of no known shape by its (scrubbed) ``repr``."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def redact(value: Any) -> Any:
    """A copy of ``value`` in which no credential can be seen, whatever the container shape.

    Used for everything that leaves this module as text. A value that sits *under* a secret name (a
    mapping key such as ``secret_key``, any case or separator) or *beside* one (the items after it
    in a list or tuple: ``[("secret_key", x)]``, ``["secret_key", x]``) is replaced by ``'***'``,
    whole even when it is itself a container; a set holding a secret name keeps only the names; a
    string (or bytes) is cut after a name written with its value (``"secret_key=x"``); an object of
    another type whose ``repr`` shows such a pair stands for that ``repr``, scrubbed the same way.
    Mappings become dicts, lists/tuples keep their kind; depth is bounded so a self-referencing
    structure cannot recurse forever.
    """
    return _redacted(value, 0, plain=False)


def _redacted(value: Any, depth: int, *, plain: bool) -> Any:
    """:func:`redact`; with ``plain``, also in JSON-like form (tuples as lists, enums as values)."""
    if depth > _MAX_REDACT_DEPTH:
        return "..."
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, enum.Enum):
        return value.value if plain else value
    if isinstance(value, str):
        return _scrub_text(value)
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).decode("latin-1")
        scrubbed = _scrub_text(text)
        return value if scrubbed == text else scrubbed.encode("latin-1")
    if isinstance(value, Mapping):
        return {
            _redacted(k, depth + 1, plain=plain):
                _secret_value(v) if _is_secret_name(k) else _redacted(v, depth + 1, plain=plain)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        items: list[Any] = []
        beside_secret = False
        for item in value:
            items.append(_secret_value(item) if beside_secret else _redacted(item, depth + 1, plain=plain))
            beside_secret = beside_secret or _is_secret_name(item)
        return items if plain or isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        has_secret_name = any(_is_secret_name(item) for item in value)
        kept = [item if _is_secret_name(item) else _REDACTED if has_secret_name
                else _redacted(item, depth + 1, plain=plain) for item in value]
        if plain:
            return kept
        return frozenset(kept) if isinstance(value, frozenset) else set(kept)
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the configuration error being reported
        return _Shown(f"<{type(value).__name__}>")
    scrubbed = _scrub_text(text)
    if scrubbed == text:
        return value
    return scrubbed if plain else _Shown(scrubbed)


_repr = reprlib.Repr()
_repr.maxstring = _MAX_SHOWN_CHARS
_repr.maxother = _MAX_SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


def _show(value: Any, *, secret: bool = False) -> str:
    """The value as it may appear in a message: redacted, size-bounded, at most ~80 chars."""
    if secret:
        return repr(_REDACTED)
    text = _scrub_text(_repr.repr(redact(value)))
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return text


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _invalid(path: str, value: Any, allowed: str, *, secret: bool = False) -> ConfigError:
    """The error for ``value`` at ``path``; the value is hidden whole when the key is secret or its
    name looks like a credential (``backpressure.password``)."""
    key = re.sub(r"\[\d+\]$", "", path.rsplit(".", 1)[-1])
    shown = _show(value, secret=secret or _is_secret_name(key))
    return ConfigError(f"invalid {path} = {shown}: expected {allowed}")


def _did_you_mean(word: str, candidates: Any, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate (similarity >= ``cutoff``), or ``""``."""
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------
# The schema machinery: one KeySpec per key
# --------------------------------------------------------------------------------------------

_NO_DEFAULT = object()


@dataclass(frozen=True, slots=True)
class KeySpec:
    """The rule of one configuration key.

    ``kind`` is one of ``"int"`` (bools rejected), ``"float"`` (ints accepted, NaN/inf rejected),
    ``"bool"``, ``"str"``, ``"str_list"`` (non-empty list of non-empty strings, stored as a tuple),
    ``"locality"`` (``LOCAL``/``REMOTE``, case-insensitive, stored as :class:`Locality`),
    ``"mapping"`` (validated against ``schema``) or ``"backpressure"``. ``nullable`` admits
    ``None`` (then the value means "not given"). ``gt``/``ge``/``le`` bound numbers; ``choices``
    are case-insensitive and normalised to lower case. ``check`` returns a problem description
    for values of the right type that are still unacceptable (NUL bytes, ``..`` segments).
    ``env_default`` computes the default at parse time (p2p's ``$VLLM_P2P_*`` variables) and
    returns ``(value, variable name)``; that value is validated like a given one.
    """

    kind: str
    default: Any = _NO_DEFAULT
    nullable: bool = False
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    non_empty: bool = False
    max_len: int | None = None
    secret: bool = False
    check: Callable[[Any], str | None] | None = None
    schema: Mapping[str, KeySpec] | None = None
    env_default: Callable[[], tuple[Any, str]] | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT and self.env_default is None

    def describe(self) -> str:
        """What is allowed, in words (used in error messages)."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices) + " (case-insensitive)"
        elif self.kind in ("int", "float"):
            text = "an integer" if self.kind == "int" else "a finite number"
            if self.ge is not None and self.le is not None:
                text += f" in {_num(self.ge)}..{_num(self.le)}"
            else:
                bounds = [f"{op} {_num(bound)}" for op, bound in
                          ((">", self.gt), (">=", self.ge), ("<=", self.le)) if bound is not None]
                if bounds:
                    text += " " + " and ".join(bounds)
        elif self.kind == "bool":
            text = "true or false"
        elif self.kind == "str":
            text = "a non-empty string" if self.non_empty else "a string"
            if self.max_len is not None:
                text += f" of at most {self.max_len} characters"
        elif self.kind == "str_list":
            text = f"a non-empty list (at most {MAX_BACKENDS}) of non-empty strings"
        elif self.kind == "locality":
            text = "'LOCAL' or 'REMOTE' (case-insensitive)"
        elif self.kind == "backpressure":
            text = "a dict with a 'backpressure_cls' string"
        elif self.kind == "backpressure_override":
            text = "a dict of back-pressure fields (merged over the top-level backpressure)"
        else:
            text = "a dict"
        if self.help:
            text += f" ({self.help})"
        if self.nullable:
            text += ", or null"
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _convert(spec: KeySpec, value: Any, path: str) -> Any:
    """Validate one present value against ``spec``; return its normalised form or raise."""
    if value is None:
        if spec.nullable:
            return None
        raise _invalid(path, value, spec.describe(), secret=spec.secret)

    def bad() -> ConfigError:
        return _invalid(path, value, spec.describe(), secret=spec.secret)

    kind = spec.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        _check_range(spec, value, bad)
        result: Any = value
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        result = float(value)
        if not math.isfinite(result):
            raise bad()
        _check_range(spec, result, bad)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise bad()
        result = value
    elif kind == "str":
        if not isinstance(value, str):
            raise bad()
        if spec.non_empty and not value:
            raise bad()
        if spec.max_len is not None and len(value) > spec.max_len:
            raise bad()
        result = value
        if spec.choices is not None:
            result = value.lower()
            if result not in spec.choices:
                raise bad()
    elif kind == "str_list":
        if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_BACKENDS:
            raise bad()
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise _invalid(f"{path}[{i}]", item, "a non-empty string")
        result = tuple(value)
    elif kind == "locality":
        result = _parse_locality(value)
        if result is None:
            raise bad()
    elif kind == "mapping":
        if not isinstance(value, Mapping):
            raise bad()
        assert spec.schema is not None
        result = FrozenOptions(_parse_section(value, spec.schema, path))
    elif kind in ("backpressure", "backpressure_override"):
        result = FrozenOptions(
            _parse_backpressure(value, path, require_cls=kind == "backpressure")
        )
    else:  # pragma: no cover - a schema typo, caught by the defaults test
        raise AssertionError(f"unknown KeySpec kind {kind!r}")
    if spec.check is not None:
        problem = spec.check(result)
        if problem is not None:
            raise _invalid(path, value, f"{spec.describe()}; {problem}", secret=spec.secret)
    return result


def _check_range(spec: KeySpec, value: float, bad: Callable[[], ConfigError]) -> None:
    if spec.gt is not None and not value > spec.gt:
        raise bad()
    if spec.ge is not None and not value >= spec.ge:
        raise bad()
    if spec.le is not None and not value <= spec.le:
        raise bad()


def _parse_locality(value: Any) -> Locality | None:
    if isinstance(value, Locality):
        return value
    if isinstance(value, str):
        try:
            return Locality(value.upper())
        except ValueError:
            return None
    return None


def _check_keys(raw: Mapping[Any, Any], allowed: Any, path: str) -> None:
    """Reject non-string and unknown keys; the value of an unknown key is never shown
    (a misspelt ``secret_kye`` would otherwise leak)."""
    for key in raw:
        if not isinstance(key, str):
            where = path or "config"
            raise ConfigError(f"invalid key {_show(key)} in {where}: keys must be strings")
        if key not in allowed:
            where = _join(path, key)
            raise ConfigError(
                f"unknown key {_show(where)}{_did_you_mean(key, allowed)}; "
                f"allowed keys: {', '.join(sorted(allowed))}"
            )


def _parse_section(
    raw: Mapping[Any, Any], schema: Mapping[str, KeySpec], path: str, *, extra_allowed: Any = ()
) -> dict[str, Any]:
    """Validate ``raw`` against ``schema``: unknown keys, required keys, each value; fill in
    defaults. Keys in ``extra_allowed`` are accepted here and handled by the caller."""
    _check_keys(raw, set(schema) | set(extra_allowed), path)
    out: dict[str, Any] = {}
    for key, spec in schema.items():
        where = _join(path, key)
        if key in raw:
            out[key] = _convert(spec, raw[key], where)
        elif spec.env_default is not None:
            value, variable = spec.env_default()
            out[key] = _convert(spec, value, f"{where} (from ${variable})")
        elif spec.required:
            raise ConfigError(f"missing required key {where}: expected {spec.describe()}")
        else:
            out[key] = spec.default
    return out


def _parse_backpressure(value: Any, path: str, *, require_cls: bool) -> dict[str, Any]:
    """Back-pressure settings (reference §2.12): their shape is checked here; the engine's
    spec builds one detector per tier from the merged settings (``kvtier.backpressure``), which
    resolves the classes and rejects any argument the detector does not take.

    ``backpressure_cls`` (a short name or a dotted path) is required in the top-level dict; a
    tier's dict is merged over it field by field, so there it is required only when the
    top-level dict lacks it (checked by ``EngineConfig.from_dict``). ``policy_cls`` is optional;
    the remaining fields are detector arguments and must be plain scalars.
    """
    spec = KeySpec("backpressure" if require_cls else "backpressure_override")
    if not isinstance(value, Mapping):
        raise _invalid(path, value, spec.describe())
    _check_keys(value, value.keys(), path)  # only rejects non-string keys here
    out: dict[str, Any] = {}
    for key, item in value.items():
        where = _join(path, key)
        if key in ("backpressure_cls", "policy_cls"):
            if not isinstance(item, str) or not item:
                raise _invalid(where, item, "a non-empty string (class name or dotted path)")
        elif item is not None and not isinstance(item, (bool, int, float, str)):
            raise _invalid(where, item, "a number, string, boolean or null (a detector argument)")
        out[key] = item
    if require_cls and "backpressure_cls" not in out:
        raise ConfigError(
            f"missing required key {_join(path, 'backpressure_cls')}: expected a non-empty string"
        )
    return out


class FrozenOptions(Mapping[str, Any]):
    """A read-only mapping of validated options whose ``repr`` redacts secrets.

    Lookups return the real values (the obj tier needs its credentials); only the textual forms
    hide them.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(_plain(self))

    __str__ = __repr__


def _plain(value: Any) -> Any:
    """Plain ``dict``/``list`` form (JSON-like) of a normalised value, secrets redacted as
    :func:`redact` does."""
    return _redacted(value, 0, plain=True)


# --------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------


def _no_nul(value: Any) -> str | None:
    return "must not contain NUL bytes" if "\x00" in value else None


def _safe_prefix(value: Any) -> str | None:
    if "\x00" in value:
        return "must not contain NUL bytes"
    if ".." in value.replace("\\", "/").split("/"):
        return "must not contain '..' path segments"
    return None


def _module_path(value: Any) -> str | None:
    return None if _MODULE_PATH_RE.match(value) else "must be a dotted Python module path"


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


_MODULE = KeySpec("str", default=None, nullable=True, non_empty=True, max_len=512,
                  check=_module_path, help="dotted module path")
_THREADS = KeySpec("int", default=16, ge=1, le=1024)

#: Engine keys (CONFIG.md "Engine keys" + TieringOffloadingSpec keys of reference §2.15).
#: ``secondary_tiers`` is parsed separately (each entry by the tier tables below).
ENGINE_SCHEMA: Mapping[str, KeySpec] = {
    "spec_name": KeySpec("str", default=CPU_SPEC, non_empty=True, max_len=256),
    "spec_module_path": _MODULE,
    "cpu_bytes_to_use": KeySpec("int", gt=0, help="total host bytes across all workers"),
    "block_size": KeySpec("int", default=None, nullable=True, gt=0, help="tokens per chunk"),
    "blocks_per_chunk": KeySpec("int", default=None, nullable=True, gt=0),
    "eviction_policy": KeySpec("str", default="lru", non_empty=True, max_len=256),
    "cache_policy_module_path": _MODULE,
    "store_threshold": KeySpec("int", default=0, ge=0),
    "max_tracker_size": KeySpec("int", default=64000, gt=0),
    "offload_prompt_only": KeySpec("bool", default=True),
    "self_describing_kv_events": KeySpec("bool", default=False),
    "tier_poll_interval_s": KeySpec("float", default=0.001, gt=0),
    "sync_load_budget_bytes": KeySpec("int", default=0, ge=0),
    "canonical_layout": KeySpec("bool", default=False),
    "backpressure": KeySpec("backpressure", default=None, nullable=True),
}

#: Keys every tier entry may carry, whatever its type.
TIER_COMMON_SCHEMA: Mapping[str, KeySpec] = {
    "type": KeySpec("str", non_empty=True, max_len=256),
    "module_path": _MODULE,
    "locality": KeySpec("locality", default=None, nullable=True),
    "enable_kv_events": KeySpec("bool", default=False),
    "backpressure": KeySpec("backpressure_override", default=None),
}

_SECRET = KeySpec("str", default="", secret=True, max_len=4096)

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
#: ``auth`` of a p2p tier: CurveZMQ on the control plane (reference §5 has no authentication).
P2P_AUTH_SCHEMA: Mapping[str, KeySpec] = {
    "curve_secret_key_file": _KEY_FILE,
    "curve_public_key_file": _KEY_FILE,
    "trusted_public_keys_dir": _KEY_FILE,
}

#: Type-specific keys of the built-in tiers (CONFIG.md "Secondary tier dictionaries").
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


# --------------------------------------------------------------------------------------------
# Config objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class TierConfig:
    """One validated ``secondary_tiers`` entry.

    ``options`` holds the type-specific keys with defaults filled in (read-only). For an
    out-of-tree tier (``module_path`` given) they are passed through unvalidated: the tier class
    owns them. ``backpressure`` is the tier's own back-pressure dict (``None`` when absent); see
    :meth:`EngineConfig.backpressure_for` for the merged settings.
    """

    index: int
    type: str
    module_path: str | None = None
    locality: Locality | None = None
    enable_kv_events: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: FrozenOptions({}))
    backpressure: Mapping[str, Any] | None = None

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
            out["backpressure"] = _plain(self.backpressure)
        out.update(_plain(self.options))
        return out

    def __repr__(self) -> str:
        return (
            f"TierConfig(index={self.index}, type={self.type!r}, module_path={self.module_path!r}, "
            f"locality={self.locality!r}, enable_kv_events={self.enable_kv_events}, "
            f"options={_plain(self.options)!r}, backpressure={_plain(self.backpressure)!r})"
        )

    __str__ = __repr__

    @classmethod
    def from_dict(cls, raw: Any, index: int, *, path: str | None = None) -> TierConfig:
        """Validate one tier entry (``path`` defaults to ``secondary_tiers[<index>]``)."""
        try:
            return cls._from_dict(raw, index, path=path)
        except ConfigError as exc:
            raise trim_traceback(exc)  # the message says it all: no frames of the schema machinery

    @classmethod
    def _from_dict(cls, raw: Any, index: int, *, path: str | None = None) -> TierConfig:
        path = path if path is not None else f"secondary_tiers[{index}]"
        if not isinstance(raw, Mapping):
            raise _invalid(path, raw, "a dict with at least a 'type' key")
        _check_keys(raw, raw.keys(), path)  # string keys only
        if "type" not in raw:
            raise ConfigError(
                f"missing required key {_join(path, 'type')}: expected one of "
                f"{', '.join(map(repr, BUILTIN_TIER_TYPES))} or a class name with module_path"
            )
        if raw["type"] == "p2p" and "backpressure" in raw and raw.get("module_path") is None:
            raise _invalid(
                _join(path, "backpressure"), raw["backpressure"],
                "no backpressure key: p2p tiers do not support back-pressure",
            )
        common_raw = {k: v for k, v in raw.items() if k in TIER_COMMON_SCHEMA}
        rest = {k: v for k, v in raw.items() if k not in TIER_COMMON_SCHEMA}
        common = _parse_section(common_raw, TIER_COMMON_SCHEMA, path)
        type_name: str = common["type"]
        if common["module_path"] is not None:
            # Out-of-tree tier: the class named ``type`` in ``module_path`` owns its keys.
            options = dict(rest)
        elif type_name in TIER_SCHEMAS:
            schema = TIER_SCHEMAS[type_name]
            _check_keys(rest, set(schema) | set(TIER_COMMON_SCHEMA), path)
            options = _parse_section(rest, schema, path)
        else:
            raise ConfigError(
                f"invalid {_join(path, 'type')} = {_show(type_name)}: unknown tier type"
                f"{_did_you_mean(type_name, BUILTIN_TIER_TYPES)}; expected one of "
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
        )


@dataclass(frozen=True, slots=True, repr=False)
class EngineConfig:
    """The validated engine configuration (CONFIG.md "Engine keys").

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
            raise _invalid("config", d, "a mapping (the kv_connector_extra_config dict)")
        values = _parse_section(d, ENGINE_SCHEMA, "", extra_allowed=("secondary_tiers",))

        spec_name = values["spec_name"]
        if spec_name not in BUILTIN_SPECS and values["spec_module_path"] is None:
            raise ConfigError(
                f"invalid spec_name = {_show(spec_name)}: unknown spec"
                f"{_did_you_mean(spec_name, BUILTIN_SPECS)}; expected "
                f"{' or '.join(map(repr, BUILTIN_SPECS))}, or give spec_module_path for a "
                "custom spec class"
            )
        if values["block_size"] is not None and values["blocks_per_chunk"] is not None:
            raise ConfigError(
                f"invalid blocks_per_chunk = {_show(values['blocks_per_chunk'])} together with "
                f"block_size = {_show(values['block_size'])}: expected only one of block_size "
                "and blocks_per_chunk"
            )

        raw_tiers = d.get("secondary_tiers", [])
        if raw_tiers is None:
            raw_tiers = []
        if not isinstance(raw_tiers, (list, tuple)):
            raise _invalid("secondary_tiers", raw_tiers, "a list of tier dicts")
        if len(raw_tiers) > MAX_SECONDARY_TIERS:
            raise _invalid(
                "secondary_tiers", raw_tiers, f"a list of at most {MAX_SECONDARY_TIERS} tier dicts"
            )
        if raw_tiers and spec_name == CPU_SPEC:
            raise _invalid(
                "secondary_tiers", raw_tiers,
                f"an empty list with spec_name {CPU_SPEC!r}; use spec_name {TIERING_SPEC!r} "
                "for secondary tiers",
            )
        tiers = tuple(TierConfig._from_dict(raw, i) for i, raw in enumerate(raw_tiers))

        config = cls(secondary_tiers=tiers, **values)
        if config.is_tiering and config.store_threshold >= 2:
            raise _invalid(
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
            raise _invalid("device_block_size", device_block_size, "an integer > 0")
        if self.block_size is not None:
            if self.block_size % device_block_size != 0:
                raise _invalid(
                    "block_size", self.block_size,
                    f"a positive multiple of the accelerator block size {device_block_size}",
                )
            return self.block_size // device_block_size
        return self.blocks_per_chunk if self.blocks_per_chunk is not None else 1

    def num_slots(self, slot_bytes: int) -> int:
        """Whole host slots of ``slot_bytes`` in ``cpu_bytes_to_use``; fewer than one is an
        error (the host tier cannot hold a single chunk)."""
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise _invalid("slot_bytes", slot_bytes, "an integer > 0")
        slots = self.cpu_bytes_to_use // slot_bytes
        if slots < 1:
            raise _invalid(
                "cpu_bytes_to_use", self.cpu_bytes_to_use,
                f"at least one chunk slot of {slot_bytes} bytes",
            )
        return slots

    def backpressure_for(self, tier: TierConfig) -> Mapping[str, Any] | None:
        """Merged back-pressure settings of ``tier`` (engine dict, then the tier's fields on
        top), or ``None`` when neither gives any (reference §2.12)."""
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
            out[key] = _plain(getattr(self, key))
        out["secondary_tiers"] = [t.to_dict() for t in self.secondary_tiers]
        return out

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"EngineConfig({fields})"

    __str__ = __repr__


def _tier_path(tier: TierConfig) -> str:
    return f"secondary_tiers[{tier.index}]"


# --------------------------------------------------------------------------------------------
# Per-request parameters
# --------------------------------------------------------------------------------------------


#: A ``kv_load_tiers`` string entry: a tier type name, optionally as a label ``"<n>:<type>"``.
_TIER_NAME_RE = re.compile(r"^([0-9]{1,4}:)?[A-Za-z_][A-Za-z0-9_.-]{0,255}$")


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """Matches a tier when, on each axis, the matcher is ``None``, the tier's value is ``None``,
    or both are equal (reference §1.2)."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True, slots=True)
class TierFilter:
    """Which secondary tiers a request may load from (``kv_load_tiers``).

    A tier is allowed when its 0-based index is in ``indexes``, its type name or label
    (``"1:fs"``) is in ``names`` (case-insensitive), or any matcher matches its medium and
    locality. ``TierFilter.ALL`` allows every tier; an empty filter allows none (the host tier is
    always consulted — it is not subject to the filter).
    """

    indexes: frozenset[int] = frozenset()
    names: frozenset[str] = frozenset()
    matchers: tuple[TierMatcher, ...] = ()
    allow_all: bool = False

    ALL: ClassVar[TierFilter]

    def allows(
        self, index: int, type_name: str, medium: Medium | None, locality: Locality | None
    ) -> bool:
        if self.allow_all:
            return True
        if index in self.indexes:
            return True
        if self.names and (
            type_name.lower() in self.names or f"{index + 1}:{type_name}".lower() in self.names
        ):
            return True
        return any(m.matches(medium, locality) for m in self.matchers)

    @classmethod
    def from_kv_load_tiers(cls, value: Any) -> TierFilter:
        """Parse ``kv_load_tiers``: a list of ints (tier index), strings (type name or label)
        and ``{medium, locality}`` dicts. Not a list → ALL; invalid entries are skipped with a
        warning; ``[]`` → no secondary tier; all entries invalid → ALL."""
        if value is None:
            return cls.ALL
        if not isinstance(value, (list, tuple)):
            logger.warning("kv_load_tiers = %s is not a list; consulting all tiers", _show(value))
            return cls.ALL
        if not value:
            return cls()
        indexes: set[int] = set()
        names: set[str] = set()
        matchers: list[TierMatcher] = []
        for i, entry in enumerate(value):
            if isinstance(entry, bool):
                problem: str | None = "a boolean is not a tier index"
            elif isinstance(entry, int):
                problem = None if entry >= 0 else "a tier index must be >= 0"
                if problem is None:
                    indexes.add(entry)
            elif isinstance(entry, str):
                problem = None if _TIER_NAME_RE.match(entry) else "not a tier type or label"
                if problem is None:
                    names.add(entry.lower())
            elif isinstance(entry, Mapping):
                matcher, problem = _parse_matcher(entry)
                if matcher is not None:
                    matchers.append(matcher)
            else:
                problem = "expected an int, a string or a {medium, locality} dict"
            if problem is not None:
                logger.warning("ignoring kv_load_tiers[%d] = %s: %s", i, _show(entry), problem)
        if not indexes and not names and not matchers:
            logger.warning("kv_load_tiers has no valid entry; consulting all tiers")
            return cls.ALL
        return cls(frozenset(indexes), frozenset(names), tuple(matchers))


TierFilter.ALL = TierFilter(allow_all=True)

def _parse_matcher(entry: Mapping[Any, Any]) -> tuple[TierMatcher | None, str | None]:
    unknown = [k for k in entry if k not in ("medium", "locality")]
    if unknown:
        return None, f"unknown matcher key {_show(unknown[0])} (allowed: medium, locality)"
    medium_raw, locality_raw = entry.get("medium"), entry.get("locality")
    medium: Medium | None = None
    if medium_raw is not None:
        if isinstance(medium_raw, Medium):
            medium = medium_raw
        elif isinstance(medium_raw, str) and medium_raw.upper() in Medium.__members__:
            medium = Medium[medium_raw.upper()]
        else:
            return None, "medium must be 'CPU' or 'STORAGE'"
    locality: Locality | None = None
    if locality_raw is not None:
        locality = _parse_locality(locality_raw)
        if locality is None:
            return None, "locality must be 'LOCAL' or 'REMOTE'"
    return TierMatcher(medium, locality), None


#: Fields of each P/D role key and their rules (CONFIG.md "Per-request fields").
_ROLE_FIELDS: Mapping[str, tuple[str, ...]] = {
    "remote_decoder": ("kv_request_id",),
    "remote_prefiller": ("kv_request_id", "remote_host", "remote_port"),
    "remote_kv_source": ("kv_request_id", "remote_host", "remote_port"),
}
_FORBIDDEN_ROLES: tuple[frozenset[str], ...] = (
    frozenset({"remote_prefiller", "remote_decoder"}),
    frozenset({"remote_prefiller", "remote_kv_source"}),
)


def _role_field_problem(name: str, value: Any) -> str | None:
    if name == "remote_port":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            return "an integer in 1..65535"
        return None
    limit = 255 if name == "remote_host" else 1024
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        return f"a non-empty string of at most {limit} characters"
    if name == "remote_host" and any(c.isspace() for c in value):
        return "a host name or address without spaces"
    return None


def _parse_role(key: str, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, Mapping):
        logger.warning("ignoring %s = %s: expected a dict", key, _show(value))
        return None
    out: dict[str, Any] = {}
    for name in _ROLE_FIELDS[key]:
        if name not in value:
            logger.warning("ignoring %s: missing field %r", key, name)
            return None
        problem = _role_field_problem(name, value[name])
        if problem is not None:
            logger.warning(
                "ignoring %s: %s.%s = %s, expected %s", key, key, name, _show(value[name]), problem
            )
            return None
        out[name] = value[name]
    return out


#: The per-request keys kvtier reads.
REQUEST_KEYS: frozenset[str] = frozenset(
    {"max_load_tokens", "max_offload_tokens", "kv_load_tiers", *_ROLE_FIELDS}
)
#: Keys other connectors put in ``kv_transfer_params`` that look like kvtier's but are not typos
#: (vLLM's NIXL/P2P connectors: ``do_remote_decode`` is close to ``remote_decoder``).
_FOREIGN_REQUEST_KEYS = frozenset({
    "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
    "remote_port", "remote_request_id", "remote_tp_size", "remote_dp_size", "remote_dp_rank",
    "tp_size", "request_id",
})
#: Similarity (difflib ratio) above which an unknown key is taken for a typo of a known one:
#: high, because vLLM and other connectors pass many keys of their own, silently allowed.
_TYPO_CUTOFF = 0.85
_checked_request_keys: set[str] = set()  # unknown keys already judged (per request, no difflib)
_MAX_CHECKED_REQUEST_KEYS = 1024


def _warn_likely_typos(params: Mapping[str, Any]) -> None:
    """Warn once per process per key about an unknown key that is probably a misspelt kvtier key."""
    for key in params:
        if not isinstance(key, str) or key in REQUEST_KEYS or key in _FOREIGN_REQUEST_KEYS:
            continue
        if key in _checked_request_keys or len(_checked_request_keys) >= _MAX_CHECKED_REQUEST_KEYS:
            continue
        _checked_request_keys.add(key)
        hint = _did_you_mean(key, REQUEST_KEYS, cutoff=_TYPO_CUTOFF)
        if hint:
            logger.warning("kv_transfer_params: unknown key %s is ignored%s (warned once per key)",
                           _show(key), hint)


def _parse_token_cap(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        logger.warning("ignoring %s = %s: expected an integer >= 0", key, _show(value))
        return None
    return value


@dataclass(frozen=True, slots=True)
class RequestParams:
    """Validated per-request fields of ``kv_transfer_params``.

    ``max_load_tokens``/``max_offload_tokens``: ``None`` = no cap, ``0`` disables loading /
    offloading for the request. ``load_tier_filter`` says which secondary tiers may serve loads.
    The role fields are ``None`` or a dict with exactly the validated fields of that role.
    """

    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    load_tier_filter: TierFilter = TierFilter.ALL
    remote_decoder: Mapping[str, Any] | None = None
    remote_prefiller: Mapping[str, Any] | None = None
    remote_kv_source: Mapping[str, Any] | None = None

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, Any] | None) -> RequestParams:
        """Parse a request's ``kv_transfer_params``.

        Bad values are logged as warnings (logger ``kvtier.config``) and ignored; unknown keys
        are ignored silently (vLLM passes many other keys), except one that is probably a typo of
        a kvtier key (``max_load_token``): one warning with the suggestion, once per process per key. A forbidden combination of role keys
        (``remote_prefiller`` with ``remote_decoder`` or ``remote_kv_source``) raises
        :class:`RequestError`, judged on the keys present with a non-null value.
        """
        if params is None:
            return cls()
        if not isinstance(params, Mapping):
            logger.warning("ignoring kv_transfer_params = %s: expected a dict", _show(params))
            return cls()
        _warn_likely_typos(params)
        present = {k for k in _ROLE_FIELDS if params.get(k) is not None}
        for forbidden in _FORBIDDEN_ROLES:
            if forbidden <= present:
                raise RequestError(
                    "forbidden combination of kv_transfer_params role keys: "
                    f"{', '.join(sorted(present))}; allowed: one of remote_decoder, "
                    "remote_prefiller, remote_kv_source, or remote_decoder + remote_kv_source"
                )
        roles = {k: _parse_role(k, params[k]) for k in present}
        return cls(
            max_load_tokens=_parse_token_cap("max_load_tokens", params.get("max_load_tokens")),
            max_offload_tokens=_parse_token_cap(
                "max_offload_tokens", params.get("max_offload_tokens")
            ),
            load_tier_filter=TierFilter.from_kv_load_tiers(params.get("kv_load_tiers")),
            remote_decoder=roles.get("remote_decoder"),
            remote_prefiller=roles.get("remote_prefiller"),
            remote_kv_source=roles.get("remote_kv_source"),
        )

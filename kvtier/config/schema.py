"""The schema machinery: one :class:`KeySpec` per configuration key, and the checks that apply it.

Validation is table-driven: each key has one :class:`KeySpec` (type, default, range or choices,
required) in a schema table, so every rule is stated once. Anything wrong raises
:class:`kvtier.errors.ConfigError` with a message naming the key path
(``secondary_tiers[1].n_read_threads``), the offending value (truncated, secrets shown as
``'***'``) and what is allowed; an unknown key gets the closest known one as a suggestion.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config.redaction import REDACTED, is_secret_name, redact, redact_plain, scrub_text
from kvtier.errors import ConfigError
from kvtier.types import Locality

__all__ = [
    "KeySpec",
    "MAX_BACKENDS",
    "MAX_TENANTS",
    "TENANT_LABEL_RE",
    "DEFAULT_TENANT",
    "MODULE_PATH_SPEC",
    "FrozenOptions",
    "check_keys",
    "convert",
    "did_you_mean",
    "invalid",
    "join_path",
    "parse_locality",
    "parse_section",
    "show_value",
]

#: Most entries of a string-list key, so a hostile or mistaken config cannot make start-up explode.
MAX_BACKENDS = 16
_MAX_SHOWN_CHARS = 80
#: Most labels of a tenant budget map, which bounds every per-tenant metric's label values.
MAX_TENANTS = 64
#: What a tenant label may look like (a request's ``tenant``, the keys of a budget map).
TENANT_LABEL_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}\Z")
#: The budget-map label of every request whose tenant is absent or not named in the map.
DEFAULT_TENANT = "default"

_MODULE_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


# --------------------------------------------------------------------------------------------
# Message helpers
# --------------------------------------------------------------------------------------------

_repr = reprlib.Repr()
_repr.maxstring = _MAX_SHOWN_CHARS
_repr.maxother = _MAX_SHOWN_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


def show_value(value: Any, *, secret: bool = False) -> str:
    """The value as it may appear in a message: redacted, size-bounded, at most ~80 chars."""
    if secret:
        return repr(REDACTED)
    text = scrub_text(_repr.repr(redact(value)))
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return text


def join_path(path: str, key: str) -> str:
    """The path of ``key`` inside the section at ``path`` (``""`` is the top level)."""
    return f"{path}.{key}" if path else key


def invalid(path: str, value: Any, allowed: str, *, secret: bool = False) -> ConfigError:
    """The error for ``value`` at ``path``; the value is hidden whole when the key is secret or its
    name looks like a credential (``backpressure.password``)."""
    key = re.sub(r"\[\d+\]$", "", path.rsplit(".", 1)[-1])
    shown = show_value(value, secret=secret or is_secret_name(key))
    return ConfigError(f"invalid {path} = {shown}: expected {allowed}")


def did_you_mean(word: str, candidates: Any, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate (similarity >= ``cutoff``), or ``""``."""
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------------------------
# One KeySpec per key
# --------------------------------------------------------------------------------------------

_NO_DEFAULT = object()


@dataclass(frozen=True, slots=True)
class KeySpec:
    """The rule of one configuration key.

    ``kind`` is one of ``"int"`` (bools rejected), ``"float"`` (ints accepted, NaN/inf rejected),
    ``"bool"``, ``"str"``, ``"str_list"`` (non-empty list of non-empty strings, stored as a tuple),
    ``"locality"`` (``LOCAL``/``REMOTE``, case-insensitive, stored as :class:`Locality`),
    ``"mapping"`` (validated against ``schema``), ``"backpressure"``, ``"budgets"`` (tenant label →
    bytes, at most :data:`MAX_TENANTS` labels) or ``"mode"`` (permission bits: an int, or an octal
    string such as ``"0640"``). ``nullable`` admits
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
        elif self.kind == "budgets":
            text = (f"a dict of at most {MAX_TENANTS} tenant labels (lower-case letters, digits, '_', '.', '-'; "
                    f"at most 32 characters; {DEFAULT_TENANT!r} for all others) to byte budgets > 0")
        elif self.kind == "mode":
            text = "permission bits: an integer such as 0o640 (416) or an octal string such as '0640'"
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


def _module_path(value: Any) -> str | None:
    return None if _MODULE_PATH_RE.match(value) else "must be a dotted Python module path"


#: An optional dotted module path (``spec_module_path``, a tier's ``module_path``).
MODULE_PATH_SPEC = KeySpec("str", default=None, nullable=True, non_empty=True, max_len=512,
                           check=_module_path, help="dotted module path")


def convert(spec: KeySpec, value: Any, path: str) -> Any:
    """Validate one present value against ``spec``; return its normalised form or raise."""
    if value is None:
        if spec.nullable:
            return None
        raise invalid(path, value, spec.describe(), secret=spec.secret)

    def bad() -> ConfigError:
        return invalid(path, value, spec.describe(), secret=spec.secret)

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
                raise invalid(f"{path}[{i}]", item, "a non-empty string")
        result = tuple(value)
    elif kind == "locality":
        result = parse_locality(value)
        if result is None:
            raise bad()
    elif kind == "mapping":
        if not isinstance(value, Mapping):
            raise bad()
        assert spec.schema is not None
        result = FrozenOptions(parse_section(value, spec.schema, path))
    elif kind == "budgets":
        result = FrozenOptions(_parse_budgets(value, path, bad))
    elif kind == "mode":
        result = _parse_mode(value, bad)
    elif kind in ("backpressure", "backpressure_override"):
        result = FrozenOptions(
            _parse_backpressure(value, path, require_cls=kind == "backpressure")
        )
    else:  # pragma: no cover - a schema typo, caught by the defaults test
        raise AssertionError(f"unknown KeySpec kind {kind!r}")
    if spec.check is not None:
        problem = spec.check(result)
        if problem is not None:
            raise invalid(path, value, f"{spec.describe()}; {problem}", secret=spec.secret)
    return result


def _parse_budgets(value: Any, path: str, bad: Callable[[], ConfigError]) -> dict[str, int]:
    if not isinstance(value, Mapping) or not value or len(value) > MAX_TENANTS:
        raise bad()
    out: dict[str, int] = {}
    for label, budget in value.items():
        if not isinstance(label, str) or not TENANT_LABEL_RE.match(label):
            raise ConfigError(
                f"invalid tenant label {show_value(label)} in {path}: expected lower-case letters, digits, "
                "'_', '.' or '-', starting with a letter or digit, at most 32 characters"
            )
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise invalid(f"{path}.{label}", budget, "a byte budget: an integer > 0")
        out[label] = budget
    return out


def _parse_mode(value: Any, bad: Callable[[], ConfigError]) -> int:
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not digits or len(digits) > 4 or any(c not in "01234567" for c in digits):
            raise bad()
        return int(digits, 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o7777:
        raise bad()
    return value


def _check_range(spec: KeySpec, value: float, bad: Callable[[], ConfigError]) -> None:
    if spec.gt is not None and not value > spec.gt:
        raise bad()
    if spec.ge is not None and not value >= spec.ge:
        raise bad()
    if spec.le is not None and not value <= spec.le:
        raise bad()


def parse_locality(value: Any) -> Locality | None:
    """``value`` as a :class:`Locality` (a member, or its name in any case), else ``None``."""
    if isinstance(value, Locality):
        return value
    if isinstance(value, str):
        try:
            return Locality(value.upper())
        except ValueError:
            return None
    return None


def check_keys(raw: Mapping[Any, Any], allowed: Any, path: str) -> None:
    """Reject non-string and unknown keys; the value of an unknown key is never shown
    (a misspelt ``secret_kye`` would otherwise leak)."""
    for key in raw:
        if not isinstance(key, str):
            where = path or "config"
            raise ConfigError(f"invalid key {show_value(key)} in {where}: keys must be strings")
        if key not in allowed:
            where = join_path(path, key)
            raise ConfigError(
                f"unknown key {show_value(where)}{did_you_mean(key, allowed)}; "
                f"allowed keys: {', '.join(sorted(allowed))}"
            )


def parse_section(
    raw: Mapping[Any, Any], schema: Mapping[str, KeySpec], path: str, *, extra_allowed: Any = ()
) -> dict[str, Any]:
    """Validate ``raw`` against ``schema``: unknown keys, required keys, each value; fill in
    defaults. Keys in ``extra_allowed`` are accepted here and handled by the caller."""
    check_keys(raw, set(schema) | set(extra_allowed), path)
    out: dict[str, Any] = {}
    for key, spec in schema.items():
        where = join_path(path, key)
        if key in raw:
            out[key] = convert(spec, raw[key], where)
        elif spec.env_default is not None:
            value, variable = spec.env_default()
            out[key] = convert(spec, value, f"{where} (from ${variable})")
        elif spec.required:
            raise ConfigError(f"missing required key {where}: expected {spec.describe()}")
        else:
            out[key] = spec.default
    return out


def _parse_backpressure(value: Any, path: str, *, require_cls: bool) -> dict[str, Any]:
    """Back-pressure settings (``docs/configuration.md``, "Back-pressure"): their shape is checked
    here; the engine's spec builds one detector per tier from the merged settings
    (``kvtier.backpressure``), which resolves the classes and rejects any argument the detector
    does not take.

    ``backpressure_cls`` (a short name or a dotted path) is required in the top-level dict; a
    tier's dict is merged over it field by field, so there it is required only when the
    top-level dict lacks it (checked by ``EngineConfig.from_dict``). ``policy_cls`` is optional;
    the remaining fields are detector arguments and must be plain scalars.
    """
    spec = KeySpec("backpressure" if require_cls else "backpressure_override")
    if not isinstance(value, Mapping):
        raise invalid(path, value, spec.describe())
    check_keys(value, value.keys(), path)  # only rejects non-string keys here
    out: dict[str, Any] = {}
    for key, item in value.items():
        where = join_path(path, key)
        if key in ("backpressure_cls", "policy_cls"):
            if not isinstance(item, str) or not item:
                raise invalid(where, item, "a non-empty string (class name or dotted path)")
        elif item is not None and not isinstance(item, (bool, int, float, str)):
            raise invalid(where, item, "a number, string, boolean or null (a detector argument)")
        out[key] = item
    if require_cls and "backpressure_cls" not in out:
        raise ConfigError(
            f"missing required key {join_path(path, 'backpressure_cls')}: expected a non-empty string"
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
        return repr(redact_plain(self))

    __str__ = __repr__

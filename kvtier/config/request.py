"""The request side: a request's ``kv_transfer_params`` as RequestParams, and the tier filter.

Unlike the engine configuration, a bad value here does not fail: it is logged as a warning on the
``kvtier.config`` logger and ignored, because one request's mistake must not stop the server.
Only a forbidden combination of P/D role keys raises :class:`kvtier.errors.RequestError`.
``docs/configuration.md`` ("Per-request fields") describes every field.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.config.schema import TENANT_LABEL_RE, did_you_mean, parse_locality, show_value
from kvtier.errors import RequestError
from kvtier.types import Locality, Medium

__all__ = ["RequestParams", "TierFilter", "TierMatcher", "REQUEST_KEYS", "judged_request_keys", "parse_matcher",
           "parse_tenant"]

logger = logging.getLogger("kvtier.config")

#: A ``kv_load_tiers`` string entry: a tier type name, optionally as a label ``"<n>:<type>"``.
_TIER_NAME_RE = re.compile(r"^([0-9]{1,4}:)?[A-Za-z_][A-Za-z0-9_.-]{0,255}\Z")


# --------------------------------------------------------------------------------------------
# kv_load_tiers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierMatcher:
    """Matches a tier when, on each axis, the matcher is ``None``, the tier's value is ``None``,
    or both are equal: an axis left open on either side does not exclude a tier."""

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
            logger.warning("kv_load_tiers = %s is not a list; consulting all tiers", show_value(value))
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
                matcher, problem = parse_matcher(entry)
                if matcher is not None:
                    matchers.append(matcher)
            else:
                problem = "expected an int, a string or a {medium, locality} dict"
            if problem is not None:
                logger.warning("ignoring kv_load_tiers[%d] = %s: %s", i, show_value(entry), problem)
        if not indexes and not names and not matchers:
            logger.warning("kv_load_tiers has no valid entry; consulting all tiers")
            return cls.ALL
        return cls(frozenset(indexes), frozenset(names), tuple(matchers))


TierFilter.ALL = TierFilter(allow_all=True)


def parse_matcher(entry: Mapping[Any, Any]) -> tuple[TierMatcher | None, str | None]:
    """A ``{medium, locality}`` dict as a :class:`TierMatcher`, or ``(None, what is wrong)``."""
    unknown = [k for k in entry if k not in ("medium", "locality")]
    if unknown:
        return None, f"unknown matcher key {show_value(unknown[0])} (allowed: medium, locality)"
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
        locality = parse_locality(locality_raw)
        if locality is None:
            return None, "locality must be 'LOCAL' or 'REMOTE'"
    return TierMatcher(medium, locality), None


# --------------------------------------------------------------------------------------------
# P/D roles
# --------------------------------------------------------------------------------------------

#: Fields of each P/D role key.
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
        logger.warning("ignoring %s = %s: expected a dict", key, show_value(value))
        return None
    out: dict[str, Any] = {}
    for name in _ROLE_FIELDS[key]:
        if name not in value:
            logger.warning("ignoring %s: missing field %r", key, name)
            return None
        problem = _role_field_problem(name, value[name])
        if problem is not None:
            logger.warning(
                "ignoring %s: %s.%s = %s, expected %s", key, key, name, show_value(value[name]), problem
            )
            return None
        out[name] = value[name]
    return out


# --------------------------------------------------------------------------------------------
# Unknown keys
# --------------------------------------------------------------------------------------------

#: The per-request keys kvtier reads.
REQUEST_KEYS: frozenset[str] = frozenset(
    {"max_load_tokens", "max_offload_tokens", "kv_load_tiers", "tenant", *_ROLE_FIELDS}
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
#: Unknown keys already judged, so that each is looked at (and warned about) once per process,
#: not on every request; bounded by _MAX_JUDGED_REQUEST_KEYS.
judged_request_keys: set[str] = set()
_MAX_JUDGED_REQUEST_KEYS = 1024


def _warn_likely_typos(params: Mapping[str, Any]) -> None:
    """Warn once per process per key about an unknown key that is probably a misspelt kvtier key."""
    for key in params:
        if not isinstance(key, str) or key in REQUEST_KEYS or key in _FOREIGN_REQUEST_KEYS:
            continue
        if key in judged_request_keys or len(judged_request_keys) >= _MAX_JUDGED_REQUEST_KEYS:
            continue
        judged_request_keys.add(key)
        hint = did_you_mean(key, REQUEST_KEYS, cutoff=_TYPO_CUTOFF)
        if hint:
            logger.warning("kv_transfer_params: unknown key %s is ignored%s (warned once per key)",
                           show_value(key), hint)


# --------------------------------------------------------------------------------------------
# RequestParams
# --------------------------------------------------------------------------------------------


def _parse_token_cap(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        logger.warning("ignoring %s = %s: expected an integer >= 0", key, show_value(value))
        return None
    return value


def parse_tenant(value: Any) -> str | None:
    """A request's ``tenant`` label, or None (absent, or invalid: warned about and ignored).

    The value is never echoed in the warning: a caller that puts a secret there by mistake (a
    ``cache_salt``) must not find it in the logs.
    """
    if value is None:
        return None
    if isinstance(value, str) and TENANT_LABEL_RE.match(value):
        return value
    logger.warning("ignoring tenant (a %s): expected a label of 1 to 32 lower-case letters, digits, "
                   "'_', '.' or '-', starting with a letter or digit", type(value).__name__)
    return None


@dataclass(frozen=True, slots=True)
class RequestParams:
    """Validated per-request fields of ``kv_transfer_params``.

    ``max_load_tokens``/``max_offload_tokens``: ``None`` = no cap, ``0`` disables loading /
    offloading for the request. ``load_tier_filter`` says which secondary tiers may serve loads.
    The role fields are ``None`` or a dict with exactly the validated fields of that role.
    ``tenant`` is the request's tenant label (``None``: the ``"default"`` pool of every tenant
    budget); a label no budget map names is charged to ``"default"`` as well.
    """

    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    load_tier_filter: TierFilter = TierFilter.ALL
    remote_decoder: Mapping[str, Any] | None = None
    remote_prefiller: Mapping[str, Any] | None = None
    remote_kv_source: Mapping[str, Any] | None = None
    tenant: str | None = None

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, Any] | None) -> RequestParams:
        """Parse a request's ``kv_transfer_params``.

        Bad values are logged as warnings (logger ``kvtier.config``) and ignored; unknown keys
        are ignored silently (vLLM passes many other keys), except one that is probably a typo of
        a kvtier key (``max_load_token``): one warning with the suggestion, once per process per
        key. A forbidden combination of role keys (``remote_prefiller`` with ``remote_decoder``
        or ``remote_kv_source``) raises :class:`RequestError`, judged on the keys present with a
        non-null value.
        """
        if params is None:
            return cls()
        if not isinstance(params, Mapping):
            logger.warning("ignoring kv_transfer_params = %s: expected a dict", show_value(params))
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
            tenant=parse_tenant(params.get("tenant")),
        )

"""Redaction of credentials in everything the configuration code shows as text.

Secrets (``access_key``, ``secret_key``, ``session_token``) are kept as plain strings for the tier
that needs them; no ``repr``/``str``/``to_dict``, error message or warning shows them, whatever
container they were written in: text leaves the configuration package through :func:`redact`
(or :func:`redact_plain` for JSON-like output).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["SECRET_KEYS", "REDACTED", "is_secret_name", "scrub_text", "redact", "redact_plain"]

#: Keys whose values are credentials: shown as ``'***'`` everywhere (messages, repr, to_dict).
SECRET_KEYS: frozenset[str] = frozenset({"access_key", "secret_key", "session_token"})
#: What is shown in place of a credential.
REDACTED = "***"

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


def is_secret_name(key: Any) -> bool:
    """Whether ``key`` (a mapping key, or an item of a sequence) names a credential."""
    if isinstance(key, (bytes, bytearray)):
        key = bytes(key).decode("latin-1")
    return isinstance(key, str) and _SECRET_KEY_RE.fullmatch(key.strip()) is not None


def _secret_value(value: Any) -> Any:
    """What is shown for the value of a secret key: ``'***'``, unless it is empty (nothing to hide,
    and ``to_dict`` output with unset credentials stays acceptable to ``from_dict``)."""
    return value if value is None or (isinstance(value, (str, bytes)) and not value) else REDACTED


def scrub_text(text: str) -> str:
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
            return text[: join.end()] + REDACTED
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

    Used for everything that leaves the configuration package as text. A value that sits *under* a
    secret name (a mapping key such as ``secret_key``, any case or separator) or *beside* one (the
    items after it in a list or tuple: ``[("secret_key", x)]``, ``["secret_key", x]``) is replaced
    by ``'***'``, whole even when it is itself a container; a set holding a secret name keeps only
    the names; a string (or bytes) is cut after a name written with its value (``"secret_key=x"``);
    an object of another type whose ``repr`` shows such a pair stands for that ``repr``, scrubbed
    the same way. Mappings become dicts, lists/tuples keep their kind; depth is bounded so a
    self-referencing structure cannot recurse forever.
    """
    return _redacted(value, 0, plain=False)


def redact_plain(value: Any) -> Any:
    """Plain ``dict``/``list`` form (JSON-like: tuples and sets as lists, enums as their values)
    of a normalised value, secrets redacted as :func:`redact` does."""
    return _redacted(value, 0, plain=True)


def _redacted(value: Any, depth: int, *, plain: bool) -> Any:
    """:func:`redact`; with ``plain``, also in JSON-like form (tuples as lists, enums as values)."""
    if depth > _MAX_REDACT_DEPTH:
        return "..."
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, enum.Enum):
        return value.value if plain else value
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, (bytes, bytearray)):
        text = bytes(value).decode("latin-1")
        scrubbed = scrub_text(text)
        return value if scrubbed == text else scrubbed.encode("latin-1")
    if isinstance(value, Mapping):
        return {
            _redacted(k, depth + 1, plain=plain):
                _secret_value(v) if is_secret_name(k) else _redacted(v, depth + 1, plain=plain)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        items: list[Any] = []
        beside_secret = False
        for item in value:
            items.append(_secret_value(item) if beside_secret else _redacted(item, depth + 1, plain=plain))
            beside_secret = beside_secret or is_secret_name(item)
        return items if plain or isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        has_secret_name = any(is_secret_name(item) for item in value)
        kept = [item if is_secret_name(item) else REDACTED if has_secret_name
                else _redacted(item, depth + 1, plain=plain) for item in value]
        if plain:
            return kept
        return frozenset(kept) if isinstance(value, frozenset) else set(kept)
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the configuration error being reported
        return _Shown(f"<{type(value).__name__}>")
    scrubbed = scrub_text(text)
    if scrubbed == text:
        return value
    return scrubbed if plain else _Shown(scrubbed)

"""Exception types shared by every layer of kvtier, and :func:`trim_traceback` for raising them
at public entry points.

Kept in their own module at the bottom of the import graph so that any module can raise them
without importing the configuration machinery.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["ConfigError", "RequestError", "EngineClosedError", "KvtierError", "trim_traceback"]

_E = TypeVar("_E", bound=BaseException)


class KvtierError(Exception):
    """Base class of kvtier's own errors."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid.

    The message names the key path (``secondary_tiers[1].n_read_threads``), the offending value
    (never a secret) and what is allowed. Raised at start-up, never on the serving path.
    """


class RequestError(KvtierError, ValueError):
    """A per-request field combination is forbidden (for example two conflicting P/D roles)."""


class EngineClosedError(KvtierError, RuntimeError):
    """A method was called on an engine that is closed or closing.

    Raised by every public :class:`kvtier.Engine` and ``ThreadedEngine`` call once the engine's
    ``async with kvtier.open(...)`` block was left (or ``close()`` was called): a closed engine
    never answers ``0`` as if nothing were cached. Open a new engine instead.
    """


def trim_traceback(exc: _E) -> _E:
    """``exc`` ready to be raised again at a public entry point, as ``raise trim_traceback(exc)``.

    Its traceback is dropped, so the raise starts it afresh at the entry point: the user sees the
    call they made and the one clear message, not the frames of kvtier's validation internals. An
    explicit cause (``raise ... from err``) is kept; an implicit context is hidden.
    """
    exc.__suppress_context__ = True
    return exc.with_traceback(None)

"""Exception types shared by every layer of kvtier.

Kept in their own module at the bottom of the import graph so that any module can raise them
without importing the configuration machinery.
"""

from __future__ import annotations

__all__ = ["ConfigError", "RequestError", "EngineClosedError", "KvtierError"]


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

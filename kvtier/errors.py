"""Exception types shared by every layer of kvtier.

Kept in their own module at the bottom of the import graph so that any module can raise them
without importing the configuration machinery.
"""

from __future__ import annotations

__all__ = ["ConfigError", "RequestError", "KvtierError"]


class KvtierError(Exception):
    """Base class of kvtier's own errors."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid.

    The message names the key path (``secondary_tiers[1].n_read_threads``), the offending value
    (never a secret) and what is allowed. Raised at start-up, never on the serving path.
    """


class RequestError(KvtierError, ValueError):
    """A per-request field combination is forbidden (for example two conflicting P/D roles)."""

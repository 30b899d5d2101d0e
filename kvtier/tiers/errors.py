"""The exceptions a tier's primitives raise, and the statistics label of any exception.

A primitive raises :class:`ChunkNotFound` for an absent chunk, :class:`ChunkCorrupt` for bytes
that failed verification (after removing them), and :class:`TierIOError` with a ``reason`` for
any other failure. The framework counts every failure under ``(direction, failure_reason(exc))``.
"""

from __future__ import annotations

import errno

__all__ = ["TierError", "ChunkNotFound", "ChunkCorrupt", "TierIOError", "failure_reason"]


class TierError(Exception):
    """A chunk operation failed; ``reason`` is the short label counted in the statistics."""

    reason: str = "io_error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message or (reason or self.reason))
        if reason is not None:
            self.reason = reason


class ChunkNotFound(TierError):
    """The tier does not hold the chunk (reason ``"missing"``)."""

    reason = "missing"


class ChunkCorrupt(TierError):
    """The chunk's bytes failed verification; the tier removed them (reason ``"corrupt"``)."""

    reason = "corrupt"


class TierIOError(TierError):
    """Any other failure, with an explicit reason: ``"no_space"``, ``"permission"``,
    ``"io_error"``, ``"timeout"``, ``"throttled"``, …"""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message, reason=reason)


_ERRNO_REASONS: dict[int, str] = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EROFS: "permission",
    errno.ENOENT: "missing",
    errno.EIO: "io_error",
}


def failure_reason(exc: BaseException) -> str:
    """The statistics label of a primitive's exception.

    :class:`TierError` → its ``reason``; ``TimeoutError`` → ``"timeout"`` (checked before
    ``OSError``, of which it is a subclass); ``OSError`` → by errno (ENOSPC/EDQUOT ``no_space``,
    EACCES/EPERM/EROFS ``permission``, ENOENT ``missing``, anything else ``io_error``); any other
    exception → ``"internal"`` (a bug in the tier).
    """
    if isinstance(exc, TierError):
        return exc.reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return _ERRNO_REASONS.get(exc.errno or 0, "io_error")
    return "internal"

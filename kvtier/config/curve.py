"""Reading CurveZMQ certificates named by a configuration key, with errors that name the key.

The p2p control plane, the warm-up endpoint and its client load their key pairs the same way:
:func:`load_certificate` reads one certificate file (``zmq.auth`` format) and raises a
:class:`kvtier.errors.ConfigError` that names the key and the path — never the key material — when
the file is missing or is not a certificate; :func:`require_curve` refuses a libzmq built without
CURVE.
"""

from __future__ import annotations

import os

from kvtier.errors import ConfigError

__all__ = ["load_certificate", "require_curve"]


def require_curve(key: str) -> None:
    """ConfigError naming ``key`` when the installed libzmq has no CURVE support."""
    import zmq

    if not zmq.has("curve"):
        raise ConfigError(f"{key}: the installed libzmq ({zmq.zmq_version()}) has no CURVE support; install a "
                          "pyzmq wheel built with libsodium/CURVE")


def load_certificate(key: str, path: str) -> tuple[bytes, bytes | None]:
    """``(public, secret or None)`` of the certificate at ``path``, read for configuration key ``key``."""
    import zmq.auth

    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        kind = "missing" if not os.path.exists(path) else "unreadable or not a certificate"
        raise ConfigError(f"{key}: {path!r} is {kind} ({type(exc).__name__})") from None

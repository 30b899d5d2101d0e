"""ZMQ endpoints of the KV event publisher: their grammar, the per-rank offset, bind or connect.

Endpoints are checked when a publisher is built, so that a typo is a
:class:`~kvtier.errors.ConfigError` naming the key at start-up; whether an address can be used is
found out when the socket is bound.
"""

from __future__ import annotations

import ipaddress
import re

from kvtier.errors import ConfigError

__all__ = ["check_endpoint", "offset_endpoint_for_rank", "binds"]

_TCP_PORT = re.compile(r"^(tcp://.*):(\d+)$")


def offset_endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: TCP port + rank, ``inproc`` name + ``_dp<rank>``.

    Port 0, ``*`` ports, ``ipc://`` and rank 0 are returned unchanged.
    """
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    match = _TCP_PORT.match(endpoint)
    if match and int(match.group(2)) != 0:
        return f"{match.group(1)}:{int(match.group(2)) + rank}"
    return endpoint


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any and local transports; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_NUMERIC_HOST = re.compile(r"^[0-9.]+$")


def check_endpoint(key: str, endpoint: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``endpoint`` is a well-formed ZMQ endpoint.

    ``tcp://HOST:PORT`` (HOST ``*``, an IPv4 or ``[IPv6]`` literal, or a host or interface name;
    PORT 0..65535 or ``*``; an optional ``SOURCE;`` part of the same form), ``ipc://PATH`` or
    ``inproc://NAME`` (non-empty). Whether the address can be used is found out at bind time.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(f"{key}: expected a str endpoint, got {type(endpoint).__name__}")
    problem = _endpoint_problem(endpoint)
    if problem is not None:
        raise ConfigError(f"{key}: {endpoint[:80]!r} {problem}")


def _endpoint_problem(endpoint: str) -> str | None:
    if len(endpoint) > 1024:
        return "is longer than 1024 characters"
    if "\x00" in endpoint:
        return "contains a NUL character"
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return "is not a tcp://, ipc:// or inproc:// endpoint"
    if scheme != "tcp":
        return None if rest else f"has an empty {scheme} address"
    *source, address = rest.split(";")
    if len(source) > 1:
        return "has more than one ';' (tcp://[SOURCE;]HOST:PORT)"
    if source:  # a connect's source: an interface or address, with or without a port
        problem = _tcp_address_problem(source[0]) if ":" in source[0] else _host_problem(source[0])
        if problem is not None:
            return problem
    return _tcp_address_problem(address)


def _tcp_address_problem(address: str) -> str | None:
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "is not tcp://HOST:PORT"
    if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return f"has port {port!r}; expected 0..65535 or '*'"
    return _host_problem(host)


def _host_problem(host: str) -> str | None:
    if host == "*":
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            return f"has {host!r} in brackets, which is not an IPv6 address"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"has host {host!r}, which is not a valid IPv6 address"
        return None
    if _NUMERIC_HOST.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"has host {host!r}, which is not a valid IPv4 address"
        return None
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in name.split(".")):
        return f"has host {host[:80]!r}, which is not a valid host or interface name"
    return None

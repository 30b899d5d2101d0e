"""Where the p2p data plane may be reached, and the connections that reached it.

UCX listens on every interface and picks its own devices; the data plane confines it to the
configured host (:func:`host_addresses`, :func:`net_devices`: the interfaces, and the RDMA ports
behind them, that carry that host's addresses) and polices its listening port: it lists this
process's accepted TCP connections from Linux ``/proc`` (:func:`accepted_connections`), learns
which of them are links through ``ucp_ep_query`` on the libucp ucxx loaded
(:func:`ucp_library`, :func:`addresses_of`), and shuts the others down under UCX
(:func:`shut_down`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import stat
import sys
from typing import Any, Final, NamedTuple

from kvtier.errors import ConfigError

__all__ = ["host_addresses", "net_devices", "rdma_ports", "ucp_library", "addresses_of", "Connection",
           "accepted_connections", "shut_down"]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [  # struct ifaddrs (getifaddrs(3)); only the fields read here matter
    ("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p), ("ifa_netmask", ctypes.c_void_p), ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]


def _sockaddr(pointer: int) -> tuple[str, int] | None:
    """``(address, port)`` of a ``struct sockaddr`` in memory (IPv4 or IPv6); None otherwise."""
    family = ctypes.c_ushort.from_address(pointer).value
    if family == socket.AF_INET:
        raw = ctypes.string_at(pointer, 8)
        return _canonical(socket.inet_ntop(socket.AF_INET, raw[4:8])), int.from_bytes(raw[2:4], "big")
    if family == socket.AF_INET6:
        raw = ctypes.string_at(pointer, 24)
        return _canonical(socket.inet_ntop(socket.AF_INET6, raw[8:24])), int.from_bytes(raw[2:4], "big")
    return None


def _canonical(address: str) -> str:
    """One spelling per address: IPv4-mapped IPv6 addresses as IPv4, IPv6 compressed."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _interface_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for every IPv4/IPv6 address of this host (getifaddrs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr:
                address = _sockaddr(entry.ifa_addr)
                if address is not None and entry.ifa_name:
                    found.append((entry.ifa_name.decode(errors="replace"), address[0]))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def host_addresses(host: str) -> frozenset[str]:
    """The addresses ``host`` (a name or a literal, IPv6 bracketed or not) stands for.

    Empty for a wildcard (``0.0.0.0``, ``::``, ``*``): every address. Raises :class:`ConfigError`
    when the name does not resolve.
    """
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name in ("*", ""):
        return frozenset()
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ConfigError(f"p2p host {host[:64]!r} does not resolve: {exc.strerror}") from None
    addresses = frozenset(_canonical(str(info[4][0])) for info in infos)
    if any(ipaddress.ip_address(a).is_unspecified for a in addresses):
        return frozenset()
    return addresses


def net_devices(host: str) -> str | None:
    """The ``UCX_NET_DEVICES`` value that confines UCX to ``host``'s interfaces (and their RDMA
    ports, :func:`rdma_ports`).

    None for a wildcard host (every device). Raises :class:`ConfigError` when no interface of
    this machine holds any of ``host``'s addresses (the control plane could not bind it either).
    """
    addresses = host_addresses(host)
    if not addresses:
        return None
    names = sorted({name for name, address in _interface_addresses() if address in addresses})
    if not names:
        raise ConfigError(f"p2p host {host[:64]!r} ({', '.join(sorted(addresses))}) is not an "
                          "address of any network interface of this machine")
    return ",".join(names + rdma_ports(names))


def rdma_ports(interfaces: list[str], sysfs: str = "/sys/class") -> list[str]:
    """UCX's names (``mlx5_0:1``) of the RDMA ports behind ``interfaces``: every port of each HCA
    that shares an interface's PCI device (RoCE, or IPoIB's ``ib0``), so confining UCX to the
    host's interfaces keeps their RDMA transports. None where the machine has no such device."""
    ports: list[str] = []
    for interface in interfaces:
        hcas = os.path.join(sysfs, "net", interface, "device", "infiniband")
        try:
            names = sorted(os.listdir(hcas))
        except OSError:
            continue  # not an RDMA-capable device (loopback, a plain NIC, a virtual interface)
        for hca in names:
            try:
                numbers = sorted(os.listdir(os.path.join(sysfs, "infiniband", hca, "ports")), key=int)
            except (OSError, ValueError):
                continue
            ports += [f"{hca}:{number}" for number in numbers if f"{hca}:{number}" not in ports]
    return ports


def ucp_library() -> Any:
    """libucp as loaded by ucxx (never a second copy), with ``ucp_ep_query`` typed; None if absent."""
    try:
        lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_ep_query.restype = ctypes.c_int
    return lib


_UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR: Final = 1 << 1
_UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR: Final = 1 << 2
# ucp_ep_attr_t (ucp.h, UCX >= 1.13): uint64 field_mask, char name[32], struct sockaddr_storage
# local_sockaddr, then remote_sockaddr; a generous buffer covers the fields after it.
_UCP_EP_ATTR_LOCAL_OFFSET: Final = 8 + 32
_UCP_EP_ATTR_REMOTE_OFFSET: Final = 8 + 32 + 128
_UCP_EP_ATTR_BYTES: Final = 1024


def addresses_of(endpoint: Any) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """``(local, peer)`` addresses of a listener-accepted ucxx endpoint's connection
    (ucp_ep_query); ``(None, None)`` if UCX cannot tell."""
    lib = ucp_library()
    if lib is None:
        return None, None
    attr = (ctypes.c_char * _UCP_EP_ATTR_BYTES)()
    ctypes.c_uint64.from_buffer(attr).value = _UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR | _UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR
    try:
        status = lib.ucp_ep_query(ctypes.c_void_p(int(endpoint.ucp_endpoint)), attr)
    except Exception:  # noqa: BLE001 - an endpoint already gone: nothing to protect
        return None, None
    if status != 0:
        return None, None
    base = ctypes.addressof(attr)
    return _sockaddr(base + _UCP_EP_ATTR_LOCAL_OFFSET), _sockaddr(base + _UCP_EP_ATTR_REMOTE_OFFSET)


class Connection(NamedTuple):
    """An accepted TCP connection of this process, from ``/proc``."""

    fd: int
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]


def _proc_address(field: str, v6: bool) -> tuple[str, int]:
    address, _, port = field.partition(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":  # /proc prints each 32-bit word in host order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET6 if v6 else socket.AF_INET
    return _canonical(socket.inet_ntop(family, raw)), int(port, 16)


def accepted_connections(port: int) -> list[Connection]:
    """This process's TCP connections whose local port is ``port`` (Linux ``/proc``), not listeners."""
    sockets: dict[int, int] = {}  # inode -> fd
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            sockets[int(target[8:-1])] = int(name)
    found: list[Connection] = []
    for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        try:
            with open(table) as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] == "0A":  # 0A: LISTEN
                continue
            local = _proc_address(fields[1], v6)
            fd = sockets.get(int(fields[9]))
            if local[1] == port and fd is not None:
                found.append(Connection(fd, int(fields[9]), local, _proc_address(fields[2], v6)))
    return found


def shut_down(connection: Connection) -> bool:
    """Shut ``connection`` down under UCX (which then closes its own descriptor); False if its
    descriptor no longer holds that socket."""
    try:
        duplicate = os.dup(connection.fd)
    except OSError:
        return False
    try:
        info = os.fstat(duplicate)
        sock = None
        if stat.S_ISSOCK(info.st_mode) and info.st_ino == connection.inode:  # not reused since
            sock = socket.socket(fileno=duplicate)
    except OSError:
        sock = None
    if sock is None:
        os.close(duplicate)
        return False
    # Shutting the connection down through the duplicate acts on the one UCX holds (UCX then
    # closes its own descriptor once it reads the end); closing the duplicate leaves UCX's.
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True



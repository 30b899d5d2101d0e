"""What kvtier's helper processes share: the fs tier's scan workers (:mod:`kvtier.tiers.fs.scan`)
and ``kvtier verify``'s (:mod:`kvtier.ops.verify_workers`). Each is ``python -I -c BOOT`` talking
length-prefixed msgspec frames on its stdin and stdout; :func:`import_paths` tells it where kvtier
and its dependencies are. Imports nothing of kvtier's, so a worker that imports this starts fast.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TypeVar

import msgspec

__all__ = ["FRAME_HEADER", "import_paths", "die_with_parent", "requests", "read_exactly", "write_all"]

#: A request on a worker's stdin is this header (the payload's length) and a msgpack payload.
FRAME_HEADER = struct.Struct(">I")
_T = TypeVar("_T")


def import_paths(*modules: ModuleType) -> list[str]:
    """The directories a worker imports from: kvtier's, then those this process imported
    ``modules`` from (a worker runs isolated, ``-I``, so it is told where to find them), without
    repeats, in order."""
    paths = [_parent_of(__file__, levels=2)]
    for module in modules:
        parent = _parent_of(module.__file__ or "", levels=2)
        if parent not in paths:
            paths.append(parent)
    return paths


def _parent_of(path: str, *, levels: int) -> str:
    """The directory ``levels`` above ``path`` (a package's ``__init__.py``: where it is importable from)."""
    path = os.path.abspath(path)
    for _ in range(levels):
        path = os.path.dirname(path)
    return path


def die_with_parent(parent: int) -> None:
    """Be killed when process ``parent`` dies (Linux: ``PR_SET_PDEATHSIG``), so a crashed or
    interrupted parent leaves no worker behind; exit now if it is already gone. Elsewhere a
    worker ends at its next write to the parent."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the request above took effect
        os._exit(0)


def read_exactly(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``; None at its end."""
    data = bytearray()
    while len(data) < n:
        part = os.read(fd, n - len(data))
        if not part:
            return None
        data += part
    return bytes(data)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def requests(decoder: msgspec.msgpack.Decoder[_T], *, max_bytes: int) -> Iterator[_T]:
    """The requests a worker reads on its stdin (:data:`FRAME_HEADER` and a msgpack payload of at
    most ``max_bytes``), decoded, until stdin ends (the parent closed it, or died)."""
    while True:
        header = read_exactly(0, FRAME_HEADER.size)
        if header is None:
            return
        (length,) = FRAME_HEADER.unpack(header)
        if length > max_bytes:
            raise ValueError(f"a request of {length} bytes (at most {max_bytes})")
        payload = read_exactly(0, length)
        if payload is None:
            return
        yield decoder.decode(payload)

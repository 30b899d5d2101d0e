"""The chunk trailer: how a stored chunk proves its bytes are the ones that were written.

On-disk (or in-object) format of one chunk, fixed for format version 1::

    offset 0                      payload: exactly the host slot's bytes (``slot_bytes``, 4096-aligned)
    offset slot_bytes             trailer page: TRAILER_PAGE (4096) bytes, zero except its last 32
    offset slot_bytes + 4064      trailer: TRAILER_SIZE (32) bytes, little-endian, struct ``<4sHHQQ8x``:
                                      magic      b"KVTR"
                                      version    u16  (1)
                                      flags      u16  (0; reserved, must be 0 in version 1)
                                      length     u64  payload length in bytes (== slot_bytes)
                                      checksum   u64  xxh3-64 (seed 0) of the payload
                                      reserved   8 zero bytes
    total file size = slot_bytes + TRAILER_PAGE

Why a whole trailer page: an ``O_DIRECT`` writer may only write page-aligned lengths, and one
format must serve buffered and direct writers alike, so every writer appends the same page.
vLLM's reader reads exactly ``slot_bytes`` from offset 0, so it reads kvtier files unchanged;
a file of exactly ``slot_bytes`` (written by vLLM, no trailer) is accepted as *unverified*.

Every other shape is rejected with a reason (:class:`Verdict` ``reason``):
``short`` (smaller than the trailered size and not exactly ``slot_bytes``), ``long`` (larger),
``bad_trailer`` (wrong magic, version, flags or recorded length) and ``checksum``.

This module is pure (no I/O): the filesystem tier and the object tier both use it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "TRAILER_SIZE",
    "TRAILER_PAGE",
    "SizeClass",
    "Verdict",
    "checksum",
    "pack_trailer",
    "make_trailer_page",
    "stored_size",
    "classify_size",
    "verify",
    "REJECT_REASONS",
]

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_TRAILER = struct.Struct("<4sHHQQ8x")
TRAILER_SIZE = _TRAILER.size  # 32
TRAILER_PAGE = 4096
#: Every reason a stored chunk can be rejected for (the label values of the rejection counter).
REJECT_REASONS: tuple[str, ...] = ("short", "long", "bad_trailer", "checksum")

assert TRAILER_SIZE == 32


class SizeClass(enum.Enum):
    """What a stored object's size alone says about it."""

    TRAILERED = "trailered"  # slot_bytes + TRAILER_PAGE: verify the trailer
    RAW = "raw"  # exactly slot_bytes: written without a trailer (vLLM); unverifiable
    SHORT = "short"
    LONG = "long"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one stored chunk. ``ok`` ⇔ ``reason is None``."""

    ok: bool
    verified: bool  # True when a trailer checksum vouched for the bytes
    reason: str | None = None

    @staticmethod
    def reject(reason: str) -> Verdict:
        return Verdict(ok=False, verified=False, reason=reason)


ACCEPTED_VERIFIED = Verdict(ok=True, verified=True)
ACCEPTED_UNVERIFIED = Verdict(ok=True, verified=False)


def checksum(payload: memoryview | bytes) -> int:
    """xxh3-64 (seed 0) of ``payload``; accepts any contiguous buffer without copying."""
    return xxhash.xxh3_64_intdigest(payload)


def pack_trailer(payload: memoryview | bytes) -> bytes:
    """The 32-byte trailer for ``payload``."""
    return _TRAILER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), checksum(payload))


def make_trailer_page(payload: memoryview | bytes) -> bytes:
    """The full TRAILER_PAGE bytes appended after ``payload`` (zeros, then the trailer)."""
    return bytes(TRAILER_PAGE - TRAILER_SIZE) + pack_trailer(payload)


def stored_size(slot_bytes: int) -> int:
    """Size of a chunk written by kvtier for a ``slot_bytes`` slot."""
    return slot_bytes + TRAILER_PAGE


def classify_size(size: int, slot_bytes: int) -> SizeClass:
    """Classify a stored object by size alone (before reading any of it)."""
    if size == slot_bytes + TRAILER_PAGE:
        return SizeClass.TRAILERED
    if size == slot_bytes:
        return SizeClass.RAW
    return SizeClass.SHORT if size < slot_bytes + TRAILER_PAGE else SizeClass.LONG


def verify(payload: memoryview | bytes, trailer_page: memoryview | bytes | bytearray | None) -> Verdict:
    """Check ``payload`` against the trailer at the end of ``trailer_page``.

    ``trailer_page`` is ``None`` for a raw (trailer-less) chunk whose size already matched:
    accepted, unverified. Never raises for malformed input; the reason says what was wrong.
    """
    if trailer_page is None:
        return ACCEPTED_UNVERIFIED
    if len(trailer_page) < TRAILER_SIZE:
        return Verdict.reject("bad_trailer")
    magic, version, flags, length, digest = _TRAILER.unpack_from(trailer_page, len(trailer_page) - TRAILER_SIZE)
    if magic != MAGIC or version != FORMAT_VERSION or flags != 0 or length != len(payload):
        return Verdict.reject("bad_trailer")
    if digest != checksum(payload):
        return Verdict.reject("checksum")
    return ACCEPTED_VERIFIED

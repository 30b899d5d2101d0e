"""The chunk trailer: how a stored chunk proves it is the chunk asked for, with the bytes written.

On-disk (or in-object) format of one chunk, format version 2::

    offset 0                      payload: exactly the host slot's bytes (``slot_bytes``, 4096-aligned)
    offset slot_bytes             trailer page: TRAILER_PAGE (4096) bytes, zero except its last 160
    offset slot_bytes + 3936      identity: IDENTITY_SIZE (128) bytes, struct ``<32sH64s30x``:
                                      run        32 bytes: the fingerprint of the run and rank
                                                 whose tree holds the chunk
                                                 (:attr:`kvtier.layout.Namespace.fingerprint`)
                                      key_len    u16  length of the chunk's offload key (≤ 64)
                                      key        64 bytes: the offload key, zero padded
                                      reserved   30 zero bytes
    offset slot_bytes + 4064      tail: TAIL_SIZE (32) bytes, little-endian, struct ``<4sHHQQ8x``:
                                      magic      b"KVTR"
                                      version    u16  (2)
                                      flags      u16  (0; reserved, must be 0)
                                      length     u64  payload length in bytes (== slot_bytes)
                                      checksum   u64  xxh3-64 (seed 0) of the payload
                                      reserved   8 zero bytes
    total file size = slot_bytes + TRAILER_PAGE

The tail sits at the same place in every version, so a reader always learns the version first.
The identity binds the bytes to one chunk of one run (and rank, where ranks keep separate trees): a
valid chunk file renamed or copied over another chunk's name, or moved between runs or ranks,
fails with ``wrong_chunk`` although its checksum holds. Version-1 files (no identity) are rejected
with ``old_version`` — they cannot prove which chunk they are — and so are removed and
recomputed, once, as any miss is.

Why a whole trailer page: an ``O_DIRECT`` writer may only write page-aligned lengths, and one
format must serve buffered and direct writers alike, so every writer appends the same page.
vLLM's reader reads exactly ``slot_bytes`` from offset 0, so it reads kvtier files unchanged.

A file of exactly ``slot_bytes`` has no trailer (vLLM writes those): nothing vouches for it, so it
is refused (reason ``unverified``) unless the tier's ``accept_unverified_chunks`` option is on.

Every rejection has a reason (:data:`REJECT_REASONS`): ``short`` (smaller than the trailered size
and not exactly ``slot_bytes``), ``long`` (larger), ``bad_trailer`` (wrong magic, flags, length or
identity layout, or an unknown version), ``old_version``, ``checksum``, ``wrong_chunk``,
``unverified`` and ``not_regular`` (a symbolic link or special file where a chunk should be;
decided by the tier that opened it).

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
    "TAIL_SIZE",
    "MAX_KEY_BYTES",
    "SizeClass",
    "Verdict",
    "checksum",
    "identity",
    "pack_trailer",
    "make_trailer_page",
    "write_trailer",
    "stored_size",
    "classify_size",
    "recorded_length",
    "verify",
    "REJECT_REASONS",
]

MAGIC = b"KVTR"
FORMAT_VERSION = 2
_TAIL = struct.Struct("<4sHHQQ8x")
_IDENTITY = struct.Struct("<32sH64s30x")
TAIL_SIZE = _TAIL.size  # 32
IDENTITY_SIZE = _IDENTITY.size  # 128
TRAILER_SIZE = IDENTITY_SIZE + TAIL_SIZE  # 160: the non-zero end of the trailer page
TRAILER_PAGE = 4096
MAX_KEY_BYTES = 64
RUN_FINGERPRINT_BYTES = 32
#: Every reason a stored chunk can be rejected for (the label values of the rejection counters).
REJECT_REASONS: tuple[str, ...] = (
    "short", "long", "bad_trailer", "old_version", "checksum", "wrong_chunk", "unverified", "not_regular",
)

assert TAIL_SIZE == 32 and IDENTITY_SIZE == 128


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
_REJECTED = {reason: Verdict.reject(reason) for reason in REJECT_REASONS}


def rejected(reason: str) -> Verdict:
    """The shared rejection verdict for ``reason`` (one of :data:`REJECT_REASONS`)."""
    return _REJECTED[reason]


_xxh3_64 = xxhash.xxh3_64_intdigest


def checksum(payload: memoryview | bytes) -> int:
    """xxh3-64 (seed 0) of ``payload``; accepts any contiguous buffer without copying."""
    return _xxh3_64(payload)


def identity(key: bytes, run_fingerprint: bytes) -> bytes:
    """The 128 identity bytes of chunk ``key`` in the run whose fingerprint is ``run_fingerprint``.

    Raises ``ValueError`` for a key longer than :data:`MAX_KEY_BYTES` or a fingerprint that is not
    32 bytes (a programming error: offload keys are a hash plus a 4-byte group).
    """
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"offload key of {len(key)} bytes does not fit the trailer ({MAX_KEY_BYTES} max)")
    if len(run_fingerprint) != RUN_FINGERPRINT_BYTES:
        raise ValueError(f"run fingerprint must be {RUN_FINGERPRINT_BYTES} bytes, got {len(run_fingerprint)}")
    return _IDENTITY.pack(run_fingerprint, len(key), key)


def pack_trailer(payload: memoryview | bytes, chunk_identity: bytes) -> bytes:
    """The :data:`TRAILER_SIZE` trailer bytes (identity, then tail) for ``payload``."""
    if len(chunk_identity) != IDENTITY_SIZE:
        raise ValueError(f"identity must be {IDENTITY_SIZE} bytes (see identity()), got {len(chunk_identity)}")
    return chunk_identity + _TAIL.pack(MAGIC, FORMAT_VERSION, 0, len(payload), checksum(payload))


def make_trailer_page(payload: memoryview | bytes, chunk_identity: bytes) -> bytes:
    """The full TRAILER_PAGE bytes appended after ``payload`` (zeros, then the trailer)."""
    return bytes(TRAILER_PAGE - TRAILER_SIZE) + pack_trailer(payload, chunk_identity)


def write_trailer(page: memoryview | bytearray, payload: memoryview | bytes, key: bytes, run_fingerprint: bytes) -> None:
    """Write the :data:`TRAILER_SIZE` trailer of ``payload`` as chunk ``key`` of run
    ``run_fingerprint`` (the bytes of :func:`pack_trailer` with :func:`identity`) into the last
    bytes of ``page``, in place: the store path's way to a trailer page without building one.
    The rest of ``page`` is left as it is; for a trailer page the caller keeps it zero. Raises
    ``ValueError`` as :func:`identity` does.
    """
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"offload key of {len(key)} bytes does not fit the trailer ({MAX_KEY_BYTES} max)")
    if len(run_fingerprint) != RUN_FINGERPRINT_BYTES:
        raise ValueError(f"run fingerprint must be {RUN_FINGERPRINT_BYTES} bytes, got {len(run_fingerprint)}")
    end = len(page)
    _IDENTITY.pack_into(page, end - TRAILER_SIZE, run_fingerprint, len(key), key)
    _TAIL.pack_into(page, end - TAIL_SIZE, MAGIC, FORMAT_VERSION, 0, len(payload), _xxh3_64(payload))


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


def recorded_length(tail: bytes | memoryview) -> int | None:
    """The payload length a stored chunk's tail records (``tail``: its last :data:`TAIL_SIZE`
    bytes); None when ``tail`` is not a kvtier tail (wrong size or magic). Nothing else is
    checked: this tells a tree's slot size from one file, it does not verify the file."""
    if len(tail) != TAIL_SIZE:
        return None
    magic, _version, _flags, length, _digest = _TAIL.unpack(tail)
    return length if magic == MAGIC else None


def verify(payload: memoryview | bytes, trailer_page: memoryview | bytes | bytearray | None,
           chunk_identity: bytes, *, accept_unverified: bool = False) -> Verdict:
    """Check that ``payload`` + ``trailer_page`` are chunk ``chunk_identity`` with intact bytes.

    ``trailer_page`` is ``None`` for a raw (trailer-less) chunk whose size already matched: it
    is accepted unverified only with ``accept_unverified``, else rejected as ``unverified``.
    The cheap checks (layout, version, identity) run before the checksum. Never raises for
    malformed input; the verdict's reason says what was wrong.
    """
    if trailer_page is None:
        return ACCEPTED_UNVERIFIED if accept_unverified else _REJECTED["unverified"]
    end = len(trailer_page)
    if end < TRAILER_SIZE:
        return _REJECTED["bad_trailer"]
    magic, version, flags, length, digest = _TAIL.unpack_from(trailer_page, end - TAIL_SIZE)
    if magic != MAGIC or flags != 0 or length != len(payload):
        return _REJECTED["bad_trailer"]
    if version != FORMAT_VERSION:
        return _REJECTED["old_version" if version < FORMAT_VERSION else "bad_trailer"]
    # bytes == bytes compares in half the time memoryview == bytes takes (this runs per load).
    if bytes(trailer_page[end - TRAILER_SIZE : end - TAIL_SIZE]) != chunk_identity:
        return _REJECTED["wrong_chunk"]
    if digest != _xxh3_64(payload):  # checksum(), without its frame
        return _REJECTED["checksum"]
    return ACCEPTED_VERIFIED

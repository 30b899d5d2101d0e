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

Format version 3: coded chunks (compressed and/or encrypted; :mod:`kvtier.tiers.codec` writes
and reads them; a tier writes them only when its ``compression`` or ``encryption`` option is on)::

    offset 0                      stored bytes: ``length`` (L) bytes, the payload after the codecs
                                  (zstd of the slot, of its byte planes, or the slot itself;
                                  then, with AES-GCM, its ciphertext with the 16-byte tag last)
    offset L                      zero padding up to the next multiple of TRAILER_PAGE (P = padded L)
    offset P                      trailer page: zero except its last 160 bytes
    offset P + 3936               identity: 128 bytes, struct ``<32sH64sQI12sH4x``: run, key_len and
                                  key as in version 2, then
                                      slot_bytes u64  the decoded length (the host slot's size)
                                      key_id     u32  the encryption key's id (0 when not encrypted)
                                      nonce      12 bytes: the AES-GCM nonce (zero when not encrypted)
                                      flags      u16  the tail's flags again (so the associated
                                                      data below covers how to decode)
                                      reserved   4 zero bytes
    offset P + 4064               tail: as in version 2, with version 3, ``flags`` (a set of
                                  :data:`FLAG_ZSTD`, :data:`FLAG_BYTE_PLANES`, :data:`FLAG_AES_GCM`;
                                  never empty), ``length`` = L, ``checksum`` = xxh3-64 of the
                                  stored bytes
    total file size = P + TRAILER_PAGE  (:func:`coded_file_size`)

A writer stores a chunk compressed only when the whole file comes out smaller than ``slot_bytes``,
and an encrypted uncompressed chunk is ``slot_bytes + 2 * TRAILER_PAGE``: a coded file's size is
never a version-2 or raw size (:func:`is_plain_size`), so the size alone routes a read. The
AES-GCM associated data is the whole 128-byte identity, so a file under another chunk's name, in
another run, or with its key id, nonce or flags altered fails to decrypt. :func:`check_coded` verifies
everything but the codecs (layout, zero padding, identity, checksum); version-3 reasons beyond
version 2's: ``undecryptable`` (the GCM tag does not verify: wrong key or tampering), ``no_key``
(the key id is not available to the reader, or the reader has no encryption), ``codec``
(compressed data that does not decode to exactly the slot), ``no_codec`` (a compressed chunk
where ``zstandard`` is not installed: not damaged) and ``unencrypted`` (a plain chunk read by a
tier that encrypts: not authentic there).

This module is pure (no I/O): the filesystem tier and the object tier both use it.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
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
    "HEAD_SIZE",
    "expected_heads",
    "REJECT_REASONS",
    "FORMAT_VERSION_CODED",
    "FLAG_ZSTD",
    "FLAG_BYTE_PLANES",
    "FLAG_AES_GCM",
    "GCM_NONCE_BYTES",
    "GCM_TAG_BYTES",
    "CodedHeader",
    "coded_identity",
    "coded_file_size",
    "is_plain_size",
    "write_coded_trailer",
    "check_coded",
    "recorded_slot_bytes",
]

MAGIC = b"KVTR"
FORMAT_VERSION = 2
_TAIL = struct.Struct("<4sHHQQ8x")
_IDENTITY = struct.Struct("<32sH64s30x")
TAIL_SIZE = _TAIL.size  # 32
IDENTITY_SIZE = _IDENTITY.size  # 128
TRAILER_SIZE = IDENTITY_SIZE + TAIL_SIZE  # 160: the non-zero end of the trailer page
#: A version-2 trailer's bytes before its checksum (identity, magic, version, flags, length):
#: all of them known before a chunk is read (see :func:`expected_heads`).
HEAD_SIZE = IDENTITY_SIZE + 16  # 144; the checksum follows, then 8 reserved bytes
TRAILER_PAGE = 4096
MAX_KEY_BYTES = 64
RUN_FINGERPRINT_BYTES = 32
#: Every reason a stored chunk can be rejected for (the label values of the rejection counters).
REJECT_REASONS: tuple[str, ...] = (
    "short", "long", "bad_trailer", "old_version", "checksum", "wrong_chunk", "unverified", "not_regular",
    "undecryptable", "no_key", "codec", "no_codec", "unencrypted",
)
FORMAT_VERSION_CODED = 3
FLAG_ZSTD = 0x1  # the stored bytes (after decryption) are one zstd frame
FLAG_BYTE_PLANES = 0x2  # the zstd frame holds the slot's byte planes (only with FLAG_ZSTD)
FLAG_AES_GCM = 0x4  # the stored bytes are AES-256-GCM ciphertext, tag last
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_BYTE_PLANES | FLAG_AES_GCM
GCM_NONCE_BYTES = 12
GCM_TAG_BYTES = 16
_CODED_IDENTITY = struct.Struct("<32sH64sQI12sH4x")
#: The identity bytes both versions share (run, key_len, key): the rest is version 3's fields.
_NAME_BYTES = 32 + 2 + 64

assert TAIL_SIZE == 32 and IDENTITY_SIZE == 128 and _CODED_IDENTITY.size == 128


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


def expected_heads(keys: Sequence[bytes], run_fingerprint: bytes, payload_len: int) -> bytes:
    """The :data:`HEAD_SIZE` bytes each key's version-2 trailer starts with, for a payload of
    ``payload_len`` bytes, concatenated in order: a loader compares a whole batch of trailers
    with one comparison (their checksums apart) instead of one :func:`verify` per chunk.
    Raises ``ValueError`` as :func:`identity` does.
    """
    tail = _TAIL.pack(MAGIC, FORMAT_VERSION, 0, payload_len, 0)[: HEAD_SIZE - IDENTITY_SIZE]
    if not keys:
        return b""
    width = len(keys[0])
    if set(map(len, keys)) != {width} or set(map(type, keys)) != {bytes}:
        return b"".join([identity(key, run_fingerprint) + tail for key in keys])
    identity(keys[0], run_fingerprint)  # the key length and the fingerprint are checked once
    # Keys of one length: what lies between one key and the next is the same bytes every time.
    length = width.to_bytes(2, "little")
    after_key = bytes(IDENTITY_SIZE - RUN_FINGERPRINT_BYTES - 2 - width) + tail
    return run_fingerprint + length + (after_key + run_fingerprint + length).join(keys) + after_key


# ------------------------------------------------------------------------------------------------
# Format version 3 (coded chunks)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CodedHeader:
    """What a version-3 trailer records (see the module docstring); ``identity`` is its 128 bytes,
    the associated data of an encrypted chunk."""

    flags: int
    length: int
    key_id: int
    nonce: bytes
    identity: bytes


def coded_identity(chunk_identity: bytes, slot_bytes: int, flags: int, key_id: int = 0,
                   nonce: bytes = bytes(GCM_NONCE_BYTES)) -> bytes:
    """The version-3 identity of the chunk whose version-2 identity is ``chunk_identity``
    (:func:`identity`): the same name, plus the slot length, key id, nonce and flags."""
    if len(chunk_identity) != IDENTITY_SIZE or len(nonce) != GCM_NONCE_BYTES:
        raise ValueError("identity must be 128 bytes and nonce 12 bytes")
    return _CODED_IDENTITY.pack(chunk_identity[:32], int.from_bytes(chunk_identity[32:34], "little"),
                                chunk_identity[34:_NAME_BYTES], slot_bytes, key_id, nonce, flags)


def coded_file_size(stored_length: int) -> int:
    """Size of a version-3 file whose stored bytes are ``stored_length`` long."""
    return -(-stored_length // TRAILER_PAGE) * TRAILER_PAGE + TRAILER_PAGE


def is_plain_size(size: int, slot_bytes: int) -> bool:
    """Whether ``size`` is a version-2 (trailered) or raw chunk size; every other size can only
    be a version-3 file (or a damaged one)."""
    return size == slot_bytes or size == slot_bytes + TRAILER_PAGE


def write_coded_trailer(page: memoryview | bytearray, stored: memoryview | bytes, identity_v3: bytes, flags: int) -> None:
    """Write the version-3 trailer (``identity_v3`` from :func:`coded_identity`, then the tail for
    ``stored``) into the last :data:`TRAILER_SIZE` bytes of ``page``; the rest is left as it is."""
    end = len(page)
    page[end - TRAILER_SIZE : end - TAIL_SIZE] = identity_v3
    _TAIL.pack_into(page, end - TAIL_SIZE, MAGIC, FORMAT_VERSION_CODED, flags, len(stored), _xxh3_64(stored))


_ZEROS = bytes(2 * TRAILER_PAGE)


def check_coded(file_image: memoryview | bytes, chunk_identity: bytes, slot_bytes: int) -> CodedHeader | Verdict:
    """Check that ``file_image`` (a whole stored file) is a version-3 file of chunk
    ``chunk_identity`` (its version-2 identity) for a ``slot_bytes`` slot, with intact stored
    bytes: size, tail, flags, zero padding, identity, slot length and checksum. Returns the header
    (the caller then decrypts and decodes ``file_image[:header.length]``) or a rejection. Does not
    look at the codecs: authenticity is the decryption's job. Never raises for malformed input.
    """
    view = memoryview(file_image)
    n = len(view)
    plain = slot_bytes + TRAILER_PAGE
    if n < 2 * TRAILER_PAGE or n % TRAILER_PAGE:
        return _REJECTED["short" if n < plain else "long"]
    if n > slot_bytes + 2 * TRAILER_PAGE:
        return _REJECTED["long"]
    magic, version, flags, length, digest = _TAIL.unpack_from(view, n - TAIL_SIZE)
    if magic != MAGIC or bytes(view[n - 8 : n]) != _ZEROS[:8]:
        return _REJECTED["bad_trailer"]
    if version != FORMAT_VERSION_CODED:
        if version < FORMAT_VERSION:
            return _REJECTED["old_version"]
        if version == FORMAT_VERSION:  # a version-2 trailer on a file of the wrong size
            return _REJECTED["short" if n < plain else "long"]
        return _REJECTED["bad_trailer"]
    if (not flags or flags & ~_KNOWN_FLAGS or (flags & FLAG_BYTE_PLANES and not flags & FLAG_ZSTD)
            or coded_file_size(length) != n):
        return _REJECTED["bad_trailer"]
    if flags & FLAG_AES_GCM and length < GCM_TAG_BYTES:
        return _REJECTED["bad_trailer"]
    trailer_at = n - TRAILER_SIZE
    _run, _key_len, _key, slot, key_id, nonce, copied_flags = _CODED_IDENTITY.unpack_from(view, trailer_at)
    ident = bytes(view[trailer_at : n - TAIL_SIZE])
    if ident[_NAME_BYTES + 26 :] != _ZEROS[:4] or copied_flags != flags:
        return _REJECTED["bad_trailer"]
    if ident[:_NAME_BYTES] != chunk_identity[:_NAME_BYTES] or slot != slot_bytes:
        return _REJECTED["wrong_chunk"]
    if not flags & FLAG_AES_GCM and (key_id or nonce != _ZEROS[:GCM_NONCE_BYTES]):
        return _REJECTED["bad_trailer"]
    if bytes(view[length:trailer_at]) != _ZEROS[: trailer_at - length]:
        return _REJECTED["bad_trailer"]
    if digest != _xxh3_64(view[:length]):
        return _REJECTED["checksum"]
    return CodedHeader(flags, length, key_id, nonce, ident)


def recorded_slot_bytes(trailer: bytes | memoryview, size: int) -> int | None:
    """The slot size a stored chunk of ``size`` bytes records (``trailer``: its last
    :data:`TRAILER_SIZE` bytes): a version-2 file's payload length when it matches its size, a
    version-3 file's slot length when its stored length matches its size; None otherwise. Nothing
    else is checked: this tells a tree's slot size from one file, it does not verify the file."""
    if len(trailer) != TRAILER_SIZE:
        return None
    magic, version, _flags, length, _digest = _TAIL.unpack_from(trailer, IDENTITY_SIZE)
    if magic != MAGIC:
        return None
    if version == FORMAT_VERSION:
        return length if length == size - TRAILER_PAGE else None
    if version == FORMAT_VERSION_CODED and coded_file_size(length) == size:
        slot = _CODED_IDENTITY.unpack_from(trailer, 0)[3]
        return slot if slot > 0 and slot % TRAILER_PAGE == 0 else None
    return None

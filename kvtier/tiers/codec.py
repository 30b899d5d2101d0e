"""``ChunkCodec``: opt-in lossless compression and encryption at rest of stored chunks.

Shared by the fs and obj tiers. A tier builds one codec at open from its ``compression`` and
``encryption`` options (:meth:`ChunkCodec.from_options`) and passes every stored file through it:
:meth:`~ChunkCodec.encode_into` turns a host slot into the whole file image,
:meth:`~ChunkCodec.decode_into` checks a file image and decodes it into a host slot. The format
(version 3 of the chunk trailer) is :mod:`kvtier.tiers.integrity`'s; a plain chunk stays version 2
byte for byte, so vLLM and older kvtier read it.

Compression (``{"codec": "zstd", "level": 1, "transform": "byte_planes"}``): zstd from the
``zstandard`` package. ``byte_planes`` (2-byte dtypes only; others compress as they are) stores
the slot's high bytes, then its low bytes, before zstd: the high byte of a bf16/fp16 value (sign,
exponent) repeats far more than the whole value does. A chunk is stored compressed only when its
file comes out smaller than the slot (two pages or more saved); otherwise it is stored as it is.

Encryption (``{"key_file": path, "key_id": n}``): AES-256-GCM from ``cryptography``, after
compression; keys from a key file (:mod:`kvtier.tiers.keyfile`), never from the configuration
itself. A fresh random 96-bit nonce per write; the associated data is the chunk's whole identity
(run, offload key, slot length, key id, nonce, flags), so a file swapped, renamed, moved or replayed
under another chunk's name fails to decrypt. ``key_id`` ``None`` decrypts only (the way to turn
encryption off without losing the encrypted chunks at once: it reads them and writes plain ones).

What a codec accepts on load: a tier that encrypts refuses every chunk that is not encrypted
(``unencrypted``: a plaintext chunk there is not authentic, so it is a miss and is rewritten
encrypted); a tier that does not encrypt refuses encrypted chunks whose key it lacks (``no_key``)
and accepts plain and compressed ones (compression needs no configuration to be read, as long as
``zstandard`` is installed; without it a compressed chunk is ``codec``).

Keys never appear in ``repr``, ``str``, errors or logs; this module logs nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtier.config.schema import KeySpec, convert
from kvtier.config.tiers import COMPRESSION_SCHEMA, ENCRYPTION_SCHEMA
from kvtier.errors import ConfigError
from kvtier.layout import DTYPE_ITEMSIZE, normalize_dtype
from kvtier.tiers.integrity import (
    ACCEPTED_VERIFIED,
    FLAG_AES_GCM,
    FLAG_BYTE_PLANES,
    FLAG_ZSTD,
    GCM_NONCE_BYTES,
    GCM_TAG_BYTES,
    IDENTITY_SIZE,
    TRAILER_PAGE,
    TRAILER_SIZE,
    CodedHeader,
    Verdict,
    check_coded,
    coded_file_size,
    coded_identity,
    is_plain_size,
    rejected,
    verify,
    write_coded_trailer,
    write_trailer,
)
from kvtier.tiers.keyfile import Keyring, load_key_file

__all__ = ["ChunkCodec", "is_plain_file_size", "is_coded_file_size"]

_COMPRESSION_SPEC = KeySpec("mapping", schema=COMPRESSION_SCHEMA)
_ENCRYPTION_SPEC = KeySpec("mapping", schema=ENCRYPTION_SCHEMA)


def is_plain_file_size(size: int, slot_bytes: int) -> bool:
    """Whether ``size`` is a plain chunk's size (version 2, or raw of exactly ``slot_bytes``): a
    coded chunk never has one, so a reader may take its plain fast path on that alone."""
    return is_plain_size(size, slot_bytes)


def is_coded_file_size(size: int, slot_bytes: int) -> bool:
    """Whether ``size`` can be a coded (version-3) chunk's size for a ``slot_bytes`` slot: a page
    multiple from two pages up to ``slot_bytes + 2 * 4096``, and not a plain size. Any other size
    that is not plain is a short or long file, whatever its content."""
    return (size % TRAILER_PAGE == 0 and 2 * TRAILER_PAGE <= size <= slot_bytes + 2 * TRAILER_PAGE
            and not is_plain_size(size, slot_bytes))


def _missing(package: str, extra: str, where: str) -> ConfigError:
    return ConfigError(f"{where} needs the {package} package, which is not installed or cannot be imported; "
                       f"install the {extra} extra: pip install 'kvtier[{extra}]'")


def _import_zstd(where: str) -> Any:
    try:
        import zstandard
    except ImportError:
        raise _missing("zstandard", "compression", where) from None
    return zstandard


def _import_aesgcm(where: str) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise _missing("cryptography", "encryption", where) from None
    return AESGCM


def _zstd_or_none() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


class ChunkCodec:
    """Encodes host slots into stored files and decodes them back (see the module docstring).

    ``active`` is True when :meth:`encode_into` writes coded (version 3) files; an inactive codec
    writes plain version-2 files. ``encrypts`` is True when it encrypts: then it refuses every
    chunk that is not encrypted (plain sizes need not even be read). Both methods are thread-safe
    (each thread has its own compressor and scratch buffers). ``repr`` shows :meth:`describe`, never a key.
    """

    __slots__ = ("slot_bytes", "dtype", "level", "byte_planes", "key_id", "active", "encrypts", "max_file_bytes",
                 "_zstd", "_compress", "_ciphers", "_encrypts", "_local", "_describe")

    def __init__(self, *, dtype: str, slot_bytes: int, level: int | None = None, byte_planes: bool = False,
                 ciphers: Mapping[int, Any] | None = None, key_id: int | None = None, zstd: Any = None) -> None:
        if slot_bytes <= 0 or slot_bytes % TRAILER_PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {TRAILER_PAGE}, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.dtype = dtype
        self._compress = level is not None
        self.level = level
        self.byte_planes = bool(byte_planes and self._compress and DTYPE_ITEMSIZE.get(dtype) == 2 and slot_bytes % 2 == 0)
        self._zstd = zstd
        self._ciphers: dict[int, Any] = dict(ciphers or {})
        self.key_id = key_id
        self._encrypts = self.encrypts = key_id is not None
        self.active = self._compress or self._encrypts
        self.max_file_bytes = slot_bytes + 2 * TRAILER_PAGE
        self._local = threading.local()
        info: dict[str, Any] = {}
        if self._compress:
            info.update(codec="zstd", level=level, transform="byte_planes" if self.byte_planes else "none")
        if self._ciphers:
            info.update(encryption="aes-256-gcm", key_id=key_id, key_ids=sorted(self._ciphers))
        self._describe = info

    # --- construction -------------------------------------------------------------------------
    @staticmethod
    def dtype_of(run_fields: Mapping[str, Any]) -> str | None:
        """The KV element type a run's fields name (kvtier's and vLLM's alike), canonical; None
        when absent or not one kvtier knows (then no byte-plane transform applies)."""
        try:
            return normalize_dtype(run_fields["dtype"])
        except (KeyError, ConfigError):
            return None

    @classmethod
    def from_options(cls, compression: Any, encryption: Any, *, dtype: str | None, slot_bytes: int,
                     where: str = "") -> ChunkCodec:
        """The codec of a tier whose ``compression`` / ``encryption`` options are these (None:
        off). Loads the key file. ``ConfigError`` for a malformed option, a missing library (naming
        the extra to install) or a key file that is unsafe or malformed; ``where`` prefixes the key
        paths in messages (e.g. ``"secondary_tiers[0]."``)."""
        dtype = normalize_dtype(dtype) if dtype is not None else "bytes"
        level: int | None = None
        byte_planes = False
        zstd = _zstd_or_none()
        if compression is not None:
            level, byte_planes = cls._compression_options(compression, f"{where}compression")
            zstd = _import_zstd(f"{where}compression")
        ciphers: dict[int, Any] = {}
        key_id: int | None = None
        if encryption is not None:
            keyring, key_id = cls._encryption_options(encryption, f"{where}encryption")
            aesgcm = _import_aesgcm(f"{where}encryption")
            ciphers = {i: aesgcm(keyring.key(i)) for i in keyring.ids}
        return cls(dtype=dtype, slot_bytes=slot_bytes, level=level, byte_planes=byte_planes, ciphers=ciphers,
                   key_id=key_id, zstd=zstd)

    @classmethod
    def reader(cls, *, dtype: str, slot_bytes: int) -> ChunkCodec:
        """A codec with no options: writes plain chunks, reads plain and compressed ones (when
        ``zstandard`` is installed), refuses encrypted ones (``no_key``)."""
        return cls(dtype=normalize_dtype(dtype), slot_bytes=slot_bytes, zstd=_zstd_or_none())

    @staticmethod
    def _compression_options(options: Any, where: str) -> tuple[int, bool]:
        values = convert(_COMPRESSION_SPEC, options, where)  # as the configuration checks it
        return values["level"], values["transform"] == "byte_planes"

    @staticmethod
    def _encryption_options(options: Any, where: str) -> tuple[Keyring, int | None]:
        values = convert(_ENCRYPTION_SPEC, options, where)  # as the configuration checks it
        key_id = values["key_id"]
        keyring = load_key_file(values["key_file"], where=f"{where}.key_file")
        if key_id is not None and key_id not in keyring:
            raise ConfigError(f"{where}.key_id {key_id} is not in {where}.key_file (ids there: {list(keyring.ids)})")
        return keyring, key_id

    # --- description --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What this codec does, for logs and ``inspect``: no key bytes (``{}`` when plain)."""
        return dict(self._describe)

    def __repr__(self) -> str:
        return f"ChunkCodec({self._describe})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:  # holds key material: never pickled
        raise TypeError("a ChunkCodec cannot be pickled")

    # --- per-thread state ---------------------------------------------------------------------
    def _scratch(self, which: str) -> np.ndarray:
        """This thread's ``slot_bytes`` scratch buffer ``which`` (created on first use)."""
        buf = getattr(self._local, which, None)
        if buf is None:
            buf = np.empty(self.slot_bytes, dtype=np.uint8)
            setattr(self._local, which, buf)
        return buf

    def _compressor(self) -> Any:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = self._zstd.ZstdCompressor(level=self.level, write_content_size=True)
        return cctx

    def _decompressor(self) -> Any:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = self._zstd.ZstdDecompressor()
        return dctx

    # --- encode -------------------------------------------------------------------------------
    def encode_into(self, payload: memoryview, chunk_identity: bytes, out: memoryview) -> int:
        """Write the whole stored file of slot ``payload`` as chunk ``chunk_identity`` (its
        version-2 identity, :func:`kvtier.tiers.integrity.identity`) into ``out[:n]`` and return
        ``n``, a multiple of 4096 and at most :attr:`max_file_bytes`. ``out`` (at least
        :attr:`max_file_bytes` long; page aligned for an ``O_DIRECT`` writer) must not overlap
        ``payload``. An inactive codec writes the plain version-2 file."""
        slot = self.slot_bytes
        if len(payload) != slot or len(chunk_identity) != IDENTITY_SIZE:
            raise ValueError(f"payload must be {slot} bytes and identity {IDENTITY_SIZE} bytes")
        if len(out) < self.max_file_bytes:
            raise ValueError(f"out must hold {self.max_file_bytes} bytes, got {len(out)}")
        flags = 0
        data: Any = payload
        if self._compress:
            source: Any = payload
            if self.byte_planes:
                source = self._split_planes(payload)
            packed = self._compressor().compress(source)
            extra = GCM_TAG_BYTES if self._encrypts else 0
            if coded_file_size(len(packed) + extra) < slot:
                data = packed
                flags = FLAG_ZSTD | (FLAG_BYTE_PLANES if self.byte_planes else 0)
        if self._encrypts:
            assert self.key_id is not None
            flags |= FLAG_AES_GCM
            nonce = os.urandom(GCM_NONCE_BYTES)
            ident = coded_identity(chunk_identity, slot, flags, self.key_id, nonce)
            length = len(data) + GCM_TAG_BYTES
            _encrypt_into(self._ciphers[self.key_id], nonce, data, ident, out[:length])
        elif flags:
            ident = coded_identity(chunk_identity, slot, flags)
            length = len(data)
            out[:length] = data
        else:  # nothing paid or nothing is on: the plain version-2 file
            out[:slot] = payload
            page = out[slot : slot + TRAILER_PAGE]
            page[: TRAILER_PAGE - TRAILER_SIZE] = _ZERO_PAGE[: TRAILER_PAGE - TRAILER_SIZE]
            write_trailer(page, payload, chunk_identity[34 : 34 + _key_len(chunk_identity)], chunk_identity[:32])
            return slot + TRAILER_PAGE
        total = coded_file_size(length)
        trailer_at = total - TRAILER_PAGE
        out[length : total - TRAILER_SIZE] = _ZERO_PAGE[: total - TRAILER_SIZE - length] if (
            total - TRAILER_SIZE - length <= len(_ZERO_PAGE)) else bytes(total - TRAILER_SIZE - length)
        write_coded_trailer(out[trailer_at:total], out[:length], ident, flags)
        return total

    def _split_planes(self, payload: memoryview) -> np.ndarray:
        """The slot's high bytes, then its low bytes (little-endian 2-byte elements), in scratch."""
        planes = self._scratch("planes")
        pairs = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 2)
        half = self.slot_bytes // 2
        planes[:half] = pairs[:, 1]
        planes[half:] = pairs[:, 0]
        return planes

    # --- decode -------------------------------------------------------------------------------
    def decode_into(self, file_image: memoryview, chunk_identity: bytes, dst: memoryview, *,
                    accept_unverified: bool = False) -> Verdict:
        """Check ``file_image`` (a whole stored file, any format) as chunk ``chunk_identity`` and
        decode it into ``dst`` (one slot, not overlapping ``file_image``). Returns the verdict;
        on a rejection ``dst`` is zeroed (never left holding unverified bytes). Never raises for
        malformed input."""
        verdict = self._decode(memoryview(file_image), chunk_identity, dst, accept_unverified)
        if not verdict.ok:
            dst[:] = _zeros(len(dst))
        return verdict

    def _decode(self, image: memoryview, chunk_identity: bytes, dst: memoryview, accept_unverified: bool) -> Verdict:
        slot = self.slot_bytes
        if len(dst) != slot:
            raise ValueError(f"dst must be one slot ({slot} bytes), got {len(dst)}")
        n = len(image)
        if is_plain_size(n, slot):
            if self._encrypts:
                return rejected("unencrypted")
            dst[:] = image[:slot]
            return verify(dst, image[slot:] if n > slot else None, chunk_identity, accept_unverified=accept_unverified)
        header = check_coded(image, chunk_identity, slot)
        if isinstance(header, Verdict):
            return header
        return self._decode_coded(image, header, dst)

    def _decode_coded(self, image: memoryview, header: CodedHeader, dst: memoryview) -> Verdict:
        slot = self.slot_bytes
        stored = image[: header.length]
        flags = header.flags
        if self._encrypts and not flags & FLAG_AES_GCM:
            return rejected("unencrypted")
        if flags & FLAG_AES_GCM:
            cipher = self._ciphers.get(header.key_id)
            if cipher is None:
                return rejected("no_key")
            plain_length = header.length - GCM_TAG_BYTES
            if not flags & FLAG_ZSTD:
                if plain_length != slot:
                    return rejected("codec")
                target: Any = dst
            else:
                if plain_length > slot:
                    return rejected("codec")
                target = self._scratch("plain").data[:plain_length]
            try:
                _decrypt_into(cipher, header.nonce, stored, header.identity, target)
            except Exception:  # InvalidTag (wrong key, tampering); never a partial result
                return rejected("undecryptable")
            if not flags & FLAG_ZSTD:
                return ACCEPTED_VERIFIED
            stored = target
        if flags & FLAG_ZSTD:
            return self._decompress(stored, bool(flags & FLAG_BYTE_PLANES), dst)
        return rejected("bad_trailer")  # unreachable: check_coded refuses empty flags

    def _decompress(self, packed: memoryview, byte_planes: bool, dst: memoryview) -> Verdict:
        if self._zstd is None:  # not damaged: undecodable here (another process may decode it)
            return rejected("no_codec")
        slot = self.slot_bytes
        if byte_planes and slot % 2:
            return rejected("codec")
        target = self._scratch("planes").data if byte_planes else dst
        try:
            # The frame records its decoded size: anything but one slot is refused before decoding.
            if self._zstd.get_frame_parameters(packed).content_size != slot:
                return rejected("codec")
            # Straight into the slot (or the planes scratch): no intermediate bytes object.
            with self._decompressor().stream_reader(packed) as reader:
                got = reader.readinto(target)
        except Exception:  # zstandard.ZstdError and friends: damaged compressed bytes
            return rejected("codec")
        if got != slot:
            return rejected("codec")
        if byte_planes:
            pairs = np.frombuffer(dst, dtype=np.uint8).reshape(-1, 2)
            planes = np.frombuffer(target, dtype=np.uint8)
            half = slot // 2
            pairs[:, 1] = planes[:half]
            pairs[:, 0] = planes[half:]
        return ACCEPTED_VERIFIED


def _encrypt_into(cipher: Any, nonce: bytes, data: Any, aad: bytes, out: memoryview) -> None:
    """AES-GCM ``data`` straight into ``out`` (cryptography 44+), or through a copy before that."""
    if hasattr(cipher, "encrypt_into"):
        cipher.encrypt_into(nonce, data, aad, out)
    else:  # pragma: no cover - older cryptography
        out[:] = cipher.encrypt(nonce, bytes(data), aad)


def _decrypt_into(cipher: Any, nonce: bytes, stored: Any, aad: bytes, out: Any) -> None:
    """Decrypt and authenticate ``stored`` into ``out`` (raises on a bad tag)."""
    if hasattr(cipher, "decrypt_into"):
        cipher.decrypt_into(nonce, stored, aad, out)
    else:  # pragma: no cover - older cryptography
        out[:] = cipher.decrypt(nonce, bytes(stored), aad)


def _key_len(chunk_identity: bytes) -> int:
    return int.from_bytes(chunk_identity[32:34], "little")


_ZERO_PAGE = bytes(2 * TRAILER_PAGE)
_zero_cache: dict[int, bytes] = {}


def _zeros(n: int) -> bytes:
    """``n`` zero bytes, shared between calls (the rejection path zeroes whole slots)."""
    zeros = _zero_cache.get(n)
    if zeros is None:
        zeros = _zero_cache[n] = bytes(n)
    return zeros

"""Compressed and encrypted chunks (kvtier/tiers/codec.py, format version 3 of kvtier/tiers/integrity.py).

Round trips are byte-identical for every combination; every corruption, swap, truncation,
extension, wrong or missing key and plaintext on an encrypting tier is a rejection with its
reason and leaves the slot zeroed; keys never show in repr, str, errors or log records. Expected
layouts are built from the documented format (``struct``, ``xxhash``), not from the module.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import pickle
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvtier.errors import ConfigError
from kvtier.keys import make_offload_key
from kvtier.tiers import integrity
from kvtier.tiers.codec import ChunkCodec, is_plain_file_size
from kvtier.tiers.keyfile import load_key_file, parse_keys

SLOT = 16 * 4096
PAGE = 4096
RUN = hashlib.sha256(b"run").digest()
KEY_A = make_offload_key(hashlib.sha256(b"a").digest(), 0)
KEY_B = make_offload_key(hashlib.sha256(b"b").digest(), 0)
ID_A = integrity.identity(KEY_A, RUN)
ID_B = integrity.identity(KEY_B, RUN)
HEX1 = "11" * 16 + "ab" * 16
HEX2 = "22" * 16 + "cd" * 16
HEX1_OTHER = "33" * 32
TAIL = struct.Struct("<4sHHQQ8x")
IDENT3 = struct.Struct("<32sH64sQI12sH4x")
ZSTD = {"codec": "zstd", "level": 3}
ZSTD_FLAT = {"codec": "zstd", "level": 1, "transform": "none"}
COMPRESSIONS = [None, ZSTD, ZSTD_FLAT]
DTYPES = ["bfloat16", "float16", "float32", "fp8_e4m3"]


def write_key_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    return write_key_file(tmp_path / "keys", f"# kvtier keys\n\n1:{HEX1}\n 2 : {HEX2} \n")


def kv_like(dtype: str, seed: int = 0) -> bytes:
    """A slot of normally distributed values of ``dtype`` (KV-like: compressible high bytes)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(SLOT // 4, generator=gen)
    if dtype == "fp8_e4m3":
        return (values * 8).clamp(-100, 100).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()[:SLOT].ljust(SLOT, b"\0")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    raw = values.repeat(4).to(torch_dtype).view(torch.uint8).numpy().tobytes()
    return raw[:SLOT]


def payloads(dtype: str) -> dict[str, bytes]:
    return {"kv": kv_like(dtype), "zeros": bytes(SLOT), "random": np.random.default_rng(1).bytes(SLOT)}


def encode(codec: ChunkCodec, payload: bytes, ident: bytes = ID_A) -> bytes:
    out = memoryview(mmap.mmap(-1, codec.max_file_bytes))
    n = codec.encode_into(memoryview(payload), ident, out)
    assert n % PAGE == 0 and n <= codec.max_file_bytes
    return bytes(out[:n])


def decode(codec: ChunkCodec, image: bytes, ident: bytes = ID_A, **kw: bool) -> tuple[integrity.Verdict, bytes]:
    dst = bytearray(b"\xaa" * SLOT)
    verdict = codec.decode_into(memoryview(image), ident, memoryview(dst), **kw)
    if not verdict.ok:
        assert dst == bytes(SLOT), "a rejected chunk must leave the slot zeroed"
    return verdict, bytes(dst)


def make(compression: dict | None, key_file: str | None, key_id: int | None = 1, dtype: str = "bfloat16") -> ChunkCodec:
    encryption = None if key_file is None else {"key_file": key_file, "key_id": key_id}
    return ChunkCodec.from_options(compression, encryption, dtype=dtype, slot_bytes=SLOT)


def parse_v3(image: bytes) -> tuple[tuple, tuple]:
    n = len(image)
    return IDENT3.unpack_from(image, n - 160), TAIL.unpack_from(image, n - 32)


def with_checksum(image: bytes) -> bytes:
    """``image`` with its tail's checksum recomputed (a forger's edit, not a random flip)."""
    (_ident, (magic, version, flags, length, _digest)) = parse_v3(image)
    tail = TAIL.pack(magic, version, flags, length, xxhash.xxh3_64_intdigest(image[:length]))
    return image[:-32] + tail


def flip(image: bytes, at: int) -> bytes:
    b = bytearray(image)
    b[at] ^= 0x01
    return bytes(b)


# --- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compression", COMPRESSIONS, ids=["plain", "zstd_planes", "zstd_flat"])
@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "aes"])
def test_round_trips_are_byte_identical(dtype: str, compression: dict | None, encrypted: bool, key_file: str) -> None:
    codec = make(compression, key_file if encrypted else None, dtype=dtype)
    assert codec.active == (compression is not None or encrypted)
    for name, payload in payloads(dtype).items():
        image = encode(codec, payload)
        verdict, out = decode(codec, image)
        assert verdict.ok and verdict.verified, (name, verdict)
        assert out == payload, name
        coded = len(image) != SLOT + PAGE
        assert is_plain_file_size(len(image), SLOT) == (not coded)
        if not codec.active:
            assert not coded
        if encrypted:
            assert len(image) <= SLOT + 2 * PAGE and coded
        if name == "random":  # incompressible: stored as it is (plain, or encrypted only)
            assert len(image) == (SLOT + 2 * PAGE if encrypted else SLOT + PAGE)
        if compression is not None and name == "zeros":
            assert len(image) < SLOT


def test_a_plain_file_is_format_version_2_byte_for_byte(key_file: str) -> None:
    payload = np.random.default_rng(2).bytes(SLOT)
    v2 = payload + integrity.make_trailer_page(payload, ID_A)
    assert encode(ChunkCodec.reader(dtype="bfloat16", slot_bytes=SLOT), payload) == v2
    assert encode(make(ZSTD, None), payload) == v2  # incompressible: not worth a version-3 file


def test_compressed_file_layout_is_the_documented_one() -> None:
    codec = make(ZSTD, None)
    payload = kv_like("bfloat16")
    image = encode(codec, payload)
    (run, key_len, key, slot, key_id, nonce, flags2), (magic, version, flags, length, digest) = parse_v3(image)
    assert (magic, version) == (b"KVTR", 3)
    assert flags == flags2 == integrity.FLAG_ZSTD | integrity.FLAG_BYTE_PLANES == 0x3
    assert (run, key[:key_len], slot, key_id, nonce) == (RUN, KEY_A, SLOT, 0, bytes(12))
    assert len(image) == -(-length // PAGE) * PAGE + PAGE < SLOT
    assert digest == xxhash.xxh3_64_intdigest(image[:length])
    assert image[length:-160] == bytes(len(image) - 160 - length)
    import zstandard

    planes = zstandard.ZstdDecompressor().decompress(image[:length])
    pairs = np.frombuffer(payload, np.uint8).reshape(-1, 2)
    assert planes == pairs[:, 1].tobytes() + pairs[:, 0].tobytes()


def test_encrypted_file_layout_and_aad_are_the_documented_ones(key_file: str) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    payload = np.random.default_rng(3).bytes(SLOT)
    image = encode(make(None, key_file, key_id=2), payload)
    (run, _kl, _key, slot, key_id, nonce, flags2), (_m, version, flags, length, _d) = parse_v3(image)
    assert (version, flags, flags2, key_id, slot, length) == (3, integrity.FLAG_AES_GCM, 4, 2, SLOT, SLOT + 16)
    aad = image[-160:-32]
    assert AESGCM(bytes.fromhex(HEX2)).decrypt(nonce, image[:length], aad) == payload
    second = encode(make(None, key_file, key_id=2), payload)
    assert parse_v3(second)[0][5] != nonce, "a fresh nonce per write"


def test_compression_and_encryption_combined_is_zstd_then_aes(key_file: str) -> None:
    image = encode(make(ZSTD, key_file), kv_like("float16"))
    _ident, (_m, _v, flags, _l, _d) = parse_v3(image)
    assert flags == integrity.FLAG_ZSTD | integrity.FLAG_BYTE_PLANES | integrity.FLAG_AES_GCM
    assert len(image) < SLOT


def test_byte_planes_only_for_two_byte_dtypes() -> None:
    assert make(ZSTD, None, dtype="float32").describe()["transform"] == "none"
    assert make(ZSTD, None, dtype="fp8").describe()["transform"] == "none"
    assert make(ZSTD, None, dtype="torch.bfloat16").describe() == {"codec": "zstd", "level": 3, "transform": "byte_planes"}


def test_encode_decode_from_many_threads(key_file: str) -> None:
    codec = make(ZSTD, key_file)
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(20):
            payload = kv_like("bfloat16", seed * 100 + i)
            verdict, out = decode(codec, encode(codec, payload))
            if not verdict.ok or out != payload:
                errors.append(f"{seed}/{i}: {verdict}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# --- what each kind of tier accepts -------------------------------------------------------------
def test_reader_accepts_plain_and_compressed_refuses_encrypted(key_file: str) -> None:
    reader = ChunkCodec.reader(dtype="bfloat16", slot_bytes=SLOT)
    assert not reader.active and reader.describe() == {}
    payload = kv_like("bfloat16")
    assert decode(reader, encode(make(ZSTD, None), payload)) == (integrity.ACCEPTED_VERIFIED, payload)
    assert decode(reader, encode(reader, payload)) == (integrity.ACCEPTED_VERIFIED, payload)
    assert decode(reader, encode(make(ZSTD, key_file), payload))[0].reason == "no_key"
    assert decode(reader, encode(make(None, key_file), payload))[0].reason == "no_key"


def test_raw_files_follow_accept_unverified() -> None:
    reader = ChunkCodec.reader(dtype="bfloat16", slot_bytes=SLOT)
    payload = kv_like("bfloat16")
    assert decode(reader, payload)[0].reason == "unverified"
    assert decode(reader, payload, accept_unverified=True) == (integrity.ACCEPTED_UNVERIFIED, payload)


def test_an_encrypting_tier_refuses_every_unencrypted_chunk(key_file: str) -> None:
    codec = make(ZSTD, key_file)
    payload = kv_like("bfloat16")
    for image in (encode(ChunkCodec.reader(dtype="bfloat16", slot_bytes=SLOT), payload),  # plain v2
                  encode(make(ZSTD, None), payload)):  # compressed, not encrypted
        assert decode(codec, image)[0].reason == "unencrypted"
    assert decode(codec, payload, accept_unverified=True)[0].reason == "unencrypted"  # raw


def test_decrypt_only_reads_encrypted_and_plain_and_writes_plain(key_file: str) -> None:
    codec = make(None, key_file, key_id=None)
    assert not codec.active
    payload = kv_like("bfloat16")
    assert decode(codec, encode(make(ZSTD, key_file, key_id=2), payload)) == (integrity.ACCEPTED_VERIFIED, payload)
    plain = encode(codec, payload)
    assert len(plain) == SLOT + PAGE
    assert decode(codec, plain) == (integrity.ACCEPTED_VERIFIED, payload)


def test_every_key_in_the_file_decrypts(key_file: str) -> None:
    payload = kv_like("bfloat16")
    old = encode(make(None, key_file, key_id=1), payload)
    assert decode(make(None, key_file, key_id=2), old) == (integrity.ACCEPTED_VERIFIED, payload)


# --- rejections ----------------------------------------------------------------------------------
@pytest.fixture(params=["zstd", "aes", "zstd+aes"])
def coded(request: pytest.FixtureRequest, key_file: str) -> tuple[ChunkCodec, bytes]:
    compression = None if request.param == "aes" else ZSTD
    codec = make(compression, key_file if "aes" in request.param else None)
    return codec, encode(codec, kv_like("bfloat16"))


def test_flipped_bytes_are_rejected_with_their_reason(coded: tuple[ChunkCodec, bytes]) -> None:
    codec, image = coded
    n = len(image)
    _ident, (_m, _v, flags, length, _d) = parse_v3(image)
    encrypted = bool(flags & integrity.FLAG_AES_GCM)
    cases = {
        "stored first byte": (0, "checksum"),
        "stored last byte (the tag when encrypted)": (length - 1, "checksum"),
        "padding": (length, "bad_trailer") if length < n - PAGE else None,
        "trailer page zeros": (n - PAGE + 5, "bad_trailer"),
        "run": (n - 160, "wrong_chunk"),
        "key": (n - 160 + 40, "wrong_chunk"),
        "slot length": (n - 160 + 98, "wrong_chunk"),
        "key id": (n - 160 + 106, "no_key" if encrypted else "bad_trailer"),
        "nonce": (n - 160 + 110, "undecryptable" if encrypted else "bad_trailer"),
        "flags copy": (n - 160 + 122, "bad_trailer"),
        "reserved": (n - 160 + 124, "bad_trailer"),
        "magic": (n - 32, "bad_trailer"),
        "version": (n - 27, "bad_trailer"),  # 3 + 256: unknown
        "flags": (n - 26, "bad_trailer"),
        "length": (n - 24, "checksum" if length % 2 == 0 else "bad_trailer"),  # ±1: a zero byte more or less
        "checksum": (n - 16, "checksum"),
        "tail reserved": (n - 1, "bad_trailer"),
    }
    as_v2 = decode(codec, flip(image, n - 28))[0]  # 3 -> 2: a version-2 trailer on a coded size
    assert as_v2.reason == ("short" if n < SLOT + PAGE else "long")
    for name, case in cases.items():
        if case is None:
            continue
        at, reason = case
        verdict, _ = decode(codec, flip(image, at))
        assert verdict.reason == reason, (name, verdict)


def test_forged_checksums_do_not_get_past_authentication(key_file: str) -> None:
    codec = make(ZSTD, key_file)
    image = encode(codec, kv_like("bfloat16"))
    _ident, (_m, _v, _f, length, _d) = parse_v3(image)
    for at in (0, length // 2, length - 1):  # the ciphertext, the tag
        assert decode(codec, with_checksum(flip(image, at)))[0].reason == "undecryptable"


def coded_file(stored: bytes, flags: int, ident: bytes = ID_A) -> bytes:
    """A version-3 file of ``stored`` bytes, built with the format helpers (a forger's file)."""
    size = integrity.coded_file_size(len(stored))
    image = bytearray(size)
    image[: len(stored)] = stored
    integrity.write_coded_trailer(memoryview(image)[size - PAGE :], stored, integrity.coded_identity(ident, SLOT, flags), flags)
    return bytes(image)


def test_compressed_bytes_that_do_not_decode_to_one_slot_are_a_codec_rejection() -> None:
    import zstandard

    codec = make(ZSTD, None)
    image = encode(codec, kv_like("bfloat16"))
    assert decode(codec, with_checksum(flip(image, 0)))[0].reason == "codec"  # the frame's magic
    flat = integrity.FLAG_ZSTD
    assert decode(codec, coded_file(zstandard.ZstdCompressor().compress(bytes(SLOT)), flat))[0].ok
    for stored in (zstandard.ZstdCompressor().compress(bytes(SLOT - 2)),  # decodes short
                   zstandard.ZstdCompressor().compress(bytes(SLOT + 2)),  # decodes long
                   zstandard.ZstdCompressor(write_content_size=False).compress(bytes(SLOT)),  # no size
                   zstandard.ZstdCompressor().compress(bytes(SLOT))[:-3],  # cut short
                   b"not zstd at all"):
        assert decode(codec, coded_file(stored, flat))[0].reason == "codec"
        assert decode(codec, coded_file(stored, flat | integrity.FLAG_BYTE_PLANES))[0].reason == "codec"


def test_forged_flags_fail_to_decrypt(key_file: str) -> None:
    codec = make(ZSTD, key_file)
    image = bytearray(encode(codec, kv_like("bfloat16")))
    n = len(image)
    for at in (n - 26, n - 160 + 122):  # byte planes off, in the tail and its copy in the identity
        image[at] &= ~integrity.FLAG_BYTE_PLANES
    assert decode(codec, bytes(image))[0].reason == "undecryptable"


def test_a_renamed_encrypted_chunk_with_a_forged_name_fails_to_decrypt(key_file: str) -> None:
    codec = make(ZSTD, key_file)
    image = bytearray(encode(codec, kv_like("bfloat16")))
    n = len(image)
    image[n - 160 : n - 160 + 98] = ID_B[:98]  # the attacker rewrites the name to B's
    assert decode(codec, bytes(image), ID_B)[0].reason == "undecryptable"


def test_truncated_and_extended_files_are_rejected(coded: tuple[ChunkCodec, bytes]) -> None:
    codec, image = coded
    for bad in (image[:-1], image[:-PAGE], image[:PAGE], image[:-160], image + b"\0", image + bytes(PAGE),
                image + image[-PAGE:], b"", image[: 2 * PAGE]):
        verdict = decode(codec, bad)[0]
        assert not verdict.ok and verdict.reason in ("short", "long", "bad_trailer", "unencrypted"), (len(bad), verdict)
    assert decode(codec, image + bytes(codec.max_file_bytes - len(image) + PAGE))[0].reason == "long"


def test_a_wrong_key_is_undecryptable_and_a_missing_id_is_no_key(tmp_path: Path, key_file: str) -> None:
    payload = kv_like("bfloat16")
    image = encode(make(ZSTD, key_file, key_id=1), payload)
    wrong = write_key_file(tmp_path / "wrong", f"1:{HEX1_OTHER}\n")
    assert decode(make(ZSTD, wrong), image)[0].reason == "undecryptable"
    only2 = write_key_file(tmp_path / "only2", f"2:{HEX2}\n")
    assert decode(make(ZSTD, only2, key_id=2), image)[0].reason == "no_key"


def test_no_key_without_encryption_options(coded: tuple[ChunkCodec, bytes]) -> None:
    codec, image = coded
    if "encryption" in codec.describe():
        assert decode(make(ZSTD, None), image)[0].reason == "no_key"


def test_reasons_are_registered() -> None:
    for reason in ("undecryptable", "no_key", "codec", "no_codec", "unencrypted"):
        assert reason in integrity.REJECT_REASONS
        assert integrity.rejected(reason).reason == reason


# --- configuration errors ----------------------------------------------------------------------
@pytest.mark.parametrize("compression, match", [
    ({"codec": "lz4"}, r"secondary_tiers\[0\]\.compression\.codec = 'lz4': expected one of 'zstd'"),
    ({"codec": "zstd", "level": 99}, r"compression\.level = 99: expected an integer in -7\.\.22"),
    ({"codec": "zstd", "level": True}, r"compression\.level = True"),
    ({"codec": "zstd", "transform": "shuffle"}, r"compression\.transform = 'shuffle': expected one of"),
    ({"codec": "zstd", "speed": 1}, r"unknown key 'secondary_tiers\[0\]\.compression\.speed'"),
    ("zstd", r"secondary_tiers\[0\]\.compression = 'zstd': expected a dict"),
])
def test_bad_compression_options(compression: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ChunkCodec.from_options(compression, None, dtype="bfloat16", slot_bytes=SLOT, where="secondary_tiers[0].")


def test_missing_libraries_name_the_extra(monkeypatch: pytest.MonkeyPatch, key_file: str) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match=r"kvtier\[compression\]"):
        make(ZSTD, None)
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ConfigError, match=r"kvtier\[encryption\]"):
        make(None, key_file)


def test_key_file_must_be_private_regular_and_no_link(tmp_path: Path) -> None:
    text = f"1:{HEX1}\n"
    for mode in (0o640, 0o604, 0o620, 0o644):
        path = write_key_file(tmp_path / f"k{mode:o}", text, mode)
        with pytest.raises(ConfigError, match="group or others") as err:
            make(None, path)
        assert HEX1 not in str(err.value)
    good = write_key_file(tmp_path / "good", text, 0o400)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(ConfigError, match="symbolic link"):
        make(None, str(link))
    with pytest.raises(ConfigError, match="not a regular file"):
        make(None, str(tmp_path))
    with pytest.raises(ConfigError, match="cannot open"):
        make(None, str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="key_id 7 is not in"):
        make(None, good, key_id=7)
    with pytest.raises(ConfigError, match=r"encryption\.key_id = .1.: expected an integer in 1\.\.4294967295"):
        make(None, good, key_id="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key"):
        ChunkCodec.from_options(None, {"key_file": good, "key_id": 1, "key": HEX1}, dtype="bfloat16", slot_bytes=SLOT)


@pytest.mark.parametrize("text, match", [
    (f"1 {HEX1}\n", "line 1"),
    (f"1:{HEX1[:-2]}\n", "line 1"),
    (f"# c\n1:{HEX1}zz\n", "line 2"),
    (f"1:{HEX1[:-1]}g\n", "line 1"),
    (f"0:{HEX1}\n", "key id must be"),
    (f"-1:{HEX1}\n", "line 1"),
    (f"4294967296:{HEX1}\n", "key id must be"),
    (f"1:{HEX1}\n1:{HEX2}\n", "appears twice"),
    ("# nothing\n\n", "no keys"),
])
def test_key_file_format_errors_never_show_the_line(tmp_path: Path, text: str, match: str) -> None:
    path = write_key_file(tmp_path / "keys", text)
    with pytest.raises(ConfigError, match=match) as err:
        load_key_file(path)
    message = str(err.value)
    assert HEX1[:16] not in message and HEX2[:16] not in message


def test_keys_never_in_repr_str_errors_or_logs(key_file: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    codec = make(ZSTD, key_file, key_id=2)
    keyring = load_key_file(key_file)
    payload = kv_like("bfloat16")
    image = encode(codec, payload)
    decode(codec, image)
    decode(codec, flip(image, 0))
    texts = [repr(codec), str(codec), repr(codec.describe()), repr(keyring), str(keyring), caplog.text]
    texts += [r.getMessage() for r in caplog.records]
    for secret in (HEX1, HEX2, HEX1.upper(), bytes.fromhex(HEX1).hex(), repr(bytes.fromhex(HEX2))):
        for text in texts:
            assert secret not in text
    assert codec.describe() == {"codec": "zstd", "level": 3, "transform": "byte_planes",
                                "encryption": "aes-256-gcm", "key_id": 2, "key_ids": [1, 2]}
    with pytest.raises(TypeError):
        pickle.dumps(codec)
    with pytest.raises(TypeError):
        pickle.dumps(keyring)
    assert parse_keys(f"5:{HEX1}").ids == (5,)


def test_compressed_chunks_without_zstandard_are_no_codec_not_damaged(monkeypatch: pytest.MonkeyPatch) -> None:
    writer = make(ZSTD, None)
    image = encode(writer, kv_like("bfloat16"))
    assert len(image) < SLOT  # compressed
    monkeypatch.setitem(sys.modules, "zstandard", None)
    reader = ChunkCodec.reader(dtype="bfloat16", slot_bytes=SLOT)
    verdict, slot = decode(reader, image)
    assert (verdict.ok, verdict.reason) == (False, "no_codec") and slot == bytes(SLOT)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (CI runs as root)")
def test_a_key_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "keys", f"1:{HEX1}\n")
    os.chown(path, 65534, 65534)  # mode 0600, but the other user can read and replace the keys
    with pytest.raises(ConfigError, match="owned by uid 65534") as err:
        make(None, path)
    assert HEX1 not in str(err.value)

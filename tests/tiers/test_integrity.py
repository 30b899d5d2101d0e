"""Specification of the chunk trailer format (kvtier/tiers/integrity.py).

Expected bytes are built here from the documented format (``struct``, ``hashlib`` and ``xxhash``
called directly), never taken from the module under test.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from kvtier.keys import make_offload_key
from kvtier.tiers import integrity
from kvtier.tiers.integrity import SizeClass

SLOT = 16384
KEY = make_offload_key(hashlib.sha256(b"chunk").digest(), 0)
RUN = hashlib.sha256(b"run").digest()
ME = integrity.identity(KEY, RUN)


def _payload(seed: int = 1) -> bytes:
    return bytes((i * seed + 7) % 251 for i in range(SLOT))


def xxh3_64(data: bytes) -> int:
    """The documented checksum: xxh3-64 with seed 0, from the xxhash package itself."""
    return xxhash.xxh3_64_intdigest(data, seed=0)


def documented_trailer_page(payload: bytes, run: bytes, key: bytes) -> bytes:
    """The 4096-byte trailer page of format version 2, written out field by field."""
    identity = run + len(key).to_bytes(2, "little") + key + bytes(64 - len(key)) + bytes(30)
    tail = (b"KVTR" + (2).to_bytes(2, "little") + (0).to_bytes(2, "little") + len(payload).to_bytes(8, "little")
            + xxh3_64(payload).to_bytes(8, "little") + bytes(8))
    return bytes(4096 - 160) + identity + tail


def test_checksum_is_xxh3_64_with_seed_0() -> None:
    assert integrity.checksum(b"") == 0x2D06800538D394C2  # XXH3_64bits("") of the xxHash reference
    for payload in (_payload(), _payload(5), b"abc"):
        assert integrity.checksum(payload) == xxh3_64(payload)


def test_trailer_page_matches_the_documented_bytes() -> None:
    assert KEY == hashlib.sha256(b"chunk").digest() + bytes(4)  # the hash, then group 0 (4 bytes, big-endian)
    for seed in (1, 2):
        payload = _payload(seed)
        assert integrity.make_trailer_page(payload, ME) == documented_trailer_page(payload, RUN, KEY)
    short_key = make_offload_key(b"\x01\x02\x03", 7)
    page = integrity.make_trailer_page(b"x" * 4096, integrity.identity(short_key, RUN))
    assert page == documented_trailer_page(b"x" * 4096, RUN, b"\x01\x02\x03\x00\x00\x00\x07")


def test_trailer_written_in_place_is_the_documented_trailer() -> None:
    short_key = make_offload_key(b"\x01\x02\x03", 7)
    for payload, key in ((_payload(1), KEY), (b"x" * 4096, short_key)):
        page = bytearray(integrity.TRAILER_PAGE)
        page[-integrity.TRAILER_SIZE :] = b"\xff" * integrity.TRAILER_SIZE  # every trailer byte is written
        integrity.write_trailer(memoryview(page), payload, key, RUN)
        assert bytes(page) == documented_trailer_page(payload, RUN, key)
    with pytest.raises(ValueError):
        integrity.write_trailer(bytearray(integrity.TRAILER_PAGE), b"x", bytes(65), RUN)
    with pytest.raises(ValueError):
        integrity.write_trailer(bytearray(integrity.TRAILER_PAGE), b"x", KEY, RUN[:31])


def test_trailer_layout_is_identity_then_the_documented_32_byte_tail() -> None:
    payload = _payload()
    trailer = integrity.pack_trailer(payload, ME)
    assert len(trailer) == integrity.TRAILER_SIZE == 160
    run, key_len, key = struct.unpack("<32sH64s30x", trailer[:128])
    assert (run, key_len, key[:key_len], key[key_len:]) == (RUN, len(KEY), KEY, bytes(64 - len(KEY)))
    magic, version, flags, length, digest = struct.unpack("<4sHHQQ", trailer[128:152])
    assert (magic, version, flags, length) == (b"KVTR", 2, 0, SLOT)
    assert digest == xxh3_64(payload)
    assert trailer[152:] == bytes(8)


def test_trailer_page_is_one_page_ending_with_the_trailer() -> None:
    payload = _payload()
    page = integrity.make_trailer_page(payload, ME)
    assert len(page) == integrity.TRAILER_PAGE == 4096
    assert page[:-160] == bytes(4096 - 160)
    assert page[-160:] == integrity.pack_trailer(payload, ME)
    assert integrity.stored_size(SLOT) == SLOT + 4096


def test_identity_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        integrity.identity(bytes(65), RUN)
    with pytest.raises(ValueError, match="32 bytes"):
        integrity.identity(KEY, RUN[:12])
    with pytest.raises(ValueError, match="128 bytes"):
        integrity.pack_trailer(_payload(), b"short")


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (SLOT + 4096, SizeClass.TRAILERED),
        (SLOT, SizeClass.RAW),
        (0, SizeClass.SHORT),
        (SLOT - 1, SizeClass.SHORT),
        (SLOT + 1, SizeClass.SHORT),
        (SLOT + 4095, SizeClass.SHORT),
        (SLOT + 4097, SizeClass.LONG),
        (2 * SLOT + 8192, SizeClass.LONG),
    ],
)
def test_size_alone_classifies_a_stored_chunk(size: int, expected: SizeClass) -> None:
    assert integrity.classify_size(size, SLOT) is expected


def test_intact_payload_of_the_asked_chunk_verifies() -> None:
    payload = _payload()
    verdict = integrity.verify(payload, integrity.make_trailer_page(payload, ME), ME)
    assert verdict.ok and verdict.verified and verdict.reason is None


def test_raw_chunk_without_trailer_is_refused_unless_unverified_chunks_are_accepted() -> None:
    assert integrity.verify(_payload(), None, ME) == integrity.Verdict.reject("unverified")
    verdict = integrity.verify(_payload(), None, ME, accept_unverified=True)
    assert verdict.ok and not verdict.verified


def test_another_chunks_valid_file_is_the_wrong_chunk() -> None:
    payload = _payload()
    other_key = make_offload_key(hashlib.sha256(b"other").digest(), 0)
    page = integrity.make_trailer_page(payload, integrity.identity(other_key, RUN))
    assert integrity.verify(payload, page, ME).reason == "wrong_chunk"
    same_hash_other_group = integrity.identity(make_offload_key(KEY[:-4], 1), RUN)
    page = integrity.make_trailer_page(payload, same_hash_other_group)
    assert integrity.verify(payload, page, ME).reason == "wrong_chunk"


def test_the_same_chunk_of_another_run_is_the_wrong_chunk() -> None:
    payload = _payload()
    page = integrity.make_trailer_page(payload, integrity.identity(KEY, hashlib.sha256(b"run2").digest()))
    assert integrity.verify(payload, page, ME).reason == "wrong_chunk"


def test_a_version_1_trailer_is_rejected_as_old_version() -> None:
    payload = _payload()
    v1_tail = struct.pack("<4sHHQQ8x", b"KVTR", 1, 0, SLOT, xxh3_64(payload))
    page = bytes(4096 - 32) + v1_tail
    assert integrity.verify(payload, page, ME).reason == "old_version"


def test_any_flipped_payload_byte_fails_the_checksum() -> None:
    payload = bytearray(_payload())
    page = integrity.make_trailer_page(payload, ME)
    for position in (0, SLOT // 2, SLOT - 1):
        damaged = bytearray(payload)
        damaged[position] ^= 0x01
        assert integrity.verify(damaged, page, ME) == integrity.Verdict.reject("checksum")


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda t: b"XXXX" + t[4:], id="magic"),
        pytest.param(lambda t: t[:4] + struct.pack("<H", 3) + t[6:], id="future-version"),
        pytest.param(lambda t: t[:6] + struct.pack("<H", 1) + t[8:], id="flags"),
        pytest.param(lambda t: t[:8] + struct.pack("<Q", SLOT - 4096) + t[16:], id="length"),
    ],
)
def test_malformed_tail_is_rejected_as_bad_trailer(mutate) -> None:  # type: ignore[no-untyped-def]
    payload = _payload()
    page = integrity.make_trailer_page(payload, ME)
    bad = page[:-32] + mutate(page[-32:])
    assert integrity.verify(payload, bad, ME).reason == "bad_trailer"


def test_a_trailer_page_too_small_to_hold_a_trailer_is_bad() -> None:
    assert integrity.verify(_payload(), b"KVTR", ME).reason == "bad_trailer"


def test_verify_reads_memoryviews_like_bytes() -> None:
    payload = _payload(3)
    page = integrity.make_trailer_page(payload, ME)
    assert integrity.checksum(memoryview(payload)) == xxh3_64(payload)
    assert integrity.verify(memoryview(payload), memoryview(bytearray(page)), ME).verified


@pytest.mark.parametrize("lengths", [[36] * 5, [5, 36, 64, 7], [64, 64], [36]])
def test_expected_heads_are_each_trailers_bytes_before_its_checksum(lengths: list[int]) -> None:
    keys = [hashlib.sha256(bytes([i])).digest()[: n - 4].ljust(n - 4, b"k") + bytes([0, 0, 0, i])
            for i, n in enumerate(lengths)]
    payload = _payload()
    heads = integrity.expected_heads(keys, RUN, len(payload))
    assert heads == b"".join(documented_trailer_page(payload, RUN, key)[-160:][: integrity.HEAD_SIZE] for key in keys)
    assert integrity.expected_heads([], RUN, len(payload)) == b""


@pytest.mark.parametrize("keys, run", [([b"x" * 65] * 2, RUN), ([b"x" * 36, b"y" * 65], RUN), ([KEY], b"short")])
def test_expected_heads_refuse_what_identity_refuses(keys: list[bytes], run: bytes) -> None:
    with pytest.raises(ValueError):
        integrity.expected_heads(keys, run, 4096)

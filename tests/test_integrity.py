"""Specification of the chunk trailer format (kvtier/tiers/integrity.py)."""

from __future__ import annotations

import struct

import pytest

from kvtier.tiers import integrity
from kvtier.tiers.integrity import SizeClass

SLOT = 16384


def _payload(seed: int = 1) -> bytes:
    return bytes((i * seed + 7) % 251 for i in range(SLOT))


def test_trailer_layout_is_the_documented_32_little_endian_bytes() -> None:
    payload = _payload()
    trailer = integrity.pack_trailer(payload)
    assert len(trailer) == integrity.TRAILER_SIZE == 32
    magic, version, flags, length, digest = struct.unpack("<4sHHQQ", trailer[:24])
    assert (magic, version, flags, length) == (b"KVTR", 1, 0, SLOT)
    assert digest == integrity.checksum(payload)
    assert trailer[24:] == bytes(8)


def test_trailer_page_is_one_page_ending_with_the_trailer() -> None:
    payload = _payload()
    page = integrity.make_trailer_page(payload)
    assert len(page) == integrity.TRAILER_PAGE == 4096
    assert page[:-32] == bytes(4096 - 32)
    assert page[-32:] == integrity.pack_trailer(payload)
    assert integrity.stored_size(SLOT) == SLOT + 4096


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


def test_intact_payload_verifies() -> None:
    payload = _payload()
    verdict = integrity.verify(payload, integrity.make_trailer_page(payload))
    assert verdict.ok and verdict.verified and verdict.reason is None


def test_raw_chunk_without_trailer_is_accepted_unverified() -> None:
    verdict = integrity.verify(_payload(), None)
    assert verdict.ok and not verdict.verified


def test_any_flipped_payload_byte_fails_the_checksum() -> None:
    payload = bytearray(_payload())
    page = integrity.make_trailer_page(payload)
    for position in (0, SLOT // 2, SLOT - 1):
        damaged = bytearray(payload)
        damaged[position] ^= 0x01
        assert integrity.verify(damaged, page) == integrity.Verdict.reject("checksum")


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda t: b"XXXX" + t[4:], id="magic"),
        pytest.param(lambda t: t[:4] + struct.pack("<H", 2) + t[6:], id="version"),
        pytest.param(lambda t: t[:6] + struct.pack("<H", 1) + t[8:], id="flags"),
        pytest.param(lambda t: t[:8] + struct.pack("<Q", SLOT - 4096) + t[16:], id="length"),
    ],
)
def test_malformed_trailer_is_rejected_as_bad_trailer(mutate) -> None:  # type: ignore[no-untyped-def]
    payload = _payload()
    page = integrity.make_trailer_page(payload)
    bad = page[:-32] + mutate(page[-32:])
    assert integrity.verify(payload, bad).reason == "bad_trailer"


def test_a_trailer_page_too_small_to_hold_a_trailer_is_bad() -> None:
    assert integrity.verify(_payload(), b"KVTR").reason == "bad_trailer"


def test_checksum_reads_memoryviews_without_copying_semantics_change() -> None:
    payload = _payload(3)
    assert integrity.checksum(memoryview(payload)) == integrity.checksum(payload)

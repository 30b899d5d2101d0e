"""Compression and encryption at rest on the fs tier (its ``compression`` / ``encryption`` options,
kvtier/tiers/codec.py wired into kvtier/tiers/fs/tier.py and chunks.py): round trips, what the
files look like on disk, caches written before an option was turned on, capacity counted at the
files' real sizes, and every damaged, swapped or unreadable file a miss with a zeroed slot."""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fs_tiers import FILE, SLOT, bin_files, expected, key_of, load, make_tier, metric, probe, running, store

from kvtier.host.slots import SlotBuffer
from kvtier.tiers.fs import chunks
from kvtier.types import LookupResult

PAGE = 4096
ZSTD = {"codec": "zstd", "level": 3}
KEY1 = "11" * 32
KEY2 = "22" * 32


@pytest.fixture
def host() -> Iterator[SlotBuffer]:
    buf = SlotBuffer(32, SLOT, pin_memory=False)
    yield buf
    buf.close()


@pytest.fixture(params=[True, False], ids=["o_direct-probed", "buffered"])
def io_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both I/O modes: the tier's probe (O_DIRECT where the filesystem has it), and buffered."""
    if not request.param:
        monkeypatch.setattr(chunks, "probe_o_direct", lambda directory: False)
    return bool(request.param)


def key_file(path: Path, *lines: str) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    path.chmod(0o600)
    return str(path)


def encryption(tmp_path: Path, key_id: int = 1, keys: tuple[str, ...] = (f"1:{KEY1}",)) -> dict[str, Any]:
    return {"key_file": key_file(tmp_path / f"keys-{len(list(tmp_path.glob('keys-*')))}", *keys), "key_id": key_id}


def version(path: Path) -> int:
    """The format version a chunk file's tail records."""
    tail = path.read_bytes()[-32:]
    assert tail[:4] == b"KVTR"
    return int(struct.unpack_from("<H", tail, 4)[0])


def host_bytes(host: SlotBuffer, slot: int) -> bytes:
    return bytes(host.view(slot))


def options(tmp_path: Path, compressed: bool, encrypted: bool) -> dict[str, Any]:
    return {"compression": ZSTD if compressed else None,
            "encryption": encryption(tmp_path) if encrypted else None}


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("compressed", "encrypted"), [(True, False), (False, True), (True, True)],
                         ids=["zstd", "aes-gcm", "zstd+aes-gcm"])
async def test_coded_chunks_round_trip_byte_identical(tmp_path: Path, host: SlotBuffer, io_mode: bool,
                                                      compressed: bool, encrypted: bool) -> None:
    root = tmp_path / "cache"
    opts = options(tmp_path, compressed, encrypted)
    tier = make_tier(root, host, **opts)
    async with running(tier):
        assert (await store(tier, host, range(6))).success
        host.view(0)[:] = bytes(SLOT)
        assert (await load(tier, range(6))).success
        assert [host_bytes(host, s) for s in range(6)] == [expected(i) for i in range(6)]
    files = bin_files(root)
    assert len(files) == 6 and {version(f) for f in files} == {3}
    sizes = {f.stat().st_size for f in files}
    assert all(size % PAGE == 0 for size in sizes)
    if compressed:
        assert max(sizes) < SLOT  # these payloads compress well
    else:
        assert sizes == {SLOT + 2 * PAGE}  # the GCM tag takes a page more than a plain file
    if encrypted:  # the payload's bytes are nowhere in the file
        assert all(expected(i)[:64] not in f.read_bytes() for f in files for i in range(6))
    # A fresh tier (a restart) finds them by its scan, counts their real sizes and loads them.
    again = make_tier(root, host, **opts)
    async with running(again):
        assert again.index.used == sum(f.stat().st_size for f in files)
        assert await probe(again, [key_of(i) for i in range(6)]) == [LookupResult.HIT] * 6
        assert (await load(again, range(6))).success
        assert [host_bytes(host, s) for s in range(6)] == [expected(i) for i in range(6)]


@pytest.mark.anyio
async def test_a_plain_cache_stays_readable_when_compression_is_turned_on_and_off(tmp_path: Path,
                                                                                  host: SlotBuffer) -> None:
    root = tmp_path / "cache"
    plain = make_tier(root, host)
    async with running(plain):
        assert (await store(plain, host, range(4))).success
    old = {f: f.stat().st_size for f in bin_files(root)}
    assert set(old.values()) == {FILE} and {version(f) for f in old} == {2}
    compressed = make_tier(root, host, compression=ZSTD)
    async with running(compressed):
        assert (await load(compressed, range(4))).success  # old chunks still load
        assert [host_bytes(host, s) for s in range(4)] == [expected(i) for i in range(4)]
        assert (await store(compressed, host, range(4, 8))).success
        assert compressed.index.used == 4 * FILE + sum(f.stat().st_size for f in bin_files(root) if f not in old)
    new = [f for f in bin_files(root) if f not in old]
    assert len(new) == 4 and {version(f) for f in new} == {3}
    assert all(f.stat().st_size < FILE for f in new)  # smaller on disk
    assert {f: f.stat().st_size for f in old} == old  # the old ones untouched
    # Compression off again: the compressed chunks stay readable.
    off = make_tier(root, host)
    async with running(off):
        assert await probe(off, [key_of(i) for i in range(8)]) == [LookupResult.HIT] * 8
        assert (await load(off, range(8))).success
        assert [host_bytes(host, s) for s in range(8)] == [expected(i) for i in range(8)]


@pytest.mark.anyio
async def test_encryption_turned_on_over_a_plain_cache_misses_old_chunks_and_rewrites_them(
    tmp_path: Path, host: SlotBuffer
) -> None:
    root = tmp_path / "cache"
    plain = make_tier(root, host, compression=ZSTD)
    async with running(plain):
        assert (await store(plain, host, [0, 1])).success  # one of each: compressed...
    plain = make_tier(root, host)
    async with running(plain):
        assert (await store(plain, host, [2, 3])).success  # ... and plain
    tier = make_tier(root, host, encryption=encryption(tmp_path))
    async with running(tier):
        assert await probe(tier, [key_of(i) for i in (2, 3)]) == [LookupResult.MISS] * 2  # plain: not usable
        result = await load(tier, range(4))
        assert not result.success
        assert all(host_bytes(host, s) == bytes(SLOT) for s in range(4))  # no plaintext reaches a slot
        assert bin_files(root) == []  # rejected, removed
        assert metric(tier, "fs_rejected_chunks")[("unencrypted",)] == 4
        assert (await store(tier, host, range(4))).success
        assert {f.stat().st_size for f in bin_files(root)} == {SLOT + 2 * PAGE}
        assert (await load(tier, range(4))).success
        assert [host_bytes(host, s) for s in range(4)] == [expected(i) for i in range(4)]


# --- capacity ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_max_bytes_counts_compressed_files_at_their_size(tmp_path: Path, host: SlotBuffer) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root, host, compression=ZSTD, max_bytes=4 * FILE)
    async with running(tier):
        # Jobs of two: each reserves a plain file's size per chunk while it writes (the cap holds
        # whatever the codec gives), then counts what the files take.
        for first in range(0, 6, 2):
            assert (await store(tier, host, [first, first + 1])).success
        on_disk = sum(f.stat().st_size for f in bin_files(root))
        assert len(bin_files(root)) == 6  # more than the 4 plain files max_bytes holds: nothing evicted
        assert tier.index.used == on_disk <= 6 * 2 * PAGE
        assert tier.statistics().evictions == 0
        # Room for a whole job at full size is made when there is not: the least recent go.
        assert (await store(tier, host, [6, 7])).success
        assert tier.statistics().evictions == 1 and len(bin_files(root)) == 7
        on_disk = sum(f.stat().st_size for f in bin_files(root))
        assert tier.index.used == on_disk
    again = make_tier(root, host, compression=ZSTD, max_bytes=4 * FILE)
    async with running(again):
        assert again.index.used == on_disk


@pytest.mark.anyio
async def test_an_encrypting_tier_reserves_and_counts_the_larger_file(tmp_path: Path, host: SlotBuffer) -> None:
    encrypted = SLOT + 2 * PAGE
    with pytest.raises(Exception, match="cannot hold one chunk"):
        make_tier(tmp_path / "small", host, encryption=encryption(tmp_path), max_bytes=FILE)
    root = tmp_path / "cache"
    tier = make_tier(root, host, encryption=encryption(tmp_path), max_bytes=3 * encrypted)
    async with running(tier):
        for i in range(5):
            assert (await store(tier, host, [i])).success
        assert len(bin_files(root)) == 3
        assert tier.index.used == 3 * encrypted == sum(f.stat().st_size for f in bin_files(root))


# --- rejections -------------------------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[100] ^= 0x01
    elif how == "truncate":
        data = data[:-PAGE]
    elif how == "grow":
        data += bytes(PAGE)
    path.write_bytes(bytes(data))


@pytest.mark.anyio
@pytest.mark.parametrize(("compressed", "encrypted"), [(True, False), (False, True), (True, True)],
                         ids=["zstd", "aes-gcm", "zstd+aes-gcm"])
@pytest.mark.parametrize("how", ["flip", "truncate", "grow", "swap"])
async def test_a_damaged_or_swapped_coded_file_is_a_miss_with_a_zeroed_slot(
    tmp_path: Path, host: SlotBuffer, io_mode: bool, compressed: bool, encrypted: bool, how: str
) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root, host, **options(tmp_path, compressed, encrypted))
    async with running(tier):
        assert (await store(tier, host, [0, 1])).success
        target = next(f for f in bin_files(root) if f.name.startswith(key_of(0)[:-4].hex()))
        if how == "swap":
            other = next(f for f in bin_files(root) if f != target)
            os.replace(other, target)
        else:
            damage(target, how)
        host.view(0)[:] = b"\xff" * SLOT
        result = await load(tier, [0])
        assert not result.success
        assert host_bytes(host, 0) == bytes(SLOT)
        assert not target.exists()  # removed, then rewritten by the next store
        assert sum(metric(tier, "fs_rejected_chunks").values()) == 1
        assert (await store(tier, host, [0])).success
        assert (await load(tier, [0])).success and host_bytes(host, 0) == expected(0)


@pytest.mark.anyio
async def test_a_wrong_or_missing_key_is_a_miss_never_garbage(tmp_path: Path, host: SlotBuffer) -> None:
    root = tmp_path / "cache"
    writer = make_tier(root, host, compression=ZSTD, encryption=encryption(tmp_path))
    async with running(writer):
        assert (await store(writer, host, [0, 1, 2])).success
    cases = [
        ("undecryptable", {"encryption": encryption(tmp_path, keys=(f"1:{KEY2}",))}, [0]),  # same id, other key
        ("no_key", {"encryption": encryption(tmp_path, key_id=2, keys=(f"2:{KEY2}",))}, [1]),  # key id not there
        ("no_key", {}, [2]),  # encryption turned off entirely
    ]
    for reason, opts, ids in cases:
        tier = make_tier(root, host, **opts)
        async with running(tier):
            host.view(0)[:] = b"\xff" * SLOT
            assert not (await load(tier, ids)).success
            assert host_bytes(host, 0) == bytes(SLOT)
            assert metric(tier, "fs_rejected_chunks")[(reason,)] == 1
    assert bin_files(root) == []


@pytest.mark.anyio
async def test_a_key_rotation_reads_old_chunks_and_writes_new_ones_with_the_new_key(tmp_path: Path,
                                                                                    host: SlotBuffer) -> None:
    root = tmp_path / "cache"
    old = make_tier(root, host, encryption=encryption(tmp_path, keys=(f"1:{KEY1}",)))
    async with running(old):
        assert (await store(old, host, [0])).success
    rotated = make_tier(root, host, encryption=encryption(tmp_path, key_id=2, keys=(f"1:{KEY1}", f"2:{KEY2}")))
    async with running(rotated):
        assert (await load(rotated, [0])).success and host_bytes(host, 0) == expected(0)
        assert (await store(rotated, host, [1])).success
        assert (await load(rotated, [1])).success and host_bytes(host, 0) == expected(1)


@pytest.mark.anyio
async def test_a_compressed_chunk_this_process_cannot_decode_is_a_miss_left_in_place(
    tmp_path: Path, host: SlotBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    writer = make_tier(root, host, compression=ZSTD)
    async with running(writer):
        assert (await store(writer, host, [0, 1])).success
    files = {f: f.read_bytes() for f in bin_files(root)}
    monkeypatch.setitem(sys.modules, "zstandard", None)  # a process installed without the extra
    reader = make_tier(root, host)
    async with running(reader):
        result = await load(reader, [0, 1])
        assert not result.success and result.failure_reason == "no_codec"
        assert all(host_bytes(host, s) == bytes(SLOT) for s in range(2))
        assert metric(reader, "fs_rejected_chunks")[("no_codec",)] == 2
    assert {f: f.read_bytes() for f in bin_files(root)} == files  # not damaged: nothing removed


@pytest.mark.anyio
async def test_storing_chunks_held_compressed_again_evicts_nothing(tmp_path: Path, host: SlotBuffer) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root, host, compression=ZSTD, max_bytes=3 * FILE)
    async with running(tier):
        for i in range(6):  # compressed: six fit where three plain files would
            assert (await store(tier, host, [i])).success
        assert len(bin_files(root)) == 6 and tier.statistics().evictions == 0
        used = tier.index.used
        assert (await store(tier, host, [0, 1, 2])).success  # held already: nothing to make room for
        assert len(bin_files(root)) == 6 and tier.statistics().evictions == 0
        assert tier.index.used == used == sum(f.stat().st_size for f in bin_files(root))

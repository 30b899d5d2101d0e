"""Specification of the fs tier's per-slice load (``chunks.chunk_loader``): for every file a
shared tree can hold under a chunk's name it gives exactly what ``chunks.load_chunk`` gives —
its fast path for an intact chunk changes how many Python steps a load takes, never a verdict."""

from __future__ import annotations

import errno
import hashlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chunk_files import ME, SLOT, slot_filled_with, trailer_page_of

from kvtier.keys import make_offload_key
from kvtier.tiers.codec import ChunkCodec
from kvtier.tiers.fs import beneath, chunks
from kvtier.tiers.integrity import ACCEPTED_VERIFIED, Verdict, identity, make_trailer_page

SRC = bytes(slot_filled_with(0x5D))
OTHER = identity(make_offload_key(hashlib.sha256(b"d").digest(), 0), hashlib.sha256(b"run").digest())


def _intact(p: Path) -> None:
    p.write_bytes(SRC + trailer_page_of(SRC))


#: name -> how to plant it at ``<tree>/d/c.bin``: every kind of file the loader must judge.
PLANTS: dict[str, Callable[[Path], None]] = {
    "intact": _intact,
    "trailer-less": lambda p: p.write_bytes(SRC),
    "truncated in the trailer": lambda p: p.write_bytes(SRC + trailer_page_of(SRC)[:-32]),
    "truncated in the payload": lambda p: p.write_bytes(SRC[:100]),
    "extended by a byte": lambda p: p.write_bytes(SRC + trailer_page_of(SRC) + b"\0"),
    "extended by pages": lambda p: p.write_bytes(SRC + trailer_page_of(SRC) + bytes(3 * 4096)),
    "payload flipped": lambda p: p.write_bytes(b"\xa2" + SRC[1:] + trailer_page_of(SRC)),
    "bad magic": lambda p: p.write_bytes(SRC + trailer_page_of(SRC)[:-32] + b"XXXX" + trailer_page_of(SRC)[-28:]),
    "another chunk's (swapped)": lambda p: p.write_bytes(SRC + make_trailer_page(SRC, OTHER)),
    "empty": lambda p: p.write_bytes(b""),
    "a directory": lambda p: p.mkdir(),
    "a named pipe": lambda p: os.mkfifo(p),
    "a link to an intact chunk": lambda p: (_intact(p.parent / "real.bin"), os.symlink(p.parent / "real.bin", p)),
}


@pytest.fixture(params=[True, False], ids=["inline", "ordinary-open"])
def inline(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(beneath, "_openat2_state", {})
    return bool(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[int]:
    (tmp_path / "d").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _both(tree: int, inline: bool, *, accept_unverified: bool = False,
          codec: ChunkCodec | None = None) -> tuple[Verdict | Exception, bytes, Verdict | Exception, bytes]:
    """The loader's result and bytes, then ``load_chunk``'s, for the file at ``d/c.bin``."""
    load = chunks.chunk_loader(tree, o_direct=False, inline=inline, accept_unverified=accept_unverified, codec=codec)
    dst = slot_filled_with(0)
    [got] = load([("d/c.bin", ME, dst)])
    ref_dst = slot_filled_with(0)
    try:
        ref: Verdict | Exception = chunks.load_chunk(tree, "d/c.bin", ref_dst, ME, o_direct=False,
                                                     accept_unverified=accept_unverified, codec=codec)
    except OSError as exc:
        ref = exc
    return got, bytes(dst), ref, bytes(ref_dst)


@pytest.mark.parametrize("plant", list(PLANTS), ids=list(PLANTS))
@pytest.mark.parametrize("accept_unverified", [False, True], ids=["strict", "accept-unverified"])
def test_every_file_gets_load_chunks_verdict(tmp_path: Path, tree: int, inline: bool, plant: str,
                                             accept_unverified: bool) -> None:
    PLANTS[plant](tmp_path / "d" / "c.bin")
    got, got_bytes, ref, ref_bytes = _both(tree, inline, accept_unverified=accept_unverified)
    assert isinstance(got, Verdict) and isinstance(ref, Verdict)
    assert (got.ok, got.verified, got.reason) == (ref.ok, ref.verified, ref.reason)
    if got.ok:  # bytes are trusted only on acceptance, and then they are the chunk's
        assert got_bytes == ref_bytes == SRC
    if plant == "intact":
        assert got is ACCEPTED_VERIFIED
    elif plant in ("a link to an intact chunk", "a directory", "a named pipe"):
        assert got.reason == "not_regular"  # never followed, never waited on
    elif plant != "trailer-less" or not accept_unverified:
        assert not got.ok


def test_a_socket_is_not_a_chunk(tmp_path: Path, tree: int, inline: bool) -> None:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "d" / "c.bin"))
        got, _, ref, _ = _both(tree, inline)
    finally:
        sock.close()
    assert isinstance(got, Verdict) and isinstance(ref, Verdict) and got.reason == ref.reason == "not_regular"


def test_a_missing_file_and_a_linked_directory_on_the_way(tmp_path: Path, tree: int, inline: bool) -> None:
    got, _, ref, _ = _both(tree, inline)
    assert isinstance(got, FileNotFoundError) and isinstance(ref, FileNotFoundError)
    (tmp_path / "outside").mkdir()
    _intact(tmp_path / "outside" / "c.bin")
    os.rmdir(tmp_path / "d")
    os.symlink(tmp_path / "outside", tmp_path / "d")
    got, got_bytes, ref, _ = _both(tree, inline)
    assert isinstance(got, Verdict) and isinstance(ref, Verdict) and got.reason == ref.reason == "not_regular"
    assert got_bytes != SRC


def test_a_slice_reports_each_chunk_in_order_and_a_failure_stops_no_other(tmp_path: Path, tree: int,
                                                                          inline: bool) -> None:
    _intact(tmp_path / "d" / "a.bin")
    PLANTS["payload flipped"](tmp_path / "d" / "b.bin")
    _intact(tmp_path / "d" / "e.bin")
    load = chunks.chunk_loader(tree, o_direct=False, inline=inline)
    dsts = [slot_filled_with(0) for _ in range(4)]
    results = load([("d/a.bin", ME, dsts[0]), ("d/b.bin", ME, dsts[1]), ("d/none.bin", ME, dsts[2]),
                    ("d/e.bin", ME, dsts[3])])
    assert results[0] is ACCEPTED_VERIFIED and results[3] is ACCEPTED_VERIFIED
    assert isinstance(results[1], Verdict) and results[1].reason == "checksum"
    assert isinstance(results[2], FileNotFoundError)
    assert bytes(dsts[0]) == bytes(dsts[3]) == SRC


def test_a_read_error_is_the_chunks_exception(tmp_path: Path, tree: int, inline: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _intact(tmp_path / "d" / "c.bin")
    load = chunks.chunk_loader(tree, o_direct=False, inline=inline)

    def failing_read(*args: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(chunks.os, "preadv", failing_read)
    [got] = load([("d/c.bin", ME, slot_filled_with(0))])
    assert isinstance(got, OSError) and got.errno == errno.EIO


def test_a_tree_that_encodes_loads_through_the_codec(tmp_path: Path, tree: int, inline: bool) -> None:
    codec = ChunkCodec.from_options({"codec": "zstd", "level": 1}, None, dtype=None, slot_bytes=SLOT, where="t.")
    image = chunks.image_buffer(codec.max_file_bytes)
    n = codec.encode_into(memoryview(SRC), ME, image)
    (tmp_path / "d" / "c.bin").write_bytes(bytes(image[:n]))
    got, got_bytes, ref, _ = _both(tree, inline, codec=codec)
    assert isinstance(got, Verdict) and got.ok and got.verified and got_bytes == SRC
    assert isinstance(ref, Verdict) and ref.ok

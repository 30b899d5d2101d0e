"""``kvtier verify`` on trees holding coded chunks (compressed and/or encrypted, kvtier/tiers/codec.py).

The trees are written by the fs tier, then their files are replaced by coded images of the same
chunks (made by the codec with each file's own identity), so the run layout and config are the
tier's own. Without ``--key-file`` encrypted chunks are reported ``encrypted`` (never problems);
with it they are decrypted, and a forged one is ``undecryptable``.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import xxhash
from fs_tiers import GEOMETRY, SLOT, key_of  # noqa: E402
from test_ops import build, chunk, cli, cli_json  # noqa: E402

from kvtier.layout import namespace  # noqa: E402
from kvtier.ops.inspect import run_inspect_cli  # noqa: E402
from kvtier.ops.verify import REASONS, run_verify_cli  # noqa: E402
from kvtier.tiers.codec import ChunkCodec  # noqa: E402
from kvtier.tiers.integrity import identity  # noqa: E402

HEX1 = "0f" * 32
HEX2 = "f0" * 32
N = 8
# Chunks 0-1 plain, 2-3 compressed, 4-5 encrypted with key 1, 6-7 compressed and encrypted with key 2.
PLAIN, ZSTD, AES1, BOTH2 = (0, 1), (2, 3), (4, 5), (6, 7)


def key_file(tmp_path: Path, text: str = f"1:{HEX1}\n2:{HEX2}\n", name: str = "keys") -> str:
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


def payload(i: int) -> bytes:
    """Half zeros: compresses well below one slot whatever the rest is."""
    head = bytes((j * (i + 3)) % 251 for j in range(SLOT // 2))
    return head + bytes(SLOT - len(head))


def coded_tree(tmp_path: Path) -> tuple[Path, str, Path]:
    root = tmp_path / "root"
    tree = build(root, list(range(N)))
    keys = key_file(tmp_path)
    fingerprint = namespace(str(root), GEOMETRY.run_fields(1, parallel_agnostic=True), 0).fingerprint
    codecs = {
        ZSTD: ChunkCodec.from_options({"codec": "zstd"}, None, dtype="float16", slot_bytes=SLOT),
        AES1: ChunkCodec.from_options(None, {"key_file": keys, "key_id": 1}, dtype="float16", slot_bytes=SLOT),
        BOTH2: ChunkCodec.from_options({"codec": "zstd"}, {"key_file": keys, "key_id": 2}, dtype="float16",
                                       slot_bytes=SLOT),
        PLAIN: ChunkCodec.reader(dtype="float16", slot_bytes=SLOT),
    }
    for ids, codec in codecs.items():
        for i in ids:
            out = memoryview(mmap.mmap(-1, codec.max_file_bytes))
            n = codec.encode_into(memoryview(payload(i)), identity(key_of(i), fingerprint), out)
            chunk(tree, i).write_bytes(bytes(out[:n]))
    return root, keys, tree


def rewrite(path: Path, at: int, *, forge_checksum: bool) -> None:
    """Flip a byte of ``path``'s stored bytes; with ``forge_checksum`` recompute the tail's checksum."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    if forge_checksum:
        length = int.from_bytes(data[-24:-16], "little")
        data[-16:-8] = xxhash.xxh3_64_intdigest(bytes(data[:length])).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("workers", ["1", "3"])
def test_coded_tree_is_clean_and_encrypted_chunks_are_reported_unchecked_without_a_key(
        tmp_path: Path, workers: str) -> None:
    root, keys, tree = coded_tree(tmp_path)
    status, report = cli_json(run_verify_cli, str(root), "--workers", workers)
    assert status == 0, report["problems"]
    assert report["ok"] == N - 4 and report["counts"]["encrypted"] == 4
    assert sorted(report["encrypted"]) == sorted(f"{tree.name}/{chunk(tree, i).relative_to(tree)}" for i in AES1 + BOTH2)
    assert report["problems"] == [] and report["problems_left"] == 0
    (t,) = report["trees"]
    assert t["slot_bytes"] == SLOT
    status, text = cli(run_verify_cli, str(root), "--workers", workers)
    assert status == 0 and "encrypted" in text and "give --key-file" in text

    status, report = cli_json(run_verify_cli, str(root), "--workers", workers, "--key-file", keys)
    assert status == 0 and report["ok"] == N and report["counts"]["encrypted"] == 0 and report["encrypted"] == []
    assert set(report["counts"]) == set(REASONS)


def test_slot_size_is_read_from_coded_trailers(tmp_path: Path) -> None:
    root, keys, tree = coded_tree(tmp_path)
    for i in PLAIN:  # only coded files left: their sizes vary, their trailers tell the slot
        chunk(tree, i).unlink()
    status, report = cli_json(run_verify_cli, str(root), "--workers", "1", "--key-file", keys)
    assert status == 0
    (t,) = report["trees"]
    assert (t["slot_bytes"], t["slot_bytes_source"]) == (SLOT, "trailer")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_forged_and_corrupt_coded_chunks_are_problems_repaired(tmp_path: Path, workers: str) -> None:
    root, keys, tree = coded_tree(tmp_path)
    rewrite(chunk(tree, AES1[0]), 100, forge_checksum=True)  # only decryption can tell
    rewrite(chunk(tree, BOTH2[0]), 3, forge_checksum=False)  # the checksum tells
    rewrite(chunk(tree, ZSTD[0]), 0, forge_checksum=True)  # the zstd frame's magic: codec

    status, report = cli_json(run_verify_cli, str(root), "--workers", workers)
    found = {p["path"].rsplit("/", 1)[-1]: p["reason"] for p in report["problems"]}
    assert status == 1 and sorted(found.values()) == ["checksum", "codec"]
    assert report["counts"]["encrypted"] == 3  # the forged one among them: unchecked without the key

    status, report = cli_json(run_verify_cli, str(root), "--workers", workers, "--key-file", keys, "--repair")
    found = {p["path"].rsplit("/", 1)[-1]: p["reason"] for p in report["problems"]}
    assert sorted(found.values()) == ["checksum", "codec", "undecryptable"]
    assert all(p["repaired"] for p in report["problems"]) and status == 0
    for i in (AES1[0], BOTH2[0], ZSTD[0]):
        assert not chunk(tree, i).exists()


def test_a_key_missing_from_the_key_file_is_no_key_and_kept(tmp_path: Path) -> None:
    root, _keys, tree = coded_tree(tmp_path)
    only1 = key_file(tmp_path, f"1:{HEX1}\n", name="only1")
    status, report = cli_json(run_verify_cli, str(root), "--workers", "1", "--key-file", only1, "--repair")
    assert status == 1
    assert sorted(p["reason"] for p in report["problems"]) == ["no_key", "no_key"]
    assert not any(p["repaired"] for p in report["problems"])
    for i in BOTH2:
        assert chunk(tree, i).exists()
    wrong = key_file(tmp_path, f"1:{HEX2}\n2:{HEX1}\n", name="swapped")
    status, report = cli_json(run_verify_cli, str(root), "--workers", "1", "--key-file", wrong)
    assert status == 1 and sorted(p["reason"] for p in report["problems"]) == ["undecryptable"] * 4


def test_an_unusable_key_file_is_a_usage_error_that_never_shows_a_key(tmp_path: Path) -> None:
    root, _keys, _tree = coded_tree(tmp_path)
    loose = key_file(tmp_path, f"1:{HEX1}\n", name="loose")
    os.chmod(loose, 0o644)
    status, text = cli(run_verify_cli, str(root), "--key-file", loose)
    assert status == 2
    bad = key_file(tmp_path, f"1:{HEX1}x\n", name="bad")
    status, text2 = cli(run_verify_cli, str(root), "--key-file", bad)
    assert status == 2
    assert HEX1 not in text + text2


def test_inspect_counts_coded_files_at_the_slot_size_their_trailers_record(tmp_path: Path) -> None:
    root, _keys, tree = coded_tree(tmp_path)
    status, report = cli_json(run_inspect_cli, str(root))
    assert status == 0
    (t,) = report["runs"][0]["trees"]
    assert (t["slot_bytes"], t["slot_bytes_source"]) == (SLOT, "trailer")
    assert (t["coded_files"], t["trailerless_files"], t["other_size_files"]) == (N - len(PLAIN), 0, 0)
    assert report["totals"]["coded_files"] == N - len(PLAIN)
    status, text = cli(run_inspect_cli, str(root))
    assert status == 0 and f"coded {N - len(PLAIN)}" in text and "(trailer)" in text

    for i in ZSTD + AES1 + BOTH2:  # a plain tree: stat alone decides, as before
        chunk(tree, i).unlink()
    status, report = cli_json(run_inspect_cli, str(root))
    (t,) = report["runs"][0]["trees"]
    assert (t["slot_bytes"], t["slot_bytes_source"], t["coded_files"]) == (SLOT, "guessed", 0)

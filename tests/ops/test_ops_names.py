"""Operator output survives any file name: ``kvtier inspect``, ``verify`` (and ``--repair``) and
``gc`` on trees holding names that are not UTF-8 and names holding control characters (a
terminal escape sequence, a newline). Names are printed escaped (:func:`kvtier.ops.runs.printable`),
the commands exit with their usual status and print their summary, and ``--repair`` and ``gc``
report what they remove before they remove it: an output that fails removes nothing.

The commands run as programs (``python -m kvtier.cli``) under a UTF-8 locale, so that their
output goes through a real, encoding stream."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_ops import build, chunk  # noqa: E402

from kvtier.ops.runs import printable  # noqa: E402
from kvtier.ops.verify import run_verify_cli  # noqa: E402

# Block-buffered output, as by default (PYTHONUNBUFFERED would write each line at once).
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "LC_ALL": "C.UTF-8",
       "PYTHONIOENCODING": "utf-8"}

NOT_UTF8 = b"\xff\xfe.bin"  # shown as \xff\xfe.bin
ESCAPES = "evil\x1b[31mred\nline\x07.txt"  # shown as evil\x1b[31mred\x0aline\x07.txt
IN_SHARD = b"\xff.bin"
ORPHAN = "org_evil\x1b]0;pwned\x07_0123456789ab_r0"  # a tree name under ROOT (no valid run)


def shown(name: str | bytes) -> str:
    return printable(os.fsdecode(name))


def add_hostile_names(tree: Path) -> dict[str, Path]:
    """Stray entries with hostile names in the rank tree (top level and in a shard directory)."""
    shard = chunk(tree, 0).parent
    paths = {
        "not_utf8": Path(os.fsdecode(os.fsencode(tree) + b"/" + NOT_UTF8)),
        "escapes": tree / ESCAPES,
        "in_shard": Path(os.fsdecode(os.fsencode(shard) + b"/" + IN_SHARD)),
    }
    for path in paths.values():
        path.write_bytes(b"x")
    return paths


def run_cli(*argv: str | bytes, stdout: Any = subprocess.PIPE,
            stderr: Any = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], stdout=stdout, stderr=stderr, env=ENV,
                          timeout=300, check=False)


def assert_terminal_safe(data: bytes) -> str:
    """The output is UTF-8 with no control character but the line ends; returns it decoded."""
    text = data.decode("utf-8")  # strict: raises on anything that is not UTF-8
    assert not [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) < 0xa0], text
    return text


def json_strings(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in (k, *json_strings(v))]
    if isinstance(doc, list):
        return [s for v in doc for s in json_strings(v)]
    return [doc] if isinstance(doc, str) else []


def load_json(data: bytes) -> dict[str, Any]:
    doc = json.loads(assert_terminal_safe(data))
    for s in json_strings(doc):  # no lone surrogate (a byte that was not UTF-8) or control character
        assert s.isprintable(), s
    return doc  # type: ignore[no-any-return]


def test_printable_escapes_bytes_controls_and_backslashes_only() -> None:
    plain = "org_tiny-model_840d2a028110_r0/272/5a_g0/ab.bin"
    assert printable(plain) == plain
    assert printable("café ☕.bin") == "café ☕.bin"  # printable UTF-8 is shown as it is
    assert printable(os.fsdecode(b"\xff\xfe.bin")) == "\\xff\\xfe.bin"  # a byte that is not UTF-8
    assert printable("a\x1b[31mb\nc\td\x7f") == "a\\x1b[31mb\\x0ac\\x09d\\x7f"
    assert printable("back\\slash") == "back\\\\slash"  # so that every escape is unambiguous
    assert printable("\u0085\u202e\u200b") == "\\u0085\\u202e\\u200b"  # C1 control, bidi override, zero width
    assert printable("\U000e0001") == "\\U000e0001"
    assert printable("é", encoding="ascii") == "\\u00e9"  # a character the output cannot encode
    assert printable("é\\", encoding="latin-1") == "é\\\\"


def test_inspect_prints_escaped_names_and_its_summary(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1, 2])
    add_hostile_names(tree)
    (tmp_path / ORPHAN).mkdir()
    os.mkdir(os.fsencode(tmp_path) + b"/other\xff")

    proc = run_cli("inspect", str(tmp_path))
    assert proc.returncode == 1, proc.stderr  # stray entries and an orphan tree: problems, not a usage error
    text = assert_terminal_safe(proc.stdout)
    for name in (NOT_UTF8, ESCAPES):
        assert f"stray: {shown(name)}" in text
    assert shown(ORPHAN) in text and "other\\xff" in text
    assert "\ntotal: 3 chunk files" in text and proc.stderr == b""

    proc = run_cli("inspect", str(tmp_path), "--json")
    assert proc.returncode == 1, proc.stderr
    report = load_json(proc.stdout)
    strays = report["runs"][0]["trees"][0]["stray_entries"]
    relpath_in_shard = shown(str(chunk(tree, 0).parent.relative_to(tree)) + "/" + os.fsdecode(IN_SHARD))
    assert sorted(strays) == sorted([shown(NOT_UTF8), shown(ESCAPES), relpath_in_shard])
    assert report["orphan_trees"] == [shown(ORPHAN)] and report["other_entries"] == ["other\\xff"]
    assert report["totals"]["chunk_files"] == 3


@pytest.mark.parametrize("workers", ["1", "2"])
def test_verify_prints_escaped_names_and_its_summary(tmp_path: Path, workers: str) -> None:
    tree = build(tmp_path, [0, 1, 2])
    paths = add_hostile_names(tree)
    (tmp_path / ORPHAN).mkdir()

    proc = run_cli("verify", str(tmp_path), "--workers", workers)
    assert proc.returncode == 1, proc.stderr
    text = assert_terminal_safe(proc.stdout)
    for name in (NOT_UTF8, ESCAPES):
        assert f"stray        {shown(tree.name + '/' + os.fsdecode(name))}" in text
    assert f"orphan tree {shown(ORPHAN)}" in text
    assert "checked 3 files: ok 3  stray=3" in text and "problems left: 4" in text and "GiB/s" in text

    proc = run_cli("verify", str(tmp_path), "--workers", workers, "--json")
    assert proc.returncode == 1, proc.stderr
    report = load_json(proc.stdout)
    assert sorted(p["path"] for p in report["problems"]) == sorted(
        shown(str(p.relative_to(tmp_path))) for p in paths.values())
    assert report["orphan_trees"] == [shown(ORPHAN)] and report["problems_left"] == 4
    assert all(p.exists() for p in paths.values())  # verify alone changes nothing


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_repair_reports_every_entry_then_removes_it(tmp_path: Path, as_json: bool) -> None:
    tree = build(tmp_path, [0, 1, 2])
    paths = add_hostile_names(tree)
    proc = run_cli("verify", str(tmp_path), "--workers", "1", "--repair", *(["--json"] if as_json else []))
    assert proc.returncode == 0, proc.stderr
    assert not any(os.path.lexists(p) for p in paths.values())
    assert all(chunk(tree, i).exists() for i in range(3))
    # What it removes is listed: on stdout in text, on stderr beside the JSON document.
    listing = assert_terminal_safe(proc.stderr if as_json else proc.stdout)
    for path in paths.values():
        assert shown(str(path.relative_to(tmp_path))) in listing
    assert "repair: removing 3 of 3 problem entries" in listing
    if as_json:
        report = load_json(proc.stdout)
        assert report["problems_left"] == 0 and len(report["problems"]) == 3
        assert all(p["repaired"] for p in report["problems"])
    else:
        assert "repaired: removed 3 of 3 problem entries" in listing and "problems left: 0" in listing


def test_verify_repair_writes_the_report_before_removing_anything(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1, 2])
    paths = add_hostile_names(tree)
    seen: list[tuple[str, bool]] = []  # (what was written, whether every file still existed then)

    class Watching(io.StringIO):
        def write(self, text: str) -> int:
            seen.append((text, all(os.path.lexists(p) for p in paths.values())))
            return super().write(text)

    out = Watching()
    assert run_verify_cli([str(tmp_path), "--workers", "1", "--repair"], out=out) == 0
    assert not any(os.path.lexists(p) for p in paths.values())
    before = "".join(text for text, all_there in seen if all_there)
    for path in paths.values():  # every entry and the summary were written while nothing was removed yet
        assert shown(str(path.relative_to(tmp_path))) in before
    assert "checked 3 files: ok 3  stray=3" in before and "repair: removing 3 of 3 problem entries" in before
    assert "problems left: 0" in out.getvalue()


def _broken_pipe() -> int:
    """The write end of a pipe whose reader is gone: every write fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


@pytest.mark.parametrize("as_json", [False, True])
def test_an_output_that_fails_removes_nothing_and_is_not_a_usage_error(tmp_path: Path, as_json: bool) -> None:
    tree = build(tmp_path, [0, 1, 2])
    paths = add_hostile_names(tree)
    broken = _broken_pipe()
    try:
        # The listing goes to stdout in text, to stderr with --json: break that one.
        streams = {"stderr": broken, "stdout": subprocess.PIPE} if as_json else {"stdout": broken}
        proc = run_cli("verify", str(tmp_path), "--workers", "1", "--repair", *(["--json"] if as_json else []),
                       **streams)
    finally:
        os.close(broken)
    assert proc.returncode == 1, proc.stderr
    assert all(p.exists() for p in paths.values())  # nothing removed that was not reported
    if not as_json:
        assert proc.stderr.decode().splitlines()[-1:] == ["kvtier verify: error: Broken pipe"], proc.stderr


def test_gc_reports_before_it_removes_and_escapes_root(tmp_path: Path) -> None:
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/root\xff\x1b[2J"))
    tree = build(root, [0, 1, 2, 3])
    broken = _broken_pipe()
    try:
        proc = run_cli("gc", os.fsencode(root), "--max-bytes", "0", stdout=broken)
    finally:
        os.close(broken)
    assert proc.returncode == 1, proc.stderr
    assert all(chunk(tree, i).exists() for i in range(4))  # the listing could not be written: nothing removed

    proc = run_cli("gc", os.fsencode(root), "--max-bytes", "0")
    assert proc.returncode == 0, proc.stderr
    text = assert_terminal_safe(proc.stdout)
    for i in range(4):
        assert f"to be removed {chunk(tree, i).relative_to(root)}" in text
    assert text.index("removing 4 files") < text.index("\nremoved 4 files")
    assert not any(chunk(tree, i).exists() for i in range(4))

    tree = build(root, [0, 1])
    proc = run_cli("gc", os.fsencode(root), "--max-bytes", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = load_json(proc.stdout)
    assert report["root"] == shown(os.fsencode(root)) and len(report["removed"]) == 2
    assert "to be removed" in assert_terminal_safe(proc.stderr)


def test_a_root_that_is_missing_is_named_escaped(tmp_path: Path) -> None:
    proc = run_cli("inspect", os.fsencode(tmp_path) + b"/gone\xff\x1b[2J")
    assert proc.returncode == 2
    assert assert_terminal_safe(proc.stderr).endswith("/gone\\xff\\x1b[2J: no such directory\n")


def test_an_output_the_pipe_refuses_at_exit_is_status_1_without_a_traceback(tmp_path: Path) -> None:
    build(tmp_path, [0, 1])  # a clean tree: status 0, and a report small enough to wait in the buffer
    broken = _broken_pipe()
    try:
        proc = run_cli("inspect", str(tmp_path), stdout=broken)
    finally:
        os.close(broken)
    assert proc.returncode == 1  # not 0 (nothing was shown), not 120 (the interpreter's failed flush)
    assert proc.stderr == b"kvtier inspect: error: cannot write the output: Broken pipe\n"


def test_an_output_encoding_without_the_name_s_characters_escapes_them(tmp_path: Path) -> None:
    tree = build(tmp_path, [0, 1])
    (tree / "café.txt").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", str(tmp_path)], capture_output=True,
                          env={**ENV, "PYTHONIOENCODING": "ascii"}, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr  # a stray entry, not a usage error
    assert "stray: caf\\u00e9.txt" in proc.stdout.decode("ascii") and b"\ntotal: 2 chunk files" in proc.stdout


def test_a_report_that_cannot_be_encoded_is_status_1_not_a_usage_error(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.ops.inspect import build_parser
    from kvtier.ops.runs import run_on_root

    def body(args: Any, root_fd: int) -> int:
        "\udcff".encode()  # what writing a raw name that is not UTF-8 to a UTF-8 stream raises
        return 0

    assert run_on_root("inspect", build_parser(), [str(tmp_path)], body) == 1
    assert capsys.readouterr().err.startswith("kvtier inspect: error: cannot write the report: ")

"""The ``kvtier`` command line: version, help, table-driven dispatch, one-line errors, exit statuses."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import types
from importlib.metadata import version

import pytest

from kvtier import cli
from kvtier.ops.events_cmd import run_events_cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "--version")
    assert (rc, out, err) == (0, f"kvtier {version('kvtier')}\n", "")


def test_version_as_a_program() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"kvtier {version('kvtier')}"


def test_help_lists_every_command_and_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for name in ("bench", "events", "warm", "inspect", "verify", "gc"):
        assert f"\n  {name} " in out
    assert "exit status:" in out and "--version" in out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys)
    assert rc == 2 and "commands:" in err


@pytest.mark.parametrize("argv", [("bogus",), ("--bogus",), ("evnets",)])
def test_bad_top_level_arguments_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                         argv: tuple[str, ...]) -> None:
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("kvtier: error:")
    assert "Traceback" not in err


def test_typo_of_a_command_suggests_it(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = run(capsys, "evnets")
    assert "did you mean 'events'?" in err


def test_the_operator_commands_are_in_the_table() -> None:
    assert cli.COMMANDS["inspect"][1] == "kvtier.ops.inspect:run_inspect_cli"
    assert cli.COMMANDS["verify"][1] == "kvtier.ops.verify:run_verify_cli"
    assert cli.COMMANDS["gc"][1] == "kvtier.ops.gc:run_gc_cli"


def test_a_command_whose_module_is_missing_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("not written yet", "kvtier.ops.no_such_module:run"))
    rc, out, err = run(capsys, "ghost", "--help")
    assert rc == 2 and out == ""
    assert err.strip() == ("kvtier ghost: this command is not available in this installation "
                           "(module kvtier.ops.no_such_module is missing)")


def test_a_command_missing_a_dependency_names_it(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "kvtier_test_needs_dep.py").write_text("import kvtier_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "needy", ("needs a dependency", "kvtier_test_needs_dep:run"))
    rc, out, err = run(capsys, "needy")
    assert rc == 2 and out == ""
    assert err.strip() == ("kvtier needy: needs the Python module 'kvtier_no_such_dependency', "
                           "which is not installed")


def test_dispatch_passes_arguments_and_returns_the_status(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    module = types.ModuleType("kvtier_test_cmd")
    module.run = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier_test_cmd", module)
    monkeypatch.setitem(cli.COMMANDS, "probe", ("a test command", "kvtier_test_cmd:run"))
    rc, _, _ = run(capsys, "probe", "--x", "1")
    assert rc == 7 and seen == [["--x", "1"]]


# ------------------------------------------------------------------------------ kvtier events


def test_events_help_shows_defaults_and_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "events", "--help")
    assert rc == 0
    flat = " ".join(out.split())  # the help is wrapped to the terminal's width
    assert "(default: tcp://127.0.0.1:5557)" in flat and "(default: 10.0)" in flat and "(default: 0)" in flat
    assert "exit status:" in out
    for code in ("0", "1", "2"):
        assert f"\n  {code}   " in out


@pytest.mark.parametrize("argv, message", [
    (("--endpoint", "bogus"), "--endpoint: 'bogus' is not a tcp://, ipc:// or inproc:// endpoint"),
    (("--endpoint", "tcp://127.0.0.1:99999"), "--endpoint: 'tcp://127.0.0.1:99999' has port '99999'"),
    (("--replay-endpoint", "tcp://nohost"), "--replay-endpoint: 'tcp://nohost' is not tcp://HOST:PORT"),
    (("--count", "0"), "--count: 0 is invalid; expected an int >= 1"),
    (("--count", "x"), "argument --count: invalid int value: 'x'"),
    (("--from-seq", "-1"), "--from-seq: -1 is invalid"),
    (("--wait", "-1"), "--wait: -1.0 is invalid"),
    (("--timeout", "nan"), "--timeout: nan is invalid"),
    (("--no-such-option",), "unrecognized arguments: --no-such-option"),
])
def test_events_bad_arguments_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                      argv: tuple[str, ...], message: str) -> None:
    rc, out, err = run(capsys, "events", *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvtier events: error: ") and message in err


def test_events_bogus_endpoint_as_a_program_has_no_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "events", "--endpoint", "bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_events_without_a_publisher_times_out_with_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    rc, out, err = run(capsys, "events", "--endpoint", "tcp://127.0.0.1:1", "--wait", "0.2")
    assert time.monotonic() - started < 5
    assert rc == 1 and out == ""
    assert err.strip() == ("kvtier events: timed out after 0.2 s waiting for the first batch from "
                           "tcp://127.0.0.1:1; is a publisher running there? (--wait 0 waits forever)")


def test_events_timeout_replaces_wait_for_the_first_batch() -> None:
    err = io.StringIO()
    started = time.monotonic()
    stderr, sys.stderr = sys.stderr, err
    try:
        rc = run_events_cli(["--endpoint", "tcp://127.0.0.1:1", "--timeout", "0.1", "--wait", "30"],
                            out=io.StringIO())
    finally:
        sys.stderr = stderr
    assert rc == 1 and time.monotonic() - started < 5
    assert "timed out after 0.1 s waiting for the first batch" in err.getvalue()

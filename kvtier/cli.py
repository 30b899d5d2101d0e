"""The ``kvtier`` command line: ``kvtier bench`` (the main job), ``kvtier events``, ``kvtier warm`` and
the operator commands.

Dispatch is table-driven: :data:`COMMANDS` maps a command name to its one-line help and the
``"module:function"`` that runs it. The function takes the remaining arguments
(``list[str]``) and returns the exit status; the module is imported only when its command runs,
so a command whose module (or one of its optional dependencies) is missing fails with one line
on stderr and exit status 2, and every other command keeps working.

The conventions the commands' own parsers share (:class:`~kvtier.ops.cli_args.CliParser`,
:func:`~kvtier.ops.cli_args.exit_codes_epilog`) live in :mod:`kvtier.ops.cli_args`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import TextIO

from kvtier import __version__
from kvtier.config.schema import did_you_mean
from kvtier.ops.cli_args import CliParser, exit_codes_epilog

__all__ = ["main", "COMMANDS", "version"]

#: name -> (one-line help, "module:function"); the function is ``(argv: list[str]) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "reproduce the tiered-offloading scaling result on this machine (the main job)",
        "kvtier.bench.cli:run_bench_cli",
    ),
    "events": (
        "subscribe to a kvtier/vLLM KV-event publisher and print events as JSON lines",
        "kvtier.ops.events_cmd:run_events_cli",
    ),
    "warm": (
        "ask an engine's warm-up endpoint to prefetch a prompt's cached prefix into host memory",
        "kvtier.ops.warm_cmd:run_warm_cli",
    ),
    "inspect": ("show what a tier's storage holds", "kvtier.ops.inspect:run_inspect_cli"),
    "verify": ("check the integrity of a tier's stored chunks", "kvtier.ops.verify:run_verify_cli"),
    "gc": ("remove stale or unusable data from a tier's storage", "kvtier.ops.gc:run_gc_cli"),
}

_EXIT_CODES = {0: "success", 2: "bad arguments, or the command is not available in this installation"}


def version() -> str:
    """The installed kvtier version (package metadata; the source tree's ``__version__`` without it)."""
    try:
        return dist_version("kvtier")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return __version__


def _top_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    commands = "\n".join(f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items())
    parser = CliParser(
        prog="kvtier",
        usage="kvtier [-h] [--version] COMMAND [ARGS ...]",
        description="Hierarchical KV-cache offloading for LLM serving.\n\ncommands:\n" + commands,
        epilog="Run 'kvtier COMMAND --help' for a command's options and exit statuses.\n\n"
        + exit_codes_epilog({**_EXIT_CODES, 1: "the command failed (see its --help)"}),
    )
    parser.add_argument("--version", action="version", version=f"kvtier {version()}")
    return parser


def _load(command: str) -> Callable[[list[str]], int] | str:
    """The command's function, or a one-line reason it cannot run."""
    target = COMMANDS[command][1]
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if module_name == missing or module_name.startswith(missing + "."):
            return (f"kvtier {command}: this command is not available in this installation "
                    f"(module {module_name} is missing)")
        return f"kvtier {command}: needs the Python module {missing!r}, which is not installed"
    function = getattr(module, function_name, None)
    if not callable(function):
        return f"kvtier {command}: this command is not available in this installation ({target} is missing)"
    return function  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvtier ARGS``; returns the exit status (0 success, 1 the command failed, an output
    that cannot be written included, 2 bad arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    if not args:
        parser.print_help(sys.stderr)
        return 2
    if args[0].startswith("-"):
        try:
            parser.parse_args(args[:1])  # --help and --version print and exit 0; others exit 2
        except SystemExit as exc:
            return int(exc.code or 0)
        return 2  # pragma: no cover - parse_args always exits on an option without a command
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"kvtier: error: unknown command {command!r}{did_you_mean(command, COMMANDS)}; "
              f"allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    function = _load(command)
    if isinstance(function, str):
        print(function, file=sys.stderr)
        return 2
    return _flushed(command, _run(function, rest))


def _run(function: Callable[[list[str]], int], rest: list[str]) -> int:
    try:
        return int(function(rest))
    except SystemExit as exc:  # a command's argparse exiting (--help, usage errors)
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _flushed(command: str, status: int) -> int:
    """``status`` once what the command wrote is flushed. An output that cannot be written (a
    closed pipe, a full disk) makes a success status 1 — never 2, which says the arguments were
    wrong — and leaves nothing for the interpreter to fail on at exit (status 120, a traceback)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            if status == 0:
                status = 1
                if stream is sys.stdout:
                    _say(f"kvtier {command}: error: cannot write the output: "
                         f"{getattr(exc, 'strerror', None) or exc}")
            _drop_pending(stream)
    return status


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _drop_pending(sys.stderr)


def _drop_pending(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null, so that what it still holds goes nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):  # no descriptor (a stream in memory): nothing to flush at exit
        pass


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

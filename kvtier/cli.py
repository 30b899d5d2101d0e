"""The ``kvtier`` command line: ``kvtier bench`` (the main job) and ``kvtier events``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS = {
    "bench": "reproduce the tiered-offloading scaling result on this machine (the main job)",
    "events": "subscribe to a kvtier/vLLM KV-event publisher and print events as JSON lines",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Hierarchical KV-cache offloading for LLM serving.",
        epilog="Run 'kvtier COMMAND --help' for a command's options.",
    )
    parser.add_argument("command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v}" for k, v in _COMMANDS.items()))
    if not args or args[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        parser.parse_args([command])  # prints the choices and exits with status 2
    if command == "bench":
        from kvtier.bench.cli import run_bench_cli

        return run_bench_cli(rest)
    from kvtier.events import run_events_cli

    return run_events_cli(rest)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

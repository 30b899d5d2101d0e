"""The argparse conventions every ``kvtier`` command shares.

:class:`CliParser` turns a usage error into one line on stderr and exit status 2, and shows each
option's default in ``--help``; :func:`exit_codes_epilog` writes the exit statuses a command's
``--help`` lists.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import NoReturn

__all__ = ["CliParser", "exit_codes_epilog"]


def exit_codes_epilog(codes: dict[int, str]) -> str:
    """An ``--help`` epilog listing exit statuses, one per line."""
    lines = ["exit status:"]
    for code, meaning in sorted(codes.items()):
        lines += textwrap.wrap(meaning, width=78, initial_indent=f"  {code:<3} ", subsequent_indent=" " * 6)
    return "\n".join(lines)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps description/epilog line breaks; appends ``(default: X)`` where a default means something."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


class CliParser(argparse.ArgumentParser):
    """``argparse`` parser for kvtier's commands.

    A usage error prints one line on stderr (``kvtier CMD: error: …; see 'kvtier CMD --help'``)
    and exits with status 2 (``SystemExit``); ``--help`` shows each option's default.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")

"""Operator commands for fs-tier trees: ``kvtier inspect``, ``kvtier verify`` and ``kvtier gc``.

Each is a module with ``run_<name>_cli(argv, *, out=None) -> int`` (exit status 0 clean, 1
problems found or an output that cannot be written, 2 usage error); :mod:`kvtier.ops.runs` holds
what they share, :func:`kvtier.ops.runs.printable` among it: how every name is printed. See
``docs/operators.md``.
"""

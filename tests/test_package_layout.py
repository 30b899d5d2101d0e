"""The package's own shape: what import-linter (run by ``.ci/run``) does not check.

A module never imports another module's private name (one with a leading underscore): a name
two modules share is public, documented where it is defined.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

PACKAGE = Path(kvtier.__file__).resolve().parent


def private_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvtier":
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    module = tmp_path / "kvtier" / "sample.py"
    module.parent.mkdir()
    module.write_text("from kvtier.tiers.base import _JobRecord\nfrom kvtier.types import __all__\n")
    assert private_imports(module, tmp_path) == ["kvtier/sample.py:1: kvtier.tiers.base._JobRecord"]


def test_no_module_imports_a_private_name_of_another() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in private_imports(path)]
    assert found == []

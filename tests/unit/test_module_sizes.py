"""The house rule of issue 24, kept: no module of the package over 500 lines, no class over 400. A module that
grows past it is a sign it holds two concepts; split it by concept (docs/architecture.md) rather than raise these."""

from __future__ import annotations

import ast
from pathlib import Path

import moshpeer

PACKAGE_ROOT = Path(moshpeer.__file__).parent
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 400


def test_no_module_over_500_lines_and_no_class_over_400():
    too_long = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        name = path.relative_to(PACKAGE_ROOT.parent)
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long

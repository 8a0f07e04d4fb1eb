"""moshpeer.averaging has no import cycle: a static walk of its modules' top-level imports (imports under
`if TYPE_CHECKING:` and inside functions are not followed, as Python does not run them at import time)."""

from __future__ import annotations

import ast
from pathlib import Path

import moshpeer.averaging

PACKAGE = "moshpeer.averaging"
ROOT = Path(moshpeer.averaging.__file__).parent


def top_level_imports(path: Path) -> set:
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:  # from moshpeer.averaging import wire
                found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    modules = {f"{PACKAGE}.{p.stem}" for p in ROOT.glob("*.py") if p.stem != "__init__"}
    return {name for name in found if name in modules}


def test_no_import_cycle_in_averaging():
    graph = {f"{PACKAGE}.{p.stem}": top_level_imports(p) for p in ROOT.glob("*.py") if p.stem != "__init__"}
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path + [module])
        state[module] = "open"
        for dependency in sorted(graph[module]):
            visit(dependency, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])

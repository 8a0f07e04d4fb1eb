"""The package's import graph: no import cycle, and every module imports in a fresh interpreter.

Imports inside functions count too (a deferred import only hides a circle between two modules); imports under
`if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import moshpeer

PACKAGE_ROOT = Path(moshpeer.__file__).parent


def module_names() -> Dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that `module` imports, at load time or later (TYPE_CHECKING blocks aside)."""
    is_package = path.name == "__init__.py"
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in known and name != module}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle in `graph` (as a list of modules, first == last), or [] if there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def walk(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return []


def test_the_package_has_no_import_cycle():
    modules = module_names()
    known = set(modules)
    graph = {name: imports_of(name, path, known) for name, path in modules.items()}
    assert find_cycle(graph) == []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_every_module_imports_in_a_fresh_interpreter():
    # One interpreter for all (each module in its own would take minutes: torch and hivemind load each time).
    names = sorted(name for name in module_names() if not name.endswith("__main__"))  # that one runs the CLI
    script = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    out = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=240,
                         cwd=PACKAGE_ROOT.parent)
    assert out.returncode == 0, out.stderr[-3000:]


# Within the peer layer: a folder may not import from the folders listed for it (they build on it).
PEER_FOLDERS_ABOVE = {
    "state": {"optimizer", "runtime", "strategies"},
    "strategies": {"optimizer", "runtime", "state"},
    "optimizer": {"runtime"},
}


def test_peer_folders_import_only_downward():
    modules = module_names()
    known = set(modules)
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        if parts[:2] != ["moshpeer", "peer"] or len(parts) < 4 or parts[2] not in PEER_FOLDERS_ABOVE:
            continue
        for dep in imports_of(name, path, known):
            dep_parts = dep.split(".")
            if dep_parts[:2] == ["moshpeer", "peer"] and len(dep_parts) > 2 \
                    and dep_parts[2] in PEER_FOLDERS_ABOVE[parts[2]]:
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


# The layers of docs/architecture.md, bottom up: a module imports from its own layer or from lower ones only. The
# package's root modules (errors, version, logs, ratelimited_log, bounded_memory) are below every layer; `testing`
# (netlab, orphans) is a tool for tests and benchmarks that imports no layer; simulation runs the averaging and peer
# decisions for virtual peers; adversaries (hostile peers for tests and benchmarks) use the peer's own code;
# cli may import everything.
LAYER_RANK = {"dht": 1, "compression": 1, "testing": 1, "averaging": 2, "peer": 3, "simulation": 4, "adversaries": 4,
              "cli": 5, "__main__": 6}


def test_layers_import_only_downward():
    modules = module_names()
    known = set(modules)
    wrong = []
    for name, path in modules.items():
        layer = name.split(".")[1] if name.count(".") else None
        if layer not in LAYER_RANK:
            continue  # a root module: it may import only other root modules (checked below)
        for dep in imports_of(name, path, known):
            dep_layer = dep.split(".")[1] if dep.count(".") else None
            if dep_layer in LAYER_RANK and dep_layer != layer and LAYER_RANK[dep_layer] >= LAYER_RANK[layer]:
                wrong.append(f"{name} -> {dep}")
    for name, path in modules.items():  # root modules: below every layer
        if name.count(".") == 1 and name.split(".")[1] not in LAYER_RANK:
            wrong += [f"{name} -> {dep}" for dep in imports_of(name, path, known)
                      if dep.count(".") and dep.split(".")[1] in LAYER_RANK]
    assert wrong == []

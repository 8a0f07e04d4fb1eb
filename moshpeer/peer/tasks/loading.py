"""Load a user task from a spec string: `package.module:make_task` or `path/to/file.py:make_task`.

Spec forms (the `:attribute` part defaults to `make_task`):
- a built-in name: `digits`, `charlm`, `gpt` (see `BUILTIN_TASKS`);
- a module: `package.module:make_task`, imported like `python -m` would: the current directory is
  importable, so `examples.custom_task:make_task` works from the repository root;
- a file: `path/to/task.py:make_task` (any spec whose target ends in `.py` or contains a path
  separator). The file is loaded as a standalone module and its directory is made importable, as
  `python path/to/task.py` would, so it can import its sibling modules.

Every failure (bad spec, missing module or file, missing attribute, a factory that raises or
returns something other than a `Task`) is a `UserError` with one line saying what to fix.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, Iterable, Optional

import torch

from moshpeer.errors import UserError
from moshpeer.peer.tasks.protocol import Task

BUILTIN_TASKS: dict[str, str] = {
    "digits": "moshpeer.peer.tasks.digits:make_task",
    "charlm": "moshpeer.peer.tasks.charlm:make_task",
    "gpt": "moshpeer.peer.tasks.gpt:make_task",
}
DEFAULT_TASK = "digits"
DEFAULT_FACTORY = "make_task"

_SPEC_RE = re.compile(r"^(?P<target>.+?)(?::(?P<attribute>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*))?$")


def check_task(spec: str = DEFAULT_TASK, **kwargs: Any) -> Callable[..., Any]:
    """The factory `spec` names, checked to accept `kwargs`, not called (so nothing is built or downloaded).

    :raises UserError: a bad spec, a module that does not import, a missing factory, or arguments it
        does not take
    """
    factory = resolve_task_factory(spec)
    _check_kwargs(spec, factory, kwargs)
    return factory


def load_task(spec: str = DEFAULT_TASK, *, device: Optional[torch.device] = None, **kwargs: Any) -> Task:
    """Build the task named by `spec`, passing `kwargs` to its factory.

    `device`: where to train. A factory with a `device` parameter receives it (unless `kwargs` already
    names one), and the task's model is moved there afterwards in any case."""
    factory = check_task(spec, **kwargs)
    if device is not None and "device" not in kwargs and _accepts(factory, "device"):
        kwargs["device"] = device
    try:
        task = factory(**kwargs)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"task factory {spec!r} raised {type(exc).__name__}: {_one_line(exc)}") from exc
    if not isinstance(task, Task):
        raise UserError(
            f"task factory {spec!r} returned {type(task).__name__}, expected a moshpeer.peer.tasks.Task"
        )
    return task.to(device) if device is not None else task


def resolve_task_factory(spec: str) -> Callable[..., Any]:
    """Find the factory callable named by `spec` without calling it."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("empty task spec; expected 'package.module:make_task' or 'path/to/task.py:make_task'")
    spec = spec.strip()
    spec = BUILTIN_TASKS.get(spec, spec)
    match = _SPEC_RE.match(spec)
    if match is None:  # e.g. a spec with a line break in it
        raise UserError(f"bad task spec {spec!r}; expected 'package.module:make_task' or 'path/to/task.py:make_task'")
    target, attribute = match["target"], match["attribute"] or DEFAULT_FACTORY
    module = _load_file(target, spec) if _is_path(target) else _import_module(target, spec)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise UserError(f"task module {target!r} has no attribute {attribute!r}{_suggestion(part, dir(obj))}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(
            f"{attribute!r} in task module {target!r} is of type {type(obj).__name__}, not a callable task factory"
        )
    return obj


def parse_task_kwargs(items: Iterable[str]) -> dict[str, Any]:
    """Parse `key=value` strings (from `--task-arg`) into factory kwargs.

    Values are Python literals when they parse as one (`64`, `0.01`, `True`, `'text'`), otherwise
    plain strings: `hidden=64` -> {"hidden": 64}, `corpus=stdlib` -> {"corpus": "stdlib"}.
    """
    kwargs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"bad task argument {item!r}; expected key=value with a Python identifier as key")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_module(name: str, spec: str) -> ModuleType:
    if not all(part.isidentifier() for part in name.split(".")):
        raise UserError(
            f"bad task spec {spec!r}: {name!r} is not a module name; "
            "expected 'package.module:make_task' or 'path/to/task.py:make_task'"
        )
    # Like `python -m`: modules in the current directory are importable (the `moshpeer` console
    # script does not put it on sys.path by itself). Appended, so it never shadows installed code.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UserError(
                f"task module {name!r} not found; give an importable module ('package.module:make_task', "
                "importable from the current directory) or a file ('path/to/task.py:make_task')"
            ) from exc
        raise UserError(f"task module {name!r} needs {exc.name!r}, which is not installed") from exc
    except Exception as exc:
        raise UserError(f"task module {name!r} failed to import: {type(exc).__name__}: {_one_line(exc)}") from exc


def _load_file(path: str, spec: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise UserError(f"task file {path!r} does not exist (from task spec {spec!r})")
    if not path.endswith(".py"):
        raise UserError(f"task file {path!r} is not a .py file")
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    module_name = f"moshpeer_task_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.basename(path)[:-3])}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.append(directory)
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    # Registered before execution so dataclasses and pickling inside the file can find the module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[module_name]
        if isinstance(exc, ModuleNotFoundError):
            raise UserError(f"task file {path!r} needs {exc.name!r}, which is not installed") from exc
        if isinstance(exc, Exception):
            raise UserError(f"task file {path!r} failed to load: {type(exc).__name__}: {_one_line(exc)}") from exc
        raise
    return module


def _check_kwargs(spec: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        accepted = [name for name in signature.parameters if not name.startswith("_")]
        raise UserError(f"task factory {spec!r} {exc}; it accepts {accepted}") from exc


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _suggestion(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, [c for c in candidates if not c.startswith("_")], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"

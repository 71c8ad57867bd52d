"""Issue 44 item 4, style rule 4: a thin CLI. Each registered command's body parses, builds a
request and makes ONE call into the library; its body stays short (typer options may make the
signature long).

What counts, read from the source (ast) of each command function and resolved against the
names its module and body import:

* the body: the statements after the signature and the docstring, first to last line, at most
  ``MAX_BODY`` lines;
* a library call: a call of a name imported from ``ncpctl.*`` outside ``ncpctl.cli`` (a function,
  or an attribute of an imported module; a name imported inside the command is read from its
  module's source, so this check imports no entry module and no torch). A ``*Request`` class is the request being built (a
  dataclass: data, not work) and does not count, nor does an exception class (``raise UserError(...)``
  for a flag that cannot be parsed is parsing);
* a call of a helper defined in ``ncpctl.cli`` (the command's own module or another, except
  ``_common``) is followed: the library calls it makes count as the command's, so work cannot
  hide in a CLI helper; ``cli/_common.py`` (options, error formatting) and ``ncpctl.output``
  (``Output``, the sink the command hands the library: stderr for people, stdout for the result)
  count as none.

Exactly one library call per command, followed helpers included; a call of a name that is bound
nowhere (an import forgotten in a move) is reported too.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

MAX_BODY = 25


def _commands() -> dict[str, Callable[..., Any]]:
    from ncpctl.cli.app import app

    return {c.name: inspect.unwrap(c.callback) for c in app.registered_commands}


def _tree(fn: Callable[..., Any]) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.FunctionDef), fn
    return node


def _body(node: ast.FunctionDef) -> list[ast.stmt]:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring: the command's --help text, not its work
    return body


def body_lines(fn: Callable[..., Any]) -> int:
    body = _body(_tree(fn))
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def _local_imports(node: ast.FunctionDef) -> dict[str, str]:
    """Names the function's body imports: name -> dotted target (``mod.attr`` or ``mod``)."""
    names = {}
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                names[a.asname or a.name] = f"{n.module}.{a.name}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                names[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    return names


PACKAGE = Path(__file__).resolve().parents[2] / "ncpctl"


class Declared:
    """A library name read from its module's source rather than imported (importing a command's
    entry module may import torch: seconds this check need not spend)."""

    def __init__(self, module: str, name: str, request: bool, exception: bool):
        self.__module__, self.__name__ = module, name
        self.request = request  # a ``@dataclass`` named ``*Request``
        self.exception = exception  # a class whose base is named ``*Error`` or ``*Exception``


def _declared(target: str) -> Declared | None:
    """``ncpctl.pkg.mod.name`` (outside cli) as declared at the top level of ``ncpctl/pkg/mod.py``."""
    mod, _, attr = target.rpartition(".")
    path = PACKAGE.joinpath(*mod.split(".")[1:]).with_suffix(".py")
    if not mod.startswith("ncpctl.") or mod.startswith("ncpctl.cli") or not path.is_file():
        return None
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, ast.FunctionDef) and n.name == attr:
            return Declared(mod, attr, False, False)
        if isinstance(n, ast.ClassDef) and n.name == attr:
            decorators = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in n.decorator_list}
            bases = [ast.unparse(b) for b in n.bases]
            return Declared(mod, attr, attr.endswith("Request") and bool(decorators & {"dataclass", "dataclasses.dataclass"}),
                            any(b.endswith(("Error", "Exception")) for b in bases))
    return None  # a re-exported name: imported below


def _resolve(target: str) -> Any:
    """``pkg.mod.name`` -> the object (a module, or an attribute of one), or its ``Declared`` stand-in."""
    declared = _declared(target)
    if declared is not None:
        return declared
    try:
        return importlib.import_module(target)
    except ImportError:
        mod, _, attr = target.rpartition(".")
        return getattr(importlib.import_module(mod), attr)


def _callee(call: ast.Call, local: dict[str, str], globals_: dict[str, Any]) -> Any:
    """The object a call resolves to through imports, or None (a local variable, a builtin)."""
    chain, f = [], call.func
    while isinstance(f, ast.Attribute):
        chain.append(f.attr)
        f = f.value
    if not isinstance(f, ast.Name):
        return None
    if f.id in local:
        obj = _resolve(local[f.id])
    elif f.id in globals_:
        obj = globals_[f.id]
    else:
        return _UNBOUND if f.id not in dir(builtins) else None
    for attr in reversed(chain):
        if not isinstance(obj, ModuleType):
            return None  # a method of an object, not a library entry point
        obj = getattr(obj, attr, None)
    return obj


_UNBOUND = object()


def _bound(node: ast.FunctionDef) -> set[str]:
    """Names the function binds itself: its (and its nested functions' and lambdas') parameters,
    assignments and nested definitions."""
    names = {a.arg for f in ast.walk(node) if isinstance(f, (ast.FunctionDef, ast.Lambda))
             for a in (*f.args.args, *f.args.kwonlyargs, *f.args.posonlyargs, f.args.vararg, f.args.kwarg) if a}
    names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names | {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _home(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, ModuleType) else getattr(obj, "__module__", "") or ""


def library_calls(fn: Callable[..., Any], seen: set | None = None) -> list[str]:
    """The library functions ``fn`` calls, through the CLI helpers it calls (see the module doc)."""
    seen = set() if seen is None else seen
    seen.add(fn)
    node = _tree(fn)
    local, found = _local_imports(node), []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        obj = _callee(call, local, fn.__globals__)
        if obj is _UNBOUND:
            root = call.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if root.id not in _bound(node):
                found.append(f"unbound name {root.id}")  # a NameError the first time the command runs
            continue
        home = _home(obj)
        if obj is None or not home.startswith("ncpctl.") or home == "ncpctl.output":
            continue
        if home.startswith("ncpctl.cli"):
            if home != "ncpctl.cli._common" and inspect.isfunction(obj) and obj not in seen:
                found += library_calls(inspect.unwrap(obj), seen)
            continue
        if isinstance(obj, Declared) and (obj.request or obj.exception):
            continue
        if inspect.isclass(obj) and (issubclass(obj, BaseException)
                                     or obj.__name__.endswith("Request") and dataclasses.is_dataclass(obj)):
            continue
        found.append(f"{home}.{getattr(obj, '__name__', '?')}")
    return found


COMMANDS = _commands()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_command_parses_and_makes_one_library_call(name: str) -> None:
    fn = COMMANDS[name]
    lines, calls = body_lines(fn), library_calls(fn)
    assert lines <= MAX_BODY and len(calls) == 1, \
        f"ncpctl {name} ({fn.__module__}.{fn.__name__}): body {lines} lines (max {MAX_BODY}), " \
        f"{len(calls)} library calls (expected one): {calls}"


def test_the_check_fails_on_a_command_that_does_work() -> None:
    """The measure sees work in the body and in a CLI helper it calls (so the test above can fail)."""
    ns: dict[str, Any] = {}
    src = textwrap.dedent('''
        from ncpctl.errors import UserError
        from ncpctl import fsutil

        def helper(path):
            from ncpctl.checkpoint import resolve
            return resolve(path), fsutil.atomic_write(path, "")

        def main(path: str) -> None:
            """Docstring lines do not count."""
            from ncpctl.recipe import load_recipe
            r = load_recipe(path, [])
            helper(path)
            Output(path)
            raise UserError("x")
    ''')
    import linecache

    filename = "<thin-example>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)
    ns["helper"].__module__ = ns["main"].__module__ = "ncpctl.cli.example"
    calls = library_calls(ns["main"])
    assert sorted(calls) == ["ncpctl.checkpoint.resolve", "ncpctl.fsutil.atomic_write",
                             "ncpctl.recipe.load.load_recipe", "unbound name Output"], calls
    assert body_lines(ns["main"]) == 5

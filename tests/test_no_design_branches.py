"""Issue 22: outside each design's own modules and the registry, no module of ``ncpctl/`` branches
on a built-in design, segmentation, coupling, mixer, objective or family name. Issue 44: a built-in
design lives in one room (``ncpctl/model/designs/NAME/``) registered by one line of
``registry.DESIGNS``, and the rest of the model package never names it.

A check on the source text: every comparison (``==``, ``!=``, ``in``, ``not in``) and every
``match`` case in ``ncpctl/`` is read from the syntax tree, and one whose string constants include
a built-in name fails unless the file is that name's own. The names and their owners are read from
the source of the designs' records (each ``DesignSpec(...)`` call: its strategies, the modes its
options select, its training hooks), not from the registry's tables derived from them: a room owns
its folder, the records of the base model and the families own the module each strategy names, and
a design's training hooks module (``ncpctl/train/designs/``) owns its names too. The Hugging Face
model types the families import belong to the family modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import ncpctl
from ncpctl.model.families import hf

PKG = Path(ncpctl.__file__).parent
MODEL = PKG / "model"


@functools.lru_cache(maxsize=None)
def _tree(text: str) -> ast.AST:
    """A source text's syntax tree, parsed once per text (the checks read the same files again)."""
    return ast.parse(text)


def _module_file(target: str) -> str:
    """".designs.x.module:Class" (relative to ncpctl.model) or "ncpctl.train.x:Class" -> its file (relative to ncpctl/)."""
    module = target.partition(":")[0]
    parts = module[1:].split(".") if module.startswith(".") else module.split(".")[1:]
    return ("model/" if module.startswith(".") else "") + "/".join(parts) + ".py"


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None  # a name (a section class, a law): not a literal


def records(model: Path = MODEL) -> list[tuple[str, dict]]:
    """(file, keyword literals) of every ``DesignSpec(...)`` call in the model package's source."""
    out = []
    for path in sorted(model.rglob("*.py")):
        for n in ast.walk(_tree(path.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "DesignSpec":
                kw = {k.arg: _literal(k.value) for k in n.keywords}
                kw["name"] = _literal(n.args[0]) if n.args else kw.get("name")
                out.append(("model/" + path.relative_to(model).as_posix(), kw))
    return out


def _owners() -> dict[str, set[str]]:
    """Built-in name -> the files or folders (relative to ncpctl/, a folder ending in "/") that may compare against it."""
    owners: dict[str, set[str]] = {}
    for rel, kw in records():
        room = rel.rpartition("/")[0] + "/" if rel.startswith("model/designs/") else None
        strategies = kw.get("strategies") or {}
        hooks = {_module_file(h) for h in kw.get("hooks") or ()}
        for table in strategies.values():
            for name, target in table.items():
                owners.setdefault(name, set()).update({room or _module_file(target), *hooks})
        for mode in kw.get("modes") or ():
            owners.setdefault(mode, set()).update({room or rel, *hooks})
        if room is None and "backbone" in strategies:
            families = {_module_file(t) for t in strategies["backbone"].values()}
            for model_type in hf.hf_model_types():
                owners.setdefault(model_type, set()).update(families)
    return owners


def _owns(own: set[str], rel: str) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in own)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _branches(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, source, strings) of each comparison and match case."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            found = [s for side in (n.left, *n.comparators) for s in _strings(side)]
            out.append((n.lineno, ast.unparse(n), found))
        elif isinstance(n, ast.match_case):
            found = [s for p in ast.walk(n.pattern) if isinstance(p, ast.MatchValue) for s in _strings(p.value)]
            out.append((n.pattern.lineno, ast.unparse(n.pattern), found))
    return out


def test_no_central_module_branches_on_a_built_in_name():
    owners = _owners()
    assert {"fixed", "dynamic", "add", "cross_attention", "plain", "irc", "block_attnres", "next_token",
            "neox", "llama", "gpt2", "olmo2"} <= set(owners), sorted(owners)
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for line, src, found in _branches(_tree(path.read_text())):
            names = [s for s in found if s in owners and not _owns(owners[s], rel)]
            if names:
                bad.append(f"ncpctl/{rel}:{line}: {src[:100]}  ({', '.join(names)})")
    assert not bad, "central modules branch on built-in names:\n" + "\n".join(bad)


def test_the_check_sees_a_branch():
    """The scan is not vacuous: a comparison against a built-in name in a central file is found."""
    owners = _owners()
    src = "if cfg.concept.segmentation == 'dynamic':\n    pass\nmatch mt:\n    case 'olmo2':\n        pass\n"
    found = {s for _, _, strs in _branches(ast.parse(src)) for s in strs if s in owners}
    assert found == {"dynamic", "olmo2"}
    assert not _owns(owners["dynamic"], "model/core/model.py") and _owns(owners["dynamic"], "model/designs/dynamic/module.py")


def _rooms(model: Path = MODEL) -> dict[str, set[str]]:
    """Each room of model/designs/ (its folder, listed from the disk) -> the names its record declares
    (its strategies and modes)."""
    rooms = {p.name: set() for p in (model / "designs").iterdir() if (p / "spec.py").is_file()}
    for rel, kw in records(model):
        parts = rel.split("/")
        if parts[:2] == ["model", "designs"]:
            for table in (kw.get("strategies") or {}).values():
                rooms[parts[2]].update(table)
            rooms[parts[2]].update(kw.get("modes") or ())
    return rooms


def _named(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of the string constants equal to one of ``names``, outside the named sizes
    (``SIZES``: the papers' configurations are recipe data)."""
    skip = {id(c) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
            and any(getattr(t, "id", None) == "SIZES" for t in (n.targets if isinstance(n, ast.Assign) else [n.target])) for c in ast.walk(n.value)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in skip]


def room_problems(model: Path = MODEL) -> list[str]:
    """A built-in design is named inside its own room only: no other module of the model package
    holds its names as a string, and ``registry.DESIGNS`` registers each room by exactly one line."""
    rooms = _rooms(model)
    registry = (model / "registry.py").read_text().splitlines()
    every = set().union(*rooms.values())
    strings = {path.relative_to(model).as_posix(): _named(_tree(path.read_text()), every)
               for path in sorted(model.rglob("*.py"))}
    bad = []
    for room, names in rooms.items():
        lines = [ln for ln in registry if f'".designs.{room}.' in ln]
        if len(lines) != 1:
            bad.append(f"registry.py: {len(lines)} registration lines for the room {room!r} (one wanted)")
        bad += [f"model/{rel}:{line}: names {name!r} of the room {room!r}" for rel, found in strings.items()
                if not rel.startswith(f"designs/{room}/") for line, name in found if name in names]
    return bad


def test_a_built_in_design_is_named_only_in_its_room():
    rooms = _rooms()
    assert {"dynamic", "cross_attention", "residual", "causal_diffusion", "bottleneck"} <= set(rooms), sorted(rooms)
    assert {"dynamic", "predictor", "boundary"} <= rooms["dynamic"] and {"irc", "block_attnres"} <= rooms["residual"]
    assert not room_problems(), "\n".join(room_problems())


def test_the_room_check_sees_a_stray_name(tmp_path, monkeypatch):
    """The room check is not vacuous: a core module naming a room's strategy, and a room registered
    twice, are both found."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(MODEL, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "core" / "stray.py").write_text("KIND = 'block_attnres'\n")
    with open(copy / "registry.py", "a") as f:
        f.write('EXTRA = (".designs.dynamic.spec:SPEC",)\n')
    found = room_problems(copy)
    assert any("core/stray.py:1: names 'block_attnres'" in p for p in found), found
    assert any("2 registration lines for the room 'dynamic'" in p for p in found), found

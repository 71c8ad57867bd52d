"""Issue 22: outside each design's own modules and the registry, no module of ``ncpctl/`` branches
on a built-in design, segmentation, coupling, mixer, objective or family name.

A check on the source text: every comparison (``==``, ``!=``, ``in``, ``not in``) and every
``match`` case in ``ncpctl/`` is read from the syntax tree, and one whose string constants include
a built-in name fails unless the file is that name's own module. The names come from the registry
(every built-in strategy of every extension point), the modes of the built-in designs, and the
Hugging Face model types the families import; the owners come from the registry too (the module
each built-in class lives in) plus the design's config section and its loop hooks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ncpctl
from ncpctl.model import hf
from ncpctl.model.registry import STRATEGIES

PKG = Path(ncpctl.__file__).parent

# the options of a built-in design that select how it works (their values are that design's names)
MODES = {"dynamic": ("predictor", "boundary"), "cross_attention": ("per_concept", "replicated")}
# each built-in design's config section and loop hooks (beside the module the registry names)
SECTIONS = {
    "dynamic": ("model/config_dynamic.py", "train/designs/dynamic.py"),
    "cross_attention": ("model/config_coupling.py",),
    "irc": ("model/config_residual.py",),
    "block_attnres": ("model/config_residual.py",),
}


def _owners() -> dict[str, set[str]]:
    """Built-in name -> the files (relative to ncpctl/) that may compare against it."""
    owners: dict[str, set[str]] = {}
    for kind, table in STRATEGIES.items():
        for name, target in table.items():
            if not isinstance(target, str) or not target.startswith("."):
                continue  # registered at run time (a test's toy), not built in
            module = "model/" + target[1:].partition(":")[0] + ".py"
            own = {module, *SECTIONS.get(name, ())}
            owners.setdefault(name, set()).update(own)
            for mode in MODES.get(name, ()):
                owners.setdefault(mode, set()).update(own)
    families = {"model/" + t[1:].partition(":")[0] + ".py" for t in STRATEGIES["backbone"].values()
                if isinstance(t, str)}
    for model_type in hf.hf_model_types():
        owners.setdefault(model_type, set()).update(families)
    return owners


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
        for line, src, found in _branches(ast.parse(path.read_text())):
            names = [s for s in found if s in owners and rel not in owners[s]]
            if names:
                bad.append(f"ncpctl/{rel}:{line}: {src[:100]}  ({', '.join(names)})")
    assert not bad, "central modules branch on built-in names:\n" + "\n".join(bad)


def test_the_check_sees_a_branch():
    """The scan is not vacuous: a comparison against a built-in name in a central file is found."""
    owners = _owners()
    src = "if cfg.concept.segmentation == 'dynamic':\n    pass\nmatch mt:\n    case 'olmo2':\n        pass\n"
    found = {s for _, _, strs in _branches(ast.parse(src)) for s in strs if s in owners}
    assert found == {"dynamic", "olmo2"}
    assert "model/model.py" not in owners["dynamic"] and "model/dynamic.py" in owners["dynamic"]

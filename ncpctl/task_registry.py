"""Which evaluation tasks exist: ours (the YAMLs in ``ncpctl/evaluate/tasks``, by name, groups
expanded to their leaves) and lm-eval's (its index, read only when a name is not ours).

Below ``ncpctl.recipe``, which checks a recipe's ``train.eval_tasks`` with ``unknown_tasks`` before
training starts, and below ``ncpctl.evaluate``, which loads and scores them. Nothing heavy at import
(lm-eval is imported only to read its index).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TASKS_DIR = Path(__file__).parent / "evaluate" / "tasks"


def our_tasks(tasks_dir: Path = TASKS_DIR) -> dict[str, dict[str, Any]]:
    """Our task and group YAMLs by name (a loader that ignores ``!function`` tags)."""
    class _L(yaml.SafeLoader):
        pass

    _L.add_constructor("!function", lambda loader, node: None)
    out = {}
    for f in sorted(tasks_dir.glob("*.yaml")):
        d = yaml.load(f.read_text(), Loader=_L)  # noqa: S506 - SafeLoader subclass
        out[d.get("group") or d.get("task")] = d
    return out


def leaves(name: str | dict[str, Any], ours: dict[str, dict[str, Any]]) -> list[str]:
    if isinstance(name, dict):  # a group member with overrides: {task: NAME, num_fewshot: N}
        name = name.get("task") or name.get("group")
    d = ours.get(name)
    if d is None or "group" not in d:
        return [name]
    return [leaf for t in d["task"] for leaf in leaves(t, ours)]


def unknown_tasks(names: list[str], tasks_dir: Path = TASKS_DIR) -> list[str]:
    """The names in ``names`` that are neither ours (``ncpctl/evaluate/tasks``) nor lm-eval's, each as
    one line (a recipe's ``train.eval_tasks`` is checked with it before training starts). lm-eval's
    own index (~10 s) is read only when a name is not one of ours."""
    ours = our_tasks(tasks_dir)
    rest = [n for n in names if n not in ours]
    if not rest:
        return []
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir), include_defaults=True)
    known = set(tm.all_tasks) | set(getattr(tm, "all_groups", []))
    return [f"task {n}: unknown to lm-eval" + (f" (did you mean {', '.join(near)}?)" if near else "")
            for n in rest if n not in known for near in [[k for k in known if n in k][:3]]]

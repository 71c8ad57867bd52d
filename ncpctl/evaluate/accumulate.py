"""Results that accumulate (issue 47 item 2): ``results_<tag>.json`` of a checkpoint holds every task
scored on it, whatever the call that scored it.

Scoring another task set on the same checkpoint adds its tasks to the file; scoring a task again
replaces that task's entries only (its metrics, config, shots, examples, per-example scores, logged
samples). ``scored`` says when and with what settings each task was last scored
(``ncpctl.evaluate.settings.task_settings``). What depends on several tasks is kept consistent:

* the perplexity averages are recomputed over every set in the file;
* an lm-eval group or a paper aggregate whose members were partly re-scored (a member scored alone,
  the group not) mixes two evaluations: it is dropped, and the caller says so;
* ``request`` is the last call's, with ``tasks`` and ``heldout`` the union over the calls (what
  ``ncpctl eval --compare`` evaluates a run without results on).
"""

from __future__ import annotations

import math
from typing import Any

# lm-eval's (and our) per-task sections of a results file, each {task or group: entry}
PER_TASK = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
            "n-samples", "per_example", "samples", "scored", "aggregates")


def tasks_of(res: dict[str, Any]) -> set[str]:
    """Every task and group a results object scored (its groups' members included)."""
    out = set(res.get("results") or {}) | set(res.get("groups") or {}) | set(res.get("aggregates") or {})
    for group, members in (res.get("group_subtasks") or {}).items():
        out |= {group, *members}
    return out


def _members(res: dict[str, Any], group: str) -> set[str]:
    """The tasks a group or paper aggregate of ``res`` is computed from, at any depth."""
    subs = res.get("group_subtasks") or {}
    agg = (res.get("aggregates") or {}).get(group) or {}
    todo, out = list(subs.get(group, [])) + list(agg.get("scores") or {}), set()
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo += subs.get(t, [])
    return out


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """(the merged results, the tasks kept from ``old``, the groups and aggregates of ``old`` dropped
    because some of their members were re-scored without them)."""
    if not old:
        return new, [], []
    fresh = tasks_of(new)
    # groups with scores of their own (a group without metrics, ncp_offline, is just a list of tasks)
    scored = {t for key in ("results", "groups") for t, row in (old.get(key) or {}).items()
              if any("," in k and isinstance(v, (int, float)) for k, v in row.items())} | set(old.get("aggregates") or {})
    groups = (set(old.get("group_subtasks") or {}) | set(old.get("aggregates") or {})) & scored
    stale = sorted(g for g in groups if g not in fresh and _members(old, g) & fresh)
    gone = fresh | set(stale)
    merged = dict(new)
    for key in PER_TASK:
        kept = {t: v for t, v in (old.get(key) or {}).items() if t not in gone}
        if kept or key in new:
            merged[key] = {**kept, **(new.get(key) or {})}
    old_sets = (old.get("perplexity") or {}).get("per_set") or {}
    sets = {**{t: s for t, s in old_sets.items() if t not in gone}, **((new.get("perplexity") or {}).get("per_set") or {})}
    merged["perplexity"] = summarize_sets(sets)
    merged["request"] = _request(old.get("request") or {}, new.get("request") or {})
    kept_tasks = sorted((set(old.get("results") or {}) | set(old.get("groups") or {})) - gone)
    return merged, kept_tasks, stale


def _request(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The last call's request, with the tasks and held-out corpora of every call."""
    tasks = list(dict.fromkeys([*(old.get("tasks") or []), *(new.get("tasks") or [])]))
    heldout = {h.get("label"): h for h in [*(old.get("heldout") or []), *(new.get("heldout") or [])]}
    return {**new, "tasks": tasks, "heldout": list(heldout.values())}


def summarize_sets(sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Both averages over the held-out sets of ``per_set`` entries, and the rule in words (what
    ``ncpctl.evaluate.run`` writes, and what ``merge`` recomputes when results of several evaluations
    are merged)."""
    if not sets:
        return {}
    avg = {k: s for k, s in sets.items() if s["averaged"]}
    nll, n = sum(s["nll"] for s in avg.values()), sum(s["tokens"] for s in avg.values())
    excluded = [k for k in sets if k not in avg]
    terms = " + ".join(f"{k} [{s['unit']}]" for k, s in avg.items())
    rule = (f"mean_of_sets = ({terms}) / {len(avg)}: each held-out set's own perplexity in its own unit "
            "(the ConceptLM paper's Avg PPL)" if avg else "mean_of_sets: no held-out set")
    if excluded:
        rule += "; not averaged (scored on a training split): " + ", ".join(excluded)
    if any(s.get("bound") for s in sets.values()):
        rule += "; from ELBO bounds on the log-likelihood: every perplexity is an upper bound"
    return {"per_set": sets, "mean_of_sets": sum(s["value"] for s in avg.values()) / len(avg) if avg else None,
            "token_weighted": math.exp(nll / n) if avg else None, "averaged": list(avg), "excluded": excluded,
            "rule": rule}

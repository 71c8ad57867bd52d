"""Paper protocols: task groups with per-task shots, a metric per task and the paper's aggregate rule.

A protocol group is one of our group YAMLs (``ncpctl/evaluate/tasks/``) whose ``metadata`` carries
an ``aggregate`` entry. Its ``task`` list is lm-eval's own group syntax: a member is a task or group
name, or ``{task: NAME, num_fewshot: N}`` (lm-eval applies the override itself, so
``python -m ncpctl.evaluate --tasks conceptlm_8b`` sees the same shots). The metadata says what lm-eval's
group machinery cannot: which metric of each member the paper reports (``metrics``: ``acc`` or
``metric,filter``; lm-eval's ``aggregate_metric_list`` averages one metric name over all members, and
the papers mix acc, acc_norm, exact match and pass@1), the sub-averages (``sections``) and the rule::

    metadata:
      aggregate: {name: Avg Acc, rule: unweighted_mean, note: "..."}
      metrics: {arc_challenge: acc_norm, ...}                # default: acc
      sections: {Math: [gsm8k, ...], ...}                    # optional sub-averages, same rule

``ncpctl eval --tasks GROUP`` loads every member on its own: a member whose data is not on this
machine (no network, no cache) is skipped with one line naming it and the rest run; a code member
(metric ``pass@k``) runs only with ``--allow-code-execution`` (``ncpctl.evaluate.code_exec``) and
is otherwise skipped with one line. The aggregate is computed over the members that ran, and says
which were missing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ncpctl.errors import UserError

RULES = {"unweighted_mean": "unweighted arithmetic mean of the members' scores"}


@dataclass(frozen=True)
class Member:
    name: str
    num_fewshot: int | None
    metric: str  # lm-eval result key, "metric,filter" ("acc" -> "acc,none")

    @property
    def is_code(self) -> bool:
        return self.metric.startswith("pass@")


@dataclass(frozen=True)
class Protocol:
    name: str
    members: list[Member]
    label: str  # the paper's name of the aggregate ("Avg Acc", "Overall AVG")
    rule: str  # a key of RULES
    note: str = ""
    sections: dict[str, list[str]] = field(default_factory=dict)


def _key(metric: str) -> str:
    return metric if "," in metric or metric.startswith("pass@") else f"{metric},none"


def protocol_of(name: str, ours: dict[str, dict[str, Any]]) -> Protocol | None:
    """The protocol of our group ``name`` (None: not a protocol group). Malformed metadata is a UserError."""
    d = ours.get(name)
    meta = (d or {}).get("metadata") or {}
    if d is None or "group" not in d or "aggregate" not in meta:
        return None
    agg, metrics = meta["aggregate"], meta.get("metrics") or {}
    rule = agg.get("rule", "unweighted_mean")
    if rule not in RULES:
        raise UserError(f"task group {name}: aggregate rule {rule!r} is not one of {', '.join(RULES)}")
    members = []
    for m in d["task"]:
        task = m if isinstance(m, str) else m.get("task") or m.get("group")
        shots = None if isinstance(m, str) else m.get("num_fewshot")
        members.append(Member(task, shots, _key(str(metrics.get(task, "acc")))))
    names = {m.name for m in members}
    sections = {k: list(v) for k, v in (meta.get("sections") or {}).items()}
    stray = sorted({t for v in sections.values() for t in v} - names)
    unknown_metric = sorted(set(metrics) - names)
    if stray or unknown_metric:
        raise UserError(f"task group {name}: sections/metrics name tasks that are not members: "
                        f"{', '.join(stray + unknown_metric)}")
    return Protocol(name, members, str(agg.get("name", "Avg")), rule, str(agg.get("note", "")).strip(), sections)


def check_known(p: Protocol, known: set[str]) -> None:
    """Every member must be a task or group lm-eval knows (lm-eval itself would build an unknown name
    as an empty inline task and fail later with a traceback): one line per unknown member."""
    bad = [m.name for m in p.members if m.name not in known]
    if bad:
        raise UserError(*(f"task group {p.name}: member {b} is not a task or group lm-eval knows" for b in bad),
                        hint="fix the group YAML in ncpctl/evaluate/tasks/ (lm-eval task names: lm_eval ls tasks)")


@contextlib.contextmanager
def _quiet(name: str):
    log = logging.getLogger(name)
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def load_members(p: Protocol, tm: Any, allow_code: bool, skip: Callable[[str], None]) -> list[Any]:
    """lm-eval task/group objects of the members that can run here; the others are reported through
    ``skip`` with one line each (data not on this machine, code execution not allowed)."""
    objs = []
    for m in p.members:
        if m.is_code and not allow_code:
            skip(f"{p.name}: skipping {m.name} ({m.metric} needs sampled code executed: --allow-code-execution)")
            continue
        if m.is_code:  # lm-eval's humaneval/mbpp import their metric from the hub at load time
            skip(f"{p.name}: skipping {m.name} (its lm-eval metric loads from the hub; ncpctl's sandboxed "
                 "pass@k runs on local code tasks: ncpctl.evaluate.code_exec)")
            continue
        try:  # by name: lm-eval builds a top-level {task: NAME, ...} dict as a new inline task, unmerged
            with _quiet("lm_eval.config.task"):  # its config advice for a task that may be skipped is noise
                loaded = tm.load([m.name])
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a dataset loader raises anything when offline
            first = (str(e).strip().splitlines() or [""])[0][:160]
            skip(f"{p.name}: skipping {m.name} (data not on this machine: {type(e).__name__}: {first})")
            continue
        if m.num_fewshot is not None:  # the member's shots, on every leaf (a member may be a group: mmlu)
            for task in loaded["tasks"].values():
                task.set_config(key="num_fewshot", value=m.num_fewshot)
        top = loaded["groups"].get(m.name) or loaded["tasks"].get(m.name)
        objs += [top] if top is not None else list(loaded["tasks"].values())
    return objs


def score_of(results: dict[str, dict[str, Any]], m: Member) -> float | None:
    """A member's reported score from lm-eval's results (and groups) rows; None when absent."""
    row = results.get(m.name) or {}
    v = row.get(m.metric)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def aggregate(p: Protocol, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The paper's aggregate over ``results`` ({task: {"metric,filter": value}}, lm-eval's rows):
    ``value`` by ``rule`` over the members that have a score, ``sections`` the same over each
    section, ``missing`` the members without one (then the value is not the paper's number)."""
    scores = {m.name: score_of(results, m) for m in p.members}
    have = {k: v for k, v in scores.items() if v is not None}
    sections = {s: _mean([have[t] for t in ts if t in have]) for s, ts in p.sections.items()}
    missing = [k for k, v in scores.items() if v is None]
    line = f"{p.label} = {RULES[p.rule]} over {len(have)} of {len(p.members)} tasks"
    if missing:
        line += f" (missing: {', '.join(missing)})"
    return {"name": p.label, "rule": p.rule, "rule_text": line + (f"; {p.note}" if p.note else ""),
            "value": _mean(list(have.values())), "sections": sections, "scores": scores, "missing": missing,
            "metrics": {m.name: m.metric for m in p.members}}

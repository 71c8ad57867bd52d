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
      subject_mean: [mmlu_stem, ...]                         # group members scored as the unweighted
                                                             # mean of their subtasks (default: lm-eval's
                                                             # group score, subjects weighted by size)
      summaries: {MMLU: [mmlu_stem, ...]}                    # reported beside the aggregate, not in it:
                                                             # the unweighted mean of the members' subtasks
      assumed: {minerva_math500: "greedy exact match ..."}   # where the protocol is ours, not the paper's

``ncpctl eval --tasks GROUP`` loads every member on its own: a member whose data is not on this
machine (no network, no cache) is skipped with one line naming it and the rest run; a code member
(metric ``pass@k``) runs only with ``--allow-code-execution`` (``ncpctl.evaluate.code_exec``) and
is otherwise skipped with one line. The aggregate is computed over the members that ran, and says
which were missing. A member listed in ``assumed`` is scored in a way the paper does not state (or
states and ncpctl does not follow): the rule line names it with the reason.

Each aggregate also records how it is made from examples (``strata``: every leaf task it reads, its
metric and its weight in the aggregate), so ``ncpctl eval --compare``'s seed arms can bootstrap it
stratified (``ncpctl.evaluate.uncertainty.stratified_bootstrap``): a member's leaves weigh 1/leaves
each (``subject_mean``) or their share of the member's examples (lm-eval's size-weighted group score).
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
    subject_mean: tuple[str, ...] = ()
    summaries: dict[str, list[str]] = field(default_factory=dict)
    assumed: dict[str, str] = field(default_factory=dict)


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
    summaries = {k: list(v) for k, v in (meta.get("summaries") or {}).items()}
    subject_mean, assumed = tuple(meta.get("subject_mean") or ()), {k: str(v) for k, v in (meta.get("assumed") or {}).items()}
    named = {t for v in [*sections.values(), *summaries.values()] for t in v} | set(subject_mean) | set(assumed)
    stray = sorted(named - names)
    unknown_metric = sorted(set(metrics) - names)
    if stray or unknown_metric:
        raise UserError(f"task group {name}: sections/summaries/subject_mean/assumed/metrics name tasks that are not "
                        f"members: {', '.join(stray + unknown_metric)}")
    return Protocol(name, members, str(agg.get("name", "Avg")), rule, str(agg.get("note", "")).strip(), sections,
                    subject_mean, summaries, assumed)


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


def leaf_tasks(name: str, subtasks: dict[str, list[str]] | None) -> list[str]:
    """The leaf tasks under ``name`` in lm-eval's ``group_subtasks`` (``[name]`` for a task)."""
    kids = (subtasks or {}).get(name)
    return [leaf for k in kids for leaf in leaf_tasks(k, subtasks)] if kids else [name]


def _subject_mean(results: dict[str, dict[str, Any]], m: Member, subtasks: dict[str, list[str]] | None) -> float | None:
    """The unweighted mean of the metric over the member's leaf subtasks (None unless every one has it);
    a member whose subtasks are not known is read from its own row."""
    leaves = leaf_tasks(m.name, subtasks)
    if leaves == [m.name]:
        return score_of(results, m)
    vals = [score_of(results, Member(leaf, None, m.metric)) for leaf in leaves]
    return None if any(v is None for v in vals) else _mean(vals)  # type: ignore[arg-type]


def rows(agg: dict[str, Any]) -> dict[str, float | None]:
    """An aggregate record's reported numbers by row name: the aggregate (its paper name), each
    section's ``NAME AVG`` and each summary (``--compare``'s rows)."""
    out = {agg["name"]: agg.get("value")}
    out.update({f"{s} AVG": v for s, v in (agg.get("sections") or {}).items()})
    out.update(agg.get("summaries") or {})
    return out


def strata(agg: dict[str, Any], row: str, sizes: dict[str, int]) -> dict[str, tuple[str, float]] | None:
    """{leaf task: (metric, weight)}: row ``row`` of an aggregate record (``rows``) as a weighted sum of
    its leaf tasks' mean scores. A member's leaves weigh 1/leaves each (``subject_mean``) or their
    share of its examples (``sizes``; lm-eval's size-weighted group score); a summary weighs every
    subtask alike. None when no member it averages has a score."""
    leaves, metrics = agg.get("leaves") or {}, agg.get("metrics") or {}
    sections = {f"{s} AVG": ts for s, ts in (agg.get("section_members") or {}).items()}
    summaries = agg.get("summary_members") or {}
    if row in summaries:
        subs = [(leaf, metrics[m]) for m in summaries[row] for leaf in leaves.get(m) or [m]]
        return {leaf: (metric, 1 / len(subs)) for leaf, metric in subs} if subs else None
    scores = agg.get("scores") or {}
    present = [m for m in sections.get(row, list(scores)) if scores.get(m) is not None]  # what the value averages
    return _weights(present, leaves, metrics, agg, sizes) if present else None


def _weights(members: list[str], leaves: dict[str, list[str]], metrics: dict[str, str], agg: dict[str, Any],
             sizes: dict[str, int]) -> dict[str, tuple[str, float]]:
    out: dict[str, tuple[str, float]] = {}
    for m in members:
        ls = leaves.get(m) or [m]
        if m in (agg.get("subject_mean") or []) or len(ls) == 1:
            w = {leaf: 1 / len(ls) for leaf in ls}
        else:
            total = sum(sizes.get(leaf, 0) for leaf in ls) or 1
            w = {leaf: sizes.get(leaf, 0) / total for leaf in ls}
        out.update({leaf: (metrics[m], x / len(members)) for leaf, x in w.items()})
    return out


def aggregate(p: Protocol, results: dict[str, dict[str, Any]], subtasks: dict[str, list[str]] | None = None,
              ) -> dict[str, Any]:
    """The paper's aggregate over ``results`` ({task: {"metric,filter": value}}, lm-eval's rows;
    ``subtasks``: lm-eval's ``group_subtasks``): ``value`` by ``rule`` over the members that have a
    score, ``sections`` the same over each section, ``summaries`` (reported, not averaged in),
    ``missing`` the members without one (then the value is not the paper's number)."""
    scores = {m.name: _subject_mean(results, m, subtasks) if m.name in p.subject_mean else score_of(results, m)
              for m in p.members}
    have = {k: v for k, v in scores.items() if v is not None}
    sections = {s: _mean([have[t] for t in ts if t in have]) for s, ts in p.sections.items()}
    by_name = {m.name: m for m in p.members}
    summaries = {}
    for s, ts in p.summaries.items():
        vals = [_subject_mean(results, Member(leaf, None, by_name[t].metric), None)
                for t in ts for leaf in leaf_tasks(t, subtasks)]
        summaries[s] = None if any(v is None for v in vals) else _mean(vals)  # type: ignore[arg-type]
    missing = [k for k, v in scores.items() if v is None]
    line = f"{p.label} = {RULES[p.rule]} over {len(have)} of {len(p.members)} tasks"
    if missing:
        line += f" (missing: {', '.join(missing)})"
    if p.assumed:
        line += "; assumed: " + "; ".join(f"{k} ({v})" for k, v in p.assumed.items())
    return {"name": p.label, "rule": p.rule, "rule_text": line + (f"; {p.note}" if p.note else ""),
            "value": _mean(list(have.values())), "sections": sections, "summaries": summaries, "scores": scores,
            "missing": missing, "metrics": {m.name: m.metric for m in p.members}, "assumed": dict(p.assumed),
            "leaves": {m.name: leaf_tasks(m.name, subtasks) for m in p.members},
            "subject_mean": list(p.subject_mean), "section_members": dict(p.sections),
            "summary_members": dict(p.summaries)}

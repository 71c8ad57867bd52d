"""``ncpctl eval --compare``: several runs' eval results side by side, without re-evaluating.

Each target is a run directory, a checkpoint directory or a recipe (its ``run.dir``):

* a run directory: its newest results file ``RUN/eval/results_<tag>.json`` — the one with the
  highest step in its tag (``results_step_0000300.json``), ties and step-less tags broken by
  modification time;
* a checkpoint: the results of that checkpoint, ``RUN/eval/results_<checkpoint name>.json``
  (``CHECKPOINT/eval/`` for a checkpoint outside a run directory).

A target without results but with a checkpoint (a run directory's ``checkpoints/latest``) is
evaluated first, like ``ncpctl eval`` (results in its own ``eval/`` directory, so the next
comparison reuses them), on the tasks and held-out corpora recorded in the other targets'
results (their union; ``tasks``/``heldout`` given here win) with the first such target's limit
and few-shot; with no results anywhere, on its recipe's ``eval`` section. A target with neither
results nor a checkpoint is a user error naming it.

The table: one row per (task, metric) over the union of the runs' tasks (a run that lacks a
task has a blank and a note says so), each run's value and its delta to the first run
(``value - first``), then both perplexity averages of each run's ``perplexity`` entry
(``mean_of_sets``, ``token_weighted``; ``ncpctl.evaluate.run``), and a note with the rule each
run's average follows (which held-out sets, each in its unit). Written as
``compare_<labels>.json`` / ``.md`` / ``.png`` (bars per task, one bar per run, and the runs'
validation loss curves from ``metrics.jsonl``) into ``out`` (default: the first run's ``eval/``).

Exact log-likelihoods and bounds are not ranked silently: when the runs' results differ in
``likelihood`` kind (an autoregressive model's exact cross-entropy, a Causal Diffusion LM's ELBO
bound; ``ncpctl.evaluate.run``), the first note says which run reports which and that the deltas
of the perplexity rows and of every likelihood-based metric compare a bound with an exact value,
not one model with another; the validation curves say the same when one run's is its ELBO
(``diffusion_elbo``) and another's a cross-entropy. The table itself is kept.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, atomic_write_with

PPL_ROWS = (("mean_of_sets", "mean of per-set perplexities (paper's average)"),
            ("token_weighted", "token-weighted perplexity (tokens pooled)"))
# the validation curve: next-token loss (comparable across designs), a CDLM's held-out ELBO (its bound on the
# NLL per token), else the total
VAL_KEYS = ("ntp_loss", "diffusion_elbo", "loss")
BOUND_KEYS = ("diffusion_elbo",)  # validation keys that are bounds, not cross-entropies


@dataclass
class Entry:
    """One target of the comparison."""

    target: str
    eval_dir: Path
    run_dir: Path | None = None
    checkpoint: Path | None = None
    results_file: Path | None = None
    results: dict[str, Any] | None = None
    evaluated: bool = False  # evaluated by this comparison (no results before)
    exists: bool = True

    @property
    def res(self) -> dict[str, Any]:
        assert self.results is not None, f"{self.target}: results not read yet"
        return self.results

    @property
    def ppl(self) -> dict[str, Any]:
        return self.res.get("perplexity") or {}
    label: str = ""
    notes: list[str] = field(default_factory=list)
    examples: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # per-example scores read, by task


def _step(tag: str) -> int:
    m = re.search(r"step_(\d+)", tag)
    return int(m.group(1)) if m else -1


def newest_results(eval_dir: Path) -> Path | None:
    """The results file of the highest step (``results_step_NNNNNNN.json``), then the newest by mtime."""
    files = [f for f in eval_dir.glob("results_*.json") if f.is_file()]
    return max(files, key=lambda f: (_step(f.stem), f.stat().st_mtime_ns)) if files else None


def locate(target: str) -> Entry:
    """Where ``target``'s results and checkpoint are (nothing is evaluated or loaded here)."""
    from ncpctl.checkpoint import META, resolve, run_dir_of

    p = Path(target)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        from ncpctl.recipe import load_recipe

        p = load_recipe(p).run_dir
    if not p.exists():
        return Entry(target, p / "eval", exists=False)
    if (p / META).is_file():  # a checkpoint: the results of this one
        run = run_dir_of(p)
        e = Entry(target, (run or p) / "eval", run, p)
        f = e.eval_dir / f"results_{p.name}.json"
        e.results_file = f if f.is_file() else None
        return e
    e = Entry(target, p / "eval", p, results_file=newest_results(p / "eval"))
    try:
        e.checkpoint = resolve(p)
    except UserError:
        pass
    stale = e.results_file is not None and e.checkpoint is not None \
        and e.results_file.stem != f"results_{e.checkpoint.name}"
    if stale:
        e.notes.append(f"{e.results_file.name} is not for the newest checkpoint {e.checkpoint.name} "
                       f"(`ncpctl eval {target}` refreshes it)")
    return e


def _read(f: Path) -> dict[str, Any]:
    try:
        d = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{f}: unreadable eval results ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("results"), dict):
        raise UserError(f"{f}: not an ncpctl eval results file (no 'results')")
    return d


def _label(entries: list[Entry]) -> None:
    """Run directory names (checkpoint names outside a run); ``@<tag>`` added where two collide."""
    for e in entries:
        e.label = (e.run_dir or e.checkpoint or Path(e.target)).name
    for e in entries:
        if sum(o.label == e.label for o in entries) > 1 and e.results_file is not None:
            e.label = f"{e.label}@{e.results_file.stem.removeprefix('results_')}"
    seen: dict[str, int] = {}
    for e in entries:
        seen[e.label] = seen.get(e.label, 0) + 1
        if seen[e.label] > 1:
            e.label = f"{e.label}#{seen[e.label]}"


def _request(res: dict[str, Any]) -> dict[str, Any]:
    """What a results file was evaluated on (``request``; older files: their result tasks and limit)."""
    req = res.get("request")
    if isinstance(req, dict):
        return req
    from ncpctl.evaluate.run import metrics

    return {"tasks": list(metrics(res["results"])), "heldout": [], "limit": (res.get("config") or {}).get("limit"),
            "num_fewshot": None}


def _missing_request(have: list[Entry], tasks: list[str] | None, heldout: list[str] | None, limit: int | None,
                     num_fewshot: int | None) -> tuple[Any, Any, int | None, int | None, str]:
    """(tasks, held-out specs, limit, few-shot, where from) for targets without results."""
    reqs = [_request(e.res) for e in have]
    if not reqs:
        return tasks, heldout, limit, num_fewshot, "its recipe's eval section" if tasks is None else "--tasks"
    if tasks is None:
        tasks = list(dict.fromkeys(t for r in reqs for t in r.get("tasks") or []))
    if heldout is None:
        by_label = {h["label"]: h for r in reqs for h in r.get("heldout") or []}
        from ncpctl.recipe.schema import HeldoutSource

        heldout = [HeldoutSource.model_validate(h) for h in by_label.values()]
    limit = limit if limit is not None else reqs[0].get("limit")
    num_fewshot = num_fewshot if num_fewshot is not None else reqs[0].get("num_fewshot")
    return tasks, heldout, limit, num_fewshot, f"as {', '.join(e.label for e in have)}"


def _evaluate_missing(entries: list[Entry], tasks, heldout, limit, num_fewshot, batch_size,
                      log: Callable[[str], None], how: dict[str, Any]) -> None:
    from ncpctl.evaluate.run import evaluate, resolve_target

    todo = [e for e in entries if e.results is None]
    if not todo:
        return
    have = [e for e in entries if e.results is not None]
    tasks, heldout, limit, num_fewshot, why = _missing_request(have, tasks, heldout, limit, num_fewshot)
    like = _request(have[0].res) if have else {}  # the seeds and generation settings of the first that has results
    how = {**how, "seed": how.get("seed") or like.get("seed"),
           "gen_kwargs": how.get("gen_kwargs") if how.get("gen_kwargs") is not None else like.get("gen_kwargs")}
    for e in todo:
        t = resolve_target(str(e.checkpoint), [], tasks, batch_size, limit, num_fewshot, None, heldout=heldout, **how)
        names = [*t.tasks, *(h.label or h.path for h in t.heldout)]
        log(f"{e.label}: no eval results; evaluating {e.checkpoint} first on {', '.join(names)} "
            f"({why}), limit {t.limit}")
        summary = evaluate(t, log=log)
        e.results_file, e.evaluated = Path(summary["files"]["json"]), True
        e.results = _read(e.results_file)


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def table(entries: list[Entry]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """(rows, {label: tasks it lacks}). A row: section, task, metric, values/stderr/delta by label."""
    from ncpctl.evaluate.run import metrics

    per_run = [{"tasks": metrics(e.res["results"]), "groups": metrics(e.res.get("groups") or {})} for e in entries]
    keys: dict[tuple[str, str, str], None] = {}
    for m in per_run:
        for section in ("tasks", "groups"):
            for task, row in m[section].items():
                keys.update(((section, task, k), None) for k in row if not k.endswith("_stderr"))
    first = entries[0].label
    rows = []
    for section, task, metric in keys:
        vals = {e.label: _finite(m[section].get(task, {}).get(metric)) for e, m in zip(entries, per_run)}
        errs = {e.label: _finite(m[section].get(task, {}).get(metric + "_stderr")) for e, m in zip(entries, per_run)}
        rows.append(_row(section, task, metric, vals, first) | {"stderr": errs})
    for key, _ in PPL_ROWS:
        vals = {e.label: _finite(e.ppl.get(key)) for e in entries}
        rows.append(_row("perplexity", "perplexity sets", key, vals, first))
    rows += _aggregate_rows(entries, first)
    tasks_of = {e.label: set(m["tasks"]) | set(m["groups"]) for e, m in zip(entries, per_run)}
    union = list(dict.fromkeys(t for _, t, _ in keys))
    missing = {lab: [t for t in union if t not in have] for lab, have in tasks_of.items()}
    return rows, {lab: ts for lab, ts in missing.items() if ts}


def _aggregate_rows(entries: list[Entry], first: str) -> list[dict[str, Any]]:
    """The paper aggregates of the runs' results (``ncpctl.evaluate.protocol.rows``: the aggregate, its
    section AVGs and summaries), one row each, section ``aggregates``."""
    from ncpctl.evaluate.protocol import rows as agg_rows

    aggs = [e.res.get("aggregates") or {} for e in entries]
    out = []
    for group in dict.fromkeys(g for a in aggs for g in a):
        per_run = [agg_rows(a[group]) if group in a else {} for a in aggs]
        for name in dict.fromkeys(n for r in per_run for n in r):
            vals = {e.label: _finite(r.get(name)) for e, r in zip(entries, per_run)}
            out.append(_row("aggregates", group, name, vals, first))
    return out


def _row(section: str, task: str, metric: str, vals: dict[str, float | None], first: str) -> dict[str, Any]:
    base = vals[first]
    delta = {lab: (v - base if v is not None and base is not None else None) for lab, v in vals.items() if lab != first}
    return {"section": section, "task": task, "metric": metric, "values": vals, "delta": delta}


def val_curves(entries: list[Entry]) -> dict[str, dict[str, Any]]:
    """{label: {key, steps, values}} from each run's metrics.jsonl (``"split": "val"`` records)."""
    from ncpctl.train.metrics import read_metrics

    out = {}
    for e in entries:
        recs = [r for r in read_metrics(e.run_dir) if r.get("split") == "val"] if e.run_dir else []
        key = next((k for k in VAL_KEYS if any(_finite(r.get(k)) is not None for r in recs)), None)
        if key is None:
            continue
        pts = [(r["step"], float(r[key])) for r in recs if _finite(r.get(key)) is not None]
        out[e.label] = {"key": key, "steps": [s for s, _ in pts], "values": [v for _, v in pts]}
    return out


def compare(targets: list[str], *, tasks: list[str] | None = None, heldout: list[str] | None = None,
            limit: int | None = None, num_fewshot: int | None = None, batch_size: int | None = None,
            out: str | None = None, window: int = 200, log: Callable[[str], None] = lambda m: None,
            level: float = 0.95, resamples: int = 2000, how: dict[str, Any] | None = None) -> dict[str, Any]:
    """Locate (and where needed evaluate) each target's results, build the table, write the files.
    ``tasks``/``heldout``/``limit``/``num_fewshot``/``batch_size`` and ``how`` (``seed``, ``gen_kwargs``,
    ``log_samples``, ``cache`` of ``resolve_target``) only apply to targets evaluated here.
    A comma-separated target is an arm of seeds (``ncpctl.evaluate.compare_arms``; ``level``, ``resamples``)."""
    from ncpctl.evaluate import compare_arms, parallel

    if parallel.launched().world > 1:
        raise UserError("--compare runs in one process, not under a launcher",
                        hint="score each run under the launcher first (`ncpctl eval RUN`), then compare without it")
    split = compare_arms.split_arms(targets)
    targets, arm = split if split else (targets, None)
    if len(targets) < 2:
        raise UserError("--compare needs at least two runs or checkpoints")
    entries = [locate(t) for t in targets]
    bad = [f"{e.target}: " + (f"no eval results (no {e.eval_dir}/results_*.json) and no checkpoint to evaluate"
                              if e.exists else "no such run, checkpoint or recipe")
           for e in entries if e.results_file is None and e.checkpoint is None]
    if bad:
        raise UserError(*bad, hint="pass run directories or checkpoints that `ncpctl eval` has scored or can score")
    for e in entries:
        e.results = _read(e.results_file) if e.results_file is not None else None
    _label(entries)
    from ncpctl.evaluate.compare_curves import check_tokenizers, curve_stats, scale

    check_tokenizers([e.label for e in entries], [e.checkpoint for e in entries])
    if arm is not None:
        compare_arms.check_seeds_only(entries, arm)
    _evaluate_missing(entries, tasks, heldout, limit, num_fewshot, batch_size, log, how or {})
    rows, missing = table(entries)
    runs = [{"label": e.label, "target": e.target, "run_dir": _s(e.run_dir), "checkpoint": _s(e.checkpoint),
             "results_file": str(e.results_file), "evaluated": e.evaluated,
             "step": _step(e.results_file.stem) if e.results_file else None,
             "limit": _request(e.res).get("limit"),
             "perplexity_sets": sorted(e.ppl.get("averaged", e.ppl.get("per_set") or {})), **scale(e)}
            for e in entries]
    curves = val_curves(entries)
    notes = _notes(entries, runs, missing)
    if len({c["key"] in BOUND_KEYS for c in curves.values()}) > 1:
        notes.append("validation curves: " + ", ".join(
            f"{lab} {c['key']} ({'a bound' if c['key'] in BOUND_KEYS else 'cross-entropy'})" for lab, c in curves.items())
            + ": a bound is not comparable to a cross-entropy")
    payload = {"runs": runs, "baseline": entries[0].label, "rows": rows, "missing": missing,
               "notes": notes, "val_loss": curves,
               "curves": curve_stats(runs, [e.run_dir for e in entries], curves, window),
               "likelihood": {e.label: _kind(e) for e in entries},
               "arms": compare_arms.report(entries, arm, rows, level, resamples) if arm is not None else None}
    payload["files"] = write(payload, Path(out) if out else entries[0].eval_dir, log)
    return payload


def _notes(entries: list[Entry], runs: list[dict[str, Any]], missing: dict[str, list[str]]) -> list[str]:
    """What a reader of the table must know: stale or fresh results, blanks, unequal set-ups."""
    from ncpctl.evaluate.settings import differences

    from ncpctl.evaluate.compare_curves import scale_note

    notes = _kind_notes(entries) + scale_note(runs)
    notes += [f"{e.label}: {n}" for e in entries for n in e.notes]
    notes += [f"{e.label}: evaluated now (it had no results)" for e in entries if e.evaluated]
    notes += [f"{lab}: no {', '.join(ts)} (blank in the table: the runs were evaluated on different tasks)"
              for lab, ts in missing.items()]
    notes += differences([e.label for e in entries], [e.res for e in entries])  # shots, limits, seeds, ...
    if len({tuple(r["perplexity_sets"]) for r in runs}) > 1:
        notes.append("the perplexity averages are over different sets: "
                     + "; ".join(f"{r['label']}: {', '.join(r['perplexity_sets']) or 'none'}" for r in runs))
    rules = {e.label: _rule(e.ppl) for e in entries if e.ppl}
    if len(set(rules.values())) == 1:
        notes.append(f"perplexity averages: {next(iter(rules.values()))}")
    else:
        notes += [f"{lab}: {rule}" for lab, rule in rules.items()]
    return notes


def _kind(e: Entry) -> dict[str, Any]:
    return e.res.get("likelihood") or {"kind": "exact"}  # results written before it recorded one: exact


def _kind_notes(entries: list[Entry]) -> list[str]:
    """The note that keeps a bound from being ranked against an exact log-likelihood."""
    kinds = {e.label: _kind(e) for e in entries}
    if len({k.get("kind") for k in kinds.values()}) < 2:
        return []
    said = "; ".join(f"{lab}: " + ("exact cross-entropy" if k.get("kind") != "bound" else
                                   f"an ELBO bound ({k.get('samples')} Monte Carlo samples)")
                     for lab, k in kinds.items())
    return [f"NOT A RANKING: the log-likelihoods differ in kind ({said}); a bound over-states the NLL and the "
            "perplexity, so the perplexity rows, the likelihood-based metrics and their deltas compare a bound "
            "with an exact value, not the models"]


def _rule(ppl: dict[str, Any]) -> str:
    """A run's averaging rule with each set's unit (``ncpctl.evaluate.run.perplexity_summary``);
    results written before it recorded one: the sets its mean took, with their lm-eval metrics."""
    if ppl.get("rule"):
        return ppl["rule"]
    sets = ppl.get("per_set") or {}
    terms = " + ".join(f"{k} [{v.get('metric')}]" for k, v in sets.items())
    return f"mean_of_sets = ({terms}) / {len(sets)}"


def _s(p: Path | None) -> str | None:
    return None if p is None else str(p)


# ---- output ------------------------------------------------------------------------------


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _fmt(v: float | None, signed: bool = False) -> str:
    return "" if v is None else (f"{v:+.4f}" if signed else f"{v:.4f}")


def _has_stderr(payload: dict[str, Any], label: str) -> bool:
    return any((row.get("stderr") or {}).get(label) is not None for row in payload["rows"])


def columns(payload: dict[str, Any]) -> list[str]:
    """task, metric, then per run its value, its ± stderr (where any row has one) and, after the
    first, its Δ to the first."""
    labels = [r["label"] for r in payload["runs"]]
    out = ["task", "metric"]
    for i, lab in enumerate(labels):
        out += [lab, *(["±"] if _has_stderr(payload, lab) else []), *([f"Δ {lab}"] if i else [])]
    return out


def cells(payload: dict[str, Any], row: dict[str, Any]) -> list[str]:
    labels = [r["label"] for r in payload["runs"]]
    out = [row["task"], row["metric"]]
    for i, lab in enumerate(labels):
        out.append(_fmt(row["values"][lab]))
        if _has_stderr(payload, lab):
            out.append(_fmt((row.get("stderr") or {}).get(lab)))
        if i:
            out.append(_fmt(row["delta"][lab], signed=True))
    return out


def _shown(path: Any) -> str:
    """A results file as a report names it: relative to the working directory when inside it (a
    table pasted into a document must not carry the machine's absolute paths), else as given."""
    import os

    p = os.path.abspath(str(path))
    rel = os.path.relpath(p)
    return str(path) if rel.startswith("..") else rel


def markdown(payload: dict[str, Any]) -> str:
    from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT

    cols = columns(payload)
    lines = ["# Comparison", "", f"| run | results | limit | evaluated now | tokens | parameters | training FLOPs "
             f"({FLOP_CONVENTION_SHORT}) |",
             "|---|---|---|---|---:|---:|---:|"]
    g = lambda r, k, f: "" if r.get(k) is None else format(r[k], f)  # noqa: E731
    lines += [f"| {r['label']} | {_shown(r['results_file'])} | {r['limit']} | {'yes' if r['evaluated'] else 'no'} | "
              f"{g(r, 'tokens', ',')} | {g(r, 'parameters', ',')} | {g(r, 'training_flops', '.3g')} |"
              for r in payload["runs"]]
    lines += ["", f"Δ = value - {payload['baseline']}'s value.", "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * 2 + "---:|" * (len(cols) - 2)]
    lines += ["| " + " | ".join(cells(payload, row)) + " |" for row in payload["rows"]]
    from ncpctl.evaluate.compare_curves import lines as curve_lines

    if payload.get("curves"):
        lines += ["", "Training curves:", "", *(f"- {n}" for n in curve_lines(payload["curves"], payload["baseline"]))]
    if payload.get("arms"):
        from ncpctl.evaluate.compare_arms import lines as arm_lines

        lines += ["", "Seed arms (mean ± std over seeds; paired bootstrap over examples):", "",
                  *(f"- {n}" for n in arm_lines(payload["arms"]))]
    if payload["notes"]:
        lines += ["", "Notes:", "", *(f"- {n}" for n in payload["notes"])]
    return "\n".join(lines) + "\n"


def rich_table(payload: dict[str, Any]):
    from rich.table import Table
    from rich.text import Text

    cols = columns(payload)
    caption = "\n".join(_curve_text(payload) + payload["notes"])  # Text: a rule's [token perplexity] is not markup
    table = Table(title=f"eval comparison (Δ to {payload['baseline']})", title_justify="left",
                  caption=Text(caption) if caption else None, caption_justify="left")
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i < 2 else "right")
    section = None
    for row in payload["rows"]:
        if section is not None and row["section"] != section:
            table.add_section()
        section = row["section"]
        table.add_row(*cells(payload, row))
    return table


def _curve_text(payload: dict[str, Any]) -> list[str]:
    from ncpctl.evaluate.compare_arms import lines as arm_lines
    from ncpctl.evaluate.compare_curves import lines as curve_lines

    return (curve_lines(payload["curves"], payload["baseline"]) if payload.get("curves") else []) + \
        (arm_lines(payload["arms"]) if payload.get("arms") else [])


def _stem(payload: dict[str, Any]) -> str:
    others = "_".join(r["label"] for r in payload["runs"][1:])
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", others).strip("_")[:80]
    return f"compare_{slug or 'runs'}"


def write(payload: dict[str, Any], out: Path, log: Callable[[str], None]) -> dict[str, str | None]:
    out.mkdir(parents=True, exist_ok=True)
    stem = _stem(payload)
    files = {"json": str(out / f"{stem}.json"), "markdown": str(out / f"{stem}.md"), "png": None}
    if plot(payload, out / f"{stem}.png", log):
        files["png"] = str(out / f"{stem}.png")
    atomic_write(Path(files["markdown"]), markdown(payload))
    atomic_write(Path(files["json"]), json.dumps({**payload, "files": files}, indent=2) + "\n")
    return files


def plot(payload: dict[str, Any], path: Path, log: Callable[[str], None]) -> bool:
    """Bars per task (its first metric; one bar per run), both perplexity averages, and the
    validation loss curves. False (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install 'ncpctl[plots]'): no PNG")
        return False
    labels = [r["label"] for r in payload["runs"]]
    primary: dict[tuple[str, str], dict[str, Any]] = {}  # each task's first metric
    for r in payload["rows"]:
        if r["section"] != "perplexity":
            primary.setdefault((r["section"], r["task"]), r)
    panels = [(f"{r['task']}\n{r['metric']}", [r]) for r in primary.values()]
    panels.append(("perplexity averages", [r for r in payload["rows"] if r["section"] == "perplexity"]))
    n = len(panels) + 1
    cols = min(n, 4)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(3.6 * cols, 3.0 * math.ceil(n / cols)),
                             squeeze=False)
    flat = [ax for line in axes for ax in line]
    colors = [f"C{i % 10}" for i in range(len(labels))]
    for ax, (title, rows) in zip(flat, panels):
        width = 0.8 / len(labels)
        for i, lab in enumerate(labels):
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(rows))]
            bars = ax.bar(xs, [_nan(r["values"][lab]) for r in rows], width, color=colors[i], label=lab)
            ax.bar_label(bars, fmt="%.4g", fontsize=6)
        ax.set_xticks(range(len(rows)), [r["metric"] if len(rows) > 1 else "" for r in rows], fontsize=7)
        ax.set_title(title, fontsize=8)
    ax = flat[len(panels)]
    for i, lab in enumerate(labels):
        c = payload["val_loss"].get(lab)
        if c:
            ax.plot(c["steps"], c["values"], "o-", ms=3, color=colors[i], label=f"{lab} ({c['key']})")
    ax.set_title("validation loss (metrics.jsonl)" if payload["val_loss"] else "no validation records", fontsize=8)
    ax.set_xlabel("step", fontsize=7)
    for extra in flat[n:]:
        extra.axis("off")
    flat[0].legend(fontsize=7)
    if payload["val_loss"]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return True

"""Seed arms in ``ncpctl eval --compare`` (issue 26 item 4): ``--compare A1,A2,A3 B1,B2,B3`` compares
arms of runs that differ only by seed (ConceptLM's 8B gains are +0.1 to +0.4 points, which one seed
cannot separate from noise).

* An arm is one comma-separated TARGET; its runs must have equal resolved recipes except ``run.*``
  and ``train.seed`` (read from the evaluated checkpoints' ``ncpctl.json``); a run that differs in
  more is one error line naming the keys.
* Per (task, metric): each arm's mean ± sample standard deviation over its seeds
  (``uncertainty.seeds``), and for every arm after the first its difference to the first arm with a
  paired bootstrap over examples (``uncertainty.paired_bootstrap``): an example's score in an arm
  is its mean over the arm's seeds, the examples are those every run scored (lm-eval's ``doc_id``;
  ``ncpctl eval`` writes the per-example scores as ``per_example`` in its results), resampled
  ``resamples`` times with a fixed seed (0), the percentile interval at ``level``. The interval is
  over examples: it says whether the test set separates the arms' seed-averaged models, not how a
  new seed would land (that is the ± of each arm). The per-example scores come from each run's
  logged samples (``--log-samples``: ``samples_<tag>/<task>.jsonl``), else its results' ``per_example``.
* A paper aggregate ("Avg", the number behind ConceptLM's +0.1/+0.4; its section AVGs and summaries) is
  bootstrapped stratified (``uncertainty.stratified_bootstrap``): the examples of each leaf task are
  resampled within it, and the aggregate rebuilt as the protocol builds it from the task means
  (``protocol.strata``).
* The p-value is an approximation (the bootstrap's; ``uncertainty``), and printed as one.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ncpctl.checkpoint import CHECKPOINTS, META, read_meta
from ncpctl.errors import UserError
from ncpctl.evaluate.protocol import strata
from ncpctl.evaluate.samples import per_example_of
from ncpctl.evaluate.uncertainty import paired_bootstrap, seeds, stratified_bootstrap

FREE_KEYS = ("run.", "train.seed")  # what runs of one arm may differ in
BOOTSTRAP_SEED = 0


def split_arms(targets: Sequence[str]) -> tuple[list[str], list[int]] | None:
    """(flat targets, arm index of each) when any TARGET is a comma-separated arm, else None."""
    if not any("," in t for t in targets):
        return None
    flat, arm = [], []
    for i, t in enumerate(targets):
        runs = [x.strip() for x in t.split(",") if x.strip()]
        flat += runs
        arm += [i] * len(runs)
    return flat, arm


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _recipe(e: Any) -> dict[str, Any] | None:
    """The resolved recipe the evaluated checkpoint of entry ``e`` (``compare.Entry``) carries."""
    ck = e.checkpoint
    if e.results_file is not None and e.run_dir is not None:
        named = e.run_dir / CHECKPOINTS / e.results_file.stem.removeprefix("results_")
        ck = named if (named / META).is_file() else ck
    if ck is None or not (ck / META).is_file():
        return None
    return read_meta(ck).get("recipe") or None


def check_seeds_only(entries: list[Any], arm: list[int]) -> None:
    """Every run of an arm has the first run's recipe except run.* and train.seed; else one line
    per offending run naming the keys."""
    problems = []
    for i in sorted(set(arm)):
        members = [e for e, a in zip(entries, arm) if a == i]
        trees = [_recipe(e) for e in members]
        missing = [e.label for e, t in zip(members, trees) if t is None]
        if missing:
            problems.append(f"arm {i + 1}: {', '.join(missing)}: no recorded recipe, cannot check that the "
                            "runs differ only by seed")
            continue
        first = _flat(trees[0])
        for e, t in zip(members[1:], trees[1:]):
            other = _flat(t)
            diff = sorted(k for k in set(first) | set(other)
                          if first.get(k) != other.get(k) and not k.startswith(FREE_KEYS))
            if diff:
                shown = ", ".join(f"{k} ({first.get(k)!r} vs {other.get(k)!r})" for k in diff[:6])
                problems.append(f"arm {i + 1}: {e.label} differs from {members[0].label} in more than the seed: "
                                f"{shown}{' ...' if len(diff) > 6 else ''}")
    if problems:
        raise UserError(*problems, hint="an arm is the same recipe under different train.seed values")


def _per_example(e: Any, task: str, metric: str) -> dict[int, float] | None:
    read = getattr(e, "examples", {})  # compare.Entry keeps what it read: a samples file is read once per run
    if task not in read:
        read[task] = per_example_of(e.res, getattr(e, "results_file", None), task)
    pe = read[task]
    if metric not in pe:
        return None
    return {int(d): float(v) for d, v in zip(pe["doc_id"], pe[metric]) if v is not None}


def _example_key(metric: str) -> str:
    """An lm-eval result key (``acc,none``, ``exact_match,flexible-extract``) as a per-example score's name."""
    name, _, flt = metric.partition(",")
    return name if flt in ("", "none", "first_identifier") else f"{name}[{flt}]"


def _aggregate_diff(base: list[Any], other: list[Any], group: str, row: str, level: float, resamples: int,
                    d: dict[str, Any]) -> dict[str, Any]:
    """The stratified paired bootstrap of an aggregate row (None where a leaf has no per-example scores)."""
    agg = (base[0].res.get("aggregates") or {}).get(group)
    if not agg:
        return {**d, "bootstrap": None}
    counts = base[0].res.get("n-samples") or {}  # a size-weighted group weighs its leaves by their examples
    sizes = {leaf: int((counts.get(leaf) or {}).get("effective") or 0) for ls in agg.get("leaves", {}).values()
             for leaf in ls}
    weights = strata(agg, row, sizes)
    if not weights:
        return {**d, "bootstrap": None}
    parts = []
    for leaf, (metric, w) in weights.items():
        pair = _paired(base, other, leaf, _example_key(metric))
        if pair is None:
            return {**d, "bootstrap": None}
        parts.append((*pair, w))
    return {**d, "bootstrap": stratified_bootstrap(parts, iters=resamples, level=level, seed=BOOTSTRAP_SEED)}


def report(entries: list[Any], arm: list[int], rows: list[dict[str, Any]], level: float = 0.95,
           resamples: int = 2000) -> dict[str, Any]:
    """{"arms": [{label, runs}], "rows": [{task, metric, arms: [{mean, std, n}], diff: [...]}], level,
    resamples, seed}; ``rows``: the comparison's rows (``compare.table``), by run label."""
    n_arms = max(arm) + 1
    members = [[e for e, a in zip(entries, arm) if a == i] for i in range(n_arms)]
    out_rows = []
    for row in rows:
        if row["section"] == "perplexity":
            continue
        stats = []
        for runs in members:
            vals = [row["values"].get(e.label) for e in runs]
            vals = [v for v in vals if v is not None]
            st = seeds(vals) if vals else {"mean": None, "std": None, "n": 0}
            if st["std"] is not None and math.isnan(st["std"]):  # one run: no spread (null in the JSON, not NaN)
                st["std"] = None
            stats.append(st)
        diffs = [_diff(members[0], runs, row["section"], row["task"], row["metric"], stats[0], s, level, resamples,
                       paired_bootstrap) for runs, s in zip(members[1:], stats[1:])]
        out_rows.append({"section": row["section"], "task": row["task"], "metric": row["metric"],
                         "arms": stats, "diff": diffs})
    return {"arms": [{"label": f"arm {i + 1}", "runs": [e.label for e in runs]} for i, runs in enumerate(members)],
            "rows": out_rows, "level": level, "resamples": resamples, "seed": BOOTSTRAP_SEED}


def _diff(base: list[Any], other: list[Any], section: str, task: str, metric: str, sa: dict[str, Any],
          sb: dict[str, Any], level: float, resamples: int, paired_bootstrap: Any) -> dict[str, Any]:
    """Arm ``other`` minus arm ``base``: the difference of their means, and the paired bootstrap on
    the per-example scores averaged over each arm's seeds (None where a run has no per-example scores)."""
    d: dict[str, Any] = {"mean_diff": None if sa["mean"] is None or sb["mean"] is None else sb["mean"] - sa["mean"]}
    if section == "aggregates":
        return _aggregate_diff(base, other, task, metric, level, resamples, d)
    pair = _paired(base, other, task, metric)
    if pair is None or len(pair[0]) < 2:
        return {**d, "bootstrap": None}
    return {**d, "bootstrap": paired_bootstrap(*pair, iters=resamples, level=level, seed=BOOTSTRAP_SEED)}


def _paired(base: list[Any], other: list[Any], task: str, metric: str) -> tuple[list[float], list[float]] | None:
    """Each arm's per-example scores (mean over its seeds) on the examples every run scored; None
    where a run has none."""
    per = [[_per_example(e, task, metric) for e in runs] for runs in (base, other)]
    if any(p is None for arm in per for p in arm):
        return None
    common = sorted(set.intersection(*(set(p) for arm in per for p in arm)))
    if not common:
        return None
    a, b = ([sum(p[i] for p in arm) / len(arm) for i in common] for arm in per)
    return a, b


def _fmt(v: float | None, signed: bool = False) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, "+.4f" if signed else ".4f")


def lines(arms: dict[str, Any]) -> list[str]:
    """One line per (task, metric): each arm's mean ± std (n seeds), each later arm's difference with
    its bootstrap interval."""
    pct = f"{100 * arms['level']:g}%"
    out = [f"{a['label']}: {', '.join(a['runs'])}" for a in arms["arms"]]
    for row in arms["rows"]:
        parts = [f"{a['label']} {_fmt(s['mean'])} ± {_fmt(s['std'])} (n={s['n']})" for a, s in zip(arms["arms"], row["arms"])]
        for a, d in zip(arms["arms"][1:], row["diff"]):
            text = f"{a['label']} - {arms['arms'][0]['label']} {_fmt(d['mean_diff'], True)}"
            bs = d.get("bootstrap")
            over = f"{bs['n']} examples" + (f" in {bs['strata']} tasks, stratified" if bs and "strata" in bs else "")
            text += (f", paired bootstrap over {over} {_fmt(bs['diff'], True)} [{pct}: {_fmt(bs['low'], True)}, "
                     f"{_fmt(bs['high'], True)}], p ≈ {bs['p']:.3f} (approximate)") if bs else \
                " (no per-example scores: no interval)"
            parts.append(text)
        out.append(f"{row['task']} {row['metric']}: " + "; ".join(parts))
    out.append(f"bootstrap: {arms['resamples']} resamples of the examples, seed {arms['seed']}, percentile interval; "
               "an example's score in an arm is its mean over the arm's seeds (the interval is over examples, the ± over "
               "seeds: with few seeds read both); an aggregate resamples each task's examples within the task and "
               "takes the mean of task means as its protocol does; p ≈: the bootstrap's approximate two-sided "
               "p-value (coarse below about 1/resamples)")
    return out

"""Capability proxies (NCP-ArchPreview App. C, Table 11, Fig. 9): ``ncpctl eval --proxy SPEC.jsonl``.

A proxy set is JSONL, one item per line: ``prompt``, ``suffix`` (the expert continuation),
``source`` and ``capability``; an item may also carry ``choices`` (endings) and ``label`` (the
index of the correct one, whose text is the suffix) for the multiple-choice margin.

* NLL: the teacher-forced mean negative log-likelihood per suffix token of each item (nats, the
  checkpoint's tokenizer), averaged per source, then the sources' means averaged per capability
  (the two-level rule of Eq. 28: a big source does not outweigh a small one by its item count;
  duplicating a source's items changes nothing). ``overall`` is the mean of the capabilities.
* margin: for items with choices, the character-normalised log-likelihood (sum log p / len in
  characters, lm-eval's acc_norm normalisation) of the correct ending minus that of the strongest
  distractor; > 0 means the model prefers the right ending. Averaged by the same two-level rule.
* ``correlate``: a proxy against a downstream score over several checkpoints (Fig. 9: x = -NLL):
  least-squares slope and intercept, R², and Spearman's rank correlation.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ncpctl.checkpoint import resolve, run_dir_of
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write

FIELDS = ("prompt", "suffix", "source", "capability")
# (context, continuation) pairs -> [(sum log p(continuation), continuation tokens)]
Scorer = Callable[[list[tuple[str, str]]], list[tuple[float, int]]]


@dataclass(frozen=True)
class Item:
    prompt: str
    suffix: str
    source: str
    capability: str
    choices: tuple[str, ...] = ()
    label: int | None = None


def jsonl_records(path: Path) -> tuple[list[tuple[int, Any]], list[str]]:
    """(line number, parsed value) of each non-blank line of a JSONL file, and one problem line
    per line that is not JSON (``path:line: not JSON (...)``): the task and proxy files' reader."""
    records, bad = [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            bad.append(f"{path}:{i}: not JSON ({e.msg})")
    return records, bad


def read_spec(path: str | Path) -> list[Item]:
    """The items of a proxy file; every bad line is reported at once, one line each (exit 2)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such proxy file", hint="a JSONL of {prompt, suffix, source, capability}")
    items: list[Item] = []
    records, bad = jsonl_records(p)
    for i, d in records:
        miss = [k for k in FIELDS if not isinstance(d.get(k), str) or (k != "prompt" and not d[k])] \
            if isinstance(d, dict) else list(FIELDS)
        if miss:
            bad.append(f"{p}:{i}: missing field {', '.join(miss)}")
            continue
        choices, label = d.get("choices"), d.get("label")
        if choices is not None and not (isinstance(choices, list) and len(choices) >= 2
                                        and all(isinstance(c, str) and c for c in choices)
                                        and isinstance(label, int) and 0 <= label < len(choices)
                                        and choices[label] == d["suffix"]):
            bad.append(f"{p}:{i}: choices must be >= 2 non-empty strings with label the index of the suffix")
            continue
        items.append(Item(d["prompt"], d["suffix"], d["source"], d["capability"], tuple(choices or ()), label))
    if bad:
        raise UserError(*bad, hint="each line: {prompt, suffix, source, capability[, choices, label]}")
    if not items:
        raise UserError(f"{p}: no items")
    return items


def two_level(values: Sequence[tuple[str, str, float]]) -> dict[str, Any]:
    """(capability, source, value) -> per source mean, then per capability mean of its sources,
    then ``overall`` = mean of the capabilities."""
    by_src: dict[tuple[str, str], list[float]] = defaultdict(list)
    for cap, src, v in values:
        by_src[(cap, src)].append(v)
    sources = {k: sum(v) / len(v) for k, v in by_src.items()}
    by_cap: dict[str, list[float]] = defaultdict(list)
    for (cap, _), v in sources.items():
        by_cap[cap].append(v)
    caps = {c: sum(v) / len(v) for c, v in sorted(by_cap.items())}
    return {"capabilities": caps, "overall": sum(caps.values()) / len(caps) if caps else None,
            "sources": {f"{c}/{s}": {"value": v, "items": len(by_src[(c, s)])} for (c, s), v in sorted(sources.items())}}


def margin(logliks: Sequence[float], choices: Sequence[str], label: int) -> float:
    """Character-normalised log-likelihood of the correct ending minus the strongest distractor's."""
    norm = [ll / len(c) for ll, c in zip(logliks, choices)]
    return norm[label] - max(v for j, v in enumerate(norm) if j != label)


def score(items: list[Item], scorer: Scorer) -> dict[str, Any]:
    """The proxy report: NLL by the two-level rule; margin by the same rule over items with choices."""
    pairs = [(it.prompt, it.suffix) for it in items]
    mc = [(i, j) for i, it in enumerate(items) for j in range(len(it.choices))]
    out = scorer(pairs + [(items[i].prompt, items[i].choices[j]) for i, j in mc])
    nll = []
    for it, (ll, n) in zip(items, out):
        if n <= 0:
            raise UserError(f"proxy item of {it.source}: its suffix tokenizes to no token")
        nll.append((it.capability, it.source, -ll / n))
    lls: dict[int, list[float]] = defaultdict(list)
    for (i, _), (ll, _) in zip(mc, out[len(items):]):
        lls[i].append(ll)
    margins = [(items[i].capability, items[i].source, margin(v, items[i].choices, items[i].label))
               for i, v in lls.items()]
    return {"nll": two_level(nll), "margin": two_level(margins) if margins else None,
            "items": len(items), "mc_items": len(margins),
            "rule": "mean suffix NLL per token (nats) per item -> mean per source -> mean of sources per capability; "
                    "margin: char-normalised log-lik of the correct ending minus the strongest distractor's, same rule"}


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def correlate(proxy: Sequence[float], downstream: Sequence[float]) -> dict[str, float]:
    """Least squares downstream = slope * proxy + intercept over checkpoints, its R², and Spearman's
    rho (rank agreement). Fig. 9 uses x = -NLL, so that higher is better on both axes."""
    if len(proxy) != len(downstream) or len(proxy) < 2:
        raise UserError(f"a correlation needs two or more checkpoints with both scores (got {len(proxy)})")
    x, y = list(map(float, proxy)), list(map(float, downstream))
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else float("nan")
    r = _pearson(x, y)
    return {"slope": slope, "intercept": my - slope * mx, "r2": r * r, "spearman": _pearson(_ranks(x), _ranks(y)),
            "n": len(x)}


def lm_scorer(lm: Any) -> Scorer:
    """A Scorer from an ``NCPLM``: its own request encoding, one request per pair; the continuation
    token count from its per-request accounting."""
    class _Req:
        def __init__(self, args: tuple[str, str], name: str):
            self.args, self.task_name = args, name

    def run(pairs: list[tuple[str, str]]) -> list[tuple[float, int]]:
        reqs = [_Req(p, f"proxy:{i}") for i, p in enumerate(pairs)]
        out = lm.loglikelihood(reqs, disable_tqdm=True)
        return [(ll, int(lm.token_stats.pop(r.task_name)["tokens"])) for (ll, _), r in zip(out, reqs)]

    return run


def _downstream(dirs: list[Path], tag: str, against: str) -> float | None:
    """``TASK:METRIC`` (``METRIC`` as lm-eval keys it, ``acc`` -> ``acc,none``) from the checkpoint's
    results_<tag>.json of an earlier ``ncpctl eval``, the first found in ``dirs`` (``--out``, then the
    checkpoint's own eval dir, where ``ncpctl eval`` writes it); None when it has none."""
    task, _, metric = against.partition(":")
    f = next((d / f"results_{tag}.json" for d in dirs if (d / f"results_{tag}.json").is_file()), None)
    if f is None:
        return None
    res = json.loads(f.read_text())
    row = {**res.get("results", {}), **res.get("groups", {})}.get(task) or {}
    v = row.get(metric if "," in metric else f"{metric},none")
    return float(v) if isinstance(v, (int, float)) else None


def evaluate_proxy(targets: list[str], spec: str, against: str | None = None, out: str | None = None,
                   batch_size: int = 8, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Score each checkpoint on the proxy set; write ``proxy_<tag>.json`` to its eval dir (or ``out``);
    with several checkpoints and ``against`` (``TASK:METRIC``), the correlation of each capability's
    -NLL (and the margin) with that downstream score over the checkpoints that have one."""
    from ncpctl.evaluate.lm import NCPLM

    if against is not None and ":" not in against:
        raise UserError(f"--against {against!r}: expected TASK:METRIC, e.g. hellaswag:acc_norm")
    items = read_spec(spec)  # before any model loads: a bad file is one line per problem
    per = {}
    for target in targets:
        ck = resolve(Path(target))
        out_dir = Path(out) if out else (run_dir_of(ck) or ck) / "eval"
        log(f"proxy {spec} on {ck} ({len(items)} items)")
        lm = NCPLM(str(ck), batch_size=batch_size)
        rep = score(items, lm_scorer(lm))
        # a Causal Diffusion LM's log-likelihoods are ELBO bounds: its NLLs are upper bounds
        rep.update(checkpoint=str(ck), spec=str(spec), likelihood=lm.likelihood)
        if against:
            own = (run_dir_of(ck) or ck) / "eval"
            rep["downstream"] = {"score": against, "value": _downstream([out_dir, own], ck.name, against)}
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / f"proxy_{ck.name}.json", json.dumps(rep, indent=2) + "\n")
        rep["file"] = str(out_dir / f"proxy_{ck.name}.json")
        per[str(ck)] = rep
    payload: dict[str, Any] = {"spec": str(spec), "per_checkpoint": per}
    if against and len(per) > 1:
        have = [r for r in per.values() if r["downstream"]["value"] is not None]
        y = [r["downstream"]["value"] for r in have]
        caps = sorted({c for r in have for c in r["nll"]["capabilities"]})
        views = {f"-NLL {c}": [-r["nll"]["capabilities"][c] for r in have] for c in caps}
        if all(r["margin"] for r in have):
            views["margin"] = [r["margin"]["overall"] for r in have]
        payload["correlation"] = {"against": against, "n_checkpoints": len(have),
                                  **({k: correlate(x, y) for k, x in views.items()} if len(have) > 1 else {})}
    return payload


def rich_tables(payload: dict[str, Any]) -> list[Any]:
    """One table of capability NLLs and margins per checkpoint (columns), and the correlation view."""
    from rich.table import Table

    reps = payload["per_checkpoint"]
    t = Table(title=f"capability proxies: {payload['spec']}", title_justify="left")
    t.add_column("proxy")
    for ck in reps:
        run = run_dir_of(Path(ck))  # RUN/checkpoints/step_N -> "RUN/step_N"
        t.add_column(f"{run.name}/{Path(ck).name}" if run is not None else Path(ck).name, justify="right")
    first = next(iter(reps.values()))
    for c in first["nll"]["capabilities"]:
        t.add_row(f"{c} NLL ↓", *(f"{r['nll']['capabilities'].get(c, float('nan')):.4f}" for r in reps.values()))
    t.add_row("overall NLL ↓ (mean of capabilities)", *(f"{r['nll']['overall']:.4f}" for r in reps.values()))
    if first["margin"]:
        t.add_row("margin ↑ (char-normalised)", *(f"{r['margin']['overall']:.4f}" for r in reps.values()))
    for r in reps.values():
        if "downstream" in r:
            t.add_row(f"downstream {r['downstream']['score']}", *(
                "" if x["downstream"]["value"] is None else f"{x['downstream']['value']:.4f}" for x in reps.values()))
            break
    t.caption, t.caption_justify = first["rule"], "left"
    out = [t]
    corr = payload.get("correlation") or {}
    if len(corr) > 2:
        c = Table(title=f"proxy vs {corr['against']} over {corr['n_checkpoints']} checkpoints", title_justify="left")
        for col in ("proxy (x)", "slope", "R²", "Spearman"):
            c.add_column(col, justify="left" if col.startswith("proxy") else "right")
        for k, v in corr.items():
            if isinstance(v, dict):
                c.add_row(k, f"{v['slope']:.4g}", f"{v['r2']:.3f}", f"{v['spearman']:.3f}")
        out.append(c)
    return out

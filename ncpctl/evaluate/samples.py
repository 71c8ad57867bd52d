"""Logged samples (``ncpctl eval --log-samples``, lm-eval's ``--log_samples``; issue 47 item 1).

One JSONL file per task beside the results, ``eval/samples_<tag>/<task>.jsonl``, one line per
example and filter::

    {"doc_id": 3, "filter": "none", "prompt": "...", "prompt_hash": "9c1e...", "prompt_chars": 812,
     "response": " return x", "target": "x", "scores": {"exact_match": 0.0}}

* ``prompt``: the context the model saw (few-shot examples included); over ``PROMPT_CHARS``
  characters only its sha256 (``prompt_hash``) and length (``prompt_chars``) are kept, and the same
  for a ``target`` that long (``target_hash``, ``target_chars``: a perplexity task's document).
* ``response``: a generation task's (filtered) answer; a multiple-choice task's chosen option
  (the highest log-likelihood) with ``choice`` (its index) and ``loglikelihoods`` (one per option);
  a log-likelihood task's ``[log-likelihood, is greedy]``; a perplexity task's log-likelihood.
* ``scores``: every metric lm-eval computed for the example (a perplexity's ``[log-likelihood,
  weight]`` pair as it aggregates it).

The results JSON names the files (``samples``: task -> path relative to the results file), and
``ncpctl eval --compare`` and its seed arms read the per-example scores from them
(``per_example_of``); results written without ``--log-samples`` keep their numeric per-example
scores in the JSON itself (``per_example``), which is read the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable

from ncpctl.fsutil import atomic_write

PROMPT_CHARS = 8192  # a longer prompt is logged as its hash and length


def _key(metric: str, flt: str) -> str:
    """A per-example score's name, as ``ncpctl.evaluate.run.metrics`` names the aggregate."""
    return metric if flt in ("none", "first_identifier") else f"{metric}[{flt}]"


def _plain(v: Any) -> Any:
    """JSON for a score or response: tuples as lists, NaN/inf as null, anything else as its text."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    try:
        return _plain(float(v))  # numpy scalars
    except (TypeError, ValueError):
        return str(v)


def _response(row: dict[str, Any]) -> dict[str, Any]:
    """The model's answer in a logged sample, by request kind (see the module docstring)."""
    args, resps = row.get("arguments") or [], row.get("filtered_resps") or []
    if len(resps) > 1 and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in resps):  # multiple choice
        lls = [float(r[0]) for r in resps]
        best = max(range(len(lls)), key=lls.__getitem__)
        option = args[best][1] if best < len(args) and len(args[best]) > 1 else None
        return {"response": option, "choice": best, "loglikelihoods": lls}
    return {"response": _plain(resps[0] if len(resps) == 1 else resps)}


def row(sample: dict[str, Any]) -> dict[str, Any]:
    """One logged lm-eval sample as a JSONL line (``doc`` itself is left out: its fields are the task's)."""
    args = sample.get("arguments") or [[""]]
    prompt = str(args[0][0]) if args and args[0] else ""
    out = {"doc_id": int(sample["doc_id"]), "filter": sample.get("filter", "none"),
           "prompt": prompt if len(prompt) <= PROMPT_CHARS else None,
           "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(), "prompt_chars": len(prompt)}
    out.update(_response(sample))
    target = _plain(sample.get("target"))
    if isinstance(target, str) and len(target) > PROMPT_CHARS:  # a perplexity task's document: the prompt's rule
        out.update(target=None, target_hash=hashlib.sha256(target.encode()).hexdigest(), target_chars=len(target))
    else:
        out["target"] = target
    out["scores"] = {m: _plain(sample.get(m)) for m in sample.get("metrics") or []}
    return out


def write(samples: dict[str, list[dict[str, Any]]], directory: Path, results_dir: Path) -> dict[str, str]:
    """One JSONL per task under ``directory``, in doc_id order; {task: path relative to results_dir}."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for task, rows in samples.items():
        lines = sorted((row(s) for s in rows), key=lambda r: (r["doc_id"], r["filter"]))
        path = directory / f"{task}.jsonl"
        atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
        out[task] = str(path.relative_to(results_dir)) if path.is_relative_to(results_dir) else str(path)
    return out


def per_example(rows: Iterable[dict[str, Any]]) -> dict[str, list[Any]]:
    """{"doc_id": [...], metric: [score, ...]} from one task's rows (lm-eval's logged samples, or
    the JSONL lines above): the numeric scores only (a perplexity's pairs are left out), one list
    per metric (``metric[filter]``), in doc_id order (what the seed arms' bootstrap pairs on)."""
    by_doc: dict[int, dict[str, float]] = {}
    for r in rows:
        flt = r.get("filter", "none")
        scores = r["scores"] if "scores" in r else {m: r.get(m) for m in r.get("metrics") or []}
        for m, v in scores.items():
            if isinstance(v, bool) or isinstance(v, (int, float)):
                by_doc.setdefault(int(r["doc_id"]), {})[_key(m, flt)] = float(v)
    if not by_doc:
        return {}
    ids = sorted(by_doc)
    keys = list(dict.fromkeys(k for d in by_doc.values() for k in d))
    return {"doc_id": ids, **{k: [by_doc[i].get(k) for i in ids] for k in keys}}


def per_example_of(res: dict[str, Any], results_file: Path | None, task: str) -> dict[str, list[Any]]:
    """A task's per-example scores from a results file: its logged samples (``samples``) where it
    names them, else the ``per_example`` it carries; {} when it has neither."""
    logged = (res.get("samples") or {}).get(task)
    if isinstance(logged, str) and results_file is not None:
        path = Path(logged) if Path(logged).is_absolute() else results_file.parent / logged
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            return per_example(json.loads(x) for x in lines if x.strip())
    return (res.get("per_example") or {}).get(task) or {}

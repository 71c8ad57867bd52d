"""The training-curve columns of ``ncpctl eval --compare`` (issue 26 item 4), from each run's
``metrics.jsonl`` through ``ncpctl.evaluate.uncertainty``:

* tokens-to-reach: the tokens each run needs to reach the baseline's (first run's) final
  validation loss, interpolated, and their ratio to the baseline's tokens; compute-to-reach: the
  same with the training FLOPs the checkpoints record (the run's FLOPs per token x its tokens to
  reach / the baseline's FLOPs). A validation record's tokens are the train records' at its step
  (interpolated between the train records around it when train.eval_every is not a multiple of
  train.log_every; else the record's own ``tokens``, else its step: the ratio then assumes equal
  tokens per step).
* window aggregates of the training loss: the mean over the last N steps and over the whole run.

Each run's budget and size (``scale``: tokens trained, parameters, training FLOPs) come from its
evaluated checkpoint, and a note lists them when the runs differ (``scale_note``).

Per-token metrics of runs with different tokenizers do not compare (a loss per token of one
vocabulary is not one of another): ``check_tokenizers`` refuses them with one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError
from ncpctl.evaluate.uncertainty import tokens_to_reach, window


def tokenizer_id(checkpoint: Path | None) -> str | None:
    """sha256 of the checkpoint's tokenizer.json (None where it has none)."""
    from ncpctl.checkpoint import TOKENIZER

    f = checkpoint / TOKENIZER if checkpoint is not None else None
    return hashlib.sha256(f.read_bytes()).hexdigest()[:12] if f is not None and f.is_file() else None


def check_tokenizers(labels: list[str], checkpoints: list[Path | None]) -> None:
    ids = {lab: tokenizer_id(ck) for lab, ck in zip(labels, checkpoints)}
    if len({i for i in ids.values() if i is not None}) > 1:
        raise UserError("the runs have different tokenizers (" + ", ".join(f"{k}: {v}" for k, v in ids.items())
                        + "): their per-token losses, perplexities and tokens-to-reach do not compare")


def _records(run_dir: Path | None) -> list[dict[str, Any]]:
    from ncpctl.train.metrics import read_metrics

    return read_metrics(run_dir) if run_dir is not None else []


def _tokens_at(steps: list[int], recs: list[dict[str, Any]]) -> list[float]:
    """The tokens seen at each validation step: the train record's at that step, else interpolated
    linearly between the train records around it (validation every 25 steps, logging every 10: a
    validation step need not have a train record), else the record's own ``tokens``, else the step
    itself (a run without any tokens recorded: equal tokens per step assumed)."""
    import numpy as np

    pts = sorted({x["step"]: float(x["tokens"]) for x in recs if x.get("split") == "train"
                  and isinstance(x.get("tokens"), (int, float))}.items())
    own = {x["step"]: x.get("tokens") for x in recs if x.get("split") == "val"}
    if not pts:
        return [float(own.get(s) or s) for s in steps]
    ps, pt = np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts])
    out = []
    for s in steps:
        if ps[0] <= s <= ps[-1]:
            out.append(float(np.interp(s, ps, pt)))
        elif own.get(s):
            out.append(float(own[s]))
        else:  # outside the logged steps: the nearest record's tokens per step
            i = 0 if s < ps[0] else -1
            out.append(float(pt[i] / ps[i] * s) if ps[i] > 0 else float(s))
    return out


def curve_stats(runs: list[dict[str, Any]], run_dirs: list[Path | None], curves: dict[str, dict[str, Any]],
                last: int) -> dict[str, dict[str, Any]]:
    """{label: {train_loss_last, train_loss_all, tokens_to_reach, tokens_ratio, compute_ratio}}
    (None where a run lacks the records)."""
    out: dict[str, dict[str, Any]] = {}
    base = runs[0]["label"]
    xs: dict[str, list[float]] = {}
    for r, d in zip(runs, run_dirs):
        recs = _records(d)
        train = [(x["step"], float(x["loss"])) for x in recs if x.get("split") == "train"
                 and isinstance(x.get("loss"), (int, float))]
        c = curves.get(r["label"])
        if c:
            xs[r["label"]] = _tokens_at(c["steps"], recs)
        row: dict[str, Any] = {"window": last, "train_loss_last": None, "train_loss_all": None}
        if train:
            steps, vals = zip(*train)
            row["train_loss_last"] = window(steps, vals, last)["mean"]
            row["train_loss_all"] = window(steps, vals)["mean"]
        out[r["label"]] = row
    b = curves.get(base)
    for r in runs:
        row = out[r["label"]] | {"tokens_to_reach": None, "tokens_ratio": None, "compute_ratio": None}
        c = curves.get(r["label"])
        row["reach_note"] = _why_not(base, b, r["label"], c)
        if row["reach_note"] is None:
            reach = tokens_to_reach(xs[base], b["values"], xs[r["label"]], c["values"])
            row |= {"target_loss": reach["target_loss"], "tokens_to_reach": reach["tokens"], "tokens_ratio": reach["ratio"]}
            f, t, fb = r.get("training_flops"), r.get("tokens"), runs[0].get("training_flops")
            if reach["tokens"] is not None and f and t and fb:
                row["compute_ratio"] = f / t * reach["tokens"] / fb
        out[r["label"]] = row
    return out


def _why_not(base: str, b: dict[str, Any] | None, label: str, c: dict[str, Any] | None) -> str | None:
    """Why tokens-to-reach cannot be computed for run ``label`` (None: it can): a crossing needs each
    curve to have two validation records or more."""
    for lab, curve in ((base, b), (label, c)):
        if not curve:
            return f"{lab} has no validation records in its metrics.jsonl"
        if len(curve["steps"]) < 2:
            return (f"{lab} validated once (step {curve['steps'][0]}): a crossing needs two validations or more "
                    "(train.eval_every)")
    return None


def lines(stats: dict[str, dict[str, Any]], baseline: str) -> list[str]:
    """The curve columns as text lines (terminal caption and markdown); where tokens-to-reach cannot be
    computed, the reason instead of its numbers."""
    g = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    out = []
    for lab, s in stats.items():
        head = (f"{lab}: train loss last {s['window']} steps {g(s['train_loss_last'], '.4f')}, whole run "
                f"{g(s['train_loss_all'], '.4f')}; ")
        if s.get("reach_note"):
            out.append(head + f"tokens to reach {baseline}'s final val loss: not computed ({s['reach_note']})")
            continue
        if s.get("tokens_to_reach") is None:
            out.append(head + f"{baseline}'s final val loss {g(s.get('target_loss'), '.4f')}: not reached in this run")
            continue
        out.append(head + f"tokens to reach {baseline}'s final val loss "
                   f"{g(s.get('target_loss'), '.4f')}: {g(s.get('tokens_to_reach'), ',.0f')} "
                   f"(ratio {g(s.get('tokens_ratio'), '.3f')}, compute ratio {g(s.get('compute_ratio'), '.3f')})")
    return out


def _safetensors_numel(path: Path) -> int | None:
    """Parameters stored in a safetensors file, from its header alone (no torch, nothing loaded)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    total = 0
    for name, t in header.items():
        if name != "__metadata__":
            k = 1
            for d in t["shape"]:
                k *= d
            total += k
    return total


def scale(e: Any) -> dict[str, Any]:
    """The evaluated checkpoint's budget and size: tokens trained, parameters (its safetensors),
    training FLOPs (what its metadata records the loop spent; for an older checkpoint, the exact
    accounting per token at its training length x the tokens, as if every weight trained). Empty
    where the checkpoint is not at hand."""
    from ncpctl.checkpoint import CHECKPOINTS, META

    ck = e.checkpoint
    if e.results_file is not None and e.run_dir is not None and (ck is None or e.results_file.stem != f"results_{ck.name}"):
        ck = e.run_dir / CHECKPOINTS / e.results_file.stem.removeprefix("results_")
    if ck is None or not (ck / META).is_file():
        return {}
    try:
        meta = json.loads((ck / META).read_text())
        tokens = int(meta["tokens_seen"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out: dict[str, Any] = {"tokens": tokens, "parameters": _safetensors_numel(ck / "model.safetensors")}
    spent = (meta.get("budget") or {}).get("flops")
    if isinstance(spent, (int, float)):  # the loop's own record (steps x its accounting, frozen stages as run)
        out["training_flops"] = spent
        return out
    try:  # a checkpoint written before the loop recorded it
        from ncpctl.model.accounting.flops import training_flops_per_step
        from ncpctl.model.core.config import ModelConfig

        T = int((meta.get("recipe") or {}).get("train", {}).get("seq_len"))
        per_sequence = training_flops_per_step(ModelConfig.from_dict(meta["model_config"]), T, 1)
        out["training_flops"] = per_sequence * tokens / T
    except Exception:  # an old or foreign checkpoint: tokens and parameters only
        out["training_flops"] = None
    return out


def scale_note(runs: list[dict[str, Any]]) -> list[str]:
    """One note when the runs differ in budget or size: each run's tokens, parameters and FLOPs."""
    from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT

    keys = ("tokens", "parameters", "training_flops")
    if len({tuple(r.get(k) for k in keys) for r in runs}) < 2:
        return []
    def fmt(r: dict[str, Any]) -> str:
        t, p, f = (r.get(k) for k in keys)
        return (f"{r['label']}: {'?' if t is None else f'{t:,}'} tokens, {'?' if p is None else f'{p:,}'} parameters, "
                f"{'?' if f is None else f'{f:.3g}'} training FLOPs ({FLOP_CONVENTION_SHORT})")
    return ["the runs differ in budget or size (compare at equal tokens or FLOPs before reading the deltas as "
            "a design's effect): " + "; ".join(fmt(r) for r in runs)]

"""A run's training records (``run.dir/metrics.jsonl``), read back: one reader for the training
summary, the scaling studies and ``ncpctl eval --compare``'s curves (the writer is
``ncpctl.train.metrics.MetricsLog``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError

METRICS = "metrics.jsonl"


def records(path: Path, warn: Any = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A torn last line (what a crash in the middle of a write
    leaves) is dropped, with a warning naming the file when ``warn`` is given; a bad line before
    the last is an error naming the file and line."""
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError as e:
            if any(rest.strip() for rest in lines[i + 1:]):
                raise UserError(f"{path}:{i + 1}: not a metrics record ({e})",
                                hint="the log was edited or damaged; fix or remove that line") from None
            if warn is not None:
                warn(f"{path}: cut its torn last line {i + 1} ({len(line)} characters; "
                     "a crash in the middle of writing it)")
            break
        out.append(rec)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS
    if not path.exists():
        return []
    return records(path)


def realised_ratio(cfg: Any, recs: list[dict[str, Any]]) -> float | None:
    """A dynamic segmentation's (DLCM's) tokens per concept over its training records, their mean: its
    FLOPs are those of the concepts it made, not of the target R (None: fixed blocks, or not logged)."""
    if not (cfg.concept.enabled and cfg.law.variable_length):
        return None
    seen = [float(r["tokens_per_concept"]) for r in recs
            if r.get("split") == "train" and isinstance(r.get("tokens_per_concept"), (int, float))]
    ratio = sum(seen) / len(seen) if seen else None
    return ratio if ratio is not None and ratio > 1 else None

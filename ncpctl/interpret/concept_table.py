"""A concept table the user names (``--concept-table FILE``): the labels of a concept bottleneck's
concepts, for concept search by name (``ncpctl inspect --find-concept``), for steering by name
(``generate --steer concept=NAME``) and for naming concepts in attributions.

The authors of Steerling publish theirs as ``concept_labels.parquet`` on their hub page
(guidelabs/steerling: ``concept_id``, ``concept_name``, ``concept_description``, ``head`` = known |
unknown, ``is_steerable``, ``public_group_id``, ``group_name``, ...); a CSV, JSON-lines or JSON list
with the same columns reads alike (``concept_idx`` is read as ``concept_id``, as their legacy CSV).
Only ``concept_id`` and ``concept_name`` are required; ``head`` defaults to known.

Search ranks as Steerling's ``ConceptCatalog.search``: each query word (lower case) counts its
whole-word matches in the name three times and in the description once; concepts without a match
are left out; by default known concepts only, and steerable ones only where the table says which.
A name alone is noisy, so the CLI also shows what each hit promotes in the loaded weights (the
tokens whose logits W_lm . K_c / ||K_c|| are largest: Steerling's ``concept_top_tokens``).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError


@dataclass(frozen=True)
class Concept:
    concept_id: int
    name: str
    description: str = ""
    head: str = "known"
    steerable: bool | None = None  # None: the table does not say
    group: int | None = None


def _rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the concept table ({getattr(e, 'strerror', None) or e})") from None
    except Exception as e:  # pyarrow's errors on a file that is not parquet
        raise UserError(f"{path}: not a parquet concept table ({str(e).splitlines()[0]})") from None
    if suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    try:
        if suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        if suffix == ".json":
            return list(json.loads(text))
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: not a JSON concept table ({e})") from None
    raise UserError(f"{path}: a concept table is .parquet, .csv, .jsonl or .json")


def _flag(v: Any) -> bool | None:
    if v is None or v == "":
        return None
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes")


def load(path: str | Path) -> list[Concept]:
    """The concepts of a table file, in file order (one UserError line for a bad file or row)."""
    path = Path(path)
    out = []
    for i, row in enumerate(_rows(path), start=1):
        if not isinstance(row, dict):
            raise UserError(f"{path}: row {i} is not a record of columns")
        cid = row.get("concept_id", row.get("concept_idx"))
        try:
            cid = int(cid)
        except (TypeError, ValueError):
            raise UserError(f"{path}: row {i}: concept_id {cid!r} is not an integer") from None
        name = row.get("concept_name")
        if not isinstance(name, str) or not name:
            raise UserError(f"{path}: row {i}: no concept_name")
        head = str(row.get("head") or "known")
        if head not in ("known", "unknown"):
            raise UserError(f"{path}: row {i}: head must be known or unknown, got {head!r}")
        group = row.get("public_group_id")
        out.append(Concept(cid, name, str(row.get("concept_description") or ""), head,
                           _flag(row.get("is_steerable")),
                           None if group in (None, "") or group != group else int(group)))
    return out


def known_names(concepts: list[Concept], n: int) -> list[str]:
    """The names of known concepts 0..n-1 (``#i`` where the table has none), for steering and reports."""
    names = {c.concept_id: c.name for c in concepts if c.head == "known"}
    return [names.get(i, f"#{i}") for i in range(n)]


def search(concepts: list[Concept], query: str, *, limit: int = 10, head: str | None = "known",
           steerable_only: bool = True) -> list[tuple[Concept, int]]:
    """(concept, score) of the best matches of ``query``, best first (the module docstring)."""
    terms = [t for t in query.lower().split() if t]
    hits = []
    for c in concepts:
        if (head is not None and c.head != head) or (steerable_only and c.steerable is False):
            continue
        score = 0
        for t in terms:
            word = re.compile(rf"\b{re.escape(t)}\b")
            score += 3 * len(word.findall(c.name.lower())) + len(word.findall(c.description.lower()))
        if score > 0:
            hits.append((c, score))
    hits.sort(key=lambda h: -h[1])  # stable: file order among equal scores
    return hits[:limit]


def top_tokens(model, concept: int, k: int = 10) -> list[tuple[int, float]]:
    """(token id, W_y . K_c / ||K_c||) of the ``k`` tokens known concept ``concept`` promotes most."""
    from ncpctl.model.designs.bottleneck.module import head_response

    if not 0 <= concept < model.bottleneck.n:
        raise UserError(f"concept #{concept} is not a known concept of this checkpoint (it has "
                        f"{model.bottleneck.n})")
    resp, _ = head_response(model.logit_weight, model.bottleneck.K[concept], model.cfg.vocab_size)
    v, i = resp.topk(min(k, resp.numel()))
    return list(zip(i.tolist(), v.tolist()))


def names_for(loaded, table: str | None) -> list[str] | None:
    """The known concepts' names of a loaded checkpoint: from ``table`` (a concept table file) when
    given, else those the checkpoint records (None: none)."""
    if table is None:
        return loaded.meta.get("concept_names")
    if getattr(loaded.model, "bottleneck", None) is None:
        raise UserError(f"--concept-table names a concept bottleneck's concepts; {loaded.path} has none "
                        "(model.bottleneck)")
    return known_names(load(table), loaded.model.bottleneck.n)


def group(concepts: list[Concept], concept_id: int) -> list[int]:
    """The known concepts of ``concept_id``'s group (``public_group_id``), it first (Steerling's
    ``ConceptCatalog.group``: steer them together with ``concept=#A+#B``)."""
    known = [c for c in concepts if c.head == "known"]
    focal = next((c for c in known if c.concept_id == concept_id), None)
    if focal is None:
        raise UserError(f"concept #{concept_id} is not a known concept of the table")
    if focal.group is None:
        return [concept_id]
    return [concept_id] + [c.concept_id for c in known if c.group == focal.group and c.concept_id != concept_id]

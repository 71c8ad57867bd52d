"""Perplexity on held-out text of your own, as lm-eval tasks (``ncpctl eval --heldout``, ``eval.heldout``).

Each held-out corpus is a ``data.sources`` entry (files, globs, ``.txt`` with ``sample_by``,
``.jsonl``/``.json``/``.parquet`` with ``field:``, the ``builtin:`` corpora, ``hf:`` where a
hub is reachable) plus an optional ``label``, read with ``ncpctl.data.sources`` and
tokenized with the checkpoint's tokenizer. It becomes one lm-eval task named by its label,
configured like ``ncp_heldout_ppl`` (``tasks/ncp_heldout_ppl.yaml``: ``loglikelihood_rolling``
over whole documents in rolling windows of the model's ``max_seq_len``, as lm-eval does):

* ``token_perplexity`` = exp(sum NLL / scored tokens), every token of every document scored
  once (the first one after the end-of-document token);
* ``word_perplexity`` (words = whitespace-separated pieces, as lm-eval's wikitext),
  ``byte_perplexity`` (UTF-8 bytes) and ``bits_per_byte``: the same NLL over other units.

Documents are the source's own (one per ``.txt`` file unless ``sample_by``, one per row of a
``.jsonl``/parquet); empty and whitespace-only documents are dropped. A corpus that yields no tokens at all
(no file matches, every document empty or undecodable) is a user error naming it, raised before
the model loads. ``--limit`` takes the first documents, as for every task.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncpctl.errors import UserError
from ncpctl.evaluate.offline import ppl_results
from ncpctl.task_registry import our_tasks

if TYPE_CHECKING:
    from ncpctl.recipe.schema import HeldoutSource

LABEL = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_spec(text: str, where: str = "--heldout") -> "HeldoutSource":
    """``--heldout VALUE``: a path / glob / ``builtin:NAME`` / ``hf:NAME``, or a YAML mapping with
    the keys of a ``data.sources`` entry plus ``label`` (``{path: notes.jsonl, field: body}``)."""
    import yaml
    from pydantic import ValidationError

    from ncpctl.recipe.schema import HeldoutSource

    raw: Any = text
    if text.lstrip().startswith("{"):
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UserError(f"{where} {text}: not a YAML mapping ({str(e).splitlines()[0]})") from None
    if isinstance(raw, str):
        raw = {"path": raw}
    try:
        return HeldoutSource.model_validate(raw)
    except ValidationError as e:
        raise UserError(*(f"{where} {text}: {'.'.join(map(str, err['loc'])) or 'value'}: {err['msg']}"
                          for err in e.errors())) from None


def label_of(spec: "HeldoutSource") -> str:
    """The task name: ``spec.label``, else ``heldout_`` + the source's slug (its path's last two
    parts, wildcard-only parts left out): ``/data/notes/*.md`` -> ``heldout_notes_md``."""
    from ncpctl.data.sources import source_slug

    return spec.label or "heldout_" + source_slug(spec.path)


def check_labels(specs: list["HeldoutSource"], tasks: list[str]) -> list[str]:
    """Labels of ``specs``, checked: valid names, unique, not also a task name. All problems at once."""
    labels = [label_of(s) for s in specs]
    problems = []
    for s, lab in zip(specs, labels):
        if not LABEL.match(lab):
            problems.append(f"held-out corpus {s.path!r}: label {lab!r}: use letters, digits and _.- only")
        elif lab in tasks:
            problems.append(f"held-out corpus {s.path!r}: label {lab!r} is also one of the tasks")
    dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
    problems += [f"held-out corpora {', '.join(repr(s.path) for s, lab in zip(specs, labels) if lab == d)}: "
                 f"the same label {d!r}; give each a `label:`" for d in dupes]
    if problems:
        raise UserError(*problems, hint="e.g. --heldout '{path: notes/*.md, label: notes}'")
    return labels


def documents(spec: "HeldoutSource", tokenizer) -> list[dict[str, Any]]:
    """``[{"text", "n_tokens"}]``: the corpus's non-empty documents and their token counts (the
    tokens ``loglikelihood_rolling`` scores: the text encoded without special tokens)."""
    from ncpctl.data.sources import ReadStats, iter_documents
    from ncpctl.recipe.load import source_kind

    name = f"held-out corpus {label_of(spec)} ({spec.path!r})"
    kind = source_kind(spec.path, spec.type)
    if kind not in ("builtin", "hf") and not any(Path(p).is_file() for p in
                                                 glob.glob(os.path.expanduser(spec.path), recursive=True)):
        raise UserError(f"{name}: no file matches")
    stats = ReadStats()
    rows = []
    try:
        for batch in iter_documents(spec, stats):
            for text, enc in zip(batch, tokenizer.encode_batch(batch, add_special_tokens=False)):
                if enc.ids and text.strip():
                    rows.append({"text": text, "n_tokens": len(enc.ids)})
    except UserError as e:
        raise UserError(*(f"{name}: {p.removeprefix('data.sources: ')}" for p in e.problems), hint=e.hint) from None
    if not rows:
        skipped = f"; {stats.undecodable} undecodable file(s) skipped" if stats.undecodable else ""
        raise UserError(f"{name}: no text to score (every document is empty or whitespace{skipped})")
    return rows


class _Rows:
    """lm-eval's ``custom_dataset`` for one corpus. lm-eval stores ``str()`` of it in the results'
    task configs, so it prints as a short description rather than the corpus."""

    def __init__(self, spec: "HeldoutSource", rows: list[dict[str, Any]]):
        self.spec, self.rows = spec, rows

    def __call__(self, **_: Any):
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(self.rows)})

    def __repr__(self) -> str:
        return f"held-out corpus {json.dumps(self.spec.model_dump(exclude_defaults=True))} ({len(self.rows)} documents)"

    def __deepcopy__(self, memo):  # TaskConfig.to_dict deep-copies its fields: no copy of the corpus
        return self


def prepare(specs: list["HeldoutSource"], tasks: list[str], tokenizer) -> dict[str, _Rows]:
    """{label: documents} for every corpus; every bad corpus reported at once, before any model work."""
    labels = check_labels(specs, tasks)
    out, problems = {}, []
    for spec, lab in zip(specs, labels):
        try:
            out[lab] = _Rows(spec, documents(spec, tokenizer))
        except UserError as e:
            problems += e.problems
    if problems:
        raise UserError(*problems, hint="held-out corpora take the syntax of data.sources entries: a file, a glob, "
                        "builtin:NAME, or '{path: FILE.jsonl, field: COLUMN}'")
    return out


def tasks(prepared: dict[str, _Rows]) -> list[Any]:
    """One lm-eval ``ConfigurableTask`` per corpus, configured as ``ncp_heldout_ppl``."""
    from lm_eval.api.task import ConfigurableTask

    base = our_tasks()["ncp_heldout_ppl"]
    out = []
    for label, rows in prepared.items():
        cfg = {**base, "task": label, "custom_dataset": rows, "process_results": ppl_results,
               "metric_list": [dict(m) for m in base["metric_list"]]}
        out.append(ConfigurableTask(config=cfg))
    return out

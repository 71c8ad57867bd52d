"""Offline lm-eval tasks built from the tokenized corpus's validation split (no network).

Three tasks (YAMLs in ``ncpctl/evaluate/tasks/``, group ``ncp_offline``), and ConceptLM's
training-distribution perplexity ``conceptlm_val_ppl`` (``val_ppl`` below: the whole split):

* ``ncp_heldout_ppl`` (``loglikelihood_rolling``): held-out perplexity of whole validation
  documents. Metrics: ``token_perplexity`` (exp of the mean NLL per token of the data's own
  tokenizer; token-weighted over documents), ``word_perplexity``, ``byte_perplexity``,
  ``bits_per_byte`` (lm-eval's usual, tokenizer-independent ones).
* ``ncp_cloze`` (``multiple_choice``): given up to 12 lines of a file, choose the true next
  block of 3 lines among 4 (3 distractor blocks from the same file). ``acc``, ``acc_norm``.
* ``ncp_last_ident`` (``generate_until``): LAMBADA for code: the text up to the last
  identifier of a line, where that identifier already occurred in the preceding context;
  greedy generation, first identifier of the output, ``exact_match``.

The data: the documents of ``DATA/val.bin/.idx`` decoded with ``DATA/tokenizer.json``
(``DATA`` = ``run.dir/data``, written by ``ncpctl tokenize``), turned into JSONL files under
``run.dir/eval/offline/`` (rebuilt when the validation split or the tokenizer changes) and
read back as a ``datasets`` dataset. lm-eval calls the ``custom_dataset`` functions below
with its metadata, which includes the model arguments: ``checkpoint=DIR`` (the data is
found through the checkpoint's run directory or recipe) or ``data=DIR`` (a data directory).
Examples are chosen deterministically, so every model sees the same items.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import random
import re
from pathlib import Path
from typing import Any

from ncpctl.checkpoint import TOKENIZER, read_meta, resolve, run_dir_of
from ncpctl.data.indexed import paths
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write
from ncpctl.task_registry import leaves, our_tasks

FORMAT_VERSION = 2
TASKS = ("ncp_heldout_ppl", "ncp_cloze", "ncp_last_ident")
GROUP = "ncp_offline"
MAX_DOCS = 200  # validation documents used (the debug recipe has ~7)
MAX_DOC_TOKENS = 4096  # perplexity: first tokens of each document
CLOZE_LINES, CLOZE_CONTEXT_LINES, CLOZE_CHOICES = 3, 12, 4
PER_DOC, MAX_EXAMPLES = 40, 400
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LAST_IDENT = re.compile(r"(?P<prefix>.*?)(?P<space>\s*)(?P<ident>[A-Za-z_][A-Za-z0-9_]*)\s*$")


# ---- where the data is -------------------------------------------------------------------


def data_dir_for(checkpoint: str | None = None, data: str | None = None) -> tuple[Path, Path]:
    """(data dir with val.bin/.idx + tokenizer.json, cache dir for the JSONL files)."""
    if data:
        d = Path(data)
        if not (d / "val.idx").is_file():
            raise UserError(f"{d}: no val.bin/val.idx (offline tasks need `ncpctl tokenize` output)")
        return d, d.parent / "eval" / "offline"
    if not checkpoint:
        raise UserError("offline ncp_* tasks need the tokenized validation split: pass checkpoint=DIR or data=DIR "
                        "(lm-eval: --model_args or --metadata)")

    ckpt = resolve(checkpoint)
    meta = read_meta(ckpt)
    candidates: list[Path] = []
    if (own_run := run_dir_of(ckpt)) is not None:  # run.dir/checkpoints/step_N -> run.dir/data
        candidates.append(own_run / "data")
    recipe = meta.get("recipe") or {}
    run_dir = (recipe.get("run") or {}).get("dir")
    if run_dir:
        candidates.append(Path(run_dir) / "data")
    val_prefix = (recipe.get("data") or {}).get("val_prefix")
    if val_prefix:
        candidates.append(Path(val_prefix).parent)
    for d in candidates:
        if (d / "val.idx").is_file() and (d / "val.bin").is_file():
            return d, d.parent / "eval" / "offline"
    if mixture_validation(ckpt):  # prefixes only: no tokenized corpus of the run to build the tasks from
        raise UserError(f"{ckpt}: the offline ncp_* tasks read one tokenized corpus (DIR/val.bin + tokenizer.json), "
                        f"and this checkpoint trained on a data.mix of prefixes (no {candidates[0]})",
                        hint="score each component's validation split with --tasks conceptlm_val_ppl "
                             "(conceptlm_val_ppl_NAME per component), or pass data=DIR")
    raise UserError(f"{ckpt}: cannot find the validation split for the offline tasks "
                    f"(looked in {', '.join(str(c) for c in candidates) or 'nothing: no recipe in the checkpoint'})",
                    hint="run `ncpctl tokenize RECIPE` or pass data=RUN_DIR/data")


def _fingerprint(data: Path) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}".encode())
    for name in ("val.idx", "tokenizer.json"):
        p = data / name
        if p.is_file():
            h.update(p.read_bytes())
    h.update(str((data / "val.bin").stat().st_size).encode())
    return h.hexdigest()[:16]


def build(data: Path, out: Path, tokenizer=None) -> dict[str, Path]:
    """Write (or reuse) the JSONL files of the three tasks; returns {task: path}."""
    fp = _fingerprint(data)
    paths = {t: out / f"{t}.jsonl" for t in TASKS}
    stamp = out / "fingerprint"
    if stamp.is_file() and stamp.read_text().strip() == fp and all(p.is_file() for p in paths.values()):
        return paths
    from ncpctl.data.indexed import IndexedDataset

    if tokenizer is None:
        from tokenizers import Tokenizer

        tok_path = data / "tokenizer.json"
        if not tok_path.is_file():
            raise UserError(f"{tok_path}: missing (needed to decode the validation split)")
        tokenizer = Tokenizer.from_file(str(tok_path))
    eod = _eod_id(data, tokenizer)
    ds = IndexedDataset(data / "val")
    texts = []
    for i in range(min(len(ds), MAX_DOCS)):
        ids = [int(t) for t in ds[i]]
        if ids and ids[-1] == eod:
            ids = ids[:-1]
        text = tokenizer.decode(ids[:MAX_DOC_TOKENS])
        if text.strip():
            texts.append(text)
    if not texts:
        raise UserError(f"{data / 'val'}: the validation split is empty")
    rows = {
        "ncp_heldout_ppl": [dict(text=t, n_tokens=len(tokenizer.encode(t).ids)) for t in texts],
        "ncp_cloze": _cloze(texts),
        "ncp_last_ident": _last_ident(texts),
    }
    out.mkdir(parents=True, exist_ok=True)
    for task, items in rows.items():
        atomic_write(paths[task], "".join(json.dumps(r) + "\n" for r in items))
    atomic_write(stamp, fp + "\n")  # last: the stamp says the files above are complete
    return paths


def _eod_id(data: Path, tokenizer) -> int | None:
    from ncpctl.data import meta

    recorded = meta.read(data / "meta.json")  # a damaged one: one line naming it
    eod = (recorded or {}).get("tokenizer", {}).get("eod_id") if recorded and recorded.get("tokenizer") else None
    return eod if eod is not None else tokenizer.token_to_id("<|endoftext|>")


def _rng(text: str) -> random.Random:
    return random.Random(int(hashlib.sha256(text.encode()).hexdigest()[:12], 16))


def _cloze(texts: list[str]) -> list[dict[str, Any]]:
    out = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        n = CLOZE_LINES
        blocks = [(s, "".join(lines[s : s + n])) for s in range(0, len(lines) - n + 1, n)]
        blocks = [(s, b) for s, b in blocks if len(b.strip()) >= 20]
        rng = _rng(text)
        cands = [(s, b) for s, b in blocks if s >= CLOZE_CONTEXT_LINES // 2]
        rng.shuffle(cands)
        for s, true in cands[:PER_DOC]:
            context = "".join(lines[max(0, s - CLOZE_CONTEXT_LINES) : s])
            # distractors: blocks outside the context window and the true block's neighbours,
            # whose text is not in the context (a copying model would otherwise prefer them)
            others = sorted({b for t, b in blocks
                             if (t >= s + 2 * n or t + n <= s - CLOZE_CONTEXT_LINES)
                             and b.strip() != true.strip() and b.strip() not in context})
            if len(others) < CLOZE_CHOICES - 1:
                continue
            choices = rng.sample(others, CLOZE_CHOICES - 1) + [true]
            rng.shuffle(choices)
            out.append(dict(context=context, choices=choices, label=choices.index(true)))
    return _cap(out)


def _last_ident(texts: list[str]) -> list[dict[str, Any]]:
    out = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        offsets = [0]
        for ln in lines:
            offsets.append(offsets[-1] + len(ln))
        items = []
        for i, ln in enumerate(lines):
            m = LAST_IDENT.match(ln.rstrip("\n"))
            if not m or not m.group("prefix").strip():
                continue
            ident = m.group("ident")
            if len(ident) < 3 or keyword.iskeyword(ident):
                continue
            before = text[max(0, offsets[i] - 1500) : offsets[i]] + m.group("prefix")
            if ident not in IDENT.findall(before):  # predictable from the context, as in LAMBADA
                continue
            items.append(dict(context=before, target=ident))
        rng = _rng(text)
        rng.shuffle(items)
        out.extend(items[:PER_DOC])
    return _cap(out)


def _cap(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(items) > MAX_EXAMPLES:
        items = random.Random(0).sample(items, MAX_EXAMPLES)
    return items


# ---- lm-eval hooks (``custom_dataset`` / ``process_results`` in the task YAMLs) ------------


def _dataset(task: str, metadata: dict[str, Any]):
    import datasets

    data, cache = data_dir_for(metadata.get("checkpoint"), metadata.get("data"))
    path = build(data, cache)[task]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise UserError(f"{path}: no examples could be made from the validation split for {task}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def heldout_ppl(**metadata: Any):
    return _dataset("ncp_heldout_ppl", metadata)


def cloze(**metadata: Any):
    return _dataset("ncp_cloze", metadata)


def last_ident(**metadata: Any):
    return _dataset("ncp_last_ident", metadata)


# ---- the training distribution's held-out split (``conceptlm_val_ppl``) -------------------


def validation_prefix(checkpoint: str) -> tuple[Path, Path]:
    """(PREFIX of the checkpoint's validation split, its tokenizer.json): the split its training
    validated on, i.e. the recipe's ``data.val_prefix`` (the Pythia recipes: the Pile's validation
    set), else ``run.dir/data/val`` (``ncpctl tokenize``'s held-out documents: the GPT-2 recipes'
    OpenWebText), looked for in the checkpoint's own run directory, then the recipe's ``run.dir``."""
    ckpt = resolve(checkpoint)
    recipe = read_meta(ckpt).get("recipe") or {}
    given = (recipe.get("data") or {}).get("val_prefix")
    if given:
        candidates = [Path(given)]
    else:
        run_dir = (recipe.get("run") or {}).get("dir")
        candidates = [d / "data" / "val" for d in (run_dir_of(ckpt), Path(run_dir) if run_dir else None) if d]
    for prefix in candidates:
        if all(f.is_file() for f in paths(prefix)):
            if not (ckpt / TOKENIZER).is_file():
                raise UserError(f"{ckpt / TOKENIZER}: missing (needed to decode the validation split)")
            return prefix, ckpt / TOKENIZER
    where = f"data.val_prefix {given}" if given else ", ".join(str(c) for c in candidates) or "no run directory"
    raise UserError(f"{ckpt}: conceptlm_val_ppl: no validation split ({where}: no .bin/.idx)",
                    hint="run `ncpctl tokenize RECIPE`, or point data.val_prefix at the held-out split")


def val_ppl(**metadata: Any):
    """Every document of the validation split (``validation_prefix``), decoded whole: lm-eval's
    ``loglikelihood_rolling`` scores each token once, in windows of the model's ``max_seq_len``
    (``--limit N``: the first N documents). A ``data.mix`` checkpoint has one split per component:
    ``ncpctl eval --tasks conceptlm_val_ppl`` scores each as its own task (``mixture_tasks``)."""
    import datasets
    from tokenizers import Tokenizer

    if not metadata.get("checkpoint"):
        raise UserError("conceptlm_val_ppl needs the checkpoint (lm-eval: --model_args checkpoint=DIR)")
    comps = mixture_validation(metadata["checkpoint"])
    if comps:  # reached through a group (conceptlm_ppl): one split would silently be one component's
        raise UserError(f"conceptlm_val_ppl: {metadata['checkpoint']} trained on data.mix, validated per component "
                        f"({', '.join(n for n, _ in comps)}); inside a task group it has no single split",
                        hint="pass --tasks conceptlm_val_ppl (and the group's other tasks) to score each "
                             "component's validation split as conceptlm_val_ppl_NAME")
    prefix, tok_path = validation_prefix(metadata["checkpoint"])
    rows = split_rows(prefix, Tokenizer.from_file(str(tok_path)))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def split_rows(prefix: Path, tokenizer: Any) -> list[dict[str, Any]]:
    """The documents of the split at ``prefix``, decoded whole: ``{text, n_tokens}`` each."""
    from ncpctl.data.indexed import IndexedDataset

    eod, ds = _eod_id(prefix.parent, tokenizer), IndexedDataset(prefix)
    rows = []
    for start in range(0, len(ds), 1024):  # decoded and re-encoded 1024 documents at a time
        docs = [ds[i].tolist() for i in range(start, min(start + 1024, len(ds)))]
        texts = [t for t in tokenizer.decode_batch([d[:-1] if d and d[-1] == eod else d for d in docs]) if t.strip()]
        for text, enc in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []):
            rows.append({"text": text, "n_tokens": len(enc.ids)})
    if not rows:
        raise UserError(f"{prefix}: the validation split has no text")
    return rows


# ---- a data.mix checkpoint: each component's validation split --------------------------


def mixture_validation(checkpoint: str | Path) -> list[tuple[str, Path]] | None:
    """A checkpoint trained on ``data.mix`` (without data.train_prefix / data.val_prefix, which
    replace it): (component name, validation prefix) of each component that has a validation
    split, as training validated it (``ncpctl.train.validate``): a prefix component's ``val_prefix``,
    a sources component's run.dir/mix/NAME/data/val (the checkpoint's run directory, then the
    recipe's). None for any other checkpoint; [] when no component has one (then the run's one split)."""
    ckpt = resolve(checkpoint, pin_it=False)
    recipe = read_meta(ckpt).get("recipe") or {}
    data = recipe.get("data") or {}
    if not data.get("mix") or data.get("train_prefix") or data.get("val_prefix"):
        return None
    recipe_run = (recipe.get("run") or {}).get("dir")
    runs = [d for d in (run_dir_of(ckpt), Path(recipe_run) if recipe_run else None) if d is not None]
    out = []
    for c in data["mix"]:
        if c.get("prefix"):
            candidates = [Path(c["val_prefix"])] if c.get("val_prefix") else []
        else:
            candidates = [d / "mix" / c["name"] / "data" / "val" for d in runs]
        found = next((p for p in candidates if all(f.is_file() for f in paths(p))), None)
        if found is not None:
            out.append((c["name"], found))
    return out


class _SplitRows:
    """lm-eval's ``custom_dataset`` for one component's validation split (printed short in the
    results' task configs, as ``ncpctl.evaluate.heldout``'s corpora)."""

    def __init__(self, name: str, prefix: Path, rows: list[dict[str, Any]]):
        self.name, self.prefix, self.rows = name, prefix, rows

    def __call__(self, **_: Any):
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(self.rows)})

    def __repr__(self) -> str:
        return f"data.mix component {self.name}: {self.prefix} ({len(self.rows)} documents)"

    def __deepcopy__(self, memo):
        return self


def say_mixture(names: list[str], checkpoint: Path, log: Any) -> None:
    """One line when the ``ncp_*`` tasks score a checkpoint trained on a data.mix of ``sources``: they
    read the one tokenized corpus ``ncpctl tokenize`` wrote for it, the union of the components'
    validation documents, not weighted by the mix (a mix of prefixes has no such corpus: ``data_dir_for``
    refuses it)."""
    ours = our_tasks()
    ncp = list(dict.fromkeys(leaf for n in names for leaf in leaves(n, ours) if leaf in TASKS))
    if not ncp or mixture_validation(checkpoint) is None:
        return
    try:
        data, _ = data_dir_for(str(checkpoint))
    except UserError:
        return  # refused when the task loads, with its own line
    log(f"{', '.join(ncp)}: {checkpoint} trained on a data.mix; these tasks read one corpus, {data / 'val'}: "
        "the union of the components' validation documents, not weighted by the mix (conceptlm_val_ppl scores "
        "each component's split)")


def mixture_tasks(names: list[str], checkpoint: Path) -> tuple[list[str], list[Any]]:
    """``names`` without ``conceptlm_val_ppl`` and, in its place, one lm-eval task per data.mix
    component of ``checkpoint`` (``conceptlm_val_ppl_NAME``, configured as ``conceptlm_val_ppl``
    on that component's validation split): the held-out perplexity per component, as training's
    validation reports its loss per component. ``names`` unchanged for any other checkpoint."""
    comps = mixture_validation(checkpoint) if "conceptlm_val_ppl" in names else None
    if not comps:
        return names, []
    from lm_eval.api.task import ConfigurableTask
    from tokenizers import Tokenizer

    tok_path = resolve(checkpoint, pin_it=False) / TOKENIZER
    if not tok_path.is_file():
        raise UserError(f"{tok_path}: missing (needed to decode the validation splits)")
    tokenizer = Tokenizer.from_file(str(tok_path))
    base = our_tasks()["conceptlm_val_ppl"]
    objs = [ConfigurableTask(config={**base, "task": f"conceptlm_val_ppl_{name}",
                                     "custom_dataset": _SplitRows(name, prefix, split_rows(prefix, tokenizer)),
                                     "process_results": ppl_results,
                                     "metric_list": [dict(m) for m in base["metric_list"]]})
            for name, prefix in comps]
    return [n for n in names if n != "conceptlm_val_ppl"], objs


def ppl_results(doc: dict[str, Any], results: list[float]) -> dict[str, tuple[float, int]]:
    """Rolling log-likelihood -> (ll, count) pairs for lm-eval's weighted perplexities."""
    (ll,) = results
    text = doc["text"]
    n_bytes = len(text.encode("utf-8"))
    return {
        "token_perplexity": (ll, doc["n_tokens"]),
        "word_perplexity": (ll, len(re.split(r"\s+", text))),
        "byte_perplexity": (ll, n_bytes),
        "bits_per_byte": (ll, n_bytes),
    }

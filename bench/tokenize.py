"""Tokenize throughput: `ncpctl tokenize` vs raw `Tokenizer.encode_batch` vs `datasets.map` (issue 2, item 5).

A script, not a test. Every row encodes the SAME documents with the SAME tokenizer file on
the SAME cores (this process; the tokenizers Rust pool uses all of them unless
RAYON_NUM_THREADS says otherwise):

  ours            ``ncpctl.data.tokenize.tokenize(recipe, force=True)``, the library call behind
                  ``ncpctl tokenize --force``, with ``tokenizer.path`` set to an already trained
                  tokenizer.json so that BPE training is excluded. Timed end to end: fingerprint,
                  reading the corpus files, encoding, EOD + train/val split, writing .bin/.idx,
                  meta.json and the directory swap.
  raw             ``Tokenizer.encode_batch`` over the documents already in memory, in batches of
                  ``data.batch_documents``, each document's ids turned into a numpy array of the
                  dataset dtype: the least work a real pipeline must do. No reading, no writing.
  raw (fast)      the same with ``encode_batch_fast`` (no offsets), the call ours makes: ``ours/raw
                  (fast)`` is the like-for-like pipeline overhead (no goal; printed for honesty,
                  since on this corpus ``encode_batch``'s offsets alone cost ~1.5x the CPU).
  datasets.map    ``Dataset.from_dict({"text": docs}).map(lambda b: {"ids": ...}, batched=True)``
                  with default settings, as a typical user writes it (documents already in memory).
  datasets.map np2  the same with ``num_proc=2`` (each forked worker's tokenizers then run on one
                  thread: tokenizers turns its parallelism off after a fork).

The cpu-s column is CPU time of all threads and num_proc workers: steadier than wall time on a
busy machine, and it shows where a row's time goes.

Tokens are the BPE tokens of the documents, EOD not counted, and are checked to be identical
for every row, so tokens/s ratios are time ratios. Rows are interleaved in every round and the
best (least disturbed) round of each is used for the ratios; the median is reported too,
because the machine may be shared.

    .venv/bin/python bench/tokenize.py                      # builtin stdlib corpus, 3 rounds
    .venv/bin/python bench/tokenize.py --repeat 5 --json
    .venv/bin/python bench/tokenize.py --corpus 'data/*.jsonl' --tokenizer runs/x/data/tokenizer.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named tokenize.py: drop its folder from the import path, or `import tokenize`
# (stdlib, used by pandas/datasets/linecache) would import this script instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from ncpctl.recipe.load import Recipe

REPO = Path(__file__).resolve().parents[1]
GOALS = {"ours/raw": 0.9, "ours/datasets.map": 2.0}


def _recipe(args: argparse.Namespace, run_dir: Path, tokenizer: str | None) -> Recipe:
    from ncpctl.recipe import load_recipe

    sets = [f"run.dir={run_dir}"]
    if args.corpus:
        sets.append(f"data.sources={json.dumps([args.corpus])}")  # a JSON list is YAML too
    if tokenizer:
        sets.append(f"tokenizer.path={tokenizer}")
    return load_recipe(args.recipe, sets, need_sources=True)


def _tokenizer_file(args: argparse.Namespace, work: Path) -> tuple[str, float]:
    """A trained tokenizer.json (given, or trained once here, untimed) and the training seconds."""
    if args.tokenizer:
        return args.tokenizer, 0.0
    from ncpctl.data.sources import ReadStats
    from ncpctl.data.tokenize import train_bpe

    t0 = time.perf_counter()
    tok = train_bpe(_recipe(args, work / "train-bpe", None), ReadStats())
    path = work / "tokenizer.json"
    tok.save(str(path))
    return str(path), time.perf_counter() - t0


def _documents(recipe: Recipe) -> list[str]:
    """The exact texts ours encodes (same sources, order, min_chars/max_documents filtering)."""
    from ncpctl.data.sources import ReadStats, documents

    return [text for _, texts in documents(recipe.data, ReadStats()) for text in texts]


@contextlib.contextmanager
def _quiet_fork_warning() -> Iterator[None]:
    """Hide the tokenizers 'process just got forked ... disabling parallelism' notice that every
    num_proc worker prints (expected: each worker then encodes on one core); echo anything else."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as cap:
        os.dup2(cap.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            cap.seek(0)
            skip = ("huggingface/tokenizers", "To disable this warning", "- Avoid using `tokenizers`",
                    "- Explicitly set the environment variable")
            for line in cap.read().decode(errors="replace").splitlines():
                if line.strip() and not line.lstrip().startswith(skip):
                    print(line, file=sys.stderr)


def _cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its finished child processes."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; best and median reported (default 3)")
    p.add_argument("--corpus", default=None,
                   help="one data source (path, glob, hf:NAME or builtin:python-stdlib); default: the recipe's "
                        "(builtin:python-stdlib in recipes/debug.yaml)")
    p.add_argument("--recipe", default=str(REPO / "recipes" / "debug.yaml"), help="recipe (default recipes/debug.yaml)")
    p.add_argument("--tokenizer", default=None,
                   help="trained tokenizer.json to use; default: train the recipe's BPE once, untimed")
    p.add_argument("--no-num-proc", action="store_true", help="skip the datasets.map num_proc=2 row")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    import datasets
    import pyarrow.compute as pc
    from tokenizers import Tokenizer

    from ncpctl.data.indexed import best_dtype
    from ncpctl.data.tokenize import tokenize

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # for bench/run_all.py: what this run will report (all at the end: the rounds interleave the rows)
    plan = {**{k: f">= {g}" for k, g in GOALS.items()}, "ours/raw (fast)": "-"}
    if not args.no_num_proc:
        plan["ours/datasets.map np2"] = "-"
    print("bench-plan: " + json.dumps(plan), file=sys.stderr, flush=True)
    say: Callable[[str], None] = (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True))

    with tempfile.TemporaryDirectory(prefix="ncpctl-bench-tokenize-") as tmp:
        work = Path(tmp)
        say("preparing: tokenizer (untimed) ...")
        tok_path, t_train = _tokenizer_file(args, work)
        recipe = _recipe(args, work / "run", tok_path)
        docs = _documents(recipe)
        batch = recipe.data.batch_documents
        tok = Tokenizer.from_file(tok_path)
        dtype = best_dtype(tok.get_vocab_size(with_added_tokens=True)) if recipe.data.dtype == "auto" \
            else np.dtype(recipe.data.dtype)
        n_bytes = sum(len(d.encode()) for d in docs)

        # Each row returns a zero-argument token counter, called after its timing stops.
        def ours() -> Callable[[], int]:
            meta = tokenize(recipe, force=True)
            return lambda: meta["tokens"] - meta["documents"]  # ours counts one EOD per document

        def raw(method: str) -> Callable[[], Callable[[], int]]:
            encode = getattr(tok, method)

            def run() -> Callable[[], int]:
                out: list[np.ndarray] = []
                for i in range(0, len(docs), batch):
                    out.extend(np.array(e.ids, dtype=dtype) for e in encode(docs[i:i + batch]))
                return lambda: sum(a.size for a in out)
            return run

        def ds_map(num_proc: int | None) -> Callable[[], Callable[[], int]]:
            def run() -> Callable[[], int]:
                ctx = _quiet_fork_warning() if num_proc else contextlib.nullcontext()
                with ctx:
                    ds = datasets.Dataset.from_dict({"text": docs}).map(
                        lambda b: {"ids": [e.ids for e in tok.encode_batch(b["text"])]}, batched=True,
                        num_proc=num_proc)
                return lambda: int(pc.sum(pc.list_value_length(ds.data.column("ids"))).as_py())
            return run

        rows: list[tuple[str, Callable[[], Callable[[], int]]]] = [
            ("ours", ours), ("raw", raw("encode_batch")), ("datasets.map", ds_map(None)),
        ]
        if hasattr(tok, "encode_batch_fast"):
            rows.insert(2, ("raw (fast)", raw("encode_batch_fast")))
        if not args.no_num_proc:
            rows.append(("datasets.map np2", ds_map(2)))

        seconds: dict[str, list[float]] = {name: [] for name, _ in rows}
        cpu: dict[str, list[float]] = {name: [] for name, _ in rows}  # all threads + num_proc workers
        tokens: dict[str, int] = {}
        load = [os.getloadavg()[0]]
        for r in range(args.repeat):
            say(f"round {r + 1}/{args.repeat} ...")
            for name, fn in rows:
                gc.collect()
                c0, t0 = _cpu_seconds(), time.perf_counter()
                count = fn()
                seconds[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_seconds() - c0)
                n = count()
                if tokens.setdefault(name, n) != n:
                    raise SystemExit(f"{name}: token count changed between rounds ({tokens[name]} -> {n})")
            load.append(os.getloadavg()[0])
        if len(set(tokens.values())) != 1:
            raise SystemExit(f"token counts differ, the rows did not encode the same text: {tokens}")
        n_tok = tokens["ours"]

    result: dict[str, Any] = {
        "corpus": [s.path for s in recipe.data.sources],
        "documents": len(docs),
        "bytes": n_bytes,
        "tokens": n_tok,
        "batch_documents": batch,
        "cpu_cores": os.cpu_count(),
        "rayon_threads": os.environ.get("RAYON_NUM_THREADS", "all cores"),
        "repeat": args.repeat,
        "loadavg_1min": [round(x, 2) for x in load],
        "tokenizer_training_seconds_untimed": round(t_train, 3),
        "rows": {
            name: {
                "seconds_best": round(min(s), 4),
                "seconds_median": round(statistics.median(s), 4),
                "seconds_all": [round(x, 4) for x in s],
                "cpu_seconds_median": round(statistics.median(cpu[name]), 4),
                "tokens_per_second_best": round(n_tok / min(s)),
                "tokens_per_second_median": round(n_tok / statistics.median(s)),
            } for name, s in seconds.items()
        },
    }
    best = {name: min(s) for name, s in seconds.items()}
    med = {name: statistics.median(s) for name, s in seconds.items()}
    ratios = {}
    for key, goal in GOALS.items():
        other = key.split("/")[1]
        ratios[key] = {"best": round(best[other] / best["ours"], 3), "median": round(med[other] / med["ours"], 3),
                       "goal": goal, "met": best[other] / best["ours"] >= goal}
    for other in ("raw (fast)", "datasets.map np2"):  # no goal: like-for-like encode call; num_proc
        if other in best:
            ratios[f"ours/{other}"] = {"best": round(best[other] / best["ours"], 3),
                                       "median": round(med[other] / med["ours"], 3)}
    result["ratios"] = ratios
    for key, r in ratios.items():
        print("bench-ratio: " + json.dumps({key: r}), file=sys.stderr, flush=True)

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"corpus {', '.join(result['corpus'])}: {len(docs):,} documents, {n_bytes / 1e6:.1f} MB, "
          f"{n_tok:,} tokens (EOD not counted); batch {batch}; {os.cpu_count()} cores; "
          f"{args.repeat} rounds; 1-min load {' -> '.join(f'{x:.1f}' for x in load)}")
    print(f"{'':18} {'tokens':>10} {'s best':>8} {'s median':>9} {'tok/s best':>12} {'tok/s median':>13} "
          f"{'cpu-s median':>13}")
    for name, s in seconds.items():
        print(f"{name:18} {n_tok:>10,} {min(s):>8.3f} {statistics.median(s):>9.3f} "
              f"{n_tok / min(s):>12,.0f} {n_tok / statistics.median(s):>13,.0f} {statistics.median(cpu[name]):>13.2f}")
    for key, r in ratios.items():
        if key not in GOALS:
            print(f"{key} = {r['best']:.2f} (median {r['median']:.2f}; no goal)")
    for key in GOALS:
        r = ratios[key]
        print(f"{key} = {r['best']:.2f} (median {r['median']:.2f}); goal >= {r['goal']}: "
              f"{'MET' if r['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The target's own outputs as a drafter's training data (issue 25: "trained on the target's own
outputs or on data"): greedy continuations by a checkpoint of prompts cut from its training data,
written as a Megatron dataset (uint16 / int32 by vocabulary) with the data's meta.json and
tokenizer.json beside it, for ``ncpctl train-drafter --set data.train_prefix=DIR/train``.

A drafter trained on these learns what greedy verification accepts (each next token is the
target's own greedy choice), the EAGLE / DFlash practice; a drafter trained on the data learns the
data. Prompts come from the data's train split, never from bench/speculative.py's prompts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/target_outputs.py --target runs/pythia70m-code \\
        --data runs/debug/data --out runs/pythia70m-code/own --sequences 320 --prompt 32 --new 96 --batch 32
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="checkpoint or run directory")
    ap.add_argument("--data", required=True, help="a `ncpctl tokenize` data directory (train.bin/.idx, meta.json)")
    ap.add_argument("--out", required=True, help="directory for train.bin/.idx and val.bin/.idx")
    ap.add_argument("--sequences", type=int, default=96, help="training sequences (val: an eighth as many more)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens cut from the data")
    ap.add_argument("--new", type=int, default=96, help="greedy tokens generated after each prompt")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import numpy as np
    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.data.indexed import IndexedDataset, IndexedDatasetWriter
    from ncpctl.inference import SamplingParams, generate

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lm = load_model(args.target)
    data, out = Path(args.data), Path(args.out)
    flat = np.concatenate([np.asarray(d) for d in _docs(IndexedDataset(data / "train"))])
    rng = np.random.default_rng(args.seed)
    n_val = max(1, args.sequences // 8)
    starts = rng.integers(0, len(flat) - args.prompt, args.sequences + n_val)
    prompts = [flat[s : s + args.prompt].tolist() for s in starts]
    params = SamplingParams(max_new_tokens=args.new, greedy=True)
    t0, seqs = time.perf_counter(), []
    for i in range(0, len(prompts), args.batch):
        chunk = prompts[i : i + args.batch]
        done = generate(lm.model, chunk, params, lambda ids: "", vocab_size=lm.config.vocab_size)
        seqs += [p + c.tokens for p, c in zip(chunk, done)]
        print(f"{len(seqs)}/{len(prompts)} sequences, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if lm.config.vocab_size < 65536 else "int32"
    for split, part in (("train", seqs[:args.sequences]), ("val", seqs[args.sequences:])):
        with IndexedDatasetWriter(out / split, dtype) as w:
            for s in part:
                w.add_document(s)
    for name in ("meta.json", "tokenizer.json"):
        if (data / name).is_file():
            shutil.copy(data / name, out / name)
    print(f"{out}: {len(seqs)} sequences of {args.prompt} + {args.new} tokens ({time.perf_counter() - t0:.0f} s)")


def _docs(ds):
    """The first documents of a dataset, up to about 2M tokens (plenty of prompts)."""
    total = 0
    for i in range(len(ds)):
        d = ds[i]
        total += len(d)
        yield d
        if total > 2_000_000:
            return


if __name__ == "__main__":
    main()

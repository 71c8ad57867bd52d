"""Causal Diffusion LM sampling speed: block-wise sampling on cached blocks against recomputing the
whole sequence at every step (issue 23 item 3; goal >= 3x at 512 new tokens).

A script, not a test. ``recipes/debug-cdlm.yaml``'s model (random weights: the speed does not
depend on them; ``max_seq_len`` raised to hold the prompt and the new tokens), ``--batch`` random
prompts of ``--prompt`` tokens (not block-aligned by default), ``--new`` greedy tokens with
``steps_per_block`` = the block size (one token committed per step, one forward per token), through
``ncpctl.inference.causal_diffusion.sample_blocks`` with ``cache=True`` and ``cache=False``,
best of ``--repeats``, the two interleaved. Both give the same tokens (checked here; the tests
check it too).

    OMP_NUM_THREADS=2 .venv/bin/python bench/cdlm_sampling.py          # ~1 min on 2 cores
    OMP_NUM_THREADS=2 .venv/bin/python bench/cdlm_sampling.py --size pythia-70m --new 128
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

REPO = _HERE.parent
RECIPE = REPO / "recipes" / "debug-cdlm.yaml"


def build(prompt: int, new: int, size: str | None = None):
    """The debug-cdlm model (its recipe's model section, the tokenizer's vocabulary, [MASK] = 1);
    ``size``: another named size with the recipe's other model keys."""
    import torch
    import yaml

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    r = yaml.safe_load(RECIPE.read_text())
    m = dict(r["model"])
    recipe_size = m.pop("size")
    size, block = size or recipe_size, m["diffusion"]["block_size"]
    need = -(-(prompt + new) // block) * block
    m["max_seq_len"] = max(m.get("max_seq_len", 0), need)
    m["diffusion"] = {**m["diffusion"], "mask_id": 1}
    torch.manual_seed(0)
    cfg = build_config(size, vocab_size=r["tokenizer"]["vocab_size"], **m)
    return NCPModel(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=20, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=512, help="new tokens per row")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--size", default=None, help="another named size (e.g. pythia-70m) with the recipe's other "
                    "model keys (default: the recipe's, debug)")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()

    import torch

    from ncpctl.inference import SamplingParams
    from ncpctl.inference.causal_diffusion import sample_blocks

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = build(args.prompt, args.new, args.size)
    block = model.objective.block
    print("bench-plan: " + json.dumps({"cached_over_recompute": ">= 3"}), file=sys.stderr, flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, model.cfg.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new, greedy=True, steps_per_block=block)
    best = {True: float("inf"), False: float("inf")}
    tokens = {}
    sample_blocks(model, prompts, SamplingParams(max_new_tokens=2 * block, greedy=True))  # warm-up
    for _ in range(args.repeats):
        for cache in (True, False):
            t0 = time.perf_counter()
            tokens[cache] = sample_blocks(model, prompts, params, vocab_size=model.cfg.vocab_size, cache=cache)
            best[cache] = min(best[cache], time.perf_counter() - t0)
    n = args.batch * args.new
    ratio = best[False] / best[True]
    print("bench-ratio: " + json.dumps({"cached_over_recompute": {"value": round(ratio, 2), "goal": ">= 3",
                                                                 "met": ratio >= 3}}), file=sys.stderr, flush=True)
    out = {"shape": f"{args.size or 'debug-cdlm'} (d={model.cfg.d_model}, {model.cfg.n_layers} layers, vocab {model.cfg.vocab_size}, "
                    f"block {block})",
           "prompt": args.prompt, "new_tokens": args.new, "batch": args.batch, "steps_per_block": block,
           "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
           "same_tokens": tokens[True] == tokens[False],
           "cached_tokens_per_s": round(n / best[True], 1), "recompute_tokens_per_s": round(n / best[False], 1),
           "cached_s": round(best[True], 3), "recompute_s": round(best[False], 3),
           "ratio": round(ratio, 2), "goal": ">= 3", "met": ratio >= 3}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

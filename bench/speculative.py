"""Speculative decoding speed: tokens/s of ``generate`` with a drafter against plain cached decoding,
side by side in one run, at batch 1 and 8, with MAL beside each (issue 25; goal >= 1.5x at batch 1
with the best drafter, for a target of the pythia-70m shape).

A script, not a test. ``--target`` and ``--draft`` are checkpoints (``--draft mtp``: the target's
own MTP head; repeatable); prompts are ``--prompts`` lines of a text file, or eight short lines of
Python when none is given. Greedy, ``--new`` tokens per prompt,
best of ``--repeats``, plain and speculative interleaved; the outputs are checked to be the same
tokens (greedy speculative decoding is exact). Also reported: the drafter's cost of one decoding
step relative to the target's (batch 1), the machine and its load.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speculative.py --target runs/debug --draft runs/debug-small
    OMP_NUM_THREADS=1 .venv/bin/python bench/speculative.py --target runs/debug-archpreview --draft mtp -k 1
    OMP_NUM_THREADS=1 .venv/bin/python bench/speculative.py --target runs/debug \\
        --draft runs/drafter-debug-base --draft runs/drafter-debug-concept -k 16

A block-parallel drafter (``ncpctl train-drafter``) drafts all K tokens in one forward: its cost is
reported per round (``drafter_round_over_target_step``), a model drafter's per step.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

GOAL = 1.5


def _step_ms(model, B: int = 1, Tp: int = 32, reps: int = 16) -> float:
    """Milliseconds of one cached decoding step of ``model`` at batch B after a Tp-token prompt."""
    import torch

    from ncpctl.model.decode import step_many

    x = torch.randint(0, model.cfg.vocab_size, (B, Tp))
    _, st = model.prefill(x, [Tp] * B, max_len=Tp + reps + 1)
    tok = torch.randint(0, model.cfg.vocab_size, (B, 1))
    step_many(model, st, tok)
    t0 = time.perf_counter()
    for _ in range(reps - 1):
        step_many(model, st, tok)
    return (time.perf_counter() - t0) / (reps - 1) * 1e3


def _block_round_ms(runner, reps: int = 16) -> float:
    """Milliseconds of one block-drafter round at batch 1: its forward over W context states and
    the target's LM head on its K slots (all K drafts at once)."""
    import torch

    cfg, m = runner.cfg, runner.model
    feats = torch.randn(1, cfg.window, len(cfg.target_layers) * cfg.d_model)
    pos, valid = torch.arange(cfg.window)[None], torch.ones(1, cfg.window, dtype=torch.bool)
    x, c = torch.randn(1, cfg.d_model), torch.randn(1, cfg.d_model) if cfg.concept_injection else None
    with torch.no_grad():
        m.head(runner.drafter(feats, pos, valid, x, c))
        t0 = time.perf_counter()
        for _ in range(reps):
            m.head(runner.drafter(feats, pos, valid, x, c))
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target checkpoint or run directory")
    ap.add_argument("--draft", action="append", required=True, help="drafter checkpoint, or 'mtp' (repeatable)")
    ap.add_argument("-k", "--draft-tokens", type=int, default=4, help="tokens drafted per round")
    ap.add_argument("--prompts", default=None, help="one prompt per line (default: a few Python lines)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, action="append", default=None, help="batch sizes (default: 1 and 8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()

    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams, generate_texts
    from ncpctl.inference.drafters import load_speculative

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    prompts = (Path(args.prompts).read_text().splitlines() if args.prompts else
               ["def main(argv):", "import os", "class Reader:", "for i in range(10):", "def read_file(path):",
                "    return self.", 'if __name__ == "__main__":', "x = [1, 2, 3]"])
    batches = args.batch or [1, 8]
    lm = load_model(args.target)
    params = SamplingParams(max_new_tokens=args.new, greedy=True)
    ratios = {f"{Path(d).name}@b{b}": f">= {GOAL}" for d in args.draft for b in batches}
    print("bench-plan: " + json.dumps(ratios), file=sys.stderr, flush=True)
    target_ms = _step_ms(lm.model)
    rows = []
    for draft in args.draft:
        spec0, info = load_speculative(lm, draft, args.draft_tokens)
        block = info.get("drafter") == "block"  # one forward drafts all K (it reads the target's states)
        draft_ms = _block_round_ms(spec0.drafter) if block else \
            _step_ms(lm.model if info["draft"] == "mtp" else spec0.drafter.model)
        for B in batches:
            best = {"plain": float("inf"), "speculative": float("inf")}
            out, stats = {}, None
            for _ in range(args.repeats):
                for how in best:
                    spec, _ = load_speculative(lm, draft, args.draft_tokens) if how == "speculative" else (None, None)
                    t0 = time.perf_counter()
                    out[how] = generate_texts(lm, prompts, params, batch_size=B, speculative=spec)
                    best[how] = min(best[how], time.perf_counter() - t0)
                    stats = spec.stats.as_dict() if spec is not None else stats
            n = sum(len(c.tokens) for c in out["plain"])
            ratio = best["plain"] / best["speculative"]
            name = f"{Path(draft).name}@b{B}"
            print("bench-ratio: " + json.dumps({name: {"value": round(ratio, 2), "goal": f">= {GOAL}",
                                                       "met": ratio >= GOAL}}), file=sys.stderr, flush=True)
            rows.append({"draft": info["draft"], "batch": B, "draft_tokens": args.draft_tokens,
                         "same_tokens": [c.tokens for c in out["plain"]] == [c.tokens for c in out["speculative"]],
                         "plain_tokens_per_s": round(n / best["plain"], 1),
                         "speculative_tokens_per_s": round(n / best["speculative"], 1), "ratio": round(ratio, 2),
                         "mal": round(stats["mal"], 3), "acceptance": round(stats["acceptance"], 3),
                         # a model drafter: one of its K steps a round; the block drafter: its whole round
                         "drafter_step_over_target_step": None if block else round(draft_ms / target_ms, 3),
                         "drafter_round_over_target_step": round(draft_ms / target_ms, 3) if block else None,
                         **({"concept_injection": info["concept_injection"],
                             "concept_source": info["concept_source"]} if block else {})})
    result = {"target": str(lm.path), "shape": f"d={lm.config.d_model}, {lm.config.n_layers} layers, "
                                               f"vocab {lm.config.vocab_size}",
              "prompts": len(prompts), "new_tokens": args.new, "greedy": True,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
              "target_step_ms_b1": round(target_ms, 2), "goal": f">= {GOAL} at batch 1 with the best drafter",
              "results": rows}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

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

Costs, all relative to one plain cached target step at the same batch (``target_step_ms``):
``drafter_round_over_target_step``, the drafter's time per round measured inside the speculative
run (its ``propose`` and ``commit``: a model drafter's K steps, the MTP head's K depths, the block
drafter's one forward plus its context of the round's tokens); ``verify_over_target_step``, one
verification forward of K + 1 tokens (``decode.step_many``, with its per-token concept steps and
snapshots). A speculative round costs about the sum of the two (plus acceptance and bookkeeping),
so the speed-up is at most MAL / (verify + drafter round); ``bound`` reports that.
``--out FILE`` also writes the JSON there (e.g. bench/results/speculative.json).
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


def _step_ms(model, B: int = 1, n: int = 1, Tp: int = 32, reps: int = 12) -> float:
    """Milliseconds of one cached decoding call of ``model`` feeding n tokens per row at batch B after
    a Tp-token prompt (n = 1: a plain decoding step; n = K + 1: a verification forward)."""
    import torch

    from ncpctl.model.core.decode import step_many

    x = torch.randint(0, model.cfg.vocab_size, (B, Tp))
    _, st = model.prefill(x, [Tp] * B, max_len=Tp + n * reps + n)
    tok = torch.randint(0, model.cfg.vocab_size, (B, n))
    step_many(model, st, tok)
    t0 = time.perf_counter()
    for _ in range(reps - 1):
        step_many(model, st, tok)
    return (time.perf_counter() - t0) / (reps - 1) * 1e3


class _Timed:
    """Wraps a drafter's ``propose`` and ``commit`` (instance attributes) to add up their time."""

    def __init__(self, drafter):
        self.s = 0.0
        for name in ("propose", "commit"):
            setattr(drafter, name, self._wrap(getattr(drafter, name)))

    def _wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t0
        return timed


def _compare(lm, draft: str, k: int, B: int, prompts, params, repeats: int) -> dict:
    """Plain and speculative ``generate`` of ``prompts`` at batch B, interleaved, best of ``repeats``."""
    from ncpctl.inference import generate_texts
    from ncpctl.inference.drafters import load_speculative

    best = {"plain": float("inf"), "speculative": float("inf")}
    out, stats, info, draft_s = {}, None, None, None
    for _ in range(repeats):
        for how in best:
            spec, info = load_speculative(lm, draft, k) if how == "speculative" else (None, info)
            timer = _Timed(spec.drafter) if spec is not None else None
            t0 = time.perf_counter()
            out[how] = generate_texts(lm, prompts, params, batch_size=B, speculative=spec)
            dt = time.perf_counter() - t0
            if spec is not None:
                stats = spec.stats.as_dict()
                if dt < best[how]:  # the drafter's share of the best run
                    draft_s = timer.s / (stats["rounds"] or 1)
            best[how] = min(best[how], dt)
    n = sum(len(c.tokens) for c in out["plain"])
    return {"info": info, "stats": stats, "n": n, "best": best, "draft_round_ms": draft_s * 1e3,
            "same": [c.tokens for c in out["plain"]] == [c.tokens for c in out["speculative"]]}


def _row(lm, draft: str, args, B: int, prompts, params) -> dict:
    """One (drafter, batch) comparison as a result row, with its costs relative to a target step."""
    r = _compare(lm, draft, args.draft_tokens, B, prompts, params, args.repeats)
    info, stats = r["info"], r["stats"]
    K = min(args.draft_tokens, info.get("drafter_k") or info.get("mtp_depth") or args.draft_tokens)
    step_ms, verify_ms = _step_ms(lm.model, B), _step_ms(lm.model, B, K + 1)
    ratio = r["best"]["plain"] / r["best"]["speculative"]
    name = f"{Path(draft).name}@b{B}"
    print("bench-ratio: " + json.dumps({name: {"value": round(ratio, 2), "goal": f">= {GOAL}",
                                               "met": ratio >= GOAL}}), file=sys.stderr, flush=True)
    draft_rel, verify_rel = r["draft_round_ms"] / step_ms, verify_ms / step_ms
    return {"draft": info["draft"], "batch": B, "draft_tokens": K, "same_tokens": r["same"],
            "plain_tokens_per_s": round(r["n"] / r["best"]["plain"], 1),
            "speculative_tokens_per_s": round(r["n"] / r["best"]["speculative"], 1), "ratio": round(ratio, 2),
            "mal": round(stats["mal"], 3), "acceptance": round(stats["acceptance"], 3),
            "committed_per_round": stats["committed_per_round"],
            "target_step_ms": round(step_ms, 2), "drafter_round_over_target_step": round(draft_rel, 3),
            "verify_over_target_step": round(verify_rel, 3),
            # rounds cost >= verify + drafter (in target steps) and commit MAL tokens; plain: 1 per step
            "bound": round(stats["mal"] / (verify_rel + draft_rel), 2),
            **({"concept_injection": info["concept_injection"], "concept_source": info["concept_source"]}
               if info.get("drafter") == "block" else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target checkpoint or run directory")
    ap.add_argument("--draft", action="append", required=True, help="drafter checkpoint, or 'mtp' (repeatable)")
    ap.add_argument("-k", "--draft-tokens", type=int, default=4, help="tokens drafted per round")
    ap.add_argument("--prompts", default=None, help="one prompt per line (default: a few Python lines)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--batch", type=int, action="append", default=None, help="batch sizes (default: 1 and 8)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()

    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    prompts = (Path(args.prompts).read_text().splitlines() if args.prompts else
               ["def main(argv):", "import os", "class Reader:", "for i in range(10):", "def read_file(path):",
                "    return self.", 'if __name__ == "__main__":', "x = [1, 2, 3]"])
    batches = args.batch or [1, 8]
    lm = load_model(args.target)
    params = SamplingParams(max_new_tokens=args.new, greedy=True)
    ratios = {f"{Path(d).name}@b{b}": f">= {GOAL}" for d in args.draft for b in batches}
    print("bench-plan: " + json.dumps(ratios), file=sys.stderr, flush=True)
    load_before = list(os.getloadavg())
    rows = [_row(lm, draft, args, B, prompts, params) for draft in args.draft for B in batches]
    cfg = lm.config
    result = {"target": str(lm.path), "shape": f"d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
                                               f"vocab {cfg.vocab_size}, mtp_depth {cfg.mtp_depth}",
              "prompts": len(prompts), "new_tokens": args.new, "greedy": True, "machine": _cpu(),
              "threads": torch.get_num_threads(), "load_average_before": load_before,
              "load_average_after": list(os.getloadavg()), "goal": f">= {GOAL} at batch 1 with the best drafter",
              "results": rows}
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(text)


def _cpu() -> str:
    """The CPU model (/proc/cpuinfo) and core count."""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()

"""Cost of the stability diagnostics (``train.attention_stats_every``; NCP-ArchPreview Sec. 4.6):
one ``NCPModel.attention_stats`` call over one training step of the same model and micro-batch.

A script, not a test. The step is what the loop runs per optimizer step, without DeepSpeed:
``accum`` micro-batches of forward + backward, then an AdamW step and zero_grad. The call is the
extra no-grad forward of ONE micro-batch with the chunked logit maxima of every attention layer.
Both are timed back to back in every round, alternating who goes first; medians are reported:

  per_call/step   the cost of one call relative to one step (wall clock; CPU time too on the CPU)
  call/forward    the call relative to a plain no-grad forward of the same micro-batch (what the
                  logit maxima add to the forward they ride on)
  at_every_N      that divided by N: the share of training time at train.attention_stats_every=N

Default model: recipes/debug.yaml (debug ConceptLM d=64, 4 layers, seq 256, micro-batch 8).
On a GPU (``--device cuda``) it is bf16 and synchronised around each timed call.

    .venv/bin/python bench/attention_stats.py                               # debug.yaml, CPU, 2 threads
    .venv/bin/python bench/attention_stats.py --recipe recipes/debug-archpreview.yaml --json
    python bench/attention_stats.py --device cuda --set model.d_model=2048 --set model.n_heads=16 ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py shadows stdlib
ROOT = _HERE.parent


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _setup(args: argparse.Namespace) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """({step, call, forward}: one training step, one attention_stats call, one plain no-grad
    forward of the same micro-batch), facts about the shapes)."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.profile.step import random_windows, training_step
    from ncpctl.recipe import load_recipe

    r = load_recipe(Path(args.recipe), args.set)
    cfg, device = r.model_config, torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = NCPModel(cfg).to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # fused/foreach as torch picks: the step is not the point
    mb, T = args.micro_batch or r.train.micro_batch_size, r.seq_len
    batches = [b.to(device) for b in random_windows(cfg.vocab_size, mb, T, seed=1, count=args.accum)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = training_step(model, opt, batches, sync=sync)

    def call() -> Any:
        b = batches[0]
        out = model.attention_stats(b[:, :-1], b[:, 1:])
        torch.stack(list(out.values())).tolist()  # the host copy the loop makes
        sync()
        return out

    def forward() -> Any:
        b = batches[0]
        with torch.no_grad():
            model.eval()
            out = model(b[:, :-1], compute_logits=False)
            model.train()
        sync()
        return out

    facts = {"model": cfg.name, "d_model": cfg.d_model, "layers": len(call()) // 3 - 1, "seq_len": T,
             "micro_batch": mb, "accum": args.accum, "device": str(device), "dtype": str(dtype).split(".")[-1],
             "params": sum(p.numel() for p in model.parameters())}
    return {"step": step, "call": call, "forward": forward}, facts


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ncpctl.profile.timing import clocks

    fns, facts = _setup(args)
    for fn in fns.values():  # warm-up
        fn()
    t: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for i in range(args.rounds):
        order = list(fns.items())
        for name, fn in order if i % 2 == 0 else order[::-1]:
            t[name].append(clocks(fn))
        _say(f"  round {i + 1}/{args.rounds}: step {t['step'][-1][0] * 1e3:.1f} ms, attention_stats "
             f"{t['call'][-1][0] * 1e3:.1f} ms, forward {t['forward'][-1][0] * 1e3:.1f} ms  (load {os.getloadavg()[0]:.1f})")
    med = {clock: {k: statistics.median(x[c] for x in v) for k, v in t.items()} for c, clock in enumerate(("wall", "cpu"))}
    ratio = {clock: round(m["call"] / m["step"], 4) for clock, m in med.items()}
    return {**facts, "rounds": args.rounds, "median_ms": {c: {k: round(v * 1e3, 2) for k, v in m.items()}
                                                         for c, m in med.items()},
            "per_call/step": ratio, "call/forward": {c: round(m["call"] / m["forward"], 4) for c, m in med.items()},
            "at_every_N": {n: round(ratio["wall"] / n, 5) for n in (1, 10, 100)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "debug.yaml"))
    ap.add_argument("--set", action="append", default=[], help="recipe override key.path=value (repeatable)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's train.micro_batch_size")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (the loop's grad_accum_steps)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = {**measure(args), "threads": args.threads, "torch": torch.__version__,
           "wall_s": 0.0, "loadavg_1min": round(os.getloadavg()[0], 2)}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    m = res["median_ms"]["wall"]
    print(f"{res['model']} d={res['d_model']}, {res['layers']} attention layers, {res['accum']} x {res['micro_batch']} "
          f"x {res['seq_len']} tokens/step, {res['device']} {res['dtype']}: step {m['step']:.1f} ms, "
          f"attention_stats {m['call']:.1f} ms = {res['per_call/step']['wall']:.3f} of a step "
          f"(cpu {res['per_call/step']['cpu']:.3f}), {res['call/forward']['wall']:.2f} x a plain forward "
          f"({m['forward']:.1f} ms); at every 100 steps {res['at_every_N'][100]:.5f} of training")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

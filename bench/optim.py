"""Optimizer cost: a training step with ``train.optimizer: muon`` over the same step with AdamW.

A script, not a test. Both optimizers come from ``ncpctl.train.config.make_optimizer`` (the
recipe's groups: Muon on the hidden matrices, AdamW on the rest, vs AdamW on everything), on
the same model, batch and threads, fp32, no DeepSpeed (stage 0: the engine hands the optimizer
the parameters as they are). One step = forward + backward + optimizer step + zero_grad.

Newton-Schulz costs about 10 (2 m^2 n + m^3) FLOPs per (m <= n) matrix and step, independent
of the batch, while the step costs 6 m n per token: its share shrinks only with more tokens per
optimizer step, so the shape is judged at ``--tokens-per-d`` x d tokens per step (default 32;
micro-batches accumulate to it). Reported:

  muon/adamw   median over rounds of the per-round step-time ratio (the two timed back to back,
               alternating who goes first), wall clock (judged) and CPU time of the process
               (on a loaded machine the steadier one). Goal: <= 1.15.
  composed     1 + (Muon+AdamW optimizer step - AdamW step) / AdamW training step: the two steps
               differ only there, and the optimizer steps alone are timed best-of-3 per round.
  ns           the Newton-Schulz time on its own: torch.optim.Muon's iteration on every Muon
               matrix of the model (random inputs of the same shapes), per step, timed in every
               round; and the optimizer steps alone (Muon+AdamW vs AdamW).

The CPU is shared: the 1-minute load average is printed with every round; read the medians
(and, when the load exceeds the cores, the CPU-time and composed ratios).

    .venv/bin/python bench/optim.py                          # d=256 ConceptLM, 8192 tokens/step, 5 rounds
    .venv/bin/python bench/optim.py --d-model 512 --rounds 3 --json
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
GOAL = 1.15


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _recipe(args: argparse.Namespace, optimizer: str):
    from ncpctl.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    sets = [f"model.d_model={args.d_model}", f"model.ffn_dim={4 * args.d_model}", f"model.n_heads={args.d_model // 64}",
            f"model.max_seq_len={args.seq_len}", f"train.seq_len={args.seq_len}", f"train.optimizer={optimizer}",
            "deepspeed.zero_stage=1", "train.grad_clip=0"]  # stage >= 1: no stage-0 guard (DeepSpeed clips)
    return load_recipe(root / "recipes" / "debug.yaml", sets)


def _stepper(args: argparse.Namespace, optimizer: str) -> tuple[Callable[[], float], Any, Any]:
    """(one optimizer step over the accumulated micro-batches, the optimizer, the model)."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.profile.step import random_windows, training_step
    from ncpctl.train.config import make_optimizer

    r = _recipe(args, optimizer)
    torch.manual_seed(0)
    model = NCPModel(r.model_config)
    opt = make_optimizer(model, r, on_gpu=False)
    batches = random_windows(r.model_config.vocab_size, args.micro_batch, args.seq_len, seed=1, count=args.accum)
    return training_step(model, opt, batches), opt, model


def _ns_probe(opt) -> Callable[[], None]:
    """Newton-Schulz alone on random matrices of the shapes of ``opt``'s Muon group, a fused
    matrix as its logical matrices (q, k, v; gate, up), as the step orthogonalises them."""
    import torch

    from ncpctl.train.muon import row_blocks

    (group,) = [g for g in opt.param_groups if g.get("muon")]
    shapes = [(b - a, p.shape[1]) for p, rows in zip(group["params"], opt._fused[group["name"]])
              for a, b in row_blocks(p.shape, rows)]
    # the matrices of one shape in one batch (n, A, B), as the step orthogonalises them
    inputs = [torch.randn(shapes.count(s), *s) for s in dict.fromkeys(shapes)]

    def run() -> None:
        for u in inputs:
            opt._orthogonalise(u, group)

    return run


def _opt_step_only(opt, model) -> Callable[[], None]:
    """The optimizer step alone, on fixed gradients (weights drift a little; irrelevant for time)."""
    import torch

    grads = {p: torch.randn_like(p) * 1e-3 for p in model.parameters() if p.requires_grad}

    def run() -> None:
        for p, gr in grads.items():
            p.grad = gr
        opt.step()

    return run


def _best(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, float]:
    from ncpctl.profile.timing import clocks

    runs = [clocks(fn) for _ in range(repeats)]
    return min(w for w, _ in runs), min(c for _, c in runs)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from ncpctl.profile.timing import clocks

    step_a, opt_a, model_a = _stepper(args, "adamw")
    step_m, opt_m, model_m = _stepper(args, "muon")
    first = {"adamw": step_a(), "muon": step_m()}  # warm-up
    probes = {"ns": _ns_probe(opt_m), "opt_muon": _opt_step_only(opt_m, model_m),
              "opt_adamw": _opt_step_only(opt_a, model_a)}
    for fn in probes.values():
        fn()
    wall: dict[str, list[float]] = {k: [] for k in ("adamw", "muon", *probes)}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    for r in range(args.rounds):
        order = [("adamw", step_a), ("muon", step_m)]
        timed = [(name, clocks(fn)) for name, fn in (order if r % 2 == 0 else order[::-1])]
        timed += [(name, _best(fn)) for name, fn in probes.items()]
        for name, (w, c) in timed:
            wall[name].append(w)
            cpu[name].append(c)
        _say(f"  round {r + 1}/{args.rounds}: wall (cpu) adamw {wall['adamw'][-1]:.2f} ({cpu['adamw'][-1]:.2f}) s, "
             f"muon {wall['muon'][-1]:.2f} ({cpu['muon'][-1]:.2f}) s; NS {wall['ns'][-1] * 1e3:.0f} "
             f"({cpu['ns'][-1] * 1e3:.0f}) ms; opt step muon {wall['opt_muon'][-1] * 1e3:.0f} "
             f"({cpu['opt_muon'][-1] * 1e3:.0f}) / adamw {wall['opt_adamw'][-1] * 1e3:.0f} "
             f"({cpu['opt_adamw'][-1] * 1e3:.0f}) ms  (load {os.getloadavg()[0]:.1f})")

    def ratio(t: dict[str, list[float]]) -> float:  # median of the per-round ratios
        return round(statistics.median(m / a for m, a in zip(t["muon"], t["adamw"])), 4)

    med = {clock: {k: round(statistics.median(v), 5) for k, v in t.items()} for clock, t in (("wall", wall), ("cpu", cpu))}
    (group,) = [g for g in opt_m.param_groups if g.get("muon")]
    # the two steps differ only in the optimizer: (step_adamw - opt_adamw + opt_muon) / step_adamw
    composed = {clock: round(1 + (m["opt_muon"] - m["opt_adamw"]) / m["adamw"], 4) for clock, m in med.items()}
    return {"muon/adamw": ratio(wall), "muon/adamw_cpu": ratio(cpu), "composed": composed,
            "goal": f"<= {GOAL}", "met": ratio(wall) <= GOAL, "median_s": med,
            "ns_share_of_muon_step": {c: round(m["ns"] / m["muon"], 4) for c, m in med.items()},
            "muon_matrices": len(group["params"]), "muon_params": sum(p.numel() for p in group["params"]),
            "params": sum(p.numel() for p in model_m.parameters()), "first_loss": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256, help="width of the debug ConceptLM (ffn 4d, heads d/64)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--tokens-per-d", type=int, default=32, help="tokens per optimizer step = this x d_model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    tokens = args.tokens_per_d * args.d_model
    args.accum = max(1, -(-tokens // (args.micro_batch * args.seq_len)))
    tokens = args.accum * args.micro_batch * args.seq_len
    _say("bench-plan: " + json.dumps({"muon/adamw": f"<= {GOAL}"}))
    _say(f"muon vs adamw: debug ConceptLM d={args.d_model}, {tokens} tokens/step ({args.accum} x {args.micro_batch} "
         f"x {args.seq_len}), fp32, {args.threads} threads, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    t0, load = time.perf_counter(), os.getloadavg()[0]
    res = {"d_model": args.d_model, "tokens_per_step": tokens, "threads": args.threads, "rounds": args.rounds,
           "cpu_cores": os.cpu_count(), "torch": torch.__version__, **measure(args), "wall_s": 0.0}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["loadavg_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    _say("bench-ratio: " + json.dumps({"muon/adamw": {"value": res["muon/adamw"], "goal": res["goal"],
                                                      "met": res["met"]}}))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"d={args.d_model}, {tokens} tokens/step, {res['muon_matrices']} Muon matrices ({res['muon_params']:,} of "
          f"{res['params']:,} parameters), fp32, {args.threads} threads, {args.rounds} rounds, {res['wall_s']} s, "
          f"1-min load {' -> '.join(f'{x:.1f}' for x in res['loadavg_1min'])}")
    for clock in ("wall", "cpu"):
        m = res["median_s"][clock]
        print(f"{clock:4} medians: step adamw {m['adamw']:.3f} s, muon {m['muon']:.3f} s; Newton-Schulz alone "
              f"{m['ns'] * 1e3:.1f} ms ({res['ns_share_of_muon_step'][clock]:.1%} of the muon step); optimizer step "
              f"alone muon {m['opt_muon'] * 1e3:.1f} ms, adamw {m['opt_adamw'] * 1e3:.1f} ms; composed ratio "
              f"{res['composed'][clock]}")
    print(f"muon/adamw = {res['muon/adamw']} (CPU time: {res['muon/adamw_cpu']}); goal {res['goal']}: "
          f"{'MET' if res['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

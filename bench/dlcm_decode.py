"""DLCM cached decode cost per token against the base model of the same token width and layer
count (issue: DLCM, goal <= 1.2x at batch 1 and 8, R = 4).

A script, not a test. ``recipes/debug-dlcm.yaml``'s model (dynamic boundaries, the concept
transformer at d_concept, causal cross-attention to closed concepts) at ``--d-model`` with its
concept width doubled, against two bases with the concept path off, all at the token width:
``matched`` has as many token layers as DLCM has layers (encoder + concept + decoder: how
DLCM builds its inference-FLOPs-matched baseline, recipes/dlcm-baseline-1.3b.yaml's 32 =
10 + 16 + 6), and ``token`` only DLCM's encoder + decoder layers. Prefill of ``--prompt``
random tokens, then ``--steps`` greedy ``decode_step`` calls, seconds per step (B tokens; the
ratio is the same per token) best-of-``--repeats``, the models interleaved. Random weights: the
boundary predictor starts at the identity, and what rate random states give depends on the width
(3.8 tokens per concept at d = 256, 256 at d = 1024), so the inference threshold is set to the
(1 - 1/R) quantile of p on random tokens (``ncpctl.profile.dlcm.calibrate_threshold``), which realises R = 4 as a
trained model's balance loss does (the realised value is printed). The concept
step runs on a step only for the rows that closed a segment (ncpctl.model.core.decode), so at batch
1 it runs on about 1/R of the steps and at batch 8 on most steps, for a few rows: where
decoding is bound by reading the weights (a GPU, or this CPU once the concept layers no longer
fit its cache) a step where any row closes costs a whole read of the concept stack.

    .venv/bin/python bench/dlcm_decode.py                 # d=256, batch 1 and 8, ~1 min
    .venv/bin/python bench/dlcm_decode.py --batches 1,8,32,64   # where the ratio falls to 1.2
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
RECIPE = REPO / "recipes" / "debug-dlcm.yaml"


def per_step(model, B: int, prompt: int, steps: int) -> float:
    """Seconds per decode step (one new token for each of the B rows), after a prefill."""
    import torch

    x = torch.randint(0, model.cfg.vocab_size, (B, prompt), generator=torch.Generator().manual_seed(B))
    with torch.no_grad():
        logits, st = model.prefill(x, [prompt] * B, max_len=prompt + steps + 1)
        nxt = logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = model.decode_step(st, nxt).argmax(-1)
        return (time.perf_counter() - t0) / steps


def work_per_step(model, B: int, prompt: int, steps: int) -> dict[str, float]:
    """What one decode step does, averaged over ``steps``: matmul FLOPs (torch's FlopCounterMode,
    SDPA's math kernel so attention counts as matmuls) and the bytes of weights it reads (every
    module that ran, its parameters once per step; an embedding its B looked-up rows), plus the
    fraction of steps that ran the concept stack. Weight reads are what a step costs where
    decoding is bandwidth-bound (small batches on a GPU; here once the weights outgrow the cache),
    FLOPs where it is compute-bound."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    ran: set[torch.nn.Module] = set()
    hooks = [m.register_forward_pre_hook(lambda mod, _a: ran.add(mod)) for m in model.modules()]
    x = torch.randint(0, model.cfg.vocab_size, (B, prompt), generator=torch.Generator().manual_seed(B))
    concept = getattr(getattr(model, "concept", None), "layers", None)
    weight_bytes, concept_steps = 0, 0
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            logits, st = model.prefill(x, [prompt] * B, max_len=prompt + steps + 1)
            nxt = logits[:, -1].argmax(-1)
            with FlopCounterMode(display=False) as counter:
                for _ in range(steps):
                    ran.clear()
                    nxt = model.decode_step(st, nxt).argmax(-1)
                    for mod in ran:
                        own = list(mod.parameters(recurse=False))
                        if isinstance(mod, torch.nn.Embedding):
                            weight_bytes += B * mod.embedding_dim * mod.weight.element_size()
                        else:
                            weight_bytes += sum(p.numel() * p.element_size() for p in own)
                    concept_steps += concept is not None and concept in ran
    finally:
        for h in hooks:
            h.remove()
    return {"flops": counter.get_total_flops() / steps, "weight_bytes": weight_bytes / steps,
            "concept_step_fraction": concept_steps / steps}


def paper_shape_weight_ratio(batches: list[int]) -> dict[str, float]:
    """The weights a bandwidth-bound decode step reads, recipes/dlcm-2.3b.yaml over
    recipes/dlcm-baseline-1.3b.yaml (meta-device models: shapes only): the token side (every
    module but the concept step's and the embedding) every step, the concept step's (W_up, the
    concept layers, the heads) on the steps where some row closes a segment, 1 - (1 - 1/R)^B of
    them for independent rows at rate 1/R."""
    import torch

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    def sizes(cfg) -> tuple[int, int]:
        with torch.device("meta"):
            model = NCPModel(cfg)
        step = ("concept.layers.", "concept.lift", "concept.heads", "concept.norm")
        own = {n: p.numel() for n, p in model.named_parameters() if not n.startswith("embed.")}
        return (sum(v for n, v in own.items() if not n.startswith(step)),
                sum(v for n, v in own.items() if n.startswith(step)))

    # the recipes' models (their data and tokenizer paths are placeholders): the named size, and
    # recipes/dlcm-baseline-1.3b.yaml's change of it
    tok, con = sizes(build_config("dlcm-2.3b", vocab_size=128815))
    base = sum(sizes(build_config("dlcm-2.3b", vocab_size=128815, n_layers=32, concept=dict(enabled=False))))
    R = 4.0
    return {str(B): (tok + (1 - (1 - 1 / R) ** B) * con) / base for B in batches}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from ncpctl.profile.dlcm import models, tokens_per_concept

    torch.set_num_threads(args.threads)
    bases, dlcm, cfg = models(RECIPE, args.d_model)
    out = {"d_model": args.d_model, "d_concept": cfg.concept.d_concept, "token_layers": cfg.n_token_layers,
           "boundary_threshold": dlcm.concept.segmenter.threshold,
           "concept_layers": cfg.concept.concept_layers, "target_ratio": cfg.concept.target_ratio,
           "threads": args.threads, "batches": {},
           "tokens_per_concept_random_weights": tokens_per_concept(dlcm, 2, 256)}
    names = {"dlcm": dlcm, **{f"base_{k}": m for k, m in bases.items()}}
    for B in (int(b) for b in args.batches.split(",")):
        best = {k: float("inf") for k in names}
        for _ in range(args.repeats):
            for name, m in names.items():
                best[name] = min(best[name], per_step(m, B, args.prompt, args.steps))
        work = {name: work_per_step(m, B, args.prompt, min(args.steps, 64)) for name, m in names.items()}
        out["batches"][str(B)] = {**{f"{k}_ms": v * 1e3 for k, v in best.items()},
                                  **{f"ratio_{k}": best["dlcm"] / best[f"base_{k}"] for k in bases},
                                  "concept_step_fraction": work["dlcm"]["concept_step_fraction"],
                                  **{f"{q}_ratio_{k}": work["dlcm"][q] / work[f"base_{k}"][q]
                                     for k in bases for q in ("flops", "weight_bytes")}}
    out["paper_shape_weight_ratio"] = paper_shape_weight_ratio([int(b) for b in out["batches"]])
    out["loadavg_1min"] = round(os.getloadavg()[0], 2)
    L = cfg.n_token_layers + cfg.concept.concept_layers
    for B, r in out["batches"].items():
        print(f"batch {B}: DLCM {r['dlcm_ms']:.3f} ms/step; base of {L} layers (matched) {r['base_matched_ms']:.3f}, "
              f"ratio {r['ratio_matched']:.3f} (goal <= 1.2); base of {cfg.n_token_layers} token layers "
              f"{r['base_token_ms']:.3f}, ratio {r['ratio_token']:.3f}", file=sys.stderr)
        print(f"    per step against the matched base: FLOPs {r['flops_ratio_matched']:.3f}x, weights read "
              f"{r['weight_bytes_ratio_matched']:.3f}x (the concept stack ran on {100 * r['concept_step_fraction']:.0f}% "
              f"of the steps)", file=sys.stderr)
    print("at the paper's shape (dlcm-2.3b over dlcm-baseline-1.3b) a bandwidth-bound step reads "
          + ", ".join(f"{v:.2f}x the weights at batch {B}" for B, v in out["paper_shape_weight_ratio"].items()),
          file=sys.stderr)
    print(f"d={out['d_model']} (concepts {out['d_concept']}), {cfg.n_token_layers} token + {cfg.concept.concept_layers} "
          f"concept layers, R = {out['target_ratio']}, tokens per concept {out['tokens_per_concept_random_weights']:.2f} "
          f"(random weights, threshold {out['boundary_threshold']:.4f}), load {out['loadavg_1min']}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

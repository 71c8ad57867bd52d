"""Causal Diffusion LM training-step cost (issue 23): one noisy copy vs AR and vs two copies.

A script, not a test. Three models of one shape, trained alike (fp32, forward + backward +
AdamW + zero_grad, ``ncpctl.profile.step.training_step``), random tokens:

  ar     next-token prediction (``objective: next_token``): causal attention, SDPA ``is_causal``.
  cdlm   Steerling's Causal Diffusion LM (``objective: causal_diffusion``, block 64): the T inputs
         with each block masked at its own rate, block-causal attention through a boolean mask
         (the pattern cannot use ``is_causal``), the loss on the masked tokens.
  bd     a two-copy Block Diffusion step (BD3-LM's training input, what Causal Diffusion avoids):
         the noisy copy and the clean copy concatenated (2T tokens, each copy at positions 0..T-1),
         noisy block j attending to itself and to the clean blocks before it, clean block j to the
         clean blocks up to it; the loss on the noisy copy's masked tokens. The same model as cdlm
         with its token context swapped for the 2T one: only the input and the mask differ.

Ratios (median over rounds of the per-round ratio, models timed alternately, ABBA order):
  cdlm/ar   goal <= 1.15 (one noisy copy, not two)
  cdlm/bd   goal <= 0.60
One extra step of each is profiled: the attention kernel's share of the step (SDPA forward and
backward, their total time over the profiled step's). The 1-minute load average is printed with
every round: on a shared machine, read it. Sampling with block caches is measured by
``bench/cdlm_sampling.py``.

    .venv/bin/python bench/cdlm.py                                   # debug and pythia-70m, T=512
    .venv/bin/python bench/cdlm.py --sizes debug --rounds 5 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py shadows stdlib

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Callable  # noqa: E402

from ncpctl.profile.timing import paired_ratios, timed  # noqa: E402

GOALS = {"cdlm/ar": 1.15, "cdlm/bd": 0.60}
BATCH = {"debug": 8, "pythia-70m": 2}
MASK_ID = 1


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def two_copy_mask(T: int, block: int):
    """BD3-LM's training mask over [noisy copy; clean copy] (1, 1, 2T, 2T), True = attend."""
    import torch

    b = torch.arange(T) // block
    same = b[:, None] == b[None, :]
    before = b[None, :] < b[:, None]
    upto = b[None, :] <= b[:, None]
    zero = torch.zeros(T, T, dtype=torch.bool)
    top = torch.cat([same, before], dim=1)  # noisy queries: own noisy block, earlier clean blocks
    bottom = torch.cat([zero, upto], dim=1)  # clean queries: clean blocks up to their own
    return torch.cat([top, bottom], dim=0)[None, None]


def two_copy(model, T: int):
    """Swap ``model``'s token context for the 2T two-copy one (positions 0..T-1 twice)."""
    import torch

    from ncpctl.model.core.layers import Context, rope

    pos = torch.cat([torch.arange(T), torch.arange(T)])[None]
    cos, sin = rope(pos, model.cfg, model.embed.weight.dtype)
    mask = two_copy_mask(T, model.cfg.diffusion.block_size)
    ctx = Context(cos, sin, {p.key: mask for p in model.token_patterns})

    def token_context(n, device, dtype, doc_ids=None):  # NCPModel.token_context's signature
        assert doc_ids is None, "the two-copy step has no document masks"
        return ctx, pos

    model.token_context = token_context  # instance attribute: this model only
    return model


def models(size: str, T: int, block: int) -> dict[str, Any]:
    import torch

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    ar = build_config(size, max_seq_len=T)
    cd = build_config(size, max_seq_len=T, objective="causal_diffusion",
                      diffusion=dict(block_size=block, mask_id=MASK_ID))
    out = {}
    for name, cfg in (("ar", ar), ("cdlm", cd), ("bd", cd)):
        torch.manual_seed(0)  # the same initial weights for all three
        out[name] = NCPModel(cfg).train()
    two_copy(out["bd"], T)
    return out


def batches(ms: dict[str, Any], B: int, T: int) -> dict[str, tuple[Any, Any]]:
    import torch

    from ncpctl.profile.step import random_windows

    (w,) = random_windows(ms["ar"].cfg.vocab_size - 2, B, T)
    w = w + 2  # no EOD or [MASK] among the data tokens
    ids = torch.arange(B)
    xn, yn = ms["cdlm"].objective.keyed_batch(w, ids)  # (B, T): the noisy copy and its targets
    clean = w[:, :-1]
    return {
        "ar": (w[:, :-1], w[:, 1:]),
        "cdlm": (xn, yn),
        "bd": (torch.cat([xn, clean], 1), torch.cat([yn, torch.full_like(yn, -100)], 1)),
    }


def attention_share(step: Callable[[], float]) -> float:
    """The SDPA kernels' share (forward + backward) of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    # top-level SDPA ops, children included (the math fallback's matmuls are SDPA's too)
    attn = sum(e.cpu_time_total for e in ev if e.key == "aten::scaled_dot_product_attention"
               or (e.key.startswith("aten::_scaled_dot_product") and e.key.endswith("_backward")))
    return attn / total


def run(size: str, B: int, T: int, block: int, rounds: int) -> dict[str, Any]:
    from ncpctl.profile.step import adamw, training_step

    ms = models(size, T, block)
    data = batches(ms, B, T)
    steps = {n: training_step(m, adamw(m.parameters()), forward=(lambda m=m, xy=data[n]: m(*xy).loss))
             for n, m in ms.items()}
    first = {n: fn() for n, fn in steps.items()}  # warm-up
    secs: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(rounds):
        for n, fn in (list(steps.items()) if r % 2 == 0 else list(steps.items())[::-1]):
            gc.collect()
            secs[n].append(timed(fn)[0])
        _say(f"  {size} round {r + 1}/{rounds}: " + ", ".join(f"{n} {s[-1]:.3f}s" for n, s in secs.items())
             + f"  (load {os.getloadavg()[0]:.1f})")
    share = {n: attention_share(fn) for n, fn in steps.items()}
    ratios = {"cdlm/ar": paired_ratios(secs["cdlm"], secs["ar"]), "cdlm/bd": paired_ratios(secs["cdlm"], secs["bd"])}
    for k, v in ratios.items():
        _say("bench-ratio: " + json.dumps({"name": f"{size} {k}", "value": v["paired_median"], "goal": GOALS[k]}))
    return {"size": size, "batch": B, "seq_len": T, "block": block, "first_loss": first, "seconds": secs,
            "median_s": {n: statistics.median(s) for n, s in secs.items()}, "attention_share": share,
            "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="debug,pythia-70m")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    sizes = [s for s in a.sizes.split(",") if s]
    _say("bench-plan: " + json.dumps([f"{s} {k}" for s in sizes for k in GOALS]))
    res = [run(s, BATCH.get(s, 1), a.seq_len, a.block, a.rounds) for s in sizes]
    out = {"machine": platform.processor() or platform.machine(), "threads": a.threads,
           "load_1min": os.getloadavg()[0], "results": res, "goals": GOALS}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{'size':11} {'B':>2} {'T':>4}  {'ar s':>7} {'cdlm s':>7} {'bd s':>7}  {'cdlm/ar':>8} {'cdlm/bd':>8}  "
          "attention share (ar / cdlm / bd)")
    for r in res:
        m, q, sh = r["median_s"], r["ratios"], r["attention_share"]
        print(f"{r['size']:11} {r['batch']:>2} {r['seq_len']:>4}  {m['ar']:7.3f} {m['cdlm']:7.3f} {m['bd']:7.3f}  "
              f"{q['cdlm/ar']['paired_median']:8.3f} {q['cdlm/bd']['paired_median']:8.3f}  "
              f"{sh['ar']:.2f} / {sh['cdlm']:.2f} / {sh['bd']:.2f}")
    print(f"goals: cdlm/ar <= {GOALS['cdlm/ar']}, cdlm/bd <= {GOALS['cdlm/bd']}; "
          f"{a.threads} threads, load {out['load_1min']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

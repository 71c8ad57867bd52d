"""Causal Diffusion LM likelihood bound: one two-copy forward per sample against one forward per
block (issue 43 item 6; ``ncpctl.model.designs.causal_diffusion.module.estimates``, ``method``).

A script, not a test. ``recipes/debug-cdlm.yaml``'s model (random weights: the speed does not
depend on them; ``max_seq_len`` raised to ``--seq-len``), ``--batch`` random windows of
``--seq-len`` tokens, every token scored (validation's bound), ``--samples`` Monte Carlo samples,
the same keyed masks for both methods: the estimates must agree (``max_abs_diff_per_token``, nats)
and the two-copy one should be faster (goal >= 2x at T = 512). Best of ``--repeats``, the two
interleaved; the load average is printed with the result: on a shared machine, read it.

    OMP_NUM_THREADS=2 .venv/bin/python bench/cdlm_bound.py                      # T = 128 and 512
    OMP_NUM_THREADS=2 .venv/bin/python bench/cdlm_bound.py --seq-len 128 --json
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
GOAL = 2.0  # per_block seconds / two_copy seconds at the largest --seq-len


def build(T: int, size: str | None = None):
    """The debug-cdlm model (its recipe's model section, [MASK] = 1), ``max_seq_len`` >= T."""
    import torch
    import yaml

    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    r = yaml.safe_load(RECIPE.read_text())
    m = dict(r["model"])
    recipe_size = m.pop("size")
    m["max_seq_len"] = max(m.get("max_seq_len", 0), T)
    m["diffusion"] = {**m["diffusion"], "mask_id": 1}
    torch.manual_seed(0)
    return NCPModel(build_config(size or recipe_size, vocab_size=r["tokenizer"]["vocab_size"], **m)).eval()


def measure(T: int, batch: int, samples: int, repeats: int, size: str | None) -> dict:
    import torch

    from ncpctl.model.designs.causal_diffusion.module import estimates

    model = build(T, size)
    x = torch.randint(2, model.cfg.vocab_size, (batch, T), generator=torch.Generator().manual_seed(1))
    best, est = {}, {}
    estimates(model, x[:, : model.objective.block * 2], samples=1)  # warm-up
    for _ in range(repeats):
        for method in ("per_block", "two_copy"):
            t0 = time.perf_counter()
            est[method] = estimates(model, x, samples=samples, method=method)
            best[method] = min(best.get(method, float("inf")), time.perf_counter() - t0)
    diff = float((est["two_copy"] - est["per_block"]).abs().max()) / T
    return {"seq_len": T, "batch": batch, "samples": samples, "block": model.objective.block,
            "per_block_s": round(best["per_block"], 4), "two_copy_s": round(best["two_copy"], 4),
            "speedup": round(best["per_block"] / best["two_copy"], 2), "max_abs_diff_per_token": diff,
            "bound_per_token": float(est["two_copy"].sum(0).mean()) / (batch * T)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", default="128,512", help="comma-separated window lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--samples", type=int, default=4, help="Monte Carlo samples (validation's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--size", default=None, help="another named size with the recipe's other model keys")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lengths = [int(t) for t in a.seq_len.split(",") if t]
    print("bench-plan: " + json.dumps({"per_block_over_two_copy": f">= {GOAL}"}), file=sys.stderr, flush=True)
    rows = [measure(T, a.batch, a.samples, a.repeats, a.size) for T in lengths]
    ratio = rows[-1]["speedup"]
    print("bench-ratio: " + json.dumps({"per_block_over_two_copy": {"value": ratio, "goal": f">= {GOAL}",
                                                                    "met": ratio >= GOAL}}), file=sys.stderr, flush=True)
    out = {"rows": rows, "threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
           "goal": f"per_block / two_copy >= {GOAL} at T = {lengths[-1]}", "met": ratio >= GOAL}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{'T':>5} {'per_block s':>12} {'two_copy s':>11} {'speed-up':>9} {'max |diff|/token':>17}")
    for r in rows:
        print(f"{r['seq_len']:>5} {r['per_block_s']:>12.4f} {r['two_copy_s']:>11.4f} {r['speedup']:>9.2f} "
              f"{r['max_abs_diff_per_token']:>17.2e}")
    print(f"{out['goal']}; {out['threads']} threads, load {out['load_average'][0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

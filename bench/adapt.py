"""VQ adaptation against its baselines (NCP-ArchPreview Sec. 5.1, Fig. 7): tokens/s and peak memory.

A script, not a test. Three arms adapt one model at one shape, each with ncpctl's own stage
set-up (``ncpctl.train``): ``vq`` (``freeze_all_but_codebook``: the learned codebook and the
concept heads train), ``lora`` (``apply_lora`` at the rank whose trainable count is closest to
vq's, on the four projections of every block: ``recipes/adapt/lora.yaml``'s rule) and ``full``
(every weight). One step = forward (the full loss: NTP + NCP + VQ) + backward + gradient clipping
+ AdamW over the trained parameters + zero_grad, the same code for every arm (no DeepSpeed).

The shape keeps NCP-ArchPreview 8.9B's proportions at CPU size: E/C/D = 4/2/4 (16/8/16 / 4),
FFN 2.6875 d, S = d/32 segments of N = 128 codes, learned codebook, sliding window with every
4th layer full; d = 256, vocab 4096, T = 512, batch 2, fp32.

Measured:
  memory     per arm in its own process (so that its memory is its own): peak resident set size
             (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after a warm-up and one step, minus
             the resident set after the imports, before the model is built: weights, gradients,
             optimizer state, activations and the allocator's caching, a CPU stand-in for Fig. 7's
             share of GPU memory. ``tracemalloc`` would not see tensors (torch allocates them
             outside Python's allocator).
  tokens/s   the three arms in one process, stepped in turn (vq, lora, full, then lora, full, vq,
             ...; one untimed warm-up step each), so that load from other processes on a shared
             machine hits all alike; per round (``--steps`` turns) B*T / each arm's median step
             time. The value judged against the goal is the median over rounds of the per-round
             ratio. Every round is printed, with the 1-minute load average.
The exact training FLOPs of each arm (what MFU counts: ``exact_flops(..., trainable=...)``) are
printed next to the measured ratios.

Paper (Fig. 7, 8 GPUs, micro-batch 1): VQ 2.02x full fine-tuning and 1.50x LoRA in tokens/s;
memory 32.4% / 49.0% / 90.3% of the GPU for VQ / LoRA / full. Goal here: vq/full tokens/s >= 1.5.

    .venv/bin/python bench/adapt.py                   # 3 rounds of 3 turns, ~3-5 minutes on 2 busy cores
    .venv/bin/python bench/adapt.py --rounds 5 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds tokenize.py: drop this folder from the import path, or `import tokenize`
# (stdlib, used by inspect) would import that script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

ARMS = ("vq", "lora", "full")
GOALS = {"vq/full tokens/s": 1.5}
PAPER = {"vq/full tokens/s": 2.02, "vq/lora tokens/s": 1.50, "memory vq": 0.324, "memory lora": 0.490,
         "memory full": 0.903}
SHAPE = dict(d_model=256, n_layers=8, n_heads=8, ffn_dim=688, vocab_size=4096, max_seq_len=512,
             sliding_window=256, concept=dict(encoder_layers=4, concept_layers=2, segments=8, codes=128,
                                              codebook="learned"))
T, B = 512, 2


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _config():
    from ncpctl.model.core.config import build_config

    return build_config("ncp-archpreview-8.9b", **SHAPE)


def lora_rank(cfg) -> tuple[int, int]:
    """The rank whose LoRA count is closest to adapt-vq's, and that count (meta device)."""
    from functools import partial

    from ncpctl.model.accounting.flops import count_parameters
    from ncpctl.recipe.schema import LoraSection
    from ncpctl.train.lora import apply_lora
    from ncpctl.train.stages import freeze_all_but_codebook

    vq = count_parameters(cfg, freeze_all_but_codebook).trainable
    per_rank = count_parameters(cfg, partial(apply_lora, spec=LoraSection(rank=1))).trainable
    rank = max(1, min(range(1, 257), key=lambda r: abs(r * per_rank - vq)))
    return rank, rank * per_rank


def setup(arm: str, cfg):
    """The arm's stage set-up (what ``make_stage`` gives each recipe of recipes/adapt/)."""
    from functools import partial

    from ncpctl.recipe.schema import LoraSection
    from ncpctl.train.lora import apply_lora
    from ncpctl.train.stages import freeze_all_but_codebook

    if arm == "vq":
        return freeze_all_but_codebook
    if arm == "lora":
        return partial(apply_lora, spec=LoraSection(rank=lora_rank(cfg)[0]))
    return None


def _arm(arm: str, cfg, seed: int = 0):
    """The arm's model, set up, and its ``step() -> seconds`` (one warm-up step already taken)."""
    import torch

    from ncpctl.model.core.model import NCPModel
    from ncpctl.profile.step import training_step
    from ncpctl.profile.timing import timed

    torch.manual_seed(seed)
    model = NCPModel(cfg)
    prepare = setup(arm, cfg)
    if prepare is not None:
        prepare(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    one = training_step(model, opt, [x], clip=1.0)

    def step() -> float:
        return timed(one)[0]

    step()  # warm-up: allocations, optimizer state
    return model, step


def memory_child(arm: str, threads: int) -> dict[str, Any]:
    """One arm alone in this process: peak RSS over the post-import baseline, after two steps."""
    import resource

    import torch

    from ncpctl.model.accounting.flops import exact_flops

    torch.set_num_threads(threads)
    cfg = _config()
    if arm == "lora":
        import peft  # noqa: F401  (imported before the baseline: its import is not the arm's memory)
    base_kb = _rss_kb()
    model, step = _arm(arm, cfg)
    step()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    flops = exact_flops(cfg, T, B, trainable=None if arm == "full" else trainable).training_per_step(causal=True)
    return {"arm": arm, "trainable": sum(trainable.values()), "memory_mb": (peak_kb - base_kb) / 1024,
            "train_flops_per_step": flops}


def speed_child(rounds: int, steps: int, threads: int) -> list[dict[str, Any]]:
    """All three arms in this process, stepped in turn (vq, lora, full; then lora, full, vq; ...):
    each round is ``steps`` such turns; per round the median step time of every arm."""
    import torch

    torch.set_num_threads(threads)
    cfg = _config()
    stepper = {arm: _arm(arm, cfg)[1] for arm in ARMS}
    out = []
    for i in range(rounds):
        load = os.getloadavg()[0]
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for j in range(steps):
            k = (i * steps + j) % 3
            for arm in ARMS[k:] + ARMS[:k]:
                times[arm].append(stepper[arm]())
        out.append({"round": i + 1, "load_1min": round(load, 2),
                    "tokens_per_s": {arm: B * T / statistics.median(t) for arm, t in times.items()},
                    "step_s": times})
        _say(f"round {i + 1} (load {load:.2f}): " + ", ".join(
            f"{arm} {out[-1]['tokens_per_s'][arm]:,.0f} tok/s" for arm in ARMS))
    return out


def _child(args: list[str], threads: int) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(_HERE.parent)}
    proc = subprocess.run([sys.executable, __file__, *args, "--threads", str(threads)], text=True,
                          stdout=subprocess.PIPE, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench/adapt.py {' '.join(args)} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="turns of the three arms per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--memory-child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--speed-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.memory_child:
        print(json.dumps(memory_child(a.memory_child, a.threads)))
        return 0
    if a.speed_child:
        print(json.dumps(speed_child(a.rounds, a.steps, a.threads)))
        return 0
    print("bench-plan: " + json.dumps({k: f">= {v}" for k, v in GOALS.items()}), file=sys.stderr, flush=True)
    mem = {arm: _child(["--memory-child", arm], a.threads) for arm in ARMS}
    _say("memory (peak RSS over the post-import baseline): "
         + ", ".join(f"{arm} {mem[arm]['memory_mb']:,.0f} MB" for arm in ARMS))
    rounds = _child(["--speed-child", "--rounds", str(a.rounds), "--steps", str(a.steps)], a.threads)
    for r in rounds:
        tps = r["tokens_per_s"]
        r["ratios"] = {"vq/full": tps["vq"] / tps["full"], "vq/lora": tps["vq"] / tps["lora"],
                       "lora/full": tps["lora"] / tps["full"]}
    judged = {f"{k} tokens/s": statistics.median(r["ratios"][k] for r in rounds) for k in rounds[0]["ratios"]}
    memory = {f"memory {arm}/full": mem[arm]["memory_mb"] / mem["full"]["memory_mb"] for arm in ("vq", "lora")}
    flops = {arm: mem[arm]["train_flops_per_step"] for arm in ARMS}
    out = {"shape": {**SHAPE, "seq_len": T, "batch": B, "threads": a.threads}, "rounds": rounds,
           "median_ratios": judged, "memory_mb": {arm: mem[arm]["memory_mb"] for arm in ARMS}, "memory_ratios": memory,
           "trainable": {arm: mem[arm]["trainable"] for arm in ARMS},
           "train_flops_ratio": {"vq/full": flops["vq"] / flops["full"], "lora/full": flops["lora"] / flops["full"]},
           "paper": PAPER,
           "goals": {k: {"value": judged[k], "goal": f">= {v}", "met": judged[k] >= v} for k, v in GOALS.items()}}
    for k, v in out["goals"].items():
        print("bench-ratio: " + json.dumps({k: v}), file=sys.stderr, flush=True)
    _say("per round: " + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items()) for r in rounds))
    _say("trainable: " + ", ".join(f"{arm} {n:,}" for arm, n in out["trainable"].items())
         + f"; training FLOPs vs full: vq {out['train_flops_ratio']['vq/full']:.3f}, "
         f"lora {out['train_flops_ratio']['lora/full']:.3f}")
    _say("median over rounds: " + ", ".join(f"{k} {v:.2f}" for k, v in judged.items())
         + "; memory vs full: " + ", ".join(f"{k.split()[1]} {v:.2f}" for k, v in memory.items())
         + "  (paper: vq/full 2.02, vq/lora 1.50; memory vq 32%, lora 49%, full 90% of the GPU)")
    if a.json:
        print(json.dumps(out))
    return 0 if all(g["met"] for g in out["goals"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

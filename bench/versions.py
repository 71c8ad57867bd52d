"""Two versions of ncpctl, timed against each other in one run: does a change slow training?

A script, not a test. ``--before`` and ``--after`` are source trees of the package (for example
``git worktree add /tmp/before <commit>`` beside the current checkout). Each (tree, model) pair
runs in its own worker process that imports ncpctl from its tree only, builds the model once
(same seed, same batch) and times one optimizer step per request: forward + backward + AdamW
(fused) + zero_grad, fp32, random tokens, ``--threads`` threads; a request runs ``--repeats``
steps and answers the fastest (the minimum is what the code costs; a slower step met interference
from outside, which on a shared machine moves single steps by 10-20%). The driver asks the workers in
turn, in pairs ordered A, B, B, A, ... (before, after, then after, before), so load from other
processes hits both versions alike, and judges the median over pairs of after/before; the goal
(issue 22) is <= 1.02 for the base model and for ConceptLM, over at least 7 pairs. Every pair
and the 1-minute load average are printed.

Models, at ``--size`` (default pythia-70m, B=4, T=512, the shape of bench/train_step.py):
  ours       the backbone alone (concept.enabled=false)
  conceptlm  ConceptLM: E=1, C=2, k=4 (bench/train_step.py's concept arm)

    .venv/bin/python bench/versions.py --before /tmp/before --after . --pairs 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"ours": {}, "conceptlm": {"concept": {"enabled": True, "k": 4, "encoder_layers": 1, "concept_layers": 2}}}
BATCH = {"debug": 4, "pythia-70m": 4, "pythia-160m": 2}  # debug: the smoke test's size (tests/test_bench_smoke.py)


def worker(tree: str, model: str, size: str, T: int, B: int, repeats: int = 1) -> None:
    """Serve timing requests on stdin: one line in, one line out (seconds of one step)."""
    sys.path[:] = [tree] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    import torch

    import ncpctl
    try:  # the model's rooms (issue 44); a tree from before them has the flat modules
        from ncpctl.model.core.config import build_config
        from ncpctl.model.core.model import NCPModel
    except ModuleNotFoundError:
        from ncpctl.model.config import build_config  # type: ignore[no-redef]
        from ncpctl.model.model import NCPModel  # type: ignore[no-redef]

    if not str(Path(ncpctl.__file__).resolve()).startswith(str(Path(tree).resolve())):
        raise SystemExit(f"imported ncpctl from {ncpctl.__file__}, not from {tree}")
    cfg = build_config(size, max_seq_len=T, **MODELS[model])
    torch.manual_seed(0)
    net = NCPModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    x, y = idx[:, :T], idx[:, 1:]

    def step() -> float:
        loss = net(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = step()  # warm-up
    print(json.dumps({"ready": True, "loss": loss}), flush=True)
    for _ in sys.stdin:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": min(times), "all": times}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="source tree of the version before the change")
    p.add_argument("--after", help="source tree of the version after the change")
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--size", default="pythia-70m", choices=sorted(BATCH))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="steps per timing; the fastest counts")
    p.add_argument("--models", default="ours,conceptlm")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("TREE", "MODEL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    B = BATCH[a.size]
    if a.worker:
        return worker(a.worker[0], a.worker[1], a.size, a.seq_len, B, a.repeats)
    if not (a.before and a.after):
        p.error("--before and --after (two source trees) are required")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH="")
    out: dict = {"size": a.size, "batch": B, "seq_len": a.seq_len, "threads": a.threads, "repeats": a.repeats,
                 "models": {}}
    for model in a.models.split(","):
        procs = {}
        for name, tree in (("before", a.before), ("after", a.after)):
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(Path(tree).resolve()), model, "--size", a.size,
                 "--seq-len", str(a.seq_len), "--repeats", str(a.repeats)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        losses = {}
        for n, pr in procs.items():
            line = pr.stdout.readline()
            if not line:
                raise SystemExit(f"{model}: the {n} worker ({getattr(a, n)}) failed before its first step")
            losses[n] = json.loads(line)["loss"]
        if abs(losses["before"] - losses["after"]) > 1e-4:
            raise SystemExit(f"{model}: first-step losses differ ({losses}): the versions compute different things")

        def timed(name: str) -> float:
            procs[name].stdin.write("step\n")
            procs[name].stdin.flush()
            return json.loads(procs[name].stdout.readline())["seconds"]

        pairs = []
        for i in range(a.pairs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            s = {n: timed(n) for n in order}
            load = os.getloadavg()[0]
            pairs.append({"before_s": s["before"], "after_s": s["after"], "ratio": s["after"] / s["before"],
                          "load": load, "order": "AB" if i % 2 == 0 else "BA"})
            print(f"{model} pair {i + 1}: before {s['before']:.3f}s after {s['after']:.3f}s "
                  f"ratio {pairs[-1]['ratio']:.3f} (load {load:.2f})", file=sys.stderr, flush=True)
        for pr in procs.values():
            pr.stdin.close()
            pr.wait()
        med = statistics.median(x["ratio"] for x in pairs)
        out["models"][model] = {"pairs": pairs, "median_ratio": med, "first_loss": losses, "goal": 1.02,
                                "met": med <= 1.02}
        print(f"{model}: median after/before over {len(pairs)} pairs = {med:.3f} (goal <= 1.02)",
              file=sys.stderr if a.json else sys.stdout, flush=True)
    if a.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Steering benchmark (Steerling-8B Table 18 style): does adding a labelled concept's direction
make a model write about it, and what does it cost in fluency?

A script, not a test. A debug-size concept-bottleneck model trained on the built-in corpus with
the built-in ast labeller (``recipes/debug-bottleneck.yaml``; trained here into ``--run-dir``
unless that holds a checkpoint already, about 1.5 min on 2 cores) continues a set of Python
prompts. For each labelled concept with a detector (below) and each method:

  none      the prompt as is (the unsteered base rate)
  prompt    the prompting baseline: a leading comment naming the concept (``# <description>``)
  steer@S   ``ncpctl generate --steer concept=NAME,strength=S logit,at=readout`` (the bottleneck's
            output, where adding gamma * K_c raises k_c: Steerling's intervention; ``--at decoder.3``
            etc. for a layer's stream), for several strengths S

for two models: the pretrained one, and the same after Steerling's steering stage
(``recipes/debug-bottleneck-steer.yaml``: 90 steps of ``ncpctl midtrain`` that inject a labelled
concept's direction where the labels say the text is about it, with the respond and express
losses; trained into ``--run-dir``-steer; ``--no-steering-stage`` skips it). Each model's
unsteered continuations are its own reference.

each continuation is scored by

  concept   whether the concept's detector fires on the continuation (a regular expression per
            concept: a small model's continuations rarely parse, so ``ast`` cannot detect)
  quality   min(1, ppl_ref / ppl): its perplexity under the unsteered model given the original
            prompt (no comment), relative to the median perplexity of the unsteered continuations
  parse     whether prompt + continuation parses (an extra column)

and each (concept, method) gets its mean concept score, mean quality and their harmonic mean
(Steerling's combined score). Sampling: temperature 0.8, top-p 0.95, ``--samples`` seeds per
prompt, the same seeds for every method.

    .venv/bin/python bench/steering.py                      # train (or reuse) both and score, ~4 min
    .venv/bin/python bench/steering.py --strengths 1,2,4 --samples 4 --json
    .venv/bin/python bench/steering.py --at decoder.3 --strengths 1,2,4,8
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # bench/tokenize.py vs stdlib

import argparse  # noqa: E402
import ast  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

REPO = _HERE.parent
RECIPE = REPO / "recipes" / "debug-bottleneck.yaml"
STAGE = REPO / "recipes" / "debug-bottleneck-steer.yaml"  # Steerling's steering stage on top of it
PROMPTS = [
    "def load(path):\n    ",
    "class Config:\n    def __init__(self, name):\n        self.name = name\n\n    def ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "    result = []\n    for item in items:\n        ",
    "def parse(text):\n    \"\"\"Parse text.\"\"\"\n    ",
    "\n\ndef run(self, args):\n    ",
]
# concept -> regular expression on the continuation (re.M)
DETECTORS = {
    "exception_handling": r"\btry\s*:|\bexcept\b|\braise\b|\bfinally\s*:",
    "imports": r"^\s*(import|from)\s+\w",
    "loops": r"\bfor\s+\w+.*\bin\b|\bwhile\b",
    "tests": r"\bassert\b|\bdef\s+test_|\bself\.assert\w+",
    "docstrings": r'"""|\'\'\'',
    "string_formatting": r'\bf"|\bf\'|\.format\(|["\']\s*%\s*[(\w]',
    "context_managers": r"\bwith\s+\w",
    "class_definition": r"\bclass\s+\w+",
    "function_definition": r"\bdef\s+\w+\s*\(",
    "file_io": r"\bopen\(|\.read\w*\(|\.write\w*\(",
}


def _ncpctl(*args: str) -> None:
    exe = Path(sys.executable).parent / "ncpctl"
    subprocess.run([str(exe), *args], check=True, stdout=subprocess.DEVNULL)


def checkpoint(run_dir: Path, steps: int) -> Path:
    """The newest checkpoint of ``run_dir``, training recipes/debug-bottleneck.yaml there first if none."""
    from ncpctl.checkpoint import resolve

    try:
        return resolve(run_dir)
    except Exception:
        pass
    sets = ["--set", f"run.dir={run_dir}", "--set", f"train.max_steps={steps}"]
    t0 = time.perf_counter()
    _ncpctl("tokenize", str(RECIPE), *sets)
    _ncpctl("pretrain", str(RECIPE), *sets)
    print(f"trained {RECIPE.name} for {steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return resolve(run_dir)


def stage_checkpoint(run_dir: Path, base: Path) -> Path:
    """The steering stage (recipes/debug-bottleneck-steer.yaml) on top of checkpoint ``base``, in
    ``run_dir``-steer (reused when it holds a checkpoint)."""
    from ncpctl.checkpoint import resolve

    out = run_dir.with_name(run_dir.name + "-steer")
    try:
        return resolve(out)
    except Exception:
        pass
    data = run_dir / "data"
    sets = [x for kv in (f"run.dir={out}", f"train.init_from={base}", f"data.train_prefix={data / 'train'}",
                         f"data.val_prefix={data / 'val'}") for x in ("--set", kv)]
    t0 = time.perf_counter()
    _ncpctl("midtrain", str(STAGE), *sets)
    print(f"trained the steering stage {STAGE.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return resolve(out)


def _nll(model, tok, prompt: str, text: str) -> float:
    """Mean negative log-likelihood of ``text``'s tokens after ``prompt`` under ``model``."""
    import torch

    p = tok.encode(prompt, add_special_tokens=False).ids
    c = tok.encode(text, add_special_tokens=False).ids
    if not c:
        return float("nan")
    ids = torch.tensor(p + c)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    tgt = ids[0, 1:]
    return float(-logp.gather(-1, tgt[:, None])[len(p) - 1 :, 0].mean())


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def run(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams
    from ncpctl.inference.generate import generate_texts
    from ncpctl.interpret.steer import SteerSpec, resolve

    torch.set_num_threads(args.threads)
    loaded = load_model(path)
    model, tok, names = loaded.model, loaded.tokenizer, loaded.meta.get("concept_names") or []
    from ncpctl.data.labels import PYTHON_CONCEPTS

    concepts = [c for c in DETECTORS if c in names]
    at = args.at
    strengths = [float(s) for s in args.strengths.split(",") if s]
    methods = ["none", "prompt", *(f"steer@{s:g}" for s in strengths)]
    prompts = PROMPTS[: args.prompts]
    seeds = list(range(args.samples))

    def sample(texts: list[str], steer=None) -> list[str]:
        out = []
        for seed in seeds:
            p = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=1000 * seed)
            done = generate_texts(loaded, texts, p, steer=None if steer is None else [steer] * len(texts))
            out += [c.text for c in done]
        return out

    t0 = time.perf_counter()
    base = sample(prompts)  # method "none": one set shared by every concept
    ctx = [p for _ in seeds for p in prompts]  # the original prompt of each continuation
    base_nll = [_nll(model, tok, p, c) for p, c in zip(ctx, base)]
    ref_ppl = statistics.median(math.exp(x) for x in base_nll if math.isfinite(x))
    rows = []
    for concept in concepts:
        det = re.compile(DETECTORS[concept], re.M)
        outs = {"none": base,
                "prompt": sample([f"# {PYTHON_CONCEPTS[concept]}\n{p}" for p in prompts])}
        for s in strengths:
            r = resolve(model, SteerSpec.parse(f"concept={concept},strength={s}logit,at={at}"), names)
            outs[f"steer@{s:g}"] = sample(prompts, [r])
        for method in methods:
            texts = outs[method]
            nll = base_nll if method == "none" else [_nll(model, tok, p, c) for p, c in zip(ctx, texts)]
            quality = [min(1.0, ref_ppl / math.exp(x)) if math.isfinite(x) else 0.0 for x in nll]
            score = [bool(det.search(t)) for t in texts]
            c, q = statistics.mean(score), statistics.mean(quality)
            rows.append({"concept": concept, "method": method, "concept_score": c, "quality": q,
                         "harmonic": 0.0 if c + q == 0 else 2 * c * q / (c + q),
                         "parse_rate": statistics.mean(_parses(p + t) for p, t in zip(ctx, texts)),
                         "n": len(texts)})
    summary = {m: {k: statistics.mean(r[k] for r in rows if r["method"] == m)
                   for k in ("concept_score", "quality", "harmonic", "parse_rate")} for m in methods}
    return {"checkpoint": str(loaded.path), "at": at, "strengths": strengths, "prompts": len(prompts),
            "samples": args.samples, "tokens": args.tokens, "ref_ppl": ref_ppl, "rows": rows, "summary": summary,
            "seconds": round(time.perf_counter() - t0, 1), "loadavg_1min": round(os.getloadavg()[0], 2)}


def table(res: dict[str, Any]) -> str:
    lines = [f"steering benchmark: {res['checkpoint']} (steer at {res['at']}), {res['prompts']} prompts x "
             f"{res['samples']} samples x {res['tokens']} tokens; quality = min(1, {res['ref_ppl']:.1f} / ppl)",
             f"{'concept':20} {'method':10} {'concept':>8} {'quality':>8} {'H':>6} {'parse':>6}"]
    for r in res["rows"]:
        lines.append(f"{r['concept']:20} {r['method']:10} {r['concept_score']:8.3f} {r['quality']:8.3f} "
                     f"{r['harmonic']:6.3f} {r['parse_rate']:6.2f}")
    lines.append("mean over concepts:")
    for m, s in res["summary"].items():
        lines.append(f"{'':20} {m:10} {s['concept_score']:8.3f} {s['quality']:8.3f} {s['harmonic']:6.3f} "
                     f"{s['parse_rate']:6.2f}")
    lines.append(f"{res['seconds']} s, 1-min load {res['loadavg_1min']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "bench-steering"))
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--strengths", default="1,2,4", help="steering strengths in nominal logit units")
    ap.add_argument("--at", default="readout", help="where to add the direction (generate --steer's at=): "
                    "readout = the bottleneck's output, the LM head's input (Steerling's concept intervention); "
                    "or decoder.L, encoder.L, decoder_input")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--samples", type=int, default=3, help="seeds per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per continuation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-steering-stage", action="store_true",
                    help="score the pretrained model only (default: also the model after the steering stage, "
                         "recipes/debug-bottleneck-steer.yaml, trained into RUN_DIR-steer)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = checkpoint(Path(args.run_dir), args.train_steps)
    models = {"pretrained": base}
    if not args.no_steering_stage:
        models["steering_stage"] = stage_checkpoint(Path(args.run_dir), base)
    res = {}
    for name, path in models.items():
        res[name] = run(args, path)
        print(f"== {name}\n{table(res[name])}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

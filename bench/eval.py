"""Evaluation and decoding speed (issue #5). Prints ratios last, each with its goal.

1. lm-eval loglikelihood requests/s: ours (``NCPLM`` on the checkpoint) vs lm-eval's ``hf``
   backend (``HFLM``) on the same model exported as ``GPTNeoXForCausalLM``; the same requests
   (contexts from the standard library's source, 4 continuations each), same batch size,
   timed in two halves in ABBA order (ours, hf, hf, ours) so that a change of load on a shared
   machine hits both alike. Goal >= 1.0x.
2. Cached decoding (prefill + ``decode_step``) vs full recompute (a whole forward per new
   token), 384 new tokens after a 16-token prompt, greedy, batch 1. Goal >= 10x. The full
   recompute is the slowest part of this script (its cost grows with the square of the
   tokens: 512 took ~70 s on a 2-core EPYC, 384 takes ~40 s for a ratio of ~15x).
3. ConceptLM per-token decode cost vs the base model's (same backbone, same steps; best of
   3 interleaved runs of ``--decode-steps`` tokens). Goal <= 1.15x.

Weights are random (speed does not depend on them). The default shape is the debug size
widened to d=512, 6 layers, 8 heads (Pythia-70M's body with a 4096-token vocabulary): big
enough that the model's arithmetic, not Python overhead, is what is measured. Usage:
    python bench/eval.py [--size debug] [--d-model 512 --layers 6 --heads 8] [--requests 64] [--json]

With ``--json`` the progress lines go to stderr and one JSON object (the measurements and a
``ratios`` dict: name -> value, goal, met) to stdout; ``bench/run_all.py`` reads that. Either
way each ratio is also printed to stderr as ``bench-ratio: {JSON}`` the moment it is measured
(after ``bench-plan: {JSON}`` naming them all), so a run stopped by ``run_all.py``'s budget
still reports what it measured and which ratios it did not reach.
"""

from __future__ import annotations

import os
import sys

# bench/ holds tokenize.py, which would shadow the standard library's `tokenize` (used by
# `inspect`) when this script's directory is sys.path[0].
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402


SHAPE: dict = {}  # d_model / n_layers / n_heads overrides from the command line


def build(size: str, vocab: int, concept: bool, max_seq_len: int, seed: int = 0):
    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    torch.manual_seed(seed)
    cfg = build_config(size, vocab_size=vocab, max_seq_len=max_seq_len, **SHAPE,
                       concept=dict(enabled=concept, k=4, encoder_layers=1, concept_layers=2,
                                    segments=SHAPE.get("n_heads")))
    return NCPModel(cfg).eval()


def tokenizer(vocab: int, out: Path) -> Path:
    """A byte-level BPE trained on a slice of the standard library (seconds)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    p = out / "tokenizer.json"
    tok.save(str(p))
    return p


def requests(n: int):
    import sysconfig

    from lm_eval.api.instance import Instance

    text = "".join(f.read_text(errors="ignore") for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[80:120])
    lines = text.splitlines(keepends=True)
    out = []
    for i in range(n):
        s = (i * 37) % (len(lines) - 40)
        ctx = "".join(lines[s : s + 8 + i % 17])
        cont = "".join(lines[s + 25 + i % 4 : s + 26 + i % 4 + i % 3])
        out.append(Instance("loglikelihood", {}, (ctx, cont or "pass\n"), i))
    return out


def bench_loglikelihood(size: str, vocab: int, n: int, bs: int) -> tuple[float, float, float]:
    from lm_eval.models.huggingface import HFLM

    from ncpctl.checkpoint import load_model, save_model_files
    from ncpctl.evaluate.lm import NCPLM
    from ncpctl.interop.hf_export import export

    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        model = build(size, vocab, concept=False, max_seq_len=512)
        save_model_files(td / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tokenizer(vocab, td))
        export(td / "ck", td / "hf", verify=False)  # the loglikelihoods below are compared anyway
        reqs = requests(n)
        ours = NCPLM(loaded=load_model(td / "ck"), batch_size=bs)
        hf = HFLM(pretrained=str(td / "hf"), device="cpu", dtype="float32", batch_size=bs)
        ours.loglikelihood(reqs[:4]), hf.loglikelihood(reqs[:4])  # warm-up: first-call costs, one small batch
        half = n // 2
        secs, out = {"ours": 0.0, "hf": 0.0}, {"ours": [], "hf": []}
        # ABBA: ours and hf on the first half, hf and ours on the second
        for name, lm, part in (("ours", ours, reqs[:half]), ("hf", hf, reqs[:half]),
                               ("hf", hf, reqs[half:]), ("ours", ours, reqs[half:])):
            t = time.perf_counter()
            out[name] += lm.loglikelihood(part)
            secs[name] += time.perf_counter() - t
        diff = max(abs(x[0] - y[0]) for x, y in zip(out["ours"], out["hf"]))
    return n / secs["ours"], n / secs["hf"], diff


@torch.no_grad()
def decode_times(model, prompt_len: int, n_new: int, full: bool) -> float:
    x = torch.randint(0, model.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    if full:
        ids = x
        for _ in range(n_new):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    else:
        logits, st = model.prefill(x, [prompt_len], max_len=prompt_len + n_new)
        nxt = logits[:, -1].argmax(-1)
        for _ in range(n_new - 1):
            nxt = model.decode_step(st, nxt).argmax(-1)
    return time.perf_counter() - t


def per_token_decode(models: list, steps: int, repeats: int = 3) -> list[float]:
    """Best-of-``repeats`` seconds per token for each model, runs interleaved so that load
    from other processes on a shared machine hits every model alike."""
    best = [float("inf")] * len(models)
    for _ in range(repeats):
        for i, m in enumerate(models):
            best[i] = min(best[i], decode_times(m, 16, steps, full=False))
    return [b / steps for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="debug")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=64, help="loglikelihood requests (default 64: 4 batches of 16)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=384, help="tokens decoded for cached vs full recompute")
    ap.add_argument("--decode-steps", type=int, default=128, help="tokens per run of the ConceptLM vs base "
                    "per-token decode comparison (best of 3 interleaved runs)")
    ap.add_argument("--d-model", type=int, default=512, help="override the size's width (0: keep)")
    ap.add_argument("--layers", type=int, default=6, help="override the size's token layers (0: keep)")
    ap.add_argument("--heads", type=int, default=8, help="override the size's heads (0: keep)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decoding small matrices is "
                    "latency-bound: extra threads on shared cores only add contention)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout (progress on stderr)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = sys.stderr if args.json else sys.stdout

    def say(msg: str = "") -> None:
        print(msg, file=out, flush=True)

    SHAPE.update({k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers), ("n_heads", args.heads)) if v})
    say(f"size {args.size} {SHAPE}, vocab {args.vocab}, {args.threads} thread(s), torch {torch.__version__}")
    names = {"ll": "loglikelihood req/s, ours / lm-eval hf",
             "decode": f"cached vs full recompute ({args.new_tokens} new tokens)",
             "concept": "ConceptLM / base per-token decode cost"}
    goals = {"ll": (">= 1.0", lambda r: r >= 1.0), "decode": (">= 10", lambda r: r >= 10),
             "concept": ("<= 1.15", lambda r: r <= 1.15)}
    print("bench-plan: " + json.dumps({names[k]: goals[k][0] for k in names}), file=sys.stderr, flush=True)
    rows = []

    def measured(key: str, ratio: float) -> None:
        goal, ok = goals[key]
        rows.append((names[key], ratio, goal, ok(ratio)))
        print("bench-ratio: " + json.dumps({names[key]: {"value": round(ratio, 3), "goal": goal, "met": ok(ratio)}}),
              file=sys.stderr, flush=True)

    ours, hf, diff = bench_loglikelihood(args.size, args.vocab, args.requests, args.batch_size)
    # (each section prints as it finishes; the ratios come last)
    say(f"loglikelihood: ours {ours:.1f} req/s, lm-eval hf {hf:.1f} req/s ({args.requests} requests, "
        f"batch {args.batch_size}; max |ll diff| {diff:.2e})")
    measured("ll", ours / hf)

    base = build(args.size, args.vocab, concept=False, max_seq_len=16 + args.new_tokens)
    cached = decode_times(base, 16, args.new_tokens, full=False)
    full = decode_times(base, 16, args.new_tokens, full=True)
    say(f"decode {args.new_tokens} tokens: cached {cached:.2f} s, full recompute {full:.2f} s")
    measured("decode", full / cached)

    concept = build(args.size, args.vocab, concept=True, max_seq_len=16 + args.new_tokens)
    t_base, t_con = per_token_decode([base, concept], args.decode_steps)
    say(f"per-token decode ({args.decode_steps} steps): base {t_base * 1e3:.3f} ms, ConceptLM {t_con * 1e3:.3f} ms")
    measured("concept", t_con / t_base)

    if args.json:
        print(json.dumps({
            "shape": {"size": args.size, **SHAPE, "vocab": args.vocab}, "threads": args.threads,
            "torch": torch.__version__,
            "loglikelihood": {"ours_req_per_s": ours, "hf_req_per_s": hf, "requests": args.requests,
                              "batch_size": args.batch_size, "max_abs_ll_diff": diff},
            "decode": {"new_tokens": args.new_tokens, "cached_s": cached, "full_recompute_s": full,
                       "decode_steps": args.decode_steps, "per_token_s": {"base": t_base, "concept": t_con}},
            "ratios": {name: {"value": round(ratio, 3), "goal": goal, "met": ok} for name, ratio, goal, ok in rows},
        }, indent=2))
        return
    print()
    for name, ratio, goal, ok in rows:
        print(f"{name:<52} {ratio:7.2f}x  goal {goal:<7} {'met' if ok else 'MISSED'}")
    sys.stdout.flush()

if __name__ == "__main__":
    main()

"""Loading a Steerling directory maps its safetensors instead of copying them (issue 43 item 5). A
script, not a test.

Writes a synthetic interpretable Steerling model in their layout (their config.json, bf16 weights as
their converter saves them, sharded at 1 GB) of about 1.1B parameters: d 2048, 12 layers, GQA 16/4,
SwiGLU 8192, the release's vocabulary (100,281) and concept heads (33,732 known; 101,196 unknown at
rank 256; top-k 32 / 128). Then, in a process of its own, ``ncpctl.checkpoint.load_model`` loads it
(the weights mapped: ncpctl/interop/authors/safetensors_map.py) and runs one forward of 64 tokens
(every weight but the unselected concept embeddings read at least once); reported: the peak resident
set size (``ru_maxrss``) over the resident set after the imports, as a multiple of the weights'
bytes. Goal: <= 1.2x.

    .venv/bin/python bench/steerling_load.py                  # ~2-4 min on 2 busy cores; 2.3 GB in --dir
    .venv/bin/python bench/steerling_load.py --json --dir /tmp/steerling-1b
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
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

ARCH = dict(n_layers=12, n_head=16, n_embd=2048, n_kv_heads=4, block_size=4096, diff_block_size=64, use_rms_norm=True,
            norm_eps=1e-5, norm_order="post", use_qk_norm=True, use_rope=True, rope_base=500000.0, mlp_type="swiglu",
            mlp_ratio=4, intermediate_size=None, use_bias=False, clip_qkv=10.0, weight_sharing=True, vocab_size=100281,
            mask_token_id=100280, model_type="causal_diffusion", interpretable=True)
CONCEPT = dict(n_concepts=33732, n_unknown_concepts=101196, concept_dim=2048, topk_known=32, topk_known_features=32,
               unknown_topk=128, apply_topk_to_unknown=True, factorize_unknown=True, factorize_rank=256,
               use_epsilon_correction=True, pad_multiple=16)
GOAL = 1.2


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def write(d: Path) -> int:
    """The synthetic directory (tensor by tensor into 1 GB shards); returns the weights' bytes."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**ARCH, "concept": CONCEPT}))
    D, L, F, V = ARCH["n_embd"], ARCH["n_layers"], 4 * ARCH["n_embd"], ARCH["vocab_size"]
    kv = D // ARCH["n_head"] * ARCH["n_kv_heads"]
    n, m, r = CONCEPT["n_concepts"], CONCEPT["n_unknown_concepts"], CONCEPT["factorize_rank"]
    pad = lambda k: -(-k // CONCEPT["pad_multiple"]) * CONCEPT["pad_multiple"]  # noqa: E731
    shapes = {"transformer.tok_emb.weight": (V, D), "transformer.ln_f.weight": (D,),
              "known_head.concept_predictor.weight": (pad(n), D),
              "known_head.concept_embedding.weight": (pad(n), D),
              "unknown_head.predictor_down.weight": (r, D), "unknown_head.predictor_up.weight": (pad(m), r),
              "unknown_head.embedding_coef.weight": (pad(m), r), "unknown_head.embedding_basis.weight": (D, r)}
    for i in range(L):
        p = f"transformer.blocks.{i}."
        shapes.update({p + "ln_1.weight": (D,), p + "ln_2.weight": (D,), p + "attn.c_attn.weight": (D + 2 * kv, D),
                       p + "attn.c_proj.weight": (D, D), p + "attn.q_norm.weight": (D // ARCH["n_head"],),
                       p + "attn.k_norm.weight": (D // ARCH["n_head"],), p + "mlp.c_fc.weight": (2 * F, D),
                       p + "mlp.c_proj.weight": (D, F)})
    g = torch.Generator().manual_seed(0)
    shard, size, n, total, weight_map = {}, 0, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        n += 1
        save_file(shard, str(d / f"model-{n:05d}.safetensors"))
        weight_map.update({k: f"model-{n:05d}.safetensors" for k in shard})
        shard, size = {}, 0

    for k, s in shapes.items():
        t = (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
        shard[k], size, total = t, size + 2 * t.numel(), total + 2 * t.numel()
        if size > 2**30:
            flush()
    flush()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def child(d: Path) -> dict:
    """Load (``ncpctl.checkpoint.load_model``: mapped) and run one forward, in this process."""
    import torch

    from ncpctl.checkpoint import load_model

    base = _rss_kb()
    model = load_model(d, with_tokenizer=False).model
    loaded_kb = _rss_kb() - base
    x = torch.randint(0, model.cfg.vocab_size - 1, (1, 64))  # below the [MASK] (the last id)
    with torch.no_grad():
        model(x)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"rss_after_load_gb": loaded_kb / 2**20, "peak_rss_gb": peak_kb / 2**20,
            "dtype": str(model.embed.weight.dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the synthetic model goes (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    d = args.dir or Path(tempfile.mkdtemp(prefix="steerling-1b-"))
    if not (d / "config.json").is_file():
        write(d)
    total = sum(f.stat().st_size for f in d.glob("*.safetensors"))  # (headers: a few kB)
    out = subprocess.run([sys.executable, __file__, "--child", str(d)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    r = json.loads(out.stdout.splitlines()[-1])
    res = {"weights_gib": total / 2**30, "parameters": total // 2, **r,
           "peak_over_weights": r["peak_rss_gb"] * 2**30 / total, "goal": GOAL, "load_average": os.getloadavg()}
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"weights {res['weights_gib']:.2f} GiB ({res['parameters'] / 1e9:.2f}B parameters, bf16); load "
              f"average {res['load_average'][0]:.1f}\n  peak RSS {r['peak_rss_gb']:.2f} GiB = "
              f"{res['peak_over_weights']:.2f}x the weights (goal <= {GOAL}x; after load "
              f"{r['rss_after_load_gb']:.2f} GiB, weights {r['dtype']})")


if __name__ == "__main__":
    main()

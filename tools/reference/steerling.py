"""Reference fixtures for Steerling made by the authors' own code (issue 43; tools/reference/README.md).

Runs the ``steerling`` package (PyPI 0.2.0, Apache-2.0) and two scripts of its repository
(guidelabs/steerling: ``scripts/convert_weights.py``, ``scripts/hugging_face/build_hf_files.py``), never
ncpctl: their code and ours meet only through the files this writes. Nothing of theirs is committed.

    pip install --no-deps --ignore-requires-python --target DIR steerling==0.2.0
    git clone https://github.com/guidelabs/steerling REPO        # (commit recorded in reference.json)
    PYTHONPATH=DIR python tools/reference/steerling.py make --repo REPO --out tests/fixtures/authors/steerling
    PYTHONPATH=DIR python tools/reference/steerling.py check EXPORT_DIR \
        --fixture tests/fixtures/authors/steerling/interpretable

``make`` builds two tiny random models with their classes, ``CausalDiffusionLM`` (``base/``) and
``InterpretableCausalDiffusionLM`` (``interpretable/``), and writes for each: ``model/`` in their
layout (config and weights written by their scripts: ``base`` in the package's layout,
``convert_weights.py``'s nested ``config.json`` and one ``model.safetensors``; ``interpretable`` in the
Hugging Face release's, ``build_hf_files.py``'s flat ``config.json`` and sharded safetensors with an
index), ``reference.safetensors`` (fixed inputs and their outputs) and ``reference.json`` (versions,
settings, non-tensor results). ``check`` loads a directory (an ncpctl export back to their layout)
with their ``SteerlingGenerator.from_pretrained`` and compares its logits on the fixture's inputs;
exit status 0 when max |diff| <= 1e-5 * max |logit|.

Their tokenizer needs tiktoken's cl100k_base (a download): a stub ``tiktoken`` module stands in (a
92-token "vocabulary" mapping characters to ids); only the generation prompts go through it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB, N_BASE = 96, 92  # the stub's 92 ids + pad, bos, endofchunk, mask (Steerling's layout: mask = vocab - 1)
ARCH = dict(n_layers=3, n_head=4, n_embd=32, block_size=64, n_kv_heads=2, diff_block_size=4, use_rms_norm=True,
            norm_eps=1e-5, norm_order="post", use_qk_norm=True, use_rope=True, rope_base=500000.0,
            rope_full_precision=True, mlp_type="swiglu", activation="gelu", mlp_ratio=4, intermediate_size=None,
            use_bias=False, clip_qkv=1.0, weight_sharing=True)  # clip_qkv 1 (release: 10) so that it clips here
# block_size 16 < 24 concepts: their streaming top-k merges over blocks; pad_multiple 16 pads 24 -> 32, 52 -> 64
CONCEPT = dict(n_concepts=24, n_unknown_concepts=52, concept_dim=32, use_attention_known=False,
               use_attention_unknown=False, topk_known=4, topk_known_features=4, unknown_topk=8, use_unknown=True,
               factorize_unknown=True, factorize_rank=16, use_epsilon_correction=True, block_size=16,
               pad_multiple=16, apply_topk_to_unknown=True, inject_layer=2, inject_alpha=1.0)
B, T = 2, 16
GAP = 1e-4  # the k-th and (k+1)-th concept scores of every position differ by more than this

STUB = '''"""A stand-in for tiktoken (tools/reference/steerling.py): cl100k_base's interface, 92 ids."""
class Encoding:
    def __init__(self, name, pat_str="", mergeable_ranks=None, special_tokens=None, explicit_n_vocab=None):
        self.name, self._pat_str = name, pat_str
        self._mergeable_ranks, self._special_tokens = dict(mergeable_ranks or {}), dict(special_tokens or {})
        self.n_vocab = 92
    def encode(self, text, allowed_special=(), disallowed_special=()):
        return [ord(c) % 90 for c in text]
    def decode(self, ids, errors="replace"):
        return "".join(chr(32 + int(i) % 90) for i in ids if int(i) < 90)
def get_encoding(name):
    return Encoding(name, special_tokens={"<|endoftext|>": 91})
'''


def install_stub() -> None:
    d = Path(tempfile.mkdtemp(prefix="tiktoken-stub-"))
    (d / "tiktoken.py").write_text(STUB)
    sys.path.insert(0, str(d))


def their_script(repo: Path, rel: str):
    """A script of their repository (a clone or a bare git directory), imported from a temporary copy."""
    if (repo / rel).is_file():
        text = (repo / rel).read_text()
    else:
        text = subprocess.run(["git", f"--git-dir={repo}", "show", f"HEAD:{rel}"], check=True,
                              capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="steerling-script-")) / Path(rel).name
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def repo_commit(repo: Path) -> str:
    for args in (["git", f"--git-dir={repo}"], ["git", "-C", str(repo)]):
        r = subprocess.run([*args, "rev-parse", "HEAD"], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip()
    return "unknown"


# ---------------------------------------------------------------- the models (their classes)


def build(interpretable: bool, seed: int):
    """One of their models, random: their default init, then the (tied) embedding, every norm weight and
    the concept heads (padding rows included, which their forward never reads) redrawn, so that each
    weight matters."""
    import torch
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig
    from steerling.models import CausalDiffusionLM, InterpretableCausalDiffusionLM

    torch.manual_seed(seed)
    cfg = CausalDiffusionConfig(**ARCH, interpretable=interpretable)
    model = InterpretableCausalDiffusionLM(cfg, ConceptConfig(**CONCEPT), VOCAB) if interpretable \
        else CausalDiffusionLM(cfg, VOCAB)
    with torch.no_grad():
        # tied: nn.Linear's init (+-1/sqrt(d)) would leave the embeddings too small for clip_qkv to clip
        (model.transformer if interpretable else model).tok_emb.weight.normal_(0, 1)
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "q_norm.weight", "k_norm.weight")):
                p.uniform_(0.7, 1.3)
        if interpretable:
            k, u = model.known_head, model.unknown_head
            k.concept_predictor.weight.normal_(0, 0.25)
            k.concept_embedding.weight.normal_(0, 0.3)
            k.concept_predictor.weight[5] *= 40  # concept 5's logits pass +-15: their clamp matters
            u.embedding_coef.weight.normal_(0, 0.5)
            u.embedding_basis.weight.normal_(0, 0.3)
            u.predictor_down.weight.normal_(0, 0.3)
            u.predictor_up.weight.normal_(0, 0.5)
            u.predictor_up.weight[7] *= 40
    return model.eval()


def inputs(seed: int):
    """(clean (B, T), noisy (B, T) with [MASK] = VOCAB - 1): row 0 has a clean block, a half-masked,
    a fully masked and a one-masked block; row 1 masks each token with probability 1/2."""
    import torch

    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, N_BASE - 1, (B, T), generator=g)
    masked = torch.zeros(B, T, dtype=torch.bool)
    masked[0, 4:6] = masked[0, 8:12] = masked[0, 14] = True
    masked[1] = torch.rand(T, generator=g) < 0.5
    masked[1, 0] = True
    return clean, clean.masked_fill(masked, VOCAB - 1)


def min_gap(scores, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th largest score over positions, scores (..., n)."""
    top = scores.float().topk(k + 1, dim=-1).values
    return float((top[..., k - 1] - top[..., k]).min())


def concept_gaps(model, x) -> dict:
    """The top-k gaps of both heads on input x, in the scores their code ranks (sigmoid of the clamped
    known logits; the clamped unknown logits) and in sigmoid (what ncpctl ranks)."""
    import torch

    with torch.no_grad():
        h = model.transformer(x, return_hidden=True)
        kz = (h @ model.known_head.concept_predictor.weight[:24].t()).clamp(-15, 15)
        u = model.unknown_head
        uz = ((h @ u.predictor_down.weight.t()) @ u.predictor_up.weight[:52].t()).clamp(-15, 15)
    return {"known": min_gap(torch.sigmoid(kz), CONCEPT["topk_known"]),
            "unknown_logit": min_gap(uz, CONCEPT["unknown_topk"]),
            "unknown_sigmoid": min_gap(torch.sigmoid(uz), CONCEPT["unknown_topk"])}


def losses(logits, clean, noisy) -> dict:
    """Their losses of a noisy batch: the mean cross-entropy over the masked tokens, and the Monte
    Carlo estimate their lm-eval wrapper sums (``_compute_mc_loglikelihood``: ce / p, p each row's
    masked fraction, summed over masked tokens, divided by the rows)."""
    import torch
    import torch.nn.functional as F

    m = noisy == VOCAB - 1
    ce = F.cross_entropy(logits[m].float(), clean[m], reduction="none")
    p = (m.float().mean(1, keepdim=True)).expand_as(m)[m]
    return {"loss_masked_mean": ce.mean(), "loss_mc": (ce / p).sum() / m.shape[0]}


# ---------------------------------------------------------------- what the interpretable model gives


def decomposition(model, x) -> dict:
    import torch

    with torch.no_grad():
        logits, o = model(x, minimal_output=False)
    out = {"logits": logits, "hidden": o.hidden, "known_features": o.known_features,
           "known_topk_indices": o.known_topk_indices, "known_topk_logits": o.known_topk_logits,
           "unk_hat": o.unk_hat, "unknown_topk_indices": o.unknown_topk_indices,
           "unknown_topk_logits": o.unknown_topk_logits, "epsilon": o.epsilon, "epsilon_true": o.epsilon_true,
           "composed": o.composed}
    return out


def attributions(model, x, logits) -> dict:
    """Their per-concept attribution (``AttributionAccumulator.commit``, what their faithful attributor
    runs at each commit) of every position's argmax token in this one forward, row by row."""
    import torch
    from steerling.attribution.concept_attribution import AttributionAccumulator, _compute_unknown_topk
    from steerling.attribution.trace import CommitRecord

    rows = []
    with torch.no_grad():
        _, o = model(x, minimal_output=False)
        for b in range(x.shape[0]):
            acc = AttributionAccumulator(seq_len=T, k_known=CONCEPT["topk_known"], k_unk=CONCEPT["unknown_topk"],
                                         device=torch.device("cpu"), lm_head_weight=model.transformer.lm_head.weight,
                                         known_head=model.known_head, unknown_head=model.unknown_head)
            pos = torch.arange(T)
            tok = logits[b].argmax(-1)
            u_idx, u_lgt = _compute_unknown_topk(model.unknown_head, o.hidden[b : b + 1], k=CONCEPT["unknown_topk"])
            acc.commit(CommitRecord(commit_order=0, denoising_step=0, positions=pos, token_ids=tok,
                                    target_logits=logits[b].gather(-1, tok[:, None])[:, 0],
                                    known_indices=o.known_topk_indices[b], known_logits=o.known_topk_logits[b],
                                    unk_indices=u_idx[0], unk_logits=u_lgt[0]))
            r = acc.result()
            assert r.verify().passed, r.verify()
            rows.append(r)
    names = ("target_token_ids", "target_logits", "known_indices", "known_weights", "known_contributions",
             "unk_indices", "unk_weights", "unk_contributions", "epsilon_contribution")
    return {f"attr_{n}": torch.cat([getattr(r, n) for r in rows]) for n in names}


def generator(model):
    import torch
    from steerling import SteerlingGenerator
    from steerling.data.tokenizer import SteerlingTokenizer

    return SteerlingGenerator(model, SteerlingTokenizer(), model.config, is_interpretable=True,
                              device=torch.device("cpu"))


STEER = dict(concept_ids=[3], mai_lm_target=4.0, inject_layer=2, cutoff_tokens=32)
STEER_GROUP = dict(STEER, concept_ids=[3, 11])
UNLEARN = dict(concept_id=3, group_concept_ids=[11], mai_lm_target=-2.0, inject_layer=1, relu_strength=3.0)


def steering(model, x) -> tuple[dict, dict]:
    """Their steered forward (``generate_steered``'s step: ``_prepare_steering`` -> the direction and
    alpha, ``_position_injection`` at the [MASK] slots, added after every block i with i + 1 >=
    inject_layer), for one concept and for a group (their directions summed), their relu logit mask,
    and their ``intervene`` (known concept weights set)."""
    import torch
    from steerling import SteeringConfig

    gen = generator(model)
    tensors, meta = {}, {}
    with torch.no_grad():
        for name, spec in (("steer", STEER), ("steer_group", STEER_GROUP)):
            direction, alpha, layer = gen._prepare_steering(SteeringConfig.injection(**spec))
            inj = gen._position_injection(x, direction)
            tensors |= {f"{name}_direction": direction, f"{name}_logits": gen._forward(x, inj, layer, alpha)}
            meta[name] = {**spec, "alpha": alpha, "layer": layer}
        tensors["relu_suppression"] = gen._build_relu_mask({UNLEARN["concept_id"]: UNLEARN["relu_strength"]})
        tensors["intervene_logits"], _ = model.intervene(x, known={3: 1.0, 11: 0.0})
    return tensors, meta | {"relu_suppression": {str(UNLEARN["concept_id"]): UNLEARN["relu_strength"]},
                            "intervene": {"known": {"3": 1.0, "11": 0.0}}}


GEN = dict(max_new_tokens=8, steps=8, temperature=0.0, top_p=0.0, repetition_penalty=1.0,
           use_entropy_sampling=False, seed=0)
PROMPT = "steer me"  # the stub maps each character to an id: 8 tokens


def generations(model, labels: Path) -> tuple[dict, dict]:
    """Greedy generation with their faithful attributor (its DiffusionTrace commit records: what each
    token was committed with), and greedy generation steered by their two presets."""
    import torch
    from steerling import GenerationConfig, SteeringConfig
    from steerling.attribution.concept_attribution import FaithfulConceptAttributor

    gen = generator(model)
    attributor = FaithfulConceptAttributor(gen, concepts_path=labels)
    with torch.no_grad():
        out, chunks = attributor.attribute(PROMPT, GenerationConfig(**GEN))
        amplified = gen.generate_steered(PROMPT, GenerationConfig(**GEN), SteeringConfig.injection(**STEER))
        unlearned = gen.generate_steered(PROMPT, GenerationConfig(**GEN), SteeringConfig.injection_relu(**UNLEARN))
    a, recs = attributor.last_attribution, attributor.last_trace.groups
    tensors = {"gen_tokens": out.tokens, "gen_amplified_tokens": amplified.tokens,
               "gen_unlearned_tokens": unlearned.tokens,
               "gen_commit_positions": torch.cat([r.positions for r in recs]),
               "gen_commit_steps": torch.cat([torch.full_like(r.positions, r.denoising_step) for r in recs]),
               "gen_commit_token_ids": torch.cat([r.token_ids for r in recs]),
               "gen_commit_target_logits": torch.cat([r.target_logits for r in recs]),
               "gen_commit_known_indices": torch.cat([r.known_indices for r in recs]),
               "gen_commit_known_logits": torch.cat([r.known_logits for r in recs]),
               "gen_commit_unk_indices": torch.cat([r.unk_indices for r in recs]),
               "gen_commit_unk_logits": torch.cat([r.unk_logits for r in recs]),
               "gen_attr_known_contributions": a.known_contributions[0],
               "gen_attr_unk_contributions": a.unk_contributions[0],
               "gen_attr_epsilon": a.epsilon_contribution[0]}
    meta = {"prompt": PROMPT, "prompt_ids": gen.tokenizer.encode(PROMPT, add_special_tokens=False),
            "config": GEN, "chunks": [{"entries": e, "epsilon_pct": p} for e, p in chunks],
            "amplify": STEER, "unlearn": UNLEARN}
    return tensors, meta


# ---------------------------------------------------------------- files


def concept_table(path: Path) -> None:
    """A tiny label table in their catalog's columns (their hub's concept_labels.parquet, as CSV)."""
    names = ["python loops", "string formatting", "file io", "recursion", "sorting", "error handling",
             "regular expressions", "classes", "list comprehension", "networking", "dates and times",
             "unit tests", "logging", "json parsing", "math functions", "sql queries", "http requests",
             "command line", "threads", "generators", "decorators", "type hints", "dictionaries", "sets"]
    lines = ["concept_id,concept_name,concept_description,head,public_group_id,group_name,is_steerable,"
             "is_tone,is_alignment,is_demographic"]
    for i, n in enumerate(names):
        group = "1,code style" if i in (3, 11) else ","
        lines.append(f"{i},{n},text about {n},known,{group},{i % 5 != 4},False,False,False")
    for j in range(3):
        lines.append(f"{j},discovered {j},an unknown concept,unknown,,,False,False,False,False")
    path.write_text("\n".join(lines) + "\n")


def searches(labels: Path) -> dict:
    import pandas as pd
    from steerling.concepts import ConceptCatalog

    cat = ConceptCatalog(pd.read_csv(labels).query("head == 'known'"))
    return {q: [c.concept_id for c in cat.search(q)] for q in ("file", "unit tests", "python loops sorting")} | \
        {"group_of_3": cat.group(3)}


def scalex_config(interpretable: bool, tok) -> dict:
    """The training config their ``convert_weights.py`` reads (its ``build_steerling_config``)."""
    return {"model": {**ARCH, "interpretable": interpretable},
            "tokenizer": {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
                          "eos_token_id": tok.eos_token_id, "endofchunk_token_id": tok.endofchunk_token_id,
                          "mask_token_id": tok.mask_token_id, "vocab_size": tok.vocab_size},
            "concept": CONCEPT if interpretable else None,
            "steering": {"inject_layer": CONCEPT["inject_layer"], "inject_alpha": CONCEPT["inject_alpha"]}}


def write_model(model, interpretable: bool, out: Path, convert, build_hf) -> None:
    """Their layout, by their scripts: ``base`` the package's (``convert_weights``: nested config, one
    file); ``interpretable`` the Hugging Face release's (``build_hf_files``' flat config and tokenizer
    config; ``convert_weights``' sharding, tied ``transformer.lm_head.weight`` left out)."""
    from steerling.data.tokenizer import SteerlingTokenizer

    out.mkdir(parents=True)
    tok = SteerlingTokenizer()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if interpretable:
        del sd["transformer.lm_head.weight"]  # tied (convert_weights.main drops it so)
        convert.save_safetensors(sd, out, shard_size_bytes=60_000)
        arch = {**ARCH, "interpretable": True}
        (out / "config.json").write_text(build_hf.compact_json(build_hf.build_config_json(arch, CONCEPT)))
        (out / "tokenizer_config.json").write_text(build_hf.compact_json(build_hf.build_tokenizer_config_json()))
    else:
        convert.save_safetensors(sd, out)
        sx = out.parent / "scalex_config.json"
        sx.write_text(json.dumps(scalex_config(False, tok)))
        (out / "config.json").write_text(json.dumps(convert.build_steerling_config(sx), indent=2))
        sx.unlink()


def versions(repo: Path) -> dict:
    import importlib.metadata as md
    import platform

    import torch

    def ver(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"steerling": ver("steerling"), "steerling_repo_commit": repo_commit(repo), "torch": torch.__version__,
            "python": platform.python_version(), "safetensors": ver("safetensors"), "pandas": ver("pandas"),
            "pydantic": ver("pydantic"), "transformers": ver("transformers"), "tiktoken": "stub (this script)"}


def make_one(interpretable: bool, out: Path, repo: Path, convert, build_hf) -> None:
    import torch
    from safetensors.torch import save_file

    seed = 43 if interpretable else 41
    model = build(interpretable, seed)
    for input_seed in range(100):  # inputs without a near tie at any top-k boundary
        clean, noisy = inputs(input_seed)
        gaps = concept_gaps(model, noisy) if interpretable else {}
        if all(g > GAP for g in gaps.values()):
            break
    else:
        raise SystemExit("no input seed without top-k ties")
    write_model(model, interpretable, out / "model", convert, build_hf)
    meta = {"versions": versions(repo), "arch": ARCH, "vocab_size": VOCAB, "weights_seed": seed,
            "input_seed": input_seed, "min_topk_gaps": gaps, "mask_token_id": VOCAB - 1}
    with torch.no_grad():
        logits = model(noisy, minimal_output=False)[0] if interpretable else model(noisy)
    tensors = {"clean_ids": clean, "input_ids": noisy, "logits": logits, **losses(logits, clean, noisy)}
    qkv = model.transformer.blocks[0].attn.c_attn if interpretable else model.blocks[0].attn.c_attn
    emb = (model.transformer if interpretable else model).tok_emb(noisy)
    meta["clipped_fraction_layer0"] = float((qkv(emb).abs() > ARCH["clip_qkv"]).float().mean())
    if interpretable:
        labels = out / "concepts.csv"
        concept_table(labels)
        tensors |= decomposition(model, noisy) | attributions(model, noisy, logits)
        steer_t, meta["steering"] = steering(model, noisy)
        gen_t, meta["generation"] = generations(model, labels)
        tensors |= steer_t | gen_t
        meta["concept"], meta["search"] = CONCEPT, searches(labels)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, out / "reference.safetensors")
    (out / "reference.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    reloaded = check(out / "model", out, quiet=True) if not interpretable else None
    print(f"{out}: {len(tensors)} reference tensors; gaps {gaps}; their loader on it: {reloaded}")


def load_theirs(path: Path):
    """Their loader: ``SteerlingGenerator.from_pretrained`` (its direct checkpoint path: config.json
    in the package's layout and *.safetensors), fp32 on the CPU."""
    import logging

    from steerling import SteerlingGenerator

    logging.getLogger("steerling").setLevel(logging.ERROR)
    return SteerlingGenerator.from_pretrained(str(path), device="cpu", dtype=None)


def check(path: Path, fixture: Path, quiet: bool = False) -> dict:
    """Their loader on ``path``; its logits (and, interpretable, the decomposition) on the fixture's
    inputs against the fixture's (``fixture``: a fixture directory, or any safetensors file with
    ``input_ids`` and ``logits``, e.g. ncpctl's of the model exported). Returns the max |diff| of each,
    relative to the reference's max |x|."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(str(fixture / "reference.safetensors" if fixture.is_dir() else fixture))
    gen = load_theirs(path)
    with torch.no_grad():
        if gen.is_interpretable:
            logits, o = gen.model(ref["input_ids"], minimal_output=False)
            got = {"logits": logits, "known_features": o.known_features, "unk_hat": o.unk_hat, "epsilon": o.epsilon}
            got = {k: v for k, v in got.items() if k in ref}
        else:
            got = {"logits": gen.model(ref["input_ids"])}
    rel = {k: float((v - ref[k]).abs().max() / ref[k].abs().max()) for k, v in got.items()}
    if not quiet:
        print(json.dumps({"path": str(path), "interpretable": gen.is_interpretable, "relative_max_diff": rel}))
    return rel


def main() -> None:
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]  # this file is not the package
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the fixtures")
    mk.add_argument("--repo", type=Path, required=True, help="guidelabs/steerling: a clone or a bare git directory")
    mk.add_argument("--out", type=Path, required=True)
    ck = sub.add_parser("check", help="load a directory with their code and compare its logits with a fixture's")
    ck.add_argument("path", type=Path)
    ck.add_argument("--fixture", type=Path, required=True)
    args = ap.parse_args()
    install_stub()
    if args.cmd == "check":
        rel = check(args.path, args.fixture)
        raise SystemExit(0 if max(rel.values()) <= 1e-5 else 1)
    convert = their_script(args.repo, "scripts/convert_weights.py")
    build_hf = their_script(args.repo, "scripts/hugging_face/build_hf_files.py")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out}: not empty")
    for interpretable in (False, True):
        make_one(interpretable, args.out / ("interpretable" if interpretable else "base"), args.repo, convert,
                 build_hf)


if __name__ == "__main__":
    main()

"""Steerling's own model directories (guidelabs/steerling, the ``steerling`` package 0.2.0; issue 43).

Two layouts, both recognised from ``config.json`` alone (no code from the directory ever runs):

* the package's (``scripts/convert_weights.py``; ``SteerlingGenerator.from_pretrained`` loads it
  directly): ``model_type: causal_diffusion``, ``CausalDiffusionConfig``'s fields, the token ids, and
  for an interpretable model a nested ``concept`` (``ConceptConfig``'s fields);
* the Hugging Face release's (``scripts/hugging_face/build_hf_files.py``): ``model_type: steerling``,
  the same fields flat (the concept head's ``block_size`` as ``concept_block_size``), remote code that
  ncpctl does not run.

Weights: ``model.safetensors``, or shards with ``model.safetensors.index.json``, or the ``*.safetensors``
their loader globs; names as their modules' state dicts: ``CausalDiffusionLM``'s (``tok_emb``,
``blocks.i.{ln_1, ln_2, attn.c_attn, attn.c_proj, attn.q_norm, attn.k_norm, mlp.c_fc, mlp.c_proj}``,
``ln_f``, ``lm_head``), under ``transformer.`` in an interpretable model, beside ``known_head.*`` and
``unknown_head.*`` (``ConceptHead``: rows padded to ``pad_multiple``, never read). Mapped, not copied
(safetensors_map.py), and kept in the file's dtype; the one layout change that copies is the SwiGLU
input projection (theirs ``[up; gate]``, ncpctl's ``[gate; up]``) and the unknown basis's transpose.

What ncpctl builds computes their function (tests/interop/test_steerling.py, against fixtures their
code made: tools/reference/steerling.py): a ``llama`` backbone with post-norm, per-head QK-norm,
``clip_qkv``, full RoPE, ``objective: causal_diffusion``; the concept bottleneck without biases, logits
clamped to +-15, their top-k, the factorised unknown head; no vocabulary padding (their logits have
exactly ``vocab_size`` columns). The differences kept on purpose are listed in docs/released-models.md
("Using the released models").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError

MODEL_TYPES = ("causal_diffusion", "steerling")  # their config.json's model_type (package, Hugging Face)
CLAMP = 15.0  # their ConceptHead clamps every concept logit to [-15, 15] (a constant in their code)
MASK_TOKEN = "<|mask|>"


def detect(path: str | Path) -> bool:
    """Whether ``path`` is a Steerling model directory (its ``config.json``; light: no torch)."""
    p = Path(path)
    if not (p / "config.json").is_file() or (p / "ncpctl.json").is_file():
        return False
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("model_type") in MODEL_TYPES or
                                      ("diff_block_size" in raw and "n_embd" in raw and "n_head" in raw))


def read_config(path: Path) -> tuple[dict, dict | None]:
    """(the architecture's fields with the token ids, the concept head's fields or None)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path / 'config.json'}: unreadable ({e})") from None
    if not raw.get("interpretable", False):
        return raw, None
    concept = raw.get("concept")
    if concept is None:  # the Hugging Face release's flat config
        concept = {k: raw[k] for k in _CONCEPT_FIELDS if k in raw}
        if "concept_block_size" in raw:
            concept["block_size"] = raw["concept_block_size"]
    return raw, concept


_CONCEPT_FIELDS = ("n_concepts", "n_unknown_concepts", "concept_dim", "use_attention_known", "use_attention_unknown",
                   "topk_known", "topk_known_features", "unknown_topk", "use_unknown", "apply_topk_to_unknown",
                   "topk_on_logits", "factorize_unknown", "factorize_rank", "use_epsilon_correction", "pad_multiple")
# (field, value their code needs for ncpctl to compute the same function, what ncpctl has instead)
_ARCH_NEEDS = (("use_rms_norm", True, "ncpctl's llama blocks use RMSNorm"),
               ("mlp_type", "swiglu", "ncpctl's llama blocks use SwiGLU"))
_CONCEPT_NEEDS = (("use_attention_known", False, "ncpctl's known head is linear"),
                  ("use_attention_unknown", False, "ncpctl's unknown head is linear"),
                  ("topk_on_logits", False, "ncpctl keeps the top-k of the activations"),
                  ("use_epsilon_correction", True, "ncpctl's LM head reads h = kK + uU + e"),
                  ("use_unknown", True, "ncpctl's bottleneck always has an unknown head"))


def _refusals(path: Path, arch: dict, concept: dict | None) -> list[str]:
    out = []
    for table, fields in ((_ARCH_NEEDS, arch), (_CONCEPT_NEEDS, concept or {})):
        for key, want, why in table:
            if key in fields and fields[key] != want:
                out.append(f"{path / 'config.json'}: {key}: {fields[key]!r} is not supported ({why})")
    for key in ("n_layers", "n_head", "n_embd", "block_size", "diff_block_size", "vocab_size", "mask_token_id"):
        if not isinstance(arch.get(key), int):
            out.append(f"{path / 'config.json'}: {key}: an integer is required, got {arch.get(key)!r}")
    if concept is not None and concept.get("concept_dim", arch.get("n_embd")) != arch.get("n_embd"):
        out.append(f"{path / 'config.json'}: concept_dim: {concept['concept_dim']} != n_embd "
                   "(their code needs them equal)")
    return out


def config_dict(path: Path, arch: dict, concept: dict | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields of their config (``build_config("debug", **this)``)."""
    problems = _refusals(path, arch, concept)
    if problems:
        raise UserError(*problems)
    d = arch["n_embd"]
    out: dict[str, Any] = dict(
        name=path.name or "steerling", backbone="llama", vocab_size=arch["vocab_size"], pad_vocab_multiple=1,
        d_model=d, n_layers=arch["n_layers"], n_heads=arch["n_head"],
        n_kv_heads=arch.get("n_kv_heads") or arch["n_head"],
        ffn_dim=arch.get("intermediate_size") or arch.get("mlp_ratio", 4) * d, max_seq_len=arch["block_size"],
        rotary_pct=1.0 if arch.get("use_rope", True) else 0.0, rope_base=float(arch.get("rope_base", 500000.0)),
        norm_eps=float(arch.get("norm_eps", 1e-5)), parallel_residual=False, bias=bool(arch.get("use_bias", False)),
        tie_embeddings=bool(arch.get("weight_sharing", True)),
        qk_norm="head" if arch.get("use_qk_norm", True) else "none",
        clip_qkv=arch.get("clip_qkv"), norm_placement=arch.get("norm_order", "post"), objective="causal_diffusion",
        diffusion=dict(block_size=arch["diff_block_size"], mask_id=arch["mask_token_id"], mask_token=MASK_TOKEN),
        concept=dict(enabled=False))
    if concept is not None:
        n, m = concept.get("n_concepts", 33732), concept.get("n_unknown_concepts", 101196)
        factorised = concept.get("factorize_unknown", True)
        topk = concept.get("topk_known_features") or concept.get("topk_known", 32)
        out["bottleneck"] = dict(
            enabled=True, concepts=n, unknown=m, rank=concept.get("factorize_rank", 256) if factorised else d,
            unknown_head="low_rank" if factorised else "dense", chunk=arch["diff_block_size"], bias=False,
            logit_clamp=CLAMP, top_k_known=topk,
            top_k_unknown=concept.get("unknown_topk", 128) if concept.get("apply_topk_to_unknown", True) else None)
    return out


def model_config(path: str | Path, **overrides: Any):
    """The ``ModelConfig`` of a Steerling directory, with ``overrides`` (recipe keys) on top."""
    from ncpctl.model.core.config import ConfigError, build_config, deep_merge

    path = Path(path)
    arch, concept = read_config(path)
    try:
        return build_config("debug", **deep_merge(config_dict(path, arch, concept), overrides))
    except ConfigError as e:
        raise UserError(*(f"{path / 'config.json'}: {k}: {m}" for k, m in e.problems)) from None


# ---------------------------------------------------------------- weights

# each block's tensors: ncpctl's name -> theirs (the SwiGLU projection, reordered, apart)
LAYER_NAMES = {"attn_norm.weight": "ln_1.weight", "mlp_norm.weight": "ln_2.weight",
               "attn.qkv.weight": "attn.c_attn.weight", "attn.proj.weight": "attn.c_proj.weight",
               "mlp.proj.weight": "mlp.c_proj.weight", "attn.q_norm.weight": "attn.q_norm.weight",
               "attn.k_norm.weight": "attn.k_norm.weight", "attn.qkv.bias": "attn.c_attn.bias",
               "attn.proj.bias": "attn.c_proj.bias", "mlp.proj.bias": "mlp.c_proj.bias"}


def weight_files(path: Path) -> list[Path]:
    """Their safetensors: the index's shards, ``model.safetensors``, or every ``*.safetensors`` (their glob)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no weights (model.safetensors, model.safetensors.index.json or *.safetensors)")
    return files


def state_dict(cfg, path: Path) -> dict[str, Any]:
    """Their weights under ncpctl's names, mapped from the files (safetensors_map.py)."""
    import torch

    from .safetensors_map import MappedSafetensors

    w = MappedSafetensors(weight_files(path))
    pre = "transformer." if cfg.bottleneck.enabled else ""
    need = lambda k: k if k in w else _missing(path, k)  # noqa: E731
    ffn = cfg.ffn_dim
    sd = {"embed.weight": w.view(need(pre + "tok_emb.weight")), "final_norm.weight": w.view(need(pre + "ln_f.weight"))}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = w.view(need(pre + "lm_head.weight"))
    for i in range(cfg.n_layers):
        theirs, ours = f"{pre}blocks.{i}.", f"decoder.{i}."
        for o, t in LAYER_NAMES.items():
            qk, bias = o in ("attn.q_norm.weight", "attn.k_norm.weight"), o.endswith(".bias")
            if (not qk or cfg.qk_norm != "none") and (not bias or cfg.bias):
                sd[ours + o] = w.view(need(theirs + t))
        for p in ["weight"] + (["bias"] if cfg.bias else []):  # theirs [up; gate] -> ncpctl's [gate; up]
            sd[f"{ours}mlp.fc.{p}"] = w.copy(need(f"{theirs}mlp.c_fc.{p}"), lambda x: torch.cat([x[ffn:], x[:ffn]]))
    if cfg.bottleneck.enabled:
        sd.update(_concept_heads(cfg, w, need))
    return sd


def _concept_heads(cfg, w, need) -> dict[str, Any]:
    """The known and unknown heads (their padding rows dropped): U = A B with A their coefficients
    (or, unfactorised, their embedding with B = I)."""
    import torch

    n, m = cfg.bottleneck.concepts, cfg.bottleneck_unknown
    sd = {"bottleneck.known.weight": w.view(need("known_head.concept_predictor.weight"))[:n],
          "bottleneck.K": w.view(need("known_head.concept_embedding.weight"))[:n]}
    if "unknown_head.embedding_coef.weight" in w:
        sd["bottleneck.unknown.0.weight"] = w.view(need("unknown_head.predictor_down.weight"))
        sd["bottleneck.unknown.1.weight"] = w.view(need("unknown_head.predictor_up.weight"))[:m]
        sd["bottleneck.A"] = w.view("unknown_head.embedding_coef.weight")[:m]
        sd["bottleneck.B"] = w.copy(need("unknown_head.embedding_basis.weight"), lambda x: x.t())
    else:
        sd["bottleneck.unknown.weight"] = w.view(need("unknown_head.concept_predictor.weight"))[:m]
        sd["bottleneck.A"] = w.view(need("unknown_head.concept_embedding.weight"))[:m]
        sd["bottleneck.B"] = torch.eye(cfg.d_model, dtype=sd["bottleneck.A"].dtype)
    return sd


def _missing(path: Path, key: str):
    raise UserError(f"{path}: the weights lack {key!r} (not a Steerling model of this config.json)")


def load_into(cfg, path: Path, *, train: bool = False):
    """An ``NCPModel`` of ``cfg`` holding the directory's weights: on the CPU, in the files' dtype,
    sharing their pages (``train``: fp32 copies, train mode, for ``train.init_from``)."""
    import torch

    from ncpctl.model.core.model import NCPModel

    sd = state_dict(cfg, path)
    dtypes = {v.dtype for v in sd.values()}
    if train or len(dtypes) > 1:  # training reads fp32 copies; mixed files are read as fp32
        sd = {k: v.float() for k, v in sd.items()}
    with torch.device("meta"):
        model = NCPModel(cfg)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:
        why = str(e).strip().splitlines()[-1].strip()
        raise UserError(f"{path}: weights do not fit its config.json ({why})") from None
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not fit its config.json (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for mod in model.modules():  # non-persistent buffers (none hold values here) leave the meta device
        for key, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[key] = torch.empty(buf.shape, dtype=buf.dtype)
    return model.train(train)


# ---------------------------------------------------------------- as an ncpctl checkpoint


def meta(path: str | Path) -> dict[str, Any]:
    """What ``ncpctl.checkpoint.read_meta`` gives for a Steerling directory: its model config (no
    recipe, step 0) and where it came from."""
    path = Path(path)
    cfg = model_config(path)
    return {"format": "ncpctl-checkpoint", "version": 1, "step": 0, "tokens_seen": 0, "model_config": cfg.to_dict(),
            "recipe": None, "imported": {"from": "steerling", "path": str(path)}}


def load(path: str | Path, *, with_tokenizer: bool = True):
    """``ncpctl.checkpoint.load_model`` of a Steerling directory: the model (eval mode, CPU, the
    files' dtype, mapped), its tokenizer (tiktoken_bpe.py; with_tokenizer: refused with one line when
    it has none) and its ``meta``."""
    from ncpctl.checkpoint import LoadedModel
    from ncpctl.model.core.config import ModelConfig

    path = Path(path)
    m = meta(path)
    cfg = ModelConfig.from_dict(m["model_config"])
    tok = tokenizer_of(path) if with_tokenizer else None
    return LoadedModel(model=load_into(cfg, path), config=cfg, tokenizer=tok, meta=m, path=path)


def tokenizer_of(path: str | Path):
    """The directory's tokenizer (tiktoken_bpe.py), refused with one line when it has none."""
    from .tiktoken_bpe import tokenizer

    return tokenizer(Path(path), read_config(Path(path))[0], required=True)


# ---------------------------------------------------------------- train.init_from


def init_config(model: Any, directory: str | Path, problems: list) -> Any:
    """``train.init_from: <Steerling dir>`` with a ``model`` section: its config plus the recipe's
    explicit model keys (as for a Hugging Face directory); problems reported at load time."""
    explicit = model.model_dump(exclude={"size", "vocab_size"}, exclude_none=True)
    try:
        return model_config(directory, **explicit)
    except UserError as e:
        problems.extend(("train.init_from", m) for m in e.problems)
        return None


def load_pretrained(directory: str | Path, cfg: Any = None):
    """The model ``midtrain`` starts from (fp32, CPU, train mode): the directory's weights in ``cfg``
    (the recipe loader's; None: the directory's own config)."""
    directory = Path(directory)
    return load_into(cfg if cfg is not None else model_config(directory), directory, train=True)

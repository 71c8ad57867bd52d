"""``ncpctl export CKPT --format steerling``: a model back into Steerling's own layout (issue 43 item 3).

Writes the package's layout (``scripts/convert_weights.py``'s, which ``SteerlingGenerator.from_pretrained``
loads without remote code): ``config.json`` (``model_type: causal_diffusion``, ``CausalDiffusionConfig``'s
fields, the token ids, a nested ``concept`` for a model with the concept bottleneck), the weights under
their names (``transformer.`` before the backbone's in an interpretable model; the SwiGLU projection
back to ``[up; gate]``; the concept heads' rows padded to 16 with zeros; the tied LM head left out, as
their converter does) in ``model.safetensors`` or shards with an index (``model-0000i-of-0000n``, their
converter's naming), the
tiktoken file and ``tokenizer_config.json`` of an imported model. The export is imported back and its
logits compared with the source's before it is put in place (and tools/reference/steerling.py
``check`` loads it with their code). A model their code cannot compute (another backbone, a concept
path, sliding windows, biases on the concept heads, no logit clamp, ...) is refused with the reasons.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError

from .steerling import CLAMP, LAYER_NAMES

TOLERANCE = 1e-5  # max |logit difference| of the re-import, relative to max |logit|
PAD = 16  # their ConceptHead pads its rows to a multiple of pad_multiple (16)


def refusals(model) -> list[str]:
    """Why their code cannot compute this model's function (empty: it can)."""
    from ncpctl.model.designs.causal_diffusion.module import CausalDiffusion
    from ncpctl.model.core.layers import MLP, Block, PlainResidual, RMSNorm

    cfg, out = model.cfg, []
    blk = model.decoder[0] if len(model.decoder) else None
    checks = [
        (model.concept is not None, "a concept path (model.concept): their model has none"),
        (not isinstance(model.objective, CausalDiffusion), "objective: theirs is the Causal Diffusion LM"),
        (not isinstance(model.final_norm, RMSNorm), "their use_rms_norm needs RMSNorm (backbone llama)"),
        (blk is None or type(blk) is not Block or not isinstance(blk.mlp, MLP) or not blk.mlp.gated,
         "their blocks are RMSNorm + SwiGLU + attention (backbone llama)"),
        (cfg.parallel_residual, "parallel_residual: their blocks are sequential"),
        (not isinstance(model.decoder.residual, PlainResidual), "residual: theirs is x + f(x)"),
        (cfg.qk_norm == "layer", "qk_norm layer: theirs is per head"),
        (cfg.rotary_pct not in (0.0, 1.0) or cfg.rope_scaling is not None, "their RoPE rotates whole heads, unscaled"),
        (cfg.sliding_window is not None, "sliding_window: their attention is block-causal only"),
        (cfg.mtp_depth or model.logit_divisor is not None or cfg.extra_token_layers, "MTP, muP or extra layers"),
    ]
    b = cfg.bottleneck
    if b.enabled:
        checks += [(b.bias, "bottleneck.bias: their concept heads have no biases"),
                   (b.logit_clamp != CLAMP, f"bottleneck.logit_clamp: their heads clamp at {CLAMP:g}"),
                   (b.unknown_head == "low_rank" and not 16 <= cfg.bottleneck_rank <= 1024,
                    "bottleneck.rank: their factorize_rank is 16..1024")]
    return [why for bad, why in checks if bad]


def _config(loaded) -> dict[str, Any]:
    """Their config.json: ``convert_weights.build_steerling_config``'s fields."""
    cfg, src = loaded.config, _source_config(loaded)
    d = dict(model_type="causal_diffusion", interpretable=cfg.bottleneck.enabled, n_layers=cfg.n_layers,
             n_head=cfg.n_heads, n_embd=cfg.d_model, block_size=cfg.max_seq_len,
             n_kv_heads=cfg.n_kv_heads or cfg.n_heads,
             diff_block_size=cfg.diffusion.block_size, use_rms_norm=True, norm_eps=cfg.norm_eps,
             norm_order=cfg.norm_placement, use_qk_norm=cfg.qk_norm == "head", use_rope=cfg.rotary_pct > 0,
             rope_base=cfg.rope_base, rope_full_precision=True, mlp_type="swiglu", activation="gelu",
             mlp_ratio=max(1, cfg.ffn_dim // cfg.d_model), intermediate_size=cfg.ffn_dim, use_bias=bool(cfg.bias),
             clip_qkv=cfg.clip_qkv, weight_sharing=cfg.tie_embeddings)
    tok = loaded.tokenizer
    for key, text in (("pad_token_id", "<|pad|>"), ("bos_token_id", "<|bos|>"), ("eos_token_id", "<|endoftext|>"),
                      ("endofchunk_token_id", "<|endofchunk|>")):
        tid = src.get(key, tok.token_to_id(text) if tok is not None else None)
        if tid is not None:
            d[key] = tid
    d.update(mask_token_id=cfg.diffusion.mask_id, vocab_size=cfg.vocab_size)
    b = cfg.bottleneck
    if b.enabled:
        low = b.unknown_head == "low_rank"
        d["concept"] = dict(
            n_concepts=b.concepts, n_unknown_concepts=cfg.bottleneck_unknown, max_concepts=16, concept_dim=cfg.d_model,
            use_attention_known=False, use_attention_unknown=False, topk_known=b.top_k_known,
            topk_known_features=b.top_k_known, unknown_topk=b.top_k_unknown, use_unknown=True,
            apply_topk_to_unknown=b.top_k_unknown is not None, topk_on_logits=False, factorize_unknown=low,
            factorize_rank=cfg.bottleneck_rank if low else 256, use_epsilon_correction=True, block_size=4096,
            pad_multiple=PAD, store_unknown_weights=False, inject_layer=src.get("inject_layer", cfg.n_layers // 2),
            inject_alpha=1.0)
    return d


def _source_config(loaded) -> dict[str, Any]:
    """The config.json of an imported Steerling directory (its token ids), else {}."""
    src = (loaded.meta.get("imported") or {}).get("path")
    if not src:
        return {}
    raw = json.loads((Path(src) / "config.json").read_text())
    return {**raw, **(raw.get("concept") or {})}


def _padded(x, rows: int):
    import torch

    n = -(-rows // PAD) * PAD
    return torch.cat([x, x.new_zeros(n - rows, *x.shape[1:])]) if n > rows else x


def state(model) -> dict[str, Any]:
    """The weights under their names (contiguous copies in the model's dtype)."""
    import torch

    cfg, sd = model.cfg, model.state_dict()
    pre = "transformer." if cfg.bottleneck.enabled else ""
    V = cfg.vocab_size  # their embedding has exactly the real vocabulary (ncpctl's padded rows are no token)
    out = {pre + "tok_emb.weight": sd["embed.weight"][:V], pre + "ln_f.weight": sd["final_norm.weight"]}
    if not cfg.tie_embeddings:
        out[pre + "lm_head.weight"] = sd["lm_head.weight"][:V]
    ffn = cfg.ffn_dim
    for i in range(cfg.n_layers):
        ours, theirs = f"decoder.{i}.", f"{pre}blocks.{i}."
        out.update({theirs + t: sd[ours + o] for o, t in LAYER_NAMES.items() if ours + o in sd})
        for p in ("weight", "bias"):
            if f"{ours}mlp.fc.{p}" in sd:  # ncpctl's [gate; up] -> their [up; gate]
                gate, up = sd[f"{ours}mlp.fc.{p}"].split([ffn, ffn])
                out[f"{theirs}mlp.c_fc.{p}"] = torch.cat([up, gate])
    if cfg.bottleneck.enabled:
        n, m = cfg.bottleneck.concepts, cfg.bottleneck_unknown
        out["known_head.concept_predictor.weight"] = _padded(sd["bottleneck.known.weight"], n)
        out["known_head.concept_embedding.weight"] = _padded(sd["bottleneck.K"], n)
        if cfg.bottleneck.unknown_head == "low_rank":
            out["unknown_head.predictor_down.weight"] = sd["bottleneck.unknown.0.weight"]
            out["unknown_head.predictor_up.weight"] = _padded(sd["bottleneck.unknown.1.weight"], m)
            out["unknown_head.embedding_coef.weight"] = _padded(sd["bottleneck.A"], m)
            out["unknown_head.embedding_basis.weight"] = sd["bottleneck.B"].t()
        else:  # their dense unknown embedding is ncpctl's U = A B
            out["unknown_head.concept_predictor.weight"] = _padded(sd["bottleneck.unknown.weight"], m)
            out["unknown_head.concept_embedding.weight"] = _padded(sd["bottleneck.A"] @ sd["bottleneck.B"], m)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def export(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", max_shard_size: str | int = "5GB",
           verify: bool = True, log=lambda m: None, move_aside: bool = False) -> dict[str, Any]:
    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.interop.hf_export import _new_dir, _put_in_place, _save_weights, existing, write_marker

    if dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype: {dtype!r} is not one of fp32, bf16")
    out = Path(out)
    existing(out, move_aside)
    from .steerling import detect

    loaded = load_model(checkpoint, with_tokenizer=not detect(checkpoint))  # an ncpctl checkpoint's, if it has one
    why = refusals(loaded.model)
    if why:
        raise UserError(*(f"{loaded.path}: cannot export in Steerling's layout: {w}" for w in why))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_dir(out)
    try:
        sd = state(loaded.model)  # their names; shards named as their converter names them (model-0000i-of-0000n)
        shards = _save_weights(sd, tmp, torch_dtype, max_shard_size)
        (tmp / "config.json").write_text(json.dumps(_config(loaded), indent=2) + "\n")
        _tokenizer_files(loaded, tmp)
        info = {"format": "steerling", "dtype": dtype, "shards": shards,
                "parameters": sum(v.numel() for v in sd.values())}
        if verify:
            log("verifying: importing the export back and comparing logits")
            info["verify"] = _verify(loaded, tmp, torch_dtype)
        write_marker(tmp, "ncpctl export --format steerling", loaded.path)  # sizes and checksums: issue 42
        aside = _put_in_place(tmp, out, move_aside)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(out), "files": sorted(p.name for p in out.iterdir()),
            **({"moved_aside": str(aside)} if aside is not None else {})}


def _tokenizer_files(loaded, d: Path) -> None:
    """An imported model's tiktoken file and tokenizer_config.json travel with it; an ncpctl
    checkpoint's tokenizer.json too (their loader reads tiktoken's; ncpctl reads this one back)."""
    src = Path((loaded.meta.get("imported") or {}).get("path") or loaded.path)
    for f in [*sorted(src.glob("*.tiktoken")), src / "tokenizer_config.json", src / "tokenizer.json"]:
        if f.is_file():
            shutil.copyfile(f, d / f.name)


def _verify(loaded, d: Path, torch_dtype) -> dict[str, float]:
    """The export imported back (steerling.py) against the source, on a probe batch with [MASK]s."""
    import torch

    from .steerling import load_into, model_config

    cfg = loaded.config
    g = torch.Generator().manual_seed(0)
    T = min(cfg.max_seq_len, 3 * cfg.diffusion.block_size + 1)
    x = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    x[:, T // 2:] = torch.where(torch.rand(2, T - T // 2, generator=g) < 0.5, cfg.diffusion.mask_id, x[:, T // 2:])
    src = loaded.model.to(torch_dtype)
    back = load_into(model_config(d), d)
    with torch.no_grad():
        a = src(x).logits[..., : cfg.vocab_size].float()
        b = back(x).logits.float()
    diff, scale = float((a - b).abs().max()), float(a.abs().max())
    if diff > TOLERANCE * max(scale, 1.0):
        raise UserError(f"export check failed: the re-imported model's logits differ by {diff:.3g} "
                        f"(max |logit| {scale:.3g}); nothing was written")
    return {"max_abs_diff": diff, "max_abs_logit": scale, "tolerance": TOLERANCE * max(scale, 1.0)}

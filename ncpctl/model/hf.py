"""Weights and configs to and from HF transformers (GPT-NeoX, Llama, Qwen3).

* ``hf_config(cfg)`` / ``config_from_hf(hf_cfg)``: ``neox`` <-> ``GPTNeoXConfig``;
  ``llama`` <-> ``LlamaConfig``, or ``Qwen3Config`` when it has per-head QK-norm (``qk_norm:
  head``, which Qwen3 always has), incl. sliding windows on every layer but each n-th.
  Layer-wise QK-norm (OLMo-2 style) has no pre-norm HF equivalent and is not exported.
* ``to_hf_state_dict(model)`` / ``from_hf_state_dict(cfg, sd)``: state dicts, layer by
  layer (token layer i = ``encoder[i]`` if i < E else ``decoder[i-E]``). The HF model holds
  ``padded_vocab_size`` rows; a smaller HF vocab is zero-padded on import (slice logits to
  ``vocab_size`` when scoring). Importing into a concept model fills the backbone only
  (and, with ``concept.copy_concept_layers_from_base``, the concept layers from the base's
  first C layers); ``load_hf_state_dict`` loads it and returns the keys left at init.

Only the model state is converted; this module does no file I/O (HF ``save_pretrained`` /
safetensors do that in the caller).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ncpctl.model.config import ConfigError, ModelConfig

# ---- configs ---------------------------------------------------------------------------


def _layer_types(cfg: ModelConfig) -> list[str]:
    return ["full_attention" if w is None else "sliding_attention" for w in cfg.token_windows]


def hf_config(cfg: ModelConfig):
    """The HF config of ``cfg``'s backbone (``n_token_layers`` layers, padded vocab)."""
    import transformers

    problems: list[tuple[str, str]] = []
    if cfg.concept.enabled:
        problems.append(("concept.enabled", "HF models have no concept path; export a base model"))
    if cfg.residual != "plain":
        problems.append(("residual", f"HF models have plain residuals, not {cfg.residual!r}"))
    common = dict(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_token_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
    )
    if cfg.backbone == "neox":
        for name, bad, why in (
            ("n_kv_heads", cfg.n_kv_heads != cfg.n_heads, "GPT-NeoX has no GQA"),
            ("qk_norm", cfg.qk_norm != "none", "GPT-NeoX has no QK-norm"),
            ("sliding_window", cfg.sliding_window is not None, "GPT-NeoX has no sliding window"),
            ("bias", not cfg.bias, "GPT-NeoX MLPs always have biases"),
        ):
            if bad:
                problems.append((name, why))
        if problems:
            raise ConfigError(problems)
        return transformers.GPTNeoXConfig(
            **common, hidden_act="gelu", layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual,
            attention_bias=cfg.bias,
            rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base, partial_rotary_factor=cfg.rotary_pct),
        )
    if cfg.rotary_pct != 1.0:
        problems.append(("rotary_pct", "HF Llama/Qwen3 rotate whole heads"))
    if cfg.parallel_residual:
        problems.append(("parallel_residual", "HF Llama/Qwen3 blocks are sequential"))
    llama = dict(
        **common, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        rms_norm_eps=cfg.norm_eps, attention_bias=cfg.bias,
        rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base),
    )
    if cfg.qk_norm == "head":
        if cfg.bias:
            problems.append(("bias", "Qwen3 MLPs have no biases"))
        if problems:
            raise ConfigError(problems)
        return transformers.Qwen3Config(
            **llama, use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
            layer_types=_layer_types(cfg),
        )
    if cfg.qk_norm == "layer":
        problems.append(("qk_norm", "layer-wise QK-norm has no pre-norm HF model (OLMo-2 is post-norm)"))
    if cfg.sliding_window is not None:
        problems.append(("sliding_window", "HF Llama has no sliding window (use qk_norm: head -> Qwen3)"))
    if problems:
        raise ConfigError(problems)
    return transformers.LlamaConfig(**llama, mlp_bias=cfg.bias)


def _rope(hf) -> dict[str, Any]:
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    if rp.get("rope_type", "default") != "default":
        raise ConfigError([("rope_parameters", f"rope_type {rp['rope_type']!r} is not supported (only default)")])
    return rp


HF_MODEL_TYPES = ("gpt_neox", "llama", "qwen3")  # the HF model types config_from_hf reads


def config_from_hf(hf, **overrides: Any) -> ModelConfig:
    """A ``ModelConfig`` for the HF config ``hf`` (``overrides`` add e.g. ``concept=...``)."""
    mt = hf.model_type
    if mt not in HF_MODEL_TYPES:  # before reading any field: other types name them differently
        raise ConfigError([("model_type", f"unsupported HF model type {mt!r} ({', '.join(HF_MODEL_TYPES)})")])
    d, H = hf.hidden_size, hf.num_attention_heads
    base = dict(
        name=getattr(hf, "name_or_path", "") or mt, vocab_size=hf.vocab_size, d_model=d,
        n_layers=hf.num_hidden_layers, n_heads=H, ffn_dim=hf.intermediate_size,
        max_seq_len=hf.max_position_embeddings, tie_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
    )
    rp = _rope(hf)
    if mt == "gpt_neox":
        if hf.hidden_act != "gelu":
            raise ConfigError([("hidden_act", f"only exact gelu is supported, got {hf.hidden_act!r}")])
        base.update(
            backbone="neox", rotary_pct=rp.get("partial_rotary_factor", 0.25), rope_base=rp["rope_theta"],
            norm_eps=hf.layer_norm_eps, parallel_residual=hf.use_parallel_residual, bias=hf.attention_bias,
        )
    elif mt in ("llama", "qwen3"):
        problems = []
        if getattr(hf, "head_dim", None) not in (None, d // H):
            problems.append(("head_dim", f"{hf.head_dim} != hidden_size/heads = {d // H}"))
        if hf.hidden_act != "silu":
            problems.append(("hidden_act", f"only silu is supported, got {hf.hidden_act!r}"))
        if mt == "llama" and getattr(hf, "mlp_bias", False) != hf.attention_bias:
            problems.append(("mlp_bias", "attention and MLP biases must agree"))
        base.update(
            backbone="llama", n_kv_heads=hf.num_key_value_heads, rotary_pct=1.0, rope_base=rp["rope_theta"],
            norm_eps=hf.rms_norm_eps, parallel_residual=False, bias=hf.attention_bias,
        )
        if mt == "qwen3":
            base["qk_norm"] = "head"
            types = list(hf.layer_types)
            if "sliding_attention" in types:
                full = [i for i, t in enumerate(types) if t == "full_attention"]
                every = full[0] + 1 if full else len(types) + 1
                base.update(sliding_window=hf.sliding_window, full_attn_every=every)
                want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(len(types))]
                if types != want:
                    problems.append(("layer_types", "only 'every n-th layer full' window patterns are supported"))
        if problems:
            raise ConfigError(problems)
    else:
        raise ConfigError([("model_type", f"unsupported HF model type {mt!r} (gpt_neox, llama, qwen3)")])
    base.update(overrides)
    return ModelConfig.from_dict(base)


# ---- state dicts -----------------------------------------------------------------------


def _neox_qkv_to_hf(w: torch.Tensor, H: int, hd: int) -> torch.Tensor:
    """Ours [q; k; v] rows -> HF GPT-NeoX per-head interleaved (H, 3, hd) rows."""
    return w.reshape(3, H, hd, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _neox_qkv_from_hf(w: torch.Tensor, H: int, hd: int) -> torch.Tensor:
    return w.reshape(H, 3, hd, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Top-level (non-layer) names: ours -> HF."""
    if cfg.backbone == "neox":
        out = {"embed.weight": "gpt_neox.embed_in.weight", "final_norm.weight": "gpt_neox.final_layer_norm.weight",
               "final_norm.bias": "gpt_neox.final_layer_norm.bias"}
    else:
        out = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    out["lm_head.weight"] = "lm_head.weight"
    return out


def _layer_to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], ours: str, hf: str) -> dict[str, torch.Tensor]:
    """One block: our keys under prefix ``ours`` -> HF keys under prefix ``hf``."""
    H, Hkv, hd, ffn = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    g = lambda n: sd[ours + n]  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    params = ["weight"] + (["bias"] if cfg.bias else [])
    if cfg.backbone == "neox":
        for p in ("weight", "bias"):
            out[f"{hf}input_layernorm.{p}"] = g(f"attn_norm.{p}")
            out[f"{hf}post_attention_layernorm.{p}"] = g(f"mlp_norm.{p}")
        for p in params:
            out[f"{hf}attention.query_key_value.{p}"] = _neox_qkv_to_hf(g(f"attn.qkv.{p}"), H, hd)
            out[f"{hf}attention.dense.{p}"] = g(f"attn.proj.{p}")
            out[f"{hf}mlp.dense_h_to_4h.{p}"] = g(f"mlp.fc.{p}")
            out[f"{hf}mlp.dense_4h_to_h.{p}"] = g(f"mlp.proj.{p}")
        return out
    out[f"{hf}input_layernorm.weight"] = g("attn_norm.weight")
    out[f"{hf}post_attention_layernorm.weight"] = g("mlp_norm.weight")
    if cfg.qk_norm != "none":
        out[f"{hf}self_attn.q_norm.weight"] = g("attn.q_norm.weight")
        out[f"{hf}self_attn.k_norm.weight"] = g("attn.k_norm.weight")
    for p in params:
        q, k, v = g(f"attn.qkv.{p}").split([H * hd, Hkv * hd, Hkv * hd])
        out[f"{hf}self_attn.q_proj.{p}"], out[f"{hf}self_attn.k_proj.{p}"], out[f"{hf}self_attn.v_proj.{p}"] = q, k, v
        out[f"{hf}self_attn.o_proj.{p}"] = g(f"attn.proj.{p}")
        out[f"{hf}mlp.gate_proj.{p}"], out[f"{hf}mlp.up_proj.{p}"] = g(f"mlp.fc.{p}").split([ffn, ffn])
        out[f"{hf}mlp.down_proj.{p}"] = g(f"mlp.proj.{p}")
    return out


def _layer_from_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], hf: str, ours: str) -> dict[str, torch.Tensor]:
    H, hd = cfg.n_heads, cfg.head_dim
    g = lambda n: sd[hf + n]  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    params = ["weight"] + (["bias"] if cfg.bias else [])
    if cfg.backbone == "neox":
        for p in ("weight", "bias"):
            out[f"{ours}attn_norm.{p}"] = g(f"input_layernorm.{p}")
            out[f"{ours}mlp_norm.{p}"] = g(f"post_attention_layernorm.{p}")
        for p in params:
            out[f"{ours}attn.qkv.{p}"] = _neox_qkv_from_hf(g(f"attention.query_key_value.{p}"), H, hd)
            out[f"{ours}attn.proj.{p}"] = g(f"attention.dense.{p}")
            out[f"{ours}mlp.fc.{p}"] = g(f"mlp.dense_h_to_4h.{p}")
            out[f"{ours}mlp.proj.{p}"] = g(f"mlp.dense_4h_to_h.{p}")
        return out
    out[f"{ours}attn_norm.weight"] = g("input_layernorm.weight")
    out[f"{ours}mlp_norm.weight"] = g("post_attention_layernorm.weight")
    if cfg.qk_norm != "none":
        out[f"{ours}attn.q_norm.weight"] = g("self_attn.q_norm.weight")
        out[f"{ours}attn.k_norm.weight"] = g("self_attn.k_norm.weight")
    for p in params:
        out[f"{ours}attn.qkv.{p}"] = torch.cat([g(f"self_attn.{n}_proj.{p}") for n in "qkv"])
        out[f"{ours}attn.proj.{p}"] = g(f"self_attn.o_proj.{p}")
        out[f"{ours}mlp.fc.{p}"] = torch.cat([g(f"mlp.gate_proj.{p}"), g(f"mlp.up_proj.{p}")])
        out[f"{ours}mlp.proj.{p}"] = g(f"mlp.down_proj.{p}")
    return out


def _ours_layer(cfg: ModelConfig, i: int) -> str:
    E = cfg.encoder_layers
    return f"encoder.{i}." if i < E else f"decoder.{i - E}."


def _hf_layer(cfg: ModelConfig, i: int) -> str:
    return f"gpt_neox.layers.{i}." if cfg.backbone == "neox" else f"model.layers.{i}."


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """HF state dict of a base model (``model.cfg`` as given by ``hf_config``)."""
    cfg: ModelConfig = model.cfg
    if cfg.concept.enabled:
        raise ConfigError([("concept.enabled", "HF models have no concept path; export a base model")])
    sd = model.state_dict()
    out = {hf: sd[ours] for ours, hf in _names(cfg).items() if ours in sd}
    for i in range(cfg.n_token_layers):
        out.update(_layer_to_hf(cfg, sd, _ours_layer(cfg, i), _hf_layer(cfg, i)))
    return out


def from_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from an HF one: every backbone weight HF has (plus, with
    ``concept.copy_concept_layers_from_base``, the concept layers). Keys HF lacks (concept
    path, PM's extra token layers) are absent: load with ``strict=False``."""
    sd = dict(sd)
    if "embed_out.weight" in sd:  # original Pythia checkpoints
        sd.setdefault("lm_head.weight", sd.pop("embed_out.weight"))
    prefix = "gpt_neox.layers." if cfg.backbone == "neox" else "model.layers."
    n_hf = len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})
    if not cfg.n_layers <= n_hf <= cfg.n_token_layers:
        raise ConfigError([("n_layers", f"the HF state dict has {n_hf} layers, the config {cfg.n_layers}")])
    out: dict[str, torch.Tensor] = {}
    for ours, hf in _names(cfg).items():
        if hf in sd:
            out[ours] = sd[hf]
    if "lm_head.weight" not in out:  # HF may omit a tied head
        out["lm_head.weight"] = out["embed.weight"]
    for name in ("embed.weight", "lm_head.weight"):
        if name in out:
            rows = out[name].shape[0]
            if rows > cfg.padded_vocab_size:
                raise ConfigError([("vocab_size", f"HF has {rows} rows, more than {cfg.padded_vocab_size}")])
            out[name] = F.pad(out[name], (0, 0, 0, cfg.padded_vocab_size - rows))
    for i in range(n_hf):
        out.update(_layer_from_hf(cfg, sd, _hf_layer(cfg, i), _ours_layer(cfg, i)))
    c = cfg.concept
    if c.enabled and c.copy_concept_layers_from_base:
        if c.concept_layers > n_hf:
            raise ConfigError([("concept.concept_layers", f"{c.concept_layers} > the base's {n_hf} layers to copy")])
        for j in range(c.concept_layers):
            out.update(_layer_from_hf(cfg, sd, _hf_layer(cfg, j), f"concept.layers.{j}."))
    return out


def load_hf_state_dict(model, sd: dict[str, torch.Tensor]) -> list[str]:
    """Load an HF state dict into ``model``; returns the keys left at their init."""
    missing, unexpected = model.load_state_dict(from_hf_state_dict(model.cfg, sd), strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected keys after HF conversion: {unexpected}")
    return list(missing)

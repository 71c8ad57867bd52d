"""Weights and configs to and from HF transformers (GPT-NeoX, Llama, Qwen3, OLMo-2/3, GPT-2).

* ``hf_config(cfg)`` / ``config_from_hf(hf_cfg)``: ``neox`` <-> ``GPTNeoXConfig``;
  ``llama`` <-> ``LlamaConfig`` (``rope_type: llama3`` scaling included), or ``Qwen3Config``
  when it has per-head QK-norm (``qk_norm: head``, which Qwen3 always has), incl. sliding
  windows on every layer but each n-th; post-norm ``llama`` (``norm_placement: post``, with
  the layer-wise QK-norm OLMo always has) <-> ``Olmo2Config``, or ``Olmo3Config`` when it has
  a sliding window (OLMo-3's ``layer_types``; one RoPE for both layer types); ``gpt2`` <->
  ``GPT2Config`` (Conv1D weights are stored transposed). Layer-wise QK-norm with pre-norm
  has no HF model and is not exported. The importer reads an allow-list of fields per model
  type: any other field that may change the computation is refused by name (ids, dtypes,
  dropout pass).
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
    problems: list[tuple[str, str]] = []
    if cfg.concept.enabled:
        problems.append(("concept.enabled", "HF models have no concept path; export a base model"))
    if cfg.residual != "plain":
        problems.append(("residual", f"HF models have plain residuals, not {cfg.residual!r}"))
    if cfg.mup_base_width is not None and cfg.tie_embeddings:
        problems.append(("mup_base_width", _MUP_TIED))
    build = {"neox": _neox_config, "gpt2": _gpt2_config, "llama": _llama_config}[cfg.backbone]
    return build(cfg, problems)


def _common(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_token_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
    )


def _refuse(problems, checks) -> None:
    problems.extend((name, why) for name, bad, why in checks if bad)
    if problems:
        raise ConfigError(problems)


_POST = "post-norm blocks export as OLMo-2/3 (backbone: llama, qk_norm: layer)"


def _neox_config(cfg: ModelConfig, problems: list):
    import transformers

    _refuse(problems, (
        ("norm_placement", cfg.norm_placement != "pre", f"GPT-NeoX blocks are pre-norm; {_POST}"),
        ("n_kv_heads", cfg.n_kv_heads != cfg.n_heads, "GPT-NeoX has no GQA"),
        ("qk_norm", cfg.qk_norm != "none", "GPT-NeoX has no QK-norm"),
        ("sliding_window", cfg.sliding_window is not None, "GPT-NeoX has no sliding window"),
        ("bias", not cfg.bias, "GPT-NeoX MLPs always have biases"),
        ("rope_scaling", cfg.rope_scaling is not None, "the GPT-NeoX export writes no RoPE scaling"),
    ))
    return transformers.GPTNeoXConfig(
        **_common(cfg), hidden_act="gelu", layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual,
        attention_bias=cfg.bias,
        rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base, partial_rotary_factor=cfg.rotary_pct),
    )


def _gpt2_config(cfg: ModelConfig, problems: list):
    import transformers

    _refuse(problems, (
        ("norm_placement", cfg.norm_placement != "pre", f"GPT-2 blocks are pre-norm; {_POST}"),
        ("n_kv_heads", cfg.n_kv_heads != cfg.n_heads, "GPT-2 has no GQA"),
        ("qk_norm", cfg.qk_norm != "none", "GPT-2 has no QK-norm"),
        ("sliding_window", cfg.sliding_window is not None, "GPT-2 has no sliding window"),
        ("bias", not cfg.bias, "GPT-2 layers always have biases"),
        ("parallel_residual", cfg.parallel_residual, "GPT-2 blocks are sequential"),
    ))
    return transformers.GPT2Config(
        vocab_size=cfg.padded_vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_token_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim, n_positions=cfg.max_seq_len, activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )


def _llama_config(cfg: ModelConfig, problems: list):
    import transformers

    rope = dict(rope_type="default", rope_theta=cfg.rope_base)
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_base}
    llama = dict(
        **_common(cfg), num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        rms_norm_eps=cfg.norm_eps, attention_bias=cfg.bias, rope_parameters=rope,
    )
    checks = [("rotary_pct", cfg.rotary_pct != 1.0, "HF Llama/Qwen3/OLMo rotate whole heads"),
              ("parallel_residual", cfg.parallel_residual, "HF Llama/Qwen3/OLMo blocks are sequential")]
    if cfg.norm_placement == "post":
        return _olmo_config(cfg, llama, checks, problems)
    if cfg.qk_norm == "head":
        _refuse(problems, (*checks, ("bias", cfg.bias, "Qwen3 MLPs have no biases")))
        return transformers.Qwen3Config(
            **llama, use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
            layer_types=_layer_types(cfg),
        )
    _refuse(problems, (
        *checks,
        ("qk_norm", cfg.qk_norm == "layer",
         "layer-wise QK-norm has no pre-norm HF model (OLMo-2/3 have it with norm_placement: post)"),
        ("sliding_window", cfg.sliding_window is not None, "HF Llama has no sliding window (use qk_norm: head -> Qwen3)"),
    ))
    return transformers.LlamaConfig(**llama, mlp_bias=cfg.bias)


def _olmo_config(cfg: ModelConfig, llama: dict[str, Any], checks: list, problems: list):
    """Post-norm llama: ``Olmo2Config`` without a sliding window, else ``Olmo3Config``, whose
    RoPE is given per layer type (the same for both here: ncpctl has one)."""
    import transformers

    _refuse(problems, (
        *checks,
        ("qk_norm", cfg.qk_norm != "layer", "the post-norm HF models (OLMo-2/3) always have layer-wise QK-norm"),
        ("bias", cfg.bias, "OLMo-2/3 MLPs have no biases"),
    ))
    llama.update(pad_token_id=None, eos_token_id=None)  # not OLMo's ids (the export sets the tokenizer's)
    if cfg.sliding_window is None:
        return transformers.Olmo2Config(**llama)
    rope = llama.pop("rope_parameters")
    return transformers.Olmo3Config(
        **llama, rope_parameters={t: dict(rope) for t in ("sliding_attention", "full_attention")},
        sliding_window=cfg.sliding_window, layer_types=_layer_types(cfg),
    )


HF_MODEL_TYPES = ("gpt_neox", "llama", "qwen3", "olmo2", "olmo3", "gpt2")  # the HF model types config_from_hf reads

# Fields the importer reads (or checks), per model type; a field outside them and outside
# _INERT is refused: it may change the computation in a way the import would silently drop.
_READ = {
    "gpt_neox": {"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                 "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act", "layer_norm_eps",
                 "use_parallel_residual", "attention_bias", "rope_parameters", "rope_theta", "rotary_pct",
                 "rotary_emb_base", "partial_rotary_factor", "rope_scaling"},
    "llama": {"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
              "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act", "rms_norm_eps",
              "num_key_value_heads", "head_dim", "attention_bias", "mlp_bias", "rope_parameters", "rope_theta",
              "rope_scaling", "pretraining_tp"},
    "gpt2": {"n_embd", "n_head", "n_layer", "n_inner", "n_positions", "vocab_size", "tie_word_embeddings",
             "activation_function", "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
             "reorder_and_upcast_attn", "add_cross_attention"},
}
_READ["qwen3"] = _READ["llama"] - {"mlp_bias", "pretraining_tp"} | {"layer_types", "sliding_window",
                                                                      "use_sliding_window", "max_window_layers"}
# transformers 5 keeps OLMo's RoPE in rope_parameters only (no rope_theta / rope_scaling fields)
_READ["olmo2"] = _READ["llama"] - {"mlp_bias", "pretraining_tp", "rope_theta", "rope_scaling"}
_READ["olmo3"] = _READ["olmo2"] | {"layer_types", "sliding_window"}
# Fields that do not change what the model computes: ids, dtypes, bookkeeping, initialisation,
# dropout (training-time regularisation ncpctl does not apply) and GPT-2's unused summary head.
_INERT = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
    "is_encoder_decoder", "is_decoder", "label2id", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "initializer_range",
    "attention_dropout", "hidden_dropout", "classifier_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop",
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj",
    "use_return_dict", "tie_encoder_decoder", "name_or_path",
}


def config_from_hf(hf, **overrides: Any) -> ModelConfig:
    """A ``ModelConfig`` for the HF config ``hf`` (``overrides`` add e.g. ``concept=...``)."""
    mt = hf.model_type
    if mt not in HF_MODEL_TYPES:  # before reading any field: other types name them differently
        raise ConfigError([("model_type", f"unsupported HF model type {mt!r} ({', '.join(HF_MODEL_TYPES)})")])
    unknown = sorted(set(hf.to_dict()) - _READ[mt] - _INERT)
    if unknown:
        raise ConfigError([("config", f"{mt}: field(s) the importer does not understand and that may change the "
                                      f"computation: {', '.join(unknown)}")])
    base = _gpt2_fields(hf) if mt == "gpt2" else _rope_fields(hf, mt)
    base.setdefault("name", getattr(hf, "name_or_path", "") or mt)
    base.update(overrides)
    return ModelConfig.from_dict(base)


def _gpt2_fields(hf) -> dict[str, Any]:
    problems = [(k, f"must be {want!r}, got {getattr(hf, k)!r}") for k, want in (
        ("activation_function", "gelu_new"), ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)) if getattr(hf, k) != want]
    if problems:
        raise ConfigError(problems)
    return dict(backbone="gpt2", vocab_size=hf.vocab_size, d_model=hf.n_embd, n_layers=hf.n_layer, n_heads=hf.n_head,
                ffn_dim=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions, norm_eps=hf.layer_norm_epsilon,
                tie_embeddings=bool(hf.tie_word_embeddings), init_std=hf.initializer_range)


def _rope_fields(hf, mt: str) -> dict[str, Any]:
    """GPT-NeoX, Llama and Qwen3: the fields they share, RoPE (with scaling), the backbone's own."""
    d, H = hf.hidden_size, hf.num_attention_heads
    base = dict(vocab_size=hf.vocab_size, d_model=d, n_layers=hf.num_hidden_layers, n_heads=H,
                ffn_dim=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                tie_embeddings=bool(hf.tie_word_embeddings), init_std=hf.initializer_range)
    rp = _rope_parameters(hf, mt)
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise ConfigError([("rope_parameters", f"rope_type {kind!r} is not supported (default, llama3)")])
    if kind == "llama3":
        base["rope_scaling"] = {k: rp.get(k) for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                                       "original_max_position_embeddings")}
    base["rope_base"] = rp["rope_theta"]
    if mt == "gpt_neox":
        if hf.hidden_act != "gelu":
            raise ConfigError([("hidden_act", f"only exact gelu is supported, got {hf.hidden_act!r}")])
        return {**base, "backbone": "neox", "rotary_pct": rp.get("partial_rotary_factor", 0.25),
                "norm_eps": hf.layer_norm_eps, "parallel_residual": hf.use_parallel_residual, "bias": hf.attention_bias}
    problems = []
    if getattr(hf, "head_dim", None) not in (None, d // H):
        problems.append(("head_dim", f"{hf.head_dim} != hidden_size/heads = {d // H}"))
    if hf.hidden_act != "silu":
        problems.append(("hidden_act", f"only silu is supported, got {hf.hidden_act!r}"))
    if mt == "llama" and getattr(hf, "mlp_bias", False) != hf.attention_bias:
        problems.append(("mlp_bias", "attention and MLP biases must agree"))
    base.update(backbone="llama", n_kv_heads=hf.num_key_value_heads, rotary_pct=1.0, norm_eps=hf.rms_norm_eps,
                parallel_residual=False, bias=hf.attention_bias)
    if mt == "qwen3":
        base["qk_norm"] = "head"
    if mt in ("olmo2", "olmo3"):  # post-norm blocks, layer-wise QK-norm, MLPs without biases
        base.update(norm_placement="post", qk_norm="layer")
        if hf.attention_bias:
            problems.append(("attention_bias", "OLMo attention biases without MLP biases: ncpctl's bias covers both"))
    if mt in ("qwen3", "olmo3"):
        problems += _window_fields(hf, base)
    if problems:
        raise ConfigError(problems)
    return base


def _rope_parameters(hf, mt: str) -> dict[str, Any]:
    """The one RoPE of the model: HF's ``rope_parameters``, or for OLMo-3 (one per layer type)
    that of the layer types it uses, which must agree (ncpctl rotates every layer alike)."""
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    if mt != "olmo3":
        return rp
    per = {t: rp.get(t) for t in dict.fromkeys(hf.layer_types)}
    for t, p in per.items():
        kind = (p or {}).get("rope_type")
        if kind not in ("default", "llama3"):
            raise ConfigError([("rope_parameters", f"{t}: rope_type {kind!r} is not supported (default, llama3)")])
    first = next(iter(per.values()))
    if any(p != first for p in per.values()):
        raise ConfigError([("rope_parameters", "sliding and full attention layers use different RoPE "
                                               "(ncpctl has one for all layers)")])
    return dict(first)


def _window_fields(hf, base: dict[str, Any]) -> list[tuple[str, str]]:
    """Qwen3 / OLMo-3 ``layer_types`` -> ``sliding_window`` + ``full_attn_every`` (into ``base``),
    if the pattern is 'every n-th layer full'; else the problem."""
    types = list(hf.layer_types)
    if "sliding_attention" not in types:
        return []
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else len(types) + 1
    base.update(sliding_window=hf.sliding_window, full_attn_every=every)
    want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(len(types))]
    if types != want:
        return [("layer_types", "only 'every n-th layer full' window patterns are supported")]
    return []


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
    elif cfg.backbone == "gpt2":
        out = {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
               "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}
    else:
        out = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    out["lm_head.weight"] = "lm_head.weight"
    return out


# GPT-2 block: ours -> HF name, and whether the tensor is a Conv1D weight ((in, out): transposed)
_GPT2_LAYER = {"attn_norm": ("ln_1", False), "attn.qkv": ("attn.c_attn", True), "attn.proj": ("attn.c_proj", True),
               "mlp_norm": ("ln_2", False), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}


def _gpt2_layer(sd: dict[str, torch.Tensor], src: str, dst: str, to_hf: bool) -> dict[str, torch.Tensor]:
    out = {}
    for ours, (theirs, conv) in _GPT2_LAYER.items():
        for p in ("weight", "bias"):
            a, b = (f"{ours}.{p}", f"{theirs}.{p}") if to_hf else (f"{theirs}.{p}", f"{ours}.{p}")
            t = sd[src + a]
            out[dst + b] = t.t().contiguous() if conv and p == "weight" else t
    return out


# Llama/Qwen3 (pre-norm) and OLMo-2/3 (post-norm: the norms on the attention and MLP outputs)
_LLAMA_NORMS = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
                "post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}}


def _pre_norm_only(cfg: ModelConfig) -> None:
    """HF GPT-NeoX and GPT-2 are pre-norm: their weights do not convert to or from post-norm."""
    if cfg.backbone != "llama" and cfg.norm_placement != "pre":
        raise ConfigError([("norm_placement", f"HF {cfg.backbone} models are pre-norm; {_POST}")])


def _layer_to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], ours: str, hf: str) -> dict[str, torch.Tensor]:
    """One block: our keys under prefix ``ours`` -> HF keys under prefix ``hf``."""
    H, Hkv, hd, ffn = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    g = lambda n: sd[ours + n]  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    params = ["weight"] + (["bias"] if cfg.bias else [])
    if cfg.backbone == "gpt2":
        return _gpt2_layer(sd, ours, hf, to_hf=True)
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
    for ours_norm, hf_norm in _LLAMA_NORMS[cfg.norm_placement].items():
        out[f"{hf}{hf_norm}.weight"] = g(f"{ours_norm}.weight")
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
    if cfg.backbone == "gpt2":
        return _gpt2_layer(sd, hf, ours, to_hf=False)
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
    for ours_norm, hf_norm in _LLAMA_NORMS[cfg.norm_placement].items():
        out[f"{ours}{ours_norm}.weight"] = g(f"{hf_norm}.weight")
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
    """Our prefix of token layer i (encoder then decoder)."""
    E = cfg.encoder_layers
    return f"encoder.{i}." if i < E else f"decoder.{i - E}."


def _base_to_token_layer(cfg: ModelConfig, j: int) -> int:
    """Token-layer index of the base's layer j: PM's extra layers sit at ``cfg.extra_layers``."""
    return j + (cfg.extra_token_layers if cfg.extra_layers and j >= cfg.extra_layers[0] else 0)


_HF_LAYERS = {"neox": "gpt_neox.layers.", "llama": "model.layers.", "gpt2": "transformer.h."}


def _hf_layer(cfg: ModelConfig, i: int) -> str:
    return f"{_HF_LAYERS[cfg.backbone]}{i}."


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """HF state dict of a base model (``model.cfg`` as given by ``hf_config``)."""
    cfg: ModelConfig = model.cfg
    if cfg.concept.enabled:
        raise ConfigError([("concept.enabled", "HF models have no concept path; export a base model")])
    _pre_norm_only(cfg)
    _untied_for_mup(cfg)
    sd = model.state_dict()
    out = {hf: sd[ours] for ours, hf in _names(cfg).items() if ours in sd}
    if cfg.mup_widths is not None:  # decoupled muP: the logit divisor 1/s_token folded into the head
        out["lm_head.weight"] = out["lm_head.weight"] / cfg.mup_widths[0]
    for i in range(cfg.n_token_layers):
        out.update(_layer_to_hf(cfg, sd, _ours_layer(cfg, i), _hf_layer(cfg, i)))
    return out


_MUP_TIED = ("decoupled muP divides the logits by s_token, which a native HF model can only hold folded into an "
             "untied LM head (tie_embeddings: true here)")


def _untied_for_mup(cfg: ModelConfig) -> None:
    """Decoupled muP's logit divisor travels folded into an untied LM head; a tied one cannot hold it."""
    if cfg.mup_base_width is not None and cfg.tie_embeddings:
        raise ConfigError([("mup_base_width", _MUP_TIED)])


def from_hf_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from an HF one: every backbone weight HF has (plus, with
    ``concept.copy_concept_layers_from_base`` / ``copy_extra_layers_from_base``, the concept
    layers / PM's extra token layers from the base's first layers). The base's layer j goes to
    token layer j, or j + extra_token_layers at and above ``extra_token_layers_at``. Keys HF
    lacks (concept path, fresh extra layers) are absent: load with ``strict=False``."""
    _pre_norm_only(cfg)
    sd = dict(sd)
    if "embed_out.weight" in sd:  # original Pythia checkpoints
        sd.setdefault("lm_head.weight", sd.pop("embed_out.weight"))
    prefix = _HF_LAYERS[cfg.backbone]
    n_hf = len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})
    if n_hf not in (cfg.n_layers, cfg.n_token_layers):
        raise ConfigError([("n_layers", f"the HF state dict has {n_hf} layers, the config {cfg.n_layers}")])
    whole = n_hf == cfg.n_token_layers  # already holds every token layer (a PM model exported before)
    out = {ours: sd[hf] for ours, hf in _names(cfg).items() if hf in sd}
    if "lm_head.weight" not in out:  # HF may omit a tied head
        out["lm_head.weight"] = out["embed.weight"]
    if cfg.mup_widths is not None:  # decoupled muP divides by s_token at the head: undo the fold
        _untied_for_mup(cfg)
        out["lm_head.weight"] = out["lm_head.weight"] * cfg.mup_widths[0]
    for name in ("embed.weight", "lm_head.weight"):
        rows = out[name].shape[0]
        if rows > cfg.padded_vocab_size:
            raise ConfigError([("vocab_size", f"HF has {rows} rows, more than {cfg.padded_vocab_size}")])
        out[name] = F.pad(out[name], (0, 0, 0, cfg.padded_vocab_size - rows))
    for j in range(n_hf):
        t = j if whole else _base_to_token_layer(cfg, j)
        out.update(_layer_from_hf(cfg, sd, _hf_layer(cfg, j), _ours_layer(cfg, t)))
    copies = []  # (our prefix, how many base layers to copy into it, the key that asked)
    c = cfg.concept
    if c.enabled and c.copy_concept_layers_from_base:
        copies += [(f"concept.layers.{j}.", j, "concept.concept_layers") for j in range(c.concept_layers)]
    if cfg.copy_extra_layers_from_base and not whole:
        copies += [(_ours_layer(cfg, t), j, "extra_token_layers") for j, t in enumerate(cfg.extra_layers)]
    for ours, j, key in copies:
        if j >= n_hf:
            raise ConfigError([(key, f"more layers to copy than the base's {n_hf}")])
        out.update(_layer_from_hf(cfg, sd, _hf_layer(cfg, j), ours))
    return out


def fresh_keys(cfg: ModelConfig) -> tuple[str, ...]:
    """Prefixes of the weights an HF import leaves at their init: the concept path (unless its
    layers are copied, its heads and codebook still are), the concept bottleneck (Steerling's
    mid-training adds it to a base) and PM's extra layers (unless copied)."""
    fresh = ("concept.", "bottleneck.")
    if not cfg.copy_extra_layers_from_base:
        fresh += tuple(_ours_layer(cfg, t) for t in cfg.extra_layers)
    return fresh


def load_hf_state_dict(model, sd: dict[str, torch.Tensor]) -> list[str]:
    """Load an HF state dict into ``model``; returns the keys left at their init."""
    missing, unexpected = model.load_state_dict(from_hf_state_dict(model.cfg, sd), strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected keys after HF conversion: {unexpected}")
    return list(missing)

"""``backbone: llama``: Llama-style blocks (RMSNorm, SwiGLU at 8/3 d rounded to 256, RoPE on whole
heads, GQA, no biases), which with ``qk_norm`` and ``norm_placement`` are also Qwen3's and
OLMo-2/3's. HF: ``LlamaConfig`` (``rope_type: llama3`` scaling included), or ``Qwen3Config`` with
per-head QK-norm (``qk_norm: head``, which Qwen3 always has), incl. sliding windows on every layer
but each n-th; post-norm (``norm_placement: post``, with the layer-wise QK-norm OLMo always has)
<-> ``Olmo2Config``, or ``Olmo3Config`` with a sliding window (OLMo-3's ``layer_types``; one RoPE
for both layer types). Layer-wise QK-norm with pre-norm has no HF model and is not exported.
``mlp.fc`` is ``[gate; up]`` (HF: two Linears) and ``attn.qkv`` ``[q; k; v]`` (HF: three)."""

from __future__ import annotations

from typing import Any

from ncpctl.model.families.base import Family, hf_common, layer_types, refuse, rope_fields

_READ = {"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
         "vocab_size", "tie_word_embeddings", "hidden_act", "rms_norm_eps", "num_key_value_heads", "head_dim",
         "attention_bias", "mlp_bias", "rope_parameters", "rope_theta", "rope_scaling", "pretraining_tp"}
# transformers 5 keeps OLMo's RoPE in rope_parameters only (no rope_theta / rope_scaling fields)
_OLMO2 = _READ - {"mlp_bias", "pretraining_tp", "rope_theta", "rope_scaling"}

# what each HF model type adds to Llama's blocks: its own recipe keys, whether its MLP bias is a field
# of its own, whether it has per-layer-type sliding windows and (OLMo-3) one RoPE per layer type
_TYPES = {
    "llama": dict(keys={}, mlp_bias=True),
    "qwen3": dict(keys={"qk_norm": "head"}, windows=True),
    "olmo2": dict(keys={"norm_placement": "post", "qk_norm": "layer"}, post=True),
    "olmo3": dict(keys={"norm_placement": "post", "qk_norm": "layer"}, post=True, windows=True, rope_per_type=True),
}

# pre-norm (Llama, Qwen3) and post-norm (OLMo-2/3: the norms on the attention and MLP outputs)
_NORMS = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
          "post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"}}


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


class Llama(Family):
    mlp_matrices = 3  # SwiGLU: gate, up, down
    hf_model_types = ("llama", "qwen3", "olmo2", "olmo3")
    hf_read = {
        "llama": _READ,
        "qwen3": _READ - {"mlp_bias", "pretraining_tp"} | {"layer_types", "sliding_window", "use_sliding_window",
                                                           "max_window_layers"},
        "olmo2": _OLMO2,
        "olmo3": _OLMO2 | {"layer_types", "sliding_window"},
    }
    hf_architectures = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                        "olmo3": "Olmo3ForCausalLM"}
    hf_layers = "model.layers."

    def defaults(self, cfg: Any) -> dict[str, Any]:
        return dict(ffn_dim=_round_up(int(8 * cfg.d_model / 3), 256), rotary_pct=1.0, parallel_residual=False,
                    bias=False)

    def norm(self, cfg: Any, dim: int) -> Any:
        from ncpctl.model.core.layers import RMSNorm

        return RMSNorm(dim, cfg.norm_eps)

    def mlp(self, cfg: Any) -> Any:
        from ncpctl.model.core.layers import MLP

        return MLP(cfg, gated=True)  # SwiGLU

    # ---- HF configs ----
    def hf_config(self, cfg: Any, problems: list) -> Any:
        import transformers

        rope = dict(rope_type="default", rope_theta=cfg.rope_base)
        if cfg.rope_scaling is not None:
            rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_base}
        llama = dict(
            **hf_common(cfg), num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
            rms_norm_eps=cfg.norm_eps, attention_bias=cfg.bias, rope_parameters=rope,
        )
        checks = [("rotary_pct", cfg.rotary_pct != 1.0, "HF Llama/Qwen3/OLMo rotate whole heads"),
                  ("parallel_residual", cfg.parallel_residual, "HF Llama/Qwen3/OLMo blocks are sequential")]
        if cfg.norm_placement == "post":
            return self._olmo_config(cfg, llama, checks, problems)
        if cfg.qk_norm == "head":
            refuse(problems, (*checks, ("bias", cfg.bias, "Qwen3 MLPs have no biases")))
            return transformers.Qwen3Config(
                **llama, use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                layer_types=layer_types(cfg),
            )
        refuse(problems, (
            *checks,
            ("qk_norm", cfg.qk_norm == "layer",
             "layer-wise QK-norm has no pre-norm HF model (OLMo-2/3 have it with norm_placement: post)"),
            ("sliding_window", cfg.sliding_window is not None,
             "HF Llama has no sliding window (use qk_norm: head -> Qwen3)"),
        ))
        return transformers.LlamaConfig(**llama, mlp_bias=cfg.bias)

    def _olmo_config(self, cfg: Any, llama: dict[str, Any], checks: list, problems: list) -> Any:
        """Post-norm llama: ``Olmo2Config`` without a sliding window, else ``Olmo3Config``, whose
        RoPE is given per layer type (the same for both here: ncpctl has one)."""
        import transformers

        refuse(problems, (
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
            sliding_window=cfg.sliding_window, layer_types=layer_types(cfg),
        )

    def from_hf(self, hf: Any) -> dict[str, Any]:
        from ncpctl.model.core.config import ConfigError

        kind = _TYPES[hf.model_type]
        d, H = hf.hidden_size, hf.num_attention_heads
        base = rope_fields(hf, _rope_parameters(hf, kind.get("rope_per_type", False)))
        problems = []
        if getattr(hf, "head_dim", None) not in (None, d // H):
            problems.append(("head_dim", f"{hf.head_dim} != hidden_size/heads = {d // H}"))
        if hf.hidden_act != "silu":
            problems.append(("hidden_act", f"only silu is supported, got {hf.hidden_act!r}"))
        if kind.get("mlp_bias") and getattr(hf, "mlp_bias", False) != hf.attention_bias:
            problems.append(("mlp_bias", "attention and MLP biases must agree"))
        base.update(backbone="llama", n_kv_heads=hf.num_key_value_heads, rotary_pct=1.0, norm_eps=hf.rms_norm_eps,
                    parallel_residual=False, bias=hf.attention_bias, **kind["keys"])
        if kind.get("post") and hf.attention_bias:  # OLMo: post-norm blocks, layer-wise QK-norm, MLPs without biases
            problems.append(("attention_bias", "OLMo attention biases without MLP biases: ncpctl's bias covers both"))
        if kind.get("windows"):
            problems += _window_fields(hf, base)
        if problems:
            raise ConfigError(problems)
        return base

    # ---- HF weights ----
    def hf_names(self, cfg: Any) -> dict[str, str]:
        return {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}

    def check_weights(self, cfg: Any) -> None:
        return None  # pre-norm: Llama, Qwen3; post-norm: OLMo-2/3

    def layer_to_hf(self, cfg: Any, sd: dict, ours: str, hf: str) -> dict:
        H, Hkv, hd, ffn = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
        g = lambda n: sd[ours + n]  # noqa: E731
        out = {}
        for ours_norm, hf_norm in _NORMS[cfg.norm_placement].items():
            out[f"{hf}{hf_norm}.weight"] = g(f"{ours_norm}.weight")
        if cfg.qk_norm != "none":
            out[f"{hf}self_attn.q_norm.weight"] = g("attn.q_norm.weight")
            out[f"{hf}self_attn.k_norm.weight"] = g("attn.k_norm.weight")
        for p in ["weight"] + (["bias"] if cfg.bias else []):
            q, k, v = g(f"attn.qkv.{p}").split([H * hd, Hkv * hd, Hkv * hd])
            out[f"{hf}self_attn.q_proj.{p}"], out[f"{hf}self_attn.k_proj.{p}"] = q, k
            out[f"{hf}self_attn.v_proj.{p}"] = v
            out[f"{hf}self_attn.o_proj.{p}"] = g(f"attn.proj.{p}")
            out[f"{hf}mlp.gate_proj.{p}"], out[f"{hf}mlp.up_proj.{p}"] = g(f"mlp.fc.{p}").split([ffn, ffn])
            out[f"{hf}mlp.down_proj.{p}"] = g(f"mlp.proj.{p}")
        return out

    def layer_from_hf(self, cfg: Any, sd: dict, hf: str, ours: str) -> dict:
        import torch

        g = lambda n: sd[hf + n]  # noqa: E731
        out = {}
        for ours_norm, hf_norm in _NORMS[cfg.norm_placement].items():
            out[f"{ours}{ours_norm}.weight"] = g(f"{hf_norm}.weight")
        if cfg.qk_norm != "none":
            out[f"{ours}attn.q_norm.weight"] = g("self_attn.q_norm.weight")
            out[f"{ours}attn.k_norm.weight"] = g("self_attn.k_norm.weight")
        for p in ["weight"] + (["bias"] if cfg.bias else []):
            out[f"{ours}attn.qkv.{p}"] = torch.cat([g(f"self_attn.{n}_proj.{p}") for n in "qkv"])
            out[f"{ours}attn.proj.{p}"] = g(f"self_attn.o_proj.{p}")
            out[f"{ours}mlp.fc.{p}"] = torch.cat([g(f"mlp.gate_proj.{p}"), g(f"mlp.up_proj.{p}")])
            out[f"{ours}mlp.proj.{p}"] = g(f"mlp.down_proj.{p}")
        return out


def _rope_parameters(hf: Any, per_type: bool) -> dict[str, Any]:
    """The one RoPE of the model: HF's ``rope_parameters``, or for OLMo-3 (one per layer type)
    that of the layer types it uses, which must agree (ncpctl rotates every layer alike)."""
    from ncpctl.model.core.config import ConfigError

    rp = dict(getattr(hf, "rope_parameters", None) or {})
    if not per_type:
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


def _window_fields(hf: Any, base: dict[str, Any]) -> list[tuple[str, str]]:
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

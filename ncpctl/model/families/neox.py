"""``backbone: neox``: GPT-NeoX (Pythia). LayerNorm, parallel attention + MLP residual, rotary on
a quarter of each head, exact GELU MLP at 4 d, biases; HF ``GPTNeoXForCausalLM``, whose fused
query_key_value interleaves q, k, v per head (ours stacks [q; k; v])."""

from __future__ import annotations

from typing import Any

from ncpctl.model.families.base import POST, Family, hf_common, refuse, rope_fields


def _qkv_to_hf(w, H: int, hd: int):
    """Ours [q; k; v] rows -> HF GPT-NeoX per-head interleaved (H, 3, hd) rows."""
    return w.reshape(3, H, hd, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _qkv_from_hf(w, H: int, hd: int):
    return w.reshape(H, 3, hd, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


class NeoX(Family):
    hf_model_types = ("gpt_neox",)
    hf_read = {"gpt_neox": {
        "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
        "vocab_size", "tie_word_embeddings", "hidden_act", "layer_norm_eps", "use_parallel_residual",
        "attention_bias", "rope_parameters", "rope_theta", "rotary_pct", "rotary_emb_base", "partial_rotary_factor",
        "rope_scaling"}}
    hf_architectures = {"gpt_neox": "GPTNeoXForCausalLM"}
    hf_layers = "gpt_neox.layers."

    def defaults(self, cfg: Any) -> dict[str, Any]:
        return dict(ffn_dim=4 * cfg.d_model, rotary_pct=0.25, parallel_residual=True, bias=True)

    def hf_config(self, cfg: Any, problems: list) -> Any:
        import transformers

        refuse(problems, (
            ("norm_placement", cfg.norm_placement != "pre", f"GPT-NeoX blocks are pre-norm; {POST}"),
            ("n_kv_heads", cfg.n_kv_heads != cfg.n_heads, "GPT-NeoX has no GQA"),
            ("qk_norm", cfg.qk_norm != "none", "GPT-NeoX has no QK-norm"),
            ("sliding_window", cfg.sliding_window is not None, "GPT-NeoX has no sliding window"),
            ("bias", not cfg.bias, "GPT-NeoX MLPs always have biases"),
            ("rope_scaling", cfg.rope_scaling is not None, "the GPT-NeoX export writes no RoPE scaling"),
        ))
        return transformers.GPTNeoXConfig(
            **hf_common(cfg), hidden_act="gelu", layer_norm_eps=cfg.norm_eps,
            use_parallel_residual=cfg.parallel_residual, attention_bias=cfg.bias,
            rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base, partial_rotary_factor=cfg.rotary_pct),
        )

    def from_hf(self, hf: Any) -> dict[str, Any]:
        from ncpctl.model.core.config import ConfigError

        rp = dict(getattr(hf, "rope_parameters", None) or {})
        base = rope_fields(hf, rp)
        if hf.hidden_act != "gelu":
            raise ConfigError([("hidden_act", f"only exact gelu is supported, got {hf.hidden_act!r}")])
        return {**base, "backbone": "neox", "rotary_pct": rp.get("partial_rotary_factor", 0.25),
                "norm_eps": hf.layer_norm_eps, "parallel_residual": hf.use_parallel_residual, "bias": hf.attention_bias}

    def hf_names(self, cfg: Any) -> dict[str, str]:
        return {"embed.weight": "gpt_neox.embed_in.weight", "final_norm.weight": "gpt_neox.final_layer_norm.weight",
                "final_norm.bias": "gpt_neox.final_layer_norm.bias"}

    def check_weights(self, cfg: Any) -> None:
        if cfg.norm_placement != "pre":  # HF GPT-NeoX is pre-norm
            from ncpctl.model.core.config import ConfigError

            raise ConfigError([("norm_placement", f"HF {cfg.backbone} models are pre-norm; {POST}")])

    def layer_to_hf(self, cfg: Any, sd: dict, ours: str, hf: str) -> dict:
        return self._layer(cfg, sd, ours, hf, to_hf=True)

    def layer_from_hf(self, cfg: Any, sd: dict, hf: str, ours: str) -> dict:
        return self._layer(cfg, sd, hf, ours, to_hf=False)

    def _layer(self, cfg: Any, sd: dict, src: str, dst: str, to_hf: bool) -> dict:
        H, hd = cfg.n_heads, cfg.head_dim
        names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
        mats = {"attn.qkv": "attention.query_key_value", "attn.proj": "attention.dense", "mlp.fc": "mlp.dense_h_to_4h",
                "mlp.proj": "mlp.dense_4h_to_h"}
        out = {}
        for p, table in [(p, names) for p in ("weight", "bias")] + \
                        [(p, mats) for p in ["weight"] + (["bias"] if cfg.bias else [])]:
            for a, b in table.items():
                a, b = (f"{a}.{p}", f"{b}.{p}") if to_hf else (f"{b}.{p}", f"{a}.{p}")
                t = sd[src + a]
                if "qkv" in a or "query_key_value" in a:
                    t = (_qkv_to_hf if to_hf else _qkv_from_hf)(t, H, hd)
                out[dst + b] = t
        return out

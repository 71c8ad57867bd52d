"""``backbone: gpt2``: GPT-2 (HF ``GPT2LMHeadModel``). LayerNorm, learned absolute positions (no
rotary), tanh-approximate GELU (HF ``gelu_new``) at 4 d, biases everywhere, sequential blocks.
HF's Conv1D weights are stored (in, out): transposed on the way in and out."""

from __future__ import annotations

from typing import Any

from ncpctl.model.families.base import POST, Family, refuse

# GPT-2 block: ours -> HF name, and whether the tensor is a Conv1D weight ((in, out): transposed)
_LAYER = {"attn_norm": ("ln_1", False), "attn.qkv": ("attn.c_attn", True), "attn.proj": ("attn.c_proj", True),
          "mlp_norm": ("ln_2", False), "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}


class GPT2(Family):
    learned_positions = True
    hf_model_types = ("gpt2",)
    hf_read = {"gpt2": {
        "n_embd", "n_head", "n_layer", "n_inner", "n_positions", "vocab_size", "tie_word_embeddings",
        "activation_function", "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn", "add_cross_attention"}}
    hf_architectures = {"gpt2": "GPT2LMHeadModel"}
    hf_layers = "transformer.h."

    def defaults(self, cfg: Any) -> dict[str, Any]:
        return dict(ffn_dim=4 * cfg.d_model, rotary_pct=0.0, parallel_residual=False, bias=True)

    def mlp(self, cfg: Any) -> Any:
        from ncpctl.model.core.layers import MLP

        return MLP(cfg, approximate="tanh")  # HF "gelu_new"

    def hf_config(self, cfg: Any, problems: list) -> Any:
        import transformers

        refuse(problems, (
            ("norm_placement", cfg.norm_placement != "pre", f"GPT-2 blocks are pre-norm; {POST}"),
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

    def from_hf(self, hf: Any) -> dict[str, Any]:
        from ncpctl.model.core.config import ConfigError

        problems = [(k, f"must be {want!r}, got {getattr(hf, k)!r}") for k, want in (
            ("activation_function", "gelu_new"), ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)) if getattr(hf, k) != want]
        if problems:
            raise ConfigError(problems)
        return dict(backbone="gpt2", vocab_size=hf.vocab_size, d_model=hf.n_embd, n_layers=hf.n_layer,
                    n_heads=hf.n_head, ffn_dim=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions,
                    norm_eps=hf.layer_norm_epsilon, tie_embeddings=bool(hf.tie_word_embeddings),
                    init_std=hf.initializer_range)

    def hf_names(self, cfg: Any) -> dict[str, str]:
        return {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
                "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias"}

    def check_weights(self, cfg: Any) -> None:
        if cfg.norm_placement != "pre":  # HF GPT-2 is pre-norm
            from ncpctl.model.core.config import ConfigError

            raise ConfigError([("norm_placement", f"HF {cfg.backbone} models are pre-norm; {POST}")])

    def layer_to_hf(self, cfg: Any, sd: dict, ours: str, hf: str) -> dict:
        return _layer(sd, ours, hf, to_hf=True)

    def layer_from_hf(self, cfg: Any, sd: dict, hf: str, ours: str) -> dict:
        return _layer(sd, hf, ours, to_hf=False)


def _layer(sd: dict, src: str, dst: str, to_hf: bool) -> dict:
    out = {}
    for ours, (theirs, conv) in _LAYER.items():
        for p in ("weight", "bias"):
            a, b = (f"{ours}.{p}", f"{theirs}.{p}") if to_hf else (f"{theirs}.{p}", f"{ours}.{p}")
            t = sd[src + a]
            out[dst + b] = t.t().contiguous() if conv and p == "weight" else t
    return out

"""Parity with HF transformers (GPT-NeoX, Llama, Qwen3, OLMo-2/3, OLMoE, GPT-2) and weight/config
conversion."""

from __future__ import annotations

import pytest
import torch
import transformers

from ncpctl.model.core.config import ConfigError, build_config
from ncpctl.model.families.hf import (
    config_from_hf,
    from_hf_state_dict,
    hf_config,
    load_hf_state_dict,
    to_hf_state_dict,
)
from ncpctl.model.core.layers import attn_mask
from ncpctl.model.core.model import NCPModel

from ._helpers import build, hf_model, tiny, tokens

TOL = 1e-5

CASES = {
    # Pythia layout: partial rotary, parallel residual, biases; padded vocab 200 -> 256
    "neox": (tiny("neox"), transformers.GPTNeoXForCausalLM),
    "neox-sequential-tied": (tiny("neox", parallel_residual=False, tie_embeddings=True, rotary_pct=0.5),
                             transformers.GPTNeoXForCausalLM),
    "llama-gqa": (tiny("llama"), transformers.LlamaForCausalLM),
    "llama-bias": (tiny("llama", n_kv_heads=4, bias=True), transformers.LlamaForCausalLM),
    # per-head QK-norm + GQA + sliding window (window 5, every 2nd layer full) -> Qwen3
    "llama-headnorm-swa": (tiny("llama", qk_norm="head", sliding_window=5, full_attn_every=2, n_layers=4),
                           transformers.Qwen3ForCausalLM),
    # Llama-3.1 RoPE scaling; original context 16 < T = 20: every frequency band is exercised
    "llama3-rope-scaling": (tiny("llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0, original_max_position_embeddings=16)),
                            transformers.LlamaForCausalLM),
    # post-norm (norm on the attention/MLP outputs) + layer-wise QK-norm + GQA -> OLMo-2
    "olmo2-post": (tiny("llama", norm_placement="post", qk_norm="layer"), transformers.Olmo2ForCausalLM),
    # ... with Llama-3.1 RoPE scaling and tied embeddings
    "olmo2-post-rope-scaling-tied": (tiny("llama", norm_placement="post", qk_norm="layer", tie_embeddings=True,
                                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0, original_max_position_embeddings=16)),
                                     transformers.Olmo2ForCausalLM),
    # ... with a sliding window (window 5, every 3rd layer full; the ArchPreview pattern) -> OLMo-3
    "olmo3-post-swa": (tiny("llama", norm_placement="post", qk_norm="layer", sliding_window=5, full_attn_every=3,
                            n_layers=4, n_kv_heads=4), transformers.Olmo3ForCausalLM),
    # GPT-2: learned absolute positions, tanh GELU, Conv1D layout, tied embeddings
    "gpt2": (tiny("gpt2", tie_embeddings=True), transformers.GPT2LMHeadModel),
}


def _check_parity(model, hf, cfg, T=20):
    x = tokens(cfg, 2, T)
    ours = model(x).logits
    ref = hf(input_ids=x).logits
    assert ours.shape == ref.shape == (2, T, cfg.padded_vocab_size)
    assert (ours - ref).abs().max().item() <= TOL
    return ours


@pytest.mark.parametrize("case", list(CASES))
def test_parity_ours_to_hf(case):
    cfg, cls = CASES[case]
    model = build(cfg)
    hf_cfg = hf_config(cfg)
    assert hf_cfg.vocab_size == cfg.padded_vocab_size
    hf = hf_model(cls, hf_cfg)
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    _check_parity(model, hf, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_hf_to_ours(case):
    cfg, cls = CASES[case]
    torch.manual_seed(3)
    hf = hf_model(cls, hf_config(cfg))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    back = config_from_hf(hf.config)
    for f in ("backbone", "padded_vocab_size", "d_model", "n_token_layers", "n_heads", "n_kv_heads", "ffn_dim",
              "rotary_dim", "rope_base", "norm_eps", "parallel_residual", "bias", "tie_embeddings", "qk_norm",
              "norm_placement", "sliding_window", "full_attn_every", "rope_scaling", "max_seq_len"):
        assert getattr(back, f) == getattr(cfg, f), f
    windows = lambda c: [b.attn.window for b in NCPModel(c).token_layers()]  # noqa: E731
    assert windows(back) == windows(cfg)
    model = NCPModel(back).eval()
    assert load_hf_state_dict(model, hf.state_dict()) == []
    _check_parity(model, hf, cfg)


def test_roundtrip_state_dict():
    for cfg, _ in CASES.values():
        model = build(cfg)
        sd = from_hf_state_dict(cfg, to_hf_state_dict(model))
        ref = model.state_dict()
        assert set(sd) == set(ref)
        for k in ref:
            assert torch.equal(sd[k], ref[k]), k


def test_llama_layer_qk_norm_matches_olmoe():
    """OLMo-2-style (whole-projection) QK RMSNorm: OLMoE is the pre-norm HF model with it;
    with one expert and top-1 routing (weight exactly 1) its MoE is a SwiGLU MLP."""
    cfg = tiny("llama", qk_norm="layer")
    model = build(cfg)
    hf_cfg = transformers.OlmoeConfig(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.norm_eps, rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_base),
        num_experts=1, num_experts_per_tok=1, norm_topk_prob=False, max_position_embeddings=cfg.max_seq_len,
    )
    hf = hf_model(transformers.OlmoeForCausalLM, hf_cfg)
    sd = to_hf_state_dict(model)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}.mlp."
        gate, up, down = sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight"), sd.pop(p + "down_proj.weight")
        sd[p + "experts.gate_up_proj"] = torch.cat([gate, up])[None]
        sd[p + "experts.down_proj"] = down[None]
        sd[p + "gate.weight"] = torch.zeros(1, cfg.d_model)
    hf.load_state_dict(sd, strict=True)
    _check_parity(model, hf, cfg)
    with pytest.raises(ConfigError, match="qk_norm"):
        hf_config(cfg)


def test_sliding_window_mask_matches_reference():
    T, W = 12, 4
    pos = torch.arange(T)[None]
    ref = torch.tensor([[j <= i and i - j < W for j in range(T)] for i in range(T)])
    assert torch.equal(attn_mask(pos, pos, W)[0, 0], ref)
    assert torch.equal(attn_mask(pos, pos, None)[0, 0], torch.ones(T, T, dtype=torch.bool).tril())
    # the archpreview pattern: window on layers 1-3 of every 4, full on 4, 8, ...
    cfg = build_config("ncp-archpreview-8.9b")
    assert [cfg.token_windows[n - 1] for n in range(1, 9)] == [4096, 4096, 4096, None] * 2


def test_import_pads_a_smaller_hf_vocab():
    hf_cfg = hf_config(tiny("neox", vocab_size=256, pad_vocab_multiple=64))
    hf_cfg.vocab_size = 200  # an unpadded HF checkpoint
    torch.manual_seed(0)
    hf = hf_model(transformers.GPTNeoXForCausalLM, hf_cfg)
    cfg = config_from_hf(hf.config, pad_vocab_multiple=64)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (200, 256)
    model = NCPModel(cfg).eval()
    load_hf_state_dict(model, hf.state_dict())
    x = tokens(cfg, 1, 10)
    assert (model(x).logits[..., :200] - hf(input_ids=x).logits).abs().max() <= TOL
    assert torch.all(model.embed.weight[200:] == 0)


def test_import_into_concept_model():
    base = tiny("neox")
    hf = hf_model(transformers.GPTNeoXForCausalLM, hf_config(base))
    cfg = tiny("neox", concept=dict(copy_concept_layers_from_base=True), extra_token_layers=1)
    model = NCPModel(cfg)
    missing = load_hf_state_dict(model, hf.state_dict())
    # only the concept path (not its layers) and PM's extra token layer keep their init
    assert missing and all(k.startswith(("concept.", "decoder.2.")) and not k.startswith("concept.layers.")
                           for k in missing)
    assert any(k.startswith("decoder.2.") for k in missing)
    ours = from_hf_state_dict(cfg, hf.state_dict())
    assert torch.equal(ours["concept.layers.1.attn.proj.weight"], ours["decoder.0.attn.proj.weight"])  # layer 1
    assert torch.equal(model.encoder[0].mlp.fc.weight, hf.gpt_neox.layers[0].mlp.dense_h_to_4h.weight)


def test_hf_config_rejects_what_hf_cannot_hold():
    with pytest.raises(ConfigError, match="concept"):
        hf_config(tiny("neox", concept={}))
    with pytest.raises(ConfigError, match="sliding_window"):
        hf_config(tiny("llama", sliding_window=4))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        hf_config(tiny("neox", n_kv_heads=2))
    with pytest.raises(ConfigError, match="concept"):
        to_hf_state_dict(NCPModel(tiny("neox", concept={})))


def _olmo3(**kw):
    return transformers.Olmo3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, sliding_window=5, **kw)


def test_olmo3_import_reads_one_rope_and_periodic_windows():
    """OLMo-3 gives RoPE per layer type and a window per layer: ncpctl has one RoPE and 'every
    n-th layer full'; anything else is refused, naming the field (a RoPE type by its name)."""
    default = dict(rope_type="default", rope_theta=1e4)
    cfg = config_from_hf(_olmo3(layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                rope_parameters=dict(sliding_attention=default, full_attention=default)))
    assert (cfg.norm_placement, cfg.qk_norm, cfg.sliding_window, cfg.full_attn_every) == ("post", "layer", 5, 4)
    assert cfg.rope_base == 1e4 and cfg.rope_scaling is None
    assert config_from_hf(_olmo3(layer_types=["full_attention"] * 4)).sliding_window is None
    with pytest.raises(ConfigError, match="layer_types: only 'every n-th layer full'"):
        config_from_hf(_olmo3(layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                           "full_attention"]))
    # OLMo-3's long-context configs scale the full-attention layers' RoPE with YaRN
    yarn = _olmo3(rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192))
    with pytest.raises(ConfigError, match="full_attention: rope_type 'yarn' is not supported"):
        config_from_hf(yarn)
    with pytest.raises(ConfigError, match="sliding and full attention layers use different RoPE"):
        config_from_hf(_olmo3(rope_parameters=dict(sliding_attention=default,
                                                   full_attention=dict(default, rope_theta=5e5))))
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_hf(_olmo3(attention_bias=True))


def test_olmo_import_refuses_fields_outside_its_allow_list():
    hf_cfg = hf_config(tiny("llama", norm_placement="post", qk_norm="layer"))
    assert hf_cfg.model_type == "olmo2"
    hf_cfg.sliding_window = 4  # an OLMo-3 field: HF's OLMo-2 ignores it, an import must not guess
    with pytest.raises(ConfigError, match="olmo2: field.*sliding_window"):
        config_from_hf(hf_cfg)


def test_post_norm_export_needs_what_olmo_has():
    post = dict(backbone="llama", norm_placement="post")
    with pytest.raises(ConfigError, match="qk_norm: the post-norm HF models"):
        hf_config(tiny(**post))  # qk_norm: none
    with pytest.raises(ConfigError, match="qk_norm: the post-norm HF models"):
        hf_config(tiny(**post, qk_norm="head"))
    with pytest.raises(ConfigError, match="bias: OLMo-2/3 MLPs have no biases"):
        hf_config(tiny(**post, qk_norm="layer", bias=True))
    for backbone in ("neox", "gpt2"):  # the block runs post-norm for them too; no HF model does
        cfg = tiny(backbone, norm_placement="post")
        with pytest.raises(ConfigError, match="norm_placement: .* pre-norm; post-norm blocks export as OLMo"):
            hf_config(cfg)
        with pytest.raises(ConfigError, match="norm_placement"):
            to_hf_state_dict(NCPModel(cfg))
    with pytest.raises(ConfigError, match="norm_placement: must be pre or post"):
        tiny("llama", norm_placement="sandwich")

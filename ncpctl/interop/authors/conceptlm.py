"""The ConceptLM authors' own models (LUMIA-Group/ConceptLM, issue 43): a directory in their
layout (``config.json`` + safetensors, single or sharded, as their ``save_pretrained`` writes it)
opens as an ``NCPModel`` that computes what their ``ConceptLM_Pythia`` / ``ConceptLM_GPT`` /
``ConceptLM_Llama_ForCausalLM`` compute, and an ncpctl model of that form exports back to it.

A directory is theirs when its ``config.json`` (read as JSON: no code from it ever runs) has a
``model_type`` of gpt_neox, gpt2 or llama and their ``chunk_size`` and ``training_type`` fields:
their configs keep the backbone's ``model_type``. Their code runs under one combination of
switches only (other combinations leave variables undefined in their forward: tools/reference/
conceptlm.py); any other value, and any field this module does not read, is refused by name.

What their code computes, read from it and checked against fixtures made by it
(tests/fixtures/authors/conceptlm, tests/interop/test_authors_conceptlm.py), in ncpctl's keys:

* concepts: the mean of each complete chunk of k = ``chunk_size`` encoder outputs, through
  ``special_layers`` concept layers at RoPE positions j * k (``rope_scale_by_k``; GPT-2's have no
  positions), then H / ``vq_patch_ratio`` heads ``ctx_lm_head[i]`` (with biases; the heads from
  H / r up are saved but unused), after a norm for Pythia only (``head_norm``); the raw scores
  weight ``vqs[i].codebook`` = ``code_transform(frozen_codebook)``, one SimVQ per segment
  (``code_weights: linear``, ``codebook_per_segment``; an MLP, or for GPT-2 SimVQ's bias-free Linear);
* token t receives the prediction of slot (t+1) // k (slot 0 = zeros): ``segmentation: fixed``;
  Pythia and Llama add it raw, GPT-2 as ``ln_f(h) + ln_f(slot)`` with its final norm
  (``add: final_norm``); Llama detaches it (``detach_added_concept``);
* Pythia's ``embed_out`` and GPT-2's ``lm_head`` are never tied (their ``tie_weights`` is a
  no-op); Llama's follows ``tie_word_embeddings``; Llama's ``cached_*`` buffers (written during a
  forward) are not weights: ignored on import, never exported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError

LAYOUT = "conceptlm"
TRANSFORMERS = "4.51.0"  # the version their code pins (README: transformers==4.51)

# their switches, with the one value their forward runs with (the GPT-2 and Llama entries: their own)
_SWITCHES = dict(hlm_type="vq_gpt2_ce", chunk_merge_method="meanpooling", distribution_merge=True,
                 shift_feature=True, add_GT_ratio=0)
_TRAINING_TYPE = "Context_addvqfeature"  # Pythia tests 'addvqfeature' in it, Llama 'Context'; neither 'baseline'
_CONCEPT = ("chunk_size", "encoder_layers", "decoder_layers", "special_layers", "training_type", "vq_config",
            "dist_topk", "vq_patch_ratio", *_SWITCHES)
# fields that do not change what their model computes
_INERT = {"architectures", "model_type", "torch_dtype", "transformers_version", "use_cache", "bos_token_id",
          "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "hidden_dropout",
          "classifier_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation",
          "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj", "_name_or_path",
          "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation_autoset"}


class Backbone:
    """One of their three classes: its config fields and weight names."""

    name = ""
    model_type = ""
    architecture = ""
    base = ""  # their prefix of everything but the LM head ("model." for Llama)
    stack = ""  # their concept layers
    heads = ""
    head_norm: str | None = None
    reads: frozenset = frozenset()
    own_switches: dict = {}
    concept: dict = {}  # the ncpctl concept keys their code implies

    def fields(self, j: dict) -> dict:
        """Their config -> ncpctl ModelConfig fields of the backbone."""
        raise NotImplementedError

    def config(self, cfg) -> dict:
        """ncpctl config -> their config fields of the backbone."""
        raise NotImplementedError

    def top(self, cfg) -> dict[str, str]:
        """Top-level weights, ours -> theirs."""
        raise NotImplementedError

    def problems(self, j: dict) -> list[tuple[str, str]]:
        return []


class Pythia(Backbone):
    name, model_type, architecture = "pythia", "gpt_neox", "ConceptLM_Pythia"
    stack, heads, head_norm = "hlm.transformer.", "hlm.ctx_lm_head.", "hlm.layer_norm."
    reads = frozenset({"vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                       "max_position_embeddings", "rotary_pct", "partial_rotary_factor", "rotary_emb_base",
                       "rope_theta", "layer_norm_eps", "use_parallel_residual", "hidden_act", "attention_bias",
                       "tie_word_embeddings", "rope_scaling", "layer_norm_option"})
    own_switches = {"layer_norm_option": "rawadd"}
    concept = dict(head_norm=True, add="raw", codebook_transform="mlp")

    def fields(self, j: dict) -> dict:
        return dict(backbone="neox", d_model=j["hidden_size"], n_heads=j["num_attention_heads"],
                    ffn_dim=j["intermediate_size"], max_seq_len=j["max_position_embeddings"],
                    rotary_pct=j.get("rotary_pct", j.get("partial_rotary_factor", 0.25)),
                    rope_base=float(j.get("rotary_emb_base", j.get("rope_theta", 10000))),
                    norm_eps=j.get("layer_norm_eps", 1e-5), parallel_residual=j.get("use_parallel_residual", True),
                    bias=j.get("attention_bias", True), tie_embeddings=False)

    def config(self, cfg) -> dict:
        return dict(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim,
                    num_hidden_layers=cfg.n_token_layers, max_position_embeddings=cfg.max_seq_len,
                    rotary_pct=cfg.rotary_pct,
                    partial_rotary_factor=cfg.rotary_pct, rotary_emb_base=cfg.rope_base, rope_theta=cfg.rope_base,
                    layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual, hidden_act="gelu",
                    attention_bias=cfg.bias, tie_word_embeddings=False, rope_scaling=None)

    def top(self, cfg) -> dict[str, str]:
        return {"embed.weight": "embed_in.weight", "lm_head.weight": "embed_out.weight",
                "final_norm.weight": "final_layer_norm.weight", "final_norm.bias": "final_layer_norm.bias"}

    def problems(self, j: dict) -> list[tuple[str, str]]:
        out = [] if j.get("hidden_act", "gelu") == "gelu" else [("hidden_act", "their Pythia is built with gelu")]
        if j.get("rope_scaling") is not None:
            out.append(("rope_scaling", "their Pythia code reads none"))
        if j.get("num_hidden_layers", 0) < max(j.get("encoder_layers", 0), j.get("decoder_layers", 0)):
            # their forward zips each stack with num_hidden_layers cache slots: fewer would drop layers
            out.append(("num_hidden_layers", "must be at least encoder_layers and decoder_layers"))
        return out


class GPT2(Backbone):
    name, model_type, architecture = "gpt2", "gpt2", "ConceptLM_GPT"
    stack, heads = "hlm.transformer.", "hlm.ctx_lm_head."
    reads = frozenset({"vocab_size", "n_embd", "n_head", "n_layer", "n_inner", "n_positions", "activation_function",
                       "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                       "reorder_and_upcast_attn", "tie_word_embeddings", "detach_or_not", "loss_type",
                       "add_cross_attention"})
    own_switches = {"loss_type": "hlm_MSE_loss"}
    concept = dict(head_norm=False, add="final_norm", codebook_transform="linear")

    def fields(self, j: dict) -> dict:
        d = j["n_embd"]
        return dict(backbone="gpt2", d_model=d, n_heads=j["n_head"], ffn_dim=j.get("n_inner") or 4 * d,
                    max_seq_len=j["n_positions"], norm_eps=j.get("layer_norm_epsilon", 1e-5), tie_embeddings=False)

    def config(self, cfg) -> dict:
        return dict(n_embd=cfg.d_model, n_head=cfg.n_heads, n_layer=cfg.n_token_layers, n_inner=cfg.ffn_dim,
                    n_positions=cfg.max_seq_len, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                    scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                    attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, detach_or_not="detach")

    def top(self, cfg) -> dict[str, str]:
        return {"embed.weight": "wte.weight", "pos_embed.weight": "wpe.weight", "lm_head.weight": "lm_head.weight",
                "final_norm.weight": "ln_f.weight", "final_norm.bias": "ln_f.bias"}

    def problems(self, j: dict) -> list[tuple[str, str]]:
        want = {"activation_function": "gelu_new", "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, "add_cross_attention": False, "vq_patch_ratio": 1}
        out = [(k, f"must be {v!r}, got {j[k]!r}") for k, v in want.items() if k in j and j[k] != v]
        if "default" in str(j.get("detach_or_not", "")):
            out.append(("detach_or_not", "their GPT-2 forward skips the concept prediction when it holds 'default'"))
        return out


class Llama(Backbone):
    name, model_type, architecture = "llama", "llama", "ConceptLM_Llama_ForCausalLM"
    base, stack, heads = "model.", "model.hlm_layers.", "model.ctx_lm_head."
    reads = frozenset({"vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                       "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
                       "head_dim", "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings", "pretraining_tp"})
    concept = dict(head_norm=False, add="raw", codebook_transform="mlp", detach_added_concept=True)

    def fields(self, j: dict) -> dict:
        out = dict(backbone="llama", d_model=j["hidden_size"], n_heads=j["num_attention_heads"],
                   n_kv_heads=j.get("num_key_value_heads") or j["num_attention_heads"], ffn_dim=j["intermediate_size"],
                   max_seq_len=j["max_position_embeddings"], norm_eps=j.get("rms_norm_eps", 1e-6),
                   rope_base=float(j.get("rope_theta", 10000.0)), bias=bool(j.get("attention_bias", False)),
                   tie_embeddings=bool(j.get("tie_word_embeddings", False)))
        if j.get("rope_scaling") is not None:
            out["rope_scaling"] = dict(j["rope_scaling"])
        return out

    def config(self, cfg) -> dict:
        return dict(hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                    num_hidden_layers=cfg.n_token_layers, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                    rope_theta=cfg.rope_base, rope_scaling=cfg.rope_scaling, head_dim=cfg.head_dim,
                    attention_bias=cfg.bias, mlp_bias=cfg.bias, hidden_act="silu",
                    tie_word_embeddings=cfg.tie_embeddings, pretraining_tp=1)

    def top(self, cfg) -> dict[str, str]:
        return {"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
                "final_norm.weight": "model.norm.weight"}

    def problems(self, j: dict) -> list[tuple[str, str]]:
        out = []
        if j.get("hidden_act", "silu") != "silu":
            out.append(("hidden_act", "ncpctl's Llama blocks use silu"))
        if bool(j.get("mlp_bias", False)) != bool(j.get("attention_bias", False)):
            out.append(("mlp_bias", "attention and MLP biases must agree"))
        if j.get("head_dim") not in (None, j["hidden_size"] // j["num_attention_heads"]):
            out.append(("head_dim", "must be hidden_size / num_attention_heads"))
        if j.get("pretraining_tp", 1) != 1:
            out.append(("pretraining_tp", "must be 1"))
        if j.get("encoder_layers") != 1:  # their single-pass forward tests len(cache) == 1 after the encoder
            out.append(("encoder_layers", "their Llama forward runs with 1 encoder layer only"))
        return out


BACKBONES = {b.model_type: b for b in (Pythia(), GPT2(), Llama())}


# ---- recognising and reading a directory (no torch) ----------------------------------------

def read_config(directory: str | Path) -> dict | None:
    """Their config.json as a dict when ``directory`` is a ConceptLM directory; None otherwise."""
    f = Path(directory) / "config.json"
    if not f.is_file() or (Path(directory) / "ncpctl.json").is_file():
        return None
    try:
        j = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(j, dict) and j.get("model_type") in BACKBONES and "chunk_size" in j and "training_type" in j:
        return j
    return None


def detect(directory: str | Path) -> bool:
    """``directory`` holds a model in the ConceptLM authors' layout."""
    return read_config(directory) is not None


def _problems(j: dict, bb: Backbone) -> list[tuple[str, str]]:
    out = [(k, f"their code runs with {v!r} only, got {j.get(k)!r}") for k, v in {**_SWITCHES, **bb.own_switches}.items()
           if j.get(k) != v]
    tt = str(j.get("training_type"))
    if "baseline" in tt or "vqaddfeature" in tt or ("addvqfeature" not in tt and "Context" not in tt):
        out.append(("training_type", f"must hold their concept path ('addvqfeature' / 'Context', no 'baseline'), "
                                     f"got {tt!r}"))
    codes = (j.get("vq_config") or {}).get("codebook_size") if isinstance(j.get("vq_config"), dict) else None
    if not isinstance(codes, int) or j.get("dist_topk") != codes:
        out.append(("dist_topk", f"must equal vq_config.codebook_size ({codes!r}): their forward mixes every code "
                                 "only then"))
    heads = j.get("num_attention_heads", j.get("n_head"))
    r = j.get("vq_patch_ratio")
    if not isinstance(r, int) or not isinstance(heads, int) or r <= 0 or heads % r:
        out.append(("vq_patch_ratio", f"must divide the {heads} attention heads, got {r!r}"))
    unknown = sorted(set(j) - bb.reads - set(_CONCEPT) - _INERT)
    if unknown:
        out.append(("config", f"field(s) ncpctl does not read and that may change the computation: "
                              f"{', '.join(unknown)}"))
    return out + bb.problems(j)


def model_config(directory: str | Path):
    """The ``ModelConfig`` that computes what their code computes from ``directory``."""
    from ncpctl.model.core.config import ConfigError, ModelConfig

    d = Path(directory)
    j = read_config(d)
    if j is None:
        raise UserError(f"{d}: not a ConceptLM directory (config.json with chunk_size and training_type)")
    bb = BACKBONES[j["model_type"]]
    problems = _problems(j, bb)
    if problems:
        raise UserError(*(f"{d / 'config.json'}: {k}: {m}" for k, m in problems))
    try:
        return ModelConfig.from_dict(dict(
            bb.fields(j), name=f"conceptlm-{bb.name}", vocab_size=j["vocab_size"], pad_vocab_multiple=1,
            n_layers=j["encoder_layers"] + j["decoder_layers"], concept=_concept(j, bb)))
    except (ConfigError, KeyError, TypeError) as e:
        lines = [f"{k}: {m}" for k, m in e.problems] if isinstance(e, ConfigError) else [f"{type(e).__name__}: {e}"]
        raise UserError(*(f"{d / 'config.json'}: {x}" for x in lines)) from None


def their_config(cfg) -> dict:
    """Their config.json for the ncpctl config ``cfg`` (``export_problems`` must be empty)."""
    bb = _backbone_of(cfg)
    c, S, H = cfg.concept, cfg.n_segments, cfg.n_heads
    out = dict(architectures=[bb.architecture], model_type=bb.model_type, vocab_size=cfg.padded_vocab_size,
               **bb.config(cfg), chunk_size=c.k,
               encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers, special_layers=c.concept_layers,
               training_type=_TRAINING_TYPE, vq_config={"codebook_size": c.codes}, dist_topk=c.codes,
               vq_patch_ratio=H // S, **_SWITCHES, **bb.own_switches, torch_dtype="float32",
               transformers_version=TRANSFORMERS, use_cache=True)  # use_cache: their Llama forward needs its cache
    return out


def _backbone_of(cfg) -> Backbone:
    by_family = {"neox": Pythia.model_type, "gpt2": GPT2.model_type, "llama": Llama.model_type}
    if cfg.backbone not in by_family:
        raise UserError(f"backbone {cfg.backbone!r}: the ConceptLM code exists for Pythia, GPT-2 and Llama only")
    return BACKBONES[by_family[cfg.backbone]]


# keys their layout does not hold (training-only, or a name): not compared by ``export_problems``
_FREE = {"name", "init", "init_std", "vocab_size", "pad_vocab_multiple", "mtp_depth", "mtp_weight",
         "mtp_weight_schedule", "mtp_stop_token", "concept.ncp_weight", "concept.vq_weight", "concept.commitment",
         "concept.ncp_reduction", "concept.vq_reduction", "concept.detach_added_concept",
         "concept.copy_concept_layers_from_base"}


def export_problems(cfg) -> list[str]:
    """What keeps ``cfg`` from their layout: every key whose value their config cannot express
    (read back from the config ``their_config`` writes), with the value it would need."""
    from ncpctl.model.core.config import ModelConfig

    try:
        bb = _backbone_of(cfg)
    except UserError as e:
        return e.problems
    if not cfg.concept.enabled:
        return ["concept.enabled: their classes all have the concept path (true)"]
    if cfg.n_heads % cfg.n_segments:
        return [f"concept.segments: {cfg.n_segments} must divide the {cfg.n_heads} heads (their vq_patch_ratio)"]
    j = their_config(cfg)
    problems = [f"{k}: {m}" for k, m in _problems(j, bb)]
    if problems:
        return problems
    back = ModelConfig.from_dict(dict(bb.fields(j), vocab_size=j["vocab_size"], pad_vocab_multiple=1,
                                      n_layers=cfg.n_token_layers, concept=_concept(j, bb)))
    return [f"{k}: {have!r} (their code computes {want!r})" for k, have, want in _diff(cfg.to_dict(), back.to_dict())]


def _concept(j: dict, bb: Backbone) -> dict:
    """The ncpctl concept keys of their config ``j``."""
    heads = j.get("num_attention_heads", j.get("n_head"))
    return dict(enabled=True, k=j["chunk_size"], encoder_layers=j["encoder_layers"],
                concept_layers=j["special_layers"], segments=heads // j["vq_patch_ratio"],
                codes=j["vq_config"]["codebook_size"], codebook="simvq", code_weights="linear",
                codebook_per_segment=True, head_bias=True, rope_scale_by_k=True, commitment=0.25, **bb.concept)


def _diff(have: dict, want: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for k in sorted(set(have) | set(want)):
        key = prefix + k
        if key in _FREE:
            continue
        a, b = have.get(k), want.get(k)
        if isinstance(a, dict) and isinstance(b, dict) and k != "rope_scaling":
            out += _diff(a, b, key + ".")
        elif a != b:
            out.append((key, a, b))
    return out

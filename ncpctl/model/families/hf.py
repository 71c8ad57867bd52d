"""Weights and configs to and from HF transformers, through the backbone families (family.py).

Each family module holds its own mapping (``family_neox.py``: ``GPTNeoXConfig``;
``family_llama.py``: ``LlamaConfig``, ``Qwen3Config``, ``Olmo2Config``, ``Olmo3Config``;
``family_gpt2.py``: ``GPT2Config``); this module does what every family shares.

* ``hf_config(cfg)`` / ``config_from_hf(hf_cfg)``: our config <-> the HF config of the family
  (``config_from_hf`` picks the family by ``model_type``: ``hf_model_types()``). The importer
  reads an allow-list of fields per model type (the family's ``hf_read``): any other field that
  may change the computation is refused by name (ids, dtypes, dropout pass).
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

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from ncpctl.model.core.config import ConfigError, ModelConfig
from ncpctl.model.families.base import Family, registered
from ncpctl.model.registry import family

# the default depth mixer, x + f(x): the only one an HF model has
_PLAIN = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == "residual")

# ---- configs ----------------------------------------------------------------------------


def hf_config(cfg: ModelConfig):
    """The HF config of ``cfg``'s backbone (``n_token_layers`` layers, padded vocab)."""
    problems: list[tuple[str, str]] = []
    if cfg.concept.enabled:
        problems.append(("concept.enabled", "HF models have no concept path; export a base model"))
    if cfg.residual != _PLAIN:
        problems.append(("residual", f"HF models have plain residuals, not {cfg.residual!r}"))
    if cfg.clip_qkv is not None:
        problems.append(("clip_qkv", "the HF models ncpctl exports to do not clamp q/k/v (OLMo-1, which does, is "
                                     "not one of them); set it to null"))
    if cfg.mup_base_width is not None and cfg.tie_embeddings:
        problems.append(("mup_base_width", _MUP_TIED))
    return family(cfg.backbone).hf_config(cfg, problems)


def hf_architecture(cfg: ModelConfig, hf) -> str:
    """The HF ``*ForCausalLM`` class of ``hf_config(cfg)`` = ``hf``."""
    return family(cfg.backbone).hf_architectures[hf.model_type]


def _importers() -> dict[str, Family]:
    """HF model type -> the registered family that imports it."""
    return {mt: fam for fam in registered().values() for mt in fam.hf_model_types}


def hf_model_types() -> tuple[str, ...]:
    """The HF model types ``config_from_hf`` reads (every registered family's)."""
    return tuple(_importers())



# Fields that do not change what the model computes: ids, dtypes, bookkeeping, initialisation,
# dropout (training-time regularisation ncpctl does not apply) and GPT-2's unused summary head.
# A field outside them and outside the family's ``hf_read`` of the model type is refused: it
# may change the computation in a way the import would silently drop.
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
    importers = _importers()
    if mt not in importers:  # before reading any field: other types name them differently
        raise ConfigError([("model_type", f"unsupported HF model type {mt!r} ({', '.join(importers)})")])
    fam = importers[mt]
    unknown = sorted(set(hf.to_dict()) - fam.hf_read[mt] - _INERT)
    if unknown:
        raise ConfigError([("config", f"{mt}: field(s) the importer does not understand and that may change the "
                                      f"computation: {', '.join(unknown)}")])
    base = fam.from_hf(hf)
    base.setdefault("name", getattr(hf, "name_or_path", "") or mt)
    base.update(overrides)
    return ModelConfig.from_dict(base)


# ---- state dicts -----------------------------------------------------------------------


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Top-level (non-layer) names: ours -> HF."""
    return {**family(cfg.backbone).hf_names(cfg), "lm_head.weight": "lm_head.weight"}


def _ours_layer(cfg: ModelConfig, i: int) -> str:
    """Our prefix of token layer i (encoder then decoder)."""
    E = cfg.encoder_layers
    return f"encoder.{i}." if i < E else f"decoder.{i - E}."


def _base_to_token_layer(cfg: ModelConfig, j: int) -> int:
    """Token-layer index of the base's layer j: PM's extra layers sit at ``cfg.extra_layers``."""
    return j + (cfg.extra_token_layers if cfg.extra_layers and j >= cfg.extra_layers[0] else 0)


def _hf_layer(cfg: ModelConfig, i: int) -> str:
    return f"{family(cfg.backbone).hf_layers}{i}."


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """HF state dict of a base model (``model.cfg`` as given by ``hf_config``)."""
    cfg: ModelConfig = model.cfg
    if cfg.concept.enabled:
        raise ConfigError([("concept.enabled", "HF models have no concept path; export a base model")])
    family(cfg.backbone).check_weights(cfg)
    _untied_for_mup(cfg)
    fam, sd = family(cfg.backbone), model.state_dict()
    out = {hf: sd[ours] for ours, hf in _names(cfg).items() if ours in sd}
    if cfg.mup_widths is not None:  # decoupled muP: the logit divisor 1/s_token folded into the head
        out["lm_head.weight"] = out["lm_head.weight"] / cfg.mup_widths[0]
    for i in range(cfg.n_token_layers):
        out.update(fam.layer_to_hf(cfg, sd, _ours_layer(cfg, i), _hf_layer(cfg, i)))
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
    fam = family(cfg.backbone)
    fam.check_weights(cfg)
    sd = dict(sd)
    if "embed_out.weight" in sd:  # original Pythia checkpoints
        sd.setdefault("lm_head.weight", sd.pop("embed_out.weight"))
    prefix = fam.hf_layers
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
        out.update(fam.layer_from_hf(cfg, sd, _hf_layer(cfg, j), _ours_layer(cfg, t)))
    copies = []  # (our prefix, how many base layers to copy into it, the key that asked)
    c = cfg.concept
    if c.enabled and c.copy_concept_layers_from_base:
        copies += [(f"concept.layers.{j}.", j, "concept.concept_layers") for j in range(c.concept_layers)]
    if cfg.copy_extra_layers_from_base and not whole:
        copies += [(_ours_layer(cfg, t), j, "extra_token_layers") for j, t in enumerate(cfg.extra_layers)]
    for ours, j, key in copies:
        if j >= n_hf:
            raise ConfigError([(key, f"more layers to copy than the base's {n_hf}")])
        out.update(fam.layer_from_hf(cfg, sd, _hf_layer(cfg, j), ours))
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

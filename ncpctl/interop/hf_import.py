"""``load_hf_pretrained``: a local Hugging Face directory -> ``NCPModel`` (midtrain's
``train.init_from: <HF dir>``).

Reads ``config.json`` (``GPTNeoXForCausalLM`` such as Pythia, ``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``Olmo2/3ForCausalLM``, ``GPT2LMHeadModel``: any model type a registered
backbone family imports, ``ncpctl.model.families.hf.hf_model_types()``) and the weights (``model.safetensors``, sharded safetensors with an
index, or ``pytorch_model.bin``), builds the ``ModelConfig`` with ``config_from_hf`` plus
the caller's overrides, and loads the backbone with ``ncpctl.model.families.hf``. With a concept
path (``concept={"enabled": True, ...}``) the encoder is the base's first E layers and
the decoder the rest; the concept layers are fresh, or copied from the base's first C
layers with ``concept.copy_concept_layers_from_base`` (ConceptLM 8B). With
``zero_concept_output`` the codebook's output projection starts at zero, so the predicted
concept is 0 and (with ``add: raw``) the model computes exactly the base's logits at step 0;
training moves it from there.

No network: the directory must be local (``HF_HUB_OFFLINE`` or not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (not an ncpctl checkpoint, nor a ConceptLM authors' directory,
    which ``ncpctl.checkpoint`` opens as a checkpoint: authors/conceptlm.py)."""
    from ncpctl.interop.authors import conceptlm

    p = Path(path)
    return (p / "config.json").is_file() and not (p / "ncpctl.json").is_file() and not conceptlm.detect(p)


def read_hf_state_dict(directory: Path) -> dict[str, Any]:
    """The weights of a Hugging Face directory, loaded without running code (``ncpctl.safe_load``:
    safetensors, or ``pytorch_model.bin`` with weights_only); a damaged file is one line naming it."""
    from ncpctl.safe_load import load_pt, load_safetensors

    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single)
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
        sd: dict[str, Any] = {}
        for f in files:
            sd.update(load_safetensors(directory / f))
        return sd
    binf = directory / "pytorch_model.bin"
    if binf.is_file():
        return load_pt(binf)
    raise UserError(f"{directory}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def _config(d: Path, concept: dict[str, Any] | None, model_overrides: dict[str, Any]):
    from transformers import AutoConfig

    from ncpctl.model.core.config import ConfigError
    from ncpctl.model.families.hf import config_from_hf

    try:
        hf_cfg = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{d / 'config.json'}: unreadable HF config ({str(e).splitlines()[0]})") from None
    overrides = dict(model_overrides)
    if concept is not None:
        overrides["concept"] = dict(concept)
    try:
        return config_from_hf(hf_cfg, **overrides)
    except ConfigError as e:
        raise UserError(*(f"{d / 'config.json'}: {k}: {m}" for k, m in e.problems)) from None


def load_hf_pretrained(directory: str | Path, *, cfg: Any = None, concept: dict[str, Any] | None = None,
                       zero_concept_output: bool = False, **model_overrides: Any):
    """An ``NCPModel`` (fp32, CPU, train mode) initialised from the HF directory.

    ``cfg``: the ``ModelConfig`` to build, already resolved (the recipe loader does that for
    ``midtrain``); else it is derived here from the HF config with ``concept``: ``ConceptConfig``
    fields (e.g. ``{"enabled": True, "k": 4, "encoder_layers": 1,
    "copy_concept_layers_from_base": True}``) and ``model_overrides``: other ``ModelConfig``
    fields (``extra_token_layers``, ``max_seq_len``, ``vocab_size``, ...)."""
    from ncpctl.model.core.config import ConfigError
    from ncpctl.model.families.hf import fresh_keys, load_hf_state_dict
    from ncpctl.model.core.model import NCPModel

    from ncpctl.interop.authors import steerling

    d = Path(directory)
    if steerling.detect(d):  # Steerling's own layout (issue 43)
        return steerling.load_pretrained(d, cfg)
    if not (d / "config.json").is_file():
        raise UserError(f"{d}: not a Hugging Face model directory (no config.json)")
    if cfg is None:
        cfg = _config(d, concept, model_overrides)
    model = NCPModel(cfg)
    try:
        missing = load_hf_state_dict(model, read_hf_state_dict(d))
    except (ConfigError, KeyError, RuntimeError) as e:
        raise UserError(f"{d}: weights do not fit the config ({str(e).splitlines()[0]})") from None
    unexpected_missing = [k for k in missing if not k.startswith(fresh_keys(cfg))]
    if unexpected_missing:
        raise UserError(f"{d}: the HF weights lack {', '.join(sorted(unexpected_missing)[:4])}"
                        + (" ..." if len(unexpected_missing) > 4 else ""))
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if zero_concept_output and model.concept is not None:
        model.concept.codebook.zero_output()
    return model

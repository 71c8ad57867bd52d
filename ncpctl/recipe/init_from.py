"""``train.init_from``: the model config a recipe starts from when it names an ncpctl checkpoint
or a Hugging Face directory (the recipe loader, ``load.py``, reports what this finds)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError
from ncpctl.model.core.config import ConfigError, ModelConfig, build_config

Problem = tuple[str, str]  # (key path, message)


def init_from_model(train: Any, problems: list[Problem]) -> ModelConfig | None:
    """The model config stored in ``train.init_from`` when that is an ncpctl checkpoint (or a
    run directory); None otherwise (a Hugging Face directory, or a problem reported elsewhere).
    A strategy only the checkpoint names is not imported but reported (issue 21)."""
    if train is None or not train.init_from:
        return None
    from ncpctl.checkpoint import read_meta, resolve
    from ncpctl.model.core.config import UNTRUSTED, from_checkpoint

    try:
        path = resolve(train.init_from)
        with from_checkpoint(path):
            return ModelConfig.from_dict(read_meta(path)["model_config"])
    except ConfigError as e:
        problems.extend(("train.init_from", m) for _, m in e.problems if UNTRUSTED in m)
        return None
    except (UserError, KeyError, TypeError):
        return None


# the HF model types ncpctl.model.families.hf.config_from_hf converts (checked first: it reads
# attributes such as intermediate_size that other configs, GPT-2's, do not have)
def init_from_hf(train: Any) -> bool:
    if train is None or not train.init_from:
        return False
    from ncpctl.interop.hf_import import is_hf_dir  # light: no torch, no transformers

    return is_hf_dir(train.init_from)


def hf_init_config(model: Any, directory: str, problems: list[Problem]) -> ModelConfig | None:
    """midtrain from a Hugging Face directory: the model is the HF ``config.json`` plus the
    recipe's explicit ``model`` keys, and the concept path of the recipe (``model.size``'s
    concept defaults + ``model.concept``); ``vocab_size`` is the HF model's. Problems are
    reported like any recipe problem, at load time; None when the config is impossible."""
    from ncpctl.interop.authors import steerling

    if steerling.detect(directory):  # Steerling's own layout (issue 43)
        return steerling.init_config(model, directory, problems)
    cfg_file = Path(directory) / "config.json"
    try:
        preset = build_config(model.size)  # the size's concept defaults
    except ConfigError as e:
        problems.extend((f"model.{k}", m) for k, m in e.problems)
        return None
    from transformers import AutoConfig  # only here: loading any other recipe stays light

    from ncpctl.model.families.hf import config_from_hf, hf_model_types

    try:
        hf = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        problems.append(("train.init_from", f"{cfg_file}: unreadable Hugging Face config ({str(e).splitlines()[0]})"))
        return None
    if hf.model_type not in hf_model_types():
        problems.append(("train.init_from", f"{cfg_file}: model_type: unsupported Hugging Face model type "
                         f"{hf.model_type!r} (supported: {', '.join(hf_model_types())})"))
        return None
    explicit = model.model_dump(exclude={"size", "concept", "vocab_size"}, exclude_none=True)
    concept = dataclasses.asdict(preset.concept)
    concept.update(model.concept.model_dump(exclude_none=True) if model.concept is not None else {})
    try:
        return config_from_hf(hf, concept=concept, **explicit)
    except ConfigError as e:
        fields = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
        for k, m in e.problems:
            if k.split(".")[0] in fields:  # a model key (the recipe's, or the HF value it did not override)
                problems.append((f"model.{k}", f"{m} (with the Hugging Face model {directory})"))
            else:  # a property of the HF config itself
                problems.append(("train.init_from", f"{cfg_file}: {k}: {m}"))
        return None

"""Self-describing model checkpoints for everything after training (style rule 7).

Every training checkpoint directory (``run.dir/checkpoints/step_NNNNNNN/``) holds, besides
DeepSpeed's own engine files, an inference view that needs no DeepSpeed to read:

    ncpctl.json        {"format": "ncpctl-checkpoint", "version": 1, "step", "tokens_seen",
                        "model_config": ModelConfig.to_dict(), "recipe": resolved recipe dict}
    model.safetensors  fp32 weights of NCPModel (full, consolidated; state_dict names)
    tokenizer.json     the tokenizer the data was made with (when known)

``eval``, ``generate`` and ``export`` need only this directory (or ``run.dir``, which
resolves to the newest complete checkpoint through ``checkpoints/latest``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, atomic_write_with
from ncpctl.model.config import ConfigError, ModelConfig

FORMAT = "ncpctl-checkpoint"
VERSION = 1
META = "ncpctl.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CHECKPOINTS = "checkpoints"  # run.dir/checkpoints/step_NNNNNNN/

# Whether reading a checkpoint checks its files against its manifest (``--no-verify`` turns it off
# for the command: the CLI sets it once, before any checkpoint is read).
_VERIFY = [True]


def set_verify(on: bool) -> None:
    _VERIFY[0] = bool(on)


def verifying() -> bool:
    return _VERIFY[0]


@dataclass
class LoadedModel:
    model: Any  # NCPModel, eval mode, on CPU
    config: ModelConfig
    tokenizer: Any | None  # tokenizers.Tokenizer
    meta: dict[str, Any]
    path: Path


def save_model_files(directory: Path, model: Any, *, step: int, tokens_seen: int, recipe: dict[str, Any] | None,
                     tokenizer_path: Path | None, extra: dict[str, Any] | None = None) -> None:
    """Write the inference view into ``directory`` (created). Call on one rank with the full
    (consolidated) state dict in ``model`` or pass a ``{name: tensor}`` dict as ``model``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = model if isinstance(model, dict) else model.state_dict()
    cfg = model.cfg if not isinstance(model, dict) else None
    # safetensors refuses shared storage; the tied lm_head is rebuilt from the config on load
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if cfg is not None and cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    # each file atomically and fsynced (ncpctl.fsutil): a crash leaves the old file or the new one
    atomic_write_with(directory / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    if tokenizer_path is not None and Path(tokenizer_path).is_file():
        atomic_write_with(directory / TOKENIZER, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "tokens_seen": tokens_seen,
        "model_config": (cfg.to_dict() if cfg is not None else (extra or {}).get("model_config")),
        "recipe": recipe,
        **{k: v for k, v in (extra or {}).items() if k != "model_config"},
    }
    # last: a directory with ncpctl.json is complete
    atomic_write(directory / META, json.dumps(meta, indent=2, default=str) + "\n")


def resolve(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory from a checkpoint dir, a ``checkpoints/`` dir or a run dir."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such checkpoint or run directory")
    if (p / META).is_file():
        return p
    for base in (p, p / CHECKPOINTS):
        latest = base / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
            cand = base / tag
            if (cand / META).is_file():
                return cand
            raise UserError(f"{latest}: points at {tag}, which is not a complete checkpoint")
    raise UserError(f"{p}: not an ncpctl checkpoint (no {META}, no checkpoints/latest)",
                    hint="pass a checkpoint directory such as runs/debug/checkpoints/step_0000300 or a run directory")


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint directory belongs to (``RUN/checkpoints/step_N`` -> ``RUN``),
    or None for a checkpoint outside a run directory (copied elsewhere, an exported view).

    Where eval results, the export and the tokenized data of a checkpoint live by default.
    """
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def read_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{directory / META}: unreadable checkpoint metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{directory / META}: not an ncpctl checkpoint (format {meta.get('format')!r})")
    if meta.get("version", 0) > VERSION:
        raise UserError(f"{directory / META}: checkpoint format version {meta['version']} is newer than this "
                        f"ncpctl understands ({VERSION}); upgrade ncpctl")
    return meta


def read_weights(directory: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full fp32 state dict of checkpoint ``directory`` (tied lm_head restored)."""
    from safetensors.torch import load_file

    weights = directory / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{weights}: missing (the checkpoint is incomplete)")
    state = load_file(str(weights))
    if (meta or read_meta(directory)).get("model_config", {}).get("tie_embeddings"):
        state.setdefault("lm_head.weight", state["embed.weight"])
    return state


def load_model(path: str | os.PathLike[str], *, with_tokenizer: bool = True) -> LoadedModel:
    """NCPModel (fp32, CPU, eval mode) + tokenizer + metadata from a checkpoint or run dir."""
    import torch

    from ncpctl.model.model import NCPModel

    directory = resolve(path)
    meta = read_meta(directory)
    try:
        cfg = ModelConfig.from_dict(meta["model_config"])
    except (ConfigError, TypeError, KeyError) as e:
        raise UserError(f"{directory / META}: invalid model_config ({e})") from None
    state = read_weights(directory, meta)
    with torch.device("meta"):
        model = NCPModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise UserError(f"{directory / WEIGHTS}: weights do not match the model config "
                        f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.eval()
    tok = None
    if with_tokenizer and (directory / TOKENIZER).is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(directory / TOKENIZER))
    return LoadedModel(model=model, config=cfg, tokenizer=tok, meta=meta, path=directory)

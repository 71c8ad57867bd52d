"""What a checkpoint directory is made of: the file names, the format tag and version, and the
in-memory record of a loaded model (``LoadedModel``).

The floor below ``ncpctl.checkpoint`` (which finds, verifies and opens checkpoints) and below the
readers of the authors' layouts (``ncpctl.interop.authors``), which build the same record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "ncpctl-checkpoint"
VERSION = 1
META = "ncpctl.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


@dataclass
class LoadedModel:
    model: Any  # NCPModel, eval mode, on CPU
    config: Any  # ModelConfig
    tokenizer: Any | None  # tokenizers.Tokenizer
    meta: dict[str, Any]
    path: Path


def eod_token(loaded: LoadedModel) -> tuple[str, int | None]:
    """The end-of-document token of a loaded checkpoint (its recipe's ``tokenizer.eod_token``,
    default ``<|endoftext|>``) and its id in the checkpoint's tokenizer (None if absent)."""
    token = ((loaded.meta.get("recipe") or {}).get("tokenizer") or {}).get("eod_token", "<|endoftext|>")
    return token, (loaded.tokenizer.token_to_id(token) if loaded.tokenizer is not None else None)

"""Parameter counts of an NCP model (accounting.py's third view): the real ``NCPModel`` built on
the meta device, grouped by component. Torch is imported only when counting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncpctl.model.core.config import ModelConfig

__all__ = ["PARAM_GROUPS", "ParamCounts", "count_parameters"]


# Groups in reporting order; the first matching prefix wins (see _param_group).
PARAM_GROUPS = (
    "embeddings",
    "lm_head",
    "token_layers",
    "concept_layers",
    "concept_heads",
    "codebook",
    "codebook_transform",
    "dynamic_residuals",
    "segmentation",
    "coupling",
    "bottleneck",
    "mtp",
    "norms_other",
)

_PREFIXES = (
    ("embed.", "embeddings"),
    ("pos_embed.", "embeddings"),  # gpt2: learned absolute positions
    ("lm_head.", "lm_head"),
    ("encoder.", "token_layers"),
    ("decoder.", "token_layers"),
    ("concept.layers.", "concept_layers"),
    ("concept.up.", "concept_layers"),  # DLCM's W_up into a wider concept transformer
    ("concept.heads.", "concept_heads"),
    ("concept.codebook.transform.", "codebook_transform"),
    ("concept.codebook.", "codebook"),  # frozen base codes (or a plain learned codebook)
    ("crc.", "dynamic_residuals"),
    ("concept.segmenter.", "segmentation"),  # the segmentation's own (DLCM's boundary predictor)
    ("concept.coupling.", "coupling"),  # the coupling's own (DLCM's cross-attention)
    ("bottleneck.", "bottleneck"),  # Steerling's concept bottleneck: f, K, g, A, B
    ("mtp.", "mtp"),  # the multi-token prediction head (training only)
)


def _param_group(name: str) -> str:
    if ".residual." in name:  # a stack's depth mixer (IRC), wherever the stack is
        return "dynamic_residuals"
    if name.startswith("decoder.") and ".cross" in name:  # a coupling's sub-layer in a decoder block (Block.cross)
        return "coupling"
    for prefix, group in _PREFIXES:
        if name.startswith(prefix):
            return group
    return "norms_other"  # final_norm, concept.norm / norm_h / norm_pred


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts of ``NCPModel(cfg)`` by component (tied weights counted once).

    ``unpadded_total``: the same without the padding rows of the embedding and LM head
    (``padded_vocab_size - vocab_size`` rows each, once when tied): the count of the HF model
    with the real vocabulary (GPT-2 124M: 124,439,808 at vocab 50257)."""

    components: dict[str, int]
    total: int
    trainable: int
    unpadded_total: int

    def to_dict(self) -> dict[str, Any]:
        return {"components": dict(self.components), "total": self.total, "trainable": self.trainable,
                "unpadded_total": self.unpadded_total}


def count_parameters(cfg: ModelConfig, setup: Any = None) -> ParamCounts:
    """Build ``NCPModel(cfg)`` on the meta device (no memory, no init cost) and count.

    ``setup(model)``: a stage's set-up applied first (adapt-vq's freeze, LoRA's adapters:
    ``ncpctl.train.stages.Stage.freeze``), so that ``trainable`` is what that stage trains."""
    import torch  # lazy: the CLI imports this module to describe configs without torch

    from ncpctl.model.core.model import NCPModel

    with torch.device("meta"):
        model = NCPModel(cfg)
        if setup is not None:
            setup(model)
    comps = {g: 0 for g in PARAM_GROUPS}
    total = trainable = 0
    for name, p in model.named_parameters():  # shared (tied) parameters are yielded once
        n = p.numel()
        comps[_param_group(name)] += n
        total += n
        if p.requires_grad:
            trainable += n
    pad_rows = (cfg.padded_vocab_size - cfg.vocab_size) * (1 if cfg.tie_embeddings else 2)
    return ParamCounts(components=comps, total=total, trainable=trainable,
                       unpadded_total=total - pad_rows * cfg.d_model)

"""LoRA as a stage set-up (``train.lora``): the baseline of NCP-ArchPreview Sec. 5.1 next to
adapt-vq and full fine-tuning.

``apply_lora`` runs where adapt-vq's freeze runs (``loop._build_model``, after the checkpoint's
weights are loaded, also when resuming): every weight of the model is frozen and peft's
``inject_adapter_in_model`` wraps each target ``nn.Linear`` in place, so the model stays an
``NCPModel`` (same forward, outputs, hooks) whose trainable parameters are the adapters:
``W x + (alpha / rank) B A x`` with A (rank, in) and B (out, rank), B starting at zero (step 0
computes exactly the checkpoint's logits).

Checkpoints: DeepSpeed's files hold the module as trained (base weights plus ``lora_A``/``lora_B``,
what a resume loads back into a model set up the same way); the inference view
``model.safetensors`` holds the adapters merged into the weights under the plain model's names
(``merge_adapters``), so ``eval``, ``generate``, ``export`` and a later ``train.init_from`` read a
LoRA run's checkpoint like any other; ``ncpctl.json`` records ``lora`` (rank, alpha, targets,
``merged: true``).
"""

from __future__ import annotations

from typing import Any

import torch

from ncpctl.errors import UserError


def lora_config(spec: Any) -> Any:
    """peft's ``LoraConfig`` for the recipe's ``train.lora`` section."""
    try:
        from peft import LoraConfig
    except ImportError:  # an optional dependency: only LoRA runs need it
        raise UserError("train.lora: LoRA needs peft, which is not installed",
                        hint="pip install 'ncpctl[lora]' (or pip install peft)") from None
    return LoraConfig(r=spec.rank, lora_alpha=spec.rank * 2 if spec.alpha is None else spec.alpha,
                      lora_dropout=spec.dropout, target_modules=list(spec.targets), bias="none")


def apply_lora(model: torch.nn.Module, spec: Any) -> None:
    """Freeze every weight of ``model``, then add trainable adapters to the ``spec.targets``."""
    from peft import inject_adapter_in_model

    config = lora_config(spec)
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # peft: no module matched the targets
        raise UserError(f"train.lora.targets: {e}", hint="targets are suffixes of module paths such as "
                        "attn.qkv, attn.proj, mlp.fc, mlp.proj") from None


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """``module path -> alpha / rank`` of every adapted layer (empty without LoRA)."""
    out = {}
    for name, m in model.named_modules():
        scale = getattr(m, "scaling", None)
        if isinstance(scale, dict) and hasattr(m, "base_layer") and "default" in scale:
            out[name] = float(scale["default"])
    return out


def merge_adapters(state: dict[str, torch.Tensor], scale: dict[str, float]) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict with each adapter merged, W + (alpha / rank) B A, under the plain
    model's names (``x.base_layer.weight`` -> ``x.weight``; the adapters' own entries dropped).
    Works on any full state dict (also ZeRO-3's consolidated one); merges in fp32."""
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    for module, s in scale.items():
        a, b = state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + s * (b.float() @ a.float())).to(w.dtype)
    return out


def describe(spec: Any) -> dict[str, Any]:
    """What ``ncpctl.json`` records of a LoRA run."""
    return {"rank": spec.rank, "alpha": spec.rank * 2 if spec.alpha is None else spec.alpha,
            "dropout": spec.dropout, "targets": list(spec.targets), "merged": True}

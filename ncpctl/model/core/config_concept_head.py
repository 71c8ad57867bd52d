"""The recipe keys of the concept heads and the SimVQ codebook transform (concept.py): the section
``ConceptConfig`` composes (``model.concept.head_norm``, ...) and its checks. Stdlib only
(config_base.py).

The defaults are ncpctl's first reading of ConceptLM; the authors' released code (LUMIA-Group/
ConceptLM, issue 43) differs per backbone: a norm before the heads in its Pythia code only, heads
with biases everywhere (``nn.Linear``), and one SimVQ, so one transform, per codebook segment, an
MLP for Pythia and Llama and SimVQ's default bias-free Linear for GPT-2 (docs: "Using the released
models")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ncpctl.model.core.config_base import Section, option

TRANSFORMS = ("mlp", "linear")


@dataclass
class ConceptHeadSection(Section):
    head_norm: bool = option(
        True, "A norm (the backbone's) on the concept transformer's output before the concept heads (ConceptLM's "
        "Pythia code; its GPT-2 and Llama code have none).")
    head_bias: bool | None = option(
        None, "Biases in the concept heads; null = model.bias. The authors' ConceptLM code always has them "
        "(nn.Linear), Llama included.")
    codebook_transform: Literal["mlp", "linear"] = option(
        "mlp", "SimVQ's transform of the frozen base codes (codebook: simvq): mlp = Linear(d/S, 2d/S) -> ReLU -> "
        "Linear(2d/S, d/S) (ConceptLM App. E.3, its Pythia and Llama code); linear = Linear(d/S, d/S) without bias "
        "(SimVQ's default, the authors' GPT-2 code).")
    codebook_per_segment: bool = option(
        False, "One transform per codebook segment (the authors' code: one SimVQ per segment); false = one transform "
        "shared by the S segments.")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        problems = []
        if self.codebook_transform not in TRANSFORMS:
            problems.append(("codebook_transform", f"must be one of {', '.join(TRANSFORMS)}, "
                                                   f"got {self.codebook_transform!r}"))
        for key in ("head_norm", "codebook_per_segment"):
            if not isinstance(getattr(self, key), bool):
                problems.append((key, f"must be true or false, got {getattr(self, key)!r}"))
        if self.head_bias is not None and not isinstance(self.head_bias, bool):
            problems.append(("head_bias", f"must be true, false or null, got {self.head_bias!r}"))
        return problems

    def transform_layers(self, ds: int) -> list[tuple[int, int, bool]]:
        """The transform's linear layers as (in, out, bias), at their ``nn.Sequential`` indices 0, 2
        (a ReLU between them); segment width ``ds``."""
        if self.codebook_transform == "linear":
            return [(ds, ds, False)]
        return [(ds, 2 * ds, True), (2 * ds, ds, True)]

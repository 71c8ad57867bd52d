"""The recipe keys of the depth mixers (residual.py): NCP-ArchPreview's intra-module residual
(``residual: irc``) and cross-module residuals (``crc_*``, Sec. 2.6) and Block AttnRes
(``residual: block_attnres``): the sections ``ModelConfig`` composes (``model.irc_hidden``, ...)
and their checks. Stdlib only (config_base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ncpctl.model.core.config_base import Section, is_positive_int, option

CRC_CONNECTIONS = ("encoder-concept", "encoder-decoder", "concept-decoder")
CRC_MODES = ("layers", "input")
ATTNRES = "block_attnres"  # the depth mixer whose keys attnres_* are (STRATEGIES["residual"])


@dataclass
class IrcSection(Section):
    irc_hidden: int = option(32, "IRC: hidden width of each layer's weight MLP (the paper does not state it).")
    irc_normalize: Literal["none", "softmax"] = option(
        "none", "IRC weights: none = unnormalised (the paper); softmax = Table 3's per-stage-softmax variant.")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        problems = []
        if not is_positive_int(self.irc_hidden):
            problems.append(("irc_hidden", f"must be a positive integer, got {self.irc_hidden!r}"))
        if self.irc_normalize not in ("none", "softmax"):
            problems.append(("irc_normalize", f"must be none or softmax, got {self.irc_normalize!r}"))
        return problems


@dataclass
class CrcSection(Section):
    crc_connections: list = option(
        list, "NCP-ArchPreview's cross-module residuals (Sec. 2.6, Eqs. 19-20), any of encoder-concept, "
        "encoder-decoder, concept-decoder (all three: the paper's IRC+CRC); needs the concept path.")
    crc_hidden: int = option(32, "CRC: hidden width of each target layer's depth-selection MLP.")
    crc_init: float = option(0.0, "CRC: initial per-dimension scale D (0: the network starts as the plain one; "
                                  "the paper's small init, e.g. 0.01, as an option).")
    crc_mode: Literal["layers", "input"] = option(
        "layers", "Where each CRC connection enters its target module: layers = after every target layer (Sec. 2.6, "
        "Eqs. 19-20); input = once, on the target module's input (Table 3's \"IRC + input-level cross connection\").")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        """NCP-ArchPreview Sec. 2.6's cross-module residuals."""
        problems = []
        if not is_positive_int(self.crc_hidden):
            problems.append(("crc_hidden", f"must be a positive integer, got {self.crc_hidden!r}"))
        if self.crc_mode not in CRC_MODES:
            problems.append(("crc_mode", f"must be one of {', '.join(CRC_MODES)}, got {self.crc_mode!r}"))
        links = self.crc_connections
        if not isinstance(links, list) or any(x not in CRC_CONNECTIONS for x in links) or len(set(links)) != len(links):
            return problems + [("crc_connections", f"must be distinct names from {', '.join(CRC_CONNECTIONS)}, "
                                                   f"got {links!r}")]
        if links and not self.concept.enabled:
            problems.append(("crc_connections", "cross-module residuals connect the encoder, concept and decoder "
                                                "modules: they need the concept path (model.concept.enabled)"))
        elif "encoder-concept" in links and law is not None and not law.pools_any_width:
            problems.append(("crc_connections", f"encoder-concept pools every encoder depth, which segmentation "
                                                f"{self.concept.segmentation!r} cannot (its law: pools_any_width)"))
        return problems


@dataclass
class AttnResSection(Section):
    attnres_block: int = option(4, "block_attnres: layers per block (Table 3: 4); a block's layer updates are summed "
                                   "into one stored state.")
    attnres_cross: bool = option(
        True, "block_attnres with the concept path: the block states continue across modules (encoder -> concept "
        "pooled like the concepts, encoder and concept -> decoder aligned and shifted like CRC): Table 3's arm.")

    def section_check(self, cfg: Any, law: Any) -> list[tuple[str, str]]:
        """Block AttnRes keys; the cross-module ones only when it is the depth mixer."""
        problems = []
        if not is_positive_int(self.attnres_block):
            problems.append(("attnres_block", f"must be a positive integer, got {self.attnres_block!r}"))
        if not isinstance(self.attnres_cross, bool):
            problems.append(("attnres_cross", f"must be true or false, got {self.attnres_cross!r}"))
        if self.residual != ATTNRES:
            return problems
        if self.crc_connections:
            problems.append(("crc_connections", "residual: block_attnres has its own cross-module connections "
                                                "(attnres_cross); CRC connects IRC-style depths: use [] here"))
        if self.attnres_cross and self.concept.enabled and law is not None and not law.pools_any_width:
            problems.append(("attnres_cross", f"the encoder's block states are pooled to the concepts, which "
                                              f"segmentation {self.concept.segmentation!r} cannot (its law: "
                                              f"pools_any_width); set attnres_cross: false"))
        return problems


# The cost model's view of the built-in depth mixers (accounting.py asks ``design_cost``): ``key``
# is the component they are reported as; ``flops(cfg, stack, shape)`` the forward matmul FLOPs of
# one stack (encoder, concept or decoder) per sequence, ``shape[stack] = (layers, positions)``;
# ``vector`` (optional) the part of them that is not a GEMM (elementwise or matrix-vector work, which
# runs at memory bandwidth and which torch's FlopCounterMode does not count).
class IrcCost:
    """IRC, per layer i: MLP(R) d -> hidden -> i+2 weights, then the i+2 states' weighted sum."""

    key = "residual.irc"

    @staticmethod
    def flops(cfg: Any, stack: str, shape: dict[str, tuple[int, int]]) -> int:
        d, h = cfg.d_model, cfg.irc_hidden
        n, P = shape[stack]
        return sum(2 * P * (d * h + h * (i + 2)) + 2 * P * (i + 2) * d for i in range(n))

    @staticmethod
    def vector(cfg: Any, stack: str, shape: dict[str, tuple[int, int]]) -> int:
        """The part of ``flops`` that is not a GEMM: none (the weighted sums are one batched matmul
        per layer, forward and backward: ``residual.DepthMix``)."""
        return 0


class AttnResCost:
    """Block AttnRes, per query i = 0..n (layer i's input, the output after layer n-1) over V values
    (the cross-module sources, the input, the i // S completed blocks, the open one): the logits
    w . RMSNorm(v) (2 V d) and the weighted sum (2 V d), V = 1 included."""

    key = "residual.attnres"

    @staticmethod
    def depths(cfg: Any, layers: int) -> int:
        """States a stack of ``layers`` hands on: its input, its blocks (the last may be partial), its output."""
        return 2 + -(-layers // cfg.attnres_block)

    @staticmethod
    def flops(cfg: Any, stack: str, shape: dict[str, tuple[int, int]]) -> int:
        d, S = cfg.d_model, cfg.attnres_block
        n, P = shape[stack]
        src = 0
        if cfg.attnres_cross and cfg.concept.enabled:
            before = {"encoder": (), "concept": ("encoder",), "decoder": ("encoder", "concept")}[stack]
            src = sum(AttnResCost.depths(cfg, shape[s][0]) for s in before)
        V = [src + 1 + i // S + (i % S > 0) for i in range(n + 1)]
        return sum(4 * P * v * d for v in V)

    @classmethod
    def vector(cls, cfg: Any, stack: str, shape: dict[str, tuple[int, int]]) -> int:
        """Half of it: the logits are matrix-vector products (one pseudo-query); the weighted sums are
        a batched matmul (``residual.DepthMix``)."""
        return cls.flops(cfg, stack, shape) // 2

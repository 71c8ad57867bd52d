"""NCP-ArchPreview's dynamic residuals (paper Sec. 2.6, Eqs. 14-20; ncp-model.md sections 7-8).

**IRC** (intra-module, ``model.residual: irc``), a depth mixer of every stack: after layer l
(1-based) the candidates are the stack input and every layer output so far,
``X = {H_1, H_1 + R_1, ..., H_l + R_l}``, and the next input is their per-token weighted sum
``H_{l+1} = sum_j w_{l,j} X_j`` with ``w_l = MLP_l(R_l)``, *not* normalised (negative weights
allowed; ``irc_normalize: softmax`` is Table 3's per-stage-softmax variant). The MLP's last layer
starts at zero and a constant one-hot on the newest candidate is added, so at init the stack is
exactly the plain residual network. The paper does not give the MLP's width: ``irc_hidden``.

**CRC** (cross-module, ``model.crc_connections``): for a target module s and a source module u,
after each target layer l, ``alpha = softmax(MLP(T_l))`` over the K source depths (the source
module's input and each of its layers' outputs), ``M = sum_j alpha_j LN(S_j)``, and
``T <- T + D_l * M`` with a per-dimension scale D (0 at init: the plain network; ``crc_init``
is the paper's small init). Connections, aligned to the target's sequence:

* ``encoder-concept``: encoder depths pooled to concepts by the segmentation (it must pool
  any width, as fixed blocks do: ``Segmenter.pools_any_width``);
* ``encoder-decoder``: token-aligned;
* ``concept-decoder``: concept depths spread to the tokens exactly as pred is (token t sees the
  concepts closed at or before it), so the model stays causal with CRC on.

Both mixers work per position, so cached decoding equals the full forward (decode.py keeps the
sources a new token needs). Their parameters get no weight decay (``no_weight_decay``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Residual

CONNECTIONS = ("encoder-concept", "encoder-decoder", "concept-decoder")


def _weight_mlp(d: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, out))


class IRC(Residual):
    owns_init = True

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__(cfg, n_layers)
        self.softmax = cfg.irc_normalize == "softmax"
        # layer i (0-based) mixes i + 2 candidates: the stack input and the outputs of layers 0..i
        self.mlps = nn.ModuleList(_weight_mlp(cfg.d_model, cfg.irc_hidden, i + 2) for i in range(n_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for mlp in self.mlps:
            mlp[0].reset_parameters()
            nn.init.zeros_(mlp[2].weight)
            nn.init.zeros_(mlp[2].bias)

    def begin(self, x0: torch.Tensor) -> list[torch.Tensor]:
        return [x0]

    def forward(self, layer: int, x: torch.Tensor, update: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
        seen.append(update + x)  # H_l + R_l: the plain output of this layer
        w = self.mlps[layer](update)  # (B, T, layer + 2), zero at init
        newest = torch.zeros(layer + 2, dtype=w.dtype, device=w.device)
        newest[-1] = 1.0
        w = w + newest
        if self.softmax:
            w = w.softmax(-1)
        out = w[..., :1] * seen[0]
        for j in range(1, layer + 2):  # one fused multiply-add per candidate
            out = torch.addcmul(out, w[..., j : j + 1], seen[j])
        return out


class CrossModule(nn.Module):
    """One CRC connection into a target stack of ``n_target`` layers from K source depths."""

    no_weight_decay = True
    owns_init = True  # D = crc_init (0: the plain network); NCPModel.init_weights leaves it alone

    def __init__(self, cfg: ModelConfig, n_target: int, K: int):
        super().__init__()
        d = cfg.d_model
        self.K, self.init = K, cfg.crc_init
        self.mlps = nn.ModuleList(_weight_mlp(d, cfg.crc_hidden, K) for _ in range(n_target))
        self.norms = nn.ModuleList(nn.LayerNorm(d, eps=cfg.norm_eps) for _ in range(K))
        self.scale = nn.Parameter(torch.empty(n_target, d))  # D, one per target layer
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for mlp in self.mlps:
            for m in mlp:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        for n in self.norms:
            n.reset_parameters()
        nn.init.constant_(self.scale, self.init)

    def sources(self, depths: list[torch.Tensor]) -> list[torch.Tensor]:
        """LN(S_j) of each source depth (each aligned to the target: (B, T_target, d))."""
        return [norm(s) for norm, s in zip(self.norms, depths)]

    def forward(self, layer: int, x: torch.Tensor, normed: list[torch.Tensor]) -> torch.Tensor:
        alpha = F.softmax(self.mlps[layer](x), dim=-1)  # (B, T, K)
        m = alpha[..., :1] * normed[0]
        for j in range(1, self.K):
            m = torch.addcmul(m, alpha[..., j : j + 1], normed[j])
        return torch.addcmul(x, self.scale[layer], m)


class CrossModules(nn.Module):
    """The model's CRC connections (``crc_connections``), each a ``CrossModule``."""

    no_weight_decay = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = cfg.concept
        sizes = {"encoder": cfg.encoder_layers, "concept": c.concept_layers, "decoder": cfg.decoder_layers}
        self.links = nn.ModuleDict({
            name.replace("-", "_"): CrossModule(cfg, sizes[name.split("-")[1]], sizes[name.split("-")[0]] + 1)
            for name in cfg.crc_connections
        })

    def has(self, name: str) -> bool:
        return name.replace("-", "_") in self.links

    def hook(self, targets: list[tuple[str, list[torch.Tensor]]]) -> "CrossHook | None":
        """A ``Context.post`` hook applying the connections ``targets`` = [(name, aligned source
        depths)] after each layer of their target stack; None when there are none."""
        links = [(self.links[name.replace("-", "_")], depths) for name, depths in targets]
        return CrossHook([(link, link.sources(depths)) for link, depths in links]) if links else None


class CrossHook:
    """``post(layer, x)`` of a target stack: every connection into it, with its normed sources."""

    def __init__(self, applied: list[tuple[CrossModule, list[torch.Tensor]]]):
        self.applied = applied

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        for link, normed in self.applied:
            x = link(layer, x, normed)
        return x

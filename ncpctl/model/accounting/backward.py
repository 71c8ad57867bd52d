"""The backward of a partly frozen model, for ``exact_flops(..., trainable=...)`` (accounting.py):
which matmuls autograd really runs when a stage freezes weights (adapt-vq, LoRA) or a design
detaches its input (the bottleneck's sg(h)). Each design's own matmuls are asked of the design
(``design_cost``); the walk follows the model's data flow."""

from __future__ import annotations

from typing import Mapping

from ncpctl.model.accounting.parts import (SLOTS, _concept_costs, _crc_flops, _crc_key, _keys_causal, _keys_full,
                                           _mtp_flops, _shapes)
from ncpctl.model.core.config import ModelConfig
from ncpctl.model.designs.bottleneck.config import BottleneckCost
from ncpctl.model.designs.mtp.config import MtpCost
from ncpctl.model.registry import family
from ncpctl.model.registry import design_cost

__all__ = ["Backward"]


class Backward:
    """The backward of a partly frozen model, walked in data-flow order (one sequence).

    ``rg`` ("requires grad") says whether the activation flowing into an op depends on a
    trained parameter. A weight matmul of forward cost F costs F for its input gradient when
    its input is rg and F for its weight gradient when its weight trains; a weight-less op
    (attention's QK^T and AV, pooling, the codebook mix) costs 2F when its input is rg, per
    operand for the mix (code weights, codes). With every weight trained this is exactly
    2x forward, the 3x convention. A trained norm or bias makes the activation after it rg.
    """

    def __init__(self, cfg: ModelConfig, trainable: Mapping[str, int]):
        self.cfg = cfg
        self.numel = {k.replace(".base_layer.", "."): int(v) for k, v in trainable.items()}
        self.flops: dict[str, int] = {}
        self.causal: dict[str, int] = {}
        self.vector: dict[str, int] = {}  # the non-GEMM part of ``flops`` (ExactFlops.vector_backward)
        self.adapters = 0  # forward FLOPs of LoRA adapters, per sequence

    def trains(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.numel)

    def add(self, key: str, flops: int, vector: int = 0) -> None:
        """Backward ``flops`` of component ``key``, ``vector`` of them not a GEMM."""
        self.flops[key] = self.flops.get(key, 0) + flops
        if vector:
            self.vector[key] = self.vector.get(key, 0) + vector

    def linear(self, key: str, module: str, f: int, n: int, rg: bool) -> bool:
        """Weight matmul ``module`` (forward f on n positions); returns whether its output is rg."""
        self.add(key, f * (rg + (f"{module}.weight" in self.numel)))
        a, b = (2 * n * sum(v for k, v in self.numel.items() if k.startswith(f"{module}.lora_{x}.")) for x in "AB")
        if a or b:  # x -> A -> B: weight gradients of both, B's input gradient, A's when x is rg
            self.adapters += a + b
            self.add("adapters", a * (1 + rg) + 2 * b)
        return rg or self.trains(f"{module}.")

    def block(self, group: str, prefix: str, n: int, window: int | None, rg: bool, cfg: ModelConfig) -> bool:
        """Block ``prefix`` (attention then MLP, ncpctl.model.core.layers.Block, shaped by ``cfg``) on n positions."""
        d = cfg.d_model
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        x = rg or self.trains(f"{prefix}attn_norm.")
        q = self.linear(f"{group}.qkv", f"{prefix}attn.qkv", 2 * n * d * (q_dim + 2 * kv_dim), n, x)
        q = q or self.trains(f"{prefix}attn.q_norm.") or self.trains(f"{prefix}attn.k_norm.")
        self.add(f"{group}.attention", 2 * 4 * q_dim * _keys_full(n, window) * q)
        self.causal[f"{group}.attention"] = self.causal.get(f"{group}.attention", 0) + 2 * 4 * q_dim * _keys_causal(n, window) * q
        a = self.linear(f"{group}.attn_out", f"{prefix}attn.proj", 2 * n * q_dim * d, n, q)
        m = (rg if cfg.parallel_residual else rg or a) or self.trains(f"{prefix}mlp_norm.")
        gate = family(cfg.backbone).mlp_matrices - 1  # the fused fc holds gate and up for SwiGLU
        h = self.linear(f"{group}.mlp", f"{prefix}mlp.fc", 2 * n * d * cfg.ffn_dim * gate, n, m)
        self.linear(f"{group}.mlp", f"{prefix}mlp.proj", 2 * n * cfg.ffn_dim * d, n, h)
        return rg or self.trains(prefix)  # any trained parameter of the block (cross sub-layer too)

    def stack(self, group: str, prefix: str, windows, n: int, rg: bool, cfg: ModelConfig | None = None) -> bool:
        for i, w in enumerate(windows):
            rg = self.block(group, f"{prefix}.{i}.", n, w, rg, cfg or self.cfg) or self.trains(f"{prefix}.residual.")
        return rg

    def dynamic_residuals(self, T: int, M: int, rg: dict[str, bool]) -> None:
        """IRC and CRC as a linear of their forward F: F for the input gradient when the stack's
        output depends on something trained (``rg``: the stacks' outputs), F for the weight
        gradients when the mixer trains. (A stack's lowest layers below its first trained
        parameter get no input gradient; counting the whole stack is exact when every block or
        no block of a stack trains, as in adapt-vq, LoRA and full fine-tuning.)"""
        cfg = self.cfg
        mixer = design_cost("residual", cfg.residual)
        if mixer is not None:
            shapes = _shapes(cfg, T, M)
            for stack, prefix in (("encoder", "encoder"), ("concept", "concept.layers"), ("decoder", "decoder")):
                f = mixer.flops(cfg, stack, shapes)
                v = mixer.vector(cfg, stack, shapes) if hasattr(mixer, "vector") else 0
                factor = bool(rg[stack]) + self.trains(f"{prefix}.residual.")
                self.add(mixer.key, f * factor, v * factor)
        for link in cfg.crc_connections:
            source, target = link.split("-")
            f, v = _crc_flops(cfg, link, T, M), _crc_flops(cfg, link, T, M, vector=True)
            factor = bool(rg[source] or rg[target]) + self.trains(f"crc.links.{link.replace('-', '_')}.")
            self.add(_crc_key(cfg), f * factor, v * factor)

    def design(self, slot: str, cost, T: int, M: int, comps: dict[str, int], vector: dict[str, int], grads_in: bool) -> None:
        """The backward of a concept-path strategy's own components (``cost``, at parameter prefix
        ``slot``): its ``backward`` when it has one, else each component as a linear of its forward."""
        fwd = {k: comps[k] for k in cost.flops(self.cfg, T, M)}
        # a coupling's parameters: its own and its sub-layer in each decoder block (Block.cross)
        slots = [slot] + ([f"decoder.{i}.cross." for i in range(self.cfg.decoder_layers)]
                          if slot == SLOTS["coupling"] else [])
        trains = lambda p: any(self.trains(s + p) for s in slots)  # noqa: E731
        if hasattr(cost, "backward"):
            out = cost.backward(self.cfg, T, M, fwd, grads_in, trains)
        else:
            out = {k: f * (grads_in + trains("")) for k, f in fwd.items()}
        for k, f in out.items():
            self.add(k, f, f * vector.get(k, 0) // comps[k] if comps[k] else 0)

    def model(self, T: int, M: int, comps: dict[str, int], vector: dict[str, int]) -> None:
        cfg, c = self.cfg, self.cfg.concept
        E = cfg.encoder_layers
        h = self.stack("token_layers", "encoder", cfg.token_windows[:E], T, self.trains("embed.") or self.trains("pos_embed."))
        z = h
        if c.enabled:
            costs = dict(_concept_costs(cfg))  # slot -> cost model
            seg = costs.get(SLOTS["segmentation"])
            if seg is None or "concept.pooling" not in seg.flops(cfg, T, M):  # fixed blocks: k adds per element
                self.add("concept.pooling", 2 * comps["concept.pooling"] * h, 2 * vector.get("concept.pooling", 0) * h)
            if seg is not None:
                self.design(SLOTS["segmentation"], seg, T, M, comps, vector, h)
            c_in = self.linear("concept.up", "concept.up", comps["concept.up"], M, h) if "concept.up" in comps else h
            u = self.stack("concept_layers", "concept.layers", cfg.concept_windows, M, c_in, cfg.concept_cfg) \
                or self.trains("concept.norm.")
            w = self.linear("concept.heads", "concept.heads", comps["concept.heads"], M, u)
            codes = "concept.codebook.base" in self.numel
            if c.codebook == "simvq":  # base -> its transform's linears (at indices 0, 2), once per step
                S, N = cfg.n_segments, c.codes
                for j, (i, o, _) in enumerate(c.transform_layers(cfg.segment_dim)):
                    codes = self.linear("concept.codebook_transform", f"concept.codebook.transform.{2 * j}",
                                        2 * S * N * i * o, 0, codes)
            self.add("concept.codebook_einsum", comps["concept.codebook_einsum"] * (w + codes))
            pred = (w or codes) and not c.detach_added_concept
            coupling = costs.get(SLOTS["coupling"])
            if coupling is not None:
                self.design(SLOTS["coupling"], coupling, T, M, comps, vector, h or pred)
            z = h or pred or self.trains(SLOTS["coupling"])
        dec = self.stack("token_layers", "decoder", cfg.token_windows[E:], T, z)
        self.dynamic_residuals(T, M, {"encoder": h, "concept": c.enabled and u, "decoder": dec})
        out = dec or self.trains("final_norm.")
        if cfg.bottleneck.enabled:  # h -> h_bar, as the bottleneck walks itself
            out = BottleneckCost.backward(cfg, comps, out, Scoped(self, "bottleneck."))
        lm_w = "lm_head.weight" in self.numel or (cfg.tie_embeddings and "embed.weight" in self.numel)
        self.add("lm_head", comps["lm_head"] * (out + lm_w))
        factors = MtpCost.backward_factors(out, self.trains("mtp."), lm_w)
        for key, (f, c) in _mtp_flops(cfg, T).items():
            factor = factors[key]
            self.add(key, f * factor)
            if c is not None:
                self.causal[key] = self.causal.get(key, 0) + c * factor


class Scoped:
    """The walk as a design's own module sees it: parameter names relative to its ``prefix``."""

    def __init__(self, walk: Backward, prefix: str):
        self.walk, self.prefix = walk, prefix

    def has(self, name: str) -> bool:
        """Whether the parameter ``name`` (relative) trains."""
        return self.prefix + name in self.walk.numel

    def linear(self, key: str, module: str, f: int, rg: bool) -> bool:
        """Weight matmul ``module`` (relative) of forward f, reported as ``key``; whether its output carries a gradient."""
        return self.walk.linear(key, self.prefix + module, f, 0, rg)

    def add(self, key: str, flops: int) -> None:
        self.walk.add(key, flops)

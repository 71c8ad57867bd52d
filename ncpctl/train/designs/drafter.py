"""Training the block-parallel drafter (NCP-ArchPreview Sec. 5.3) with the one training loop.

The ``train-drafter`` stage (``ncpctl.train.stages``) builds the target from ``train.init_from``
(frozen, eval mode) and hands the loop a ``DraftTraining`` module in its place: the loop sees a
model like any other (``forward(x, y)`` -> loss, ``log_keys``, the target's objective for its
batches), the optimizer sees the drafter's parameters only, and a checkpoint's weights are the
drafter's alone (the target is held outside the module tree). ``DrafterHooks`` writes the drafter's
config, the target it was trained for and its concept source into every checkpoint's
``ncpctl.json`` (``drafter``), which makes the checkpoint a drafter to ``generate --draft`` and
``eval --speculative``.

Data: each training window (T + 1 tokens) gives ``train.drafter.anchors`` anchors a per row, drawn
uniformly from the positions that have K tokens after the pending one: the target's states at
positions <= a are the context, x[a+1] the pending token, x[a+2 .. a+K+1] the K targets (next-K
tokens of the data, not the target's own outputs).

The loop's FLOPs accounting (MFU, a FLOPs budget) is the target's model config with no trained
parameter in it: the frozen target's forward; the drafter's own FLOPs are not counted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.inference.block_drafter import TargetTap, block_concepts, check_target, pool_blocks, predicted_terms
from ncpctl.model.designs.drafter.module import BlockDrafter, DrafterConfig
from ncpctl.model.core.outputs import LogKey, NCPOutput
from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import DesignHooks


def drafter_config(recipe: Recipe) -> DrafterConfig:
    """The drafter of ``train.drafter`` for the recipe's target (its model config)."""
    spec = recipe.train.drafter
    return DrafterConfig.for_target(
        recipe.model_config, target_layers=list(spec.layers or []), n_layers=spec.n_layers, k=spec.k,
        window=spec.window, concept_injection=spec.concept_injection, concept_source=spec.concept_source)


class DraftTraining(nn.Module):
    """The loop's model in the drafter stage: the frozen target (not a submodule) and the drafter."""

    def __init__(self, target: nn.Module, cfg: DrafterConfig, anchors: int, decay: float | None = None):
        super().__init__()
        why = check_target(target, cfg, "the drafter")
        if why:
            raise ValueError(why)
        self.held = [target.eval().requires_grad_(False)]  # outside the module tree: not saved, not optimised
        self.objective = target.objective
        self.drafter = BlockDrafter(cfg)
        self.draft_cfg, self.anchors = cfg, anchors
        w = torch.ones(cfg.k) if decay is None else torch.exp(-torch.arange(cfg.k, dtype=torch.float32) / decay)
        self.slot_weight = (w / w.sum()).tolist()  # (K,) sums to 1: the loss stays a mean CE
        self.tap = TargetTap(target, cfg.target_layers)

    @property
    def target(self) -> nn.Module:
        return self.held[0]

    def _apply(self, fn, *args, **kw):  # DeepSpeed's .to(device / dtype) reaches the target too
        self.held[0] = self.held[0]._apply(fn, *args, **kw)
        return super()._apply(fn, *args, **kw)

    def train(self, mode: bool = True) -> "DraftTraining":
        super().train(mode)
        self.target.eval()
        return self

    def forward(self, x: torch.Tensor, y: torch.Tensor, **_: Any) -> NCPOutput:
        """x, y (B, T) the objective's next-token batch -> the drafter's mean CE over K slots."""
        cfg = self.draft_cfg
        K, W = cfg.k, cfg.window
        seq = torch.cat([x, y[:, -1:]], 1)  # (B, T+1) the window
        B, T = x.shape
        with torch.no_grad():
            out = self.target(x, compute_logits=False)
            feats, h = self.tap.take()  # (B, T, L*d), (B, T, d)
        hi = T - 1 - K  # the last anchor with K targets after the pending token
        if hi < 0:
            raise ValueError(f"train.seq_len {T} is too short for {K} draft tokens")
        A = min(self.anchors, hi + 1)
        a = torch.rand(B, hi + 1, device=x.device).argsort(1)[:, :A]  # (B, A) distinct anchors per row
        ctx = a[..., None] - W + 1 + torch.arange(W, device=x.device)  # (B, A, W)
        valid = ctx >= 0
        f = feats.gather(1, ctx.clamp_min(0).view(B, -1, 1).expand(-1, -1, feats.shape[-1]))
        pend = seq.gather(1, a + 1)  # (B, A) the pending token
        x_emb = self.target.embed_tokens(pend, a + 1)
        c = None
        if cfg.concept_injection:
            per_block = (predicted_terms(self.target, out.concept.pred) if cfg.concept_source == "predicted"
                         else pool_blocks(h, cfg.concept_k))  # (B, M, d): what decoding reads
            c = block_concepts(per_block, a, cfg.concept_k).reshape(B * A, -1)
        hN = self.drafter(f.view(B * A, W, -1), ctx.view(B * A, W), valid.view(B * A, W),
                          x_emb.reshape(B * A, -1), c)  # (B*A, K, d)
        tgt = seq.gather(1, (a[..., None] + 2 + torch.arange(K, device=x.device)).view(B, -1)).view(B * A, K)
        logits = self.target.head(hN).float()  # (B*A, K, V)
        ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view(B * A, K)
        loss = (ce.mean(0) * ce.new_tensor(self.slot_weight)).sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == tgt).float()  # (B*A, K)
            run = hit.cumprod(1).sum(1)  # leading correct slots: what greedy verification accepts
        return NCPOutput(logits=None, loss=loss, losses={"draft_loss": ce.detach().mean()},
                         metrics={"draft_acc": hit.mean(), "draft_mal": (run + 1).mean()})

    def log_keys(self) -> list[LogKey]:
        return [LogKey("loss"), LogKey("draft_loss"), LogKey("draft_acc"), LogKey("draft_mal")]

    def stat_keys(self) -> list[str]:
        return []

    def on_step_begin(self, step: int) -> None:
        pass

    def on_step_end(self, stats: dict[str, float]) -> None:
        pass

    def attention_stats(self, idx, targets=None, **_: Any) -> dict[str, torch.Tensor]:
        return {}  # the target is frozen: its stability curves are its own run's

    uses_sample_ids = False


class DrafterHooks(DesignHooks):
    """The drafter's entry in ``ncpctl.json``: config (with its concept source), target, anchors."""

    with_drafter = True  # the drafter's own hooks

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        return recipe.train.drafter is not None

    def checkpoint_meta(self) -> dict[str, Any]:
        from ncpctl.checkpoint import resolve

        t = self.recipe.train
        return {"drafter": {"config": drafter_config(self.recipe).to_dict(), "target": t.init_from,
                            "target_checkpoint": str(resolve(t.init_from, pin_it=False)),
                            "anchors": t.drafter.anchors, "decay": t.drafter.decay, "data": "next-K tokens of the data"}}

"""Multi-token prediction (NCP-ArchPreview Sec. 5.2; the MTP of DeepSeek-V3 / Megatron-LM).

``model.mtp_depth`` = D extra prediction depths on top of the main model. Depth k (1-based)
predicts token t + k + 1 at position t from the previous depth's states and the embedding of the
token k ahead (teacher forcing):

    z_k[t] = proj_k(cat[norm_e(embed(x[t + k])), norm_h(h_{k-1}[t])])     (B, T - k, 2d) -> (B, T - k, d)
    h_k    = one transformer layer (causal) on z_k                          (B, T - k, d)
    loss_k = CE(lm_head(final_norm(h_k)), x[t + k + 1])                    the shared LM head

with h_0 the main model's final-norm states. The total loss adds ``weight * mean_k loss_k``
(ArchPreview: one depth, 0.3; ConceptLM Table 4's baseline predicts four future tokens: the main
head and three depths, ``recipes/ablations/table4-mtp.yaml``; the weight can follow
``mtp_weight_schedule``). A prediction whose shift would cross a document boundary (an
end-of-document token among x[t+1 .. t+k], ``mtp_stop_token``) is not scored. MTP runs in
training only: validation, evaluation, decoding and the export use the main head alone (its
per-depth loss and accuracy are logged as ``mtp_loss`` and ``mtp_acc``, the acceptance-rate proxy
for speculative decoding).
"""

from __future__ import annotations

import torch
from torch import nn

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.layers import Context, Stack, make_norm
from ncpctl.model.core.outputs import LogKey


class MTPDepth(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.norm_e, self.norm_h = make_norm(cfg, d), make_norm(cfg, d)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = Stack(cfg, [None], residual="plain")  # one full-attention layer

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, ctx: Context) -> torch.Tensor:
        return self.layer(self.proj(torch.cat([self.norm_e(emb), self.norm_h(h_prev)], dim=-1)), ctx)


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.depths = nn.ModuleList(MTPDepth(cfg) for _ in range(cfg.mtp_depth))
        self.weight = float(cfg.mtp_weight)

    def log_keys(self) -> list[LogKey]:
        return [LogKey("mtp_loss", train_only=True), LogKey("mtp_acc", len(self.depths), per="depth", train_only=True)]

    def on_step_begin(self, step: int) -> None:
        """The weight of the optimizer step about to run (0-based ``step``): the last
        ``mtp_weight_schedule`` entry [from_step, weight] reached, else ``mtp_weight``."""
        self.weight = float(self.cfg.mtp_weight)
        for start, weight in sorted(self.cfg.mtp_weight_schedule):
            if step >= start:
                self.weight = float(weight)

    def forward(self, h: torch.Tensor, targets: torch.Tensor, model,
                doc: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Main final-norm states h (B, T, d) and next-token targets (B, T) -> (mean loss over the
        depths, {"mtp_acc": (D,) top-1 accuracy per depth}). ``model`` lends its embedding, final
        norm and LM head (shared, as in DeepSeek-V3). ``doc`` (B, T): packed documents: each depth's
        layer attends inside a document at restarted positions, and position t is not scored at depth
        k when its fed token x[t + k] is another document's (as the main head, the position of a
        document's last token may still predict the next document's first token)."""
        B, T, _ = h.shape
        losses, accs = [], []
        prev, stop = h, self.cfg.mtp_stop_token
        crossing = None if stop is None else torch.cumsum((targets == stop).long(), dim=1)  # (B, T)
        for k, depth in enumerate(self.depths, start=1):
            n = T - k
            if n <= 0:
                break
            if doc is None:
                positions = torch.arange(n, device=h.device)[None]
                ctx = Context.causal(self.cfg, positions, [None], h.dtype)
            else:
                ctx, positions = Context.documents(self.cfg, doc[:, :n], [None], h.dtype)
            emb = model.embed_tokens(targets[:, k - 1 : k - 1 + n].clamp_min(0), positions)  # x[t + k]
            prev = depth(prev[:, :n], emb, ctx)  # (B, n, d)
            tgt = targets[:, k:].clone()  # x[t + k + 1]
            if crossing is not None:  # an end of document among x[t+1 .. t+k]: across documents
                before = torch.cat([crossing.new_zeros(B, 1), crossing[:, : n - 1]], dim=1)
                tgt[(crossing[:, k - 1 : k - 1 + n] - before) > 0] = -100
            if doc is not None:  # the fed token x[t + k] is in another document
                tgt[doc[:, k:] != doc[:, :n]] = -100
            _, loss, hits = model.head(model.final_norm(prev), tgt, top1=True)  # the shared head (muP: its logit divisor too)
            losses.append(loss)
            accs.append(hits / (tgt != -100).sum().clamp_min(1))  # top-1 accuracy of this depth
        if not losses:
            zero = h.new_zeros(())
            return zero, {"mtp_acc": h.new_zeros(len(self.depths))}
        acc = torch.stack(accs).float()
        if len(accs) < len(self.depths):
            acc = torch.cat([acc, acc.new_zeros(len(self.depths) - len(accs))])
        return torch.stack(losses).mean(), {"mtp_acc": acc}

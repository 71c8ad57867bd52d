"""``NCPModel``: the whole NCP model in one place (spec ncp-model.md sections 1-5).

tokens -> embed -> encoder (E layers) -> [concept path] -> decoder (D layers) -> final_norm
-> lm_head. Token layer i of the backbone is ``encoder[i]`` if i < E else ``decoder[i-E]``, so
HF weights map layer by layer. With ``concept.enabled`` false, E = 0, ``concept`` is None and
the model is exactly HF ``GPTNeoXForCausalLM`` / ``LlamaForCausalLM``.
"""

from __future__ import annotations

import torch
from torch import nn

from ncpctl.model import decode
from ncpctl.model.concept import ConceptModule
from ncpctl.model.config import ModelConfig
from ncpctl.model.head import LMHead
from ncpctl.model.outputs import LogKey, NCPOutput
from ncpctl.model.layers import (
    Block, RMSNorm, causal_masks, layer_window, make_norm, rope, run_stack, stack_windows,
)


class NCPModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.padded_vocab_size, d)
        blocks = [Block(cfg, layer_window(cfg, i + 1)) for i in range(cfg.n_token_layers)]
        E = cfg.encoder_layers
        self.encoder = nn.ModuleList(blocks[:E])
        self.decoder = nn.ModuleList(blocks[E:])
        self.concept = ConceptModule(cfg) if cfg.concept.enabled else None
        self.final_norm = make_norm(cfg, d)
        self.lm_head = LMHead(d, cfg.padded_vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) for matrices and embeddings, zero biases, unit norms (HF's init)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=self.cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if self.concept is not None:
            self.concept.codebook.reset_parameters()

    def token_layers(self) -> list[Block]:
        """Backbone token layers in order (encoder then decoder)."""
        return [*self.encoder, *self.decoder]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> NCPOutput:
        """idx (B, T) token ids; targets (B, T) next-token ids aligned with idx (targets[:, p]
        = x[p+1]), -100 = ignore. Returns logits (B, T, V) and, with targets, the losses."""
        cfg = self.cfg
        T = idx.shape[1]
        x = self.embed(idx)  # (B, T, d)
        cos, sin = rope(torch.arange(T, device=idx.device)[None], cfg, x.dtype)
        masks = causal_masks(stack_windows(self.token_layers()), T, idx.device)
        x = run_stack(self.encoder, x, cos, sin, masks)  # h (B, T, d)
        aux = None
        if self.concept is not None:
            x, aux = self.concept(x, losses=targets is not None)  # z (B, T, d)
        x = run_stack(self.decoder, x, cos, sin, masks)
        h = self.final_norm(x)  # (B, T, d)
        if targets is None:
            return NCPOutput(logits=self.lm_head(h), concept=aux)  # (B, T, V)
        logits, ntp = self.lm_head(h, targets)  # == F.cross_entropy(lm_head(h).float(), targets)
        out = NCPOutput(logits=logits, loss=ntp, losses={"ntp_loss": ntp}, concept=aux)
        if aux is not None:
            c = cfg.concept
            out.loss = ntp + c.ncp_weight * aux.ncp_loss + c.vq_weight * aux.vq_loss
            out.losses.update(ncp_loss=aux.ncp_loss, vq_loss=aux.vq_loss)
            for name in ("code_usage", "code_perplexity", "ncp_code_acc"):
                if getattr(aux, name) is not None:
                    out.metrics[name] = getattr(aux, name)
        return out

    # ---- what the training loop logs (declared once, the same on every rank) ----

    def log_keys(self) -> list[LogKey]:
        keys = [LogKey("loss"), LogKey("ntp_loss")]
        if self.concept is not None:
            S = self.cfg.n_segments
            keys += [LogKey("ncp_loss"), LogKey("vq_loss"), LogKey("code_perplexity", S),
                     LogKey("ncp_code_acc", S), LogKey("code_usage", S, per="segment")]
        return keys

    def stat_keys(self) -> list[str]:
        """Names of the per-step global statistics (``NCPOutput.stats``), in a fixed order."""
        return []

    def on_step_end(self, stats: dict[str, float]) -> None:
        """The per-step hook: ``stats`` are the totals of ``NCPOutput.stats`` over every
        micro-batch of the step on every rank (called on every rank after the step)."""

    # ---- incremental decoding (spec section 5; see decode.py) ----

    def prefill(self, tokens: torch.Tensor, lengths, max_len: int) -> tuple[torch.Tensor, decode.DecodeState]:
        """Left-padded prompts (B, Tp) with real ``lengths`` -> (logits (B, Tp, V), state)."""
        return decode.prefill(self, tokens, lengths, max_len)

    def decode_step(self, state: decode.DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per row (B,) -> next-token logits (B, V); advances ``state``."""
        return decode.step(self, state, tokens)

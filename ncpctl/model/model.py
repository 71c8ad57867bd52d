"""``NCPModel``: the whole NCP model in one place (spec ncp-model.md sections 1-5).

tokens -> embed -> encoder (E layers) -> [concept path] -> decoder (D layers) -> final_norm
-> lm_head. Token layer i of the backbone is ``encoder[i]`` if i < E else ``decoder[i-E]``, so
HF weights map layer by layer. With ``concept.enabled`` false, E = 0, ``concept`` is None and
the model is exactly HF ``GPTNeoXForCausalLM`` / ``LlamaForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ncpctl.model import decode
from ncpctl.model.concept import ConceptModule
from ncpctl.model.config import ModelConfig
from ncpctl.model.head import LMHead
from ncpctl.model.layers import (
    Block, RMSNorm, causal_masks, layer_window, make_norm, rope, run_stack, stack_windows,
)


@dataclass
class NCPOutput:
    """Forward result. Loss terms are None without ``targets``; concept terms None when off.

    Metrics are detached tensors (no host sync); ``.item()`` them when logging.
    """

    # (B, T, padded_vocab_size); None when a loss that will be differentiated is computed
    # (targets given, grad enabled): the fused LM head then reuses the logits' memory for
    # their gradient (head.py). Run under torch.no_grad() or without targets to get them.
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None  # ntp + alpha*ncp + beta_vq*vq
    ntp_loss: torch.Tensor | None = None
    ncp_loss: torch.Tensor | None = None
    vq_loss: torch.Tensor | None = None
    code_usage: torch.Tensor | None = None  # (S,) fraction of codes used per segment
    code_perplexity: torch.Tensor | None = None  # (S,) perplexity of code usage
    ncp_code_acc: torch.Tensor | None = None  # (S,) nearest code of pred == of the true next block
    pred: torch.Tensor | None = None  # (B, M, d) predicted next-block concepts


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
        pred = aux.pred if aux is not None else None
        if targets is None:
            return NCPOutput(logits=self.lm_head(h), pred=pred)  # (B, T, V)
        logits, ntp = self.lm_head(h, targets)  # == F.cross_entropy(lm_head(h).float(), targets)
        out = NCPOutput(logits=logits, pred=pred, ntp_loss=ntp, loss=ntp)
        if aux is not None:
            c = cfg.concept
            out.loss = out.ntp_loss + c.ncp_weight * aux.ncp_loss + c.vq_weight * aux.vq_loss
            out.ncp_loss, out.vq_loss = aux.ncp_loss, aux.vq_loss
            out.code_usage, out.code_perplexity = aux.code_usage, aux.code_perplexity
            out.ncp_code_acc = aux.ncp_code_acc
        return out

    # ---- incremental decoding (spec section 5; see decode.py) ----

    def prefill(self, tokens: torch.Tensor, lengths, max_len: int) -> tuple[torch.Tensor, decode.DecodeState]:
        """Left-padded prompts (B, Tp) with real ``lengths`` -> (logits (B, Tp, V), state)."""
        return decode.prefill(self, tokens, lengths, max_len)

    def decode_step(self, state: decode.DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per row (B,) -> next-token logits (B, V); advances ``state``."""
        return decode.step(self, state, tokens)

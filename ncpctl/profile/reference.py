"""A plain-PyTorch Pythia (GPT-NeoX) training step: the well-tuned loop ncpctl's is measured
against, side by side (issue 45 item 6; bench/gpu_check.py section 1's ``reference``).

nanoGPT's shape in one file, with what a well-tuned single-GPU loop does today: fp32 weights under
``torch.autocast`` bf16, SDPA with ``is_causal`` (a flash kernel), every block compiled with
``torch.compile`` (torchtitan's per-block compile), torch's fused AdamW, the gradient norm clipped
with ``foreach``, and the plain ``F.cross_entropy`` head. No DeepSpeed, no concept path, no
extension points. ``RefGPT.from_ncp`` copies the weights of an ncpctl base model of the ``neox``
family (Pythia's) into it: the two compute the same function (tests/profile/test_reference.py), so
"ours / reference" compares loops, not models.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


class RefBlock(nn.Module):
    """GPT-NeoX's parallel block: x + attn(ln1(x)) + mlp(ln2(x)), partial rotary embeddings."""

    def __init__(self, d: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)  # qkv rows: [q; k; v], each heads x hd
        self.fc, self.out = nn.Linear(d, ffn), nn.Linear(ffn, d)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, hd): its first rd = cos.shape[-1] dims rotated (HF's rotate_half form)."""
        rd = cos.shape[-1]
        r, rest = x[..., :rd], x[..., rd:]
        r1, r2 = r.chunk(2, dim=-1)
        return torch.cat([r * cos + torch.cat([-r2, r1], -1) * sin, rest], -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(self.rotate(q, cos, sin), self.rotate(k, cos, sin), v, is_causal=True)
        a = self.proj(y.transpose(1, 2).reshape(B, T, d))
        return self.out(F.gelu(self.fc(self.ln2(x)))) + a + x


class RefGPT(nn.Module):
    """Embedding, ``n_layers`` RefBlocks, the final LayerNorm and an untied bias-free LM head."""

    def __init__(self, cfg: Any):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.embed = nn.Embedding(cfg.padded_vocab_size, d)
        self.blocks = nn.ModuleList(RefBlock(d, cfg.n_heads, cfg.ffn_dim, cfg.norm_eps) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, cfg.padded_vocab_size, bias=False)
        rd = cfg.rotary_dim
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float), inv)
        emb = torch.cat([freqs, freqs], -1)  # (max_seq_len, rd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens x (B, T) -> the mean cross-entropy of targets y (B, T) (-100 ignored), or logits (B, T, V)."""
        T = x.shape[1]
        h = self.embed(x)
        cos, sin = self.cos[:T].to(h.dtype), self.sin[:T].to(h.dtype)
        for blk in self.blocks:
            h = blk(h, cos, sin)
        logits = self.head(self.norm(h))
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    @classmethod
    def from_ncp(cls, model: nn.Module) -> "RefGPT":
        """The same function as ``model``, an ncpctl base model (no concept path, plain residual, no
        bottleneck) of the neox family with fused [q; k; v] rows, parallel pre-norm blocks, biases."""
        from ncpctl.model.core.layers import MLP, PlainResidual

        cfg = model.cfg
        blocks = model.token_layers()
        plain = (model.concept is None and model.bottleneck is None and model.pos_embed is None and model.crc is None
                 and model.logit_divisor is None and cfg.parallel_residual and not cfg.tie_embeddings
                 and all(type(s.residual) is PlainResidual for s in (model.encoder, model.decoder))
                 and all(isinstance(b.attn_norm, nn.LayerNorm) and type(b.mlp) is MLP and not b.mlp.gated
                         and b.mlp.approximate == "none" and not b.post and b.cross is None and b.attn.clip is None
                         and not hasattr(b.attn, "q_norm") and b.attn.n_kv == b.attn.n_heads and b.attn.window is None
                         and b.attn.qkv.bias is not None for b in blocks))
        if not plain:  # read from the modules: a GPT-NeoX block is what the copy below assumes
            raise ValueError("the reference is a plain GPT-NeoX (Pythia): a neox base model without concepts")
        ref = cls(cfg)
        names = {"ln1": "attn_norm", "ln2": "mlp_norm", "qkv": "attn.qkv", "proj": "attn.proj", "fc": "mlp.fc",
                 "out": "mlp.proj"}
        ours = dict(model.state_dict())
        state = {"embed.weight": ours["embed.weight"], "norm.weight": ours["final_norm.weight"],
                 "norm.bias": ours["final_norm.bias"], "head.weight": ours["lm_head.weight"]}
        layers = [f"encoder.{i}" for i in range(len(model.encoder))] + [f"decoder.{i}" for i in range(len(model.decoder))]
        for i, src in enumerate(layers):
            for mine, theirs in names.items():
                for p in ("weight", "bias"):
                    state[f"blocks.{i}.{mine}.{p}"] = ours[f"{src}.{theirs}.{p}"]
        ref.load_state_dict(state)
        return ref


def reference_step(model: RefGPT, x: torch.Tensor, y: torch.Tensor, *, lr: float, clip: float, bf16: bool,
                   compile_backend: str | None) -> Callable[[], torch.Tensor]:
    """One optimizer step of the plain loop as a function returning the loss (detached, no host sync):
    autocast bf16 forward (``bf16``), backward, foreach clipping to ``clip``, fused AdamW (lr, betas
    and weight decay as Pythia's recipe: 0.9 / 0.95, 0.01 on matrices). ``compile_backend``: each
    block compiled in place with it (None: eager)."""
    from ncpctl.profile.step import adamw

    if compile_backend is not None:
        for blk in model.blocks:
            blk.compile(backend=compile_backend)
    decay = [p for p in model.parameters() if p.ndim >= 2 and p is not model.embed.weight]
    rest = [p for p in model.parameters() if not (p.ndim >= 2 and p is not model.embed.weight)]
    opt = adamw([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=lr,
                betas=(0.9, 0.95))
    params = list(model.parameters())
    dev = x.device.type

    def step() -> torch.Tensor:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step

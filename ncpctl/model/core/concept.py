"""The concept path (spec sections 1-3): segmentation, concept transformer, heads, codebook,
coupling, losses.

Shapes: B batch, T tokens, M concepts, d width, S segments of the codebook, N codes per
segment, ds = d / S segment width. Pooling is the segmenter's (segment.py; fixed blocks of k
tokens by default) and how the decoder uses the prediction is the coupling's (coupling.py);
this module owns what is common to every design: the concept transformer on the M-long
sequence, the S heads, the product-quantised codebook and the NCP/VQ losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.config import ModelConfig, strategy
from ncpctl.model.core.coupling import Coupling
from ncpctl.model.core.interventions import edit_code_weights
from ncpctl.model.core.layers import Context, Stack, document_masks, make_norm, rope
from ncpctl.model.core.outputs import LogKey
from ncpctl.model.core.segment import Segmenter, Segments, shift_blocks  # noqa: F401  (shift_blocks: re-exported)


class SegmentLinear(nn.Module):
    """S independent linears, one per codebook segment: x (S, N, i) -> (S, N, o); ``weight`` (S, o, i),
    ``bias`` (S, o). Each is initialised like ``nn.Linear``."""

    def __init__(self, S: int, i: int, o: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(S, o, i))
        self.bias = nn.Parameter(torch.empty(S, o)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for s in range(self.weight.shape[0]):  # nn.Linear's init, per segment (fan_in = i)
            nn.init.kaiming_uniform_(self.weight[s], a=math.sqrt(5))
            if self.bias is not None:
                nn.init.uniform_(self.bias[s], -self.weight.shape[2] ** -0.5, self.weight.shape[2] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight.transpose(1, 2))  # (S, N, o)
        return torch.baddbmm(self.bias[:, None], x, self.weight.transpose(1, 2))  # bias + x W^T: one kernel


class Codebook(nn.Module):
    """Product-quantised SimVQ codebook: codes = transform(base), (S, N, ds).

    ``base`` is a frozen Gaussian (std ds**-0.5), kept as a non-trainable Parameter so it is
    counted and saved; only ``transform`` trains: an MLP or a bias-free Linear
    (``concept.codebook_transform``), one shared by the segments or one per segment
    (``concept.codebook_per_segment``: ``SegmentLinear``s, the authors' one SimVQ per segment), its
    linears at ``nn.Sequential`` indices 0 and 2 either way. With ``codebook: learned`` the base
    itself is the trainable codebook and there is no transform.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = cfg.concept
        S, N, ds = cfg.n_segments, c.codes, cfg.segment_dim
        learned = c.codebook == "learned"
        self.base = nn.Parameter(torch.empty(S, N, ds), requires_grad=learned)
        self.transform = None
        if not learned:
            make = (lambda i, o, b: SegmentLinear(S, i, o, b)) if c.codebook_per_segment else nn.Linear
            layers = [make(i, o, b) for i, o, b in c.transform_layers(ds)]
            self.transform = nn.Sequential(*[m for lin in layers for m in (lin, nn.ReLU())][:-1])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # SimVQ: Gaussian codes of unit expected norm, projection with PyTorch's default init.
        nn.init.normal_(self.base, std=self.base.shape[-1] ** -0.5)
        if self.transform is not None:
            for m in self.transform:
                if not isinstance(m, nn.ReLU):
                    m.reset_parameters()

    @torch.no_grad()
    def zero_output(self) -> None:
        """Every code 0 (so the predicted concept is 0): the transform's last layer, or the base."""
        last = self.base if self.transform is None else self.transform[-1]
        for p in ([last] if isinstance(last, nn.Parameter) else last.parameters()):
            p.zero_()

    def forward(self) -> torch.Tensor:
        return self.base if self.transform is None else self.transform(self.base)  # (S, N, ds)


_ARANGES: dict = {}  # (n, device) -> 0..n-1


def constant_arange(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 on ``device``, made once per (n, device) and reused (a kernel per step otherwise). Not a
    buffer: a model built on the meta device and then loaded has no data for an unsaved buffer."""
    key = (n, str(device))
    if key not in _ARANGES:
        _ARANGES[key] = torch.arange(n, device=device)
    return _ARANGES[key]


_ONES: dict = {}  # (device, dtype) -> 1


def constant_one(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A scalar 1 on ``device``, made once (``expand`` it: a tensor of ones without a kernel)."""
    key = (str(device), dtype)
    if key not in _ONES:
        _ONES[key] = torch.ones((), device=device, dtype=dtype)
    return _ONES[key]


def nearest_code(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Index (B, M, S) of the nearest code per segment for x (B, M, d), codes (S, N, ds)."""
    B, M, _ = x.shape
    S, N, ds = codes.shape
    xs = x.reshape(B * M, S, ds).transpose(0, 1)  # (S, B M, ds), a view
    # ||x - e||^2 = ||x||^2 - 2 x.e + ||e||^2; ||x||^2 does not change the argmin. One batched GEMM
    # per segment adds the codes' norms and -2 x.e together.
    dist = torch.baddbmm(codes.pow(2).sum(-1)[:, None], xs, codes.transpose(1, 2), alpha=-2)  # (S, B M, N)
    return dist.argmin(-1).t().reshape(B, M, S)  # a view


@dataclass
class ConceptOutput:
    """What the concept path hands back: the decoder input and everything it was made of.

    ``z`` (B, T, d) decoder input; ``pred`` (B, M, d), pred[j] predicts concept j+1 from
    concepts 0..j (None when no concept closed); ``weights`` (B, M, S, N) the code weights
    pred is mixed from (after softmax and interventions: pred[j] = sum over n of
    weights[j, s, n] * codes[s, n] in segment s's slice of d); ``segments`` the pooled concepts
    c and their validity; ``losses`` unweighted terms, ``metrics`` detached, ``stats`` local
    sums for the per-step hook (outputs.py).
    """

    z: torch.Tensor
    pred: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    segments: Segments | None = None
    losses: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    states: list | None = None  # the concept stack's per-depth states, when asked for


def strategy_class(kind: str, name: str, base: type) -> type:
    cls = strategy(kind, name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{kind} {name!r}: {cls!r} is not a {base.__name__} subclass")
    return cls


def coupling_layer_factory(cfg: ModelConfig):
    """``i -> module or None``: the coupling's sub-layer of decoder block i (cross-attention)."""
    cls = strategy_class("coupling", cfg.concept.coupling, Coupling)
    return lambda i: cls.decoder_layer(cfg, i)


def _build(kind: str, name: str, base: type, cfg: ModelConfig) -> nn.Module:
    return strategy_class(kind, name, base)(cfg)


class ConceptModule(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c = cfg.concept
        self.cfg = cfg
        self.S, self.N = cfg.n_segments, c.codes
        self.segmenter = _build("segmentation", c.segmentation, Segmenter, cfg)
        # the concept transformer at its own width d_c (DLCM): W_up lifts the pooled (B, M, d) concepts
        self.ccfg = ccfg = cfg.concept_cfg
        dc = ccfg.d_model
        self.up = nn.Linear(cfg.d_model, dc, bias=cfg.bias) if dc != cfg.d_model else None
        self.layers = Stack(ccfg, cfg.concept_windows)
        # the norm before the heads (concept.head_norm; None: the heads read u itself)
        self.norm = make_norm(ccfg, dc) if c.head_norm else None
        # S per-segment heads fused into one matmul: (B, M, d_c) -> (B, M, S*N).
        self.heads = nn.Linear(dc, self.S * self.N, bias=cfg.bias if c.head_bias is None else c.head_bias)
        self.codebook = Codebook(cfg)
        self.coupling = _build("coupling", c.coupling, Coupling, cfg)
        # checkpoints before the coupling existed kept its norms here (concept.norm_h, .norm_pred)
        self.register_load_state_dict_pre_hook(_move_coupling_keys)

    # ---- pieces shared by the full forward and incremental decoding ----

    def lift(self, c: torch.Tensor) -> torch.Tensor:
        """Pooled concepts (B, M, d) -> the concept transformer's input (B, M, d_c) (W_up, DLCM Sec. 3.3.2)."""
        return c if self.up is None else self.up(c)

    def code_weights(self, u: torch.Tensor) -> torch.Tensor:
        """Concept-transformer output u (B, M, d_c) -> code weights w (B, M, S, N)."""
        B, M, _ = u.shape
        w = self.heads(u if self.norm is None else self.norm(u)).view(B, M, self.S, self.N)
        if self.cfg.concept.code_weights == "softmax":  # pred in the convex hull of each segment
            w = w.softmax(dim=-1)
        return w

    def mix(self, w: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Code weights w (B, M, S, N) x codes (S, N, ds) -> pred (B, M, d)."""
        B, M = w.shape[:2]
        return torch.einsum("bmsn,snd->bmsd", w, codes).reshape(B, M, -1)

    def predict(self, u: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Concept-transformer output u (B, M, d_c) -> pred (B, M, d) as a mix of codes."""
        return self.mix(self.code_weights(u), codes)

    def context(self, positions: torch.Tensor, dtype: torch.dtype, docs: torch.Tensor | None = None,
                limit: int | None = None) -> Context:
        """The concept stack's context for concepts at RoPE ``positions`` (B|1, M), unpadded, all
        below ``limit`` (the token count); with ``docs`` (B, M) (packed documents) attention stays
        inside each concept's document."""
        if docs is None:
            return Context.causal(self.ccfg, positions, self.cfg.concept_windows, dtype, limit=limit)
        cos, sin = rope(positions, self.ccfg, dtype, limit=limit)
        # boolean masks: M changes between batches under a data-dependent segmentation, and the
        # (B, 1, M, M) mask is small (M = T / k)
        return Context(cos, sin, document_masks(set(self.cfg.concept_windows), docs, flex=False))

    # ---- full-sequence forward ----

    def forward(self, h: torch.Tensor, losses: bool, interventions=(), states: bool = False,
                crc=None, enc_states: list | None = None, sample_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> ConceptOutput:
        """Encoder output h (B, T, d) -> ConceptOutput (decoder input z and the concept terms).

        ``crc`` (residual.CrossModules) with an encoder-concept connection pools every encoder
        depth ``enc_states`` (E + 1 of (B, T, d)) with the same segments and feeds them to the
        concept stack; ``states`` also returns the concept stack's depths (concept-decoder CRC);
        ``sample_ids`` (B,) global sample indices, for a segmenter whose sampling is keyed by them;
        ``doc_ids`` (B, T) packed documents: segments, the concept stack's attention and the shift
        stay inside each document (``Segments.docs``/``first``)."""
        seg, pooled = self.segment(h, enc_states if crc is not None and crc.has("encoder-concept") else None,
                                   sample_ids, doc_ids)
        out = ConceptOutput(z=h, segments=seg, losses=dict(seg.losses), metrics=dict(seg.metrics),
                            stats=dict(seg.stats))
        M = seg.concepts.shape[1]
        if M == 0:  # no complete concept: nothing to predict, nothing added
            out.z = self.coupling(h, None, seg, self.segmenter)
            if losses:
                zero = h.new_zeros(())
                out.losses.update(ncp_loss=zero, vq_loss=zero, commitment_loss=zero)
            return out
        ctx = self.context(seg.positions, h.dtype, seg.docs, limit=h.shape[1])
        if pooled is not None:
            ctx = crc.attach(ctx, [("encoder-concept", pooled)])
        if states:
            u, out.states = self.layers(self.lift(seg.concepts), ctx, states=True)
        else:
            u = self.layers(self.lift(seg.concepts), ctx)
        codes = self.codebook()  # (S, N, ds)
        w = self.code_weights(u)
        if interventions:
            w = edit_code_weights(interventions, w, torch.arange(M, device=h.device)[None])
        pred = self.mix(w, codes)  # (B, M, d); pred[j] predicts c[j+1]
        out.pred, out.weights = pred, w
        out.z = self.coupling(h, pred, seg, self.segmenter)
        if losses:
            self._losses(seg, pred, codes, out)
        return out

    def segment(self, h: torch.Tensor, depths: list | None, sample_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> tuple[Segments, list | None]:
        """Segments of h; with ``depths`` (a width-independent segmentation) every depth is pooled
        by the same segments in one pass: (segments of h, [pooled depth (B, M, d)])."""
        kw = {} if doc_ids is None else {"doc": doc_ids}  # packed documents (Segmenter.documents)
        if depths is None:
            if getattr(self.segmenter, "keyed", False):  # its sampling noise is keyed by the sample index
                return self.segmenter(h, sample_ids=sample_ids, **kw), None
            return self.segmenter(h, **kw), None
        seg = self.segmenter(torch.cat(depths, dim=-1), **kw)  # (B, M, K*d): h = depths[-1] comes last
        pooled = list(seg.concepts.chunk(len(depths), dim=-1))
        seg.concepts = pooled[-1]
        return seg, pooled

    def loss_weights(self) -> dict[str, float]:
        c = self.cfg.concept
        # the commitment term enters the total with L_VQ's weight, as when it was part of vq_loss
        return {"ncp_loss": c.ncp_weight, "vq_loss": c.vq_weight, "commitment_loss": c.vq_weight,
                **self.segmenter.loss_weights()}

    def log_keys(self) -> list[LogKey]:
        S = self.S
        keys = [LogKey("ncp_loss"), LogKey("vq_loss"), LogKey("commitment_loss"), *self.segmenter.log_keys()]
        return keys + [LogKey("ncp_rel"), LogKey("code_perplexity", S), LogKey("ncp_code_acc", S),
                       LogKey("code_usage", S, per="segment")]

    def _losses(self, seg: Segments, pred: torch.Tensor, codes: torch.Tensor, out: ConceptOutput) -> None:
        """NCP and VQ terms (ncp-model.md section 3), reduced as ``ncp_reduction`` / ``vq_reduction``
        say; concepts that ``seg.valid`` marks as padding count in neither (nor in the metrics).
        ``vq_loss`` is the codebook term alone (NCP-ArchPreview Eq. 21 with ``sum_segment``); the
        commitment term is ``commitment_loss``, logged apart."""
        cfg = self.cfg.concept
        c, valid = seg.concepts, seg.valid
        B, M, d = c.shape
        # NCP: predict the continuous pooled state of the next concept; the target is detached.
        pair = seg.pairs() if M >= 2 else None  # (B, M-1): both real, one document
        if M >= 2 and pair is None and cfg.ncp_reduction == "mean":  # the element mean: one kernel
            out.losses["ncp_loss"] = F.mse_loss(pred[:, :-1], c[:, 1:].detach())
        elif M >= 2:
            err = (pred[:, :-1] - c[:, 1:].detach()).pow(2)  # (B, M-1, d)
            out.losses["ncp_loss"] = self._reduce(err, pair, cfg.ncp_reduction)
        else:
            out.losses["ncp_loss"] = c.new_zeros(())
        # VQ on sg(c): trains only the codebook (the learned codes, or SimVQ's transform).
        # The nearest codes of c (the VQ target) and of pred (the next-code accuracy) in one search.
        cs = c.detach()
        both = nearest_code(torch.cat([cs, pred[:, :-1].detach()], 1), codes.detach())  # (B, 2M-1, S)
        idx, pred_idx = both[:, :M], both[:, M:]
        q = codes[constant_arange(self.S, c.device), idx].reshape(B, M, d)  # (B, M, d), grad -> codes
        if M >= 2:
            with torch.no_grad():  # ncp_rel: the term over the next concepts' own nearest codes' (same reduction)
                if pair is None and cfg.ncp_reduction == "mean":  # the element mean: one kernel
                    reach = F.mse_loss(q[:, 1:], cs[:, 1:])
                else:
                    reach = self._reduce((q[:, 1:] - cs[:, 1:]).pow(2), pair, cfg.ncp_reduction)
                # reach is 0 only if every next concept were exactly a code (it never is: inf then)
                out.metrics["ncp_rel"] = out.losses["ncp_loss"].detach() / reach
        if cfg.vq_reduction == "sum_segment":  # Eq. 21: 1/(M S) sum_m sum_s ||sg(c_m^s) - q_m^s||^2
            vq = self._reduce((q - cs).pow(2), valid, "sum_segment")
        elif valid is None:  # mean: the element mean (as F.mse_loss), ConceptLM
            vq = F.mse_loss(q, cs)
        else:
            m = valid[..., None].to(c.dtype)
            vq = ((q - cs) * m).pow(2).sum() / (valid.sum() * d).clamp_min(1)
        out.losses["vq_loss"] = vq
        # The commitment term commitment x ||c - sg(q)||^2, reduced alike: c is detached at the VQ
        # input, so it equals commitment x vq_loss exactly and has no gradient (Eq. 21 has none).
        out.losses["commitment_loss"] = cfg.commitment * vq.detach()
        with torch.no_grad():  # metrics as tensors: no host sync on the hot path
            self._code_metrics(idx, pred_idx, valid, out.metrics, pair)

    def _reduce(self, err: torch.Tensor, mask: torch.Tensor | None, how: str) -> torch.Tensor:
        """Squared errors err (B, M, d) -> one loss value: per concept the mean over d (``mean``),
        the sum over d (``sum_dim``) or the sum over each segment's d/S elements averaged over the
        S segments (``sum_segment`` = sum_dim / S); then the mean over the concepts ``mask`` (B, M)
        marks as real (all of them when None)."""
        if mask is None and how == "mean":
            return err.mean()
        per = err.mean(-1) if how == "mean" else err.sum(-1)  # (B, M)
        if how == "sum_segment":
            per = per / self.S
        if mask is None:
            return per.mean()
        return (per * mask).sum() / mask.sum().clamp_min(1)

    def _code_metrics(self, idx, pred_idx, valid, metrics: dict, pair=None) -> None:
        """Code usage and perplexity of the concepts' nearest codes idx (B, M, S), and how often
        pred's nearest code pred_idx (B, M-1, S) is the next concept's."""
        S, N = self.S, self.N
        counts = torch.zeros(S, N, device=idx.device)
        flat = idx.reshape(-1, S).t()  # (S, B*M)
        ones = constant_one(idx.device, counts.dtype).expand(flat.shape)  # a view: no kernel
        if valid is not None:
            ones = ones * valid.reshape(1, -1).to(counts.dtype)
        counts.scatter_add_(1, flat, ones)  # (S, N) hits per code
        metrics["code_usage"] = counts.count_nonzero(-1) / N
        # every concept hits one code per segment: without padding the total is known here
        p = counts / (flat.shape[1] if valid is None else counts.sum(-1, keepdim=True).clamp_min(1))
        metrics["code_perplexity"] = torch.special.entr(p).sum(-1).exp()  # exp(-sum p log p), 0 log 0 = 0
        if idx.shape[1] >= 2:
            hit = pred_idx == idx[:, 1:]  # (B, M-1, S)
            if pair is None:
                metrics["ncp_code_acc"] = hit.mean(dim=(0, 1), dtype=torch.float32)
            else:
                hit = hit.float()
                pair = pair[..., None].float()
                metrics["ncp_code_acc"] = (hit * pair).sum((0, 1)) / pair.sum((0, 1)).clamp_min(1)


def _move_coupling_keys(module, state_dict, prefix, *args) -> None:
    for name in ("norm_h", "norm_pred"):
        old = f"{prefix}{name}."
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[f"{prefix}coupling.{name}." + key[len(old):]] = state_dict.pop(key)

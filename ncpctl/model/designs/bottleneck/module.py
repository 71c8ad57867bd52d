"""Steerling's additive concept bottleneck (``model.bottleneck``; shared/papers/004, Fig. 16).

Between the final norm and the linear LM head, the final-norm state h (B, T, d) is decomposed
exactly into known (labelled) concepts, unknown concepts and a residual:

    k     = sigmoid(f(h))            (B, T, n)   f = ``known``: Linear(d, n); optional top-k per token
    k_hat = k @ K                    (B, T, d)   K: (n, d), the known concepts' embeddings
    u     = sigmoid(g(sg(h)))        (B, T, m)   g = ``unknown``: Linear(d, m) (or d -> r -> m); optional top-k
    u_hat = (u @ A) @ B              (B, T, d)   U = A B: A (m, r), B (r, d)
    e     = h - k_hat - sg(u_hat)    (B, T, d)   not detached: the residual is what is left of h
    h_bar = k_hat + sg(u_hat) + drop(e)          = h + (drop(e) - e); the LM head reads h_bar

``drop`` is inverted dropout (``dropout``; Steerling 0.1, mid-training 0.3) in training only:
outside training, and with dropout 0, h_bar IS h (bitwise), so the bottleneck never changes an
evaluation's logits, decoding or the export's numbers; it makes every logit an exact sum of
concept terms, logit_y = k K W_y + u U W_y + e W_y (``attribute``). The training signal comes from
dropping e: the LM gradient reaches k_hat as (1 - mask / (1 - p)), and the dropout noise on e
costs loss, which pushes k_hat + u_hat toward h so that the concepts carry the signal.

The unknown head reads sg(h) and the LM reads sg(u_hat) (as Steerling's public code composes
them): the unknown part learns from the reconstruction and independence losses only, and cannot
open a second uninterpretable channel for the LM. K and f learn from the LM, the concept loss and
the independence penalty.

Labels ``(B, T, n)``: L[b, t, c] = 1 iff token t carries evidence of concept c. Chunks are
``chunk`` tokens from position 0 (a trailing partial chunk is a chunk).

* concept loss: BCE of the chunk's OR aggregation k_chunk = 1 - prod_t (1 - k_t) (from the dense
  logits, before top-k) against the chunk label (OR of its tokens' labels), in log space:
  log(1 - k_chunk) = sum_t logsigmoid(-z_t); mean over rows, chunks and concepts.
* causal labels: at token t, concept c is known-true iff a token s <= t of t's chunk carries c
  (the cumulative OR within the chunk). The reconstruction target and the steering stage's
  injection slots use them; teacher forcing does not feed them, since which concepts a token
  carries is decided by the whole document (a comprehension is labelled from its opening ``[``,
  ``file_io`` from the ``f`` of ``fh.read()``).
* fed labels (``fed_labels``): what teacher forcing may feed token t of chunk j, the labels of the
  chunk that closed before t: chunk j-1's label (the OR of its tokens), none in chunk 0. Labels at
  or after chunk j's first token never reach t's input, so nothing a later token decided does.
* teacher forcing (training only, labels given): with probability alpha per (row, chunk), that
  chunk's k is replaced by its fed labels (all n concepts); alpha anneals linearly from
  ``teacher_forcing_start`` to ``teacher_forcing_end`` over ``teacher_forcing_steps`` optimizer steps.
  Document-level labels (a name on every token of a document) cannot be fed causally: training
  refuses teacher forcing on a dataset that has them (``labels.document_level`` in its meta.json).
* reconstruction: mean squared error of u_hat toward sg(h - k_true K), k_true the causal labels
  (without labels: toward sg(h - k_hat), what the known part leaves).
* independence: ||Cov(k_hat, u_hat)||_F^2, the squared Frobenius norm of the batch cross-covariance
  (d, d) over all B*T tokens (linear HSIC); ``known_unknown_residual`` adds ||Cov(u_hat, e)||_F^2 with
  e = sg(h) - k_hat - u_hat (mid-training).

On the Causal Diffusion LM (``objective: causal_diffusion``; its hooks ``concept_positions`` and
``fed_labels``, objective.py) chunks lie inside the diffusion blocks (``chunk`` divides ``block_size``;
Steerling: both 64), and, as in Steerling, the concept readout is trained where the model predicts:
* concept loss and ``detection_auc``: the OR over each chunk's MASKED tokens against the OR of those
  tokens' labels; a chunk without a masked token contributes nothing (bottleneck_positions.py);
* fed labels: token t of block j is fed its OWN block's label (the OR of block j's tokens), the one
  exception to "fed labels never reveal the future": the block is the unit of generation, decided
  jointly; the labels of later blocks never reach it;
* the steering stage injects at masked positions only (Steerling's ``_position_injection``), those
  whose chunk's label over its masked tokens carries the drawn concept.

Metric ``concept_share``: for the scored token y of each position (the target in a training or
validation forward), (|k_hat.W_y| + |u_hat.W_y|) / (|k_hat.W_y| + |u_hat.W_y| + |e.W_y|), the
concepts' share of the logit magnitude (Steerling's 0.62 -> 0.85; the residual carries the rest),
averaged over positions. ``detection_auc`` scores held-out chunk labels. ``respond_loss`` and
``express_loss`` are Steerling's steering-stage terms, for a stage that injects directions
(``concept_direction``). The MTP head (training only) reads the final-norm states, not h_bar.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ncpctl.model.core.config import ModelConfig
from ncpctl.model.core.outputs import LogKey
from ncpctl.model.designs.bottleneck.chunks import causal_labels, chunk_bce, chunk_bce_at, chunk_mask, held_at
from ncpctl.model.designs.bottleneck.sparse import Attribution, attribute, clamped, known_top, unknown_top

LOSSES = ("concept_loss", "reconstruction_loss", "independence_loss")
STEERING_LOSSES = ("respond_loss", "express_loss")


@dataclass
class Injection:
    """A steering stage's injection into one training forward (``ConceptBottleneck.injection``):
    row b gets ``vector[b]`` (B, d) added at the site ``bottleneck.steer_at`` on the token slots
    ``where[b]`` (B, T) bool, all False for a row without one; ``concept`` (B,) long, its concept."""

    concept: torch.Tensor
    where: torch.Tensor
    vector: torch.Tensor


@dataclass
class BottleneckOutput:
    """The parts of one forward's decomposition (B, T, ...) and its loss terms.

    ``h_bar`` is what the LM head read and ``e`` the residual term in it (dropped out in training),
    so that h_bar = k_hat + u_hat + e + steer holds in every mode, ``steer`` (B, T, d) the readout
    steering added after the bottleneck (``AddToReadout``; None without); ``k`` the known
    activations k_hat is made of (after top-k and teacher forcing), ``k_logits`` f(h) (dense,
    before top-k). A forward without gradients on a top-k head keeps that head sparse
    (bottleneck_sparse.py): ``k``, ``k_logits`` (or ``u``) None, and ``k_index`` / ``k_value`` (or
    ``u_index`` / ``u_value``) (B, T, top-k) its selected concepts and their activations instead."""

    h_bar: torch.Tensor
    k: torch.Tensor  # (B, T, n)
    k_logits: torch.Tensor  # (B, T, n)
    u: torch.Tensor  # (B, T, m)
    k_hat: torch.Tensor  # (B, T, d)
    u_hat: torch.Tensor  # (B, T, d)
    e: torch.Tensor  # (B, T, d)
    steer: torch.Tensor | None = None  # (B, T, d): readout steering (NCPModel.forward sets it)
    positions: torch.Tensor | None = None  # (B, T) bool: where the concept readout is scored (None: everywhere)
    k_index: torch.Tensor | None = None  # (B, T, top_k_known) long: a sparse known head's concepts
    k_value: torch.Tensor | None = None  # (B, T, top_k_known): their activations
    u_index: torch.Tensor | None = None  # (B, T, top_k_unknown) long: a sparse unknown head's concepts
    u_value: torch.Tensor | None = None  # (B, T, top_k_unknown): their activations
    losses: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


class ConceptBottleneck(nn.Module):
    owns_init = True  # NCPModel.init_weights leaves it to reset_parameters (K, A, B, the prior bias)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b = self.bcfg = cfg.bottleneck
        d, n, m, r = cfg.d_model, b.concepts, cfg.bottleneck_unknown, cfg.bottleneck_rank
        self.n, self.m, self.init_std, self.vocab_size = n, m, cfg.init_std, cfg.vocab_size
        self.known = nn.Linear(d, n, bias=b.bias)  # f
        self.K = nn.Parameter(torch.empty(n, d))
        # g: dense, or factorised through the rank r of U (unknown_head: low_rank)
        self.unknown = nn.Linear(d, m, bias=b.bias) if b.unknown_head == "dense" else \
            nn.Sequential(nn.Linear(d, r, bias=False), nn.Linear(r, m, bias=b.bias))
        self.A = nn.Parameter(torch.empty(m, r))
        self.B = nn.Parameter(torch.empty(r, d))
        self.alpha = float(b.teacher_forcing_start)  # the teacher-forcing probability of this step
        # the steering stage's lift tokens T_c (n, L) long, -1 = none: set by the training loop from the
        # train split's labels (ncpctl.data.labels.lift_tokens) before training; derived from the data
        # on every start, so it is not a weight (not in the state dict)
        self.register_buffer("lift", torch.full((n, 0), -1, dtype=torch.long), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        unknown = [m for m in self.unknown.modules() if isinstance(m, nn.Linear)]
        for p in (self.known.weight, *(m.weight for m in unknown), self.K, self.A, self.B):
            nn.init.normal_(p, std=self.init_std)
        # known prior: each token's k = ln2 / chunk, so a chunk's OR starts near 1/2 (a bias of 0,
        # k = 1/2 per token, would start every chunk at 1 - 2^-chunk: a huge loss on the negatives)
        q = math.log(2) / self.bcfg.chunk
        if self.known.bias is not None:
            nn.init.constant_(self.known.bias, math.log(q / (1 - q)))
        if unknown[-1].bias is not None:
            nn.init.zeros_(unknown[-1].bias)

    # ---- the schedule and what the loop logs ----

    def on_step_begin(self, step: int) -> None:
        b = self.bcfg
        frac = 1.0 if b.teacher_forcing_steps == 0 else min(1.0, step / b.teacher_forcing_steps)
        self.alpha = float(b.teacher_forcing_start + (b.teacher_forcing_end - b.teacher_forcing_start) * frac)

    def loss_weights(self) -> dict[str, float]:
        b = self.bcfg
        return {"concept_loss": b.concept_weight, "reconstruction_loss": b.reconstruction_weight,
                "independence_loss": b.independence_weight, "respond_loss": b.respond_weight,
                "express_loss": b.express_weight}

    def external_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """What the model's forward reads outside this module's own forward (ZeRO-3 must gather
        them there too, ``ncpctl.train.engine``): the LM head's weight (the concept share, the
        steering stage's gamma) and K (the steering stage's direction)."""
        return [model.lm_head.weight, self.K]

    @property
    def steering(self) -> bool:
        """Whether training runs a steering stage (respond or express weight above 0)."""
        return self.bcfg.respond_weight > 0 or self.bcfg.express_weight > 0

    def log_keys(self) -> list[LogKey]:
        steer = [LogKey(name, train_only=True) for name in STEERING_LOSSES] if self.steering else []
        return [*(LogKey(name) for name in LOSSES), LogKey("concept_share"),
                LogKey("teacher_forcing", train_only=True), *steer]

    # ---- the steering stage (Steerling's mid-training) ----

    def injection(self, labels: torch.Tensor, logit_weight: torch.Tensor,
                  positions: torch.Tensor | None = None) -> Injection | None:
        """The steering stage's injection for a training batch with labels (B, T, n): with
        probability ``steer_fraction`` a row draws one concept c among those its causal labels
        carry and gets gamma * K_c / ||K_c|| at the slots where c is known-true causally (a token
        of its chunk at or before t carries c: the text there is about c), gamma = steer_strength
        / peak(W_lm e_c) (nominal logit units). The direction and gamma are constants (no
        gradient into K or the head through the injection). None outside a steering stage.
        ``positions`` (B, T) bool (the objective's ``concept_positions``; None: all): the slots are
        those positions whose chunk's label over its positions carries c (``held_at``)."""
        if not (self.training and self.steering):
            return None
        b = self.bcfg

        causal = causal_labels(labels, b.chunk) > 0 if positions is None else held_at(labels, b.chunk, positions)
        present = causal.any(dim=1)  # (B, n)
        B = labels.shape[0]
        draw = torch.rand(B, self.n, device=labels.device).masked_fill(~present, -1.0)
        concept = draw.argmax(dim=-1)  # (B,) uniform among the present concepts
        on = present.any(dim=1) & (torch.rand(B, device=labels.device) < b.steer_fraction)
        where = causal[torch.arange(B, device=labels.device), :, concept] & on[:, None]  # (B, T)
        e = self.K.detach()[concept]
        e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (B, d)
        peak = head_response(logit_weight, e, self.vocab_size)[1].clamp_min(1e-6)  # (B,), as generate's gamma
        vector = ((b.steer_strength / peak)[:, None] * e.float()).to(e.dtype)
        return Injection(concept=torch.where(on, concept, -1), where=where, vector=vector)

    def steering_losses(self, parts: BottleneckOutput, inj: Injection, h_bar: torch.Tensor, head) -> dict:
        """L_respond and L_express of one injected forward; ``head`` maps (K, d) states to (K, V)
        logits (the model's ``head``). Both are 0 (with a gradient path) when nothing was injected."""
        out = {"respond_loss": respond_loss(parts.k_logits, inj.concept.clamp_min(0), inj.where)}
        if self.bcfg.express_weight > 0:
            if self.lift.shape[1] == 0:
                raise ValueError("bottleneck.express_weight > 0 but no lift tokens were set (ConceptBottleneck.lift: "
                                 "the training loop derives them from the train split's labels)")
            rows = inj.where.nonzero()[:, 0]  # (K,) the row of each injected slot
            # (K, V): only the injected slots' logits. Injected at the readout, the logits are
            # W (h + v) = W h + W v (the head is linear, no bias): L_express takes its value from them
            # and its gradient from W v alone (straight through the rest), so it teaches the head to
            # express the injected direction and nothing else. Through W h or the network it would
            # teach every labelled position to favour the lift tokens, injected or not (measured on
            # debug-bottleneck, 90 steps: validation NTP 5.39 -> 5.97 through everything, unsteered
            # concept score 0.067 -> 0.164 through W h)
            hs = h_bar[inj.where]
            if self.bcfg.steer_at == "readout":
                wv = head(inj.vector[rows])
                logits = head(hs).detach() + wv - wv.detach()
            else:
                logits = head(hs)
            lift = self.lift[inj.concept[rows]]  # (K, L)
            out["express_loss"] = express_loss(logits, lift, (lift >= 0).any(-1))
        return out

    # ---- the decomposition ----

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, *, losses: bool = False,
                positions: torch.Tensor | None = None, feed=None, dense: bool = False) -> dict:
        """Final-norm states h (B, T, d), labels (B, T, n) or None -> the parts as a dict of
        ``BottleneckOutput``'s fields (``parts``); ``losses``: the loss terms too (labels-free ones
        only without labels). A dict, not the dataclass: ZeRO-3 finds the tensors a module returns
        (to gather K, A and B again for their backward) in tuples, lists and dicts only. ``positions``
        (B, T) bool: where the concept loss reads (None: all); ``feed(labels, chunk)``: teacher
        forcing's labels (None: ``fed_labels``): the objective's hooks (module docstring); ``dense``: keep
        the known head dense (its logits for a report) in a forward without gradients."""
        out = self.parts(h, labels, losses=losses, positions=positions, feed=feed, dense=dense)
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}

    def parts(self, h: torch.Tensor, labels: torch.Tensor | None = None, *, losses: bool = False,
              positions: torch.Tensor | None = None, feed=None, dense: bool = False) -> BottleneckOutput:
        """``forward``'s computation, as a ``BottleneckOutput`` (call the module, not this, in a
        training forward: ZeRO-3's hooks are on the module call)."""
        b = self.bcfg
        causal = None
        if labels is not None:
            if labels.shape != (*h.shape[:2], self.n):
                raise ValueError(f"concept_labels must be (B, T, n) = {(*h.shape[:2], self.n)}, got {tuple(labels.shape)}")
            causal = causal_labels(labels, b.chunk).to(h.dtype)
        # without gradients a top-k head streams its concepts and keeps the top-k (bottleneck_sparse.py);
        # the known head stays dense where its logits are read (labels: the concept loss; ``dense``)
        sparse = not torch.is_grad_enabled()
        kn = self._known_part(h, labels, causal, feed, sparse and not dense and labels is None)
        hd = h.detach()
        un = self._unknown_part(hd, sparse)
        k_hat, u_hat = kn["k_hat"], un["u_hat"]
        e = h - k_hat - u_hat.detach()
        if self.training and b.dropout > 0:
            dropped = F.dropout(e, b.dropout, training=True)
            h_bar = h + (dropped - e)  # = k_hat + sg(u_hat) + dropped
        else:
            dropped, h_bar = e, h  # exactly h: the decomposition is exact by construction
        out = BottleneckOutput(h_bar=h_bar, e=dropped, positions=positions, **kn, **un)
        if self.training:
            out.metrics["teacher_forcing"] = h.new_tensor(self.alpha if causal is not None else 0.0)
        if losses:
            self._losses(out, out.k_logits, hd, labels, causal)
        return out

    def _known_part(self, h: torch.Tensor, labels, causal, feed, sparse: bool) -> dict:
        """The known head's fields of ``BottleneckOutput``: k = sigmoid(f(h)) (top-k), k_hat = k K."""

        b = self.bcfg
        if sparse and b.top_k_known is not None:
            k_hat, idx, act = known_top(h, self.known, self.K, b.top_k_known, b.logit_clamp)
            return {"k": None, "k_logits": None, "k_hat": k_hat, "k_index": idx, "k_value": act}
        z = clamped(self.known(h), b.logit_clamp)  # (B, T, n)
        k = top_k(torch.sigmoid(z), b.top_k_known)
        if self.training and causal is not None and self.alpha > 0:  # never a label decided at or after t
            fed = (feed or fed_labels)(labels, b.chunk).to(h.dtype)
            k = torch.where(chunk_mask(h.shape[0], h.shape[1], b.chunk, self.alpha, h.device), fed, k)
        return {"k": k, "k_logits": z, "k_hat": k @ self.K}  # k_hat (B, T, d)

    def _unknown_part(self, hd: torch.Tensor, sparse: bool) -> dict:
        """The unknown head's fields: u = sigmoid(g(sg(h))) (top-k), u_hat = (u A) B."""

        b = self.bcfg
        if sparse and b.top_k_unknown is not None:
            u_hat, idx, act = unknown_top(hd, self.unknown, self.A, self.B, b.top_k_unknown, b.logit_clamp)
            return {"u": None, "u_hat": u_hat, "u_index": idx, "u_value": act}
        u = top_k(torch.sigmoid(clamped(self.unknown(hd), b.logit_clamp)), b.top_k_unknown)  # (B, T, m)
        return {"u": u, "u_hat": (u @ self.A) @ self.B}  # u_hat (B, T, d)

    def _losses(self, out: BottleneckOutput, z, hd, labels, causal) -> None:

        b = self.bcfg
        if labels is not None:
            out.losses["concept_loss"] = chunk_bce(z, labels, b.chunk) if out.positions is None else \
                chunk_bce_at(z, labels, b.chunk, out.positions)
            target = hd - causal @ self.K.detach()  # h - k_true K
        else:
            target = hd - out.k_hat.detach()
        out.losses["reconstruction_loss"] = F.mse_loss(out.u_hat.float(), target.float())
        indep = cross_covariance(out.k_hat, out.u_hat)
        if b.independence == "known_unknown_residual":
            indep = indep + cross_covariance(out.u_hat, hd - out.k_hat - out.u_hat)
        out.losses["independence_loss"] = indep

    # ---- reading it: attribution, share, steering ----

    def attribute(self, parts: BottleneckOutput, lm_head_weight: torch.Tensor, token_ids: torch.Tensor,
                  per_concept: bool = True) -> Attribution:
        """Exact attribution of the logits of ``token_ids`` (B, T) (e.g. the argmax) to the parts
        of one forward (``NCPModel.forward(..., return_bottleneck=True).bottleneck``), readout
        steering its own term; ``lm_head_weight`` (V, d): ``model.logit_weight``. ``per_concept``
        False skips the (B, T, n) per-concept terms (None then).

        Computed in fp32 whatever the forward's dtype (k_hat = k K again in fp32): the residual is
        e = h_bar - k_hat - u_hat - steer of the h_bar the head read, so the terms sum to W_y . h_bar
        in fp32 (1e-5 relative); a bf16 forward's own logit differs from that by its rounding to
        bf16 (2^-8 relative). ``per_unknown``: the same terms of the top unknown concepts (u_j (U_j . W_y));
        a sparse head's terms are over its top-k concepts (``known_index``, ``unknown_index``)."""

        return attribute(self, parts, lm_head_weight, token_ids, per_concept)

    @torch.no_grad()
    def share(self, parts: BottleneckOutput, lm_head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean concept share over the positions whose target is not ignored (-100)."""
        keep = targets != -100
        att = self.attribute(parts, lm_head_weight, targets.clamp_min(0), per_concept=False)
        return (att.share * keep).sum() / keep.sum().clamp_min(1)

    def concept_direction(self, index: int) -> torch.Tensor:
        """The steering direction of known concept ``index``: K_c / ||K_c||, (d,)."""
        if not 0 <= index < self.n:
            raise IndexError(f"known concept {index} is out of range (the bottleneck has {self.n})")
        v = self.K[index].detach()
        return v / v.norm().clamp_min(1e-12)


def head_response(logit_weight: torch.Tensor, direction: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_lm . e/||e|| of direction(s) (..., d) over the real vocabulary (the first ``vocab_size`` rows
    of the (V_padded, d) ``logit_weight``: padded rows are no token and never sampled), in fp32: (the
    response (..., vocab_size), its peak (...,)). The one definition of a steering strength's units,
    gamma = strength / peak, in the steering stage (``injection``) and in ``generate --steer``
    (ncpctl.interpret.steer)."""
    unit = direction.detach().float()
    unit = unit / unit.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    resp = unit @ logit_weight.detach()[:vocab_size].float().t()
    return resp, resp.amax(dim=-1)


def top_k(x: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the k largest entries of the last dimension, zero the rest (None: dense)."""
    if k is None or k >= x.shape[-1]:
        return x
    v, i = x.topk(k, dim=-1)
    return torch.zeros_like(x).scatter(-1, i, v)


def cross_covariance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||Cov(x, y)||_F^2 of (B, T, d) x (B, T, d'), the covariance over all B*T tokens (fp32)."""
    with torch.autocast(x.device.type, enabled=False):  # a sum of d^2 small squares: fp32, not bf16
        xs, ys = x.reshape(-1, x.shape[-1]).float(), y.reshape(-1, y.shape[-1]).float()
        xs, ys = xs - xs.mean(0), ys - ys.mean(0)
        cov = xs.t() @ ys / max(xs.shape[0], 1)  # (d, d')
        return cov.pow(2).sum()


# ---- Steerling's steering-stage losses (mid-training; a stage that injects directions uses them) ----


def respond_loss(k_logits: torch.Tensor, concept: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """L_respond = -1/|I| sum_{t in I} log k_{c,t}: known concept ``concept``'s activation pushed to 1
    at the positions ``positions`` (B, T) bool where its direction was injected; k_logits (B, T, n);
    ``concept`` one index or one per row (B,)."""
    if isinstance(concept, int):
        z = k_logits[..., concept]
    else:
        z = k_logits.gather(-1, concept[:, None, None].expand(*k_logits.shape[:2], 1))[..., 0]
    return -(F.logsigmoid(z.float()) * positions).sum() / positions.sum().clamp_min(1)


def express_loss(logits: torch.Tensor, lift_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """L_express = -1/|I| sum_{t in I} log sum_{y in T_c} p(y | t): the probability of the concept's lift
    tokens raised at ``positions`` (...) bool; logits (..., V); ``lift_tokens`` ids (L,) for all
    positions or (..., L) per position, -1 = no token (a concept with fewer than L)."""
    logp = logits.float().log_softmax(-1)
    lift = lift_tokens.expand(*logp.shape[:-1], lift_tokens.shape[-1])
    picked = logp.gather(-1, lift.clamp_min(0)).masked_fill(lift < 0, float("-inf")).logsumexp(-1)
    picked = torch.where(positions, picked, torch.zeros_like(picked))  # no -inf outside I
    return -(picked * positions).sum() / positions.sum().clamp_min(1)


def detection_auc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Rank-based ROC AUC (Mann-Whitney U, ties at their mean rank) of ``scores`` against binary
    ``labels`` of one shape, pooled over every element (e.g. chunks x concepts: ``chunk_probs``
    against ``chunk_labels``). NaN when the labels hold only one class."""
    s, y = scores.detach().reshape(-1).double(), labels.reshape(-1).bool()
    P = int(y.sum())
    N = y.numel() - P
    if P == 0 or N == 0:
        return torch.tensor(float("nan"))
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # 1-based mean rank of each distinct value
    rank_sum = mean_rank[inverse][y].sum()
    return (rank_sum - P * (P + 1) / 2) / (P * N)


def _weighted_auc(s: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rank AUC of scores s (N,) against labels y (N,) bool under R weightings w (N, R) of the
    items (a bootstrap's counts; ones: ``detection_auc``), ties counted one half: (R,) in w's
    dtype, NaN where a weighting leaves no positive or no negative."""
    _, group = torch.unique(s.double(), return_inverse=True)  # ascending distinct scores
    G, R = (int(group.max()) + 1 if group.numel() else 0), w.shape[1]
    pos = w.new_zeros(G, R).index_add_(0, group[y], w[y])  # (G, R): each score's positive weight
    neg = w.new_zeros(G, R).index_add_(0, group[~y], w[~y])
    below = neg.cumsum(0) - neg  # the negatives' weight strictly below each score
    P, N = pos.sum(0), neg.sum(0)
    auc = (pos * (below + 0.5 * neg)).sum(0) / (P * N)
    return torch.where((P > 0) & (N > 0), auc, torch.full_like(auc, float("nan")))


BOOTSTRAP_CELLS = 2e9  # the most (resample, chunk, concept) cells one interval may touch


def concept_auc(scores: torch.Tensor, labels: torch.Tensor, *, resamples: int = 400, seed: int = 0) -> dict:
    """Held-out concept detection of chunk scores (N, n) against chunk labels (N, n), as the
    validation record's keys:

    * ``concept_auc``: the per-concept (macro) AUC, the mean over the concepts with both positive and
      negative chunks in the split (``concept_auc_concepts`` of them; ``concept_auc_skipped`` lack one
      class), with a percentile bootstrap 95% interval over chunks (``concept_auc_low``,
      ``concept_auc_high``): ``resamples`` resamples of the chunks (fewer when resamples x N x
      concepts would pass ``BOOTSTRAP_CELLS``; at least 50), seeded, so the same split gives the
      same interval; a resample that loses a concept's positives or negatives skips it there;
    * ``concept_auc_pooled``: the AUC pooled over every (chunk, concept) pair (``detection_auc``), which
      rewards knowing which concepts are common at all, and ``concept_auc_pooled_base_rate``: the same
      pooled AUC of a constant per-concept score (each concept's positive rate in the split) that
      ignores the input, to read it against (0.885 on debug-bottleneck.yaml's validation chunks).

    NaN where nothing can be scored."""
    s, y = scores.detach().double().reshape(-1, scores.shape[-1]), labels.reshape(-1, labels.shape[-1]).bool()
    N, n = s.shape
    cols = (y.any(0) & (~y).any(0)).nonzero()[:, 0].tolist()  # concepts with a positive and a negative chunk
    macro = float(torch.stack([detection_auc(s[:, c], y[:, c]) for c in cols]).mean()) if cols else float("nan")
    R = max(50, min(resamples, int(BOOTSTRAP_CELLS // max(N * len(cols), 1))))
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, max(N, 1), (R, N), generator=g)
    counts = torch.zeros(R, N).scatter_add_(1, draws, torch.ones(R, N)).t().contiguous()  # (N, R) fp32
    boot = torch.stack([_weighted_auc(s[:, c], y[:, c], counts) for c in cols], 1).nanmean(1) if cols else \
        torch.full((R,), float("nan"), dtype=torch.float64)  # (R,) the macro AUC of each resample
    boot = boot[~boot.isnan()].double()
    low, high = (boot.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist() if boot.numel()
                 else (float("nan"), float("nan")))
    rate = y.double().mean(0, keepdim=True).expand(N, n)
    return {"concept_auc": macro, "concept_auc_low": low, "concept_auc_high": high,
            "concept_auc_concepts": len(cols), "concept_auc_skipped": n - len(cols),
            "concept_auc_pooled": float(detection_auc(s, y)),
            "concept_auc_pooled_base_rate": float(detection_auc(rate, y))}

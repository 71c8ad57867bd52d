"""``NCPModel``: the whole NCP model in one place (spec ncp-model.md sections 1-5).

Six stages, composed the same way by the full forward, the prefill and every decoding step
(decode.py):

    embed_tokens: tokens (B, T) -> x (B, T, d)
    encode:       x -> h (B, T, d)                         encoder stack (E layers)
    concepts:     h -> ConceptOutput: decoder input z      segmenter -> concept stack -> heads
                  (B, T, d), pred (B, M, d), code weights  -> codebook -> coupling (concept.py)
                  (B, M, S, N), losses, metrics
    decode:       z -> final-norm states (B, T, d)         decoder stack (D layers) + final norm
    readout:      h -> h_bar (B, T, d)                     Steerling's concept bottleneck h = kK + uU + e
                                                           (bottleneck.py; h_bar = h outside training)
    head:         h_bar -> logits (B, T, V) or the fused loss

Token layer i of the backbone is ``encoder[i]`` if i < E else ``decoder[i-E]``, so HF weights
map layer by layer. With ``concept.enabled`` false, E = 0, ``concept`` is None and the model
is exactly HF ``GPTNeoXForCausalLM`` / ``LlamaForCausalLM``.

``interventions`` (interventions.py: a code-weight edit, an addition to the decoder input or
to a layer's residual stream) are honoured identically by ``forward``, ``prefill`` and
``decode_step``; ``from_decoder_input`` re-runs the decoder from a given (modified) z.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ncpctl.model.core.concept import ConceptModule, ConceptOutput, coupling_layer_factory
from ncpctl.model.core.coupling import Coupling
from ncpctl.model.designs.bottleneck.module import BottleneckOutput, ConceptBottleneck
from ncpctl.model.core.config import ModelConfig, strategy
from ncpctl.model.designs.bottleneck.config import steer_site
from ncpctl.model.core.decode import DecodeState, prefill, step
from ncpctl.model.core.documents import check_documents
from ncpctl.model.core.head import LMHead
from ncpctl.model.core.interventions import (AddToDecoderInput, AddToReadout, AddToResidual, Intervention, check, decoder_input_addition,
                            readout_addition, readout_vector, residual_additions)
from ncpctl.model.core.layers import Context, RMSNorm, Stack, make_norm
from ncpctl.model.core.outputs import LogKey, NCPOutput
from ncpctl.model.designs.mtp.module import MTPHead
from ncpctl.model.designs.mup.module import hidden_linears
from ncpctl.model.core.objective import Objective
from ncpctl.model.designs.residual.module import CrossModules
from ncpctl.model.core.stability import CHUNK_ELEMENTS, attention_stats
from ncpctl.model.designs.dynamic.module import DynamicSegmenter  # noqa: F401  (a built-in strategy: exported with the model package)
from ncpctl.model.designs.causal_diffusion.module import CausalDiffusion  # noqa: F401  (the built-in objective, exported likewise)


class NCPModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, E = cfg.d_model, cfg.encoder_layers
        # what the model is trained to predict (objective.py; not a module: no weights, no state)
        self.objective = _objective(cfg)
        # each token layer's declared attention pattern (patterns.py), from its sliding window
        patterns = [self.objective.pattern(w) for w in cfg.token_windows]
        self.token_patterns = tuple(dict.fromkeys(patterns))  # distinct, in layer order
        self.embed = nn.Embedding(cfg.padded_vocab_size, d)
        # gpt2: learned absolute positions added to the token embeddings (no RoPE)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, d) if cfg.learned_positions else None
        self.encoder = Stack(cfg, patterns[:E])
        # a coupling may give each decoder block a sub-layer (cross-attention to the concepts)
        cross = coupling_layer_factory(cfg) if cfg.concept.enabled else None
        self.decoder = Stack(cfg, patterns[E:], cross=cross)
        self.concept = ConceptModule(cfg) if cfg.concept.enabled else None
        # NCP-ArchPreview's cross-module residuals (residual.py), when any connection is on, or the
        # depth mixer's own (``cross_modules``: Block AttnRes's parameter-free block states): both
        # are ``attach``ed to stacks
        mixer = strategy("residual", cfg.residual)
        self.crc = CrossModules(cfg) if cfg.crc_connections else None
        if self.crc is None and hasattr(mixer, "cross_modules"):
            self.crc = mixer.cross_modules(cfg)
        self.final_norm = make_norm(cfg, d)
        if self.concept is not None:  # a coupling may use the model's own modules (add: final_norm)
            self.concept.coupling.bind(self)
        self.lm_head = LMHead(d, cfg.padded_vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.mtp = MTPHead(cfg) if cfg.mtp_depth else None  # multi-token prediction (training only)
        # Steerling's additive concept bottleneck before the LM head (with or without the concept path)
        self.bottleneck = ConceptBottleneck(cfg) if cfg.bottleneck.enabled else None
        # decoupled muP: the logits are divided by s_token (None: standard parametrization)
        self.logit_divisor = cfg.mup_widths[0] if cfg.mup_widths is not None else None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """``init: hf``: N(0, init_std) for matrices and embeddings (HF's init); ``init: gpt2``:
        GPT-2's (HF ``GPT2PreTrainedModel._init_weights``): N(0, init_std), with the residual output
        projections (attention out-proj, MLP down-proj: GPT-2's ``c_proj``) N(0, init_std / sqrt(2L));
        ``init: gpt-neox``: Pythia's small_init N(0, sqrt(2/(5d))) with wang_init N(0, 2/(L sqrt(d)))
        on those projections. Zero biases, unit norms in all three.

        L = the token layers (``n_token_layers``: PM's extra layers count), also for the concept
        layers' output projections: HF scales every block of a model by its ``config.n_layer``, and
        ConceptLM's GPT-2 code builds its concept blocks as ``GPT2Block``s under the backbone's
        config, initialised by the same rule. MTP depth layers keep the base std (neither GPT-2
        nor Pythia has them).

        Modules whose init is part of their design (``owns_init``: e.g. a depth mixer that must
        start as the plain residual) are skipped here and initialise themselves.

        Decoupled muP (``mup_base_width``): the stds are the base model's (gpt-neox's at d_base),
        and a hidden matrix (mup.py) gets std / sqrt(s) of its module (variance / s); embeddings
        and the LM head keep the base std."""
        cfg = self.cfg
        own = [m for m in self.modules() if getattr(m, "owns_init", False)]
        skip = {id(sub) for m in own for sub in m.modules()}
        width = cfg.d_model if cfg.mup_base_width is None else cfg.mup_base_width
        L = cfg.n_token_layers
        std = math.sqrt(2 / (5 * width)) if cfg.init == "gpt-neox" else cfg.init_std
        out_std = {"hf": std, "gpt2": std / math.sqrt(2 * L), "gpt-neox": 2 / L / math.sqrt(width)}[cfg.init]
        outputs = {id(m) for blk in self._blocks() for m in (blk.attn.proj, blk.mlp.proj)}
        hidden = {id(m): s for m, _, s in hidden_linears(self).values()}  # muP: module -> s of its module
        for m in self.modules():
            if id(m) in skip:
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                base = out_std if id(m) in outputs else std
                nn.init.normal_(m.weight, std=base / math.sqrt(hidden[id(m)]) if id(m) in hidden else base)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if self.concept is not None:
            self.concept.codebook.reset_parameters()
        for m in own:
            m.reset_parameters()

    def _blocks(self) -> list:
        """Every transformer block: token layers and concept layers."""
        return [*self.encoder, *self.decoder, *(self.concept.layers if self.concept is not None else ())]

    def token_layers(self) -> list:
        """Backbone token layers in order (encoder then decoder)."""
        return [*self.encoder, *self.decoder]

    # ---- the stages ----

    def embed_tokens(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) at integer positions (B|1, T) -> (B, T, d) (+ learned positions, gpt2)."""
        x = self.embed(idx)
        return x if self.pos_embed is None else x + self.pos_embed(positions)

    def encode(self, x: torch.Tensor, ctx: Context, states: bool = False):
        return self.encoder(x, ctx, states=states)

    def concepts(self, h: torch.Tensor, *, losses: bool = False, interventions: Sequence[Intervention] = (),
                 states: bool = False, enc_states: list | None = None,
                 sample_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> ConceptOutput:
        if self.concept is None:
            return ConceptOutput(z=h)
        return self.concept(h, losses=losses, interventions=interventions, states=states, crc=self.crc,
                            enc_states=enc_states, sample_ids=sample_ids, doc_ids=doc_ids)

    # ---- cross-module residuals: which depths to keep, and the decoder's hook ----

    def _crc_has(self, name: str) -> bool:
        return self.crc is not None and self.crc.has(name)

    def _keeps_encoder_depths(self, asked: bool) -> bool:
        return asked or self._crc_has("encoder-decoder") or self._crc_has("encoder-concept")

    def decoder_crc(self, ctx: Context, enc_states: list | None, concept_states: list | None) -> Context:
        """``ctx`` with the decoder's encoder-decoder / concept-decoder connections (a CRC
        ``post`` hook or Block AttnRes ``sources``), from token-aligned source depths (each (B, T, d))."""
        targets = []
        if self._crc_has("encoder-decoder"):
            targets.append(("encoder-decoder", enc_states))
        if self._crc_has("concept-decoder"):
            targets.append(("concept-decoder", concept_states))
        return self.crc.attach(ctx, targets) if targets else ctx

    def _decoder_context(self, ctx: Context, co: ConceptOutput, enc_states: list | None, z: torch.Tensor) -> Context:
        """The decoder's context: the coupling's (memory to attend to) and the CRC hook."""
        if self.concept is None:
            return ctx
        ctx = self.concept.coupling.decoder_context(ctx, co.pred, co.segments, self.concept.segmenter)
        concept_states = None
        if self._crc_has("concept-decoder"):  # shifted exactly as pred: token t sees closed concepts only
            T, seg = z.shape[1], co.segments
            concept_states = ([self.concept.segmenter.spread(seg, s, T) for s in co.states] if co.states is not None
                              else [torch.zeros_like(z)] * self.concept.layers.n_depths)
        return self.decoder_crc(ctx, enc_states, concept_states)

    def decode(self, z: torch.Tensor, ctx: Context, states: bool = False):
        """Decoder input z (B, T, d) -> final-norm states (B, T, d) (and the per-depth states)."""
        if states:
            x, seen = self.decoder(z, ctx, states=True)
            return self.final_norm(x), seen
        return self.final_norm(self.decoder(z, ctx))

    def readout(self, h: torch.Tensor, concept_labels: torch.Tensor | None = None, losses: bool = False,
                positions: torch.Tensor | None = None, dense: bool = False) -> tuple[torch.Tensor, BottleneckOutput | None]:
        """Final-norm states h (B, T, d) -> (what the LM head reads, the bottleneck's parts): h
        itself without a bottleneck; with one, h_bar = k_hat + u_hat + e (== h outside training).
        ``positions`` (B, T) bool: where the concept loss reads (``objective.concept_positions``);
        ``dense``: the known head's dense logits even without gradients (bottleneck_sparse.py)."""
        if self.bottleneck is None:
            if concept_labels is not None:
                raise ValueError("concept_labels given, but this model has no concept bottleneck (model.bottleneck)")
            return h, None
        parts = BottleneckOutput(**self.bottleneck(h, concept_labels, losses=losses, positions=positions,
                                                   feed=self.objective.fed_labels, dense=dense))
        return parts.h_bar, parts

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None, top1: bool = False):
        """(B, T, d) -> logits (B, T, V); with targets -> (logits or None, mean NTP loss) (``top1``:
        also the top-1 hits, ``LMHead``). Decoupled muP divides the logits by s_token, as h / s_token
        before the head so the fused loss stays; with a concept bottleneck h is its h_bar, so the
        division comes after it: every logit is (W_y . (kK + uU + e)) / s_token, and attribution
        reads ``logit_weight`` = W / s_token to stay exact. Every path (forward, decoding,
        ``from_decoder_input``, MTP) goes through here."""
        if self.logit_divisor is not None:
            h = h / self.logit_divisor
        if targets is None:
            return self.lm_head(h)
        return self.lm_head(h, targets, top1=True) if top1 else self.lm_head(h, targets)

    @property
    def logit_weight(self) -> torch.Tensor:
        """The (V, d) matrix taking what the head reads to the logits: ``lm_head.weight`` / s_token
        under muP (the weight itself otherwise)."""
        w = self.lm_head.weight
        return w if self.logit_divisor is None else w / self.logit_divisor

    # ---- contexts: what the token stacks need besides their input ----

    def token_context(self, T: int, device, dtype, doc_ids: torch.Tensor | None = None) -> tuple[Context, torch.Tensor]:
        """Context of an unpadded, uncached T-token batch and its positions (1, T); with ``doc_ids``
        (B, T) packed documents: attention within each document, positions (B, T) restarting per document."""
        if doc_ids is not None:
            return Context.documents(self.cfg, doc_ids, self.token_patterns, dtype)
        positions = torch.arange(T, device=device)[None]
        return Context.causal(self.cfg, positions, self.token_patterns, dtype), positions

    def _stack_contexts(self, ctx: Context, ivs, positions: torch.Tensor, like: torch.Tensor):
        """(encoder context, decoder context): ``ctx`` plus each stack's residual additions."""
        if not ivs:
            return ctx, ctx
        E, D = len(self.encoder), len(self.decoder)
        return (ctx.with_(adds=residual_additions(ivs, "encoder", E, positions, like)),
                ctx.with_(adds=residual_additions(ivs, "decoder", D, positions, like)))

    def check_interventions(self, interventions) -> list[Intervention]:
        return check(interventions, {"encoder": len(self.encoder), "decoder": len(self.decoder)})

    # ---- full-sequence forward ----

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                interventions: Sequence[Intervention] | None = None, return_hidden: bool = False,
                return_states: bool = False, compute_logits: bool = True,
                concept_labels: torch.Tensor | None = None, return_bottleneck: bool = False,
                sample_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> NCPOutput:
        """idx (B, T) token ids; targets (B, T) aligned with idx as the objective builds them
        (``objective.batch``; next-token: targets[:, p] = x[p+1]), -100 = ignore. Returns logits
        (B, T, V) and, with targets, the losses (the objective's first, ``objective.loss_key``);
        ``return_hidden``: the final-norm states; ``return_states``: every stack's per-depth states.
        ``concept_labels`` (B, T, n) bool/float: token t carries evidence of labelled concept c
        (the bottleneck's concept loss and teacher forcing); ``return_bottleneck``: its parts
        (k, u, k_hat, u_hat, e) as ``out.bottleneck``, for attribution (the known head dense; without
        gradients a top-k unknown head is sparse, bottleneck_sparse.py); ``sample_ids`` (B,) each
        row's global sample index (the training loop's: the key of a segmenter's sampling noise,
        so every rank count draws the same boundaries); ``doc_ids`` (B, T) long, non-decreasing per
        row: the document of each position of a packed window (``data.document_mask``; documents.py):
        attention, positions and concept segments stay inside each document."""
        ivs = self.check_interventions(interventions)
        if doc_ids is not None:
            check_documents(self, idx, doc_ids)
        # where the bottleneck's concept loss reads and a steering stage injects (None: everywhere)
        keep = self.objective.concept_positions(idx, targets) if self.bottleneck is not None else None
        inj = self.bottleneck.injection(concept_labels, self.logit_weight, keep) \
            if self.bottleneck is not None and concept_labels is not None and targets is not None else None
        if inj is not None:  # a steering stage (Steerling): the direction added at the labelled slots
            ivs = ivs + [self._injection_site(inj)]
        ctx, positions = self.token_context(idx.shape[1], idx.device, self.embed.weight.dtype, doc_ids)
        x = self.embed_tokens(idx, positions)  # (B, T, d)
        enc_ctx, dec_ctx = self._stack_contexts(ctx, ivs, positions, x)
        h, enc_states = self.encode(x, enc_ctx, states=True) if self._keeps_encoder_depths(return_states) \
            else (self.encode(x, enc_ctx), None)
        co = self.concepts(h, losses=targets is not None, interventions=ivs, enc_states=enc_states,
                           states=return_states or self._crc_has("concept-decoder"), sample_ids=sample_ids,
                           doc_ids=doc_ids)
        z = decoder_input_addition(ivs, co.z, positions)  # (B, T, d)
        dec_ctx = self._decoder_context(dec_ctx, co, enc_states, z)
        hN = self.decode(z, dec_ctx, states=return_states)  # (B, T, d)
        states = None
        if return_states:
            hN, dec_states = hN
            states = {"encoder": enc_states, "concept": co.states, "decoder": dec_states}
        out = NCPOutput(logits=None, concept=co if self.concept is not None else None, states=states,
                        hidden=hN if return_hidden else None, metrics=dict(co.metrics), stats=dict(co.stats))
        h_bar, parts = self.readout(hN, concept_labels, losses=targets is not None, positions=keep,
                                    dense=return_bottleneck)
        steer = readout_vector(ivs, h_bar, positions)  # (B, T, d) or None: AddToReadout (steering at the head)
        h_bar = h_bar if steer is None else h_bar + steer
        if parts is not None:  # steering is an attributed part of what the head reads: h_bar = kK + uU + e + steer
            parts.h_bar, parts.steer = h_bar, steer
            out.metrics.update(parts.metrics)
            out.bottleneck = parts if return_bottleneck else None
        if targets is None:
            out.logits = self.head(h_bar) if compute_logits else None  # (B, T, V)
            return out
        # the objective's loss (next-token: the fused head's == F.cross_entropy(lm_head(h_bar).float(), targets))
        out.logits, main = self.objective.loss(self, h_bar, targets)
        out.losses = {self.objective.loss_key: main, **co.losses, **(parts.losses if parts is not None else {})}
        if inj is not None:
            out.losses.update(self.bottleneck.steering_losses(parts, inj, h_bar, self.head))
        out.loss = main
        weights = {**(self.concept.loss_weights() if self.concept is not None else {}),
                   **(self.bottleneck.loss_weights() if self.bottleneck is not None else {})}
        for name, weight in weights.items():
            if name in out.losses:  # the bottleneck's concept loss needs labels
                out.loss = out.loss + weight * out.losses[name]
        if parts is not None:
            out.metrics["concept_share"] = self.bottleneck.share(parts, self.logit_weight,
                                                                 self.objective.target_tokens(targets))
        if self.mtp is not None and self.training:  # validation and evaluation: the main head only
            out.losses["mtp_loss"], mtp_metrics = self.mtp(hN, targets, self, doc_ids)
            out.metrics.update(mtp_metrics)
            out.loss = out.loss + self.mtp.weight * out.losses["mtp_loss"]
        return out

    def _injection_site(self, inj) -> Intervention:
        """The steering stage's injection as the intervention at ``bottleneck.steer_at``."""
        stack, layer = steer_site(self.cfg.bottleneck.steer_at)
        if stack == "decoder_input":
            return AddToDecoderInput(vector=inj.vector, where=inj.where)
        if stack == "readout":
            return AddToReadout(vector=inj.vector, where=inj.where)
        return AddToResidual(vector=inj.vector, where=inj.where, stack=stack, layer=layer)

    def from_decoder_input(self, z: torch.Tensor, *, concept: ConceptOutput | None = None,
                           encoder_states: list | None = None,
                           interventions: Sequence[Intervention] | None = None) -> torch.Tensor:
        """Logits (B, T, V) of the decoder re-run from decoder input z (B, T, d) (e.g. a forward's
        ``out.concept.z`` with a code's term removed). ``concept``: that forward's ConceptOutput,
        for couplings or cross-module residuals whose decoder reads the concepts;
        ``encoder_states``: its ``out.states["encoder"]`` for an encoder-decoder cross-module
        residual. Decoder-stack interventions apply."""
        if self._crc_has("encoder-decoder") and encoder_states is None:
            raise ValueError("from_decoder_input: this model's decoder reads the encoder's depths "
                             "(crc_connections: encoder-decoder, or Block AttnRes's cross-module states); "
                             "pass encoder_states=out.states['encoder']")
        ivs = self.check_interventions(interventions)
        ctx, positions = self.token_context(z.shape[1], z.device, z.dtype)
        _, dec_ctx = self._stack_contexts(ctx, ivs, positions, z)
        if concept is not None:
            dec_ctx = self._decoder_context(dec_ctx, concept, encoder_states, z)
        elif self.concept is not None and (self.crc is not None or type(self.concept.coupling).decoder_context
                                           is not Coupling.decoder_context):
            raise ValueError("from_decoder_input: this model's decoder reads the concepts; pass concept=out.concept")
        return self.head(readout_addition(ivs, self.readout(self.decode(z, dec_ctx))[0], positions))

    @property
    def uses_sample_ids(self) -> bool:
        """Whether ``forward`` wants ``sample_ids`` (a segmenter whose sampling is keyed by them)."""
        return self.concept is not None and getattr(self.concept.segmenter, "keyed", False)

    # ---- what the training loop logs (declared once, the same on every rank) ----

    def log_keys(self) -> list[LogKey]:
        keys = [LogKey("loss"), *self.objective.log_keys()]
        keys += self.concept.log_keys() if self.concept is not None else []
        keys += self.bottleneck.log_keys() if self.bottleneck is not None else []
        return keys + (self.mtp.log_keys() if self.mtp is not None else [])

    def attention_stats(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                        chunk_elements: int = CHUNK_ELEMENTS, doc_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Stability diagnostics of one batch idx (B, T) (NCP-ArchPreview Sec. 4.6): per attention
        layer the max attention logit over visible pairs and the max per-head query / key norm, and
        their maxima over layers, as 0-dim tensors named ``attn/{layer}/{max_logit|max_q_norm|
        max_k_norm}`` and ``attn/{quantity}`` (stability.py). No grad; an extra eval-mode forward
        (targets (B, T): the MTP depths too; ``doc_ids``: packed documents); the training forward is
        untouched by it."""
        return attention_stats(self, idx, targets, chunk_elements=chunk_elements, doc_ids=doc_ids)

    def on_step_begin(self, step: int) -> None:
        """Called by the loop before optimizer step ``step`` (0-based): schedules inside the
        model (the MTP weight) follow it."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "on_step_begin", None)):
                m.on_step_begin(step)
        if callable(getattr(self.objective, "on_step_begin", None)):  # not a module
            self.objective.on_step_begin(step)

    def _stat_modules(self) -> list[nn.Module]:
        return [m for m in self.modules() if m is not self and callable(getattr(m, "stat_keys", None))]

    def stat_keys(self) -> list[str]:
        """Names of the per-step global statistics (``NCPOutput.stats``), in a fixed order."""
        return [k for m in self._stat_modules() for k in m.stat_keys()]

    def on_step_end(self, stats: dict[str, float]) -> None:
        """The per-step hook: ``stats`` are the totals of ``NCPOutput.stats`` over every
        micro-batch of the step on every rank; the loop calls it on every rank after each
        applied optimizer step (not after a step skipped for a non-finite loss)."""
        for m in self._stat_modules():
            if m.stat_keys():
                m.on_step_end({k: stats[k] for k in m.stat_keys()})

    # ---- causal decoding (spec section 5; see decode.py) ----

    def prefill(self, tokens: torch.Tensor, lengths, max_len: int | None = None, *,
                interventions: Sequence[Intervention] | None = None) -> tuple[torch.Tensor, DecodeState]:
        """Left-padded prompts (B, Tp) with real ``lengths`` -> (logits (B, Tp, V), state).
        ``max_len``: slots to allocate (None: caches grow as needed)."""
        if not self.objective.causal:
            raise ValueError(f"objective {self.cfg.objective!r} does not decode on KV caches (its attention pattern "
                             "lets a position see later ones); generate through objective.decoding")
        ivs = self.check_interventions(interventions)
        if any(iv.where is not None for iv in ivs):
            raise ValueError("an intervention with `where` (slots of a full forward) cannot apply to decoding")
        return prefill(self, tokens, lengths, max_len, ivs)

    def decode_step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per row (B,) -> next-token logits (B, V); advances ``state``."""
        return step(self, state, tokens)


def _objective(cfg: ModelConfig) -> Objective:
    cls = strategy("objective", cfg.objective)
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"objective {cfg.objective!r}: {cls!r} is not an Objective subclass")
    return cls(cfg)

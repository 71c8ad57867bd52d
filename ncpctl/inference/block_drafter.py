"""The block-parallel drafter (``ncpctl.model.designs.drafter.module``) on a target: what it reads, in training
and in speculative decoding alike, and its ``Drafter`` (drafters.py) for ``generate --draft``.

``TargetTap`` records, by forward hooks on the target's two token stacks, the residual stream
after each chosen token layer and the encoder's output h (the concept module's input), for every
call (the full forward, a prefill, a multi-token step): the same states whichever way the target
ran, and no change to the target's code. ``block_concepts`` turns h (or the target's predictions)
into the concept of the last complete block before each anchor.
"""

from __future__ import annotations

import torch

from ncpctl.model.designs.drafter.module import BlockDrafter, DrafterConfig

from .drafters import Drafter, _draw_rows


class TargetTap:
    """Forward hooks on ``model``'s encoder and decoder stacks: ``take()`` -> (feats (B, n, L*d): the
    chosen token layers' outputs concatenated, h (B, n, d): the encoder's output) of the calls
    since the last ``take`` (concatenated along the sequence)."""

    def __init__(self, model, layers: list[int]):
        E = len(model.encoder)
        self.layers = list(layers)
        self.calls: list[dict] = []
        self._cur: dict = {}
        want = {("enc" if i < E else "dec", i if i < E else i - E): n for n, i in enumerate(self.layers)}

        def stream(stack: str):
            def hook(module, args, out):
                n = want.get((stack, int(args[0])))
                if n is not None:
                    self._cur[n] = out
            return hook

        def encoder_in(module, args):
            self._cur = {}  # a new call of the target starts at its encoder

        def encoder_out(module, args, out):
            self._cur["h"] = out[0] if isinstance(out, tuple) else out

        def decoder_out(module, args, out):
            self.calls.append(self._cur)

        self.handles = [model.encoder.register_forward_pre_hook(encoder_in),
                        model.encoder.register_forward_hook(encoder_out),
                        model.decoder.residual.register_forward_hook(stream("dec")),
                        model.decoder.register_forward_hook(decoder_out)]
        if E:
            self.handles.append(model.encoder.residual.register_forward_hook(stream("enc")))

    def take(self, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        calls = self.calls[-1:] if last_only else self.calls
        self.calls = []
        feats = [torch.cat([c[n] for n in range(len(self.layers))], -1) for c in calls]
        return torch.cat(feats, 1), torch.cat([c["h"] for c in calls], 1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def block_concepts(per_block: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """per_block (B, M, d) one vector per complete block (pooled h or the target's pred), anchors
    (B, A) last verified positions -> (B, A, d): the vector of the last complete block of x[0..a]
    (index (a+1)//k - 1), zeros before the first block completes."""
    B, M, d = per_block.shape
    padded = torch.cat([per_block.new_zeros(B, 1, d), per_block], 1)  # index j+1 = block j
    j = ((anchors + 1) // k).clamp_max(M)  # (B, A) = (block index) + 1
    return padded.gather(1, j[..., None].expand(*j.shape, d))


def predicted_terms(model, pred: torch.Tensor) -> torch.Tensor:
    """The target's predicted concepts pred (B, M, d) -> what its coupling adds per concept (B, M, d)
    (``added_term``: norm(pred) with ``concept.add: normed``): the tensor a ``predicted`` drafter reads,
    in training and in decoding (the decode state's ``pred`` holds this term) alike."""
    return model.concept.coupling.added_term(pred)


def pool_blocks(h: torch.Tensor, k: int) -> torch.Tensor:
    """h (B, T, d) -> mean over each complete block of k tokens (B, T//k, d)."""
    B, T, d = h.shape
    M = T // k
    return h[:, : M * k].reshape(B, M, k, d).mean(2)


def check_target(model, cfg: DrafterConfig, where: str) -> str | None:
    """Why ``model`` cannot be the target of a drafter of ``cfg`` (None: it can)."""
    t = model.cfg
    mine = {"d_model": t.d_model, "vocab_size": t.padded_vocab_size, "n_heads": t.n_heads,
            "n_target_layers": t.encoder_layers + t.decoder_layers}
    diff = [f"{k} {getattr(cfg, k)} (target {v})" for k, v in mine.items() if getattr(cfg, k) != v]
    if diff:
        return f"{where} was trained for another target: {', '.join(diff)}"
    if cfg.concept_injection:
        from ncpctl.model.core.segment import FixedBlocks

        if model.concept is None or not isinstance(model.concept.segmenter, FixedBlocks) \
                or model.concept.segmenter.k != cfg.concept_k:
            return f"{where} injects concepts of fixed blocks of {cfg.concept_k} tokens; the target has none"
        if cfg.concept_source == "predicted" and not hasattr(model.concept.coupling, "added_term"):
            return (f"{where} injects the concept term the target adds to its tokens (concept_source: predicted); "
                    "the target's coupling adds none")
    return None


class BlockDraftRunner(Drafter):
    """``BlockDrafter`` behind the drafter interface: one drafter forward proposes all K tokens.

    Keeps, by slot, the target's tapped states of every committed token (from the prefill and
    from the verification forwards), and each row's last fed slot; a round reads the latest W
    of them, so nothing needs rolling back."""

    def __init__(self, target_model, drafter: BlockDrafter):
        self.model, self.drafter = target_model, drafter
        self.cfg = drafter.cfg
        self.max_tokens = self.cfg.k
        self.tap: TargetTap | None = None

    def attach(self, target_model) -> None:
        if target_model is not self.model:
            raise ValueError("this drafter reads the states of the target it was loaded for")
        self.tap = TargetTap(target_model, self.cfg.target_layers)  # before the prefill: it reads it

    def detach(self) -> None:
        if self.tap is not None:
            self.tap.close()
            self.tap = None

    def start(self, target, tokens, lengths, max_len) -> None:
        st = target.state
        B, Tp = tokens.shape
        feats, h = self.tap.take(last_only=True)  # the prefill's (B, Tp, .)
        cap = max_len + self.cfg.k + 2
        self.target, self.pad = target, st.pad_t
        self.F = feats.new_zeros(B, cap, feats.shape[-1])
        self.H = h.new_zeros(B, cap, h.shape[-1])
        self.F[:, :Tp], self.H[:, :Tp] = feats, h
        # per draft layer the context keys and values (B, H, cap, hd) by slot: computed once per
        # committed token (the prompt here, the kept tokens in ``commit``), not per round
        kv = self.drafter.context(feats, torch.arange(Tp, device=h.device)[None] - self.pad[:, None])
        self.KV = [tuple(t.new_zeros(*t.shape[:2], cap, t.shape[-1]) for t in pair) for pair in kv]
        for cache, pair in zip(self.KV, kv):
            for c, t in zip(cache, pair):
                c[:, :, :Tp] = t
        self.last = [Tp - 1] * B

    def _concept(self, last: torch.Tensor) -> torch.Tensor | None:
        """(B, d) the concept of the last complete block of each row's verified prefix."""
        cfg = self.cfg
        if not cfg.concept_injection:
            return None
        if cfg.concept_source == "predicted":  # the coupling's current term (predicted_terms) of the last closed block
            return self.target.state.pred
        k, B = cfg.concept_k, last.shape[0]
        t = last - self.pad  # (B,) last verified positions
        j = (t + 1) // k - 1  # the last complete block
        slots = (self.pad + j * k)[:, None] + torch.arange(k, device=last.device)[None]  # (B, k)
        c = self.H.gather(1, slots.clamp_min(0)[..., None].expand(B, k, self.H.shape[-1])).mean(1)
        return c * (j >= 0)[:, None].to(c.dtype)

    @torch.no_grad()
    def propose(self, x, K, params, gens, vocab_size):
        cfg, dev = self.cfg, x.device
        last = torch.tensor(self.last, device=dev)
        slots = last[:, None] - cfg.window + 1 + torch.arange(cfg.window, device=dev)[None]  # (B, W)
        valid = slots >= self.pad[:, None]
        at = slots.clamp_min(0)[:, None, :, None]  # (B, 1, W, 1) -> the caches' (B, H, W, hd)
        ctx_kv = [tuple(c.gather(2, at.expand(c.shape[0], c.shape[1], cfg.window, c.shape[3])) for c in cache)
                  for cache in self.KV]
        x_pos = (last - self.pad)[:, None] + 1  # (B, 1) the pending token's position
        x_emb = self.model.embed_tokens(x[:, None], x_pos.clamp_max(self.model.cfg.max_seq_len - 1))[:, 0]
        hN = self.drafter.block(ctx_kv, valid, x_pos, x_emb, self._concept(last))  # (B, k, d)
        logits = self.model.head(hN[:, :K])  # (B, K, V)
        ds, qs = zip(*(_draw_rows(logits[:, i], params, gens, vocab_size) for i in range(K)))
        return torch.stack(ds, 1), torch.stack(qs, 1)

    @torch.no_grad()
    def commit(self, keep: list[int]) -> None:
        feats, h = self.tap.take()  # (B, K+1, .) this round's fed tokens: x, d_1 .. d_K
        most = max(keep)  # the tokens some row kept: only theirs are needed
        if most == 0:
            return
        first = torch.tensor(self.last, device=feats.device) + 1  # (B,) each row's first fed slot
        pos = (first - self.pad)[:, None] + torch.arange(most, device=feats.device)[None]  # (B, most)
        kv = self.drafter.context(feats[:, :most], pos)  # their context keys and values, all rows at once
        for b, n in enumerate(keep):
            s = self.last[b] + 1
            self.F[b, s : s + n], self.H[b, s : s + n] = feats[b, :n], h[b, :n]
            for cache, pair in zip(self.KV, kv):
                for c, t in zip(cache, pair):
                    c[b, :, s : s + n] = t[b, :, :n]
        self.last = [n + k for n, k in zip(self.last, keep)]


def read_drafter(meta: dict, weights: dict, where: str = "the drafter checkpoint") -> BlockDrafter:
    """The drafter of a drafter checkpoint (its ``ncpctl.json`` ``drafter`` entry and weights); weights
    that do not fit the recorded config (an edited or mixed-up checkpoint) are one ``UserError``."""
    from ncpctl.errors import UserError

    drafter = BlockDrafter(DrafterConfig.from_dict(meta["drafter"]["config"]))
    try:
        drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in weights.items()})
    except RuntimeError as e:  # missing / unexpected keys or shapes: torch's multi-line report
        detail = " ".join(str(e).split())[:300]
        raise UserError(f"{where}: its weights do not fit the drafter its ncpctl.json describes ({detail})",
                        hint="point --draft at an intact checkpoint of `ncpctl train-drafter`") from None
    return drafter.eval()


def load_block_drafter(loaded, directory, meta: dict, k: int):
    """``--draft CKPT`` where CKPT is a drafter checkpoint (``ncpctl train-drafter``) for the target
    ``loaded`` (a ``LoadedModel``): a ``Speculative`` and the drafter's description, or a one-line
    ``UserError`` (another target's shape, tokenizer or vocabulary; no concept blocks to inject)."""
    from ncpctl.checkpoint import TOKENIZER, read_weights
    from ncpctl.errors import UserError

    from .speculative import Speculative

    drafter = read_drafter(meta, read_weights(directory, meta), str(directory))
    why = check_target(loaded.model, drafter.cfg, f"drafter {directory}")
    if why:
        raise UserError(why, hint=f"train a drafter for {loaded.path} (train.init_from) with `ncpctl train-drafter`")
    tok = directory / TOKENIZER
    if tok.is_file() and loaded.tokenizer is not None:
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(tok)).get_vocab(with_added_tokens=True) != \
                loaded.tokenizer.get_vocab(with_added_tokens=True):
            raise UserError(f"drafter {directory} was trained with another tokenizer than {loaded.path}: a drafter "
                            "must share the target's tokenizer")
    w = loaded.model.embed.weight
    drafter.to(dtype=w.dtype, device=w.device)
    cfg = drafter.cfg
    return Speculative(BlockDraftRunner(loaded.model, drafter), k), {
        "draft": str(directory), "drafter": "block", "drafter_k": cfg.k,
        "concept_injection": cfg.concept_injection,
        "concept_source": cfg.concept_source if cfg.concept_injection else None}

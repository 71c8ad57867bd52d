"""Reading an NCP model's concepts (``ncpctl inspect``): what each predicted concept is made of,
which of its codes a continuation depends on, and what each code stands for over a corpus.

The predicted concept of block j is an exact weighted sum of codebook vectors (ncp-model.md
section 3): pred[j] = concat over segments s of sum_n w[j, s, n] * code[s, n], each code in its
segment's slice of d. So

* ``decompose``: per block, the top codes of each segment with their weights and the remainder
  of the others (their weight mass and the norm of their summed term); the top terms plus the
  remainder term reconstruct pred exactly (the reported error is the float64 sum against the
  model's float32 pred). With ``add: normed`` this is pred *before* the coupling's norm: the norm
  is applied to the whole sum, so it does not distribute over the codes.
* ``ablate``: remove one code's term (or a whole segment's) from one block's prediction
  (``CodeEdit`` with scale 0 there, so the model's own forward does the rest: coupling, decoder,
  cross-module residuals, all unchanged otherwise) and report the change in the log-probability
  of a continuation. The concept of block j is first added at the token that closes it, so an
  ablation only moves logits from there on.
* ``code_dictionary``: over windows of a corpus, each code's usage (how often it is the heaviest
  of its segment), the blocks that weigh it most (with their text and the text before), and its
  lift tokens: the tokens whose log-probability rises most on average when the code's vector is
  added to the decoder input at every position of a few context windows.

No I/O beyond the corpus reader; the CLI (``ncpctl/cli/inspect.py``) prints and plots.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ncpctl.errors import UserError
from ncpctl.model.core.interventions import AddToDecoderInput, CodeEdit


@dataclass
class ConceptView:
    """One forward's concept signal for a single row: code weights w (M, S, N), pred (M, d),
    codes (S, N, ds), each concept's token span [start, end) and the first token it reaches
    (``applies_from[j]`` = the closing token of block j: pred[j] is added from there on), and
    ``indices[j]``: the model's concept index of block j (they differ only where a segmenter
    marks concepts invalid)."""

    weights: torch.Tensor
    pred: torch.Tensor
    codes: torch.Tensor
    spans: list[tuple[int, int]]
    applies_from: list[int]
    normed: bool
    indices: list[int]


def _require_concepts(model) -> None:
    if getattr(model, "concept", None) is None:
        raise UserError("this checkpoint has no concept path (model.concept.enabled is false): nothing to inspect")


@torch.no_grad()
def concept_view(model, ids: torch.Tensor) -> ConceptView:
    """The concept signal of ``ids`` (1, T): spans from the segmenter's closed counts."""
    _require_concepts(model)
    out = model(ids, compute_logits=False)
    co = out.concept
    T = ids.shape[1]
    if co.pred is None or co.pred.shape[1] == 0:
        raise UserError(f"the prompt is {T} tokens: shorter than one concept, so nothing is predicted "
                        f"(give a longer prompt)")
    closed = model.concept.segmenter.closed_counts(co.segments, T)[0].tolist()  # (T,) segments closed at t
    M = co.pred.shape[1]
    ends = [next((t for t in range(T) if closed[t] >= j + 1), T) for j in range(M)]  # closing token of j
    spans = [((ends[j - 1] + 1) if j else 0, ends[j] + 1) for j in range(M)]
    valid = co.segments.valid
    keep = [j for j in range(M) if ends[j] < T and (valid is None or bool(valid[0, j]))]
    idx = torch.tensor(keep, dtype=torch.long)
    return ConceptView(weights=co.weights[0, idx].float(), pred=co.pred[0, idx].float(),
                       codes=model.concept.codebook().float(), spans=[spans[j] for j in keep],
                       applies_from=[ends[j] for j in keep], normed=model.cfg.concept.add == "normed",
                       indices=keep)


def decompose(view: ConceptView, top: int = 5) -> list[dict[str, Any]]:
    """Per block: each segment's ``top`` codes (code, weight, norm of its term), the remainder
    (count, weight mass, norm of the others' summed term), and the reconstruction error of
    pred from top terms + remainder, computed in float64."""
    w, codes = view.weights.double(), view.codes.double()  # (M, S, N), (S, N, ds)
    M, S, N = w.shape
    top = max(0, min(top, N))
    terms = w[..., None] * codes[None]  # (M, S, N, ds): each code's term in its segment's slice
    blocks = []
    for j in range(M):
        order = w[j].argsort(dim=-1, descending=True)  # (S, N)
        segments, rec = [], []
        for s in range(S):
            chosen, rest = order[s, :top], order[s, top:]
            top_term = terms[j, s, chosen].sum(0)
            rest_term = terms[j, s, rest].sum(0)
            rec.append(top_term + rest_term)
            segments.append({
                "segment": s,
                "top": [{"code": int(n), "weight": float(w[j, s, n]), "norm": float(terms[j, s, n].norm())}
                        for n in chosen],
                "remainder": {"codes": int(rest.numel()), "weight": float(w[j, s, rest].sum()),
                              "norm": float(rest_term.norm())},
            })
        error = float((torch.cat(rec) - view.pred[j].double()).abs().max())
        blocks.append({"block": j, "span": list(view.spans[j]), "applies_from": view.applies_from[j],
                       "pred_norm": float(view.pred[j].norm()), "reconstruction_error": error,
                       "segments": segments})
    return blocks


@dataclass(frozen=True)
class Ablation:
    """Remove code ``code`` of segment ``segment`` (None: the whole segment) from block ``block``."""

    block: int
    segment: int
    code: int | None = None

    def name(self) -> str:
        return f"block {self.block} seg {self.segment}" + ("" if self.code is None else f" code {self.code}")


def _target_logprob(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Sum over t >= start of log p(ids[t] | ids[:t]) per row: logits (R, T, V), ids (1, T) -> (R,)."""
    logp = torch.log_softmax(logits[:, start - 1 : -1].float(), dim=-1)  # predicts tokens start..T-1
    tgt = ids[:, start:].expand(logits.shape[0], -1)
    return logp.gather(-1, tgt[..., None])[..., 0].sum(-1)


def _edit_scale(S: int, N: int, ab: Ablation) -> torch.Tensor:
    scale = torch.ones(S, N)
    if ab.code is None:
        scale[ab.segment] = 0.0
    else:
        scale[ab.segment, ab.code] = 0.0
    return scale


@torch.no_grad()
def ablate(model, ids: torch.Tensor, target_start: int, ablations: Sequence[Ablation],
           view: ConceptView, batch: int = 16) -> tuple[float, list[dict[str, Any]]]:
    """log p(ids[target_start:] | prefix) and, per ablation, its change when that term is removed
    (``delta`` < 0: the continuation relied on it). Blocks index ``view``'s kept concepts."""
    if not 0 < target_start < ids.shape[1]:
        raise UserError("the target continuation is empty: give --target TEXT")
    _, S, N = view.weights.shape
    base = float(_target_logprob(model(ids).logits, ids, target_start)[0])
    rows: list[dict[str, Any]] = []
    for lo in range(0, len(ablations), batch):
        chunk = list(ablations[lo : lo + batch])
        edits = [CodeEdit(start=view.indices[ab.block], length=1, rows=[r], scale=_edit_scale(S, N, ab))
                 for r, ab in enumerate(chunk)]
        logits = model(ids.expand(len(chunk), -1), interventions=edits).logits
        for ab, lp in zip(chunk, _target_logprob(logits, ids, target_start).tolist()):
            rows.append({"ablation": ab.name(), "block": ab.block, "segment": ab.segment, "code": ab.code,
                         "logprob": lp, "delta": lp - base})
    rows.sort(key=lambda r: r["delta"])
    return base, rows


def default_ablations(decomposition: list[dict[str, Any]], T: int, per_segment: int = 3) -> list[Ablation]:
    """Every block whose prediction reaches a position that predicts a token (its closing token
    is before the last of T): each segment whole and its ``per_segment`` heaviest codes."""
    out = []
    for b in decomposition:
        if b["applies_from"] > T - 2:
            continue
        for seg in b["segments"]:
            out.append(Ablation(b["block"], seg["segment"]))
            out += [Ablation(b["block"], seg["segment"], t["code"]) for t in seg["top"][:per_segment]]
    return out


# ----------------------------------------------------------------------------- over a corpus


@torch.no_grad()
def code_dictionary(model, windows: Iterable[torch.Tensor], decode: Callable[[list[int]], str], *,
                    top_blocks: int = 3, context: int = 16, lift_windows: Sequence[torch.Tensor] = (),
                    lift_tokens: int = 5, batch: int = 16) -> dict[str, Any]:
    """Usage, strongest blocks and lift tokens of every code, over ``windows`` (each (1, T) ids)."""
    _require_concepts(model)
    S, N = model.cfg.n_segments, model.cfg.concept.codes
    count = torch.zeros(S, N, dtype=torch.long)  # blocks whose heaviest code in s is n
    mass = torch.zeros(S, N, dtype=torch.float64)  # summed weights
    heaps: list[list[list[tuple[float, int, dict]]]] = [[[] for _ in range(N)] for _ in range(S)]
    blocks, seen = 0, 0
    for ids in windows:
        view = concept_view(model, ids)
        w = view.weights  # (M, S, N)
        M = w.shape[0]
        blocks += M
        best = w.argmax(-1)  # (M, S)
        count += torch.nn.functional.one_hot(best, N).sum(0)
        mass += w.double().sum(0)
        toks = ids[0].tolist()
        for j in range(M):
            a, b = view.spans[j]
            for s in range(S):
                n = int(best[j, s])
                item = (float(w[j, s, n]), seen, {"text": decode(toks[a:b]),
                                                  "context": decode(toks[max(0, a - context):a]),
                                                  "weight": float(w[j, s, n])})
                seen += 1
                h = heaps[s][n]
                (heapq.heappush if len(h) < top_blocks else heapq.heappushpop)(h, item)
    if not blocks:
        raise UserError("the corpus gave no complete concept (documents shorter than one concept)")
    lifts = _lift_tokens(model, list(lift_windows), lift_tokens, decode, batch) if lift_windows else None
    codes = []
    for s in range(S):
        for n in range(N):
            entry = {"segment": s, "code": n, "usage": int(count[s, n]) / blocks,
                     "mean_weight": float(mass[s, n]) / blocks,
                     "top_blocks": [x[2] for x in sorted(heaps[s][n], reverse=True)]}
            if lifts is not None:
                entry["lift_tokens"] = lifts[s][n]
            codes.append(entry)
    return {"blocks": blocks, "segments": S, "codes_per_segment": N, "codes": codes}


def code_direction(codes: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """Code (s, n) placed in segment s's slice of d: (d,)."""
    S, N, ds = codes.shape
    e = codes.new_zeros(S * ds)
    e[s * ds : (s + 1) * ds] = codes[s, n]
    return e


def _lift_tokens(model, windows: list[torch.Tensor], k: int, decode, batch: int) -> list[list[list[dict]]]:
    """Per code: the k tokens whose mean log-probability (over the windows' positions) rises most
    when the code's vector is added to the decoder input everywhere."""
    codes = model.concept.codebook().float()
    S, N, _ = codes.shape
    ids = torch.cat(windows, dim=0)  # (W, T)
    W = ids.shape[0]
    base = torch.log_softmax(model(ids).logits.float(), -1).mean(dim=(0, 1))  # (V,)
    pairs = [(s, n) for s in range(S) for n in range(N)]
    out: list[list[list[dict]]] = [[[] for _ in range(N)] for _ in range(S)]
    per = max(1, batch // W)
    V = model.cfg.vocab_size
    for lo in range(0, len(pairs), per):
        chunk = pairs[lo : lo + per]
        vec = torch.stack([code_direction(codes, s, n) for s, n in chunk]).repeat_interleave(W, 0)  # (R, d)
        rows = ids.repeat(len(chunk), 1)
        logp = torch.log_softmax(model(rows, interventions=[AddToDecoderInput(vector=vec)]).logits.float(), -1)
        gain = logp.view(len(chunk), W, -1, logp.shape[-1]).mean(dim=(1, 2)) - base  # (chunk, V)
        gain = gain[:, :V]
        values, index = gain.topk(k, dim=-1)
        for (s, n), vals, idx in zip(chunk, values.tolist(), index.tolist()):
            out[s][n] = [{"token": decode([t]), "id": t, "gain": v} for t, v in zip(idx, vals)]
    return out


def corpus_windows(tokenizer, sources: Sequence[str], seq_len: int, limit: int) -> list[torch.Tensor]:
    """Up to ``limit`` windows (1, seq_len) of consecutive tokens from the documents of
    ``sources`` (``data.sources`` syntax), each document cut into whole windows in order."""
    from ncpctl.data.sources import ReadStats, iter_documents
    from ncpctl.recipe.schema import SourceSpec

    out: list[torch.Tensor] = []
    for path in sources:
        for docs in iter_documents(SourceSpec(path=path), ReadStats(), batch=64):
            for text in docs:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                for lo in range(0, len(ids) - seq_len + 1, seq_len):
                    out.append(torch.tensor(ids[lo : lo + seq_len], dtype=torch.long)[None])
                    if len(out) >= limit:
                        return out
    if not out:
        raise UserError(f"{', '.join(sources)}: no document is {seq_len} tokens long (lower --seq-len)")
    return out


# ----------------------------------------------------------------------------- the concept bottleneck


@torch.no_grad()
def bottleneck_report(model, ids: torch.Tensor, names: Sequence[str] | None, *, target_start: int | None = None,
                      top: int = 5) -> dict[str, Any]:
    """Steerling's exact attribution for ``ids`` (1, T) on a model with ``model.bottleneck``: at each
    position the logit of the token it scores (the next token of ``ids`` from ``target_start`` on,
    else the argmax) split into known + unknown + residual, the ``top`` known concepts by the size
    of their term k_c (K_c . W_y) (and the ``top`` unknown ones), the concept share, and per label
    chunk the ``top`` concepts the known head detects (the OR over the chunk's tokens). ``attribution_error``: the largest
    |known + unknown + residual - logit| over positions (exact up to float rounding)."""
    from ncpctl.model.designs.bottleneck.chunks import chunk_probs

    b = model.bottleneck
    out = model(ids, return_bottleneck=True)
    parts, logits = out.bottleneck, out.logits[0].float()  # (T, V)
    T = ids.shape[1]
    scored = logits[:, : model.cfg.vocab_size].argmax(-1)  # (T,) what each position predicts
    if target_start is not None:
        scored[target_start - 1 : T - 1] = ids[0, target_start:]
    att = b.attribute(parts, model.logit_weight, scored[None])  # W / s_token under muP: exact
    label = (lambda c: names[c] if names and c < len(names) else f"concept {c}")
    error = float((att.logit[0] - logits.gather(-1, scored[:, None])[:, 0]).abs().max())
    positions = []
    first, last = (0, T) if target_start is None else (target_start - 1, T - 1)
    for t in range(first, last):
        terms = att.per_concept[0, t]
        order = terms.abs().argsort(descending=True)[:top]
        positions.append({"position": t, "token": int(scored[t]), "logit": float(att.logit[0, t]),
                          "known": float(att.known[0, t]), "unknown": float(att.unknown[0, t]),
                          "residual": float(att.residual[0, t]), "share": float(att.share[0, t]),
                          "concepts": [{"concept": label(int(c)), "term": float(terms[c]),
                                        "activation": float(parts.k[0, t, c])} for c in order],
                          "unknown_concepts": _unknown_terms(att, parts, t, top)})
    chunk = b.bcfg.chunk
    probs = chunk_probs(parts.k_logits.float(), chunk)[0]  # (chunks, n)
    chunks = []
    for j in range(probs.shape[0]):
        order = probs[j].argsort(descending=True)[:top]
        chunks.append({"chunk": j, "span": [j * chunk, min(T, (j + 1) * chunk)],
                       "concepts": [{"concept": label(int(c)), "probability": float(probs[j, c])} for c in order]})
    return {"attribution_error": error, "mean_share": float(att.share[0].mean()), "positions": positions,
            "chunks": chunks}


def _unknown_terms(att, parts, t: int, top: int) -> list[dict[str, Any]]:
    """Position t's ``top`` unknown concepts by the size of their term u_j (U_j . W_y) (Steerling's
    "discovered" concepts; a top-k head's are among its top-k), with their activations."""
    terms, index = att.per_unknown[0, t], att.unknown_index[0, t]
    act = parts.u_value[0, t] if parts.u is None else parts.u[0, t, index]
    order = terms.abs().argsort(descending=True)[:top]
    return [{"concept": int(index[j]), "term": float(terms[j]), "activation": float(act[j])} for j in order]

"""A Causal Diffusion LM's generation explained token by token, each token in the state in which it
was committed (``ncpctl inspect --generate``): Steerling's ``DiffusionTrace``, its
``FaithfulConceptAttributor`` (per-token and chunk-level concept attribution, the logit
contribution of known, unknown and residual parts) and its ``FaithfulOutputToInputAttributor``
(input attribution by integrated gradients), on ncpctl's block sampler (ncpctl/model/designs/causal_diffusion/sampler.py).

A CDLM does not produce its tokens left to right: inside a block the most confident [MASK]s are
committed first, each from a forward in which some of its block is still [MASK]. A token's logit is
therefore explained in THAT state, not in the finished text nor at the block's first step:

* ``record``: one prompt sampled block by block (cached), every commit group kept through the
  sampler's ``on_commit`` hook (those past the tokens returned too: the sampler completes the last
  block, and they are part of the other tokens' states; only the returned tokens are explained) (its positions, tokens, the model's logits of them, the tokens the row
  had committed before: what the steering schedule reads);
* ``Trace.snapshot(g)``: the input the model saw when it committed group g: the prompt, the tokens
  of the earlier groups, [MASK] at every other generated position, up to the end of g's block (later
  blocks are invisible under block-causal attention, and the sampler had not reached them);
* ``replay``: one full forward of that snapshot with the steering of that step (the vector at its
  still-[MASK] positions, as sampled: ``BlockSteering``); its logit of each committed token equals
  the recorded one (``replay_error``: the cached sampler against the full forward, float rounding);
* ``concept_attribution``: on a concept bottleneck model, each committed token's logit split exactly
  into known + unknown + residual (+ readout steering), the known concepts' terms k_c K_c . W_y and
  the unknown ones' u_j U_j . W_y (U = A B), the parts' shares of the logit's magnitude (Steerling's
  logit contribution notebook);
* ``chunk_attribution``: per chunk of generated tokens (the bottleneck's label chunks, aligned to
  positions), each concept's term divided at each token by that token's total magnitude
  (sum |known terms| + sum |unknown terms| + |residual|, so every token votes equally) and averaged
  over the chunk's tokens, with the residual's share (Steerling's ``chunk_attribution``; its chunks
  end at an end-of-chunk token, which ncpctl's tokenizers do not have);
* ``input_attribution``: integrated gradients of each committed token's logit over the snapshot's
  token embeddings from the [MASK] embedding (ncpctl.interpret.inputs: a still-[MASK] position has
  zero attribution by construction), with the step's steering applied in every forward (Steerling's
  attributor refuses steered generations). No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass
class Group:
    """Tokens committed together: ``order`` (0, 1, ...), ``positions``, ``tokens``, the sampler's
    ``logits`` of them, ``committed`` (tokens committed before), ``step`` (denoising steps before)."""

    order: int
    positions: list[int]
    tokens: list[int]
    logits: list[float]
    committed: int
    step: int


@dataclass
class Trace:
    """``groups``: every commit of the generation, in order, those past the ``n_new`` tokens returned
    included (the sampler finishes the last block: they are part of the states of the others)."""

    prompt: list[int]
    block: int
    mask_id: int
    n_new: int
    groups: list[Group] = field(default_factory=list)
    steer: Sequence[Any] = ()  # the row's resolved steering specs (ncpctl.interpret.steer.Resolved)

    @property
    def generated(self) -> list[int]:
        """The ``n_new`` generated tokens in position order."""
        at = {p: t for g in self.groups for p, t in zip(g.positions, g.tokens)}
        return [at[p] for p in sorted(at)][: self.n_new]

    def returned(self, position: int) -> bool:
        """Whether ``position`` holds one of the ``n_new`` tokens generation returns."""
        return position < len(self.prompt) + self.n_new

    def snapshot(self, g: int) -> list[int]:
        """The input (ids) the model saw when it committed group ``g``."""
        grp = self.groups[g]
        end = (max(grp.positions) // self.block + 1) * self.block
        ids = list(self.prompt) + [self.mask_id] * (end - len(self.prompt))
        for h in self.groups[:g]:
            for p, t in zip(h.positions, h.tokens):
                if p < end:
                    ids[p] = t
        return ids

    def steering(self, rows: int, committed: int, ids: torch.Tensor) -> list:
        """The steering interventions of a forward of ``rows`` copies of snapshot ``ids`` (1, T)."""
        if not self.steer:
            return []
        from .steer import BlockSteering

        where = (ids == self.mask_id) & (torch.arange(ids.shape[1], device=ids.device) >= len(self.prompt))
        return BlockSteering([list(self.steer)] * rows).interventions(where.expand(rows, -1).clone(), [committed] * rows)


def record(model, prompt: Sequence[int], params: Any, steer: Sequence[Any] = ()) -> Trace:
    """Sample ``prompt`` block by block (cached) and keep every commit group."""
    from ncpctl.model.designs.causal_diffusion.sampler import sample_blocks

    from .steer import block_steering

    ob = model.objective
    trace = Trace(list(prompt), ob.block, ob.mask_id, params.max_new_tokens, steer=list(steer))

    def keep(c) -> None:
        trace.groups.append(Group(len(trace.groups), c.positions, c.tokens, c.logits, c.committed, c.step))

    sample_blocks(model, [list(prompt)], params, vocab_size=model.cfg.vocab_size, on_commit=keep,
                  steer=block_steering([list(steer)]) if steer else None)
    return trace


@torch.no_grad()
def replay(model, trace: Trace, g: int):
    """(snapshot ids (1, T), the full forward's output with its bottleneck parts) of group ``g``."""
    ids = torch.tensor([trace.snapshot(g)], device=model.embed.weight.device)
    ivs = trace.steering(1, trace.groups[g].committed, ids)
    return ids, model(ids, interventions=ivs, return_bottleneck=getattr(model, "bottleneck", None) is not None)


def _named(idx: torch.Tensor, terms: torch.Tensor, acts: torch.Tensor, top: int, name: Callable[[int], str]) -> list[dict]:
    """The ``top`` concepts ``idx`` (J,) by |term| (J,), with their activations (J,)."""
    order = terms.abs().argsort(descending=True)[:top]
    return [{"concept": int(idx[j]), "name": name(int(idx[j])), "activation": float(acts[j]), "term": float(terms[j])}
            for j in order]


@torch.no_grad()
def concept_attribution(model, trace: Trace, names: Sequence[str] | None = None, top: int = 5,
                        keep_terms: bool = False) -> tuple[list[dict], dict]:
    """Per committed token (position order) its logit in its commit state and, with a bottleneck,
    the parts of it (the module docstring); and a summary (``replay_error``, the mean shares).
    ``keep_terms``: each record also holds its full known and unknown terms (tensors, for chunks)."""
    bn = getattr(model, "bottleneck", None)
    label = (lambda c: names[c] if names and c < len(names) else f"#{c}")
    out, err = [], 0.0
    for g, grp in enumerate(trace.groups):
        ids, fwd = replay(model, trace, g)
        pos = torch.tensor(grp.positions)
        y = torch.tensor(grp.tokens)
        logit = fwd.logits[0, pos, y].float()  # (P,)
        err = max(err, float((logit - torch.tensor(grp.logits)).abs().max()))
        parts = att = None
        if bn is not None:  # the committed positions' parts only: (1, P, ...)
            parts = _at(fwd.bottleneck, pos)
            att = bn.attribute(parts, model.logit_weight, y[None])
        for i, p in enumerate(grp.positions):
            if not trace.returned(p):
                continue
            rec: dict[str, Any] = {"position": p, "token": grp.tokens[i], "commit_order": grp.order,
                                   "step": grp.step, "committed_before": grp.committed, "logit": float(logit[i]),
                                   "sampled_logit": grp.logits[i]}
            if att is not None:
                rec.update(_parts(parts, att, i, top, label, keep_terms))
            out.append(rec)
    out.sort(key=lambda r: r["position"])
    summary: dict[str, Any] = {"replay_error": err, "tokens": len(out), "groups": len(trace.groups)}
    if out and bn is not None:
        summary["mean_shares"] = {k: sum(r["shares"][k] for r in out) / len(out) for k in ("known", "unknown", "residual")}
    return out, summary


def _at(parts, pos: torch.Tensor):
    """The bottleneck parts (1, T, ...) at positions ``pos`` (P,): (1, P, ...)."""
    import dataclasses

    take = {f.name: getattr(parts, f.name)[:, pos] for f in dataclasses.fields(parts)
            if isinstance(getattr(parts, f.name), torch.Tensor) and getattr(parts, f.name).dim() >= 2}
    return dataclasses.replace(parts, **take)


def _terms(parts, att, i: int) -> tuple:
    """Committed token i's (known concepts, their terms, activations, unknown concepts, terms,
    activations), each (J,): over all concepts of a dense head, over its top-k of a sparse one
    (ncpctl/model/designs/bottleneck/sparse.py); a top-k head's other concepts have no term."""
    if att.known_index is None:
        k_idx = torch.arange(att.per_concept.shape[-1])
        k_act = parts.k[0, i]
    else:
        k_idx, k_act = att.known_index[0, i], parts.k_value[0, i]
    u_idx = att.unknown_index[0, i]
    u_act = parts.u_value[0, i] if parts.u is None else parts.u[0, i, u_idx]
    return k_idx, att.per_concept[0, i].float(), k_act.float(), u_idx, att.per_unknown[0, i].float(), u_act.float()


def _parts(parts, att, i: int, top: int, label, keep_terms: bool) -> dict:
    """Committed token i's decomposition (``concept_attribution``)."""
    known, unknown, residual = float(att.known[0, i]), float(att.unknown[0, i]), float(att.residual[0, i])
    k_idx, k_terms, k_act, u_idx, u_terms, u_act = _terms(parts, att, i)
    mass = abs(known) + abs(unknown) + abs(residual)
    rec = {"known": known, "unknown": unknown, "residual": residual, "steering": float(att.steering[0, i]),
           "shares": {k: abs(v) / mass if mass else 0.0 for k, v in (("known", known), ("unknown", unknown),
                                                                      ("residual", residual))},
           "concepts": _named(k_idx, k_terms, k_act, top, label),
           "unknown_concepts": _named(u_idx, u_terms, u_act, top, lambda j: f"unknown #{j}")}
    if keep_terms:
        rec["_terms"] = (k_idx.clone(), k_terms.clone(), u_idx.clone(), u_terms.clone())
    return rec


def chunk_attribution(records: list[dict], chunk: int, start: int, names: Sequence[str] | None = None,
                      top: int = 10) -> list[dict]:
    """Chunk-level attribution of ``concept_attribution(..., keep_terms=True)``'s records: generated
    tokens grouped by ``chunk``-token chunks of positions (``start``: the first generated position)."""
    label = (lambda c: names[c] if names and c < len(names) else f"#{c}")
    by: dict[int, list[dict]] = {}
    for r in records:
        by.setdefault(r["position"] // chunk, []).append(r)
    out = []
    for j in sorted(by):
        rows = by[j]
        mass: dict[tuple[str, int], float] = {}
        res = 0.0
        for r in rows:  # each token votes equally: its terms over its total magnitude
            k_idx, k_terms, u_idx, u_terms = r["_terms"]
            total = max(float(k_terms.abs().sum() + u_terms.abs().sum()) + abs(r["residual"]), 1e-8)
            for kind, idx, terms in (("known", k_idx, k_terms), ("unknown", u_idx, u_terms)):
                for c, v in zip(idx.tolist(), (terms / total).tolist()):
                    mass[(kind, c)] = mass.get((kind, c), 0.0) + v / len(rows)
            res += r["residual"] / total / len(rows)
        entries = sorted(mass.items(), key=lambda e: -abs(e[1]))[:top]
        out.append({"chunk": j, "span": [max(j * chunk, start), rows[-1]["position"] + 1], "residual_share": res,
                    "concepts": [{"type": t, "concept": c, "name": label(c) if t == "known" else f"unknown #{c}",
                                  "contribution": v} for (t, c), v in entries]})
    return out


def input_attribution(model, trace: Trace, steps: int = 16, top: int = 5) -> dict[int, dict]:
    """Per committed position: integrated gradients of its logit over its snapshot's inputs (from the
    [MASK] embedding), the ``top`` inputs by |IG|, their sum, the completeness error, and the logit
    at the input and with every input [MASK] (``value``, ``baseline_value``)."""
    from .inputs import Output, integrated_gradients

    out = {}
    for g, grp in enumerate(trace.groups):
        ids = torch.tensor([trace.snapshot(g)], device=model.embed.weight.device)
        steer = (lambda rows, c=grp.committed, ids=ids: trace.steering(rows, c, ids)) if trace.steer else None
        for p, tok in zip(grp.positions, grp.tokens):
            if not trace.returned(p):
                continue
            ig = integrated_gradients(model, ids, Output("logit", (p,), token=tok, steer=steer), range(ids.shape[1]),
                                      trace.mask_id, steps=steps)
            vals = torch.tensor(ig.per_position)
            order = [int(i) for i in vals.abs().argsort(descending=True)[:top] if float(vals[i]) != 0.0]
            out[p] = {"commit_order": grp.order, "sum": float(vals.sum()), "completeness_error": ig.completeness_error,
                      "value": ig.value, "baseline_value": ig.baseline_value,
                      "per_position": ig.per_position,
                      "top": [{"position": i, "token": int(ids[0, i]), "ig": float(vals[i])} for i in order]}
    return out

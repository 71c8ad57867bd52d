"""Input attribution against the [MASK] baseline (``ncpctl inspect --attribute-inputs``, issue 23
item 6): how much each input token (or block of tokens) contributes to one output of a forward.

A Causal Diffusion LM (model/designs/causal_diffusion/module.py) is trained on inputs where any token may be [MASK], so
"this token is absent" has an in-distribution form: the token replaced by [MASK]. A zero embedding
or a pad token is a state the model never saw. An autoregressive model never saw [MASK] either (its
embedding row is untrained, when it exists at all), so it has no such baseline: the CLI refuses it
unless ``--baseline TOKEN`` names one, and then says that it is the user's choice.

The output (``Output``), for a prompt of P tokens:

* CDLM: the sequence is the prompt followed by [MASK] up to the end of the diffusion block that
  holds position P (a whole new block if P starts one): the state in which the sampler
  (inference/causal_diffusion.py) predicts the next tokens. ``logit``: the logit of token y at
  position P, the first [MASK] after the prompt (a CDLM predicts a masked token at its own
  position); y is the target's first token, else the argmax there (never [MASK]). ``concept``:
  the known concept's logit f(h)_c (the bottleneck's known head before its sigmoid) summed over
  those [MASK] positions, the output block (where Steerling's concept readout is trained).
* autoregressive: the sequence is the prompt. ``logit``: token y's logit at position P-1 (the
  position that predicts token P); ``concept``: f(h)_c at P-1.

Two attributions, both against the baseline token b:

* **occlusion**: Δ_u = F(x) − F(x with unit u's tokens replaced by b), per token or per block of
  tokens (``units``); the occluded copies run as rows of batched forwards, each batch with the
  unoccluded row first, so Δ is a difference within one forward (a token the output cannot see,
  e.g. after its block under block-causal attention, gets Δ = 0 exactly);
* **integrated gradients** on the token embeddings, all tokens at once, along the straight path
  from every attributed token's embedding replaced by b's to the input's:
  IG_i = (e_i − e_b) · mean over α of ∂F/∂e_i at e_b + α (e − e_b), α at the midpoints of
  ``steps`` equal intervals. Completeness: Σ_i IG_i ≈ F(x) − F(all attributed tokens = b), the
  error shrinking with the steps (reported). The embeddings are replaced by a forward hook on
  ``model.embed`` (learned positions, gpt2, are added after it and stay).

No I/O; the CLI (ncpctl/cli/inspect_cmd.py) prints and plots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ncpctl.errors import UserError


@dataclass(frozen=True)
class Output:
    """The scalar attributed: ``kind`` "logit" (token ``token``'s logit at ``positions[0]``) or
    "concept" (known concept ``concept``'s logit f(h)_c summed over ``positions``)."""

    kind: str
    positions: tuple[int, ...]
    token: int | None = None
    concept: int | None = None
    # steer(rows) -> the interventions of a forward of ``rows`` rows (a steered CDLM step's, replayed)
    steer: Callable[[int], list] | None = None

    def value(self, out) -> torch.Tensor:
        """One forward's output per row (R,) float32."""
        pos = list(self.positions)
        if self.kind == "logit":
            return out.logits[:, pos[0], self.token].float()
        return out.bottleneck.k_logits[:, pos, self.concept].float().sum(-1)

    def forward(self, model, idx: torch.Tensor):
        ivs = self.steer(idx.shape[0]) if self.steer is not None else None
        return model(idx, return_bottleneck=self.kind == "concept", interventions=ivs)


def is_cdlm(model) -> bool:
    return bool(getattr(model.objective, "block_sampling", False))


def sequence(model, prompt: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
    """(the ids the output is read from, the output positions): CDLM, the prompt then [MASK] to
    the end of position P's block (positions P..); autoregressive, the prompt (position P-1)."""
    P = len(prompt)
    if not is_cdlm(model):
        return list(prompt), (P - 1,)
    block, mask = model.objective.block, model.objective.mask_id
    end = (P // block + 1) * block
    return list(prompt) + [mask] * (end - P), tuple(range(P, end))


def units(n: int, unit: str, size: int) -> list[list[int]]:
    """The occluded units over positions 0..n-1: each token, or blocks of ``size`` aligned to
    absolute positions (a CDLM's diffusion blocks when ``size`` is its block size)."""
    if unit == "token":
        return [[i] for i in range(n)]
    return [list(range(a, min(n, a + size))) for a in range(0, n, size)]


@torch.no_grad()
def occlusion(model, ids: torch.Tensor, output: Output, occluded: Sequence[Sequence[int]], baseline: int,
              batch: int = 32) -> tuple[float, list[float]]:
    """(F(ids), per unit Δ = F(ids) − F(ids with the unit's positions set to ``baseline``)); ids
    (1, T). Each batched forward holds the unoccluded row first and Δ is taken against it."""
    rows = max(1, batch - 1)
    base: float | None = None
    deltas: list[float] = []
    for lo in range(0, len(occluded), rows):
        chunk = occluded[lo : lo + rows]
        x = ids.repeat(len(chunk) + 1, 1)  # (1 + R, T): row 0 unoccluded
        for r, pos in enumerate(chunk, start=1):
            x[r, list(pos)] = baseline
        v = output.value(output.forward(model, x))
        base = float(v[0]) if base is None else base
        deltas += (v[0] - v[1:]).tolist()
    if base is None:
        base = float(output.value(output.forward(model, ids))[0])
    return base, deltas


@dataclass
class IG:
    """Integrated gradients per position (T,) (0 where not attributed), the output at the input
    and at the baseline, and the completeness error Σ IG − (F(x) − F(baseline))."""

    per_position: list[float]
    value: float
    baseline_value: float
    steps: int

    @property
    def completeness_error(self) -> float:
        return sum(self.per_position) - (self.value - self.baseline_value)


def _with_embeddings(model, emb: torch.Tensor, idx: torch.Tensor, output: Output) -> torch.Tensor:
    """The output per row with ``emb`` (R, T, d) as the token embeddings of ``idx`` (R, T)."""
    handle = model.embed.register_forward_hook(lambda m, args, out: emb.to(out.dtype))
    try:
        return output.value(output.forward(model, idx))
    finally:
        handle.remove()


def integrated_gradients(model, ids: torch.Tensor, output: Output, positions: Sequence[int], baseline: int,
                         steps: int = 16, batch: int = 16) -> IG:
    """IG of ``output`` over the token embeddings at ``positions`` of ids (1, T), from ``baseline``'s
    embedding there (the module docstring); ``steps`` path points, ``batch`` of them per forward."""
    if steps < 1:
        raise ValueError(f"integrated_gradients: steps must be >= 1, got {steps}")
    with torch.no_grad():
        x = model.embed(ids)[0].float()  # (T, d)
        b = x.clone()
        b[list(positions)] = model.embed.weight[baseline].float()
        diff = x - b  # (T, d): 0 outside the attributed positions
        ends = _with_embeddings(model, torch.stack([x, b]), ids.repeat(2, 1), output)
    total = torch.zeros_like(x)
    alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
    for lo in range(0, steps, batch):
        a = alphas[lo : lo + batch, None, None]  # (R, 1, 1)
        path = (b + a * diff).requires_grad_(True)  # (R, T, d)
        with torch.enable_grad():
            v = _with_embeddings(model, path, ids.repeat(a.shape[0], 1), output)
            (g,) = torch.autograd.grad(v.sum(), path)
        total += g.float().sum(0)
    ig = (diff * total / steps).sum(-1)  # (T,)
    return IG(per_position=ig.tolist(), value=float(ends[0]), baseline_value=float(ends[1]), steps=steps)


# ----------------------------------------------------------------------------- one prompt, end to end


def default_baseline(model) -> int | None:
    """The CDLM's [MASK]; None for an autoregressive model (it never saw one)."""
    return model.objective.mask_id if is_cdlm(model) else None


def concept_index(names: Sequence[str] | None, name: str, n: int) -> int:
    """A known concept by its name (the checkpoint's ``concept_names``), or ``#N`` by index."""
    if name.startswith("#") and name[1:].isdigit() and int(name[1:]) < n:
        return int(name[1:])
    if names and name in names:
        return list(names).index(name)
    known = ", ".join(list(names or [])[:8]) + (" ..." if names and len(names) > 8 else "")
    raise UserError(f"--concept {name!r}: no such known concept in this checkpoint ("
                    + (f"known: {known}" if names else f"no names recorded; use #0..#{n - 1}") + ")")


def attribute_prompt(model, prompt: list[int], *, baseline: int, target: list[int] | None = None,
                     concept: int | None = None, unit: str = "token", block_tokens: int = 16,
                     ig_steps: int = 16, max_len: int | None = None,
                     decode: Callable[[list[int]], str] = str) -> dict[str, Any]:
    """Occlusion (and IG unless ``ig_steps`` is 0) of one prompt's tokens for the output the
    module docstring defines; a JSON-ready record."""
    if max_len is not None:  # the longest end of the prompt whose sequence fits: the context nearest the output
        keep = min(len(prompt), max_len)
        while keep > 0 and len(sequence(model, prompt[len(prompt) - keep:])[0]) > max_len:
            keep -= 1
        prompt = prompt[len(prompt) - keep:]
    if not prompt:
        raise UserError("--attribute-inputs: the prompt is empty after tokenizing")
    if target is not None and not target:
        raise UserError("--target is empty after tokenizing: give text whose first token is the output")
    ids_list, out_pos = sequence(model, prompt)
    ids = torch.tensor(ids_list, dtype=torch.long)[None]
    P = len(prompt)
    if concept is not None:
        output = Output("concept", out_pos, concept=concept)
        definition = ("the known concept's logit f(h)_c summed over the output block's [MASK] positions"
                      if is_cdlm(model) else "the known concept's logit f(h)_c at the prompt's last position")
    else:
        pos = out_pos[0]
        if target:
            token = target[0]
        else:
            with torch.no_grad():
                logits = model(ids).logits[0, pos, : model.cfg.vocab_size].float()
            if is_cdlm(model):
                logits[model.objective.mask_id] = float("-inf")  # the sampler never commits [MASK]
            token = int(logits.argmax())
        output = Output("logit", (pos,), token=token)
        definition = (f"the logit of token {token} at position {pos}, "
                      + ("the first [MASK] after the prompt" if is_cdlm(model) else "the prompt's last position")
                      + (" (the target's first token)" if target else " (its argmax)"))
    us = units(P, unit, block_tokens)
    value, deltas = occlusion(model, ids, output, us, baseline)
    ig = integrated_gradients(model, ids, output, range(P), baseline, steps=ig_steps) if ig_steps > 0 else None
    tokens = [{"position": i, "id": ids_list[i], "text": decode([ids_list[i]]),
               "occlusion": deltas[i] if unit == "token" else None,
               "ig": ig.per_position[i] if ig is not None else None} for i in range(P)]
    rec: dict[str, Any] = {
        "objective": model.cfg.objective,
        "output": {"kind": output.kind, "positions": list(output.positions), "token": output.token,
                   "token_text": decode([output.token]) if output.token is not None else None,
                   "concept": concept, "definition": definition, "value": value},
        "baseline": {"id": baseline, "text": decode([baseline])},
        "unit": unit, "tokens": tokens,
        "sequence": {"tokens": len(ids_list), "prompt_tokens": P,
                     "text_after_prompt": decode(ids_list[P:])},
    }
    if is_cdlm(model):
        rec["diffusion_block"] = model.objective.block
    if unit == "block":
        rec["block_tokens"] = block_tokens
        rec["blocks"] = [{"span": [u[0], u[-1] + 1], "text": decode(ids_list[u[0] : u[-1] + 1]), "occlusion": d,
                          "ig": sum(ig.per_position[i] for i in u) if ig is not None else None}
                         for u, d in zip(us, deltas)]
    if ig is not None:
        rec["ig"] = {"steps": ig.steps, "value": ig.value, "baseline_value": ig.baseline_value,
                     "sum": sum(ig.per_position), "completeness_error": ig.completeness_error}
    return rec

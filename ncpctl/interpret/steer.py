"""Steering (``ncpctl generate --steer SPEC``): add a concept direction to the decoder input or
to a layer's residual stream while generating, Steerling-style.

A ``SteerSpec`` names

* ``direction``: ``code:S/N`` (codebook code N of segment S, placed in segment S's slice of d),
  ``mix:S:N1=W1+N2=W2...`` (a mix of segment S's codes with those weights: what a block's
  prediction puts in that segment) or ``concept:NAME`` (a labelled concept of the concept
  bottleneck, ``model.bottleneck``: its embedding K_c, Steerling's e_c = K_c / ||K_c||; ``#N`` names
  known concept N by index; ``A+B`` steers along the normalised sum K_A + K_B, Steerling's group
  direction; names come from the checkpoint or a ``--concept-table``);
* ``at``: ``decoder_input`` (default), ``encoder.L`` / ``decoder.L`` (after layer L, 0-based),
  ``decoder.L+`` (after layer L and every later one: Steerling's injection, whose ``inject_layer``
  k is ``decoder.(k-1)+`` on a model without a concept path) or ``readout`` (what the LM head
  reads: after the final norm and the concept bottleneck, where adding gamma * K_c/||K_c|| raises
  known concept c's activation, Steerling's intervention; there the logit units are exact, not
  nominal);
* ``strength`` with its units: ``logit`` (nominal logit units, Steerling's: gamma = strength /
  peak(W_lm . e/||e||), so that the direction alone, read straight through the LM head, would
  raise the most-promoted token's logit by ``strength``; nominal because the decoder layers and
  the final norm lie between) or ``norm`` (gamma is the L2 norm of the added vector). Negative
  strengths suppress;
* the schedule: ``start`` = the first generated token steered (0: the first new token; ``prompt``:
  from the prompt's first token) and ``length`` = at most that many generated tokens (None: all);
* ``penalty`` (logit units, >= 0): Steerling's ReLU-gated suppression (Fig. 19), subtracting
  ``penalty * relu(W_lm . e/||e||) / peak`` from the logits of the steered tokens, so the tokens
  the direction promotes lose at most ``penalty``.

The vector is added at the positions whose logits pick the steered tokens: to steer generated
tokens start .. start+length-1 of a prompt of P tokens, positions P-1+start .. P-2+start+length.
A Causal Diffusion LM picks each token at its own [MASK] position, in confidence order
(``BlockSteering``, Steerling's ``generate_full``): the vector is added at every still-[MASK]
position of each forward while the row has committed c tokens with start <= c < start + length
(Steerling's ``hard_cutoff`` schedule is start 0, length ``cutoff_tokens``; its ``fixed`` one no
length), and the penalty is subtracted from the logits it samples from at those steps (Steerling's
``relu_logit_mask``, whose strength s is penalty = s ||K_c|| peak here); ``start: prompt`` is refused
there (the prompt is never [MASK]).
Written inline as comma-separated ``key=value`` (``code=2/5,at=decoder.1,strength=6logit,length=16``)
or as a JSON/YAML file with the same keys (``SteerSpec.save`` writes one, ``units`` explicit).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from ncpctl.errors import UserError

UNITS = ("logit", "norm")


@dataclass(frozen=True)
class SteerSpec:
    direction: str
    strength: float
    units: str
    at: str = "decoder_input"
    start: int | str = 0
    length: int | None = None
    penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.units not in UNITS:
            raise UserError(f"steer: units must be logit or norm, got {self.units!r}")
        parse_direction(self.direction)
        parse_site(self.at)
        if not (self.start == "prompt" or (isinstance(self.start, int) and self.start >= 0)):
            raise UserError(f"steer: start must be a generated-token index >= 0 or 'prompt', got {self.start!r}")
        if self.length is not None and (not isinstance(self.length, int) or self.length <= 0):
            raise UserError(f"steer: length must be a positive number of tokens, got {self.length!r}")
        if self.penalty < 0:
            raise UserError(f"steer: penalty is a suppression in logit units, >= 0; got {self.penalty}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        from ncpctl.fsutil import atomic_write

        atomic_write(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "steer") -> "SteerSpec":
        known = {f.name for f in fields(cls)}
        d = dict(d)
        for kind in ("code", "mix", "concept"):  # the inline shorthand's keys
            if kind in d:
                d["direction"] = f"{kind}:{d.pop(kind)}"
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{where}: unknown key {unknown[0]!r} (known: code, mix, concept, {', '.join(sorted(known))})")
        if "direction" not in d:
            raise UserError(f"{where}: no direction (code=S/N, mix=S:N=W+..., concept=NAME, or direction=...)")
        if "strength" not in d:
            raise UserError(f"{where}: no strength (e.g. strength=6logit)")
        if "units" not in d:
            d["strength"], d["units"] = _strength(d["strength"], where)
        try:
            d["strength"] = float(d["strength"])
            d["penalty"] = float(d.get("penalty", 0.0))
        except (TypeError, ValueError):
            raise UserError(f"{where}: strength and penalty must be numbers") from None
        return cls(**d)

    @classmethod
    def parse(cls, text: str) -> "SteerSpec":
        """Inline ``key=value,...`` or the path of a JSON/YAML file."""
        p = Path(text)
        if text.endswith((".json", ".yaml", ".yml")) or (p.is_file() and "=" not in text):
            return cls.load(p)
        d: dict[str, Any] = {}
        for part in filter(None, (x.strip() for x in text.split(","))):
            if "=" not in part:
                raise UserError(f"--steer {text!r}: {part!r} is not key=value")
            k, v = part.split("=", 1)
            d[k.strip()] = _scalar(v.strip()) if k.strip() not in ("code", "mix", "concept", "direction", "at") \
                else v.strip()
        return cls.from_dict(d, where=f"--steer {text!r}")

    @classmethod
    def load(cls, path: Path) -> "SteerSpec":
        try:
            raw = path.read_text()
        except OSError as e:
            raise UserError(f"{path}: cannot read the steering spec ({e.strerror or e})") from None
        import yaml

        try:
            d = yaml.safe_load(raw)  # JSON is YAML
        except yaml.YAMLError as e:
            raise UserError(f"{path}: not JSON or YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(d, dict):
            raise UserError(f"{path}: a steering spec is a mapping of keys (direction, strength, units, ...)")
        return cls.from_dict(d, where=str(path))


def _scalar(v: str) -> Any:
    if v == "prompt":
        return v
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def _strength(v: Any, where: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(logit|logits|norm)\s*", str(v))
    if m is None:
        raise UserError(f"{where}: strength {v!r} has no units: write e.g. {v}logit (nominal logit units) "
                        f"or {v}norm (the added vector's L2 norm)")
    return float(m.group(1)), "logit" if m.group(2).startswith("logit") else "norm"


def parse_direction(text: str) -> tuple[str, int, dict[int, float]]:
    """``code:S/N`` -> ("code", S, {N: 1}); ``mix:S:N1=W1+N2=W2`` -> ("mix", S, {N1: W1, ...})."""
    m = re.fullmatch(r"code:(\d+)/(\d+)", text)
    if m:
        return "code", int(m.group(1)), {int(m.group(2)): 1.0}
    m = re.fullmatch(r"mix:(\d+):(.+)", text)
    if m:
        weights = {}
        for part in m.group(2).split("+"):
            mm = re.fullmatch(r"(\d+)=([+-]?(?:\d+\.?\d*|\.\d+))", part.strip())
            if mm is None:
                raise UserError(f"steer: direction {text!r}: {part!r} is not CODE=WEIGHT")
            weights[int(mm.group(1))] = float(mm.group(2))
        return "mix", int(m.group(1)), weights
    m = re.fullmatch(r"concept:(.+)", text)
    if m:
        return "concept", -1, {m.group(1).strip(): 1.0}  # type: ignore[dict-item]  (a name, resolved later)
    raise UserError(f"steer: direction {text!r}: expected code:S/N, mix:S:N=W+N=W or concept:NAME")


def parse_site(text: str) -> tuple[str, int | None]:
    if text in ("decoder_input", "readout"):
        return text, None
    m = re.fullmatch(r"(encoder|decoder)\.(\d+)\+?", text)
    if m is None:
        raise UserError(f"steer: at {text!r}: expected decoder_input, readout, encoder.L, decoder.L or decoder.L+")
    return m.group(1), int(m.group(2))


# ----------------------------------------------------------------------------- against a model


def direction_vector(model, spec: SteerSpec, names: Sequence[str] | None = None):
    """The spec's direction e (d,): from the model's codebook (a UserError naming a bad code), or
    for ``concept:NAME`` the bottleneck's embedding K_c of labelled concept NAME (``names``: the
    checkpoint's ``concept_names``), as Steerling steers."""
    import torch

    kind, _, weights = parse_direction(spec.direction)
    if kind == "concept":
        (group,) = weights
        if getattr(model, "bottleneck", None) is None:
            raise UserError(f"steer: direction {spec.direction!r}: this checkpoint has no concept bottleneck "
                            f"(model.bottleneck), so no labelled concepts to steer with")
        idx = [_concept_index(spec.direction, name.strip(), names, model.bottleneck) for name in group.split("+")]
        if len(idx) == 1:
            return model.bottleneck.concept_direction(idx[0]).detach().float()
        return model.bottleneck.K.detach()[idx].float().sum(0)  # Steerling's group: the summed embeddings
    if model.concept is None:
        raise UserError("steer: this checkpoint has no concept path, so no codebook to steer with")
    codes = model.concept.codebook().detach().float()  # (S, N, ds)
    S, N, ds = codes.shape
    _, s, weights = parse_direction(spec.direction)
    if s >= S:
        raise UserError(f"steer: direction {spec.direction!r}: segment {s} does not exist (the model has {S})")
    bad = [n for n in weights if n >= N]
    if bad:
        raise UserError(f"steer: direction {spec.direction!r}: code {bad[0]} does not exist ({N} codes per segment)")
    e = torch.zeros(S * ds)
    for n, w in weights.items():
        e[s * ds : (s + 1) * ds] += w * codes[s, n]
    if float(e.norm()) == 0.0:
        raise UserError(f"steer: direction {spec.direction!r} is the zero vector")
    return e


def _concept_index(direction: str, name: str, names: Sequence[str] | None, bottleneck) -> int:
    """Known concept ``name`` (or ``#N``) of ``bottleneck`` whose known concepts are named ``names``."""
    if re.fullmatch(r"#\d+", name):
        if int(name[1:]) >= bottleneck.n:
            raise UserError(f"steer: direction {direction!r}: {name} is not a known concept (the model has "
                            f"{bottleneck.n})")
        return int(name[1:])
    if not names:
        raise UserError(f"steer: direction {direction!r}: the checkpoint records no concept names (train it on a "
                        f"dataset with data.labels, or name a --concept-table, or give #N)")
    if name not in names:
        import difflib

        near = difflib.get_close_matches(name, list(names), n=1)
        listed = ", ".join(names) if len(names) <= 64 else "search them with inspect --find-concept"
        raise UserError(f"steer: direction {direction!r}: unknown concept {name!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "") + f"; the {len(names)} known: {listed}")
    return list(names).index(name)


def _head_response(model, e):
    """W_lm . e/||e|| over the real vocabulary (V,), and its peak (the largest entry): the steering
    stage's definition (``ncpctl.model.designs.bottleneck.module.head_response``; muP: W / s_token, as the logits)."""
    from ncpctl.model.designs.bottleneck.module import head_response

    resp, peak = head_response(model.logit_weight, e, model.cfg.vocab_size)
    return resp, float(peak)


@dataclass
class Resolved:
    """A spec against a model: the vector to add and the logit penalty (V,) or None."""

    spec: SteerSpec
    vector: Any
    penalty: Any | None
    gamma: float
    peak: float

    def describe(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "gamma": self.gamma, "peak_logit_per_unit_norm": self.peak}


def resolve(model, spec: SteerSpec, names: Sequence[str] | None = None) -> Resolved:
    """``spec`` against ``model`` (``names``: the checkpoint's labelled concepts, for concept:NAME)."""
    import torch

    kind, layer = parse_site(spec.at)
    if layer is not None:
        n = len(getattr(model, kind))
        if layer >= n:
            raise UserError(f"steer: at {spec.at!r}: the {kind} has {n} layers (0..{n - 1})")
    e = direction_vector(model, spec, names)
    resp, peak = _head_response(model, e)
    if spec.units == "logit" and peak <= 0:
        raise UserError(f"steer: direction {spec.direction!r} raises no token's logit (peak {peak:.3g}): "
                        f"give its strength in norm units")
    gamma = spec.strength / peak if spec.units == "logit" else spec.strength
    penalty = spec.penalty * torch.relu(resp) / peak if spec.penalty and peak > 0 else None
    return Resolved(spec, gamma * e / e.norm(), penalty, gamma, peak)


def interventions_for(resolved: Sequence[Sequence[Resolved]], prompt_lengths: Sequence[int]) -> list:
    """One intervention per (row, spec): rows are batch rows, positions each row's own."""
    out = []
    for row, (specs, P) in enumerate(zip(resolved, prompt_lengths)):
        for r in specs:
            s = r.spec
            if s.start == "prompt":
                start, length = 0, None if s.length is None else P - 1 + s.length
            else:
                start, length = P - 1 + s.start, s.length
            out.append(_addition(r, start=start, length=length, rows=[row]))
    return out


def _addition(r: Resolved, **where: Any):
    """The intervention adding ``r``'s vector at its site, applying where ``where`` says."""
    from ncpctl.model.core.interventions import AddToDecoderInput, AddToReadout, AddToResidual

    kind, layer = parse_site(r.spec.at)
    if kind == "readout":
        return AddToReadout(vector=r.vector, **where)
    if layer is None:
        return AddToDecoderInput(vector=r.vector, **where)
    return AddToResidual(vector=r.vector, stack=kind, layer=layer, onward=r.spec.at.endswith("+"), **where)


@dataclass
class BlockSteering:
    """Steering of a Causal Diffusion LM's block-wise sampling (the block sampler's ``steer`` hook;
    the module docstring): ``rows[b]``, row b's resolved specs."""

    rows: Sequence[Sequence[Resolved]]

    @staticmethod
    def active(spec: SteerSpec, committed: int) -> bool:
        """Whether a row that has committed ``committed`` tokens is steered by ``spec`` now."""
        first = int(spec.start)
        return committed >= first and (spec.length is None or committed < first + spec.length)

    def interventions(self, where, committed: Sequence[int]) -> list:
        """The additions of one forward: each active spec of row b at its still-[MASK] slots ``where`` (B, n)."""
        out = []
        for b, specs in enumerate(self.rows):
            for r in specs:
                if self.active(r.spec, committed[b]):
                    own = where.clone()
                    own[:b] = False
                    own[b + 1:] = False
                    out.append(_addition(r, where=own))
        return out

    def adjust(self, row: int, committed: int, logits):
        """Row ``row``'s logits (n, V) less the penalties of its active specs."""
        for r in self.rows[row]:
            if r.penalty is not None and self.active(r.spec, committed):
                V = r.penalty.shape[0]
                logits = logits.clone()
                logits[:, :V] -= r.penalty.to(logits)
        return logits


def block_steering(resolved: Sequence[Sequence[Resolved]]) -> BlockSteering:
    """``BlockSteering`` of per-row specs (a UserError for a schedule block-wise sampling has not)."""
    for specs in resolved:
        for r in specs:
            if r.spec.start == "prompt":
                raise UserError("steer: start=prompt steers the prompt's positions, which a Causal Diffusion LM never "
                                "samples (it steers its [MASK] positions); give start=N, the committed tokens after "
                                "which steering begins")
    return BlockSteering(list(resolved))


def logit_adjuster(resolved: Sequence[Sequence[Resolved]]):
    """``f(step, logits (B, V))`` subtracting each row's active penalties at generated token
    ``step``; None when no spec has a penalty."""
    if not any(r.penalty is not None for specs in resolved for r in specs):
        return None

    def adjust(step: int, logits):
        logits = logits.clone()
        for row, specs in enumerate(resolved):
            for r in specs:
                s = r.spec
                first = 0 if s.start == "prompt" else s.start
                if r.penalty is None or step < first or (s.length is not None and step >= first + s.length):
                    continue
                V = r.penalty.shape[0]
                logits[row, :V] -= r.penalty.to(logits)
        return logits

    return adjust


def specs_from(value: Any, where: str) -> list[SteerSpec]:
    """A prompts file's ``steer`` value: None, inline text, a mapping, or a list of those."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(SteerSpec.parse(item))
        elif isinstance(item, dict):
            out.append(SteerSpec.from_dict(item, where=where))
        else:
            raise UserError(f"{where}: steer must be text, a mapping or a list of them, got {type(item).__name__}")
    return out

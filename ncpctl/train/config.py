"""What DeepSpeed is given, all derived from the recipe (one source of truth for batch sizes).

* ``deepspeed_config(recipe, on_gpu)``: the DeepSpeed JSON config; ``deepspeed.extra`` merged last.
* ``param_groups(model, weight_decay, muon)``: optimizer groups. No weight decay on 1-D
  parameters (norm weights, biases) nor on the token embedding (GPT-NeoX / nanoGPT practice);
  frozen parameters (the SimVQ codebook base, everything adapt-vq freezes) are left out
  entirely. With ``muon`` the hidden matrices (``muon_matrices``) form their own group.
* ``muon_matrices(model)``: which parameters ``train.optimizer: muon`` orthogonalises (the rule
  is in its docstring); ``fused_rows(model)``: the logical matrices stacked in a fused one (q, k, v
  in ``attn.qkv``; gate, up in a SwiGLU ``mlp.fc``), each orthogonalised on its own;
  ``ncpctl.train.muon.MuonAdamW`` is the optimizer.
* decoupled muP (``model.mup_base_width``, DLCM Sec. 6.1): the hidden matrices of the token and
  the concept module (``ncpctl.model.designs.mup.module``) get groups of their own whose ``lr_mult`` and
  ``eps_mult`` (1/s of the module) ``apply_mup`` turns into the group's lr and AdamW epsilon,
  from the module's base rate (``base_lrs``: Sec. 6.1.1's eta_base_token, eta_base_concept and
  eta_base_others = ``train.mup_lr_token``, ``mup_lr_concept``, ``lr``).
* ``GuardedAdamW``: torch AdamW that skips a step whose gradient is not finite. DeepSpeed's
  ZeRO optimizers (stages 1-3) already skip such steps in fp32 (an invalid global norm marks
  an overflow); the plain stage-0 fp32 path does not, so there this optimizer clips, measures
  the norm and skips, and DeepSpeed's own clipping is switched off (same ``train.grad_clip``).
* ``lr_schedule(recipe)``: linear warmup to ``train.lr`` then cosine decay to ``train.min_lr``
  at ``train.max_steps`` (or WSD: stable at ``train.lr``, then the last ``decay_steps`` decay to
  ``min_lr``), as the multiplier a ``torch.optim.lr_scheduler.LambdaLR`` expects.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from ncpctl.errors import UserError
from ncpctl.model.core.config import deep_merge
from ncpctl.recipe.length import warmup_steps
from ncpctl.recipe.load import Recipe


def use_bf16(recipe: Recipe, on_gpu: bool) -> bool:
    """``train.precision``: auto = bf16 on GPU, fp32 on CPU."""
    p = recipe.train.precision
    return p == "bf16" or (p == "auto" and on_gpu)


def guard_in_optimizer(recipe: Recipe, on_gpu: bool) -> bool:
    """Stage 0 fp32: DeepSpeed hands our optimizer the raw gradients, so it must guard them."""
    return recipe.deepspeed.zero_stage == 0 and not use_bf16(recipe, on_gpu)


def deepspeed_config(recipe: Recipe, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config for ``recipe``; ``deepspeed.extra`` is merged in last."""
    t, ds = recipe.train, recipe.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    bf16 = use_bf16(recipe, on_gpu)
    cfg: dict[str, Any] = {
        "train_batch_size": recipe.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": recipe.grad_accum_steps,
        # stage 0 fp32: GuardedAdamW clips (and reports the pre-clip norm); see the module doc
        "gradient_clipping": 0.0 if guard_in_optimizer(recipe, on_gpu) else t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # our torch AdamW (subclass) under ZeRO
        "steps_per_print": 2**62,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"]["check_grad_overflow"] = True  # ZeRO-2/3: what skips a non-finite step under bf16
        if bf16_optimizer(ds.zero_stage, ds.offload_optimizer):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}  # -> DeepSpeed's BF16_Optimizer
    return deep_merge(cfg, ds.extra)


def bf16_optimizer(zero_stage: int, offload: bool) -> bool:
    """Whether bf16 training at this ZeRO stage runs DeepSpeed's ``BF16_Optimizer`` (``data_types.
    grad_accum_dtype: fp32`` at ZeRO-1 without offload) instead of its ZeRO optimizer.

    Why (issue 45, the first H200 profile: ~300 ``isfinite`` per pythia-160m step and a host sync):
    under bf16 DeepSpeed 0.19's ZeRO optimizer skips a non-finite step only through
    ``bf16.check_grad_overflow``, a reduction and test per gradient tensor plus a sync, before it
    computes the global norm that clipping needs anyway; switched off, a non-finite gradient is
    applied (the weights become NaN) because that flag also gates the norm's own test. The
    ``BF16_Optimizer`` has no per-tensor pass: the one global norm decides (a non-finite norm skips
    the step and clears the gradients), and it keeps fp32 master weights and accumulates gradients
    in fp32 (what ZeRO-1 reduces in bf16). Its checkpoints (``bf16_zero_pp_rank_*``) resume exactly
    and re-partition like ZeRO-1's. DeepSpeed builds it for stage 1 only; ``deepspeed.extra:
    {data_types: {grad_accum_dtype: bf16}}`` selects the ZeRO optimizer again."""
    return zero_stage == 1 and not offload


# Linears that stay on AdamW under ``train.optimizer: muon`` although they are 2-D, and why.
MUON_EXCLUDED = {
    "lm_head": "the LM head: one row per token, an output layer over the vocabulary",
    "concept.heads": "the concept heads: one output per code (S x N), an output layer over the codebook",
    "concept.codebook": "the codebook: the code vectors (SimVQ base and the transform that makes them)",
}


def muon_matrices(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters ``train.optimizer: muon`` orthogonalises, by name (NCP-ArchPreview §3.6).

    The rule: the weight of every trainable ``nn.Linear`` whose two sides are hidden features,
    i.e. all Linears except those under ``MUON_EXCLUDED`` (the LM head, the concept heads, the
    codebook) and except inside depth mixers (modules marked ``no_weight_decay``: their weights
    are mixing coefficients, not feature maps). Everything else goes to AdamW: embeddings
    (``nn.Embedding`` tables, indexed by token or position), norms, biases, the excluded Linears.
    """
    exempt = {id(m) for mixer in model.modules() if getattr(mixer, "no_weight_decay", False)
              for m in mixer.modules()}
    out: dict[str, torch.nn.Parameter] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or id(m) in exempt or not m.weight.requires_grad:
            continue
        if any(name == k or name.startswith(k + ".") for k in MUON_EXCLUDED):
            continue
        out[f"{name}.weight"] = m.weight
    return out


def fused_rows(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``weight name -> row counts`` of each Linear that stacks several logical matrices along its
    output rows, as the modules declare them (``fused_rows = {child: rows}``: ``attn.qkv`` is
    (H hd, Hkv hd, Hkv hd), a SwiGLU ``mlp.fc`` (ffn, ffn), DLCM's ``wkv`` (d, d)). Per-matrix Muon
    orthogonalises each block alone; the fused weight itself (checkpoints, HF parity) is unchanged.
    A Linear wrapped by LoRA has no ``.weight`` of its own (its adapters are not split)."""
    params = dict(model.named_parameters())
    out: dict[str, tuple[int, ...]] = {}
    for name, m in model.named_modules():
        for child, rows in getattr(m, "fused_rows", {}).items():
            key = f"{name}.{child}.weight" if name else f"{child}.weight"
            if key in params:
                assert sum(rows) == params[key].shape[0], (key, rows, params[key].shape)
                out[key] = tuple(rows)
    return out


# Group name suffix of each muP module (stable: a checkpoint's groups are matched by position and name)
MUP_SUFFIX = {"token": "_token", "concept": "_concept"}


def param_groups(model: torch.nn.Module, weight_decay: float, muon: bool = False) -> list[dict[str, Any]]:
    """Trainable parameters split into decayed matrices and undecayed vectors/embeddings, and
    with ``muon`` the hidden matrices (``muon_matrices``, decayed too) first in a group of their own.

    Parameters of modules marked ``no_weight_decay`` (depth mixers: their weights are mixing
    coefficients, not features; ncp-model.md section 8) are never decayed either.

    Decoupled muP (``model.mup_base_width``): the hidden matrices of the token and the concept
    module get groups of their own, ``decay_token`` / ``decay_concept`` (AdamW) or ``muon_token`` /
    ``muon_concept`` (Muon), whose ``mup`` names the module and ``lr_mult`` = ``eps_mult`` = 1/s of
    it: the group's lr (and so the LambdaLR schedule, which multiplies each group's initial lr) is
    the module's base rate / s (``apply_mup``) and its AdamW epsilon train.eps / s. Every other group
    keeps lr_mult 1 and train.lr."""
    from ncpctl.model.designs.mup.module import hidden_linears

    exempt = {id(p) for m in model.modules() if getattr(m, "no_weight_decay", False) for p in m.parameters()}
    hidden = {id(p) for p in muon_matrices(model).values()} if muon else set()
    module_of = {id(lin.weight): (kind, 1.0 / s) for lin, kind, s in hidden_linears(model).values()}
    buckets: dict[str, dict[str, Any]] = {}

    def put(name: str, p: torch.nn.Parameter, decayed: bool, is_muon: bool = False, mult: float | None = None,
            kind: str | None = None) -> None:
        g = buckets.setdefault(name, {"params": [], "weight_decay": weight_decay if decayed else 0.0, "name": name})
        if is_muon:
            g["muon"] = True
        if mult is not None:  # a muP group: its module (token | concept) and 1/s of it
            g["mup"], g["lr_mult"], g["eps_mult"] = kind, mult, mult
        g["params"].append(p)

    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # frozen, or a tied weight already listed
            continue
        seen.add(id(p))
        kind, mult = module_of.get(id(p), (None, None))
        suffix = MUP_SUFFIX[kind] if kind else ""
        if id(p) in hidden:
            put("muon" + suffix, p, True, is_muon=True, mult=mult, kind=kind)
        elif kind:
            put("decay" + suffix, p, True, mult=mult, kind=kind)
        else:
            put("no_decay" if p.ndim < 2 or name.startswith("embed.") or id(p) in exempt else "decay", p,
                p.ndim >= 2 and not name.startswith("embed.") and id(p) not in exempt)
    order = ["muon", "muon_token", "muon_concept", "decay", "decay_token", "decay_concept", "no_decay"]
    return [buckets[n] for n in order if n in buckets]


def base_lrs(train: Any) -> dict[str, float]:
    """Decoupled muP's base rates by module (DLCM Sec. 6.1.1: eta_base_token, eta_base_concept; the
    others' eta_base_others is train.lr): ``train.mup_lr_token`` / ``mup_lr_concept``, train.lr if null."""
    return {"token": train.mup_lr_token or train.lr, "concept": train.mup_lr_concept or train.lr}


def apply_mup(groups: list[dict[str, Any]], lr: float, eps: float,
              base: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Each group's lr and epsilon: its base rate (a muP group's module's in ``base``, else ``lr``)
    and train.eps, times its muP multipliers (1 without)."""
    for g in groups:
        rate = (base or {}).get(g.get("mup"), lr)
        g["lr"], g["eps"] = rate * g.get("lr_mult", 1.0), eps * g.get("eps_mult", 1.0)
    return groups


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that (optionally) clips and skips non-finite steps, the way DeepSpeed's ZeRO
    optimizers do: ``overflow`` tells the engine the step was skipped (it then counts it and
    does not advance the lr schedule), ``_global_grad_norm`` is the pre-clip norm it reports.

    With ``guard=False`` (ZeRO stages: their wrapper guards, clips and measures) this is plain AdamW.
    """

    def __init__(self, params: Iterable[Any], *, guard: bool, max_norm: float, **kw: Any):
        super().__init__(params, **kw)
        self.guard, self.max_norm = guard, max_norm
        self.overflow = False
        self._global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if not self.guard:
            return self._update(closure)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        self._global_grad_norm = float(norm)  # before clipping, like DeepSpeed reports it
        self.overflow = not math.isfinite(self._global_grad_norm)
        if self.overflow:  # leave the weights and the moments untouched; the engine counts it
            return None
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        return self._update(closure)

    def _update(self, closure: Callable[[], Any] | None) -> Any:
        """The update proper (AdamW here; ``MuonAdamW`` adds its Muon groups)."""
        return super().step(closure)


def make_optimizer(model: torch.nn.Module, recipe: Recipe, on_gpu: bool) -> GuardedAdamW:
    """``train.optimizer``: AdamW on every group, or Muon on the hidden matrices + AdamW on the rest
    (``MuonAdamW``; after ``deepspeed.initialize`` call its ``bind(engine.optimizer)``)."""
    t = recipe.train
    groups = apply_mup(param_groups(model, t.weight_decay, muon=t.optimizer == "muon"), t.lr, t.eps, base_lrs(t))
    kw = dict(guard=guard_in_optimizer(recipe, on_gpu), max_norm=t.grad_clip, lr=t.lr,
              betas=(t.betas[0], t.betas[1]), eps=t.eps, weight_decay=t.weight_decay)
    if on_gpu:  # one fused kernel for the whole group instead of a loop of per-parameter kernels (CPU: as tested)
        kw["fused"] = True
    if t.optimizer == "adamw":
        return GuardedAdamW(groups, **kw)
    from ncpctl.train.muon import MuonAdamW

    if not any(g.get("muon") for g in groups):
        raise UserError(f"{recipe.path}: train.optimizer: muon: this model has no trainable hidden matrix to "
                        "orthogonalise (Muon takes the weights of nn.Linear layers other than "
                        f"{', '.join(MUON_EXCLUDED)})", hint="use train.optimizer: adamw")
    params = dict(model.named_parameters())
    rows = {id(params[n]): r for n, r in fused_rows(model).items()}
    return MuonAdamW(groups, rows=rows, momentum=t.muon_momentum, lr_scale=t.muon_lr_scale, **kw)


def schedule_change(old_train: dict[str, Any], recipe: Recipe, step: int) -> str | None:
    """How resuming at ``step`` reshapes the learning-rate schedule the checkpoint trained with
    (``old_train``: the ``train`` section of its recipe.resolved.yaml): one line naming the keys
    that changed and the lr at ``step`` under the old and the new schedule; None when unchanged."""
    from types import SimpleNamespace

    t = recipe.train
    try:
        total, warm = int(old_train["max_steps"]), old_train.get("warmup_steps")
        warm = warmup_steps(None if warm is None else int(warm), float(old_train.get("warmup_fraction", 0.0)), total)
        before = {"max_steps": total, "warmup": warm, "lr": float(old_train["lr"]), "min_lr": float(old_train["min_lr"]),
                  "schedule": old_train.get("schedule", "cosine")}
        if before["schedule"] == "wsd":
            before.update(decay=int(old_train["decay_steps"]), decay_shape=old_train.get("decay_shape", "sqrt"))
    except (KeyError, TypeError, ValueError):  # an older or hand-edited recipe: nothing to compare
        return None
    after = {"max_steps": t.max_steps, "warmup": recipe.warmup_steps, "lr": t.lr, "min_lr": t.min_lr,
             "schedule": t.schedule}
    if t.schedule == "wsd":
        after.update(decay=recipe.decay_steps, decay_shape=t.decay_shape)
    changed = [k for k in {**before, **after} if before.get(k) != after.get(k)]
    if not changed:
        return None
    old = SimpleNamespace(warmup_steps=before["warmup"], decay_steps=before.get("decay", 0), train=SimpleNamespace(
        max_steps=before["max_steps"], lr=before["lr"], min_lr=before["min_lr"], schedule=before["schedule"],
        decay_shape=before.get("decay_shape")))
    lr_old, lr_new = (r.train.lr * lr_schedule(r)(step) for r in (old, recipe))  # type: ignore[arg-type]

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, (int, float)) else str(v)

    diff = ", ".join(f"{k} {fmt(before.get(k))} -> {fmt(after.get(k))}" for k in changed)
    return (f"the learning-rate schedule differs from the checkpoint's ({diff}): from step {step} the lr follows "
            f"the new one ({lr_new:.3g} now; the old schedule would give {lr_old:.3g})")


def lr_schedule(recipe: Recipe) -> Callable[[int], float]:
    """``step -> lr / train.lr`` for the step about to be taken (0-based).

    Warmup: (step+1)/warmup for step < warmup (the first step already has a non-zero lr).
    ``cosine``: then cosine from 1 to min_lr/lr over the remaining steps, reaching min_lr at max_steps.
    ``wsd``: then 1 up to step S = max_steps - decay_steps (the stable phase, S included), then
    min_lr/lr + (1 - min_lr/lr) f(p) at p = (step - S) / decay_steps, reaching min_lr at max_steps,
    with f(p) = 1 - p (linear), (1 + cos(pi p)) / 2 (cosine) or 1 - sqrt(p) (sqrt): ``DECAY_SHAPES``.
    The lr of a step depends only on S, decay_steps and the shape, not on when S was decided, so
    a decay branch from step S equals the straight run.
    A plain function (not a callable object) so LambdaLR's state_dict does not pickle it:
    midtrain's new schedule is never replaced by the checkpoint's.
    """
    warm, total = recipe.warmup_steps, recipe.train.max_steps
    floor = recipe.train.min_lr / recipe.train.lr
    if getattr(recipe.train, "schedule", "cosine") == "wsd":
        decay, shape = recipe.decay_steps, DECAY_SHAPES[recipe.train.decay_shape]
        stable_end = total - decay

        def wsd(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if step <= stable_end:
                return 1.0
            return floor + (1.0 - floor) * shape(min(1.0, (step - stable_end) / decay))

        return wsd

    def multiplier(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


# train.decay_shape: p (the fraction of the decay done, 0..1) -> the share of lr - min_lr left
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}

"""One bf16 DeepSpeed engine per ZeRO stage on the debug model, one AdamW step at lr 3e-3 from
the same batch; prints one JSON line per stage: the wrapper DeepSpeed chose, the dtype of its
master weights, AdamW's step count after the step, and how far the step moved the zero-initialised
biases, over lr (AdamW's first step moves an entry by lr * g / (|g| + eps), ~lr wherever |g| >> eps;
the biases start at 0, where bf16 resolves 3e-3 to 0.4 %, so the bf16 model weights show it).

``--resume DIR``: then bf16 at ZeRO-1 (DeepSpeed's ``BF16_Optimizer``,
``ncpctl.train.config.bf16_optimizer``, at its default clipping): a NaN loss at step 2 of 3 is
skipped (the step not applied, the weights finite), the engine saves a checkpoint into DIR and
takes two more steps, and a second engine built from the same seed loads that checkpoint (through
``deepspeed_loads_safely``, as a resume does) and takes the same two, a third through
``ncpctl.train.elastic.load`` (the universal checkpoint a resume on another world size converts
to); one more JSON line: the wrapper, the applied flags, the files written, the engines' losses
after the checkpoint and whether their weights and fp32 masters are bit-identical.

Run by ``test_bf16.py``: ``python -m tests.train.bf16_step --stages 0 1 2 3 --resume DIR``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ncpctl.recipe import load_recipe
from tests.conftest import RECIPES

LR = 3e-3


def masters(wrapper) -> list[torch.Tensor]:
    """The fp32 copies each wrapper keeps (stage 0: per parameter; 1 (BF16_Optimizer) and 2: flat partitions;
    3: flat sub-groups)."""
    for name in ("fp32_groups", "fp32_groups_flat_partition", "single_partition_of_fp32_groups",
                 "fp32_partitioned_groups_flat"):
        if hasattr(wrapper, name):
            groups = getattr(wrapper, name)
            return [t for g in groups for t in (g if isinstance(g, list) else [g])]
    raise AssertionError(type(wrapper).__name__)


def run_stage(stage: int, d) -> dict:
    import deepspeed

    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.engine import build_engine

    recipe = load_recipe(RECIPES / "debug.yaml", [
        "model.max_seq_len=64", "train.seq_len=32", "train.precision=bf16", "train.warmup_steps=0",
        f"train.lr={LR}", f"train.min_lr={LR}", "train.grad_clip=0", "train.micro_batch_size=2",
        "train.global_batch_size=2", f"deepspeed.zero_stage={stage}"])
    torch.manual_seed(0)
    model = NCPModel(recipe.model_config)
    biases = [n for n, p in model.named_parameters() if p.ndim == 1 and not p.any()]
    engine, _ = build_engine(recipe, model, d)
    batch = torch.randint(0, recipe.model_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    out = engine(batch[:, :-1], batch[:, 1:])
    engine.backward(out.loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([params[n] for n in biases], enabled=stage == 3):
        moved = torch.cat([params[n].detach().float().abs().flatten() for n in biases])
    inner = engine.optimizer.optimizer
    return {"stage": stage, "wrapper": type(engine.optimizer).__name__,
            "masters": sorted({str(t.dtype) for t in masters(engine.optimizer)}),
            "model": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "adam_steps": sorted({float(s["step"]) for s in inner.state.values()}),
            "bias_step_over_lr": round(moved.max().item() / LR, 4)}


def _zero1(d, sets: tuple[str, ...] = ()):
    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.engine import build_engine

    recipe = load_recipe(RECIPES / "debug.yaml", [
        "model.max_seq_len=64", "train.seq_len=32", "train.precision=bf16", "train.warmup_steps=0", f"train.lr={LR}",
        "train.min_lr=3e-4", "train.max_steps=10", "train.micro_batch_size=2", "train.global_batch_size=2",
        "deepspeed.zero_stage=1", *sets])
    torch.manual_seed(0)
    return build_engine(recipe, NCPModel(recipe.model_config), d)[0]


def _steps(engine, batches, nan_at: int | None = None) -> tuple[list[float], list[bool]]:
    losses, applied = [], []
    for i, b in enumerate(batches):
        out = engine(b[:, :-1], b[:, 1:])
        engine.backward(out.loss * float("nan") if i == nan_at else out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        applied.append(bool(engine.was_step_applied()))
    return losses, applied


def _state(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()] + [t.clone() for t in masters(engine.optimizer)]


def run_resume(path: Path, d) -> dict:
    from ncpctl.safe_load import deepspeed_loads_safely
    from ncpctl.train import elastic

    a = _zero1(d)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.module.cfg.vocab_size, (2, 33), generator=g) for _ in range(5)]
    _, applied = _steps(a, batches[:3], nan_at=1)
    finite = all(bool(torch.isfinite(t).all()) for t in _state(a))
    a.save_checkpoint(str(path), tag="ckpt", save_latest=False)
    after_a, _ = _steps(a, batches[3:])
    b = _zero1(d)
    with deepspeed_loads_safely():
        b.load_checkpoint(str(path), tag="ckpt", load_optimizer_states=True, load_lr_scheduler_states=True)
    after_b, _ = _steps(b, batches[3:])
    # and through the re-partitioning path (DeepSpeed's universal checkpoint, what another world size takes)
    c = _zero1(d)
    elastic.load(c, path / "ckpt", 1, 1, path.parent / "elastic", d, lambda msg: None)
    after_c, _ = _steps(c, batches[3:])
    return {"resume": True, "wrapper": type(a.optimizer).__name__, "applied": applied, "finite": finite,
            "files": sorted(p.name for p in (path / "ckpt").iterdir()), "losses": [after_a, after_b, after_c],
            "identical": all(torch.equal(x, y) for x, y in zip(_state(a), _state(b))),
            "identical_universal": all(torch.equal(x, y) for x, y in zip(_state(a), _state(c)))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--resume", type=Path)
    args = ap.parse_args()
    from ncpctl.train.engine import init_distributed

    d = init_distributed()
    for stage in args.stages:
        print(json.dumps(run_stage(stage, d)), flush=True)
    if args.resume is not None:
        print(json.dumps(run_resume(args.resume, d)), flush=True)


if __name__ == "__main__":
    main()

"""The DeepSpeed engine, built once for everyone who trains: ``ncpctl.train.loop``, ``ncpctl
profile`` and the ``bench/`` scripts (style rule 12: DeepSpeed is the engine).

* ``init_distributed()``: torch.distributed through DeepSpeed, as a ``Dist`` (rank, world size,
  local rank, device, and the two collectives the loop uses). Without a launcher: a world of one
  on localhost; under ``deepspeed --num_gpus N`` / a hostfile, rank and world from the launcher.
* ``build_engine(recipe, model, d)``: the model wrapped exactly as ``ncpctl pretrain`` trains it:
  ``make_optimizer`` (AdamW, or Muon + AdamW bound to the ZeRO partitions), the warmup/cosine
  ``LambdaLR``, the generated DeepSpeed config, ``train.activation_checkpointing`` applied to the
  model (``ncpctl.train.recompute``), its blocks compiled with ``train.compile``
  (``ncpctl.train.compiled``), and under ZeRO-3 the parameters a module reads
  outside its own forward declared to DeepSpeed (``external_parameters``, below).
* bf16 at ZeRO stage 0: DeepSpeed wraps the optimizer in ``FP16_UnfusedOptimizer`` (fp32 master
  copies of the bf16 weights), which creates the optimizer state by taking one optimizer step on
  zero gradients when it is built. For AdamW that step counts (the first real step's bias
  correction is then off by one: sqrt(1+beta2)/(1+beta1) = 0.73x of lr at betas 0.9/0.95) and
  applies the weight decay once; ``_undo_init_step`` clears that state and sets the master
  weights back to the model's fp32 initialisation (which the wrapper copied from the bf16 cast).
  ZeRO 1-3 create their fp32 partitions without stepping.
* ``reset_hyperparameters(engine, recipe)``: midtrain with ``train.load: all`` keeps the loaded
  optimizer *state* but takes this recipe's hyperparameters.

ZeRO-3 gathers a parameter for its own module's forward only. A model component whose forward
reads a parameter owned by another module (or whose parent reads one of its parameters) says so
with a method ``external_parameters(model) -> list[nn.Parameter]``; ``build_engine`` registers
each under ZeRO-3. The engine names no component: it asks every module.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    # no GPU here: tell DeepSpeed, which otherwise warns on every run that it could not detect one
    os.environ["DS_ACCELERATOR"] = "cpu"

from ncpctl.errors import UserError
from ncpctl.model.core.head import liger_loss
from ncpctl.recipe.load import Recipe
from ncpctl.train import compiled  # compiled.compile_blocks looked up when called (tests/train/recompute_step.py picks its backend)
from ncpctl.train.optimizer import base_lrs, lr_schedule, make_optimizer, param_groups
from ncpctl.train.recompute import apply_activation_checkpointing
from ncpctl.train.zero import Zero, deepspeed_config, use_bf16


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    def barrier(self) -> None:
        import deepspeed.comm as dist

        dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) a small vector; returns it as float64 on the CPU (one host sync)."""
        import deepspeed.comm as dist

        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.double().cpu()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank: every rank gets the same answer (one all-reduce), so
        a failure on one rank can be raised on all of them instead of leaving the others waiting."""
        return self.sum(torch.tensor([float(flag)])).item() > 0

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (max) a small vector; returns it as float64 on the CPU (one host sync)."""
        import deepspeed.comm as dist

        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.double().cpu()


def _shm_op(device: str, world: int, info: Callable[[str], None]) -> None:
    """DeepSpeed's CPU backend builds its shared-memory all-reduce op (a C++ extension, minutes to
    compile on first use) in every process. One process communicates with no one: it is not
    built. Several processes on a CPU use it: where it is not compiled yet, say so before the
    silent minutes."""
    import deepspeed.ops

    if device != "cpu":
        return
    name = "deepspeed_shm_comm"
    if world == 1:
        deepspeed.ops.__compatible_ops__[name] = False  # build_shm_op() returns None: plain torch.distributed
        return
    try:  # torch's private helper: where the op would be cached (no note if it moved)
        from torch.utils.cpp_extension import _get_build_directory

        built = list(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:
        return
    if not built:
        info(f"DeepSpeed compiles its shared-memory communication op for {world} CPU processes on first use "
             "(a few minutes; cached under $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)")


def init_distributed(info: Callable[[str], None] = lambda m: None) -> Dist:
    """torch.distributed through DeepSpeed; without a launcher, a world of one on localhost.
    ``info`` receives a note before a slow first-time build (``_shm_op``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # ranks sharing one CPU: split its cores
        local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    _shm_op(acc.device_name(), int(os.environ["WORLD_SIZE"]), info)
    deepspeed.init_distributed(dist_init_required=True, verbose=False)
    import deepspeed.comm as dist

    device = torch.device(acc.device_name(local_rank)) if acc.device_name() != "cpu" else torch.device("cpu")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def external_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters some module reads outside its own forward: what every module that declares
    ``external_parameters(model)`` returns, each once, in module order."""
    seen: dict[int, torch.nn.Parameter] = {}
    for m in model.modules():
        declare = getattr(m, "external_parameters", None)
        if callable(declare) and m is not model:
            for p in declare(model):
                seen.setdefault(id(p), p)
    return list(seen.values())


def check_parameters(model: torch.nn.Module) -> None:
    """Refuse what DeepSpeed cannot hold, before it fails inside: a 0-dim parameter (its engine
    broadcasts each parameter viewed as bytes, which a tensor without dimensions cannot be)."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise UserError(f"model parameter {scalars[0]} has no dimensions (shape ()): DeepSpeed cannot broadcast it"
                        + (f" (and {len(scalars) - 1} more)" if len(scalars) > 1 else ""),
                        hint="declare it with shape (1,), e.g. nn.Parameter(torch.ones(1)): it broadcasts the same")


def compiles(setting: bool | str, on_gpu: bool) -> bool:
    """``train.compile``: true, false, or ``auto`` (on a GPU only)."""
    return on_gpu if setting == "auto" else bool(setting)


def build_engine(recipe: Recipe, model: torch.nn.Module, d: Dist, info: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> tuple[Any, bool]:
    """The DeepSpeed engine of ``model`` as the training loop runs it: our AdamW (or Muon + AdamW)
    + warmup/cosine LambdaLR, the generated config, activation checkpointing and ``train.compile``
    (``warn`` gets the line saying why a model runs eagerly). Returns (engine, bf16)."""
    import deepspeed

    check_parameters(model)
    on_gpu, zero = d.device.type != "cpu", Zero.of(recipe)
    ds_config = deepspeed_config(recipe, on_gpu)
    optimizer = make_optimizer(model, recipe, on_gpu)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(recipe))
    apply_activation_checkpointing(model, recipe.train.activation_checkpointing)
    if compiles(recipe.train.compile, on_gpu):
        compiled.compile_blocks(model, zero.stage, on_gpu, warn or info or (lambda m: None))
    bf16 = use_bf16(recipe, on_gpu)
    # stage 0 bf16: the fp32 weights, before DeepSpeed casts the model (its masters then come from bf16)
    fp32_init = ({id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
                 if bf16 and not zero.wraps_optimizer else None)
    quiet_deepspeed()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if fp32_init is not None:
        _undo_init_step(engine.optimizer, fp32_init)
    if hasattr(optimizer, "bind"):  # Muon: where its matrices lie in the flat ZeRO partitions
        optimizer.bind(engine.optimizer)
    if zero.partitioned:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for p in external_parameters(model):
            register_external_parameter(model, p)
    if bf16 and info is not None:
        info("precision: bf16" + (" (DeepSpeed's BF16_Optimizer: fp32 masters and gradient accumulation)"
                                  if type(engine.optimizer).__name__ == "BF16_Optimizer" else ""))
    if on_gpu and info is not None and liger_loss() is not None:
        info("LM head loss: Liger Kernel's fused linear cross-entropy (ncpctl.model.core.head.USE_LIGER)")
    return engine, bf16


class _DropUntested(logging.Filter):
    """DeepSpeed's "You are using ZeRO with an untested optimizer": ncpctl's optimizers (GuardedAdamW,
    MuonAdamW) are not on DeepSpeed's list, and ncpctl's tests run them under ZeRO (issue 46 item 10)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def quiet_deepspeed() -> None:
    """Drop the lines a user can do nothing about (issue 46 item 10): the untested-optimizer warning,
    and torch's FutureWarning on the collectives DeepSpeed's ZeRO calls (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``: deprecated in torch, DeepSpeed's to change), once per call site."""
    from deepspeed.utils import logger

    if not any(isinstance(f, _DropUntested) for f in logger.filters):
        logger.addFilter(_DropUntested())
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


@torch.no_grad()
def _undo_init_step(wrapper: Any, fp32_init: dict[int, torch.Tensor]) -> None:
    """Undo the optimizer step DeepSpeed's stage-0 bf16 wrapper (``FP16_UnfusedOptimizer``: our
    optimizer is never its FusedAdam) takes on zero gradients in ``initialize_optimizer_states`` (module doc): the
    inner optimizer's state is cleared (AdamW's first real step is step 1 again) and each fp32 master
    copy is the parameter's fp32 initialisation again, cast back into the bf16 model weight."""
    if not (hasattr(wrapper, "fp16_groups") and hasattr(wrapper, "fp32_groups")):
        raise AssertionError(f"bf16 at ZeRO stage 0: unexpected DeepSpeed wrapper {type(wrapper).__name__}")
    wrapper.optimizer.state.clear()
    for low, master in zip(wrapper.fp16_groups, wrapper.fp32_groups):
        for lp, hp in zip(low, master):
            hp.copy_(fp32_init[id(lp)])
            lp.copy_(hp)


def reset_hyperparameters(engine: Any, recipe: Recipe) -> None:
    """midtrain with ``load: all``: the optimizer *state* comes from the checkpoint, but lr,
    betas, eps, weight decay (and Muon's momentum and scale) are this recipe's (the loaded param
    groups carry the old ones). Each group keeps its decoupled-muP multiplier (``lr_mult``,
    ``eps_mult``: 1/s of its module, by group name as ``param_groups`` builds them for this model)
    on its module's base rate (``base_lrs``)."""
    t, schedule, base = recipe.train, lr_schedule(recipe), base_lrs(recipe.train)
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the ZeRO wrapper's inner torch optimizer
    mults = {g["name"]: g for g in param_groups(engine.module, t.weight_decay, muon=t.optimizer == "muon")}
    for g in opt.param_groups:
        mine = mults.get(g.get("name"), {})
        lr = base.get(mine.get("mup"), t.lr) * mine.get("lr_mult", 1.0)
        g.update(lr=lr * schedule(0), initial_lr=lr, betas=(t.betas[0], t.betas[1]),
                 eps=t.eps * mine.get("eps_mult", 1.0), weight_decay=t.weight_decay if g.get("name", "decay").startswith(("decay", "muon")) else 0.0)
        if "lr_mult" in mine:
            g.update(lr_mult=mine["lr_mult"], eps_mult=mine["eps_mult"], mup=mine["mup"])
        if g.get("muon"):
            g.update(momentum=t.muon_momentum, lr_scale=t.muon_lr_scale)
    engine.lr_scheduler.base_lrs = [g["initial_lr"] for g in opt.param_groups]  # our LambdaLR (kept by deepspeed)


def follow_schedule(engine: Any, recipe: Recipe) -> int:
    """A resumed run's lr (issue 46 item 6): this recipe's schedule on this recipe's base rates, from
    the step the scheduler is about to take (its ``last_epoch``: skipped steps do not advance it),
    which it returns. The loaded param groups carry the lr the checkpoint's schedule set for that
    step and LambdaLR's state the checkpoint's base rates (its lambdas are this recipe's: plain
    functions are not saved), so under a changed schedule the first resumed step took the old lr
    and, with another train.lr, every later one the old peak. An unchanged schedule gives the same
    numbers bit for bit (LambdaLR computes ``base * lambda(last_epoch)`` as here)."""
    t, schedule, base = recipe.train, lr_schedule(recipe), base_lrs(recipe.train)
    sched = engine.lr_scheduler  # our LambdaLR (kept by deepspeed), over the inner torch optimizer
    mults = {g["name"]: g for g in param_groups(engine.module, t.weight_decay, muon=t.optimizer == "muon")}
    rates = []
    for g in sched.optimizer.param_groups:
        mine = mults.get(g.get("name"), {})
        rates.append(base.get(mine.get("mup"), t.lr) * mine.get("lr_mult", 1.0))
        g.update(initial_lr=rates[-1], lr=rates[-1] * schedule(sched.last_epoch))
    sched.base_lrs = rates
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]  # what get_last_lr() reports
    return sched.last_epoch

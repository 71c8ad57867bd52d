"""Resuming on another number of data-parallel ranks (issue 27 item 6): a checkpoint saved by N
ranks continues on M, at ZeRO stage 1, 2 or 3.

What depends on the world size is only how ZeRO cuts the fp32 master weights and the optimizer
state into per-rank partitions (one flat buffer per parameter group, rank r holding elements
[r P, (r+1) P), at stages 1-2; every parameter cut on its own, ceil(numel / N) per rank, at
stage 3). The rest carries over as it is: the module weights and the lr schedule (the model-state
file), the data loader's position (global: ``WindowLoader`` / ``MixLoader`` state counts the
windows all ranks consumed, and rank r of M reads rows [r G/M, (r+1) G/M) of each global batch of
G, so the global sample order continues with nothing repeated or skipped; G must stay the same,
which the loader's state checks), and rank r's RNG state (ranks beyond N keep their seeded state).

The conversion goes through DeepSpeed's universal checkpoint: per parameter its full tensors,
``zero/NAME/fp32.pt`` and one ``zero/NAME/KEY.pt`` per optimizer state (``{"param": tensor of the
parameter's shape}``) and ``zero/NAME/step.pt``; the optimizer's global state in
``zero/optimizer_state.pt``; the model-state files beside. With ``load_universal_checkpoint`` the
engine's loader cuts this rank's partition out of them for the current world size.

Why ncpctl writes that layout (``to_universal``) instead of calling
``deepspeed.checkpoint.ds_to_universal``: DeepSpeed 0.19's converter takes exactly ``exp_avg`` and
``exp_avg_sq`` from every group (a KeyError on a Muon group, whose state is ``momentum_buffer``)
and merges only ``("fp32", "exp_avg", "exp_avg_sq")``, so Muon's momentum could not survive it; it
also opens the files with ``torch.load(weights_only=False)``. ``to_universal`` carries every state
key of every group, reading through ``ncpctl.safe_load`` (DeepSpeed's allow-list), and the
loader, generic over the files it finds at stages 1-2 (fp32 / exp_avg / exp_avg_sq at stage 3,
where Muon is refused anyway), runs under ``deepspeed_loads_safely``.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ncpctl.errors import UserError
from ncpctl.fsutil import disk_errors

OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
HINT = ("resume with the number of ranks that saved it, or from a checkpoint written by ncpctl at ZeRO 1-3 "
        "with all its files")


def _optim_files(src: Path, world: int) -> list[Path]:
    """The ZeRO optimizer files of ranks 0..world-1, in rank order (a missing one is an error)."""
    by_rank = {int(m.group(1)): p for p in src.iterdir() if (m := OPTIM_FILE.match(p.name))}
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        raise UserError(f"{src}: saved by {world} ranks but has no ZeRO optimizer file of rank(s) "
                        f"{', '.join(map(str, missing))}: its optimizer state cannot be re-partitioned", hint=HINT)
    return [by_rank[r] for r in range(world)]


def _pieces_stage12(parts: list[dict[str, Any]], pieces: dict[str, dict[str, list[torch.Tensor]]],
                    steps: dict[str, Any]) -> None:
    """Stages 1-2: each rank's flat partition per group (fp32 and every state, (P,)); the names'
    fragments (start, numel) from DeepSpeed's ``param_slice_mappings``, in rank order."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, \
        SINGLE_PARTITION_OF_FP32_GROUPS

    for sd in parts:
        state = sd[BASE_OPTIMIZER_STATE]["state"]
        for g, mapping in enumerate(sd[PARAM_SLICE_MAPPINGS]):
            flat = {"fp32": sd[SINGLE_PARTITION_OF_FP32_GROUPS][g], **state.get(g, {})}
            for name, frag in mapping.items():
                for key, t in flat.items():
                    if key == "step":
                        steps[name] = t
                    else:
                        pieces.setdefault(name, {}).setdefault(key, []).append(t.narrow(0, frag.start, frag.numel))


def _pieces_stage3(parts: list[dict[str, Any]], shapes: list[dict[str, Any]],
                   pieces: dict[str, dict[str, list[torch.Tensor]]], steps: dict[str, Any]) -> None:
    """Stage 3: sub-group g of rank r is the concatenation, in ``param_shapes`` order, of each
    parameter's r-th slice of ceil(numel / N) elements (the last rank's padded)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    world = len(parts)
    for r, sd in enumerate(parts):
        state = sd[OPTIMIZER_STATE_DICT]["state"]
        for g, group in enumerate(shapes):
            flat = {"fp32": sd[FP32_FLAT_GROUPS][g], **state.get(g, {})}
            offset = 0
            for name, shape in group.items():
                n = math.prod(shape)
                per = math.ceil(n / world)
                take = max(0, min(per, n - r * per))
                for key, t in flat.items():
                    if key == "step":
                        steps[name] = t
                    elif take:
                        pieces.setdefault(name, {}).setdefault(key, []).append(t.narrow(0, offset, take))
                offset += per


def to_universal(src: Path, dst: Path, world: int, zero_stage: int) -> None:
    """Write checkpoint ``src`` (saved by ``world`` ranks at ``zero_stage``) into ``dst`` in
    DeepSpeed's universal layout (the module doc), every optimizer state key included."""
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT,
                                                PARAM, PARAM_SHAPES, PARAM_SLICE_MAPPINGS,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)

    from ncpctl.safe_load import DEEPSPEED_GLOBALS, load_pt

    models = sorted(src.glob("*model_states.pt"))
    if not models:
        raise UserError(f"{src}: no DeepSpeed model-state file: not a checkpoint the engine wrote", hint=HINT)
    parts = [load_pt(f, allow=DEEPSPEED_GLOBALS)[OPTIMIZER_STATE_DICT] for f in _optim_files(src, world)]
    shapes = load_pt(models[0], allow=DEEPSPEED_GLOBALS, mmap=True)[PARAM_SHAPES]  # [{name: shape}] per group
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps: dict[str, Any] = {}
    if zero_stage <= 2 and not all(isinstance(sd.get(BASE_OPTIMIZER_STATE), dict) for sd in parts):
        # DeepSpeed's zero_optimization.elastic_checkpoint: a list of per-group states, no param_groups
        raise UserError(f"{src}: its ZeRO-{zero_stage} optimizer state was saved in DeepSpeed's elastic_checkpoint "
                        "layout (per-group lists); ncpctl re-partitions the default layout only", hint=HINT)
    try:
        if zero_stage <= 2:
            _pieces_stage12(parts, pieces, steps)
            common = {k: v for k, v in parts[0].items()
                      if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)}
            common["param_groups"] = parts[0][BASE_OPTIMIZER_STATE]["param_groups"]
        else:
            _pieces_stage3(parts, shapes, pieces, steps)
            inner = parts[0][OPTIMIZER_STATE_DICT]
            common = {k: v for k, v in parts[0].items() if k not in (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT)}
            common[OPTIMIZER_STATE_DICT] = {"param_groups": inner["param_groups"], "state": {
                g: {"step": s["step"]} for g, s in inner["state"].items() if "step" in s}}
            common["param_groups"] = inner["param_groups"]
    except (KeyError, IndexError, AttributeError, TypeError) as e:
        raise UserError(f"{src}: its ZeRO-{zero_stage} optimizer files lack {e} (not the layout this DeepSpeed "
                        "writes): its state cannot be re-partitioned", hint=HINT) from None
    every = {name: shape for group in shapes for name, shape in group.items()}
    zero = dst / "zero"
    for name, keyed in pieces.items():
        (zero / name).mkdir(parents=True, exist_ok=True)
        for key, ps in keyed.items():
            full = torch.cat(ps)
            if full.numel() != math.prod(every[name]):
                raise UserError(f"{src}: the {world} ranks' {key} slices of {name} hold {full.numel()} elements, "
                                f"the parameter {math.prod(every[name])}", hint=HINT)
            torch.save({PARAM: full.view(every[name])}, zero / name / f"{key}.pt")
        if name in steps:
            torch.save(steps[name], zero / name / "step.pt")
    lacking = sorted(set(every) - set(pieces))
    if lacking:
        raise UserError(f"{src}: no optimizer partition holds {lacking[0]}"
                        + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""), hint=HINT)
    torch.save(common, zero / "optimizer_state.pt")
    for f in models:
        shutil.copy2(f, dst / f.name)


def load(engine: Any, src: Path, saved_world: int, zero_stage: int, work: Path, d: Any,
         info: Callable[[str], None]) -> None:
    """Resume ``engine`` (this run's M ranks) from checkpoint ``src`` saved by ``saved_world``
    ranks: rank 0 converts it into ``work`` (``to_universal``), every rank loads its partition
    through DeepSpeed's universal loader, then ``work`` is removed. Collective."""
    from ncpctl.safe_load import DEEPSPEED_GLOBALS, deepspeed_loads_safely, load_pt

    changed = (f"world size changed ({saved_world} -> {d.world} ranks): {src} was saved by {saved_world}, "
               f"this run has {d.world}; ")
    if not any(OPTIM_FILE.match(p.name) for p in src.iterdir()):  # ZeRO 0 in fp32: one file holds every state
        info(changed + "its unpartitioned optimizer state loads as it is; the data continues at the same global sample")
        with deepspeed_loads_safely():
            engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
        return
    info(changed + f"re-partitioning its ZeRO-{zero_stage} weights and optimizer state (DeepSpeed universal "
         "checkpoint); the data continues at the same global sample")
    target = work / src.name
    problem = None
    if d.rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        try:
            with disk_errors(work):  # the copy is the checkpoint's size again: a full disk is one line
                to_universal(src, target, saved_world, zero_stage)
        except Exception as e:  # any failure (not only a UserError) must reach the all-reduce below
            problem = e
            shutil.rmtree(work, ignore_errors=True)  # no half-written copy left behind
    # every rank learns whether rank 0 converted it (a plain barrier would leave them waiting on an error)
    if d.any(problem is not None):
        raise problem or UserError(f"{src}: rank 0 could not re-partition it for {d.world} ranks (its error says why)",
                                   hint=HINT)
    config = engine._config  # the engine reads this flag at load time only
    config.load_universal_checkpoint = True
    try:
        with deepspeed_loads_safely():
            engine.load_checkpoint(str(work), tag=src.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
            saved_groups = load_pt(target / "zero" / "optimizer_state.pt", allow=DEEPSPEED_GLOBALS)["param_groups"]
    finally:
        config.load_universal_checkpoint = False
    # ZeRO-3's universal loader gives every group the hyperparameters of group 0 (weight decay on
    # the no-decay group, one name for all): put each group's own back, by position as saved
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    # ... and one ``step`` tensor to all of them, which torch's AdamW then advances in place once per
    # group per step (its bias correction drifting): every state its own copy
    for state in opt.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    d.barrier()
    if d.rank == 0:
        shutil.rmtree(work, ignore_errors=True)

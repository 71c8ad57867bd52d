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
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ncpctl.errors import UserError
from ncpctl.fsutil import disk_errors
from ncpctl.safe_load import DEEPSPEED_GLOBALS, deepspeed_loads_safely, load_pt
from ncpctl.train.zero import Zero

OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # an optimizer state's key: exp_avg, momentum_buffer, step
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


def _pieces_stage12(files: list[Path], parts: list[dict[str, Any]], own: set[str],
                    pieces: dict[str, dict[str, list[torch.Tensor]]], steps: dict[str, Any]) -> None:
    """Stages 1-2: each rank's flat partition per group (fp32 and every state, (P,)); the names'
    fragments (start, numel) from DeepSpeed's ``param_slice_mappings``, in rank order."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, \
        SINGLE_PARTITION_OF_FP32_GROUPS

    for f, sd in zip(files, parts):
        state = sd[BASE_OPTIMIZER_STATE]["state"]
        for g, mapping in enumerate(sd[PARAM_SLICE_MAPPINGS]):
            flat = {"fp32": sd[SINGLE_PARTITION_OF_FP32_GROUPS][g], **_keys(f, state.get(g, {}))}
            for name, frag in mapping.items():
                _own(f, name, own)
                for key, t in flat.items():
                    if key == "step":
                        steps[name] = t
                    else:
                        pieces.setdefault(name, {}).setdefault(key, []).append(t.narrow(0, frag.start, frag.numel))


def _pieces_stage3(files: list[Path], parts: list[dict[str, Any]], shapes: list[dict[str, Any]],
                   pieces: dict[str, dict[str, list[torch.Tensor]]], steps: dict[str, Any]) -> None:
    """Stage 3: sub-group g of rank r is the concatenation, in ``param_shapes`` order, of each
    parameter's r-th slice of ceil(numel / N) elements (the last rank's padded)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    world = len(parts)
    for r, (f, sd) in enumerate(zip(files, parts)):
        state = sd[OPTIMIZER_STATE_DICT]["state"]
        for g, group in enumerate(shapes):
            flat = {"fp32": sd[FP32_FLAT_GROUPS][g], **_keys(f, state.get(g, {}))}
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


def _own(file: Path, name: Any, own: set[str]) -> None:
    """A parameter name read from ``file`` must be one of the model's own: it becomes a directory
    (``zero/NAME``), so a tampered one (an absolute path, ``..``) would write anywhere."""
    if not isinstance(name, str) or name not in own:
        raise UserError(f"{file}: names a parameter {str(name)[:80]!r} that is not one of the model's; refusing "
                        "to re-partition it (nothing was written)", hint=HINT)


def _keys(file: Path, state: Any) -> dict[str, Any]:
    """One parameter group's optimizer state from ``file``: every key a plain identifier (it becomes
    the file name ``KEY.pt``: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``)."""
    if not isinstance(state, dict):
        raise UserError(f"{file}: an optimizer state that is not a mapping; refusing to re-partition it", hint=HINT)
    for key in state:
        if not (isinstance(key, str) and STATE_KEY.match(key)) or key == "fp32":
            raise UserError(f"{file}: optimizer state key {str(key)[:80]!r} is not an identifier of at most 64 "
                            "characters; refusing to re-partition it (nothing was written)", hint=HINT)
    return state


def _inside(root: Path, path: Path, file: Path) -> Path:
    """``path``, checked to stay inside ``root`` (after ``..`` and absolute parts are resolved)."""
    top, full = os.path.abspath(root), os.path.abspath(path)
    if os.path.commonpath([top, full]) != top:
        raise UserError(f"{file}: would write {full}, outside the conversion directory {top}; refusing "
                        "(nothing was written)", hint=HINT)
    return Path(full)


def _plan(src: Path, model_file: Path, dst: Path, world: int, shapes: list[dict[str, Any]], own: set[str],
          pieces: dict[str, dict[str, list[torch.Tensor]]]) -> dict[str, tuple[Any, Path]]:
    """Every parameter's shape and directory, all checked before the first write: a name of the model's,
    its slices adding up to the parameter, every file inside ``dst``."""
    every: dict[str, Any] = {}
    for group in shapes:
        for name, shape in group.items():
            _own(model_file, name, own)
            every[name] = tuple(int(n) for n in shape)
    zero = dst / "zero"
    plan = {}
    for name, keyed in pieces.items():
        if name not in every:
            raise UserError(f"{src}: optimizer state for {name}, which {model_file.name} does not list", hint=HINT)
        folder = _inside(zero, zero / name, model_file)
        for key, ps in keyed.items():
            _inside(zero, folder / f"{key}.pt", model_file)
            if sum(p.numel() for p in ps) != math.prod(every[name]):
                raise UserError(f"{src}: the {world} ranks' {key} slices of {name} hold "
                                f"{sum(p.numel() for p in ps)} elements, the parameter {math.prod(every[name])}",
                                hint=HINT)
        plan[name] = (every[name], folder)
    lacking = sorted(set(every) - set(pieces))
    if lacking:
        raise UserError(f"{src}: no optimizer partition holds {lacking[0]}"
                        + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""), hint=HINT)
    return plan


def to_universal(src: Path, dst: Path, world: int, zero_stage: int, own: set[str]) -> None:
    """Write checkpoint ``src`` (saved by ``world`` ranks at ``zero_stage``) into ``dst`` in
    DeepSpeed's universal layout (the module doc), every optimizer state key included. ``own``: the
    model's parameter names; the names and state keys the files hold become paths, so every one is
    checked (``_plan``) before anything is written."""
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT,
                                                PARAM, PARAM_SHAPES, PARAM_SLICE_MAPPINGS,
                                                SINGLE_PARTITION_OF_FP32_GROUPS)

    models = sorted(src.glob("*model_states.pt"))
    if not models:
        raise UserError(f"{src}: no DeepSpeed model-state file: not a checkpoint the engine wrote", hint=HINT)
    files = _optim_files(src, world)
    parts = [load_pt(f, allow=DEEPSPEED_GLOBALS)[OPTIMIZER_STATE_DICT] for f in files]
    shapes = load_pt(models[0], allow=DEEPSPEED_GLOBALS, mmap=True)[PARAM_SHAPES]  # [{name: shape}] per group
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps: dict[str, Any] = {}
    flat = Zero(zero_stage).flat_optimizer_state
    if flat and not all(isinstance(sd.get(BASE_OPTIMIZER_STATE), dict) for sd in parts):
        # DeepSpeed's zero_optimization.elastic_checkpoint: a list of per-group states, no param_groups
        raise UserError(f"{src}: its ZeRO-{zero_stage} optimizer state was saved in DeepSpeed's elastic_checkpoint "
                        "layout (per-group lists); ncpctl re-partitions the default layout only", hint=HINT)
    try:
        if flat:
            _pieces_stage12(files, parts, own, pieces, steps)
            common = {k: v for k, v in parts[0].items()
                      if k not in (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)}
            common["param_groups"] = parts[0][BASE_OPTIMIZER_STATE]["param_groups"]
        else:
            _pieces_stage3(files, parts, shapes, pieces, steps)
            inner = parts[0][OPTIMIZER_STATE_DICT]
            common = {k: v for k, v in parts[0].items() if k not in (FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT)}
            common[OPTIMIZER_STATE_DICT] = {"param_groups": inner["param_groups"], "state": {
                g: {"step": s["step"]} for g, s in inner["state"].items() if "step" in s}}
            common["param_groups"] = inner["param_groups"]
        plan = _plan(src, models[0], dst, world, shapes, own, pieces)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError, RuntimeError) as e:
        what = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{src}: its ZeRO-{zero_stage} optimizer files are not in the layout this DeepSpeed writes "
                        f"({type(e).__name__}: {what}): its state cannot be re-partitioned", hint=HINT) from None
    for name, (shape, folder) in plan.items():
        folder.mkdir(parents=True, exist_ok=True)
        for key, ps in pieces[name].items():
            torch.save({PARAM: torch.cat(ps).view(shape)}, folder / f"{key}.pt")
        if name in steps:
            torch.save(steps[name], folder / "step.pt")
    torch.save(common, dst / "zero" / "optimizer_state.pt")
    for f in models:
        shutil.copy2(f, dst / f.name)

def load(engine: Any, src: Path, saved_world: int, zero_stage: int, work: Path, d: Any,
         info: Callable[[str], None]) -> None:
    """Resume ``engine`` (this run's M ranks) from checkpoint ``src`` saved by ``saved_world``
    ranks: rank 0 converts it into ``work`` (``to_universal``), every rank loads its partition
    through DeepSpeed's universal loader, then ``work`` is removed. Collective."""
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
                to_universal(src, target, saved_world, zero_stage, {n for n, _ in engine.module.named_parameters()})
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

"""Checkpoints: DeepSpeed's engine state plus our self-describing metadata (style rule 7).

Layout under ``run.dir/checkpoints/``::

    step_0000100/                     one checkpoint (a DeepSpeed tag)
        mp_rank_00_model_states.pt    DeepSpeed: module (stages 0-2), lr scheduler, client state
        *_optim_states.pt             DeepSpeed: optimizer state (per rank under ZeRO)
        rng_rank{r}.pt                python / numpy / torch RNG states of rank r
        recipe.resolved.yaml          the recipe that produced it (usable as a recipe)
        model.safetensors             consolidated fp32 weights (the inference view that
        tokenizer.json                eval / generate / export read: ncpctl.checkpoint)
        ncpctl.json                   META in ncpctl.checkpoint's format (format, version,
                                      step, tokens_seen, model_config, recipe) plus the
                                      training state: stage, data loader state, world size,
                                      ZeRO stage, non-finite count; written last
    latest                            the tag of the newest *complete* checkpoint

``latest`` has DeepSpeed's format (one line, the tag) so DeepSpeed's own tools
(``zero_to_fp32.py``, ``load_checkpoint(dir)``) work on the directory, but we write it
ourselves, atomically and fsynced (``ncpctl.fsutil``), and only after every rank fsynced
its files (barrier). A kill (or a power cut) at any moment therefore leaves ``latest``
naming a loadable checkpoint; a half-written ``step_*`` directory is never named by it and
is removed by the next save or the ``keep_last`` clean-up.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ncpctl import manifest
# one reader for every command
from ncpctl.checkpoint import CHECKPOINTS, META, find_in, is_complete, read_meta, read_weights  # noqa: F401
from ncpctl.errors import UserError
from ncpctl.fsutil import atomic_write, disk_errors, fsync_tree

LATEST = "latest"
META_VERSION = 1


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


# ----------------------------------------------------------------------------- finding


def latest_checkpoint(root: Path, warn: Any) -> Path | None:
    """The checkpoint to resume this run from: the one ``root/latest`` names if it is complete and
    verifies, else the newest one that does (saying so; ``ncpctl.checkpoint.find_in``). The run owns
    ``root`` (it holds the run lock), so a checkpoint that fails is moved to ``corrupt-step_N``."""
    if not root.is_dir():
        return None
    return find_in(root, warn=warn, move_aside=True, pin_it=False)


def resolve(spec: str, what: str, *, pin_it: bool = True) -> Path:
    """A user-given checkpoint (a ``step_*`` directory, a ``checkpoints`` directory or a run
    directory, then its ``latest``), via ``ncpctl.checkpoint.resolve``; errors name ``what``."""
    from ncpctl.checkpoint import resolve as resolve_checkpoint

    try:
        return resolve_checkpoint(spec, pin_it=pin_it)
    except UserError as e:
        raise UserError(*(f"{what}: {p}" for p in e.problems), hint=e.hint) from None


# ----------------------------------------------------------------------------- compatibility


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "model.") -> list[str]:
    """``key: saved -> current`` for every model-config field that differs (nested for concept)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def _with_defaults(saved: dict[str, Any], where: Path) -> dict[str, Any]:
    from ncpctl.model.core.config import ConfigError, ModelConfig, from_checkpoint

    try:
        with from_checkpoint(where):  # imports no strategy only the checkpoint names
            return ModelConfig.from_dict(saved).to_dict()
    except (ConfigError, TypeError):  # unknown or impossible keys: compare what was written
        return saved


# Model keys a new stage may change from the checkpoint it starts from (train.init_from): training
# terms of the concept bottleneck, none of which shapes a weight (Steerling's mid-training raises the
# residual dropout, ends teacher forcing, splits the independence penalty, sparsifies the heads and
# interleaves steering stages). A resumed run must match its checkpoint exactly.
STAGE_KEYS = tuple(f"bottleneck.{k}" for k in (
    "dropout", "concept_weight", "reconstruction_weight", "independence_weight", "independence",
    "teacher_forcing_start", "teacher_forcing_end", "teacher_forcing_steps", "top_k_known", "top_k_unknown",
    "respond_weight", "express_weight", "steer_at", "steer_strength", "steer_fraction", "lift_tokens"))
# a Causal Diffusion LM's masking curriculum (Steerling's mid-training returns it to uniform): no weight either
STAGE_KEYS += tuple(f"diffusion.{k}" for k in ("schedule", "gaussian_mean_start", "gaussian_mean_end",
                                                "gaussian_std", "gaussian_steps"))


def _tokenizer_file(recipe: Any) -> Path:
    """The tokenizer the run's data was made with: tokenizer.path, else the one `ncpctl tokenize`
    wrote next to the data (the run's data/, or beside data.train_prefix when that is given, or
    beside the first data.mix component's prefix: the components share one tokenizer)."""
    if recipe.tokenizer.path:
        return Path(recipe.tokenizer.path)
    own = recipe.data_dir / "tokenizer.json"
    given = recipe.data.train_prefix or next((c.prefix for c in recipe.data.mix if c.prefix), None)
    if own.is_file() or not given:
        return own
    return Path(given).parent / "tokenizer.json"


def check_compatible(path: Path, meta: dict[str, Any], model_config: dict[str, Any], *,
                     world_size: int, zero_stage: int, optimizer_state: bool, new_stage: bool = False,
                     elastic: bool = False) -> None:
    """Raise a UserError (before any training) when ``path`` cannot continue this run.

    The saved config is read through ``ModelConfig`` first, so a key added to the config since
    the checkpoint was written compares as its default (what loading that checkpoint gives).
    ``new_stage``: ``path`` starts another stage (init_from), which may change ``STAGE_KEYS``.
    ``elastic``: the loader re-partitions the state for another world size (``ncpctl.train.elastic``)."""
    diffs = config_differences(_with_defaults(meta["model_config"], path), model_config)
    if new_stage:
        diffs = [d for d in diffs if d.split(":")[0].removeprefix("model.") not in STAGE_KEYS]
    problems = [f"{path}: {d}" for d in diffs]
    if optimizer_state:  # DeepSpeed's optimizer partitions are per (stage, world size)
        if meta["zero_stage"] != zero_stage:
            problems.append(f"{path}: saved with deepspeed.zero_stage={meta['zero_stage']}, now {zero_stage}")
        if meta["world_size"] != world_size and not elastic:
            problems.append(f"{path}: saved by {meta['world_size']} ranks, now {world_size}")
    if problems:
        raise UserError(*problems, hint="the checkpoint comes from an incompatible configuration: match it "
                        f"(see {path / 'recipe.resolved.yaml'}), load weights only, or start fresh (train.resume: never)")


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and plain values, so that it loads with weights_only=True
    (numpy's state is an array: its 624 words go as an int64 tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
               npy["cached_gaussian"])
    np.random.set_state(npy)  # a tuple with a numpy array in files written before issue 21
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- saving


def consolidated_weights(engine: Any, zero_stage: int, tie_embeddings: bool) -> dict[str, torch.Tensor] | None:
    """The full state dict as fp32 on rank 0 (collective under ZeRO-3, None on the other ranks
    there; bf16 runs save their bf16 module weights upcast), under the plain model's names (LoRA
    adapters merged into their weights, ``ncpctl.train.lora``)."""
    if zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # what save_16bit_model uses; rank 0 only
    else:
        state = engine.module.state_dict()
    if state is None:
        return None
    out = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
           for k, v in state.items()}
    from ncpctl.train.lora import merge_adapters, scalings

    scale = scalings(engine.module)
    if scale:  # a LoRA run: the inference view is the plain model with the adapters merged in
        out = merge_adapters(out, scale)
    if tie_embeddings:  # safetensors refuses shared storage; the loader re-ties it
        out.pop("lm_head.weight", None)
    return out


def save(engine: Any, root: Path, step: int, meta: dict[str, Any], recipe: Any, *, rank: int,
         keep_last: int, barrier: Any, fault: Any = None) -> Path:
    """Write checkpoint ``step`` on every rank (collective), then point ``latest`` at it.

    ``meta`` is the training state ncpctl.json records (step, tokens_seen, data state, ...);
    ``barrier()`` syncs ranks; ``fault(where, step)`` is the test hook (see loop.Faults).
    """
    from ncpctl.checkpoint import save_model_files

    tag = tag_for(step)
    path = root / tag
    with disk_errors(path):  # a full or read-only disk: one line naming the file, latest untouched
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # a partial save from a killed run (latest never named it)
                shutil.rmtree(path)
        barrier()
        engine.save_checkpoint(str(root), tag=tag, save_latest=False)
        with disk_errors(path / f"rng_rank{rank}.pt"):
            torch.save(rng_state(), path / f"rng_rank{rank}.pt")
        weights = consolidated_weights(engine, meta["zero_stage"], recipe.model_config.tie_embeddings)
        if fault is not None:
            fault("save", step)
        fsync_tree(path)  # this rank's DeepSpeed files and RNG state are on the device, not only in the page cache
        barrier()  # every rank's files are on disk
        share = _hash_share(path, rank, meta.get("world_size", 1))
        barrier()  # every rank's share of the manifest is written
        if rank == 0:
            recipe.write_resolved(path)
            tok = _tokenizer_file(recipe)
            # weights, then ncpctl.json (atomically), then the manifest: a directory with both is complete
            save_model_files(path, weights, step=step, tokens_seen=meta["tokens_seen"], recipe=recipe.to_dict(),
                             tokenizer_path=tok if tok.is_file() else None,
                             extra={"saved_at": time.time(), "training_version": META_VERSION, **meta,
                                    "manifest": manifest.ALGORITHM})
            _write_manifest(path, share, meta.get("world_size", 1))
            atomic_write(root / LATEST, tag + "\n")
            _prune(root, keep_last, keep=tag)
    barrier()
    return path


def _hash_share(path: Path, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """This rank's share of the engine's files (every ``world``-th, by name) hashed in parallel with
    the others; ranks but 0 leave theirs in ``.manifest.rank{r}.json`` (hidden: not a file of the
    checkpoint) for rank 0 to merge."""
    share = manifest.describe(path, manifest.files_of(path)[rank::world])
    if rank != 0:
        atomic_write(path / f".manifest.rank{rank}.json", json.dumps(share))
    return share


def _write_manifest(path: Path, share: dict[str, dict[str, Any]], world: int) -> None:
    """Rank 0: the ranks' shares plus the files written since (the inference view, ncpctl.json)."""
    entries = dict(share)
    for r in range(1, world):
        part = path / f".manifest.rank{r}.json"
        entries.update(json.loads(part.read_text()))
        part.unlink()
    entries.update(manifest.describe(path, [n for n in manifest.files_of(path) if n not in entries]))
    manifest.write(path, entries)


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Keep the newest ``keep_last`` whole checkpoints (complete, and every file of the manifest there
    at its size; always ``keep``); drop partial ones. A checkpoint pinned by a reader (``eval``,
    ``export``, ``generate``: ``ncpctl.checkpoint.pin``) stays until the next save after it is
    released; a complete one that lost a file is left for resume to move aside, never deleted here,
    so the newest checkpoint that verifies is never pruned for a damaged newer one."""
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    complete = [p for p in dirs if is_complete(p)]
    whole = [p for p in complete
             if not (p / manifest.MANIFEST).exists() or manifest.verify(p, sizes_only=True) is None]
    kept = set(p.name for p in whole[-keep_last:]) | {keep} | {p.name for p in complete if p not in whole}
    for p in dirs:
        if p.name not in kept:
            _remove_unpinned(p)


def _remove_unpinned(path: Path) -> None:
    """Remove checkpoint ``path`` unless a reader pinned it (its shared flock blocks ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- loading


def load_rng(path: Path, rank: int) -> None:
    """Rank ``rank``'s RNG states from checkpoint ``path`` (weights_only: a file that would run
    code is refused with one line); files from before issue 21 hold a numpy array, allowed here."""
    from ncpctl.safe_load import NUMPY_ARRAYS, load_pt

    f = path / f"rng_rank{rank}.pt"
    if f.is_file():  # a different world size: the extra ranks keep their seeded state
        set_rng_state(load_pt(f, allow=NUMPY_ARRAYS))

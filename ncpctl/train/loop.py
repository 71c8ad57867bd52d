"""The training loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq`` (style rule 8).

The stages differ only in set-up (``make_stage``): where the weights come from
(``train.init_from``), what is frozen (adapt-vq: all but the codebook transform and the
concept heads), and the data (each recipe's own). ``train(recipe, stage, out)`` then reads
top to bottom:

    distributed set-up -> data -> resume / init checks (before any heavy work)
    -> model -> DeepSpeed engine -> [restore checkpoint]
    -> loop: batch -> micro-batches fwd/bwd/step -> metrics -> eval -> checkpoint
    -> final eval, checkpoint, plots, summary

Runs in one process without a launcher (torch.distributed is initialised here with world
size 1) and under ``deepspeed --num_gpus N`` / a hostfile (rank and world size from the
environment the launcher sets). Every rank executes the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ncpctl.data.indexed import IndexedDataset, paths
from ncpctl.data.windows import WindowLoader
from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train import checkpoint as ckpt
from ncpctl.train.config import deepspeed_config, lr_schedule, make_optimizer, use_bf16
from ncpctl.train.metrics import MetricsLog, device_peak, unigram_entropy, write_plots

FAULT_ENV = "NCPCTL_FAULT"  # test hook, see Faults


# ----------------------------------------------------------------------------- stages


@dataclass
class Stage:
    """What differs between pretrain, midtrain and adapt-vq: set-up only."""

    name: str  # "pretrain" | "midtrain" | "adapt-vq"
    init_from: Path | None = None  # checkpoint (or HF directory) whose weights start the run
    load: str = "weights"  # "weights" (fresh optimizer) | "all" (also the optimizer state)
    freeze: Callable[[torch.nn.Module], None] | None = None
    hf: bool = False  # init_from is a Hugging Face directory (midtrain: ConceptLM continual pretraining)


def freeze_all_but_codebook(model: torch.nn.Module) -> None:
    """NCP-ArchPreview §5.1: only the codebook transform and the concept heads train
    (the base of a ``learned`` codebook is the codebook itself, so it trains instead)."""
    concept = model.concept
    for p in model.parameters():
        p.requires_grad_(False)
    cb = concept.codebook
    trainable = [concept.heads, cb.transform] if cb.transform is not None else [concept.heads]
    for module in trainable:
        for p in module.parameters():
            p.requires_grad_(True)
    if cb.transform is None:
        cb.base.requires_grad_(True)


def make_stage(recipe: Recipe, name: str) -> Stage:
    t = recipe.train
    if name == "pretrain":
        return Stage(name)
    if not t.init_from:
        raise UserError(f"{recipe.path}: train.init_from: `ncpctl {name}` starts from a checkpoint; none given",
                        hint="--set train.init_from=runs/<run>/checkpoints/step_... (or a run directory)")
    from ncpctl.interop.hf_import import is_hf_dir

    if name == "midtrain" and is_hf_dir(t.init_from):
        if t.load == "all":
            raise UserError(f"{recipe.path}: train.load: all needs an ncpctl checkpoint; {t.init_from} is a "
                            "Hugging Face directory (weights only)", hint="use train.load: weights")
        return Stage(name, Path(t.init_from), "weights", hf=True)
    init = ckpt.resolve(t.init_from, "train.init_from")
    if name == "midtrain":
        return Stage(name, init, t.load)
    cfg = recipe.model_config
    if cfg is None or not cfg.concept.enabled:
        raise UserError(f"{recipe.path}: model.concept.enabled: adapt-vq adapts the codebook; this model has no "
                        "concept path")
    return Stage(name, init, "weights", freeze_all_but_codebook)


# ----------------------------------------------------------------------------- test hooks


class Faults:
    """Failure injection for the tests, from ``$NCPCTL_FAULT`` (comma-separated):
    ``nan@S`` makes step S's loss NaN; ``kill_in_save@S`` SIGKILLs the process after DeepSpeed
    wrote checkpoint S but before it became ``latest``; ``sleep@SECONDS`` pauses after every
    step (so a test can kill a run mid-way). Unset in normal use.

    An environment variable rather than a recipe key: the faults must reach the real entry
    point (also under the launcher) without becoming part of the documented recipe. So that it
    cannot act unnoticed, any item that is not exactly one of the forms above is an error before
    training starts, and an active spec is announced on stderr (``announce``)."""

    KINDS = {"nan": int, "kill_in_save": int, "sleep": float}

    def __init__(self, spec: str):
        self.spec = spec.strip()
        self.items: set[tuple[str, str]] = set()
        self.sleep = 0.0
        for item in filter(None, (x.strip() for x in self.spec.split(","))):
            kind, _, value = item.partition("@")
            try:
                number = self.KINDS[kind](value)
                if number < 0:
                    raise ValueError(value)
            except (KeyError, ValueError):
                raise UserError(f"${FAULT_ENV}={spec!r}: {item!r} is not a test fault "
                                "(nan@STEP, kill_in_save@STEP or sleep@SECONDS)",
                                hint=f"{FAULT_ENV} is a test hook; unset it for real runs") from None
            if kind == "sleep":
                self.sleep = float(number)
            else:
                self.items.add((kind, str(number)))

    def announce(self, warn: Callable[[str], None]) -> None:
        if self.spec:
            warn(f"{FAULT_ENV}={self.spec}: test fault injection is active (unset it for real runs)")

    def nan(self, step: int) -> bool:
        return ("nan", str(step)) in self.items

    def __call__(self, where: str, step: int) -> None:
        if (f"kill_in_{where}", str(step)) in self.items:
            os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------- distributed


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


def init_distributed() -> Dist:
    """torch.distributed through DeepSpeed; without a launcher, a world of one on localhost."""
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
    deepspeed.init_distributed(dist_init_required=True, verbose=False)
    import deepspeed.comm as dist

    device = torch.device(acc.device_name(local_rank)) if acc.device_name() != "cpu" else torch.device("cpu")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


# ----------------------------------------------------------------------------- data


def _dataset(recipe: Recipe, split: str) -> IndexedDataset:
    given = recipe.data.train_prefix if split == "train" else recipe.data.val_prefix
    prefix = given or str(recipe.data_dir / split)
    missing = [str(p) for p in paths(prefix) if not p.is_file()]
    if missing:
        raise UserError(f"no {split} data: {' and '.join(missing)} not found",
                        hint=f"run `ncpctl tokenize {recipe.path}` first, or set data.{split}_prefix")
    return IndexedDataset(prefix)


def _check_vocab(recipe: Recipe, ds: IndexedDataset, vocab: int) -> None:
    """The data's token ids must fit the model's embedding (checked before training)."""
    meta_path = Path(str(ds.bin_path)[: -len(".bin")]).parent / "meta.json"
    if meta_path.is_file():
        data_vocab = json.loads(meta_path.read_text())["tokenizer"]["vocab_size"]
        if data_vocab > vocab:
            raise UserError(f"{meta_path}: the tokenizer has {data_vocab} tokens but model.vocab_size is {vocab}",
                            hint="raise model.vocab_size (or leave it unset: it defaults to the tokenizer's)")
        return
    top = int(np.asarray(ds.tokens[:10_000_000]).max(initial=0))  # no meta.json (a foreign dataset): sample
    if top >= vocab:
        raise UserError(f"{ds.bin_path}: token id {top} does not fit model.vocab_size {vocab}",
                        hint="set model.vocab_size to the dataset tokenizer's vocabulary size")


# ----------------------------------------------------------------------------- the loop


@dataclass
class _Totals:
    step: int = 0
    tokens: int = 0
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    last_saved: int = -1
    last_good: Path | None = None
    train_loss: float | None = None
    val: dict[str, float] = field(default_factory=dict)


TERMS = ("loss", "ntp_loss", "ncp_loss", "vq_loss", "code_perplexity", "ncp_code_acc")


def _terms(out: Any, S: int) -> torch.Tensor:
    """The logged terms of one forward as one fp32 vector on the model's device (no host sync):
    TERMS (per-segment metrics averaged over segments) + code_usage (S,)."""
    ref = out.loss if out.loss is not None else out.logits
    zero = ref.new_zeros((), dtype=torch.float32)
    vals = [zero if getattr(out, n) is None else getattr(out, n).detach().float().mean() for n in TERMS]
    usage = out.code_usage.detach().float() if out.code_usage is not None else ref.new_zeros(S, dtype=torch.float32)
    return torch.cat([torch.stack(vals), usage])


def train(recipe: Recipe, stage: Stage, out: Any) -> dict[str, Any]:
    """Run ``stage`` for ``recipe``; ``out`` has ``info``/``warn`` and the stderr console ``err``.
    Returns the summary (also what ``--json`` prints)."""
    import deepspeed

    from ncpctl.model.accounting import exact_flops
    from ncpctl.model.model import NCPModel

    t, cfg = recipe.train, recipe.model_config
    assert cfg is not None
    faults = Faults(os.environ.get(FAULT_ENV, ""))  # test hook; a malformed spec fails here
    d = init_distributed()
    lead = d.rank == 0
    info = out.info if lead else (lambda msg: None)
    warn = out.warn if lead else (lambda msg: None)
    faults.announce(warn)
    on_gpu = d.device.type != "cpu"
    run_dir, root = recipe.run_dir, ckpt.checkpoints_dir(recipe.run_dir)
    T, micro, G = recipe.seq_len, t.micro_batch_size, recipe.global_batch_size

    # ---- data (clear errors before any heavy work) ----
    train_ds, val_ds = _dataset(recipe, "train"), _dataset(recipe, "val")

    # midtrain from a Hugging Face directory: the model config is the HF one + the recipe's keys
    hf_model = None
    if stage.hf:
        from ncpctl.interop.hf_import import load_hf_pretrained

        torch.manual_seed(t.seed)  # the fresh concept path starts the same on every rank
        explicit = recipe.model.model_dump(exclude={"size", "concept", "vocab_size"}, exclude_none=True)
        hf_model = load_hf_pretrained(stage.init_from, concept=dataclasses.asdict(cfg.concept),
                                      zero_concept_output=t.zero_concept_output, **explicit)
        cfg = recipe.model_config = hf_model.cfg  # checkpoints and recipe.resolved.yaml pin this config
        info(f"initialised from the Hugging Face model {stage.init_from}")

    _check_vocab(recipe, train_ds, cfg.vocab_size)
    loader = WindowLoader(train_ds, T, G, seed=t.seed, rank=d.rank, world_size=d.world)
    if loader.num_windows < G:
        raise UserError(f"{train_ds.bin_path}: {train_ds.num_tokens:,} tokens make {loader.num_windows} windows of "
                        f"seq_len+1 = {T + 1} tokens, fewer than one global batch of {G}",
                        hint="use more data, or lower train.seq_len / train.global_batch_size")
    WindowLoader(val_ds, T, G, seed=t.seed)  # raises if validation has not one window

    # ---- where the weights come from: resume (same run) wins over init_from (another run) ----
    resume_from: Path | None = None
    if t.resume == "auto":
        resume_from = ckpt.latest_checkpoint(root)
    elif t.resume != "never":
        resume_from = ckpt.resolve(t.resume, "train.resume")
    tot = _Totals()
    if resume_from is not None:
        meta = ckpt.read_meta(resume_from)
        ckpt.check_compatible(resume_from, meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=True)
        if meta.get("stage", stage.name) != stage.name:
            raise UserError(f"{resume_from}: a {meta['stage']} checkpoint; this is `ncpctl {stage.name}`",
                            hint="give this stage its own run.dir, or train.resume: never")
        loader.load_state_dict(meta["data"]["train"], source=str(resume_from / ckpt.META))
    elif stage.init_from is not None and not stage.hf:
        meta = ckpt.read_meta(stage.init_from)
        ckpt.check_compatible(stage.init_from, meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=stage.load == "all")

    # A fresh lineage in a run.dir that holds other checkpoints: move them aside (never delete),
    # so keep_last and `latest` only ever see this run's checkpoints.
    if (resume_from is None or resume_from.parent != root) and any(root.glob("step_*")):
        if lead:
            aside = root.with_name(f"checkpoints.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(root, aside)
            warn(f"{root} held checkpoints this run does not continue from; moved them to {aside}")
        d.barrier()

    # ---- model: same seed on every rank; stage set-up (init, freezing) ----
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    model = hf_model if hf_model is not None else NCPModel(cfg)
    if stage.init_from is not None and resume_from is None and not stage.hf:
        model.load_state_dict(ckpt.read_weights(stage.init_from))
        info(f"initialised from {stage.init_from} ({'weights only' if stage.load == 'weights' else 'weights + optimizer'})")
    if stage.freeze is not None:
        stage.freeze(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info(f"model {cfg.name}: {n_params:,} parameters, {n_trainable:,} trainable")

    # ---- DeepSpeed engine: our AdamW + warmup/cosine LambdaLR, the generated config ----
    ds_config = deepspeed_config(recipe, on_gpu)
    optimizer = make_optimizer(model, recipe, on_gpu)
    schedule = lr_schedule(recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if bf16 := use_bf16(recipe, on_gpu):
        info("precision: bf16")

    if resume_from is not None:
        engine.load_checkpoint(str(resume_from.parent), tag=resume_from.name, load_optimizer_states=True,
                               load_lr_scheduler_states=True)
        ckpt.load_rng(resume_from, d.rank)
        tot.step, tot.tokens = meta["step"], meta["tokens_seen"]
        tot.nonfinite_total = meta.get("nonfinite_total", 0)
        tot.last_saved, tot.last_good = tot.step, resume_from
        tot.train_loss, tot.val = meta.get("train_loss"), meta.get("val") or {}
        info(f"resumed from {resume_from} (step {tot.step}, {tot.tokens:,} tokens)"
             + ("; already at train.max_steps, nothing to do" if tot.step >= t.max_steps else ""))
    elif stage.init_from is not None and stage.load == "all":
        src = stage.init_from
        engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                               load_lr_scheduler_states=False)
        _reset_hyperparameters(engine, recipe, scheduler, schedule)

    # ---- observability ----
    metrics = MetricsLog(run_dir, t.tensorboard, tot.step if resume_from else None, warn) if lead else None
    if lead:
        recipe.write_resolved(run_dir)
    flops_per_step = exact_flops(cfg, T, G).training_per_step()
    peak = d.sum(torch.tensor([device_peak(on_gpu)[0]], dtype=torch.float64)).item()  # all ranks together
    entropy = unigram_entropy(train_ds.tokens, cfg.vocab_size) if lead else None
    display = None
    if lead:
        from ncpctl.train.display import TrainDisplay

        display = TrainDisplay(out.err, stage.name)
        info(f"data: {loader.num_windows:,} train windows of {T} tokens, global batch {G} "
             f"({micro} x {recipe.grad_accum_steps} accum x {d.world} ranks); unigram entropy {entropy:.3f} nats")

    # ---- SIGINT / SIGTERM: finish the step, save, exit cleanly ----
    stop = {"signal": 0}

    def on_signal(signum: int, frame: Any) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    S = cfg.n_segments if cfg.concept.enabled else 0
    code_counts = None

    def save() -> None:
        meta_out = {"stage": stage.name, "tokens_seen": tot.tokens, "model_config": cfg.to_dict(),
                    "data": {"train": loader.state_dict(), "train_prefix": str(train_ds.bin_path)[:-4]},
                    "world_size": d.world, "zero_stage": recipe.deepspeed.zero_stage,
                    "nonfinite_total": tot.nonfinite_total, "train_loss": tot.train_loss, "val": tot.val,
                    "init_from": str(stage.init_from) if stage.init_from else None}
        tot.last_good = ckpt.save(engine, root, tot.step, meta_out, recipe, rank=d.rank, keep_last=t.keep_last,
                                  barrier=d.barrier, fault=faults)
        tot.last_saved = tot.step
        info(f"[dim]saved {tot.last_good}[/]")

    def evaluate(collect_codes: bool = False) -> None:
        nonlocal code_counts
        engine.eval()
        val = WindowLoader(val_ds, T, G, seed=t.seed, rank=d.rank, world_size=d.world)
        batches = min(t.eval_batches, math.ceil(val.num_windows / G))
        acc = torch.zeros(len(TERMS) + S, device=d.device)
        counts = torch.zeros(S, cfg.concept.codes, device=d.device) if collect_codes and S else None
        with torch.no_grad():
            for _ in range(batches):
                for mb in torch.from_numpy(next(val)).split(micro):  # (micro, T+1)
                    o = engine(mb[:, :-1].to(d.device), mb[:, 1:].to(d.device))
                    acc += _terms(o, S)
                    if counts is not None:
                        counts += _code_hits(engine, o.pred)
        acc = d.sum(acc) / (d.world * batches * recipe.grad_accum_steps)
        tot.val = {k: float(v) for k, v in zip(TERMS, acc[: len(TERMS)]) if k in _present(cfg)}
        if counts is not None:
            code_counts = d.sum(counts.flatten()).view(S, -1).numpy()
        engine.train()
        if metrics is not None:
            metrics.write({"split": "val", "step": tot.step, **tot.val})
        if display is not None:
            display.message(f"step {tot.step}: val loss {tot.val['loss']:.4f}"
                            + (f" (ntp {tot.val['ntp_loss']:.4f})" if "ncp_loss" in tot.val else ""))

    engine.train()
    t_start, steps_start, compute_s = time.perf_counter(), tot.step, 0.0
    if display is not None:
        display.start(t.max_steps, tot.step)
    try:
        while tot.step < t.max_steps:
            # ---- one optimizer step: grad_accum micro-batches of (micro, T) on every rank ----
            t0 = time.perf_counter()
            lr = float(engine.get_lr()[0])
            batch = torch.from_numpy(next(loader))  # (micro * accum, T+1) this rank's share
            acc = torch.zeros(len(TERMS) + S, device=d.device)
            for mb in batch.split(micro):
                x, y = mb[:, :-1].to(d.device), mb[:, 1:].to(d.device)  # (micro, T) inputs, next tokens
                o = engine(x, y)
                loss = o.loss * float("nan") if faults.nan(tot.step + 1) else o.loss
                engine.backward(loss)
                engine.step()  # DeepSpeed applies the update at the accumulation boundary
                vals = _terms(o, S)
                if loss is not o.loss:  # the injected NaN must show in the logged loss too
                    vals[0] = float("nan")
                acc += vals
            tot.step += 1
            tot.tokens += G * T
            skipped = not engine.was_step_applied()
            grad_norm = engine.get_global_grad_norm()
            # one collective per step: loss terms, code usage, "skipped", "stop"
            flags = torch.tensor([float(skipped), float(stop["signal"] != 0)], device=d.device)
            red = d.sum(torch.cat([acc / recipe.grad_accum_steps, flags]))
            terms = red[: len(TERMS) + S] / d.world
            skipped = skipped or red[-2].item() > 0 or not math.isfinite(terms[0].item())
            step_time = time.perf_counter() - t0
            compute_s += step_time
            if faults.sleep:
                time.sleep(faults.sleep)

            # ---- bad states: skip, count, abort after max_nonfinite in a row ----
            if skipped:
                tot.nonfinite_total += 1
                tot.nonfinite_run += 1
                warn(f"step {tot.step}: non-finite loss or gradient; step skipped "
                     f"({tot.nonfinite_run} in a row, {tot.nonfinite_total} in total)")
                if tot.nonfinite_run >= t.max_nonfinite:
                    last = f"last good checkpoint: {tot.last_good}" if tot.last_good else "no checkpoint was written"
                    raise UserError(
                        f"training diverged: {tot.nonfinite_run} non-finite steps in a row "
                        f"(steps {tot.step - tot.nonfinite_run + 1}-{tot.step}, train.max_nonfinite={t.max_nonfinite})",
                        last, hint="lower train.lr, lengthen the warmup or check the data; train.resume: auto "
                        "continues from the last good checkpoint")
            else:
                tot.nonfinite_run = 0
                tot.train_loss = terms[0].item()

            # ---- metrics ----
            if metrics is not None and (tot.step % t.log_every == 0 or tot.step == t.max_steps):
                rec = {"split": "train", "step": tot.step, "lr": lr, "tokens": tot.tokens,
                       "grad_norm": None if grad_norm is None else float(grad_norm),
                       "step_time": step_time, "tokens_per_s": G * T / step_time,
                       "mfu": flops_per_step / step_time / peak, "nonfinite": tot.nonfinite_total}
                rec.update({k: float(v) for k, v in zip(TERMS, terms[: len(TERMS)]) if k in _present(cfg)})
                if S:
                    usage = terms[len(TERMS):]
                    rec["code_usage"] = float(usage.mean())
                    rec["code_usage_per_segment"] = [round(float(u), 6) for u in usage]
                metrics.write(rec)
                display.step(rec)

            # ---- evaluation and checkpoints ----
            last = tot.step == t.max_steps
            if t.eval_every and tot.step % t.eval_every == 0 and not last:
                evaluate()
            stopping = red[-1].item() > 0
            # no periodic save inside a non-finite streak: if the weights themselves went bad,
            # the checkpoint before the streak is the one to go back to
            due = t.save_every and tot.step % t.save_every == 0 and not last and tot.nonfinite_run == 0
            if due or stopping:
                save()
            if stopping:
                info(f"stopped by signal at step {tot.step}; `train.resume: auto` continues from here")
                break
        else:
            if tot.last_saved != tot.step or not tot.val:
                evaluate(collect_codes=t.plots)
            if tot.last_saved != tot.step:
                save()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if display is not None:
            display.stop()
        if metrics is not None:
            metrics.close()

    plots = write_plots(run_dir, code_counts, warn) if lead and t.plots else []
    elapsed = time.perf_counter() - t_start
    steps = tot.step - steps_start
    return {
        "stage": stage.name, "run_dir": str(run_dir), "step": tot.step, "max_steps": t.max_steps,
        "tokens": tot.tokens, "train_loss": tot.train_loss, "val": tot.val,
        "unigram_entropy": entropy, "parameters": n_params, "trainable_parameters": n_trainable,
        "steps_run": steps, "seconds": round(elapsed, 2),
        "steps_per_s": steps / compute_s if compute_s else None,
        "tokens_per_s": steps * G * T / compute_s if compute_s else None,
        "mfu": flops_per_step * steps / compute_s / peak if compute_s else None,
        "nonfinite_steps": tot.nonfinite_total, "interrupted": bool(stop["signal"]),
        "checkpoint": str(tot.last_good) if tot.last_good else None,
        "resumed_from": str(resume_from) if resume_from else None,
        "init_from": str(stage.init_from) if stage.init_from else None,
        "world_size": d.world, "zero_stage": recipe.deepspeed.zero_stage, "bf16": bf16,
        "plots": plots,
    }


def _present(cfg: Any) -> tuple[str, ...]:
    """The logged terms this model has (no concept terms without the concept path)."""
    return TERMS if cfg.concept.enabled else ("loss", "ntp_loss")


def _code_hits(engine: Any, pred: torch.Tensor) -> torch.Tensor:
    """(S, N) counts of the nearest code of each predicted concept (B, M, d), per segment."""
    import deepspeed

    from ncpctl.model.concept import nearest_code

    cb = engine.module.concept.codebook
    with deepspeed.zero.GatheredParameters(list(cb.parameters())):  # no-op below ZeRO-3
        codes = cb().detach()  # (S, N, ds)
    idx = nearest_code(pred.detach(), codes).reshape(-1, codes.shape[0])  # (B*M, S)
    counts = codes.new_zeros(codes.shape[0], codes.shape[1], dtype=torch.float32)
    counts.scatter_add_(1, idx.t(), torch.ones(idx.t().shape, device=counts.device))
    return counts


def _reset_hyperparameters(engine: Any, recipe: Recipe, scheduler: Any, schedule: Callable[[int], float]) -> None:
    """midtrain with ``load: all``: the optimizer *state* comes from the checkpoint, but lr,
    betas, eps and weight decay are this recipe's (the loaded param groups carry the old ones)."""
    t = recipe.train
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the ZeRO wrapper's inner torch AdamW
    for g in opt.param_groups:
        g.update(lr=t.lr * schedule(0), initial_lr=t.lr, betas=(t.betas[0], t.betas[1]), eps=t.eps,
                 weight_decay=t.weight_decay if g.get("name", "decay") == "decay" else 0.0)
    scheduler.base_lrs = [t.lr] * len(opt.param_groups)

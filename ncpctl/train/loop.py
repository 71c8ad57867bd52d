"""The training loop shared by ``pretrain``, ``midtrain`` and ``adapt-vq`` (style rule 8).

The stages differ only in set-up (``make_stage``): where the weights come from
(``train.init_from``), what is frozen (adapt-vq: all but the codebook and the concept heads;
midtrain with ``train.lora``: every weight, with LoRA adapters added, ``ncpctl.train.lora``),
and the data (each recipe's own). ``train(recipe, stage, out)`` then reads
top to bottom, one named piece per stage of a run:

    _prepare: distributed set-up -> data -> resume / init checks (before any heavy work)
              -> model -> DeepSpeed engine -> [restore checkpoint] -> observability
    loop:     _optimizer_step (micro-batches fwd/bwd/step, ONE all-reduce of the named step
              vector, see ``ncpctl.train.packing``) -> _count_nonfinite -> the model's
              ``on_step_end`` hook -> _log_step -> _evaluate -> _save
    finish:   final _evaluate and _save, plots, _summary

The loop names no loss term or metric of the model except ``loss`` (the non-finite check and
``train_loss``): what it logs comes from ``model.log_keys()`` and ``model.stat_keys()``.

Runs in one process without a launcher (torch.distributed is initialised here with world
size 1) and under ``deepspeed --num_gpus N`` / a hostfile (rank and world size from the
environment the launcher sets). Every rank executes the same collectives in the same order.
"""

from __future__ import annotations

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
from ncpctl.data.windows import SourceMap, WindowLoader
from ncpctl.errors import UserError
from ncpctl.recipe.load import Recipe
from ncpctl.train import checkpoint as ckpt
from ncpctl.train.config import deepspeed_config, lr_schedule, make_optimizer, use_bf16
from ncpctl.train.metrics import MetricsLog, device_peak, unigram_entropy, write_plots
from ncpctl.train.packing import LOSS, StepPacking

FAULT_ENV = "NCPCTL_FAULT"  # test hook, see Faults


# ----------------------------------------------------------------------------- stages


@dataclass
class Stage:
    """What differs between pretrain, midtrain and adapt-vq: set-up only."""

    name: str  # "pretrain" | "midtrain" | "adapt-vq"
    init_from: Path | None = None  # checkpoint (or HF directory) whose weights start the run
    load: str = "weights"  # "weights" (fresh optimizer) | "all" (also the optimizer state)
    # what the stage does to the model once its weights are in (also when resuming): adapt-vq
    # freezes all but the codebook; LoRA freezes everything and adds adapters. None: all train.
    freeze: Callable[[torch.nn.Module], None] | None = None
    hf: bool = False  # init_from is a Hugging Face directory (midtrain: ConceptLM continual pretraining)


def freeze_all_but_codebook(model: torch.nn.Module) -> None:
    """NCP-ArchPreview §5.1: only the codebook and the concept heads train. With ``codebook:
    learned`` the codebook is ``base`` itself (the paper's setting: at 8.9B, 16,777,216 head
    weights + 524,288 codes = 17,301,504 trained); with ``simvq`` the trained part of the
    codebook is its transform (the frozen Gaussian base stays frozen). The concept norm before
    the heads, like every other weight, stays frozen."""
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


def _lora_setup(recipe: Recipe, name: str) -> Callable[[torch.nn.Module], None] | None:
    """``train.lora``'s set-up (midtrain only), checked before any heavy work."""
    spec = recipe.train.lora
    if spec is None:
        return None
    if name != "midtrain":
        does = "trains the codebook and concept heads" if name == "adapt-vq" else "trains a model from scratch"
        raise UserError(f"{recipe.path}: train.lora: LoRA adapts a checkpoint with `ncpctl midtrain`; "
                        f"`ncpctl {name}` {does}", hint=f"run `ncpctl midtrain {recipe.path}`, or remove train.lora")
    if recipe.train.load == "all":
        raise UserError(f"{recipe.path}: train.load: all restores the optimizer state of init_from's weights; a LoRA "
                        "run trains new adapters", hint="use train.load: weights")
    from functools import partial

    from ncpctl.train.lora import apply_lora, lora_config

    lora_config(spec)  # peft present, the section well-formed
    return partial(apply_lora, spec=spec)


def make_stage(recipe: Recipe, name: str) -> Stage:
    t = recipe.train
    lora = _lora_setup(recipe, name)
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
        return Stage(name, Path(t.init_from), "weights", freeze=lora, hf=True)
    init = ckpt.resolve(t.init_from, "train.init_from")
    if name == "midtrain":
        return Stage(name, init, t.load, freeze=lora)
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

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (max) a small vector; returns it as float64 on the CPU (one host sync)."""
        import deepspeed.comm as dist

        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
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


def _meta_path(ds: IndexedDataset) -> Path:
    """The meta.json ``ncpctl tokenize`` writes beside a dataset's PREFIX.bin/.idx."""
    return Path(str(ds.bin_path)[: -len(".bin")]).parent / "meta.json"


def _labels(recipe: Recipe, ds: IndexedDataset) -> tuple[Any, list[str] | None]:
    """The concept labels of ``ds`` (``PREFIX.labels.npy``, ncpctl.data.labels) when the model has a
    concept bottleneck: (LabelSpans, the vocabulary from meta.json or None); (None, None) otherwise.
    The bottleneck's ``concepts`` must equal the vocabulary's size, and teacher forcing is refused on
    document-level labels (``_check_teacher_forcing``)."""
    b = recipe.model_config.bottleneck
    if not b.enabled:
        return None, None
    from ncpctl.data.labels import LabelSpans

    prefix = str(ds.bin_path)[: -len(".bin")]
    meta_path = _meta_path(ds)
    names = None
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text()).get("labels") or {}
        names = meta.get("vocabulary")
        if names is None:
            raise UserError(f"{meta_path}: the dataset has no concept labels, but model.bottleneck is on",
                            hint="set data.labels (python-ast or field) and run `ncpctl tokenize` again")
        if len(names) != b.concepts:
            raise UserError(f"model.bottleneck.concepts: {b.concepts}, but the dataset's label vocabulary has "
                            f"{len(names)} names ({meta_path})", hint=f"set model.bottleneck.concepts={len(names)}")
        _check_teacher_forcing(recipe, meta, meta_path)
    return LabelSpans(prefix, ds.num_tokens, b.concepts), names


def _check_teacher_forcing(recipe: Recipe, meta: dict[str, Any], meta_path: Path) -> None:
    """Teacher forcing feeds a position the labels of the chunk before it (ncpctl.model.bottleneck.
    fed_labels); a document-level label sits on every token of its document, so feeding it shows
    each position its document's future: refused. A ``field`` dataset from before
    ``labels.document_level`` was recorded may hold them: refused too, until it is tokenized again."""
    b = recipe.model_config.bottleneck
    if b.teacher_forcing_start == 0 and b.teacher_forcing_end == 0:
        return
    doc = meta.get("document_level")
    if doc is None and meta.get("labeller") == "field":
        doc = ["(unknown: this dataset predates labels.document_level)"]
    if doc:
        raise UserError(f"{meta_path}: teacher forcing with document-level labels ({', '.join(doc[:6])}"
                        f"{', ...' if len(doc) > 6 else ''}) would show every position its document's future",
                        hint="set model.bottleneck.teacher_forcing_start=0 and teacher_forcing_end=0 (they stay "
                             "concept-loss targets), give the labels as spans, or run `ncpctl tokenize` again")


def _val_sources(recipe: Recipe, ds: IndexedDataset, info: Callable[[str], None]) -> SourceMap | None:
    """For a model with learned (dynamic) segments: which ``data.sources`` entry each validation
    token is from, so validation reports tokens per concept per source (DLCM Table 5), from the
    split's ``documents_per_source`` in meta.json. None (and a note why) when the model has fixed
    segments or the dataset does not say (a ``data.val_prefix`` made elsewhere, or tokenized by
    an earlier ncpctl: ``ncpctl tokenize --force`` adds the counts)."""
    c = recipe.model_config.concept
    if not (c.enabled and c.segmentation == "dynamic"):
        return None
    meta_path = _meta_path(ds)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    counts = (meta.get("splits") or {}).get("val", {}).get("documents_per_source")
    labels = meta.get("source_labels")
    why = None
    if counts is None or labels is None:
        why = f"{meta_path} does not count documents per source" if meta else f"no {meta_path}"
    else:
        try:
            return SourceMap(ds, counts, labels)
        except ValueError as e:
            why = str(e)
    info(f"validation: no tokens per concept per source ({why})")
    return None


def _vocab_from(recipe: Recipe) -> tuple[str, str]:
    """Which recipe key set the model's vocabulary size (for messages: name only keys that exist
    and were used) and what to change: (origin, hint)."""
    from ncpctl.interop.hf_import import is_hf_dir

    t, tok, n = recipe.train, recipe.tokenizer, recipe.model_config.vocab_size
    if recipe.model.vocab_size is not None:
        return "model.vocab_size", "raise model.vocab_size to the data tokenizer's vocabulary size"
    if t.init_from and (not recipe.model.model_fields_set or is_hf_dir(t.init_from)):
        return (f"the model of train.init_from {t.init_from}",
                "tokenize the data with that model's tokenizer (tokenizer.path)")
    if tok.path:
        return (f"tokenizer.path {tok.path}; model.vocab_size is unset",
                "set tokenizer.path to the tokenizer the data was made with, or tokenize the data again")
    return (f"tokenizer.vocab_size {n}; model.vocab_size is unset",
            "set tokenizer.vocab_size to the data tokenizer's vocabulary size, or tokenize the data again")


def _check_vocab(recipe: Recipe, ds: IndexedDataset, vocab: int) -> None:
    """The data's token ids must fit the model's embedding (checked before training from what
    meta.json says; the loaders check every batch as it is read)."""
    origin, hint = _vocab_from(recipe)
    meta_path = _meta_path(ds)
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        data_vocab = meta["tokenizer"]["vocab_size"]
        if data_vocab > vocab:
            raise UserError(f"{meta_path}: the data's tokenizer has {data_vocab} tokens but the model's vocabulary "
                            f"has {vocab} ({origin})", hint=hint)
        top = ((meta.get("splits") or {}).get(Path(ds.prefix).name) or {}).get("max_id")  # recorded by tokenize
        if isinstance(top, int) and top >= vocab:
            raise UserError(f"{meta_path}: {ds.bin_path.name} holds token id {top}, outside the model's vocabulary "
                            f"of {vocab} ids ({origin})", hint=hint)
        return
    top = int(np.asarray(ds.tokens[:10_000_000]).max(initial=0))  # no meta.json (a foreign dataset): sample
    if top >= vocab:
        raise UserError(f"{ds.bin_path}: token id {top} is outside the model's vocabulary of {vocab} ids ({origin})",
                        hint=hint)


# ----------------------------------------------------------------------------- a prepared run

FLAGS = ("skipped", "stop")  # the loop's own entries of the step vector, summed over ranks
# the train record's own fields: no log key or statistic of the model may use these names
RECORD_FIELDS = ("split", "step", "lr", "tokens", "grad_norm", "step_time", "tokens_per_s", "mfu", "nonfinite")


def _quiet(msg: str) -> None:
    """``info`` / ``warn`` on the ranks other than 0."""


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


@dataclass
class _Labels:
    """Concept labels of a run whose model has a bottleneck: the validation split's spans (the
    train split's live in its loader) and the vocabulary names checkpoints record."""

    val: Any = None  # ncpctl.data.labels.LabelSpans
    names: list[str] | None = None


def _micro_labels(labels: np.ndarray | None, n_micro: int, micro: int) -> list[torch.Tensor | None]:
    """A batch's per-token array (label evidence (micro * n_micro, T, n), or token sources
    (micro * n_micro, T)) as one tensor per micro-batch (None each without one)."""
    return [None] * n_micro if labels is None else list(torch.from_numpy(labels).split(micro))


@dataclass
class _Run:
    """What the loop's pieces read and update; built once by ``_prepare``."""

    recipe: Recipe
    stage: Stage
    d: Dist
    faults: Faults
    info: Callable[[str], None]
    warn: Callable[[str], None]
    train_ds: IndexedDataset
    val_ds: IndexedDataset
    loader: WindowLoader
    engine: Any
    packing: StepPacking
    resume_from: Path | None
    n_params: int
    n_trainable: int
    bf16: bool
    labels: _Labels  # model.bottleneck's concept labels (validation spans, names), or empty
    val_sources: SourceMap | None = None  # a dynamic segmentation's per-source validation metric
    tot: _Totals = field(default_factory=_Totals)
    # ---- observability (metrics and display on rank 0 only) ----
    flops_per_step: float = 0.0
    peak: float = 1.0  # FLOP/s of all ranks together
    entropy: float | None = None
    metrics: MetricsLog | None = None
    display: Any = None
    code_counts: np.ndarray | None = None  # (S, N) code hits of the final evaluation (train.plots)
    # ---- this invocation's clock (the summary's rates) ----
    started: float = 0.0
    first_step: int = 0
    compute_s: float = 0.0

    @property
    def root(self) -> Path:
        return ckpt.checkpoints_dir(self.recipe.run_dir)


@dataclass
class _Step:
    """One optimizer step's outcome, global over ranks, by name."""

    lr: float
    terms: dict[str, torch.Tensor]  # log key -> (size,) mean over micro-batches and ranks
    stats: dict[str, float]  # statistic -> total over micro-batches and ranks
    skipped: bool  # a non-finite loss or gradient on some rank: no update was applied
    stopping: bool  # some rank got SIGINT / SIGTERM
    grad_norm: float | None
    seconds: float  # without the stability diagnostics' forward (``attention``'s own seconds)
    attention: dict[str, float] | None = None  # the stability record's numbers, on the steps it is due


class _Signals:
    """SIGINT / SIGTERM only set ``signum``: the loop finishes the step, saves and exits cleanly."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __enter__(self) -> "_Signals":
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ----------------------------------------------------------------------------- the loop


def train(recipe: Recipe, stage: Stage, out: Any) -> dict[str, Any]:
    """Run ``stage`` for ``recipe``; ``out`` has ``info``/``warn`` and the stderr console ``err``.
    Returns the summary (also what ``--json`` prints)."""
    run = _prepare(recipe, stage, out)
    t, tot = recipe.train, run.tot
    with _Signals() as stop:
        run.engine.train()
        run.started, run.first_step = time.perf_counter(), tot.step
        if run.display is not None:
            run.display.start(t.max_steps, tot.step)
        try:
            while tot.step < t.max_steps:
                step = _optimizer_step(run, stop)
                run.compute_s += step.seconds
                if run.metrics is not None and step.attention is not None:  # also when the step is skipped
                    run.metrics.write({"split": "stability", "step": tot.step, **step.attention})
                if run.faults.sleep:
                    time.sleep(run.faults.sleep)
                _count_nonfinite(run, step)  # raises after train.max_nonfinite in a row
                if not step.skipped:  # the model's per-step hook: every rank, after an applied update
                    run.engine.module.on_step_end(step.stats)
                if run.metrics is not None and (tot.step % t.log_every == 0 or tot.step == t.max_steps):
                    _log_step(run, step)

                last = tot.step == t.max_steps
                if t.eval_every and tot.step % t.eval_every == 0 and not last:
                    _evaluate(run)
                # no periodic save inside a non-finite streak: if the weights themselves went bad,
                # the checkpoint before the streak is the one to go back to
                due = t.save_every and tot.step % t.save_every == 0 and not last and tot.nonfinite_run == 0
                if due or step.stopping:
                    _save(run)
                if step.stopping:
                    run.info(f"stopped by signal at step {tot.step}; `train.resume: auto` continues from here")
                    break
            else:  # max_steps reached: the final evaluation and checkpoint, unless already there
                if tot.last_saved != tot.step or not tot.val:
                    _evaluate(run, collect_codes=t.plots)
                if tot.last_saved != tot.step:
                    _save(run)
        finally:
            if run.display is not None:
                run.display.stop()
            if run.metrics is not None:
                run.metrics.close()
    c = recipe.model_config.concept
    target = c.target_ratio if c.enabled and c.segmentation == "dynamic" else None
    plots = write_plots(recipe.run_dir, run.code_counts, run.warn, target) if run.d.rank == 0 and t.plots else []
    return _summary(run, interrupted=bool(stop.signum), plots=plots)


# ----------------------------------------------------------------------------- preparing a run


def _prepare(recipe: Recipe, stage: Stage, out: Any) -> _Run:
    """distributed set-up -> data -> resume / init checks (all before any heavy work) -> model
    -> DeepSpeed engine -> [restore a checkpoint] -> observability."""
    assert recipe.model_config is not None
    faults = Faults(os.environ.get(FAULT_ENV, ""))  # test hook; a malformed spec fails here
    d = init_distributed()
    info, warn = (out.info, out.warn) if d.rank == 0 else (_quiet, _quiet)
    faults.announce(warn)
    train_ds, val_ds, loader, labels = _open_data(recipe, d)
    resume_from, meta = _weights_source(recipe, stage, d, loader, warn)
    _move_foreign_checkpoints(recipe, resume_from, d, warn)

    model = _build_model(recipe, stage, fresh=resume_from is None, info=info)
    _set_lift_tokens(model, recipe, train_ds, loader, labels, info)
    packing = StepPacking.for_model(model, FLAGS, reserved=RECORD_FIELDS)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info(f"model {recipe.model_config.name}: {n_params:,} parameters, {n_trainable:,} trainable")
    engine, bf16 = _build_engine(recipe, model, d, info)

    run = _Run(recipe, stage, d, faults, info, warn, train_ds, val_ds, loader, engine, packing, resume_from,
               n_params, n_trainable, bf16, labels, _val_sources(recipe, val_ds, info))
    _restore(run, meta)
    _observe(run, out)
    return run


def _set_lift_tokens(model: torch.nn.Module, recipe: Recipe, ds: IndexedDataset, loader: WindowLoader,
                     labels: _Labels, info: Callable[[str], None]) -> None:
    """A steering stage's lift tokens T_c (L_express), from the train split's labels: derived
    from the data at every start, fresh or resumed, so a resume sees the same ones."""
    bn = getattr(model, "bottleneck", None)
    if bn is None or bn.bcfg.express_weight <= 0:
        return
    from ncpctl.data.labels import lift_tokens

    lift = lift_tokens(ds.tokens, loader.labels, bn.bcfg.lift_tokens, recipe.model_config.vocab_size)
    bn.lift = torch.from_numpy(lift)
    empty = [labels.names[c] if labels.names else str(c) for c in range(lift.shape[0]) if lift[c, 0] < 0]
    info(f"steering stage: {bn.bcfg.lift_tokens} lift tokens per concept from the train split's labels"
         + (f" (none for {', '.join(empty)}: no express loss there)" if empty else ""))


def _open_data(recipe: Recipe, d: Dist) -> tuple[IndexedDataset, IndexedDataset, WindowLoader, _Labels]:
    """Train and validation data (and their concept labels), checked against the model and the
    batch (clear errors first)."""
    t, T, G = recipe.train, recipe.seq_len, recipe.global_batch_size
    train_ds, val_ds = _dataset(recipe, "train"), _dataset(recipe, "val")
    vocab = recipe.model_config.vocab_size
    for ds in (train_ds, val_ds):
        _check_vocab(recipe, ds, vocab)
    train_labels, names = _labels(recipe, train_ds)
    labels = _Labels(val=_labels(recipe, val_ds)[0], names=names)
    loader = WindowLoader(train_ds, T, G, seed=t.seed, rank=d.rank, world_size=d.world, labels=train_labels,
                          vocab_size=vocab, vocab_from=_vocab_from(recipe)[0])
    if loader.num_windows < G:
        raise UserError(f"{train_ds.bin_path}: {train_ds.num_tokens:,} tokens make {loader.num_windows} windows of "
                        f"seq_len+1 = {T + 1} tokens, fewer than one global batch of {G}",
                        hint="use more data, or lower train.seq_len / train.global_batch_size")
    WindowLoader(val_ds, T, G, seed=t.seed)  # raises if validation has not one window
    return train_ds, val_ds, loader, labels


def _weights_source(recipe: Recipe, stage: Stage, d: Dist, loader: WindowLoader,
                    warn: Callable[[str], None]) -> tuple[Path | None, dict[str, Any]]:
    """Where the weights come from: resume (same run) wins over init_from (another run). Checks
    that the checkpoint fits (before any heavy work) and positions the loader when resuming.
    Returns the checkpoint to resume from (or None) and its metadata."""
    t, cfg = recipe.train, recipe.model_config
    resume_from: Path | None = None
    if t.resume == "auto":
        resume_from = _resume_checkpoint(recipe, d, warn)
    elif t.resume != "never":
        resume_from = ckpt.resolve(t.resume, "train.resume", pin_it=False)
    if resume_from is not None:
        meta = ckpt.read_meta(resume_from)
        ckpt.check_compatible(resume_from, meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=True)
        if meta.get("stage", stage.name) != stage.name:
            raise UserError(f"{resume_from}: a {meta['stage']} checkpoint; this is `ncpctl {stage.name}`",
                            hint="give this stage its own run.dir, or train.resume: never")
        _check_optimizer(recipe, resume_from, meta)
        loader.load_state_dict(meta["data"]["train"], source=str(resume_from / ckpt.META))
        return resume_from, meta
    if stage.init_from is not None and not stage.hf:
        init_meta = ckpt.read_meta(stage.init_from)
        ckpt.check_compatible(stage.init_from, init_meta, cfg.to_dict(), world_size=d.world,
                              zero_stage=recipe.deepspeed.zero_stage, optimizer_state=stage.load == "all",
                              new_stage=True)
        if stage.load == "all":
            _check_optimizer(recipe, stage.init_from, init_meta)
    return None, {}


def _resume_checkpoint(recipe: Recipe, d: Dist, warn: Callable[[str], None]) -> Path | None:
    """``train.resume: auto``: rank 0 picks (and verifies) the checkpoint, moving damaged ones aside;
    the other ranks learn its choice by an all-reduce."""
    root = ckpt.checkpoints_dir(recipe.run_dir)
    if d.world == 1:
        return ckpt.latest_checkpoint(root, warn)
    chosen = ckpt.latest_checkpoint(root, warn) if d.rank == 0 else None
    pick = torch.tensor([int(chosen.name.removeprefix("step_")) if chosen else -1], dtype=torch.float64)
    step = int(d.sum(pick if d.rank == 0 else torch.zeros_like(pick)).item())
    return root / ckpt.tag_for(step) if step >= 0 else None


def _check_optimizer(recipe: Recipe, src: Path, meta: dict[str, Any]) -> None:
    """Optimizer state is only loadable into the same train.optimizer (checkpoints before the key: adamw)."""
    saved = meta.get("optimizer", "adamw")
    if saved != recipe.train.optimizer:
        raise UserError(f"{src}: train.optimizer: {saved} in the checkpoint, {recipe.train.optimizer} now",
                        hint=f"keep train.optimizer: {saved}, or start a fresh optimizer (midtrain with train.load: weights)")


def _move_foreign_checkpoints(recipe: Recipe, resume_from: Path | None, d: Dist, warn: Callable[[str], None]) -> None:
    """A fresh lineage in a run.dir that holds other checkpoints: move them aside (never delete),
    so keep_last and ``latest`` only ever see this run's checkpoints."""
    root = ckpt.checkpoints_dir(recipe.run_dir)
    if (resume_from is None or resume_from.parent != root) and any(root.glob("step_*")):
        if d.rank == 0:
            aside = root.with_name(f"checkpoints.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(root, aside)
            warn(f"{root} held checkpoints this run does not continue from; moved them to {aside}")
        d.barrier()


def _build_model(recipe: Recipe, stage: Stage, *, fresh: bool, info: Callable[[str], None]) -> torch.nn.Module:
    """The model, seeded alike on every rank, with the stage's set-up: its first weights (a
    checkpoint or a Hugging Face directory; none when resuming), then what it freezes."""
    from ncpctl.model.model import NCPModel

    t, cfg = recipe.train, recipe.model_config
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)  # the fresh parts (e.g. a new concept path) start the same on every rank
    if stage.hf and fresh:
        model = _hf_model(stage.init_from, cfg, t.zero_concept_output)
        info(f"initialised from the Hugging Face model {stage.init_from}")
    else:
        model = NCPModel(cfg)
        if stage.init_from is not None and fresh:
            model.load_state_dict(ckpt.read_weights(stage.init_from))
            info(f"initialised from {stage.init_from} "
                 f"({'weights only' if stage.load == 'weights' else 'weights + optimizer'})")
    if stage.freeze is not None:
        stage.freeze(model)
    return model


def _register_external_parameters(model: torch.nn.Module, zero_stage: int) -> None:
    """ZeRO-3 gathers a parameter for its own module's forward only; NCPModel.forward itself reads
    the LM head's weight (the bottleneck's concept share, the steering stage's gamma) and the
    bottleneck's K (the steering stage's direction), so they are declared to it."""
    bn = getattr(model, "bottleneck", None)
    if zero_stage != 3 or bn is None:
        return
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for p in (model.lm_head.weight, bn.K):
        register_external_parameter(model, p)


def _hf_model(directory: Path, cfg: Any, zero_concept_output: bool) -> torch.nn.Module:
    """The Hugging Face weights in ``cfg``, which the recipe loader resolved from the HF config
    plus the recipe's keys (``load_hf_pretrained`` runs its weight checks)."""
    from ncpctl.interop.hf_import import load_hf_pretrained

    return load_hf_pretrained(directory, cfg=cfg, zero_concept_output=zero_concept_output)


def _build_engine(recipe: Recipe, model: torch.nn.Module, d: Dist, info: Callable[[str], None]) -> tuple[Any, bool]:
    """The DeepSpeed engine: our AdamW (or Muon + AdamW) + warmup/cosine LambdaLR, the generated config."""
    import deepspeed

    on_gpu = d.device.type != "cpu"
    ds_config = deepspeed_config(recipe, on_gpu)
    optimizer = make_optimizer(model, recipe, on_gpu)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(recipe))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if hasattr(optimizer, "bind"):  # Muon: where its matrices lie in the flat ZeRO partitions
        optimizer.bind(engine.optimizer)
    _register_external_parameters(model, recipe.deepspeed.zero_stage)
    bf16 = use_bf16(recipe, on_gpu)
    if bf16:
        info("precision: bf16")
    return engine, bf16


def _restore(run: _Run, meta: dict[str, Any]) -> None:
    """Resume: engine, RNG and counters from the checkpoint. midtrain ``load: all``: the optimizer
    state of init_from, with this recipe's hyperparameters and a fresh schedule."""
    from ncpctl.safe_load import deepspeed_loads_safely

    t, tot, engine = run.recipe.train, run.tot, run.engine
    if run.resume_from is not None:
        src = run.resume_from
        with deepspeed_loads_safely():  # DeepSpeed would unpickle with weights_only=False
            engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
        ckpt.load_rng(src, run.d.rank)
        tot.step, tot.tokens = meta["step"], meta["tokens_seen"]
        tot.nonfinite_total = meta.get("nonfinite_total", 0)
        tot.last_saved, tot.last_good = tot.step, src
        tot.train_loss, tot.val = meta.get("train_loss"), meta.get("val") or {}
        run.info(f"resumed from {src} (step {tot.step}, {tot.tokens:,} tokens)"
                 + ("; already at train.max_steps, nothing to do" if tot.step >= t.max_steps else ""))
    elif run.stage.init_from is not None and run.stage.load == "all":
        src = run.stage.init_from
        with deepspeed_loads_safely():
            engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
        _reset_hyperparameters(engine, run.recipe)


def _observe(run: _Run, out: Any) -> None:
    """Rank 0: metrics.jsonl (+ TensorBoard), recipe.resolved.yaml, the live display. Every rank:
    FLOPs per step and the MFU peak of all ranks together (one collective)."""
    r, d = run.recipe, run.d
    lead, on_gpu = d.rank == 0, d.device.type != "cpu"
    t, T, G = r.train, r.seq_len, r.global_batch_size
    if lead:
        run.metrics = MetricsLog(r.run_dir, t.tensorboard, run.tot.step if run.resume_from else None, run.warn)
        r.write_resolved(r.run_dir)
    run.flops_per_step = flops_per_step(r, run.stage, run.engine.module)
    run.peak = d.sum(torch.tensor([device_peak(on_gpu)[0]], dtype=torch.float64)).item()
    if lead:
        from ncpctl.train.display import TrainDisplay

        run.entropy = unigram_entropy(run.train_ds.tokens, r.model_config.vocab_size)
        run.display = TrainDisplay(out.err, run.stage.name)
        run.info(f"data: {run.loader.num_windows:,} train windows of {T} tokens, global batch {G} "
                 f"({t.micro_batch_size} x {r.grad_accum_steps} accum x {d.world} ranks); "
                 f"unigram entropy {run.entropy:.3f} nats")


def flops_per_step(recipe: Recipe, stage: Stage, model: torch.nn.Module) -> float:
    """Training FLOPs of one optimizer step, the MFU numerator (``ncpctl.model.accounting``): 3x
    forward when every weight trains; for a stage that freezes weights (adapt-vq, LoRA) the
    backward autograd really computes, from the parameters that require grad."""
    from ncpctl.model.accounting import exact_flops

    trainable = None if stage.freeze is None else {  # ZeRO-3 partitions: ds_numel is the full size
        n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    return exact_flops(recipe.model_config, recipe.seq_len, recipe.global_batch_size,
                       trainable=trainable).training_per_step()


# ----------------------------------------------------------------------------- one step


def _optimizer_step(run: _Run, stop: _Signals) -> _Step:
    """grad_accum micro-batches of (micro, T) on every rank (DeepSpeed updates at the boundary),
    then ONE all-reduce of the step vector: log keys, statistics, flags (``StepPacking``)."""
    r, d, engine, pk = run.recipe, run.d, run.engine, run.packing
    t0 = time.perf_counter()
    lr = float(engine.get_lr()[0])
    nan = run.faults.nan(run.tot.step + 1)
    engine.module.on_step_begin(run.tot.step)  # schedules inside the model (the MTP weight)
    batch = torch.from_numpy(next(run.loader))  # (micro * accum, T+1) this rank's share
    attention = _attention_stats(run, batch[: r.train.micro_batch_size]) \
        if _attention_due(r.train.attention_stats_every, run.tot.step + 1) else None
    ids = torch.from_numpy(run.loader.sample_ids()).split(r.train.micro_batch_size)  # global sample indices
    keyed = getattr(engine.module, "uses_sample_ids", False)  # the key of sampled boundaries (DLCM)
    terms = torch.zeros(pk.n_terms, device=d.device)
    stats = torch.zeros(len(pk.stats), device=d.device)
    label_mbs = _micro_labels(run.loader.last_labels(), len(ids), r.train.micro_batch_size)
    for mb, mb_ids, lab in zip(batch.split(r.train.micro_batch_size), ids, label_mbs):
        x, y = (t.to(d.device) for t in engine.module.objective.batch(mb))  # (micro, T) inputs, targets
        kw: dict[str, Any] = {"sample_ids": mb_ids.to(d.device)} if keyed else {}
        if lab is not None:
            kw["concept_labels"] = lab.to(d.device)
        o = engine(x, y, **kw)
        loss = o.loss * float("nan") if nan else o.loss
        engine.backward(loss)
        engine.step()  # DeepSpeed applies the update at the accumulation boundary
        terms += pk.terms(o, loss)  # an injected NaN shows in the logged loss too
        stats += pk.stat_sums(o)
    run.tot.step += 1
    run.tot.tokens += r.global_batch_size * r.seq_len
    applied = engine.was_step_applied()
    grad_norm = engine.get_global_grad_norm()
    flags = {"skipped": not applied, "stop": stop.signum != 0}
    red = pk.split(d.sum(pk.join(terms / r.grad_accum_steps, stats, flags)), mean_over=d.world)
    skipped = red.flags["skipped"] > 0 or not math.isfinite(red.terms[LOSS].item())
    seconds = time.perf_counter() - t0 - (attention["seconds"] if attention else 0.0)
    return _Step(lr, red.terms, red.stats, skipped, red.flags["stop"] > 0,
                 None if grad_norm is None else float(grad_norm), seconds, attention)


def _attention_due(every: int, step: int) -> bool:
    """``train.attention_stats_every``: at step 1 (1-based; the curves start at the init) and every N-th."""
    return every > 0 and (step == 1 or step % every == 0)


def _attention_stats(run: _Run, mb: torch.Tensor) -> dict[str, float]:
    """The stability diagnostics (``NCPModel.attention_stats``) of this rank's micro-batch mb
    (micro, T+1), before the step's update: the weights the step's loss is computed with. Max
    over ranks in one collective; ``seconds``: what it took (kept out of the step's time)."""
    t0 = time.perf_counter()
    x, y = (t.to(run.d.device) for t in run.engine.module.objective.batch(mb))  # (micro, T) inputs, targets
    stats = run.engine.module.attention_stats(x, y)
    values = run.d.max(torch.stack(list(stats.values())).float()) if stats else torch.zeros(0)
    return {**dict(zip(stats, values.tolist())), "seconds": time.perf_counter() - t0}


def _count_nonfinite(run: _Run, step: _Step) -> None:
    """Bad states: a skipped step is counted; train.max_nonfinite in a row stops the run (exit 2)."""
    tot, t = run.tot, run.recipe.train
    if not step.skipped:
        tot.nonfinite_run = 0
        tot.train_loss = step.terms[LOSS].item()
        return
    tot.nonfinite_total += 1
    tot.nonfinite_run += 1
    run.warn(f"step {tot.step}: non-finite loss or gradient; step skipped "
             f"({tot.nonfinite_run} in a row, {tot.nonfinite_total} in total)")
    if tot.nonfinite_run >= t.max_nonfinite:
        last = f"last good checkpoint: {tot.last_good}" if tot.last_good else "no checkpoint was written"
        raise UserError(
            f"training diverged: {tot.nonfinite_run} non-finite steps in a row "
            f"(steps {tot.step - tot.nonfinite_run + 1}-{tot.step}, train.max_nonfinite={t.max_nonfinite})",
            last, hint="lower train.lr, lengthen the warmup or check the data; train.resume: auto "
            "continues from the last good checkpoint")


def _log_step(run: _Run, step: _Step) -> None:
    """The train record (rank 0): the loop's numbers, then the model's log keys and the step
    statistics, by name."""
    r, tot = run.recipe, run.tot
    rec = {"split": "train", "step": tot.step, "lr": step.lr, "tokens": tot.tokens, "grad_norm": step.grad_norm,
           "step_time": step.seconds, "tokens_per_s": r.global_batch_size * r.seq_len / step.seconds,
           "mfu": run.flops_per_step / step.seconds / run.peak, "nonfinite": tot.nonfinite_total,
           **run.packing.record(step.terms), **step.stats}
    run.metrics.write(rec)
    run.display.step(rec)


# ----------------------------------------------------------------------------- evaluate, save, finish


def _evaluate(run: _Run, collect_codes: bool = False) -> None:
    """Validation on train.eval_batches fixed batches: the model's log keys averaged over
    micro-batches, batches and ranks (one collective; no statistics hook). ``collect_codes``:
    also the per-segment code hits the codebook-usage plot shows."""
    r, d, engine, pk, cfg = run.recipe, run.d, run.engine, run.packing, run.recipe.model_config
    t, T, G = r.train, r.seq_len, r.global_batch_size
    S = cfg.n_segments if cfg.concept.enabled else 0
    engine.eval()
    val = WindowLoader(run.val_ds, T, G, seed=t.seed, rank=d.rank, world_size=d.world, labels=run.labels.val,
                       sources=run.val_sources, vocab_size=cfg.vocab_size, vocab_from=_vocab_from(r)[0])
    batches = min(t.eval_batches, math.ceil(val.num_windows / G))
    acc = torch.zeros(pk.n_terms, device=d.device)
    counts = torch.zeros(S, cfg.concept.codes, device=d.device) if collect_codes and S else None
    detection: list[tuple[torch.Tensor, torch.Tensor]] = []  # (chunk scores, chunk labels) per micro-batch
    by_source = None if run.val_sources is None else torch.zeros(2, len(run.val_sources.labels), dtype=torch.long)
    with torch.no_grad():
        for _ in range(batches):
            windows = torch.from_numpy(next(val))
            n_micro = math.ceil(windows.shape[0] / t.micro_batch_size)
            label_mbs = _micro_labels(val.last_labels(), n_micro, t.micro_batch_size)
            src_mbs = _micro_labels(val.last_sources(), n_micro, t.micro_batch_size)
            for mb, lab, src in zip(windows.split(t.micro_batch_size), label_mbs, src_mbs):  # (micro, T+1)
                x, y = (t.to(d.device) for t in engine.module.objective.batch(mb))
                if lab is None:
                    o = engine(x, y)
                else:
                    o = engine(x, y, concept_labels=lab.to(d.device), return_bottleneck=True)
                    detection.append(_chunk_detection(cfg, o, lab))
                if by_source is not None:
                    by_source += _source_counts(o, src, by_source.shape[1])
                acc += pk.terms(o)
                if counts is not None and o.pred is not None:
                    counts += _code_hits(engine, o.concept)
    terms = pk.split_terms(d.sum(acc), mean_over=d.world * batches * r.grad_accum_steps)
    run.tot.val = pk.scalars(terms)
    if detection:
        run.tot.val.update(_detection_auc(detection, d))
    if by_source is not None:
        concepts, tokens = d.sum(by_source.to(d.device)).tolist()
        run.tot.val.update({f"tokens_per_concept/{name}": n / c for name, c, n in
                            zip(run.val_sources.labels, concepts, tokens) if n > 0})
    if counts is not None:
        run.code_counts = d.sum(counts.flatten()).view(S, -1).numpy()
    engine.train()
    if run.metrics is not None:
        run.metrics.write({"split": "val", "step": run.tot.step, **run.tot.val})
    if run.display is not None:
        run.display.validation(run.tot.step, run.tot.val)


def _source_counts(o: Any, sources: torch.Tensor, n: int) -> torch.Tensor:
    """(2, n) long: the concepts started (segment starts, b_t = 1) and the tokens of one
    micro-batch per source, from its inference segments (``Segments.closed`` (micro, T)) and each
    token's source (micro, T); tokens / concepts per source is validation's tokens per concept
    there (the global ratio, as DLCM Table 5, not a mean of window ratios)."""
    from ncpctl.evaluate.concept_position import positions_in_concept

    starts = (positions_in_concept(o.concept.segments.closed) == 1).long().cpu().flatten()
    src = sources.flatten()
    return torch.stack([torch.zeros(n, dtype=torch.long).index_add_(0, src, starts),
                        torch.bincount(src, minlength=n)])


def _chunk_detection(cfg: Any, o: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out concept detection of one micro-batch: the known head's chunk probabilities (the OR
    over a chunk's tokens) against the chunk labels, both (B * chunks, n), on the CPU."""
    from ncpctl.model.bottleneck import chunk_labels, chunk_probs

    chunk = cfg.bottleneck.chunk
    scores = chunk_probs(o.bottleneck.k_logits.float(), chunk).cpu()
    return scores.reshape(-1, scores.shape[-1]), chunk_labels(labels.float(), chunk).reshape(-1, scores.shape[-1])


def _detection_auc(parts: list[tuple[torch.Tensor, torch.Tensor]], d: Dist) -> dict[str, float]:
    """The held-out detection keys (``ncpctl.model.bottleneck.concept_auc``: the macro AUC with its
    interval, the pooled AUC beside its base rate) over every rank's chunks: AUC does not decompose
    over shards, so the (chunks, n) scores and labels of all ranks are gathered (zero-padded blocks,
    one sum) and every rank scores the whole split."""
    from ncpctl.model.bottleneck import concept_auc

    scores, labels = torch.cat([s for s, _ in parts]), torch.cat([lab for _, lab in parts])
    if d.world > 1:
        rows = int(d.max(torch.tensor([scores.shape[0]], dtype=torch.float64)).item())
        counts = torch.zeros(d.world, dtype=torch.float64)
        counts[d.rank] = scores.shape[0]
        counts = d.sum(counts).long().tolist()
        # fp32, as the scores are (a sum with zeros is exact); Dist.sum hands back float64
        block = torch.zeros(d.world, rows, 2, scores.shape[1])
        block[d.rank, : scores.shape[0]] = torch.stack([scores.float(), labels.float()], 1)
        block = d.sum(block.flatten()).float().view(d.world, rows, 2, -1)
        both = torch.cat([block[r, :c] for r, c in enumerate(counts)])
        scores, labels = both[:, 0], both[:, 1]
    return concept_auc(scores, labels)


def _save(run: _Run) -> None:
    """A checkpoint (collective): DeepSpeed's state plus the training state ncpctl.json records."""
    r, tot, stage = run.recipe, run.tot, run.stage
    meta = {"stage": stage.name, "tokens_seen": tot.tokens, "model_config": r.model_config.to_dict(),
            "optimizer": r.train.optimizer,
            "concept_names": run.labels.names,  # model.bottleneck's labels
            "data": {"train": run.loader.state_dict(), "train_prefix": str(run.train_ds.bin_path)[:-4]},
            "world_size": run.d.world, "zero_stage": r.deepspeed.zero_stage,
            "nonfinite_total": tot.nonfinite_total, "train_loss": tot.train_loss, "val": tot.val,
            "init_from": str(stage.init_from) if stage.init_from else None}
    if r.train.lora is not None and stage.name == "midtrain":
        from ncpctl.train.lora import describe

        meta["lora"] = describe(r.train.lora)  # model.safetensors holds the adapters merged in
    tot.last_good = ckpt.save(run.engine, run.root, tot.step, meta, r, rank=run.d.rank,
                              keep_last=r.train.keep_last, barrier=run.d.barrier, fault=run.faults)
    tot.last_saved = tot.step
    run.info(f"[dim]saved {tot.last_good}[/]")


def _summary(run: _Run, *, interrupted: bool, plots: list[str]) -> dict[str, Any]:
    r, tot, stage = run.recipe, run.tot, run.stage
    elapsed = time.perf_counter() - run.started
    steps, compute_s = tot.step - run.first_step, run.compute_s
    tokens_per_step = r.global_batch_size * r.seq_len
    return {
        "stage": stage.name, "run_dir": str(r.run_dir), "step": tot.step, "max_steps": r.train.max_steps,
        "tokens": tot.tokens, "train_loss": tot.train_loss, "val": tot.val,
        "unigram_entropy": run.entropy, "parameters": run.n_params, "trainable_parameters": run.n_trainable,
        "steps_run": steps, "seconds": round(elapsed, 2),
        "steps_per_s": steps / compute_s if compute_s else None,
        "tokens_per_s": steps * tokens_per_step / compute_s if compute_s else None,
        "mfu": run.flops_per_step * steps / compute_s / run.peak if compute_s else None,
        "nonfinite_steps": tot.nonfinite_total, "interrupted": interrupted,
        "checkpoint": str(tot.last_good) if tot.last_good else None,
        "resumed_from": str(run.resume_from) if run.resume_from else None,
        "init_from": str(stage.init_from) if stage.init_from else None,
        "world_size": run.d.world, "zero_stage": r.deepspeed.zero_stage, "bf16": run.bf16,
        "plots": plots,
    }


def _code_hits(engine: Any, co: Any) -> torch.Tensor:
    """(S, N) counts of the nearest code of each predicted concept ``co.pred`` (B, M, d), per
    segment; a row's padding concepts (``co.segments.valid`` false) are not counted."""
    import deepspeed

    from ncpctl.model.concept import nearest_code

    cb = engine.module.concept.codebook
    with deepspeed.zero.GatheredParameters(list(cb.parameters())):  # no-op below ZeRO-3
        codes = cb().detach()  # (S, N, ds)
    idx = nearest_code(co.pred.detach(), codes).reshape(-1, codes.shape[0])  # (B*M, S)
    valid = co.segments.valid
    ones = torch.ones(idx.t().shape, device=idx.device)
    if valid is not None:
        ones = ones * valid.reshape(1, -1).to(ones.dtype)
    counts = codes.new_zeros(codes.shape[0], codes.shape[1], dtype=torch.float32)
    counts.scatter_add_(1, idx.t(), ones)
    return counts


def _reset_hyperparameters(engine: Any, recipe: Recipe) -> None:
    """midtrain with ``load: all``: the optimizer *state* comes from the checkpoint, but lr,
    betas, eps, weight decay (and Muon's momentum and scale) are this recipe's (the loaded param
    groups carry the old ones). Each group keeps its decoupled-muP multiplier (``lr_mult``,
    ``eps_mult``: 1/s of its module, by group name as ``param_groups`` builds them for this model)
    on its module's base rate (``base_lrs``)."""
    from ncpctl.train.config import base_lrs, param_groups

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

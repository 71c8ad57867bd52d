"""Observability: ``run.dir/metrics.jsonl`` (always), TensorBoard (when asked and installed),
the unigram-entropy baseline, and the ``train.plots`` PNGs.

metrics.jsonl holds one JSON object per line. Training records (``"split": "train"``): the
loop's step, lr, tokens, grad_norm, step_time, tokens_per_s, mfu, nonfinite (skipped steps so
far), then the model's log keys (``NCPModel.log_keys()``; per-segment vectors as their mean,
and for keys logged per element also ``{name}_per_{per}``) and its step statistics
(``stat_keys()``, totals). For the shipped models: loss, ntp_loss, ncp_loss, vq_loss,
commitment_loss, ncp_rel (the NCP term over its targets' nearest codes'), code_perplexity,
ncp_code_acc, code_usage (mean over segments), code_usage_per_segment.
Validation records (``"split": "val"``): step and the means of the log keys not logged per
element. Stability records (``"split": "stability"``, ``train.attention_stats_every``): step,
``attn/max_logit``, ``attn/max_q_norm``, ``attn/max_k_norm`` (over all attention layers) and the
same per layer as ``attn/{layer}/{quantity}`` (``NCPModel.attention_stats``), and ``seconds``.
Downstream records (``"split": "downstream"``, ``train.eval_tasks``; ``ncpctl.train.downstream``):
step, ``seconds`` and ``eval/<task>/<metric>``; one that failed: step and ``error`` (one line). The names are the recipe's and the model's (one vocabulary); the code here lists
none of them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from ncpctl.fsutil import atomic_write, atomic_write_with, disk_errors
from ncpctl.run_metrics import METRICS, read_metrics, records  # noqa: F401 (this module's API)


def unigram_entropy(tokens: np.ndarray | list[tuple[float, np.ndarray]], vocab_size: int,
                    limit: int = 200_000_000) -> float:
    """Entropy in nats of the unigram token distribution (the loss a model knowing only
    token frequencies would reach; a trained model must get clearly below it). ``tokens``: one
    array, or ``(weight, tokens)`` per data.mix component: the weighted mixture of their unigrams."""
    if isinstance(tokens, list):
        mixed = np.zeros(vocab_size)
        for w, t in tokens:
            counts = np.bincount(np.asarray(t[:limit // len(tokens)]), minlength=vocab_size).astype(np.float64)
            mixed += w * counts / max(counts.sum(), 1.0)
        p = mixed[mixed > 0] / mixed.sum()
        return float(-(p * np.log(p)).sum())
    counts = np.bincount(np.asarray(tokens[:limit]), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class MetricsLog:
    """Appends records to metrics.jsonl (rank 0 only) and mirrors scalars to TensorBoard and to
    ``tracker`` (a ``ncpctl.train.tracking.WandbRun``, or None), which ``finish`` ends."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None, warn: Any,
                 tracker: Any = None):
        self.tracker = tracker
        self.path = run_dir / METRICS
        with disk_errors(self.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                self._truncate_after(resume_step, warn)
            elif resume_step is None and self.path.exists():
                os.replace(self.path, self.path.with_suffix(".jsonl.prev"))  # a fresh run: keep one old log
            self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step)
            except ImportError:
                warn("train.tensorboard is set but tensorboard is not installed (pip install tensorboard); skipping it")

    def _truncate_after(self, step: int, warn: Any) -> None:
        """Resumed from ``step``: drop the records a killed run wrote after it (atomically), and a
        torn last line (a crash in the middle of writing it) with a warning."""
        keep = [json.dumps(r) for r in records(self.path, warn) if r.get("step", 0) <= step]
        atomic_write(self.path, "".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        with disk_errors(self.path):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is None and self.tracker is None:
            return
        # the numeric fields as SPLIT/KEY, the names both mirrors use (lists and strings stay in the jsonl)
        split, step = record.get("split", "train"), int(record["step"])
        scalars = {f"{split}/{key}": value for key, value in record.items()
                   if isinstance(value, (int, float)) and key not in ("step", "split") and math.isfinite(value)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.tracker is not None:
            self.tracker.log(scalars, step)

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # a full disk: write() already said so, and a buffered line is lost either way
            pass
        if self.tb is not None:
            self.tb.close()

    def finish(self, images: list[Path]) -> None:
        """After the plots (``images``, written once the loop is done): the tracker logs them and ends."""
        if self.tracker is not None:
            self.tracker.finish(images)
            self.tracker = None


def write_plots(run_dir: Path, code_counts: np.ndarray | None = None, warn: Any = None,
                target_ratio: float | None = None) -> list[str]:
    """``loss_curves.png`` (train loss terms and validation losses against step, per data.mix
    component too: the ``KEY/NAME`` keys),
    ``codebook_usage.png`` (one panel per codebook segment: how often each code is the nearest
    code of a predicted concept over the final validation pass, sorted; ConceptLM Fig. 5),
    when there are stability records, ``attention_stats.png`` (``_attention_plot``) and, when the
    records carry ``tokens_per_concept`` (a dynamic segmentation), ``compression.png``
    (``_compression_plot``; ``target_ratio``: R, drawn as a line). Returns the file names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("train.plots is set but matplotlib is not installed (pip install 'ncpctl[plots]'); skipping plots")
        return []
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    written = []
    # one panel per loss term: the total, then every `*_loss` the model logs, in record order
    keys = dict.fromkeys(k for r in train for k in r if k == "loss" or k.endswith("_loss"))
    terms = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in train)]
    fig, axes = plt.subplots(1, len(terms), figsize=(4 * len(terms), 3.2), squeeze=False)
    for ax, key in zip(axes[0], terms):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None and math.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), label="train", lw=1)
        vpts = [(r["step"], r[key]) for r in val if r.get(key) is not None]
        if vpts:
            ax.plot(*zip(*vpts), "o-", label="val", ms=3)
        for comp in dict.fromkeys(k for r in val for k in r if k.startswith(key + "/")):  # data.mix components
            cpts = [(r["step"], r[comp]) for r in val if isinstance(r.get(comp), (int, float))]
            ax.plot(*zip(*cpts), ".--", lw=0.8, ms=3, label=f"val: {comp.split('/', 1)[1]}")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    atomic_write_with(run_dir / "loss_curves.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    written.append("loss_curves.png")
    if code_counts is not None:
        S = code_counts.shape[0]
        cols = min(S, 4)
        rows = math.ceil(S / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
        for s in range(S):
            ax = axes[s // cols][s % cols]
            freq = np.sort(code_counts[s])[::-1] / max(1, code_counts[s].sum())
            used = int((code_counts[s] > 0).sum())
            ax.bar(np.arange(len(freq)), freq, width=1.0)
            ax.set_title(f"segment {s}: {used}/{len(freq)} codes used", fontsize=9)
            ax.set_xlabel("code (by frequency)", fontsize=8)
        for s in range(S, rows * cols):
            axes[s // cols][s % cols].axis("off")
        fig.tight_layout()
        atomic_write_with(run_dir / "codebook_usage.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
        plt.close(fig)
        written.append("codebook_usage.png")
    stability = [r for r in records if r.get("split") == "stability"]
    if stability:
        _attention_plot(plt, run_dir / "attention_stats.png", stability, train)
        written.append("attention_stats.png")
    if any("tokens_per_concept" in r for r in train + val):
        _compression_plot(plt, run_dir / "compression.png", train, val, target_ratio)
        written.append("compression.png")
    # a failed in-loop evaluation's record holds an error and no scores (ncpctl.train.stopping)
    downstream = [r for r in records if r.get("split") == "downstream" and any(k.startswith("eval/") for k in r)]
    if downstream:
        _downstream_plot(plt, run_dir / "downstream.png", downstream)
        written.append("downstream.png")
    return written


def _downstream_plot(plt: Any, path: Path, recs: list[dict[str, Any]]) -> None:
    """train.eval_tasks (``ncpctl.train.downstream``): one panel per task, its metrics against step."""
    keys = list(dict.fromkeys(k for r in recs for k in r if k.startswith("eval/")))
    tasks = list(dict.fromkeys(k.split("/")[1] for k in keys))
    cols = min(len(tasks), 4)
    fig, axes = plt.subplots(math.ceil(len(tasks) / cols), cols, figsize=(3.6 * cols, 3.0 * math.ceil(len(tasks) / cols)),
                             squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, task in zip(flat, tasks):
        for key in (k for k in keys if k.split("/")[1] == task):
            pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=3, lw=1, label=key.split("/", 2)[2])
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in flat[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _compression_plot(plt: Any, path: Path, train: list[dict[str, Any]], val: list[dict[str, Any]],
                      target: float | None) -> None:
    """DLCM Fig. 8 for this run: the compressed length over training, as tokens per concept (train:
    the sampled boundaries of each step; validation: the inference threshold, overall and per
    ``data.sources`` entry, the ``tokens_per_concept/<source>`` keys), with the target R; and the
    boundary rate F and mean boundary probability G the load balance drives to 1/R."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), squeeze=False)
    ax = axes[0][0]
    for recs, style, label in ((train, "-", "train (sampled)"), (val, "o-", "val (p >= threshold)")):
        pts = [(r["step"], r["tokens_per_concept"]) for r in recs if isinstance(r.get("tokens_per_concept"), (int, float))]
        if pts:
            ax.plot(*zip(*pts), style, lw=1, ms=3, label=label)
    per_source = dict.fromkeys(k for r in val for k in r if k.startswith("tokens_per_concept/"))
    if len(per_source) > 1:  # one source: the same as the overall line
        for key in per_source:
            pts = [(r["step"], r[key]) for r in val if isinstance(r.get(key), (int, float))]
            ax.plot(*zip(*pts), ".--", lw=0.8, ms=3, label=f"val: {key.split('/', 1)[1]}")
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target R = {target:g}")
    ax.set_title("tokens per concept")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for key, label in (("boundary_rate", "F (train)"), ("boundary_prob", "G (train)")):
        pts = [(r["step"], r[key]) for r in train if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), lw=1, label=label)
    if target is not None:
        ax.axhline(1 / target, color="k", ls="--", lw=1, label="1/R")
    ax.set_title("boundary rate F, probability G")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _attention_plot(plt: Any, path: Path, recs: list[dict[str, Any]], train: list[dict[str, Any]]) -> None:
    """NCP-ArchPreview Figs. 5-6 for this run: max attention logit, max query norm and max key norm
    of each attention layer against step (one line per layer, a colour map per stack, the max over
    layers in black), and the training loss on the same steps for the spikes to line up with."""
    layers = list(dict.fromkeys(k.split("/")[1] for r in recs for k in r if k.count("/") == 2))
    stacks = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in layers))
    cmaps = ("Blues", "Greens", "Oranges", "Purples", "Greys")
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4), squeeze=False)
    for ax, q in zip(axes[0], ("max_logit", "max_q_norm", "max_k_norm")):
        for stack_i, stack in enumerate(stacks):
            members = [n for n in layers if n.rsplit(".", 1)[0] == stack]
            cmap = plt.get_cmap(cmaps[min(stack_i, len(cmaps) - 1)])
            for j, name in enumerate(members):
                pts = [(r["step"], r[f"attn/{name}/{q}"]) for r in recs if r.get(f"attn/{name}/{q}") is not None]
                if pts:  # depth from light to dark; one legend entry per stack
                    ax.plot(*zip(*pts), lw=1, color=cmap(0.35 + 0.6 * (j + 1) / len(members)),
                            label=f"{stack}.*" if j == len(members) - 1 else None)
        top = [(r["step"], r[f"attn/{q}"]) for r in recs if r.get(f"attn/{q}") is not None]
        if top:
            ax.plot(*zip(*top), "k:", lw=1.5, label="max")  # dotted: the top layer shows under it
        ax.set_title(q.replace("_", " "))
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    loss = [(r["step"], r["loss"]) for r in train if r.get("loss") is not None and math.isfinite(r["loss"])]
    ax = axes[0][3]
    if loss:
        ax.plot(*zip(*loss), lw=1)
    ax.set_title("train loss")
    ax.set_xlabel("step")
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)

"""The live training display on stderr (rank 0): a rich progress bar with ETA and the loss terms.

On a terminal the bar leads with the step counter and the ETA (what a narrow terminal must not
cut off), then the bar, the elapsed time and the loss terms. Where stderr is not a terminal
(nohup, Slurm, ``| tee``) a live bar prints nothing until the end, so every logged step
(``train.log_every``) prints one plain line instead: ``pretrain step 120/600 (20%) ETA 0:02:44
elapsed 0:00:41 | loss ...``.

Generic over the model's log keys: it shows ``loss`` and every other ``*_loss`` term of the
record (``ntp_loss`` as ``ntp``, ...) in the record's order, plus the few keys with a display
format of their own (``PERCENT``); other keys are in metrics.jsonl, not on the line.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

PERCENT = {"code_usage": "codes"}  # record key -> label, shown as a percentage when present


def _short(key: str) -> str:
    return key.removesuffix("_loss")


def term_text(rec: dict[str, Any], key: str, fmt: str = ".4f") -> str:
    """``ncp 184.1000 (rel 1.012)``: a loss term, with its relative figure when the record has one
    (``{term}_rel``, e.g. the NCP term over its targets' nearest codes': the term's level is the
    codebook's reach, which grows with the targets' norm; ``ncpctl.model.core.concept``)."""
    rel = rec.get(_short(key) + "_rel")
    return f"{_short(key)} {rec[key]:{fmt}}" + (f" (rel {rel:.3f})" if isinstance(rel, (int, float)) else "")


def loss_terms(rec: dict[str, Any]) -> list[str]:
    """The record's loss terms besides the total ``loss``, in record order (``ntp_loss`` first)."""
    return [k for k, v in rec.items() if k.endswith("_loss") and isinstance(v, (int, float))]


def estimate_terms(rec: dict[str, Any]) -> list[str]:
    """The record's Monte Carlo estimates (a key with a ``{key}_stderr`` beside it, e.g. the CDLM's
    held-out ELBO ``diffusion_elbo``) as ``key value ± stderr``."""
    return [f"{k} {v:.4f} ± {rec[k + '_stderr']:.4f}" for k, v in rec.items()
            if isinstance(v, (int, float)) and isinstance(rec.get(k + "_stderr"), (int, float))]


def detection_line(val: dict[str, Any]) -> str:
    """The bottleneck's held-out detection in words: the macro AUC with its interval and the concepts
    it covers, and the pooled AUC never without its input-free base rate
    (``ncpctl.model.designs.bottleneck.module.concept_auc``)."""
    n = val["concept_auc_concepts"] + val["concept_auc_skipped"]
    return (f"concept AUC {val['concept_auc']:.3f} [{val['concept_auc_low']:.3f}, {val['concept_auc_high']:.3f}] "
            f"(macro over {val['concept_auc_concepts']}/{n} concepts; pooled {val['concept_auc_pooled']:.3f}, "
            f"base rate {val['concept_auc_pooled_base_rate']:.3f})")


class TrainDisplay:
    """``start(total, done)``, ``step(record)`` per logged step, ``validation(step, record)``,
    ``message(text)``, ``stop()``."""

    def __init__(self, console: Any, stage: str, plain: bool | None = None):
        """``plain``: print one line per logged step instead of a live bar (default: when the
        console is not a terminal)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn
        from rich.table import Column

        self.console, self.stage = console, stage
        self.plain = (not console.is_terminal) if plain is None else plain
        self.progress = Progress(
            TextColumn(f"[bold]{stage}[/]", table_column=Column(no_wrap=True, min_width=len(stage))),
            # the counter and the ETA first: a narrow terminal cuts the end of the line
            MofNCompleteColumn(), TextColumn("ETA"), TimeRemainingColumn(), BarColumn(bar_width=20),
            TimeElapsedColumn(),
            # the loss terms take what is left of the line and are cut, not wrapped, when narrow
            TextColumn("{task.fields[terms]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            # expand: the fixed columns keep their width, the loss terms (ratio) get the rest
            console=console, refresh_per_second=4, transient=False, expand=True,
        )
        self.task = None
        self.total = self.first = 0
        self.t0 = time.monotonic()

    def start(self, total: int, done: int) -> None:
        self.task = self.progress.add_task("train", total=total, completed=done, terms="")
        self.total, self.first, self.t0 = total, done, time.monotonic()
        if not self.plain:
            self.progress.start()

    def plain_line(self, step: int, terms: str) -> str:
        """``STAGE step S/N (P%) ETA h:mm:ss elapsed h:mm:ss | terms``; the ETA extrapolates the
        steps this process ran (a resumed run's earlier steps took no time here)."""
        took = time.monotonic() - self.t0
        ran = step - self.first
        eta = timedelta(seconds=round(took / ran * (self.total - step))) if ran > 0 else "-:--:--"
        pct = 100 * step // self.total if self.total else 100
        return (f"{self.stage} step {step}/{self.total} ({pct}%) ETA {eta} "
                f"elapsed {timedelta(seconds=round(took))} | {terms}")

    def step(self, rec: dict[str, Any]) -> None:
        terms = f"loss {rec['loss']:.4f}"
        for key in loss_terms(rec):
            terms += "  " + term_text(rec, key)
        for key, label in PERCENT.items():
            if rec.get(key) is not None:
                terms += f"  {label} {100 * rec[key]:.0f}%"
        terms += f"  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("mfu") is not None:
            terms += f"  MFU {100 * rec['mfu']:.1f}%"
        if rec.get("nonfinite"):
            terms += f"  [yellow]skipped {rec['nonfinite']}[/]"
        self.progress.update(self.task, completed=rec["step"], terms=terms)
        if self.plain:
            self.console.print(self.plain_line(rec["step"], terms), highlight=False, soft_wrap=True)  # one line in a log

    def validation(self, step: int, val: dict[str, Any]) -> None:
        """One line per evaluation: the total, with several loss terms the first one (the token
        loss, comparable across models), and with learned segments the tokens per concept (per
        data.sources entry when there are several); with data.mix each component's loss."""
        parts = loss_terms(val)
        first = f" ({term_text(val, parts[0])})" if len(parts) > 1 else ""
        extra = ""
        if isinstance(val.get("tokens_per_concept"), (int, float)):  # learned segments: the realised compression
            extra = f", {val['tokens_per_concept']:.2f} tokens per concept"
            per = {k.split("/", 1)[1]: v for k, v in val.items() if k.startswith("tokens_per_concept/")}
            if len(per) > 1:
                extra += " (" + ", ".join(f"{name} {v:.2f}" for name, v in per.items()) + ")"
        if isinstance(val.get("concept_auc"), (int, float)):  # a bottleneck: held-out concept detection
            extra += ", " + detection_line(val)
        extra += "".join(", " + s for s in estimate_terms(val))
        per = {k.split("/", 1)[1]: v for k, v in val.items() if k.startswith("loss/")}  # data.mix components
        if per:
            extra += " (" + ", ".join(f"{name} {v:.4f}" for name, v in per.items()) + ")"
        self.message(f"step {step}: val loss {val['loss']:.4f}{first}{extra}")

    def message(self, text: str) -> None:
        self.progress.console.print(text)

    def stop(self) -> None:
        if not self.plain:
            self.progress.stop()

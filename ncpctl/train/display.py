"""The live training display on stderr (rank 0): a rich progress bar with ETA and the loss terms."""

from __future__ import annotations

from typing import Any


class TrainDisplay:
    """``start(total, done)``, ``step(record)`` per logged step, ``message(text)``, ``stop()``."""

    def __init__(self, console: Any, stage: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn
        from rich.table import Column

        self.console = console
        self.progress = Progress(
            TextColumn(f"[bold]{stage}[/]", table_column=Column(no_wrap=True, min_width=len(stage))),
            BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(),
            # the loss terms take what is left of the line and are cut, not wrapped, when narrow
            TextColumn("{task.fields[terms]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=console, refresh_per_second=4, transient=False,
        )
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.task = self.progress.add_task("train", total=total, completed=done, terms="")
        self.progress.start()

    def step(self, rec: dict[str, Any]) -> None:
        terms = f"loss {rec['loss']:.4f}"
        for key, short in (("ntp_loss", "ntp"), ("ncp_loss", "ncp"), ("vq_loss", "vq")):
            if rec.get(key) is not None:
                terms += f"  {short} {rec[key]:.4f}"
        if rec.get("code_usage") is not None:
            terms += f"  codes {100 * rec['code_usage']:.0f}%"
        terms += f"  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("mfu") is not None:
            terms += f"  MFU {100 * rec['mfu']:.1f}%"
        if rec.get("nonfinite"):
            terms += f"  [yellow]skipped {rec['nonfinite']}[/]"
        self.progress.update(self.task, completed=rec["step"], terms=terms)

    def message(self, text: str) -> None:
        self.progress.console.print(text)

    def stop(self) -> None:
        self.progress.stop()

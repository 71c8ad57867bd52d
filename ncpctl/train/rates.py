"""The run's clock: the seconds this process's optimizer steps took, for the summary's rates.

Two things are kept apart from the rate (issue 46 items 1 and 6):

* ``train.compile``: the first step traces and compiles the blocks (``ncpctl.train.compiled``),
  tens of seconds to minutes before it is logged. The loop says so before it starts; the step's
  time is reported as ``compile_s`` and left out of steps/s (it is compilation, not training).
* a machine that got busy: when the recent steps take ``SLOW`` times as long as the run's own
  first ones (medians over ``WINDOW`` steps each), one warning line says so once, with the load
  average, and points to the thread policy (``ncpctl.threads``).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

WINDOW = 5  # steps in each median: the first ones (after a compiling step) and the most recent
SLOW = 3.0  # how many times slower the recent steps must be for the hint


def compiling_line(blocks: str = "the blocks") -> str:
    return (f"train.compile: the first step traces and compiles {blocks} (torch.compile, inductor); it is "
            "logged when that is done (at debug size on 2 CPU cores: minutes the first time, ~10 s once "
            "inductor's cache holds the kernels), and its time is reported apart from steps/s")


@dataclass
class Rates:
    """``add(seconds)`` after every optimizer step of this process; ``steps`` and ``compute_s``
    count the steps whose time is training (all of them, or all but a compiling first one)."""

    compiling: bool = False
    info: Callable[[str], None] = lambda m: None
    warn: Callable[[str], None] = lambda m: None
    steps: int = 0
    compute_s: float = 0.0
    compile_s: float | None = None
    first: list[float] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    hinted: bool = False

    def add(self, seconds: float, aside: float = 0.0) -> None:
        """``seconds`` of the step's training; ``aside``: what else ran in it (the stability
        diagnostics' forward, which compiles a no-grad graph of its own on a compiling step)."""
        if self.compiling and self.compile_s is None:
            self.compile_s = seconds + aside
            self.info(f"train.compile: the first step took {self.compile_s:.1f} s, compilation included "
                      "(kept out of steps/s)")
            return
        self.steps += 1
        self.compute_s += seconds
        if len(self.first) < WINDOW:
            self.first.append(seconds)
            return
        self.recent.append(seconds)
        if not self.hinted and len(self.recent) == WINDOW:
            was, now = statistics.median(self.first), statistics.median(self.recent)
            if now > SLOW * was:
                self.hinted = True
                self.warn(slow_line(was, now))

    @property
    def steps_per_s(self) -> float | None:
        return self.steps / self.compute_s if self.compute_s else None

    @classmethod
    def for_run(cls, recipe, on_gpu: bool, steps_left: int, info: Callable[[str], None],
                warn: Callable[[str], None]) -> "Rates":
        """The clock of a run about to take ``steps_left`` steps; says so when it compiles first."""
        from ncpctl.train.compiled import why_not
        from ncpctl.train.engine import compiles

        compiling = compiles(recipe.train.compile, on_gpu) and steps_left > 0 and why_not(on_gpu) is None
        if compiling:
            info(compiling_line())
        return cls(compiling, info, warn)


def slow_line(was: float, now: float) -> str:
    """The one-line hint: how much slower, the load, what to look at."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return (f"steps now take {now / was:.1f}x as long as this run's first ones ({now:.3g} s against {was:.3g} s); "
            f"load average {load:.1f} on {cores} cores: other processes are using them (docs/getting-started.md: "
            "threads on a busy machine)")

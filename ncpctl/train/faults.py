"""The tests' fault injection (``$NCPCTL_FAULT``): NaN losses, a SIGKILL inside a checkpoint write, a
SIGTERM at a known step, a pause per step. A callback of the run (``ncpctl.train.callbacks``) only
when set; the step asks ``nan(step)`` and the checkpoint save calls it between its files and
``latest`` (``ncpctl.train.checkpoint.save``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

from ncpctl.errors import UserError
from ncpctl.train.callbacks import Callback

FAULT_ENV = "NCPCTL_FAULT"  # test hook, see Faults


class Faults(Callback):
    """Failure injection for the tests, from ``$NCPCTL_FAULT`` (comma-separated):
    ``nan@S`` makes step S's loss NaN; ``kill_in_save@S`` SIGKILLs the process after DeepSpeed
    wrote checkpoint S but before it became ``latest``; ``term@S`` sends the process SIGTERM as
    step S begins (a preemption notice at a known step); ``sleep@SECONDS`` pauses after every
    step (so a test can kill a run mid-way). Unset in normal use.

    An environment variable rather than a recipe key: the faults must reach the real entry
    point (also under the launcher) without becoming part of the documented recipe. So that it
    cannot act unnoticed, any item that is not exactly one of the forms above is an error before
    training starts, and an active spec is announced on stderr (``announce``)."""

    KINDS = {"nan": int, "kill_in_save": int, "term": int, "sleep": float}

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
                                "(nan@STEP, kill_in_save@STEP, term@STEP or sleep@SECONDS)",
                                hint=f"{FAULT_ENV} is a test hook; unset it for real runs") from None
            if kind == "sleep":
                self.sleep = float(number)
            else:
                self.items.add((kind, str(number)))

    def announce(self, warn: Callable[[str], None]) -> None:
        if self.spec:
            warn(f"{FAULT_ENV}={self.spec}: test fault injection is active (unset it for real runs)")

    @property
    def active(self) -> bool:
        """Whether any fault is set (only then is it one of the run's callbacks)."""
        return bool(self.items) or self.sleep > 0

    def nan(self, step: int) -> bool:
        return ("nan", str(step)) in self.items

    def __call__(self, where: str, step: int) -> None:
        if (f"kill_in_{where}", str(step)) in self.items:
            os.kill(os.getpid(), signal.SIGKILL)
        if where == "step" and ("term", str(step)) in self.items:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_begin(self, run: Any, step: int) -> None:
        self("step", step)  # term@STEP

    def on_step_end(self, run: Any, step: Any) -> None:
        if self.sleep:
            time.sleep(self.sleep)

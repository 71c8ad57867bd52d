"""Stopping a training run on a signal, and evaluations that fail or are cut short (issue 42 item 4).

* ``Signals``: the first SIGINT / SIGTERM only sets ``signum``; the loop finishes the step (or
  abandons an evaluation, below), saves a checkpoint and exits cleanly. A second one forces the
  exit: right after the checkpoint save in progress (``saving``: a save is never cut in half), or at
  once when none is (``KeyboardInterrupt``: exit 130, the last complete checkpoint stays ``latest``).
* ``abandon_on_stop``: during an evaluation (validation, ``train.eval_tasks``) a stop signal is
  checked before every forward of the model, i.e. between evaluation batches: the evaluation is
  abandoned (``Abandoned``) and the loop saves at once. A preemption's grace period is shorter than
  a real evaluation. The check is one all-reduce per forward on more than one rank, so that every
  rank abandons at the same forward (each runs the same forwards in the same order); the hook runs
  before any other forward pre-hook (ZeRO-3's parameter gather included).
* ``downstream_or_failure``: the in-loop evaluation (``train.eval_tasks``). One that fails (a
  task's data gone, a disk error: a ``UserError`` or ``OSError``) becomes a failure record
  (``{"split": "downstream", "step", "error"}``, the error in one line, naming the file when the
  error does) and a warning, and training goes on; any other error stops the run once the
  checkpoint of this step is saved (its weights are good). Every rank takes the same path
  (``Dist.any``), so no rank is left waiting in a collective the others skipped.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Callable, Iterator

import torch

from ncpctl.errors import UserError
from ncpctl.train import downstream


class Abandoned(Exception):
    """An evaluation cut short by a stop signal (the loop saves at once)."""


class Signals:
    """SIGINT / SIGTERM handling of the training loop (the module doc)."""

    def __init__(self) -> None:
        self.signum = 0
        self.saving = False  # a checkpoint save in progress: a second signal waits for it
        self.forced = False  # a second signal came: exit once the save in progress is done
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
            return
        self.forced = True
        if not self.saving:
            raise KeyboardInterrupt  # the second signal: out at once (the CLI says "interrupted", exit 130)

    def __enter__(self) -> "Signals":
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    @contextlib.contextmanager
    def save(self) -> Iterator[None]:
        """Around a checkpoint save: a second signal during it takes effect when it is complete."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.forced:
            raise KeyboardInterrupt


@contextlib.contextmanager
def abandon_on_stop(module: torch.nn.Module, stop: Signals, d: Any) -> Iterator[None]:
    """While inside: every forward of ``module`` first asks (all ranks at once, ``d.any``) whether a
    stop signal came, and raises ``Abandoned`` if so."""

    def check(_module: torch.nn.Module, _args: Any) -> None:
        if d.any(stop.signum != 0):
            raise Abandoned

    handle = module.register_forward_pre_hook(check, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def failure_line(e: BaseException) -> str:
    """An evaluation's error as one line: a ``UserError``'s problems, else the type and first line."""
    if isinstance(e, UserError):
        return "; ".join(e.problems)
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def downstream_or_failure(run: Any, stop: Signals, save: Callable[[], None]) -> dict[str, Any] | None:
    """``ncpctl.train.downstream.evaluate(run)``: its record; a failure record (``error``) when it
    failed on some rank; None when a stop signal abandoned it. ``save()``: the checkpoint saved
    before an error that is not the user's (a bug) is raised."""
    step, error, rec = run.tot.step, None, None
    try:
        with abandon_on_stop(run.engine.module, stop, run.d):
            rec = downstream.evaluate(run)
    except Abandoned:
        run.info(f"in-loop evaluation (train.eval_tasks) at step {step} abandoned: a stop signal came; saving now")
        return None
    except Exception as e:  # noqa: BLE001 - lm-eval and a task's data can raise anything: sorted below
        error = e
    if not run.d.any(error is not None):
        return rec
    why = failure_line(error) if error is not None else "it failed on another rank (that rank's warning says why)"
    run.warn(f"in-loop evaluation (train.eval_tasks) at step {step} failed: {why}; training goes on")
    if run.d.any(error is not None and not isinstance(error, (UserError, OSError))):  # a bug: stop, but save first
        with stop.save():
            save()
        raise error or UserError(f"train.eval_tasks: the in-loop evaluation at step {step} failed on another rank "
                                 "(its error names the cause); the checkpoint of this step was saved")
    return {"split": downstream.SPLIT, "step": step, "error": why}

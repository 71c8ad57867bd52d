"""What a training run does around its steps, as callbacks the loop calls at named points.

The loop (``ncpctl.train.loop``) keeps the step and the schedule; what watches or extends a run is
a ``Callback`` in the list ``build`` makes from the recipe, in one place:

    Metrics      rank 0: every record into metrics.jsonl (+ TensorBoard, W&B: ``MetricsLog``)
    Display      rank 0: the live progress bar / plain lines (``ncpctl.train.display``)
    Downstream   ``train.eval_tasks`` on the live model (``ncpctl.train.downstream``), its failures
                 recorded and training going on (``ncpctl.train.stopping``)
    SaveEvery    ``train.save_every``: the periodic checkpoints' cadence
    Faults       the tests' fault injection (``ncpctl.train.faults``), only when ``$NCPCTL_FAULT`` is set

The points, in the order a run meets them (``run``: the prepared ``ncpctl.train.prepare.Run``):

    on_train_start(run)                  before the first step of this process
    on_step_begin(run, step)             as step ``step`` (1-based) begins, before its batch
    on_step_end(run, step)               after the optimizer step (``loop.Step``), before the
                                         non-finite check and the model's own step-end hook
    on_record(run, rec)                  a metrics record (``split``: train, val, stability, downstream)
    on_evaluate(run, stop, last, save)   after the step's validation, before its save: an evaluation
                                         of the live model; True when a stop signal abandoned it
    wants_save(run, last)                whether a periodic checkpoint is due after this step
    on_train_end(run)                    the loop is over, however it ended (reverse order)
    on_finish(run, plots)                after the plots of a run that ended normally

A callback overrides the points it needs; the others are the base class's no-ops, and
``Callbacks`` calls at each point only the callbacks that override it, so a point nobody listens
to costs one empty loop per step (the CPU step-time guard ``bench/versions.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ncpctl.train import downstream
from ncpctl.train.stopping import downstream_or_failure

POINTS = ("on_train_start", "on_step_begin", "on_step_end", "on_record", "on_evaluate", "wants_save",
          "on_train_end", "on_finish")


class Callback:
    """No-op at every point (the module doc); subclasses override what they need."""

    def on_train_start(self, run: Any) -> None:
        pass

    def on_step_begin(self, run: Any, step: int) -> None:
        pass

    def on_step_end(self, run: Any, step: Any) -> None:
        pass

    def on_record(self, run: Any, rec: dict[str, Any]) -> None:
        pass

    def on_evaluate(self, run: Any, stop: Any, last: bool, save: Callable[[], None]) -> bool:
        return False

    def wants_save(self, run: Any, last: bool) -> bool:
        return False

    def on_train_end(self, run: Any) -> None:
        pass

    def on_finish(self, run: Any, plots: list[Path]) -> None:
        pass


class Callbacks:
    """The run's callbacks in order; each point calls only those that override it."""

    def __init__(self, callbacks: list[Callback]):
        self.all = list(callbacks)
        self.at: dict[str, list[Callable[..., Any]]] = {
            p: [getattr(cb, p) for cb in self.all if getattr(type(cb), p) is not getattr(Callback, p)] for p in POINTS}

    @property
    def records(self) -> bool:
        """Whether some callback takes records (rank 0): the loop builds one only then."""
        return bool(self.at["on_record"])

    def train_start(self, run: Any) -> None:
        for f in self.at["on_train_start"]:
            f(run)

    def step_begin(self, run: Any, step: int) -> None:
        for f in self.at["on_step_begin"]:
            f(run, step)

    def step_end(self, run: Any, step: Any) -> None:
        for f in self.at["on_step_end"]:
            f(run, step)

    def record(self, run: Any, rec: dict[str, Any]) -> None:
        for f in self.at["on_record"]:
            f(run, rec)

    def evaluate(self, run: Any, stop: Any, last: bool, save: Callable[[], None]) -> bool:
        """Each evaluation in turn; the first one a stop signal abandoned ends the round (True)."""
        return any(f(run, stop, last, save) for f in self.at["on_evaluate"])

    def wants_save(self, run: Any, last: bool) -> bool:
        return any(f(run, last) for f in self.at["wants_save"])

    def train_end(self, run: Any) -> None:
        """In reverse order, as nested set-ups are taken down (the display stops before the files close)."""
        for f in reversed(self.at["on_train_end"]):
            f(run)

    def finish(self, run: Any, plots: list[Path]) -> None:
        for f in self.at["on_finish"]:
            f(run, plots)


class Metrics(Callback):
    """metrics.jsonl, TensorBoard and W&B (``ncpctl.train.metrics.MetricsLog`` with its tracker)."""

    def __init__(self, log: Any):
        self.log = log

    def on_record(self, run: Any, rec: dict[str, Any]) -> None:
        self.log.write(rec)

    def on_train_end(self, run: Any) -> None:
        self.log.close()

    def on_finish(self, run: Any, plots: list[Path]) -> None:
        self.log.finish(plots)  # W&B: the plots, then the run's end


class Display(Callback):
    """The live display (``ncpctl.train.display.TrainDisplay``): a line per logged step and per validation."""

    def __init__(self, display: Any):
        self.display = display

    def on_train_start(self, run: Any) -> None:
        self.display.start(run.recipe.train.max_steps, run.tot.step)

    def on_record(self, run: Any, rec: dict[str, Any]) -> None:
        if rec["split"] == "train":
            self.display.step(rec)
        elif rec["split"] == "val":
            self.display.validation(rec["step"], run.tot.val)

    def on_train_end(self, run: Any) -> None:
        self.display.stop()


class Downstream(Callback):
    """``train.eval_tasks`` on the live model, every rank, every ``train.eval_tasks_every`` steps and at
    the end; not step time. A failure is recorded and training goes on
    (``stopping.downstream_or_failure``); the checkpoint after it has the weights it scored."""

    def on_evaluate(self, run: Any, stop: Any, last: bool, save: Callable[[], None]) -> bool:
        if not downstream.due(run.recipe.train, run.tot.step, last):
            return False
        rec = downstream_or_failure(run, stop, save)
        if rec is None:
            return True
        if "error" not in rec:
            run.tot.downstream = rec
            run.info(downstream.line(rec))
        run.callbacks.record(run, rec)
        return False


class SaveEvery(Callback):
    """``train.save_every``: a checkpoint every N steps. Not at the last step (the loop's final save)
    and not inside a non-finite streak: if the weights themselves went bad, the checkpoint before
    the streak is the one to go back to."""

    def __init__(self, every: int):
        self.every = every

    def wants_save(self, run: Any, last: bool) -> bool:
        return run.tot.step % self.every == 0 and not last and run.tot.nonfinite_run == 0


def build(run: Any, metrics: Any, display: Any) -> Callbacks:
    """The run's callbacks from its recipe (``metrics`` / ``display``: rank 0's, else None); the
    order is the order of every point (records: written, then shown)."""
    t = run.recipe.train
    cbs: list[Callback] = []
    if metrics is not None:
        cbs.append(Metrics(metrics))
    if display is not None:
        cbs.append(Display(display))
    if t.eval_tasks:
        cbs.append(Downstream())
    if t.save_every:
        cbs.append(SaveEvery(t.save_every))
    if run.faults.active:
        cbs.append(run.faults)
    return Callbacks(cbs)

"""The loop's callbacks (``ncpctl.train.callbacks``, issue 44 item 5): a point calls only the
callbacks that override it (a run with nothing to watch does no work per step), records are
written before they are shown, and the set-up is taken down in reverse order."""

from __future__ import annotations

from types import SimpleNamespace

from ncpctl.train import callbacks as C
from ncpctl.train.faults import Faults


def _run(eval_tasks=(), save_every=0, faults="") -> SimpleNamespace:
    train = SimpleNamespace(eval_tasks=list(eval_tasks), save_every=save_every, max_steps=10)
    return SimpleNamespace(recipe=SimpleNamespace(train=train), faults=Faults(faults),
                           tot=SimpleNamespace(step=0, nonfinite_run=0, val={}))


def test_a_run_with_nothing_to_watch_calls_nothing() -> None:
    """Ranks other than 0 (no metrics, no display), no eval_tasks, no save_every, no faults."""
    cbs = C.build(_run(), None, None)
    assert cbs.all == [] and all(fs == [] for fs in cbs.at.values()) and not cbs.records
    assert set(cbs.at) == set(C.POINTS)


def test_each_point_calls_only_what_overrides_it() -> None:
    seen: list[tuple[str, object]] = []

    class Metrics:
        def write(self, rec): seen.append(("write", rec["split"]))
        def close(self): seen.append(("close", None))
        def finish(self, plots): seen.append(("finish", plots))

    class Display:
        def start(self, total, done): seen.append(("start", (total, done)))
        def step(self, rec): seen.append(("show", rec["step"]))
        def validation(self, step, val): seen.append(("val", step))
        def stop(self): seen.append(("stop", None))

    run = _run(save_every=3, faults="sleep@0,term@99")
    cbs = C.build(run, Metrics(), Display())
    assert [type(c).__name__ for c in cbs.all] == ["Metrics", "Display", "SaveEvery", "Faults"]
    assert [f.__self__ for f in cbs.at["on_step_begin"]] == [run.faults]  # term@: the faults alone
    assert cbs.at["on_evaluate"] == []  # no train.eval_tasks: no downstream evaluation
    run.callbacks = cbs
    cbs.train_start(run)
    cbs.record(run, {"split": "train", "step": 1})
    cbs.record(run, {"split": "val", "step": 1})
    cbs.record(run, {"split": "stability", "step": 1})
    cbs.train_end(run)
    cbs.finish(run, [])
    assert seen == [("start", (10, 0)), ("write", "train"), ("show", 1), ("write", "val"), ("val", 1),
                    ("write", "stability"), ("stop", None), ("close", None), ("finish", [])]
    # the checkpoint cadence: every 3rd step, not at the last, not inside a non-finite streak
    due = []
    for step, last, streak in [(3, False, 0), (4, False, 0), (6, True, 0), (9, False, 1)]:
        run.tot.step, run.tot.nonfinite_run = step, streak
        due.append(cbs.wants_save(run, last))
    assert due == [True, False, False, False]

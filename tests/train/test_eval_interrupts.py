"""In-loop evaluation that fails or is interrupted (issue 42 item 4; ``ncpctl.train.stopping``).

The tester's findings: a failing in-loop evaluation lost the checkpoint that was due (steps
trained, exit 2, no ``checkpoints/`` at all), and SIGTERM during an in-loop evaluation did not
save first (the evaluation ran to its end, then one more step, then the save); a second Ctrl-C
did not force an exit."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from .conftest import metrics, start, wait_for_step

TASKS = ["--set", "train.eval_every=0", "--set", "train.keep_last=8", "--json"]


def test_a_failing_in_loop_evaluation_is_recorded_and_training_goes_on(make_recipe, tiny_data: Path,
                                                                     tmp_path: Path) -> None:
    """The data the tasks are built from disappears mid-run (here: the tokenizer, as a re-tokenize
    in place would): every evaluation from then on is a failure record naming the file, a warning,
    and training goes on; every checkpoint that was due is there."""
    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    recipe = make_recipe("fails")
    recipe.write_text(recipe.read_text().replace(str(tiny_data), str(data)))
    run = tmp_path / "fails"
    proc = start("pretrain", str(recipe), *TASKS, "--set", "train.max_steps=6", "--set", "train.save_every=3",
                 "--set", "train.eval_tasks=[ncp_cloze]", "--set", "eval.limit=2", "--set", "train.eval_tasks_every=3",
                 "--set", "train.plots=true", env={"NCPCTL_FAULT": "sleep@0.3"})
    wait_for_step(run, 1, proc)
    (data / "tokenizer.json").unlink()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    down = metrics(run, "downstream")
    assert [r["step"] for r in down] == [3, 6] and all("tokenizer.json" in r["error"] for r in down), down
    assert "in-loop evaluation (train.eval_tasks) at step 3 failed:" in " ".join(err.split())
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000003", "step_0000006"]
    summary = json.loads(out.splitlines()[-1])
    assert summary["step"] == 6 and summary["downstream"] is None  # no scores to report
    assert "downstream.png" not in summary["plots"] and "loss_curves.png" in summary["plots"]  # no plot of nothing


def test_a_stop_signal_during_the_in_loop_evaluation_abandons_it_and_saves_at_once(make_recipe, tmp_path: Path) -> None:
    """SIGTERM as the step-2 evaluation starts: it is abandoned at its next forward, the step-2
    checkpoint is saved at once, and the run exits cleanly (not: the evaluation to its end, a third
    step, then the save)."""
    run = tmp_path / "term"
    proc = start("pretrain", str(make_recipe("term")), *TASKS, "--set", "train.max_steps=8", "--set",
                 "train.save_every=0", "--set", "train.eval_tasks=[ncp_heldout_ppl, ncp_cloze]", "--set",
                 "eval.limit=100", "--set", "train.eval_tasks_every=2")
    wait_for_step(run, 2, proc)  # the step's record is written just before the evaluation begins
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.splitlines()[-1])
    assert summary["interrupted"] and summary["step"] == 2
    assert "at step 2 abandoned: a stop signal came; saving now" in " ".join(err.split())
    assert [r["step"] for r in metrics(run)] == [1, 2] and metrics(run, "downstream") == []
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000002"


def test_a_second_signal_forces_the_exit_after_the_save_in_progress() -> None:
    """``Signals``: the first signal only asks to stop; a second one during a checkpoint save lets
    it finish, then exits (KeyboardInterrupt: the CLI's "interrupted", exit 130); outside a save it
    exits at once."""
    from ncpctl.train.stopping import Signals

    saved, before = [], signal.getsignal(signal.SIGTERM)
    with Signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and not stop.forced  # the loop goes on to save
        with pytest.raises(KeyboardInterrupt):
            with stop.save():
                os.kill(os.getpid(), signal.SIGINT)  # the second, in the middle of the save
                saved.append("the rest of the save")
        assert saved == ["the rest of the save"] and stop.forced
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # and one outside a save: at once
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back

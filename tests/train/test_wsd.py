"""Issue 24 item 3: the WSD schedule (warmup, stable, decay of a named shape) and decay branches
(``train.decay_from``: the decay phase from a stable-phase checkpoint equals the straight run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe
from ncpctl.train.optimizer import lr_schedule

from ..conftest import RECIPES
from .conftest import metrics, ncpctl, result, weights

WSD = ["train.schedule=wsd", "train.max_steps=100", "train.warmup_steps=10", "train.decay_steps=20",
       "train.lr=1.0", "train.min_lr=0.1"]


@pytest.mark.parametrize("shape, half", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_follows_its_formula_at_the_key_steps(shape: str, half: float) -> None:
    r = load_recipe(RECIPES / "debug.yaml", [*WSD, f"train.decay_shape={shape}"])
    f = lr_schedule(r)
    assert f(0) == 0.1 and f(9) == 1.0  # linear warmup, its end
    assert f(10) == f(50) == f(80) == 1.0  # stable, up to the decay's start at 100 - 20
    assert f(90) == pytest.approx(0.1 + 0.9 * half, abs=1e-12)  # half-way through the decay
    assert f(100) == pytest.approx(0.1, abs=1e-15)  # min_lr at max_steps
    assert all(f(s) > f(s + 1) for s in range(80, 100))  # the decay decreases at every step


def test_wsd_keys_are_checked() -> None:
    debug = RECIPES / "debug.yaml"
    assert load_recipe(debug, ["train.decay_shape=sqrt"]).train.schedule == "cosine"  # the default
    assert load_recipe(debug, ["train.schedule=wsd", "train.max_steps=50"]).decay_steps == 5  # decay_fraction 0.1
    with pytest.raises(UserError) as e:
        load_recipe(debug, ["train.decay_from=x"])
    assert e.value.problems == ["--set: train.decay_from: applies to train.schedule: wsd (this recipe's schedule is "
                                "cosine)"]
    with pytest.raises(UserError) as e:
        load_recipe(debug, [*WSD, "train.decay_steps=95"])
    assert "train.decay_steps: warmup 10 + decay 95 steps exceed train.max_steps=100" in e.value.problems[0]


def test_a_decay_branch_equals_the_straight_run(make_recipe) -> None:
    """A WSD run of 8 steps decaying from step 5, vs a stable run (decay only at 6) saved at step 5 and a
    decay branch of 3 steps from that checkpoint: the same lr, losses and final weights, bit for bit."""
    quiet = ["train.schedule=wsd", "train.eval_every=0", "train.decay_shape=cosine"]

    def sets(*more: str) -> list[str]:
        return [f"--set={x}" for x in (*quiet, *more)]

    straight = make_recipe("straight")
    assert result(ncpctl("pretrain", str(straight), *sets("train.max_steps=8", "train.decay_steps=3",
                                                          "train.save_every=0"), "--json"))["step"] == 8
    stable = make_recipe("stable")  # validated at step 5: the stable-phase loss of a branch from there
    ncpctl("pretrain", str(stable), *sets("train.max_steps=6", "train.decay_steps=1", "train.save_every=5",
                                          "train.eval_every=5"))
    start = stable.parent / "stable" / "checkpoints" / "step_0000005"
    branch = make_recipe("branch")  # its recipe says max_steps 12: the branch replaces it by 5 + 3
    s = result(ncpctl("pretrain", str(branch), *sets(f"train.decay_from={start}", "train.decay_steps=3"), "--json"))
    assert (s["step"], s["steps_run"], s["resumed_from"]) == (8, 3, str(start))

    a, b = metrics(straight.parent / "straight"), metrics(branch.parent / "branch")
    assert [r["step"] for r in b] == [6, 7, 8]
    assert [(r["step"], r["lr"], r["loss"]) for r in a[5:]] == [(r["step"], r["lr"], r["loss"]) for r in b]
    assert b[-1]["lr"] < a[4]["lr"] == 3.0e-3  # the branch decayed from the stable lr
    wa = weights(straight.parent / "straight" / "checkpoints" / "step_0000008")
    wb = weights(branch.parent / "branch" / "checkpoints" / "step_0000008")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # the stable run's last checkpoint (step 6) is past its stable phase (its decay starts at 5)
    late = stable.parent / "stable" / "checkpoints" / "step_0000006"
    with pytest.raises(UserError) as e:  # a new branch (the one above has checkpoints: its start is recorded)
        load_recipe(make_recipe("late"), ["train.schedule=wsd", f"train.decay_from={late}", "train.decay_steps=3"])
    assert e.value.problems == [f"--set: train.decay_from: {late}: step 6 is past its run's stable phase (the decay "
                                "starts at step 5); branch from a checkpoint at or before it"]
    with pytest.raises(UserError) as e:  # a branch writes a run directory of its own
        load_recipe(stable, ["train.schedule=wsd", f"train.decay_from={start}", "train.decay_steps=3"])
    assert e.value.problems == [f"--set: train.decay_from: {start} is a checkpoint of this recipe's run.dir; a decay "
                                "branch writes a run directory of its own (set run.dir or run.name)"]
    other = ncpctl("pretrain", str(make_recipe("other")), *sets(f"train.decay_from={start}", "train.decay_steps=3",
                                                                 "model.rope_base=500.0"))
    assert other.returncode == 2
    assert [x for x in other.stderr.splitlines() if x.startswith("error")] == [
        f"error: {start}: model.rope_base: 10000.0 in the checkpoint, 500.0 now"]

    _branch_from_a_run_directory(make_recipe, stable.parent / "stable", sets, a)

    # the branch's recipe.resolved.yaml (what `ncpctl fit` and a resume load) still loads once the
    # stable run's checkpoint is gone: the branch's own checkpoints recorded where it started
    import shutil

    shutil.rmtree(start)
    again = load_recipe(branch.parent / "branch" / "recipe.resolved.yaml")
    assert (again.train.max_steps, again.decay_steps, again.warmup_steps) == (8, 3, 2)


def _branch_from_a_run_directory(make_recipe, stable: Path, sets, straight: list[dict]) -> None:
    """Issue 40 items 1 and 7a: a branch whose train.decay_from names the stable run's directory starts
    from its newest checkpoint (step 5) and records it; when the stable run has gone on (its newest is
    step 6), the branch (a resume, ``fit``) still runs from step 5 to 8, not from the newest checkpoint
    with its lr back at the stable rate; a spec naming another start is one line; the stable run's
    validation at step 5 is the branch's stable-phase loss, a column of its point."""
    from ncpctl.study.points import read_run

    ckpts = stable / "checkpoints"
    (ckpts / "latest").write_text("step_0000005")  # the stable run as it stood when the branch started
    branch = make_recipe("dirbranch")
    s = result(ncpctl("pretrain", str(branch), *sets(f"train.decay_from={stable}", "train.decay_steps=3"), "--json"))
    assert (s["step"], s["resumed_from"]) == (8, str(ckpts / "step_0000005"))
    assert [(r["lr"], r["loss"]) for r in metrics(branch.parent / "dirbranch")] == [(r["lr"], r["loss"]) for r in straight[5:]]
    (ckpts / "latest").write_text("step_0000006")  # the stable run went on
    again = load_recipe(branch.parent / "dirbranch" / "recipe.resolved.yaml")
    assert (again.train.max_steps, again.decay_start["path"], again.decay_start["step"]) == (
        8, str(ckpts / "step_0000005"), 5)
    stable_val = next(r for r in metrics(stable, "val") if r["step"] == 5)
    assert again.decay_start["val"]["loss"] == stable_val["loss"]
    assert read_run(branch.parent / "dirbranch").column("stable_loss") == stable_val["loss"]
    with pytest.raises(UserError) as e:
        load_recipe(branch, ["train.schedule=wsd", f"train.decay_from={ckpts / 'step_0000006'}", "train.decay_steps=3"])
    assert len(e.value.problems) == 1 and "does not name this branch's start" in e.value.problems[0]
    assert str(ckpts / "step_0000005") in e.value.problems[0]


def test_resuming_under_another_schedule_names_it() -> None:
    """``schedule_change`` (a resume that reshapes the lr) also compares the schedule and the WSD decay."""
    from ncpctl.train.optimizer import schedule_change

    r = load_recipe(RECIPES / "debug.yaml", WSD)
    cosine = {"max_steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr": 0.1}
    line = schedule_change(cosine, r, 50)
    assert line is not None and line.startswith("the learning-rate schedule differs from the checkpoint's (schedule "
                                                "cosine -> wsd, decay - -> 20, decay_shape - -> sqrt): from step 50")
    same = {**cosine, "schedule": "wsd", "decay_steps": 20, "decay_shape": "sqrt"}
    assert schedule_change(same, r, 50) is None
    assert "(decay 30 -> 20)" in schedule_change({**same, "decay_steps": 30}, r, 50)

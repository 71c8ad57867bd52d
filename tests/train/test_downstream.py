"""Downstream evaluation in the training loop (``train.eval_tasks``; ncpctl.train.downstream, issue 26
item 3): the live model's scores at step N are those of ``ncpctl eval`` of the step-N checkpoint, the
run trains exactly as without it (ZeRO-3 included: every rank runs the forwards), its time stays out
of step_time, and an unknown task name stops the run before training."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ncpctl.train.engine import Dist

from .conftest import metrics, ncpctl, result

TASKS = ["--set", "train.eval_tasks=[ncp_cloze, ncp_heldout_ppl]", "--set", "eval.limit=4"]
SETS = ["--set", "train.save_every=6"]
ZERO3 = ["--set", "deepspeed.zero_stage=3"]


def _scores(rec: dict) -> dict[str, float]:
    return {k.removeprefix("eval/"): v for k, v in rec.items() if k.startswith("eval/")}


def test_in_loop_scores_equal_eval_of_the_checkpoint_and_training_is_unchanged(make_recipe, tmp_path: Path) -> None:
    with_eval, without = make_recipe("with"), make_recipe("without")
    a = result(ncpctl("pretrain", str(with_eval), "--json", *SETS, *TASKS, "--set", "train.eval_tasks_every=6",
                      "--set", "train.plots=true"))
    result(ncpctl("pretrain", str(without), "--json", *SETS))
    run_a, run_b = tmp_path / "with", tmp_path / "without"
    down = metrics(run_a, "downstream")
    assert [r["step"] for r in down] == [6, 12]  # every 6 steps, and the end
    # training is bit-identical to the run without in-loop evaluation (one thread)
    for split in ("train", "val"):
        strip = lambda rs: [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_s", "mfu")}  # noqa: E731
                            for r in rs]
        assert strip(metrics(run_a, split)) == strip(metrics(run_b, split))
    # the evaluation's seconds are not in any step's time
    assert max(r["step_time"] for r in metrics(run_a)) < min(r["seconds"] for r in down)
    assert (run_a / "downstream.png").is_file() and "downstream.png" in a["plots"]
    # ncpctl eval of the step-6 checkpoint: the same numbers (same tasks, limit, batch size)
    ev = result(ncpctl("eval", str(run_a / "checkpoints" / "step_0000006"), "--tasks", "ncp_cloze,ncp_heldout_ppl",
                       "--json"))
    assert ev["limit"] == 4
    want = {f"{task}/{k}": v for task, row in ev["results"].items() for k, v in row.items() if not k.endswith("_stderr")}
    assert _scores(down[0]) == pytest.approx(want, rel=1e-12)
    assert set(_scores(down[0])) == set(want)


def test_zero3_on_one_rank_evaluates_in_the_loop(make_recipe, tmp_path: Path) -> None:
    s = result(ncpctl("pretrain", str(make_recipe("z3")), "--json", *ZERO3, "--set", "train.max_steps=2",
                      "--set", "train.eval_tasks=[ncp_cloze]", "--set", "eval.limit=2", "--set", "train.eval_tasks_every=1"))
    assert [r["step"] for r in metrics(tmp_path / "z3", "downstream")] == [1, 2]
    assert s["downstream"]["step"] == 2 and "eval/ncp_cloze/acc" in s["downstream"]  # the --json summary's


def test_the_evaluation_puts_back_the_rng_state_and_train_mode(make_recipe) -> None:
    """lm-eval reseeds Python, numpy and torch: the in-loop evaluation restores all three."""
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe
    from ncpctl.train import downstream
    from ncpctl.train.engine import Dist

    r = load_recipe(make_recipe("rng"), ["train.eval_tasks=[ncp_cloze]", "eval.limit=2"])
    model = NCPModel(r.model_config).train()
    run = SimpleNamespace(recipe=r, d=Dist(0, 1, 0, torch.device("cpu")), engine=SimpleNamespace(module=model, train=model.train),
                          tot=SimpleNamespace(step=3), info=lambda m: None)
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    rec = downstream.evaluate(run)
    assert "eval/ncp_cloze/acc" in rec and rec["step"] == 3
    assert model.training
    assert torch.equal(torch.get_rng_state(), before[0]) and np.array_equal(np.random.get_state()[1], before[1])
    assert random.getstate() == before[2]


def test_an_unknown_eval_task_is_one_line_at_recipe_validation(make_recipe) -> None:
    """Refused by load_recipe (what every stage runs before it starts training): one line naming the key."""
    from ncpctl.errors import UserError
    from ncpctl.recipe import load_recipe

    with pytest.raises(UserError) as e:
        load_recipe(make_recipe("bad"), ["train.eval_tasks=[ncp_cloze, no_such_task_xyz]"])
    assert len(e.value.problems) == 1
    assert "train.eval_tasks: task no_such_task_xyz: unknown to lm-eval" in e.value.problems[0]


@pytest.mark.slow
def test_zero3_on_two_ranks_evaluates_in_the_loop_without_deadlock(make_recipe, tmp_path: Path) -> None:
    """Every rank scores the same requests (ZeRO-3 gathers each layer on both); rank 0 logs what one
    rank logs alone at the same step."""
    short = ["--set", "train.max_steps=2", "--set", "train.save_every=0", *ZERO3, "--set", "train.eval_tasks=[ncp_cloze]",
             "--set", "eval.limit=2", "--set", "train.eval_tasks_every=0"]  # one evaluation, at the end: cheap
    result(ncpctl("pretrain", str(make_recipe("two")), "--json", *short, launcher_ranks=2, timeout=600))
    down = metrics(tmp_path / "two", "downstream")
    assert [r["step"] for r in down] == [2]
    result(ncpctl("pretrain", str(make_recipe("one")), "--json", *short))
    one = metrics(tmp_path / "one", "downstream")
    assert _scores(down[0]) and _scores(down[0]) == pytest.approx(_scores(one[0]), rel=1e-6)  # summed in another order


class _Ranks(Dist):
    """A Dist stand-in for rank ``rank`` of 2: records the collectives it joins (every rank must
    join the same ones, or the others wait in theirs)."""

    def __init__(self, rank: int) -> None:  # no device or process group: the fields the code reads
        self.rank, self.world, self.calls = rank, 2, []

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.calls.append("sum")
        return t.double()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_task_that_fails_to_load_on_one_rank_is_seen_by_every_rank(rank, monkeypatch, tmp_path) -> None:
    """Any failure while loading the tasks (not only a UserError), on rank 0 or on another rank,
    goes through the same collectives on every rank before it is raised: no rank is left waiting."""
    from ncpctl.evaluate import run as evaluate_run
    from ncpctl.train import downstream

    def broken(*_a, **_k):
        raise RuntimeError("lm-eval could not build the task")

    monkeypatch.setattr(evaluate_run, "load_tasks", broken)
    downstream._TASK_MANAGERS.clear()
    recipe = SimpleNamespace(train=SimpleNamespace(eval_tasks=["ncp_cloze"]), data_dir=tmp_path,
                             data=SimpleNamespace(val_prefix=None))
    d = _Ranks(rank)
    with pytest.raises(RuntimeError):
        downstream._load(SimpleNamespace(d=d, recipe=recipe, info=lambda m: None))
    # rank 0 fails: every rank stops at the first all-reduce (rank 0's outcome); another rank fails:
    # rank 0 loaded, and every rank stops at the second (every rank's outcome)
    assert d.calls == (["sum"] if rank == 0 else ["sum", "sum"])

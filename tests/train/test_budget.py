"""Issue 24 item 2: ``train.max_tokens`` / ``train.max_flops`` as alternatives to ``max_steps``.

The loader resolves max_steps = floor(budget / one optimizer step's tokens or exact training FLOPs);
a run stops within one step of the budget and reports FLOPs = steps x the accounting, exactly."""

from __future__ import annotations

import json

import pytest

from ncpctl.errors import UserError
from ncpctl.model.accounting.flops import exact_flops
from ncpctl.recipe import load_recipe

from ..conftest import RECIPES
from .conftest import ncpctl, result

BUDGET = ["train.max_steps=null"]


def debug(*sets: str):
    return load_recipe(RECIPES / "debug.yaml", list(sets))


def step_flops(r) -> int:
    return exact_flops(r.model_config, r.seq_len, r.global_batch_size).training_per_step()


def test_max_tokens_resolves_to_whole_steps_and_the_warmup_fraction_follows() -> None:
    per = debug().global_batch_size * debug().seq_len  # 8 x 256
    r = debug(*BUDGET, f"train.max_tokens={40 * per + per - 1}", "train.warmup_fraction=0.1")
    assert (r.budget.kind, r.budget.per_step, r.train.max_steps) == ("tokens", per, 40)
    assert r.warmup_steps == 4  # 10% of the resolved 40 steps
    # the resolved recipe keeps the budget (max_steps null) and loads back to the same run length
    tree = r.to_dict()["train"]
    assert tree["max_steps"] is None and tree["max_tokens"] == 41 * per - 1


def test_max_flops_resolves_from_the_exact_accounting(tmp_path) -> None:
    per = step_flops(debug())
    r = debug(*BUDGET, f"train.max_flops={7.5 * per}")
    assert (r.budget.kind, r.budget.per_step, r.train.max_steps) == ("flops", per, 7)
    exact = debug(*BUDGET, f"train.max_flops={float(3 * per)}")  # a budget of exactly 3 steps: 3, not 2
    assert exact.train.max_steps == 3
    resolved = exact.write_resolved(tmp_path)
    again = load_recipe(resolved)
    assert (again.budget.kind, again.train.max_steps) == ("flops", 3)


def test_a_stage_that_freezes_weights_resolves_at_its_own_step_cost() -> None:
    """adapt-vq / LoRA train at less than the full accounting the loader planned with: the loop
    re-resolves max_steps (and the warmup) from the stage's cost before the schedule is built."""
    per = step_flops(debug())
    r = debug(*BUDGET, f"train.max_flops={10 * per}", "train.warmup_fraction=0.1")
    assert (r.train.max_steps, r.warmup_steps) == (10, 1)
    r.set_step_cost(per // 3)
    assert (r.train.max_steps, r.warmup_steps, r.budget.per_step) == (30, 3, per // 3)
    assert r.budget.record(30, 0, per // 3)["flops"] == 30 * (per // 3) <= 10 * per


def test_two_length_keys_are_refused_by_name() -> None:
    with pytest.raises(UserError) as e:
        debug("train.max_tokens=100000")  # debug.yaml sets max_steps
    (line,) = e.value.problems
    assert "train.max_tokens: set together with train.max_steps" in line
    with pytest.raises(UserError) as e:
        debug(*BUDGET, "train.max_tokens=100000", "train.max_flops=1e15")
    assert "train.max_flops: set together with train.max_tokens" in e.value.problems[0]


@pytest.mark.parametrize("key, value, size", [("max_tokens", "2047", "2,048 tokens"),
                                               ("max_flops", "1e9", "7,617,642,496 training FLOPs")])
def test_a_budget_below_one_step_names_the_key_and_the_step(key: str, value: str, size: str) -> None:
    with pytest.raises(UserError) as e:
        debug(*BUDGET, f"train.{key}={value}")
    (line,) = e.value.problems
    assert f"train.{key}: {float(value):g} is smaller than one optimizer step ({size}" in line


def test_a_budget_on_a_model_that_does_not_build_reports_the_model() -> None:
    """With no model config there is no step cost: the model's own problem is the error (it was a
    TypeError from the warmup check, max_steps left None), and nothing is said of the budget."""
    with pytest.raises(UserError) as e:
        debug(*BUDGET, "train.max_flops=1e12", "model.d_model=24", "model.n_heads=2")  # head size 12
    assert any("rotary" in p for p in e.value.problems) and not any("max_flops" in p for p in e.value.problems)


def test_cli_refuses_a_budget_below_one_step_in_one_line(make_recipe) -> None:
    proc = ncpctl("pretrain", str(make_recipe("small")), *(f"--set={s}" for s in BUDGET), "--set=train.max_tokens=255")
    assert proc.returncode == 2
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error")]
    assert errors == [f"error: --set: train.max_tokens: 255 is smaller than one optimizer step "
                      f"(256 tokens = global_batch_size 8 x seq_len 32)"]


def test_max_flops_run_stops_within_one_step_and_reports_the_accounting(make_recipe) -> None:
    path = make_recipe("flops")
    sets = [*BUDGET, "train.eval_every=0", "train.save_every=0"]
    per = step_flops(load_recipe(path, sets))
    budget = 4.7 * per
    s = result(ncpctl("pretrain", str(path), *(f"--set={x}" for x in [*sets, f"train.max_flops={budget}"]), "--json"))
    b = s["budget"]
    assert s["step"] == s["max_steps"] == b["max_steps"] == 4
    assert b["flops"] == 4 * per and b["flops"] <= budget < b["flops"] + per  # exact, within one step
    assert (b["kind"], b["value"], b["tokens"]) == ("flops", budget, 4 * 8 * 32)
    meta = json.loads((path.parent / "flops" / "checkpoints" / "step_0000004" / "ncpctl.json").read_text())
    assert meta["budget"] == b


def test_dlcm_reports_the_flops_of_its_realised_concepts(make_recipe) -> None:
    """A learned segmentation is planned at its target R; the summary adds the FLOPs at the mean tokens
    per concept of its training records (what ``ncpctl fit`` counts), beside the planned ones."""
    from .conftest import metrics

    path = make_recipe("dlcm")
    sets = [*BUDGET, "model.concept.segmentation=dynamic", "model.concept.coupling=cross_attention",
            "train.eval_every=0", "train.save_every=0"]
    r = load_recipe(path, sets)
    per = step_flops(r)
    s = result(ncpctl("pretrain", str(path), *(f"--set={x}" for x in [*sets, f"train.max_flops={3 * per}"]), "--json"))
    b = s["budget"]
    assert (b["max_steps"], b["flops"]) == (3, 3 * per)  # planned at the target R
    seen = [m["tokens_per_concept"] for m in metrics(path.parent / "dlcm")]
    assert b["tokens_per_concept"] == sum(seen) / 3 != r.model_config.concept.target_ratio
    at = exact_flops(r.model_config, r.seq_len, r.global_batch_size, realised_ratio=b["tokens_per_concept"])
    assert b["flops_realised"] == 3 * at.training_per_step() != b["flops"]

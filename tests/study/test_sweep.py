"""`ncpctl sweep`: the shipped sweep files dry-run with every point's exact FLOPs and tokens (their
data paths are placeholders), the points are those of the shipped per-point recipes, and bad sweep
files get one line and exit 2 before anything is written. (Running and resuming:
tests/train/test_sweep_run.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.model.accounting.flops import exact_flops
from ncpctl.profile.load import load_for_profile

from ..conftest import RECIPES, run_cli


def _dry(path: Path) -> dict:
    r = run_cli("sweep", str(path), "--dry", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def _flops(recipe: Path) -> tuple[float, int]:
    r, _ = load_for_profile(str(recipe))
    return exact_flops(r.model_config, r.seq_len, r.global_batch_size).training_per_step(), r.train.max_steps


def test_dlcm_grid_dry_run_lists_the_shipped_grid(tmp_path: Path) -> None:
    res = _dry(RECIPES / "sweeps" / "dlcm-grid.yaml")
    points = {p["name"]: p for p in res["points"]}
    assert len(points) == 27 and res["dry"] and not (tmp_path / "runs").exists()
    for name, p in points.items():  # 274m-p30+target_ratio=2 <-> recipes/dlcm/scaling-274m-p30-r2.yaml
        shape, ratio = name.split("+target_ratio=")
        flops, steps = _flops(RECIPES / "dlcm" / f"scaling-{shape}-r{ratio}.yaml")
        assert (p["flops_per_step"], p["max_steps"]) == (flops, steps) and flops > 0
        assert p["flops"] == flops * steps and p["tokens"] == steps * 512 * 8192
    assert res["totals"]["tokens"] == 27 * 47684 * 512 * 8192


def test_archpreview_ladder_dry_run_spends_each_budget() -> None:
    res = _dry(RECIPES / "sweeps" / "archpreview-ladder.yaml")
    points = {p["name"]: p for p in res["points"]}
    assert len(points) == 15 and {n.split("-")[0] for n in points} == {"1e19", "3e19", "5e19", "8e19", "1e20"}
    for name, p in points.items():
        assert p["flops"] > 0 and p["tokens"] == p["max_steps"] * 128 * 8192
        r, _ = load_for_profile(str(RECIPES / "sweeps" / "archpreview-ladder.yaml").replace(
            "sweeps/archpreview-ladder.yaml", "ncp-archpreview-8.9b.yaml"),
            [f"{k}={json.dumps(v)}" for k, v in p["params"].items()])
        e = exact_flops(r.model_config, r.seq_len)  # the report's C = F_tok x D (causal, no LM head)
        f_tok = e.training_per_token_causal - 3 * e.components["lm_head"] / r.seq_len
        assert p["tokens"] * f_tok == pytest.approx(float(name.split("-")[0]), rel=2e-4)
    # each budget's best point (Table 12) is the shipped table12 recipe
    for best in ("1e19-e4c4d4", "3e19-e8c4d8", "5e19-e8c8d8", "8e19-e8c4d8", "1e20-e8c8d8"):
        flops, steps = _flops(RECIPES / "archpreview" / f"table12-{best.split('-')[0]}.yaml")
        assert (points[best]["flops_per_step"], points[best]["max_steps"]) == (flops, steps)


def test_dlcm_mup_transfer_dry_run_is_three_widths_by_five_rates() -> None:
    """DLCM Fig. 3: the grid's P = 50% shapes (the FLOPs of recipes/dlcm/scaling-*-p50-r4.yaml) x the
    paper's coordinate-descent multipliers of the three base rates, moved together with min_lr."""
    res = _dry(RECIPES / "sweeps" / "dlcm-mup-transfer.yaml")
    points = {p["name"]: p for p in res["points"]}
    mults = ["0.5", "0.75", "1", "1.5", "2"]
    assert sorted(points) == sorted(f"{s}+lr-x{m}" for s in ("274m", "468m", "833m") for m in mults)
    for name, p in points.items():
        size, mult = name.split("+lr-x")
        flops, _ = _flops(RECIPES / "dlcm" / f"scaling-{size}-p50-r4.yaml")
        t = {k.removeprefix("train."): v for k, v in p["params"].items() if k.startswith("train.")}
        assert p["flops_per_step"] == flops and p["max_steps"] == 4768
        assert t["lr"] == t["mup_lr_token"] == t["mup_lr_concept"] == pytest.approx(3e-4 * float(mult))
        assert t["min_lr"] == pytest.approx(t["lr"] / 10)


def test_debug_mup_transfer_dry_run_is_three_widths_by_three_rates() -> None:
    res = _dry(RECIPES / "sweeps" / "debug-mup-transfer.yaml")
    params = {p["name"]: p["params"] for p in res["points"]}
    assert len(params) == 12 and {p["max_steps"] for p in res["points"]} == {60}
    assert {(v["model.d_model"], v["model.concept.d_concept"], v["train.lr"]) for v in params.values()} == {
        (d, 2 * d, lr) for d in (32, 64, 128) for lr in (1e-3, 3e-3, 9e-3, 2.7e-2)}
    assert params["d128+lr9e-3"]["train.min_lr"] == 9e-4


def test_the_tiny_scaling_study_spends_each_budget_within_a_step() -> None:
    """recipes/scaling/: the base and ConceptLM families at the same 5 shapes x 3 budgets, each point
    stopping within one step of its train.max_flops; its data recipes name installed packages."""
    from ncpctl.recipe.load import load_recipe

    for fam in ("base", "conceptlm"):
        res = _dry(RECIPES / "scaling" / f"sweep-{fam}.yaml")
        assert len(res["points"]) == 15
        budgets = {p["params"]["train.max_flops"] for p in res["points"]}
        assert budgets == {1e12, 2e12, 4e12}
        for p in res["points"]:
            budget = p["params"]["train.max_flops"]
            assert budget - p["flops_per_step"] < p["flops"] <= budget and p["tokens"] == p["max_steps"] * 8 * 256
    data = load_recipe(RECIPES / "scaling" / "data.yaml", need_sources=True)
    assert data.run_dir == Path("runs/scaling") and data.tokenizer.vocab_size == 2048


BASE = "model: {size: debug}\ntokenizer: {vocab_size: 512}\ndata: {sources: [builtin:python-stdlib]}\n"


@pytest.mark.parametrize("sweep,args,message", [
    ("base: base.yaml\naxes: {model.d_modle: [64, 128]}\n", [],
     "sweep.yaml: axis model.d_modle: unknown key (did you mean 'd_model'?)"),
    ("base: missing.yaml\naxes: {train.lr: [0.1]}\n", [], "sweep.yaml: base: missing.yaml: recipe not found"),
    ("base: base.yaml\naxes: {}\n", [], "sweep.yaml: axes: must be a non-empty mapping"),
    ("base: base.yaml\n", [], "sweep.yaml: no points: give axes, zip or points"),
    ("base: base.yaml\nzip: {train.lr: [0.1, 0.2], train.max_steps: [10]}\n", [],
     "sweep.yaml: zip: the lists differ in length (train.lr 2, train.max_steps 1)"),
    ("base: base.yaml\nzip: [{train.lr: [0.1, 0.2]}, {model.d_model: [64, 128], model.n_heads: [4]}]\n", [],
     "sweep.yaml: zip[1]: the lists differ in length (model.d_model 2, model.n_heads 1)"),
    ("base: base.yaml\naxes: {train.lr: [0.1]}\n", ["--executor", "kubernetes"],
     "--executor kubernetes: unknown executor; choose from local, slurm"),
    ("base: base.yaml\naxes: {train.max_steps: [10, 0]}\n", [],
     "sweep.yaml: point max_steps=0: train.max_steps: Input should be greater than 0, got 0"),
    ("base: base.yaml\naxes: {train.lr: [0.1, 0.2]}\nfixed: {train.max_stepz: 10}\n", [],
     "sweep.yaml: fixed train.max_stepz: unknown key (did you mean 'max_steps'?)"),
])
def test_bad_sweep_is_one_line_and_exit_2(tmp_path: Path, sweep: str, args: list[str], message: str) -> None:
    (tmp_path / "base.yaml").write_text(BASE + f"run: {{dir: {tmp_path / 'run'}}}\n")
    (tmp_path / "sweep.yaml").write_text(sweep + f"out: {tmp_path / 'out'}\n")
    r = run_cli("sweep", "sweep.yaml", *args, cwd=tmp_path)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_slurm_section_becomes_submitit_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slurm:` keys are submitit's Slurm parameters (a job array of at most --parallel tasks); a
    key Slurm does not know is refused in one line. (No cluster here: sbatch and srun are stubs.)"""
    from ncpctl.errors import UserError
    from ncpctl.study.sweep import read_sweep
    from ncpctl.study.sweep_run import make_executor

    for tool in ("sbatch", "srun"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "s.yaml").write_text("base: base.yaml\nranks: 2\naxes: {train.lr: [0.1, 0.2]}\n"
                                     "slurm: {partition: gpu, time: 60, nodes: 1}\n")
    sweep, _ = read_sweep(tmp_path / "s.yaml", out=str(tmp_path / "out"))
    monkeypatch.setenv("PATH", "/bin:/usr/bin")
    with pytest.raises(UserError, match="sbatch and srun not found on PATH"):
        make_executor("slurm", sweep, 4)
    monkeypatch.setenv("PATH", f"{tmp_path}:/bin:/usr/bin")
    params = make_executor("slurm", sweep, 4)._executor.parameters
    assert {k: params[k] for k in ("partition", "time", "nodes", "gpus_per_node", "ntasks_per_node",
                                   "array_parallelism")} == {"partition": "gpu", "time": 60, "nodes": 1,
                                                             "gpus_per_node": 2, "ntasks_per_node": 1,
                                                             "array_parallelism": 4}
    sweep.slurm["partitoin"] = "gpu"
    with pytest.raises(UserError, match="slurm: Unknown argument 'partitoin'") as e:
        make_executor("slurm", sweep, 4)
    assert len(e.value.problems) == 1


def test_a_point_is_its_pretrain_and_ranks_use_the_launcher(tmp_path: Path) -> None:
    """A point's job runs `ncpctl pretrain POINT.yaml`; with `ranks: N` under `deepspeed --num_gpus N`
    on a port of its own (two points on one machine must not share the rendezvous)."""
    from ncpctl.study.sweep_run import point_command

    recipe = tmp_path / "points" / "a.yaml"
    assert point_command(recipe, 1)[-3:] == ["pretrain", str(recipe), "--json"]
    cmd = point_command(recipe, 2)
    assert Path(cmd[0]).name == "deepspeed" and cmd[1:5] == ["--num_gpus", "2", "--master_port", "0"]
    assert Path(cmd[5]).name == "ncpctl" and cmd[6:] == ["pretrain", str(recipe), "--json"]


def _resolved(tmp_path: Path, sweep: str, base: str = BASE):
    from ncpctl.study.sweep import read_sweep, resolve

    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "sweep.yaml").write_text(f"base: base.yaml\nout: {tmp_path / 'out'}\n" + sweep)
    s, _ = read_sweep(tmp_path / "sweep.yaml")
    resolve(s, strict=False)
    return s


def test_a_budget_axis_over_a_base_that_sets_max_steps(tmp_path: Path) -> None:
    """Issue 46 2(a): each point is checked whole, so a train.max_flops axis works over a base that
    sets train.max_steps once the points leave it unset, in a `fixed:` section or as an axis of [null]."""
    from ncpctl.errors import UserError

    base = BASE + "train: {max_steps: 10, seq_len: 32, global_batch_size: 8, micro_batch_size: 8}\n"
    for extra in ("fixed: {train.max_steps: null}\n", "  train.max_steps: [null]\n"):
        sweep = "axes:\n  train.max_flops: [1.0e+11, 2.0e+11]\n"
        s = _resolved(tmp_path, sweep + extra if extra.startswith(" ") else extra + sweep, base)
        assert [p.name for p in s.points] == ["max_flops=1e11", "max_flops=2e11"]
        for p, budget in zip(s.points, (1e11, 2e11)):  # each stops within one step of its budget
            assert budget - p.flops_per_step < p.flops_per_step * p.max_steps <= budget
    assert s.points[0].max_steps < s.points[1].max_steps
    with pytest.raises(UserError, match="fixed: train.lr is also varied"):
        _resolved(tmp_path, "axes: {train.lr: [0.1, 0.2]}\nfixed: {train.lr: 0.3}\n")


def test_point_names_survive_a_shell_and_a_comma_list_and_old_names_are_kept(tmp_path: Path) -> None:
    """Issue 46 2(b): no commas (``eval --compare`` splits arms on them), nothing a shell would
    expand or split, numbers compact, a length cap that keeps names apart; a sweep directory whose
    run has the name an older ncpctl gave (``d16l2,max_flops=100000000000``) keeps it."""
    import shlex

    sweep = ("zip: {name: [d16l2, d24l2], model.d_model: [64, 128]}\naxes:\n  train.max_flops: [1.0e+11, 2.5e+11]\n"
             "points:\n  - {name: '..', train.lr: 0.1}\n  - {name: 'a b,c$(x)', train.lr: 0.2}\n"
             + "".join(f"  - {{train.lr: 0.3, data.val_fraction: 0.01, tokenizer.eod_token: '{'x' * 200}{i}'}}\n"
                       for i in range(2)))  # two names over the cap that differ only past it
    old = tmp_path / "out" / "runs" / "d16l2,max_flops=100000000000"
    old.mkdir(parents=True)
    s = _resolved(tmp_path, sweep)
    names = [p.name for p in s.points]
    assert names[:4] == ["d16l2,max_flops=100000000000", "d16l2+max_flops=2.5e11", "d24l2+max_flops=1e11",
                         "d24l2+max_flops=2.5e11"]
    assert s.points[0].run_dir == old and s.points[0].recipe.name == "d16l2,max_flops=100000000000.yaml"
    assert names[4] == "point" and names[5] == "a_b_c_x"
    assert len(set(names)) == len(names) and all(len(n) <= 120 for n in names) and len(names[6]) == 120
    for n in names[1:]:
        assert "," not in n and shlex.quote(n) == n and not n.startswith(("-", "."))


def test_a_lock_whose_pid_now_names_another_process_is_stale(tmp_path: Path) -> None:
    """Issue 42 item 5: the lock records its owner's start time, so a pid the kernel gave to another
    process since (here: this test's own pid with another start time) is not taken for the owner:
    `ncpctl sweep` starts the point and pretrain takes the lock over with a warning."""
    import os
    import socket

    from ncpctl.runlock import LOCK, RunLock, holder

    with RunLock(tmp_path, "pretrain", warn=print):
        owner = json.loads((tmp_path / LOCK).read_text())
        assert owner["pid"] == os.getpid() and isinstance(owner["started"], int)
        assert holder(tmp_path) is not None
    (tmp_path / LOCK).write_text(json.dumps({**owner, "started": owner["started"] - 1}))
    assert holder(tmp_path) is None
    warnings: list[str] = []
    with RunLock(tmp_path, "pretrain", warn=warnings.append):
        pass
    assert len(warnings) == 1 and "took over the stale lock" in warnings[0]
    (tmp_path / LOCK).write_text(json.dumps({**owner, "host": "gpu-node-17"}))
    assert holder(tmp_path) == f"pid {os.getpid()} on host gpu-node-17 (`ncpctl pretrain`)"
    assert holder(tmp_path, break_lock=True) is None  # `sweep --break-lock` starts it
    (tmp_path / LOCK).write_text(json.dumps({**owner, "host": socket.gethostname()}))
    assert holder(tmp_path, break_lock=True) is not None  # a live run of this host is never broken

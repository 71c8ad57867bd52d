"""Resuming on another number of ranks (issue 27 item 6) through the real entry point: a checkpoint
saved by 2 ranks continues on 1 and one saved by 1 continues on 2, re-partitioned through
DeepSpeed's universal checkpoint (``ncpctl.train.elastic``), with the same global sample order and
the losses of the uninterrupted 2-rank run (global batch 8 either way: 4 x 1 accumulation x 2
ranks, or 4 x 2 x 1; at one thread per rank the numbers agree bit for bit, the bound is 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import losses, ncpctl, result

SETS = ["--set", "train.save_every=2", "--set", "train.keep_last=6", "--set", "train.eval_every=0",
        "--set", "train.attention_stats_every=0", "--json"]


def run(make_recipe, name: str, ranks: int, *sets: str) -> tuple[Path, str]:
    """Train run ``name`` to its 12 steps on ``ranks`` processes (0: no launcher); (run dir, stderr)."""
    proc = ncpctl("pretrain", str(make_recipe(name)), *SETS, *sets, launcher_ranks=ranks, timeout=600)
    r = result(proc)
    assert r["world_size"] == max(1, ranks) and r["step"] == 12
    return make_recipe(name).parent / name, proc.stderr


def data_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:07d}" / "ncpctl.json").read_text())["data"]["train"]


def check_elastic(make_recipe, stage: str, *sets: str) -> None:
    """2 ranks uninterrupted; 1 rank from scratch; then 2 -> 1 and 1 -> 2 from the step-2 checkpoints."""
    zero = ("--set", f"deepspeed.zero_stage={stage}", *sets)
    two, _ = run(make_recipe, f"two{stage}", 2, *zero)
    one, _ = run(make_recipe, f"one{stage}", 0, *zero)
    ref = dict(losses(two))
    assert sorted(ref) == list(range(1, 13))
    for name, ranks, src, saved in ((f"down{stage}", 0, two, 2), (f"up{stage}", 2, one, 1)):
        ckpt = src / "checkpoints" / "step_0000002"
        got, err = run(make_recipe, name, ranks, *zero, "--set", f"train.resume={ckpt}")
        assert f"world size changed: {ckpt} was saved by {saved} rank(s), this run has {max(1, ranks)}" in err
        resumed = dict(losses(got))
        assert sorted(resumed) == list(range(3, 13))  # the next 10 steps
        for step, loss in resumed.items():
            assert abs(loss - ref[step]) <= 1e-5, (name, step, loss, ref[step])
        assert data_state(got, 12) == data_state(two, 12)  # the same global position: nothing repeated or skipped
        assert not any(p.name.startswith(".elastic") for p in got.iterdir())  # the conversion is cleaned up


def test_zero2_resumes_from_two_ranks_on_one_and_from_one_on_two(make_recipe) -> None:
    check_elastic(make_recipe, "2")


@pytest.mark.slow
@pytest.mark.parametrize("stage,sets", [("1", ("--set", "train.optimizer=muon")), ("3", ())],
                         ids=["zero1-muon", "zero3-adamw"])
def test_other_stages_and_muon_momentum_resume_across_world_sizes(make_recipe, stage: str, sets: tuple) -> None:
    """ZeRO-1 with Muon (its momentum, a state DeepSpeed's converter would drop) and ZeRO-3 (every
    parameter partitioned on its own; Muon is refused there)."""
    check_elastic(make_recipe, stage, *sets)


def test_zero0_across_world_sizes_is_one_line(make_recipe, tmp_path: Path) -> None:
    """At ZeRO 0 the engine keeps no partitions to convert: refused before any heavy work."""
    path = tmp_path / "fake" / "checkpoints" / "step_0000002"
    path.mkdir(parents=True)
    meta = {"format": "ncpctl-checkpoint", "version": 1, "step": 2, "tokens_seen": 512, "world_size": 2,
            "zero_stage": 0, "model_config": {}}
    (path / "ncpctl.json").write_text(json.dumps(meta))
    proc = ncpctl("pretrain", str(make_recipe("z0")), *SETS, "--set", f"train.resume={path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "saved by 2 ranks, now 1 (a resume on another number of ranks re-partitions ZeRO 1-3" in proc.stderr
    assert "Traceback" not in proc.stderr

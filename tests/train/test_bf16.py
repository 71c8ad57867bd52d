"""``train.precision=bf16`` on the CPU tracks fp32, so the GPU path's numerics (DeepSpeed's bf16
engine) are checked without a GPU:

* every ZeRO stage keeps fp32 master weights and takes AdamW's first step as step 1 (a bias moves
  by lr). The defect this guards: at stage 0 DeepSpeed wraps the optimizer in
  ``FP16_UnfusedOptimizer``, which steps it once on zero gradients when built, so the first real
  AdamW step was step 2 (bias correction sqrt(1+b2)/(1+b1): 0.73x of lr) after one weight decay;
  ``ncpctl.train.engine`` undoes that step. Before the fix: stage 0 adam_steps [2.0], 0.732 lr.
* recipes/debug.yaml on the shared tiny corpus, 50 steps at seq_len 64 from the same seed and data,
  once per precision, through the real ``ncpctl pretrain``: within 0.05 nats (before the fix the
  runs ended 0.065 (val) / 0.076 (last-5 train) apart; after: 0.0001 / 0.031)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import RECIPES
from .conftest import ENV, metrics, ncpctl, result


def test_bf16_keeps_fp32_masters_and_adamw_first_step_at_every_zero_stage() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.train.bf16_step", "--stages", "0", "1", "2", "3"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["model"] == ["torch.bfloat16"] and r["masters"] == ["torch.float32"], r
        assert r["adam_steps"] == [1.0], r  # one real step: no hidden step before it
        assert abs(r["bias_step_over_lr"] - 1.0) < 0.01, r  # bf16 resolves 3e-3 to 0.4 %


def _run(tiny_data: Path, run_dir: Path, precision: str) -> dict:
    sets = [f"data.train_prefix={tiny_data / 'train'}", f"data.val_prefix={tiny_data / 'val'}",
            f"tokenizer.path={tiny_data / 'tokenizer.json'}", f"run.dir={run_dir}", "train.max_steps=50",
            "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_every=50",
            "train.eval_batches=2", "train.save_every=0", "train.plots=false", f"train.precision={precision}"]
    return result(ncpctl("pretrain", str(RECIPES / "debug.yaml"), "--json", *(a for s in sets for a in ("--set", s))))


def test_bf16_tracks_fp32_within_005_nats(tiny_data: Path, tmp_path: Path) -> None:
    fp32, bf16 = (_run(tiny_data, tmp_path / p, p) for p in ("fp32", "bf16"))
    assert fp32["bf16"] is False and bf16["bf16"] is True and bf16["nonfinite_steps"] == 0
    last5 = {p: sum(r["loss"] for r in metrics(tmp_path / p)[-5:]) / 5 for p in ("fp32", "bf16")}
    first = metrics(tmp_path / "fp32")[0]["loss"]
    assert last5["fp32"] < first - 0.5  # it learned: 6.25 -> ~5.3 nats
    # not bit-identical: bf16 really ran (same init weights and data, so any difference is precision)
    assert [r["loss"] for r in metrics(tmp_path / "bf16")] != [r["loss"] for r in metrics(tmp_path / "fp32")]
    assert abs(last5["bf16"] - last5["fp32"]) < 0.05
    assert abs(bf16["val"]["loss"] - fp32["val"]["loss"]) < 0.05

"""``train.precision=bf16`` on the CPU tracks fp32: recipes/debug.yaml on the shared tiny corpus,
50 steps at seq_len 64 from the same seed and data, once per precision, through the real
``ncpctl pretrain``; the GPU path's numerics (DeepSpeed's bf16 engine) checked without a GPU.

Known defect (xfail, strict): at ZeRO stage 0, DeepSpeed 0.19 on the CPU wraps our optimizer in
``FP16_UnfusedOptimizer`` for bf16, whose first AdamW update is ~0.73x lr where fp32 takes lr (a
bias's step-1 delta 0.00220 vs 0.00300 at lr 3e-3), and the runs end 0.065 (val) / 0.076 (last-5
train) nats apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import RECIPES
from .conftest import metrics, ncpctl, result


def _run(tiny_data: Path, run_dir: Path, precision: str) -> dict:
    sets = [f"data.train_prefix={tiny_data / 'train'}", f"data.val_prefix={tiny_data / 'val'}",
            f"tokenizer.path={tiny_data / 'tokenizer.json'}", f"run.dir={run_dir}", "train.max_steps=50",
            "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_every=50",
            "train.eval_batches=2", "train.save_every=0", "train.plots=false", f"train.precision={precision}"]
    return result(ncpctl("pretrain", str(RECIPES / "debug.yaml"), "--json", *(a for s in sets for a in ("--set", s))))


@pytest.mark.xfail(strict=True, reason="bf16 at ZeRO 0 on the CPU: FP16_UnfusedOptimizer's first step is ~0.73x lr")
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

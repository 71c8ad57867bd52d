"""The model's per-step statistics: ``NCPOutput.stats`` summed over the micro-batches of a step
(and the ranks) reach ``NCPModel.on_step_end`` once per applied step, and the train records.

The real entry point runs in a subprocess whose ``NCPModel`` returns two known statistics
(the target tokens of each micro-batch and the sum of their first targets) and records every
hook call; the expected totals come from reading the same batches with ``WindowLoader``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ncpctl.data.indexed import IndexedDataset
from ncpctl.data.windows import WindowLoader

from .conftest import ENV, metrics, result

SCRIPT = '''
import json, sys
import torch
from ncpctl.model.core.model import NCPModel

LOG = sys.argv.pop(1)
_forward = NCPModel.forward


def forward(self, idx, targets=None, **kw):
    out = _forward(self, idx, targets, **kw)
    if targets is not None and self.training:  # this micro-batch's local sums (not the stability probe's)
        out.stats = {"target_tokens": torch.tensor(float(targets.numel())),
                     "first_target_sum": targets[:, 0].sum().float()}
    return out


def on_step_end(self, stats):
    with open(LOG, "a") as f:
        f.write(json.dumps(stats) + "\\n")


NCPModel.forward = forward
NCPModel.stat_keys = lambda self: ["target_tokens", "first_target_sum"]
NCPModel.on_step_end = on_step_end

from ncpctl.cli.app import main
sys.argv = ["ncpctl", *sys.argv[1:]]
main()
'''


def test_on_step_end_gets_the_step_totals(make_recipe, tmp_path: Path, tiny_data: Path) -> None:
    script, log = tmp_path / "run_with_stats.py", tmp_path / "hook.jsonl"
    script.write_text(SCRIPT)
    recipe = make_recipe("stats")
    # micro 2 x 4 accumulation steps = global batch 8; step 3 non-finite (skipped: no hook call)
    sets = ["train.max_steps=4", "train.micro_batch_size=2", "train.eval_every=2", "train.save_every=0"]
    proc = subprocess.run([sys.executable, str(script), str(log), "pretrain", str(recipe), "--json",
                           *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env={**ENV, "NCPCTL_FAULT": "nan@3"}, timeout=300)
    r = result(proc)
    assert r["step"] == 4 and r["nonfinite_steps"] == 1

    loader = WindowLoader(IndexedDataset(str(tiny_data / "train")), 32, 8, seed=1234)
    batches = [np.asarray(next(loader)) for _ in range(4)]  # (8, 33) per step: targets = [:, 1:]
    want = [{"target_tokens": 8.0 * 32, "first_target_sum": float(b[:, 1].sum())} for b in batches]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [want[0], want[1], want[3]]  # once per applied step, totals over the 4 micro-batches

    recs = {x["step"]: x for x in metrics(tmp_path / "stats")}
    for step in (1, 2, 3, 4):  # the train records log every step's totals under their names
        assert {k: recs[step][k] for k in want[0]} == want[step - 1]
    assert not np.isfinite(recs[3]["loss"])
    val = metrics(tmp_path / "stats", "val")
    assert val and all("target_tokens" not in v for v in val)  # evaluation has no statistics

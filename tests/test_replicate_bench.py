"""bench/replicate_conceptlm.py end to end at its smoke profile (seconds): it tokenizes
builtin:python-packages with a package held out, trains two variants, scores the held-out
package, compares the runs, and writes a summary whose numbers come from those runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import REPO


def test_replicate_script_smoke(tmp_path):
    out = tmp_path / "rep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "replicate_conceptlm.py"), "--profile", "smoke",
                           "--seeds", "1", "--variants", "base,full", "--heldout-packages", "idna", "--out", str(out),
                           "--doc", str(tmp_path / "replication.md")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + (out / "log.txt").read_text()[-3000:]
    res = json.loads((out / "summary.json").read_text())
    meta = json.loads((out / "data-run" / "data" / "meta.json").read_text())
    held = next(iter(meta["packages"].values()))["held_out"]
    assert "idna" in held  # never in training
    runs = {r["variant"]: r for r in res["runs"]}
    assert set(runs) == {"base", "full"}
    for name, r in runs.items():
        ev = json.loads(next((out / "runs" / f"{name}-s1" / "eval").glob("results_*.json")).read_text())
        entry = ev["perplexity"]["per_set"]["heldout_packages"]
        assert r["heldout_ntp_loss"] == entry["nll"] / entry["tokens"]  # the summary's number is the eval's
    assert res["summary"]["variants"]["base"]["heldout_vs_base"]["difference"] == 0
    assert "| full |" in (tmp_path / "replication.md").read_text() and res["compare"]["runs"]

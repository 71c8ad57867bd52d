"""examples/pipeline.sh, the shipped CI pipeline, run as-is on a tiny configuration: every step
chained through `--json`, and a failing step's exit code is the pipeline's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import REPO, ncpctl_cmd

SCRIPT = REPO / "examples" / "pipeline.sh"
# recipes/debug.yaml cut down to seconds: 30 documents, seq 32, 3 steps, 3 examples per eval task
TINY = ["data.max_documents=30", "data.val_fraction=0.1", "tokenizer.vocab_size=512", "model.max_seq_len=64",
        "train.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=8", "train.max_steps=3",
        "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", "train.plots=false", "eval.limit=3"]


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "NCPCTL": " ".join(ncpctl_cmd()), "PYTHON": sys.executable,
                "OUT_DIR": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=300)


def test_pipeline_chains_every_step(tmp_path: Path) -> None:
    sets = [a for s in [f"run.dir={tmp_path / 'run'}", *TINY] for a in ("--set", s)]
    r = _run(tmp_path, *sets)
    assert r.returncode == 0, r.stderr[-3000:]
    final = json.loads(r.stdout.strip().splitlines()[-1])
    ck = Path(final["checkpoint"])
    assert ck == tmp_path / "run" / "checkpoints" / "step_0000003" and (ck / "ncpctl.json").is_file()
    results = json.loads(Path(final["eval_results"]).read_text())
    assert Path(final["eval_results"]).parent == tmp_path / "run" / "eval" and "ncp_cloze" in results["results"]
    export = Path(final["export"])
    assert export == tmp_path / "run" / "export" and (export / "config.json").is_file()
    assert (export / "model.safetensors").is_file()
    for step in ("tokenize", "pretrain", "eval", "export"):
        assert json.loads((tmp_path / "out" / f"{step}.json").read_text())["ok"] is True, step


def test_a_failing_step_stops_the_pipeline_with_its_exit_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {REPO / 'recipes' / 'debug.yaml'}\ntrain: {{max_stpes: 3}}\n")
    r = _run(tmp_path, "--set", f"run.dir={tmp_path / 'run'}", RECIPE=str(bad))
    assert r.returncode == 2, r.stderr  # tokenize's user-error code, not bash's 1
    assert "train.max_stpes: unknown key" in r.stderr and "ncpctl tokenize failed (exit code 2)" in r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tokenize.json"]  # nothing ran after it
    assert json.loads((tmp_path / "out" / "tokenize.json").read_text())["exit_code"] == 2
    assert not (tmp_path / "run").exists()

"""`ncpctl sweep` runs its points through submitit's local executor and resumes: a point killed
with SIGKILL mid-run resumes from its checkpoint on the rerun, finished points are skipped (their
checkpoints untouched), and a point whose run directory a live process holds is never started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import ncpctl_cmd

from .conftest import ENV, RECIPE


def _sweep(tmp_path: Path, tiny_data: Path, lrs: list[float]) -> Path:
    (tmp_path / "base.yaml").write_text(RECIPE.format(data=tiny_data, run=tmp_path / "unused"))
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: base.yaml\nout: {tmp_path / 'out'}\naxes:\n  train.lr: {json.dumps(lrs)}\n")
    return path


def _manifest(tmp_path: Path) -> dict:
    return {p["name"]: p for p in json.loads((tmp_path / "out" / "manifest.json").read_text())["points"]}


def _checkpoints(run: Path) -> dict[str, float]:
    return {str(f.relative_to(run)): f.stat().st_mtime_ns for f in (run / "checkpoints").rglob("*") if f.is_file()}


def _kill_when_at(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGKILL the point's pretrain (the pid its run lock names) once it has logged ``step``."""
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        log, lock = run / "metrics.jsonl", run / "ncpctl.lock"
        recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
        if any(r.get("split") == "train" and r["step"] >= step for r in recs) and lock.is_file():
            os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)
            return
        time.sleep(0.05)
    raise AssertionError(f"{run} did not reach step {step}")


def test_sweep_killed_point_resumes_and_finished_points_are_skipped(tmp_path: Path, tiny_data: Path) -> None:
    sweep = _sweep(tmp_path, tiny_data, [3e-3, 1e-3, 5e-4])
    cmd = [*ncpctl_cmd(), "sweep", str(sweep), "--parallel", "3", "--json"]
    # every step sleeps 0.2 s, so the point is caught mid-run (after its step-3 checkpoint)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "NCPCTL_FAULT": "sleep@0.2"})
    runs = tmp_path / "out" / "runs"
    _kill_when_at(runs / "lr=0.001", 4, proc)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    first = json.loads(stdout.splitlines()[-1])
    assert first["ok"] is False and "lr=0.001 (failed: pretrain exited -9" in first["errors"][0]
    status = _manifest(tmp_path)
    assert {n: p["status"] for n, p in status.items()} == {"lr=0.003": "done", "lr=0.001": "failed", "lr=0.0005": "done"}
    # each point is an ordinary recipe that extends the base and sets its keys and run.dir
    child = (tmp_path / "out" / "points" / "lr=0.001.yaml").read_text()
    assert "extends: ../../base.yaml" in child and "lr: 0.001" in child and str(runs / "lr=0.001") in child
    finished = {n: _checkpoints(runs / n) for n in ("lr=0.003", "lr=0.0005")}
    jobs = len(list((tmp_path / "out" / "submitit").glob("*_submitted.pkl")))

    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    points = {p["name"]: p for p in json.loads(again.stdout.splitlines()[-1])["points"]}
    assert all(p["status"] == "done" and p["step"] == 12 for p in points.values())
    assert points["lr=0.001"]["note"].startswith("resumed from step_")
    # one job (the killed point); the finished points' checkpoints are the same files, untouched
    assert len(list((tmp_path / "out" / "submitit").glob("*_submitted.pkl"))) == jobs + 1
    assert {n: _checkpoints(runs / n) for n in finished} == finished


def test_sweep_never_starts_a_point_locked_by_a_live_process(tmp_path: Path, tiny_data: Path) -> None:
    sweep = _sweep(tmp_path, tiny_data, [3e-3])
    run = tmp_path / "out" / "runs" / "lr=0.003"
    run.mkdir(parents=True)
    # this test's own process (alive) holds the lock, as a pretrain still running would
    (run / "ncpctl.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                 "command": "pretrain"}))
    proc = subprocess.run([*ncpctl_cmd(), "sweep", str(sweep), "--json"], cwd=tmp_path, capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 1
    point = json.loads(proc.stdout.splitlines()[-1])["points"][0]
    assert point["status"] == "locked" and f"pid {os.getpid()}" in point["note"]
    assert not (run / "metrics.jsonl").exists() and not list((tmp_path / "out" / "submitit").glob("*_submitted.pkl"))

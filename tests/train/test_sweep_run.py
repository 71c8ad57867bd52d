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


def _status(sweep: Path, verify: bool = False) -> tuple[str, str, str]:
    """(name, status, note) of the sweep's one point, as `ncpctl sweep` finds it before running anything."""
    from ncpctl.study.sweep import read_sweep, resolve
    from ncpctl.study.sweep_state import refresh

    s, _ = read_sweep(sweep)
    s.verify = verify
    resolve(s, strict=True)
    refresh(s)
    return s.points[0].name, s.points[0].status, s.points[0].note


def test_a_point_is_done_only_while_its_checkpoint_and_recipe_match(tmp_path: Path, tiny_data: Path) -> None:
    """Issue 42 item 5: a lock another host left is not broken without --break-lock; a finished point
    counts as done only while its final checkpoint's files have its manifest's sizes (checksums too
    with --verify) and the keys the point and its base set have the values its run recorded (a value
    the recipe leaves to a default may change); otherwise it is "stale" and --rerun-stale trains it
    again, its old run moved aside. Issue 46 2(b, c): a run under the name an older ncpctl gave the
    point is still done; with stderr not a terminal, one plain line per point as it ends."""
    from ncpctl import manifest

    (tmp_path / "base.yaml").write_text(RECIPE.format(data=tiny_data, run=tmp_path / "unused"))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: base.yaml\nout: {tmp_path / 'out'}\n"
                     "points:\n  - {train.lr: 0.003, train.warmup_steps: 3}\n")
    name = "lr=0.003+warmup_steps=3"
    run = tmp_path / "out" / "runs" / name
    run.mkdir(parents=True)
    (run / "ncpctl.lock").write_text(json.dumps({"host": "gpu-node-17", "pid": 4242, "command": "pretrain"}))
    cmd = [*ncpctl_cmd(), "sweep", str(sweep), "--json"]
    locked = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    point = json.loads(locked.stdout.splitlines()[-1])["points"][0]
    assert locked.returncode == 1 and point["status"] == "locked" and "--break-lock" in point["note"], locked.stderr
    broken = subprocess.run([*cmd, "--break-lock"], cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert broken.returncode == 0, broken.stderr[-3000:]
    loss = json.loads(broken.stdout)["points"][0]["val_loss"]
    assert [line for line in broken.stderr.splitlines() if line.startswith("point ")] == [
        f"point {name}: done at step 12/12, val loss {loss:.4f} [1/1 ended]"]

    ck = run / "checkpoints" / "step_0000012"
    weights = ck / "model.safetensors"
    data = bytearray(weights.read_bytes())
    assert _status(sweep) == (name, "done", "")
    data[len(data) // 2] ^= 1
    weights.write_bytes(data)
    assert _status(sweep)[1] == "done"  # the sizes match: only --verify reads every byte
    assert _status(sweep, verify=True)[1:] == ("stale", "final checkpoint step_0000012: model.safetensors does not "
                                               "match its xxh3_128 checksum (damaged on disk); --rerun-stale trains "
                                               "it again")
    data[len(data) // 2] ^= 1
    weights.rename(tmp_path / "weights")
    assert _status(sweep)[1:] == ("stale", "final checkpoint step_0000012: model.safetensors is missing; "
                                  "--rerun-stale trains it again")
    (tmp_path / "weights").rename(weights)
    # a key neither the base nor the point sets (a default that changed since) does not count
    meta = json.loads((ck / "ncpctl.json").read_text())
    meta["recipe"]["train"]["weight_decay"] = 0.123
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    manifest.write(ck, manifest.describe(ck, manifest.files_of(ck)))
    assert _status(sweep, verify=True) == (name, "done", "")
    # an older ncpctl's name for the point (comma-joined): still found, still done
    legacy = run.with_name("lr=0.003,warmup_steps=3")
    run.rename(legacy)
    assert _status(sweep) == (legacy.name, "done", "")
    legacy.rename(run)

    (tmp_path / "base.yaml").write_text((tmp_path / "base.yaml").read_text().replace("enabled: true", "enabled: false"))
    stale = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    point = json.loads(stale.stdout.splitlines()[-1])["points"][0]
    assert stale.returncode == 1 and point["status"] == "stale", stale.stderr[-3000:]
    assert point["note"].startswith("its recipe changed since it was trained: model.concept.enabled: true when "
                                    "trained, false now"), point["note"]
    jobs = len(list((tmp_path / "out" / "submitit").glob("*_submitted.pkl")))
    again = subprocess.run([*cmd, "--rerun-stale"], cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list((tmp_path / "out" / "submitit").glob("*_submitted.pkl"))) == jobs + 1
    assert (tmp_path / "out" / "stale" / name / "checkpoints" / "step_0000012" / "model.safetensors").is_file()
    assert json.loads((run / "checkpoints" / "step_0000012" / "ncpctl.json").read_text())["recipe"]["model"][
        "concept"]["enabled"] is False

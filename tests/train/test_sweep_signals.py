"""`ncpctl sweep` stopped from outside (issue 42 item 5, issue 46 item 2(d)): SIGTERM, SIGHUP and a
terminal's Ctrl-C (SIGINT to the whole foreground process group) each stop the running point with
its checkpoint saved, wait for it, record it "interrupted" and end with one line; and however the
sweep or the submitit worker running a point dies (SIGKILL), the point's pretrain does not train on
as an orphan: it saves and exits. Five sweeps of one point each, run side by side."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ncpctl_cmd

from .conftest import ENV, RECIPE

MAX_STEPS = 200  # 0.2 s a step: a point left running would train on for 40 s and more
CASES = ("SIGTERM", "SIGHUP", "ctrl-c", "kill-sweep", "kill-worker")


def _start(root: Path, tiny_data: Path) -> subprocess.Popen:
    root.mkdir()
    (root / "base.yaml").write_text(RECIPE.format(data=tiny_data, run=root / "unused")
                                    .replace("max_steps: 12", f"max_steps: {MAX_STEPS}"))
    (root / "sweep.yaml").write_text(f"base: base.yaml\nout: {root / 'out'}\naxes:\n  train.lr: [0.003]\n")
    # a session of its own: a killpg of it is what a terminal's Ctrl-C sends
    return subprocess.Popen([*ncpctl_cmd(), "sweep", "sweep.yaml"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**ENV, "NCPCTL_FAULT": "sleep@0.2"})


def _steps(run: Path) -> list[int]:
    log = run / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [r["step"] for r in map(json.loads, filter(str.strip, lines)) if r.get("split") == "train"]


def _pretrain_pid(run: Path, proc: subprocess.Popen, timeout: float = 240) -> int:
    """The point's pretrain (the pid its run lock names) once it has trained 2 steps."""
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        lock = run / "ncpctl.lock"
        if max(_steps(run), default=0) >= 2 and lock.is_file():
            return json.loads(lock.read_text())["pid"]
        time.sleep(0.1)
    raise AssertionError(f"{run} did not reach step 2")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.time() + seconds
    while _alive(pid) and time.time() < end:
        time.sleep(0.1)
    return not _alive(pid)


def _saved_at_its_last_step(run: Path) -> int:
    """The run stopped early, and its newest checkpoint is its last step (saved on the way out)."""
    latest = (run / "checkpoints" / "latest").read_text().strip()
    step = int(latest.removeprefix("step_"))
    assert step == max(_steps(run)) < MAX_STEPS, (latest, max(_steps(run)))
    return step


@pytest.mark.slow  # five sweeps and their pretrains side by side: about 20 s of CPU
def test_a_stopped_or_killed_sweep_leaves_no_point_training(tmp_path: Path, tiny_data: Path) -> None:
    from ncpctl.runlock import holder

    sweeps = {case: _start(tmp_path / case, tiny_data) for case in CASES}
    pids: dict[str, int] = {}
    try:
        for case, proc in sweeps.items():
            pids[case] = _pretrain_pid(tmp_path / case / "out" / "runs" / "lr=0.003", proc)
        for case, proc in sweeps.items():
            if case in ("SIGTERM", "SIGHUP"):
                os.kill(proc.pid, getattr(signal, case))
            elif case == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)
            elif case == "kill-sweep":
                os.kill(proc.pid, signal.SIGKILL)
            else:  # the submitit worker that runs the point: pretrain's parent
                with open(f"/proc/{pids[case]}/stat") as f:
                    os.kill(int(f.read().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        for case, proc in sweeps.items():
            _, stderr = proc.communicate(timeout=240)
            run = tmp_path / case / "out" / "runs" / "lr=0.003"
            graceful = case in ("SIGTERM", "SIGHUP", "ctrl-c")
            # the stopped sweep waited for its point; a killed one's point stops on its own
            assert _gone_within(pids[case], 0 if graceful else 60), f"{case}: pretrain still running"
            assert holder(run) is None, case  # the next run does not find the point locked
            step = _saved_at_its_last_step(run)
            if not graceful:
                continue
            sig = "SIGINT" if case == "ctrl-c" else case
            assert proc.returncode == 128 + getattr(signal, sig), (case, proc.returncode, stderr[-2000:])
            errors = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, (case, stderr[-3000:])
            assert len(errors) == 1 and errors[0].startswith(f"error: interrupted by {sig}: 1 running point(s) "
                                                             "stopped (lr=0.003)"), (case, errors)
            manifest = json.loads((tmp_path / case / "out" / "manifest.json").read_text())
            point = manifest["points"][0]
            assert manifest["state"] == "interrupted" and point["status"] == "interrupted", (case, manifest)
            assert point["note"].startswith(f"stopped at step {step} with its checkpoint saved"), (case, point)
        assert sweeps["kill-worker"].returncode == 1 and sweeps["kill-sweep"].returncode == -signal.SIGKILL
    finally:
        for case, proc in sweeps.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            if case in pids and _alive(pids[case]):  # only a failing run leaves one
                os.kill(pids[case], signal.SIGKILL)

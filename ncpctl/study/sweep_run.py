"""Running a sweep's points through submitit, and stopping them.

One code path for both executors: ``local`` (submitit's LocalExecutor, at most ``parallel`` points at a
time on this machine) and ``slurm`` (its AutoExecutor, one job array, at most ``parallel`` array tasks
at a time). Each job runs ``ncpctl pretrain OUT/points/NAME.yaml`` as a subprocess (``run_point``).
A rerun skips done points, resumes the others from their checkpoints (pretrain's
``train.resume: auto``) and never starts a point whose run directory a live process holds.

Stopping. SIGINT (Ctrl-C), SIGTERM and SIGHUP to the sweep all do the same: no point is started any
more, each running point's pretrain gets SIGTERM (it finishes its step, saves and exits), the sweep
waits for them, records them ``interrupted`` (and the manifest's ``state``) and exits with one line;
a second signal kills the points at once (they resume from their last checkpoint). The local
processes die with the sweep however it ends: each point's process chain (submitit's controller ->
its task, which runs ``run_point`` -> pretrain) gets SIGTERM from the kernel when the process above
it dies (``PR_SET_PDEATHSIG``, Linux), and each controller runs in a session of its own, so the
terminal's Ctrl-C reaches the sweep alone (no tracebacks from submitit's processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from ncpctl.errors import UserError
from ncpctl.runlock import holder
from ncpctl.study.sweep import Sweep, SweepPoint, write_manifest
from ncpctl.study.sweep_state import move_aside, refresh

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies (Linux; elsewhere a no-op). False when
    ``parent`` is already gone (this process was orphaned before it asked)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == parent


def _child_setup(parent: int) -> None:
    """A ``preexec_fn``: in the child, between fork and exec (the death signal survives the exec)."""
    if not die_with_parent(parent):
        os._exit(1)


# ----------------------------------------------------------------------------- one point (a submitit job)


def point_command(recipe: Path, ranks: int, break_lock: bool = False) -> list[str]:
    """``ncpctl pretrain RECIPE --json``, under ``deepspeed --num_gpus N`` when the sweep has ranks > 1."""
    script = Path(sys.executable).parent / "ncpctl"
    ncpctl = [str(script)] if script.exists() else [sys.executable, "-m", "ncpctl"]
    extra = ["--break-lock"] if break_lock else []
    if ranks > 1:
        launcher = Path(sys.executable).parent / "deepspeed"
        if not script.exists():
            raise UserError("ranks > 1 needs the installed ncpctl script next to the interpreter (the launcher runs it)")
        # --master_port 0: run_point picks a free port, so points sharing a machine do not collide
        return [str(launcher if launcher.exists() else "deepspeed"), "--num_gpus", str(ranks), "--master_port", "0",
                str(script), "pretrain", str(recipe), "--json", *extra]
    return [*ncpctl, "pretrain", str(recipe), "--json", *extra]


def _free_port(command: list[str]) -> list[str]:
    if "--master_port" in command and command[command.index("--master_port") + 1] == "0":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            command = [*command]
            command[command.index("--master_port") + 1] = str(sock.getsockname()[1])
    return command


def run_point(command: list[str], cwd: str, log: str) -> dict[str, Any]:
    """The job submitit runs: the point's pretrain as a subprocess; its exit code and summary.

    A stop signal (SIGTERM from the controller, SIGINT, SIGHUP) goes on to pretrain as SIGTERM, which
    saves and exits; pretrain gets SIGTERM from the kernel if this process dies, and this process if
    its local controller dies (submitit's own handler would only log the SIGTERM)."""
    controller = int(os.environ.get("SUBMITIT_LOCAL_JOB_ID") or 0)  # the local controller's pid
    if controller and not die_with_parent(controller):
        return {"returncode": None, "summary": None, "note": "its submitit controller was gone before it started"}
    received: list[int] = []
    proc: subprocess.Popen[str] | None = None

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    for s in STOP_SIGNALS:
        signal.signal(s, forward)
    with open(log, "a") as err:
        proc = subprocess.Popen(_free_port(command), cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=functools.partial(_child_setup, os.getpid()))
        if received:  # a signal that came before pretrain existed
            proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate()
    summary = None
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("{"):
            try:
                summary = json.loads(line)
            except ValueError:
                continue
            break
    return {"returncode": proc.returncode, "summary": summary}


# ----------------------------------------------------------------------------- executors


def _controller_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
    """submitit's local controller, started in a session of its own (the terminal's signals reach the
    sweep alone) that gets SIGTERM when the sweep dies (it passes that on to its task)."""
    return subprocess.Popen(*args, **kwargs, start_new_session=True,
                            preexec_fn=functools.partial(_child_setup, os.getpid()))


class _LocalExecutor:
    """submitit's LocalExecutor whose controllers start through ``_controller_popen``: submitit starts
    them with ``subprocess.Popen`` in ``submitit.local.local``, where (only while submitting) that
    name is ours."""

    def __init__(self, folder: Path, timeout_min: float) -> None:
        import submitit

        self.ex = submitit.LocalExecutor(folder=folder)
        self.ex.update_parameters(timeout_min=timeout_min)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        import submitit.local.local as local

        real = local.subprocess
        local.subprocess = SimpleNamespace(Popen=_controller_popen)  # type: ignore[assignment]
        try:
            return self.ex.submit(fn, *args)
        finally:
            local.subprocess = real


def make_executor(kind: str, sweep: Sweep, parallel: int) -> Any:
    import submitit

    folder = sweep.out / "submitit"
    if kind == "local":
        return _LocalExecutor(folder, sweep.timeout_min)
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise UserError(f"--executor slurm: {' and '.join(missing)} not found on PATH (not a Slurm cluster)",
                        hint="run the sweep on the cluster's login node, or use --executor local")
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    params = dict(sweep.slurm)
    generic = {"timeout_min", "nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "mem_gb", "name",
               "stderr_to_stdout"}
    kw = {k if k in generic else f"slurm_{k}": v for k, v in params.items()}
    kw.setdefault("timeout_min", max(1, round(sweep.timeout_min)))
    kw.setdefault("tasks_per_node", 1)  # the launcher (ranks > 1) starts the ranks itself
    kw.setdefault("gpus_per_node", sweep.ranks)
    kw.setdefault("name", f"ncpctl-sweep-{sweep.name}")
    kw["slurm_array_parallelism"] = parallel
    try:
        ex.update_parameters(**kw)
    except (ValueError, TypeError, NameError, AssertionError) as e:  # submitit asserts the parameters' types
        raise UserError(f"{sweep.path}: slurm: {str(e).splitlines()[0]}") from None
    return ex


# ----------------------------------------------------------------------------- the sweep


class Stop:
    """SIGINT, SIGTERM and SIGHUP while the sweep runs: counted (the first stops the points gently, a
    second kills them), never raised in the middle of a manifest write."""

    def __init__(self) -> None:
        self.signum, self.count = 0, 0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum, self.count = self.signum or signum, self.count + 1

    def __enter__(self) -> "Stop":
        self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _signal_jobs(jobs: dict[str, Any], executor: str, force: bool) -> None:
    """Local: SIGTERM to each controller (passed on down to pretrain), or SIGKILL to its whole session;
    Slurm: scancel."""
    for job in jobs.values():
        if executor != "local":
            job.cancel(check=False)
            continue
        with contextlib.suppress(ProcessLookupError):
            if force:
                os.killpg(int(job.job_id), signal.SIGKILL)
            else:
                os.kill(int(job.job_id), signal.SIGTERM)


def _start(sweep: Sweep) -> list[SweepPoint]:
    """The points to run: pending, failed and interrupted ones, and stale ones with ``rerun_stale``."""
    refresh(sweep)
    for p in sweep.points:
        if p.status == "done":
            p.note = "finished before this run: skipped"
        elif p.status == "stale" and sweep.rerun_stale and holder(p.run_dir) is None:
            p.note = f"was stale ({p.note.split('; --rerun-stale')[0]}); its old run is now {move_aside(sweep, p)}"
    todo = [p for p in sweep.points if p.status in ("pending", "failed", "interrupted")]
    for p in todo:
        p.status, p.note = "pending", p.note if p.note.startswith("was stale") else ""
    return todo


def run(sweep: Sweep, executor: str, parallel: int, show: Callable[[Sweep], None], interval: float = 1.0) -> None:
    """Run every point that is not done, stale or locked, at most ``parallel`` at a time, through
    submitit, until all end or a signal stops them (``sweep.signum``)."""
    ex = make_executor(executor, sweep, parallel)
    todo = _start(sweep)
    jobs: dict[str, Any] = {}
    by_name = {p.name: p for p in sweep.points}
    cwd = os.getcwd()
    logs = sweep.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sweep.state = "running"

    def submit(p: SweepPoint) -> Any:
        command = point_command(p.recipe, sweep.ranks, sweep.break_lock)
        return ex.submit(run_point, command, cwd, str(logs / f"{p.name}.log"))

    with Stop() as stop:
        if executor == "slurm":  # one job array; the array's parallelism throttles it
            with ex.batch():
                pending = [(p, submit(p)) for p in todo]
            jobs, todo = {p.name: j for p, j in pending}, []
        signalled = 0
        while todo or jobs:
            if stop.count > signalled:  # the first signal: stop gently; another: kill
                force = stop.count > 1
                _signal_jobs(jobs, executor, force)
                todo, signalled = [], stop.count
                if executor != "local":
                    _abandon(jobs, by_name, "cancelled (scancel)", wait_s=0)
                    break
                if force:
                    _abandon(jobs, by_name, "killed by a second signal; it resumes from its last checkpoint")
                    break
            while todo and len(jobs) < parallel:
                p = todo.pop(0)
                refresh(sweep, jobs)  # a point locked since the sweep started is not started
                if p.status in ("pending", "failed", "interrupted"):
                    jobs[p.name] = submit(p)
            for name in [n for n, j in jobs.items() if j.done()]:
                _finish(by_name[name], jobs.pop(name), stopping=bool(stop.count))
            refresh(sweep, jobs)
            write_manifest(sweep)
            _show(show, sweep)
            if todo or jobs:
                time.sleep(interval / 4 if stop.count else interval)
        sweep.signum = stop.signum
    refresh(sweep)
    sweep.state = "interrupted" if sweep.signum else "done" if all(p.status == "done" for p in sweep.points) \
        else "incomplete"
    write_manifest(sweep)
    _show(show, sweep)


def _show(show: Callable[[Sweep], None], sweep: Sweep) -> None:
    """The progress display; a terminal that went away (SIGHUP: its writes fail) does not stop the sweep."""
    with contextlib.suppress(OSError):
        show(sweep)


def _abandon(jobs: dict[str, Any], by_name: dict[str, SweepPoint], note: str, wait_s: float = 5.0) -> None:
    """The jobs left behind: ``interrupted``; a killed local controller is waited for (briefly), so the
    point's run lock is free when the sweep looks at it last."""
    end = time.time() + wait_s
    while any(not j.done() for j in jobs.values()) and time.time() < end:
        time.sleep(0.05)
    for name in jobs:
        by_name[name].status, by_name[name].note = "interrupted", note
    jobs.clear()


def _finish(p: SweepPoint, job: Any, stopping: bool = False) -> None:
    try:
        res = job.result()
    except Exception as e:  # the job itself failed (submitit reports the worker's error)
        p.status, p.note = "failed", f"job failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        return
    rc, summary = res["returncode"], res.get("summary") or {}
    if rc == 0 and summary.get("interrupted"):
        p.status, p.note = "interrupted", f"stopped at step {summary.get('step')} with its checkpoint saved; " \
            "rerun the sweep to resume"
    elif rc != 0:
        errs = "; ".join(summary.get("errors") or []) if isinstance(summary, dict) else ""
        p.status = "interrupted" if stopping else "failed"
        p.note = (res.get("note") or f"pretrain exited {rc}") + (f": {errs}" if errs else "") + \
            f" (log: {p.run_dir.parents[1] / 'logs' / (p.name + '.log')})"
    elif summary.get("resumed_from"):
        p.note = f"resumed from {Path(summary['resumed_from']).name}"

"""Running one model-written program for a code task: the verdict and the containment.

Each program runs under a supervisor (``sandbox_supervisor.py``, a ``python -I`` process in an empty
temporary directory with no environment beyond PATH) that forks it into a session of its own under
``setrlimit`` limits (CPU seconds, address space, file size, no core files) and a wall-clock
timeout. Two ways to contain what it starts, chosen once per process (``containment()``):

* ``namespaces`` (where ``unshare --pid --net`` works: as root, or with unprivileged user
  namespaces): the supervisor is PID 1 of a new PID namespace with a network namespace of its own
  (no interface up: no network, loopback included). When it exits, the kernel kills every process
  left in the namespace, whatever group or session it moved to; killing ``unshare`` kills it too
  (``--kill-child``).
* ``subreaper`` (anywhere else, or with ``NCPCTL_SANDBOX_NAMESPACES=0``): the supervisor marks
  itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), kills the program's process group, then
  kills and reaps every process re-parented to it until none is left. The network is reachable.
  A descendant escapes only if the supervisor itself is killed from outside.

Either way the program's group is killed on the timeout and after every exit, and the supervisor
is gone before ``run_sandboxed`` returns.

The verdict: a program passes only when its harness printed this run's nonce (16 random bytes,
never in the program's or the test's text) and the program's pid after the test returned, and it
exited 0 within the limits. Exiting 0 early (``sys.exit(0)``, ``os._exit(0)``, an ``atexit`` handler), a printed
guess of a sentinel, or a failing test all fail. Output (stdout, stderr) goes to two files in the
temporary directory, each bounded by the file-size limit, and only their last ``TAIL`` bytes are
read back, so a program that prints without end costs the evaluator no memory.

This contains accidents (endless loops, memory blow-ups, forked sleepers, stray files, exits that
fake success), not a hostile model: the nonce is in the program's own process memory, the file
system is the host's. Run untrusted checkpoints in a container.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUPERVISOR = Path(__file__).with_name("sandbox_supervisor.py")
NAMESPACES_ENV = "NCPCTL_SANDBOX_NAMESPACES"  # "0": the subreaper path even where namespaces work
UNSHARE = ["unshare", "--pid", "--fork", "--net", "--kill-child"]
TAIL = 64 << 10  # bytes of each output file read back
GRACE_S = 15.0  # past the program's timeout (the supervisor sweeps for up to 10 s), before it is killed itself


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock per program
    cpu_s: int = 5
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_mb: int = 16  # each file it writes, its stdout and stderr included


@dataclass(frozen=True)
class Outcome:
    passed: bool
    why: str  # "passed", or the failure in one line
    stdout: str  # the last TAIL bytes of each
    stderr: str
    swept: int  # descendants killed after the program's group (the subreaper path; 0 with namespaces)


def _works(prefix: list[str]) -> bool:
    try:
        return subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def _probe(allowed: bool) -> tuple[str, tuple[str, ...]]:
    if allowed and shutil.which("unshare"):
        for prefix in (UNSHARE, [*UNSHARE[:1], "--user", "--map-root-user", *UNSHARE[1:]]):
            if _works(prefix):
                return "namespaces", tuple(prefix)
    return "subreaper", ()


def containment() -> tuple[str, tuple[str, ...]]:
    """("namespaces" | "subreaper", the command prefix that starts the supervisor)."""
    return _probe(os.environ.get(NAMESPACES_ENV, "1") != "0")


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _why(status: dict, stdout: str, stderr: str, nonce: str, lim: Limits) -> str:
    """The verdict in one line: "passed" or why not."""
    if status.get("timeout"):
        return "timeout"
    if "signal" in status:
        sig = status["signal"]
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        what = {"SIGXCPU": f" (over the {lim.cpu_s} s CPU limit)"}.get(name, "")
        return f"killed by {name}{what}"
    code = status.get("exit")
    if code == 0 and f"{nonce} {status['pid']}" in stdout.splitlines():
        return "passed"
    if code == 0:
        return "exited 0 before the tests finished"
    last = stderr.strip().splitlines()
    return (last[-1] if last else f"exit {code}")[:200]


def run_sandboxed(program: str, test: str = "", lim: Limits = Limits()) -> Outcome:
    """Run ``program`` then ``test`` (code that raises on failure) in the sandbox; see the module doc."""
    nonce = secrets.token_hex(16)
    while nonce in program or nonce in test:  # 2^-128 a draw: a guard, not a loop that runs
        nonce = secrets.token_hex(16)
    _, prefix = containment()
    with tempfile.TemporaryDirectory(prefix="ncp-code-") as d:
        work, io = Path(d) / "work", Path(d) / "io"
        work.mkdir()
        io.mkdir()
        req = {"program": program, "test": test, "nonce": nonce, "timeout_s": lim.timeout_s, "cpu_s": lim.cpu_s,
               "memory_mb": lim.memory_mb, "file_mb": lim.file_mb, "out": str(io / "stdout"),
               "err": str(io / "stderr"), "subreaper": not prefix}
        p = subprocess.Popen([*prefix, sys.executable, "-I", str(SUPERVISOR)],  # noqa: S603
                             cwd=work, env={"PATH": os.defpath}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
        try:
            out, err = p.communicate(json.dumps(req).encode(), timeout=lim.timeout_s + GRACE_S)
        except subprocess.TimeoutExpired:  # the supervisor itself hung: its group goes (with namespaces, all)
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return Outcome(False, "timeout (the sandbox's supervisor did not stop)", "", "", 0)
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if p.returncode != 0 or not lines:
            why = err.decode("utf-8", "replace")[-500:]
            raise RuntimeError(f"the code sandbox failed (exit {p.returncode}): {why}")
        status = json.loads(lines[-1])
        stdout, stderr = _tail(io / "stdout"), _tail(io / "stderr")
    why = _why(status, stdout, stderr, nonce, lim)
    return Outcome(why == "passed", why, stdout, stderr, int(status.get("swept", 0)))

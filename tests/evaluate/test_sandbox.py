"""The code sandbox (ncpctl/evaluate/sandbox.py, sandbox_supervisor.py), issue 41 item 5 and issue 42
item 3: a program passes only when the harness printed the run's nonce after its test (exiting 0
early, an atexit handler or a guessed sentinel fail), its output is bounded, and nothing it started
outlives it: forked sleepers after a timeout, a daemon left by a passing program. Each runs on both
containment paths: PID + network namespaces, and the subreaper fallback (forced with
NCPCTL_SANDBOX_NAMESPACES=0)."""

from __future__ import annotations

import socket
import time
import tracemalloc
from pathlib import Path

import pytest

from ncpctl.evaluate import sandbox
from ncpctl.evaluate.code_exec import ALLOW_ENV, Limits, evaluate_code

ADD = {"task_id": "add", "prompt": "def add(a, b):\n", "test": "assert add(2, 3) == 5"}
LIM = Limits(timeout_s=1.0, cpu_s=5, memory_mb=256)


@pytest.fixture(params=["namespaces", "subreaper"])
def path(request, monkeypatch) -> str:
    """Each containment path in turn; the namespace one only where this machine allows it."""
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setenv(sandbox.NAMESPACES_ENV, "1" if request.param == "namespaces" else "0")
    got = sandbox.containment()[0]
    if got != request.param:
        pytest.skip("unshare --pid --net is not permitted here (the subreaper path is tested)")
    return got


def _pass_count(completions: list[str], lim: Limits = LIM) -> tuple[int, list[str]]:
    res = evaluate_code([ADD], lambda prompt, n: completions[:n], n=len(completions), lim=lim)
    return res["problems"][0]["correct"], res["problems"][0]["failures"]


def test_a_program_that_fakes_its_exit_status_fails(path):
    """A wrong add that forces exit 0 (an atexit os._exit(0), sys.exit(0) before the tests), prints a
    guessed sentinel and leaves with os._exit(0), or lets a forked copy of itself pass, fails; the
    right add passes."""
    fakes = ["    return a * b\nimport atexit, os\natexit.register(lambda: os._exit(0))",
             "    return a * b\nimport sys\nsys.exit(0)",
             "    return a * b\nimport os\nprint('PASSED', 'ok', '0' * 32, flush=True)\nos._exit(0)",
             # a forked copy passes the test for it (its nonce line carries the copy's pid)
             "    return a * b\nimport os\nif os.fork() == 0:\n    def add(a, b):\n        return a + b\n"
             "else:\n    os.wait()\n    os._exit(0)"]
    correct, failures = _pass_count([*fakes, "    return a + b"])
    assert correct == 1, failures
    assert failures == ["AssertionError", "SystemExit: 0", "exited 0 before the tests finished"]


def test_output_is_bounded_and_read_back_as_a_tail(path):
    """64 MB of stdout: the program fails at the file-size limit (1 MB here) and the evaluator holds
    its last TAIL bytes only (on main it captured all of it in memory)."""
    lim = Limits(timeout_s=20.0, cpu_s=10, memory_mb=256, file_mb=1)
    prog = "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))\n"
    tracemalloc.start()
    try:
        correct, failures = _pass_count(["    return a + b\n" + prog], lim)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert correct == 0 and failures == ["OSError: [Errno 27] File too large"], failures
    assert peak < 8 << 20, peak
    out = sandbox.run_sandboxed(prog, "", lim)
    assert not out.passed and 0 < len(out.stdout) <= sandbox.TAIL and set(out.stdout) == {"x"}


SLEEPER = """
import os, sys, time
def sleeper(name, detach):
    if os.fork():
        return
    if detach == "setsid":
        os.setsid()
    elif detach == "daemon":  # double fork, new session, no inherited output: a daemon
        os.setsid()
        if os.fork():
            os._exit(0)
        for fd in (0, 1, 2):
            os.close(fd)
    open(os.path.join(OUT, "started-" + name), "w").close()
    time.sleep(SLEEP)
    open(os.path.join(OUT, "alive-" + name), "w").close()
    os._exit(0)
"""


def _no_survivors(out: Path, names: list[str], sleep: float) -> None:
    """Every sleeper started; none wrote its file after its sleep (waits until it would have)."""
    started = [out / f"started-{n}" for n in names]
    assert all(f.is_file() for f in started), sorted(p.name for p in out.iterdir())
    time.sleep(max(0.0, max(f.stat().st_mtime for f in started) + sleep + 0.5 - time.time()))
    assert not list(out.glob("alive-*")), sorted(p.name for p in out.glob("alive-*"))


def test_forked_sleepers_die_with_the_timeout(path, tmp_path):
    """Issue 42: three forked sleepers (same group, own session, double-forked daemon) outlived a
    timeout and wrote files later; now the timeout kills them all."""
    names = ["group", "setsid", "daemon"]
    prog = (f"OUT, SLEEP = {str(tmp_path)!r}, 2.0\n" + SLEEPER
            + "".join(f"sleeper({n!r}, {n!r})\n" for n in names)
            + "while len(os.listdir(OUT)) < 3:\n    time.sleep(0.01)\ntime.sleep(100)\n")
    out = sandbox.run_sandboxed(prog, "", LIM)
    assert out.why == "timeout"
    _no_survivors(tmp_path, names, 2.0)
    if path == "subreaper":
        assert out.swept >= 2  # the setsid child and the daemon left the group: the sweep got them


def test_a_passing_program_leaves_no_process_behind(path, tmp_path):
    """Issue 42: a "passing" program left a daemon that wrote a file after the evaluation ended."""
    prog = (f"    return a + b\nOUT, SLEEP = {str(tmp_path)!r}, 1.0\n" + SLEEPER
            + "sleeper('daemon', 'daemon')\nwhile not os.listdir(OUT):\n    time.sleep(0.01)\n")
    correct, failures = _pass_count([prog], Limits(timeout_s=5.0, cpu_s=5, memory_mb=256))
    assert correct == 1, failures
    _no_survivors(tmp_path, ["daemon"], 1.0)


def test_the_network_is_out_of_reach_only_with_namespaces(path, tmp_path):
    """What each path contains: with namespaces the program has no network (not even this host's
    loopback); the subreaper path leaves the network as it is (docs/reliability.md says so)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        prog = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
        out = sandbox.run_sandboxed(prog, "", Limits(timeout_s=5.0))
    assert out.passed == (path == "subreaper"), out.why


def test_the_containment_is_recorded_and_the_fallback_can_be_forced(monkeypatch, tmp_path):
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setenv(sandbox.NAMESPACES_ENV, "0")
    res = evaluate_code([ADD], lambda prompt, n: ["    return a + b"], n=1, lim=LIM)
    assert res["containment"] == "subreaper" and res["pass@1"] == 1.0

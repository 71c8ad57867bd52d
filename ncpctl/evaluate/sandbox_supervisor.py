"""The code sandbox's supervisor: run as a script (``python -I sandbox_supervisor.py``), standard
library only, by ``ncpctl.evaluate.sandbox.run_sandboxed``; never imported by ncpctl itself.

It reads one JSON request on stdin (program, test, nonce, limits, output paths, whether to be a
subreaper), forks the program and writes one JSON status line on stdout. The program runs in the
forked child, in a session (and process group) of its own, under ``setrlimit`` limits, with stdin
from /dev/null and stdout / stderr written to two files (each bounded by the file-size limit; a
write past it fails with EFBIG instead of killing the process). The child's harness executes the
program, then the test, in one fresh ``__main__`` module and prints the nonce only when both
returned (with its own pid, so a forked copy of the program cannot print it for it); any exception, ``SystemExit`` included, is a failure (it catches ``BaseException``) and
``os._exit`` skips ``atexit`` handlers either way.

Containment, whichever way the program ends (exit, signal, the wall-clock timeout):
* the program's process group is killed (SIGKILL) before the program itself is reaped, so its
  process-group id cannot have been reused;
* then every remaining descendant: the supervisor is either the init (PID 1) of a PID namespace
  (``unshare --pid --fork --kill-child``: when it exits, the kernel kills everything left in the
  namespace) or, without namespaces, a child subreaper (``PR_SET_CHILD_SUBREAPER``): descendants
  that left the group (``setsid``, a double fork) are re-parented to it when their parents die, and
  it kills and reaps its children until none is left.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time
import traceback
import types

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _harness(req):
    """In the forked child: the program, then the test, then the nonce; never returns."""
    try:
        mod = types.ModuleType("__main__")
        mod.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"], sys.argv = mod, ["prog.py"]
        exec(compile(req["program"], "prog.py", "exec"), mod.__dict__)  # noqa: S102
        exec(compile(req["test"], "test.py", "exec"), mod.__dict__)  # noqa: S102
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, f"\n{req['nonce']} {os.getpid()}\n".encode())  # this process's: not a forked copy's
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        try:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(0)


def _child(req):
    """Between fork and the harness: own session, limits, files; only fds 0-2 stay open."""
    try:
        os.setsid()
        mem, fsize = req["memory_mb"] << 20, req["file_mb"] << 20
        resource.setrlimit(resource.RLIMIT_CPU, (req["cpu_s"], req["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # output past the limit: EFBIG, a failure it reports
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, flags, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.closerange(3, 1 << 16)  # the status pipe stays the supervisor's
    except BaseException:  # noqa: BLE001
        os._exit(3)
    _harness(req)


def _children():
    """Pids whose parent is this process (from /proc; empty where /proc is not ours)."""
    me, kids = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                kids.append(int(name))
    return kids


def _sweep(deadline):
    """Kill and reap every child (orphaned descendants become children of a subreaper) until none
    is left; returns how many were reaped."""
    n = 0
    while time.monotonic() < deadline:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid:
            n += 1
        else:
            time.sleep(0.005)
    return n


def _wait(pid, timeout_s):
    """Wait for the program without reaping it: its wait status info, or None at the timeout.
    Orphans re-parented here meanwhile are reaped as they exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return info
        other = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # an exited orphan (never the program)
        if other is not None and other.si_pid != pid:
            os.waitpid(other.si_pid, 0)
        else:
            time.sleep(0.005)
    return None


def main():
    req = json.loads(sys.stdin.read())
    if req["subreaper"]:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    pid = os.fork()
    if pid == 0:
        _child(req)
    info = _wait(pid, req["timeout_s"])
    try:
        os.killpg(pid, signal.SIGKILL)  # the program's group: it has not been reaped, so the id is still its
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    swept = _sweep(time.monotonic() + 10.0) if req["subreaper"] else 0
    res = {"timeout": info is None, "swept": swept, "pid": pid}
    if info is not None and os.WIFEXITED(status):
        res["exit"] = os.WEXITSTATUS(status)
    elif info is not None:
        res["signal"] = os.WTERMSIG(status)
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

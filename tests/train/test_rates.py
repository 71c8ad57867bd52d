"""The run's clock (``ncpctl.train.rates``, issue 46 items 1 and 6): a compiling first step is said
out loud and kept out of steps/s; a run whose steps slow far below its own first ones says so once.
The thread policy itself (``ncpctl.threads``) is measured in docs/getting-started.md, not here: it depends on
what else the machine runs."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from ncpctl.train.rates import SLOW, WINDOW, Rates


def test_a_compiling_first_step_is_announced_and_reported_apart() -> None:
    said: list[str] = []
    recipe = SimpleNamespace(train=SimpleNamespace(compile=True))
    rates = Rates.for_run(recipe, on_gpu=True, steps_left=3, info=said.append, warn=said.append)
    assert rates.compiling and "the first step traces and compiles" in said[0]
    rates.add(30.0, 10.0)  # the step's own 30 s and the diagnostics' no-grad graph's 10 s
    for s in (0.5, 0.5):
        rates.add(s)
    assert rates.compile_s == 40.0 and rates.steps == 2 and rates.steps_per_s == 2.0
    assert said[1] == "train.compile: the first step took 40.0 s, compilation included (kept out of steps/s)"
    for setting, on_gpu in ((False, True), ("auto", False)):  # off; auto on a CPU (off there)
        eager = Rates.for_run(SimpleNamespace(train=SimpleNamespace(compile=setting)), on_gpu, 3, said.append,
                              said.append)
        eager.add(40.0)
        assert len(said) == 2 and eager.compile_s is None and eager.steps == 1  # nothing said, every step counts


def test_a_run_that_slows_far_below_its_first_steps_says_so_once() -> None:
    warned: list[str] = []
    rates = Rates(warn=warned.append)
    for s in [0.1] * WINDOW + [0.1 * (SLOW - 0.5)] * WINDOW:  # slower, not far enough
        rates.add(s)
    assert warned == []
    for s in [0.1 * (SLOW + 1)] * (2 * WINDOW):
        rates.add(s)
    assert len(warned) == 1
    assert warned[0].startswith(f"steps now take {SLOW + 1:.1f}x as long as this run's first ones (0.4 s against 0.1 s)")
    assert f"on {os.cpu_count()} cores" in warned[0] and "threads on a busy machine" in warned[0]


def test_the_cli_makes_idle_threads_wait_passively_before_torch_loads() -> None:
    """``OMP_WAIT_POLICY`` is set by the time the CLI's modules are imported (torch reads it once, when
    its OpenMP runtime loads), and a value the user set is kept."""
    code = "import ncpctl.cli.app, os, sys; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.split()
    assert out == ["PASSIVE", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"}).stdout.split()
    assert out == ["ACTIVE", "False"]


def test_the_summary_reports_compilation_apart_from_the_rates() -> None:
    import io

    from rich.console import Console

    from ncpctl.train.command import human as _human

    s = {"stage": "pretrain", "interrupted": False, "step": 20, "max_steps": 20, "tokens": 1000,
         "trainable_parameters": 10, "parameters": 10, "val": {}, "steps_per_s": 4.0, "tokens_per_s": 8000.0,
         "mfu": 0.1, "steps_run": 20, "peak_flop_per_s": 100e9, "peak_source": "x", "world_size": 1,
         "nonfinite_steps": 0, "checkpoint": None, "compile_s": 52.25}
    buf = io.StringIO()
    _human(Console(file=buf, width=400, force_terminal=False), s)
    from ncpctl.model.accounting.flops import FLOP_CONVENTION_SHORT

    assert (f"4.00 steps/s, 8,000 tokens/s, MFU 10.0% (mean over 19 steps, {FLOP_CONVENTION_SHORT}) of 100 GFLOP/s "
            "(x); compilation 52.2 s (the first step, not in these rates)") in buf.getvalue()

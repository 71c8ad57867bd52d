"""Run every benchmark on this machine and write a markdown summary (issue 6).

Runs ``bench/tokenize.py``, ``bench/eval.py`` (when it exists) and ``bench/train_step.py``,
each as its own process (with ``--json`` when the script takes it; otherwise its last block
of printed ratio lines is used), one after the other (never in parallel: they would
time each other), and writes ``bench/results/summary.md`` (plus each script's JSON next to
it) with every ratio and its goal. A missing script is reported as such, a failing one with
its exit code and last error line; the others still run.

Budget: the whole run must finish in under 10 minutes on the 2-core CPU machine (``--budget``,
default 570 s). The defaults below are sized to take about 60% of that on the slower machines
of this kind (a busy 2-core EPYC: ~65 + ~190 + ~85 s) and about 40% on a quiet one, leaving
room for a machine slower still. Each script may run until the budget left minus the expected
time of the scripts after it (but at least its own expected time), so one overrunning script
cannot starve the rest. A script that is stopped keeps the ratios it had already reported (each
script prints ``bench-plan: {JSON}`` with every ratio it will measure, then ``bench-ratio:
{JSON}`` as each is measured, on stderr); the summary lists every ratio it did not reach as
"OUT OF TIME" and the run ends with exit code 1, naming the parts that ran out.

    .venv/bin/python bench/run_all.py                 # everything, summary printed at the end
    .venv/bin/python bench/run_all.py --only train_step
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

# name -> (script, extra args, expected seconds on a slow (busy 2-core EPYC) machine, what it measures)
# tokenize runs first, as it does standalone: measured right after minutes of training-step
# load its ratio vs datasets.map drops by about a tenth (1.8-1.96 vs 2.1-2.2 on a settled
# machine), while the long train_step interleaves its models and does not care what came before.
# Where the time goes (defaults before this sizing: 420 s on a quiet machine, > 573 s on a busy
# one, where eval was cut off): train_step is 3 comparisons x 2 models x (warm-up + rounds +
# profiled) steps of 3-8 s each; eval's full recompute grows with the square of its tokens and
# its loglikelihood timing with the requests (both run on one thread). Now 3 rounds and one
# profiled step (ours) for train_step; 64 requests, 384 tokens and 128 per-token decode steps
# for eval (see each script's docstring).
BENCHES: dict[str, tuple[str, list[str], float, str]] = {
    "tokenize": ("tokenize.py", ["--repeat", "3", "--no-num-proc"], 65,
                 "ncpctl tokenize vs raw encode_batch / datasets.map"),
    "train_step": ("train_step.py", ["--rounds", "3"], 190,
                   "training step: ours vs HF, ConceptLM vs PM, FLOP/s vs GEMM peak"),
    "eval": ("eval.py", [], 85, "ncpctl eval vs lm-eval's HF backend (issue #5)"),
}


DEFAULT_BUDGET_S = 570.0  # under 10 minutes, with room for start-up and the summary
MIN_START_S = 10.0  # a script is not started with less budget left than this

RATIO_LINE = re.compile(r"^(?P<name>.+?)\s+(?P<value>[-\d.]+x?)\s+goal\s+(?P<goal>.+?)\s+(?P<met>met|MET|MISSED|missed)\s*$")


def _accepts_json(script: Path, env: dict[str, str]) -> bool:
    p = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    return "--json" in p.stdout


def _text_ratios(stdout: str) -> dict[str, Any]:
    """Ratios of a script without --json: its last block of lines ("each prints its ratio last")."""
    lines = stdout.rstrip().splitlines()
    block: list[str] = []
    for line in reversed(lines):
        if not line.strip():
            break
        block.insert(0, line.strip())
    ratios: dict[str, Any] = {}
    for line in block:
        m = RATIO_LINE.match(line)
        if m:
            ratios[m["name"].strip()] = {"value": m["value"], "goal": m["goal"], "met": m["met"].lower() == "met"}
        else:
            ratios[line] = {"value": "", "goal": "-", "met": None}
    return {"ratios": ratios, "stdout_tail": lines[-30:]}


def _progress(stderr: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(planned ratios {name: goal}, measured ratios {name: {...}}) from a script's
    ``bench-plan:`` / ``bench-ratio:`` lines on stderr."""
    plan: dict[str, Any] = {}
    measured: dict[str, Any] = {}
    for line in stderr.splitlines():
        for tag, into in (("bench-plan: ", plan), ("bench-ratio: ", measured)):
            if line.startswith(tag):
                try:
                    into.update(json.loads(line[len(tag):]))
                except ValueError:
                    pass
    return plan, measured


def _run(name: str, script: Path, args: list[str], timeout: float) -> dict[str, Any]:
    """Run one script (stderr streamed through as it comes); stopped after ``timeout`` seconds,
    it keeps the ratios it had reported and names the ones it had not."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    as_json = _accepts_json(script, env)
    cmd = [sys.executable, str(script), *(["--json"] if as_json else []), *args]
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
    err: list[str] = []
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.PIPE, text=True)

        def pump() -> None:
            for line in p.stderr:
                err.append(line)
                sys.stderr.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            p.wait()
        reader.join(timeout=10)
        secs = time.perf_counter() - t0
        out.seek(0)
        stdout = out.read()
    stderr = "".join(err)
    if timed_out:
        plan, measured = _progress(stderr)
        return {"status": "timeout", "seconds": secs, "error": f"stopped after {timeout:.0f} s (suite budget)",
                "data": {"ratios": measured}, "not_measured": {k: g for k, g in plan.items() if k not in measured}}
    if p.returncode != 0:
        last = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "failed", "exit_code": p.returncode, "seconds": secs, "error": last}
    if not as_json:
        return {"status": "ok", "seconds": secs, "data": _text_ratios(stdout)}
    try:
        data = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return {"status": "failed", "exit_code": 0, "seconds": secs, "error": "no JSON on stdout"}
    return {"status": "ok", "seconds": secs, "data": data}


def _ratio_rows(name: str, data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(ratio, value, goal, met) rows from a script's ``ratios`` dict, whatever its exact keys."""
    rows = []
    for key, v in (data.get("ratios") or {}).items():
        if not isinstance(v, dict):
            rows.append((key, str(v), "", ""))
            continue
        value = v.get("value", v.get("best"))
        extra = []
        if "median" in v and "best" in v:
            extra.append(f"median {v['median']}")
        if "best_rounds" in v:
            extra.append(f"best rounds {v['best_rounds']}")
        if "shared_kernel_floor" in v:
            extra.append(f"shared-kernel floor {v['shared_kernel_floor']}")
        if "flops_ratio" in v:
            extra.append(f"FLOPs ratio {v['flops_ratio']}")
        if "hf" in v:
            extra.append(f"HF {v['hf']}")
        shown = f"{value}" + (f" ({', '.join(extra)})" if extra else "")
        goal = v.get("goal", "")
        if isinstance(goal, (int, float)) and not isinstance(goal, bool):
            goal = f">= {goal}"
        met = v.get("met")
        rows.append((key, shown, str(goal or "-"), "-" if met is None else ("MET" if met else "MISSED")))
    return rows


def summary_markdown(results: dict[str, dict[str, Any]], load: list[float], total_s: float) -> str:
    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "# ncpctl benchmark summary",
        "",
        f"{now} · {platform.node()} · {os.cpu_count()} CPU cores · Python {platform.python_version()} · "
        f"total {total_s:.0f} s · 1-min load average {' -> '.join(f'{x:.1f}' for x in load)}",
        "",
        "Generated by `bench/run_all.py`; each script's full JSON is next to this file. Timings come "
        "from a shared machine: the load average above says how quiet it was.",
        "",
        "| benchmark | ratio | value | goal | |",
        "|---|---|---|---|---|",
    ]
    for name, res in results.items():
        if res["status"] == "missing":
            lines.append(f"| {name} | - | not run: `bench/{BENCHES[name][0]}` does not exist yet | - | SKIPPED |")
            continue
        if res["status"] == "timeout":  # what it measured before the budget ran out, then what it did not
            for key, value, goal, met in _ratio_rows(name, res.get("data") or {}):
                lines.append(f"| {name} | {key} | {value} | {goal} | {met} |")
            for key, goal in (res.get("not_measured") or {}).items():
                lines.append(f"| {name} | {key} | not measured: {res['error']} | {goal} | OUT OF TIME |")
            if not res.get("not_measured"):
                lines.append(f"| {name} | - | {res['error']}; its remaining ratios were not measured | - | OUT OF TIME |")
            continue
        if res["status"] != "ok":
            lines.append(f"| {name} | - | {res['status']}: {res.get('error', '')} | - | FAILED |")
            continue
        rows = _ratio_rows(name, res["data"])
        if not rows:
            lines.append(f"| {name} | - | finished in {res['seconds']:.0f} s, no ratios reported | - | - |")
        for key, value, goal, met in rows:
            lines.append(f"| {name} | {key} | {value} | {goal} | {met} |")
    lines += ["", "Per benchmark: " + "; ".join(
        f"{n} {r['status']}" + (f" in {r['seconds']:.0f} s" if "seconds" in r else "")
        + (f" (expected ~{BENCHES[n][2]:.0f} s on a slow machine)" if n in BENCHES else "")
        for n, r in results.items()), ""]
    ran_out = out_of_time(results)
    if ran_out:
        lines += ["**Out of time:** " + "; ".join(ran_out), ""]
    return "\n".join(lines)


def out_of_time(results: dict[str, dict[str, Any]]) -> list[str]:
    """One line per benchmark the budget stopped (or never started), naming what it lost."""
    lines = []
    for name, res in results.items():
        if res["status"] != "timeout":
            continue
        missing = list(res.get("not_measured") or {})
        what = (f"{len(missing)} ratio(s) not measured: {', '.join(missing)}" if missing
                else "its ratios were not measured")
        lines.append(f"{name} ({res['error']}): {what}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for the whole suite (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--out", default=str(RESULTS), help="directory for summary.md and the JSON results")
    args = ap.parse_args(argv)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(chosen):
        script, extra, expected, _ = BENCHES[name]
        path = HERE / script
        if not path.exists():
            print(f"== {name}: bench/{script} does not exist yet: skipped", file=sys.stderr, flush=True)
            results[name] = {"status": "missing"}
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < MIN_START_S:
            results[name] = {"status": "timeout", "error": "not started: no time left in the suite budget"}
            continue
        # keep the expected time of the scripts still to come, but give this one at least its own
        later = sum(BENCHES[n][2] for n in chosen[i + 1:] if (HERE / BENCHES[n][0]).exists())
        results[name] = _run(name, path, extra, min(left, max(expected, left - later)))
        load.append(os.getloadavg()[0])
        res = results[name]
        if res["status"] == "ok":
            (out / f"{name}.json").write_text(json.dumps(res["data"], indent=2) + "\n")
        elif res["status"] == "timeout":  # the part it measured, and what it did not
            (out / f"{name}.json").write_text(json.dumps({"status": "timeout", "error": res["error"], **res["data"],
                                                          "not_measured": res["not_measured"]}, indent=2) + "\n")
    total = time.perf_counter() - t0
    md = summary_markdown(results, load, total)
    (out / "summary.md").write_text(md)
    print(md)
    print(f"written: {out / 'summary.md'}")
    for line in out_of_time(results):
        print(f"budget ran out: {line}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "missing") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

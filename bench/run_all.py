"""Run every benchmark on this machine and write a markdown summary (issue 6).

Runs ``bench/tokenize.py``, ``bench/eval.py`` (when it exists) and ``bench/train_step.py``,
each as its own process (with ``--json`` when the script takes it; otherwise its last block
of printed ratio lines is used), one after the other (never in parallel: they would
time each other), and writes ``bench/results/summary.md`` (plus each script's JSON next to
it) with every ratio and its goal. A missing script is reported as such, a failing one with
its exit code and last error line; the others still run. The whole run is budgeted to finish
in under 10 minutes on the 2-core CPU machine (``--budget``); a script that would overrun is
stopped and reported.

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
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

# name -> (script, extra args keeping the whole suite under budget on 2 cores, what it measures)
# tokenize runs first, as it does standalone: measured right after minutes of training-step
# load its ratio vs datasets.map drops by about a tenth (1.8-1.96 vs 2.1-2.2 on a settled
# machine), while the long train_step interleaves its models and does not care what came before.
BENCHES: dict[str, tuple[str, list[str], str]] = {
    "tokenize": ("tokenize.py", ["--repeat", "3", "--no-num-proc"], "ncpctl tokenize vs raw encode_batch / datasets.map"),
    "train_step": ("train_step.py", ["--rounds", "5"], "training step: ours vs HF, ConceptLM vs PM, FLOP/s vs GEMM peak"),
    "eval": ("eval.py", [], "ncpctl eval vs lm-eval's HF backend (issue #5)"),
}


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


def _run(name: str, script: Path, args: list[str], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    as_json = _accepts_json(script, env)
    cmd = [sys.executable, str(script), *(["--json"] if as_json else []), *args]
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": time.perf_counter() - t0,
                "error": f"stopped after {timeout:.0f} s (suite budget)"}
    secs = time.perf_counter() - t0
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "failed", "exit_code": p.returncode, "seconds": secs, "error": last}
    if not as_json:
        return {"status": "ok", "seconds": secs, "data": _text_ratios(p.stdout)}
    try:
        data = json.loads(p.stdout[p.stdout.index("{"):])
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
        if res["status"] != "ok":
            lines.append(f"| {name} | - | {res['status']}: {res.get('error', '')} | - | FAILED |")
            continue
        rows = _ratio_rows(name, res["data"])
        if not rows:
            lines.append(f"| {name} | - | finished in {res['seconds']:.0f} s, no ratios reported | - | - |")
        for key, value, goal, met in rows:
            lines.append(f"| {name} | {key} | {value} | {goal} | {met} |")
    lines += ["", "Per benchmark: " + "; ".join(
        f"{n} {r['status']}" + (f" in {r['seconds']:.0f} s" if "seconds" in r else "") for n, r in results.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole suite (default 570)")
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
    for name in chosen:
        script, extra, _ = BENCHES[name]
        path = HERE / script
        if not path.exists():
            print(f"== {name}: bench/{script} does not exist yet: skipped", file=sys.stderr, flush=True)
            results[name] = {"status": "missing"}
            continue
        left = args.budget - (time.perf_counter() - t0)
        if left < 10:
            results[name] = {"status": "timeout", "error": "no time left in the suite budget"}
            continue
        results[name] = _run(name, path, extra, left)
        load.append(os.getloadavg()[0])
        if results[name]["status"] == "ok":
            (out / f"{name}.json").write_text(json.dumps(results[name]["data"], indent=2) + "\n")
    total = time.perf_counter() - t0
    md = summary_markdown(results, load, total)
    (out / "summary.md").write_text(md)
    print(md)
    print(f"written: {out / 'summary.md'}")
    return 0 if all(r["status"] in ("ok", "missing") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

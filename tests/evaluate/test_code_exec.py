"""Code tasks (ncpctl.evaluate.code_exec): the unbiased pass@k estimator and sandboxed execution on a
tiny local task of made-up problems."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate.code_exec import ALLOW_ENV, Limits, evaluate_code, pass_at_k, read_problems

PROBLEMS = [
    {"task_id": "add", "prompt": "def add(a, b):\n", "test": "assert add(2, 3) == 5"},
    {"task_id": "rev", "prompt": "def rev(s):\n", "test": "assert rev('abc') == 'cba'"},
    {"task_id": "sq", "prompt": "def sq(x):\n", "test": "assert sq(4) == 16"},
]
# completions per problem: right, wrong, an endless loop, a memory blow-up
SAMPLES = {
    "def add(a, b):\n": ["    return a + b", "    return a * b", "    while True: pass", "    return a + b"],
    "def rev(s):\n": ["    return s[::-1]", "    return s", "    return s", "    x = bytearray(1 << 30)"],
    "def sq(x):\n": ["    return x", "    return x + 1", "    while True: pass", "    return x"],
}


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 2), (4, 4, 4), (7, 1, 7)])
def test_pass_at_k_is_the_chance_that_k_of_n_draws_hold_a_correct_one(n: int, c: int, k: int) -> None:
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_sandboxed_pass_at_k_on_a_tiny_task(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "tiny.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    probs = read_problems(f)
    lim = Limits(timeout_s=3.0, cpu_s=1, memory_mb=256)
    with pytest.raises(UserError, match="model-written programs"):  # no opt-in: nothing runs
        evaluate_code(probs, lambda prompt, n: SAMPLES[prompt][:n], n=4, lim=lim)
    monkeypatch.setenv(ALLOW_ENV, "1")
    res = evaluate_code(probs, lambda prompt, n: SAMPLES[prompt][:n], n=4, ks=(1, 2), lim=lim)
    correct = [r["correct"] for r in res["problems"]]
    assert correct == [2, 1, 0]  # the loop timed out / hit the CPU limit, the allocation hit RLIMIT_AS
    assert res["pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert res["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 3)
    assert any("MemoryError" in w for w in res["problems"][1]["failures"])


def test_a_problem_without_a_test_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "def f():\n"}) + "\n")
    with pytest.raises(UserError) as e:
        read_problems(f)
    assert e.value.problems == [f"{f}:1: missing field test"]


def test_code_task_through_the_cli_needs_the_opt_in(tmp_path: Path) -> None:
    """`ncpctl eval CKPT --code-task FILE`: refused (one line, exit 2) without --allow-code-execution;
    with it, every sample of the checkpoint is executed and counted (the 20-step fixture writes no
    working code: pass@1 = 0, with the failures recorded)."""
    from ..conftest import run_cli

    ckpt = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox"
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps(PROBLEMS[0]) + "\n")
    r = run_cli("eval", str(ckpt), "--code-task", str(f), "--samples", "2", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.splitlines()[0] == "error: --code-task executes model-written programs"
    r = run_cli("eval", str(ckpt), "--code-task", str(f), "--samples", "2", "--allow-code-execution",
                "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(p["n"], p["pass@1"]) for p in res["problems"]] == [(2, p["correct"] / 2) for p in res["problems"]]
    assert len(res["problems"]) == 1 and res["pass@1"] == res["problems"][0]["pass@1"]
    assert (tmp_path / f"code_{ckpt.name}.json").is_file()

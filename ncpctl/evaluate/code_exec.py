"""Code tasks: pass@k by sampling programs and executing them against the task's tests.

Executing model output runs untrusted code, so it happens only when the user opts in
(``ncpctl eval --allow-code-execution``), each program in the sandbox of ``ncpctl.evaluate.sandbox``
(limits, containment of everything it starts, a verdict a program cannot fake by exiting 0): a
guard against accidents, not a security boundary against a hostile model: run untrusted
checkpoints in a container.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex, Eq. 1): with n samples of which c
pass, pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems. lm-eval's own code metric loads
``code_eval`` from the hub, which an offline machine cannot reach.

A code task file is JSONL, one problem per line: ``prompt`` (the code the model continues),
``test`` (code that raises on failure, run after the program) and optionally ``task_id``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

from ncpctl.checkpoint import resolve, run_dir_of
from ncpctl.errors import UserError
from ncpctl.evaluate.proxy import jsonl_records
from ncpctl.fsutil import atomic_write

from .sandbox import Limits, containment, run_sandboxed

ALLOW_ENV = "NCPCTL_ALLOW_CODE_EXECUTION"  # set by --allow-code-execution for the process that runs the task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c correct (Chen et al. 2021), computed as the
    numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem (got {n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def run_program(program: str, lim: Limits = Limits(), test: str = "") -> tuple[bool, str]:
    """(passed, why) for one program and its test: it passes only when the test ran to its end
    (``sandbox.run_sandboxed``: the harness printed this run's nonce after it)."""
    if os.environ.get(ALLOW_ENV) != "1":
        raise UserError("code tasks execute model-written programs", hint="opt in with --allow-code-execution")
    res = run_sandboxed(program, test, lim)
    return res.passed, res.why


def read_problems(path: Path) -> list[dict[str, str]]:
    """The problems of a code task file; a missing field or bad line is one line each, exit 2."""
    probs: list[dict[str, str]] = []
    records, bad = jsonl_records(path)
    for i, d in records:
        miss = [k for k in ("prompt", "test") if not isinstance(d, dict) or not isinstance(d.get(k), str)]
        if miss:
            bad.append(f"{path}:{i}: missing field {', '.join(miss)}")
            continue
        probs.append({"task_id": str(d.get("task_id", i)), "prompt": d["prompt"], "test": d["test"]})
    if bad:
        raise UserError(*bad)
    return probs


def evaluate_code(problems: list[dict[str, str]], sample: Callable[[str, int], list[str]], n: int,
                  ks: tuple[int, ...] = (1,), lim: Limits = Limits()) -> dict[str, object]:
    """pass@k over ``problems``: ``sample(prompt, n)`` returns n completions; each program is the
    prompt + completion, then the problem's test, run by ``run_program``."""
    per = []
    for p in problems:
        outcomes = [run_program(p["prompt"] + c + "\n", lim, test=p["test"] + "\n") for c in sample(p["prompt"], n)]
        c = sum(ok for ok, _ in outcomes)
        per.append({"task_id": p["task_id"], "n": len(outcomes), "correct": c,
                    **{f"pass@{k}": pass_at_k(len(outcomes), c, k) for k in ks},
                    "failures": sorted({why for ok, why in outcomes if not ok})})
    return {**{f"pass@{k}": sum(r[f"pass@{k}"] for r in per) / len(per) for k in ks},
            "n": n, "problems": per, "limits": lim.__dict__, "containment": containment()[0]}


TEMPERATURE = 0.8  # NCP-ArchPreview's Table 13 gives no decoding parameters: assumed
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]  # the end of a function body, as lm-eval's humaneval


def lm_sampler(lm, max_gen_toks: int = 256, seed: int = 0) -> Callable[[str, int], list[str]]:
    """n completions of a prompt from an lm-eval LM (``NCPLM``): its ``generate_until`` with sampling
    at ``TEMPERATURE``; the n requests share their arguments, so they are drawn as one seeded batch."""
    class _Req:
        def __init__(self, prompt: str):
            self.args = (prompt, {"until": STOP, "do_sample": True, "temperature": TEMPERATURE,
                                  "max_gen_toks": max_gen_toks, "seed": seed})

    return lambda prompt, n: lm.generate_until([_Req(prompt) for _ in range(n)], disable_tqdm=True)


def run_code_task(target: str, path: str, n: int, ks: tuple[int, ...], out: str | None = None,
                  batch_size: int = 8, log: Callable[[str], None] = lambda m: None) -> dict[str, object]:
    """``ncpctl eval CKPT --code-task FILE --allow-code-execution``: pass@k of the checkpoint on a code
    task file; writes ``code_<checkpoint name>.json`` to ``out`` (default the run's ``eval/``)."""
    from ncpctl.evaluate.lm import NCPLM

    problems = read_problems(Path(path))  # before the model loads: a bad file is one line per problem
    if os.environ.get(ALLOW_ENV) != "1":
        raise UserError("--code-task executes model-written programs", hint="opt in with --allow-code-execution")
    if max(ks) > n:
        raise UserError(f"pass@{max(ks)} needs at least {max(ks)} samples per problem (--samples {n})")
    ck = resolve(Path(target))
    log(f"{path}: {len(problems)} problems x {n} samples at temperature {TEMPERATURE} on {ck}")
    res = evaluate_code(problems, lm_sampler(NCPLM(str(ck), batch_size=batch_size)), n, ks)
    res.update(checkpoint=str(ck), task=str(path), temperature=TEMPERATURE)
    out_dir = Path(out) if out else (run_dir_of(ck) or ck) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / f"code_{ck.name}.json", json.dumps(res, indent=2) + "\n")
    res["file"] = str(out_dir / f"code_{ck.name}.json")
    return res

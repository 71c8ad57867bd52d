"""What an evaluation was run with, as lm-eval users set it (issue 47 item 3; issue 41 item 6).

* ``--seed``: lm-eval's four seeds, Python's ``random``, numpy, torch and the few-shot sampler, as
  lm-eval's own ``--seed`` takes them: one integer for all four, or four comma-separated values
  (``None`` leaves that one unset); default lm-eval's ``0,1234,1234,1234``.
* ``--gen-kwargs``: generation settings of the generation tasks (``generate_until``), merged into
  each task's own ``generation_kwargs`` as lm-eval does: ``temperature=0.8,top_p=0.95,do_sample=true``
  or a JSON object (``{"until": ["\\n\\n"], "max_gen_toks": 64}``: stop strings hold commas). The keys
  ``ncpctl.evaluate.lm.NCPLM`` reads (``GEN_KEYS``); any other is an error naming it. As with
  lm-eval's Hugging Face model, a temperature samples only with ``do_sample=true``.
* ``--limit``: examples per task, or a fraction of each task's examples when below 1 (lm-eval's
  rule: ``ceil(fraction x examples)``).

Each task's record in the results (``scored``: ``ncpctl.evaluate.accumulate``) says when it was
scored and with what: the shots it actually used, its examples, the seeds, the generation settings
(generation tasks), the limit and batch size; ``--compare`` flags runs whose settings differ
(``differences``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ncpctl.errors import UserError

DEFAULT_SEED = (0, 1234, 1234, 1234)  # lm-eval's defaults: random, numpy, torch, few-shot
# what NCPLM.generate_until reads from a task's generation_kwargs (lm-eval's names)
GEN_KEYS = ("until", "do_sample", "temperature", "top_p", "top_k", "max_gen_toks", "seed")


def parse_seed(text: str | None) -> tuple[int | None, ...]:
    """lm-eval's ``--seed``: ``N`` (all four) or ``R,N,T,F`` (``None`` leaves one unset)."""
    if text is None:
        return DEFAULT_SEED
    parts = [p.strip() for p in str(text).split(",")]
    try:
        vals = tuple(None if p == "None" else int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) == 1 and vals[0] is not None:
        return vals * 4
    if len(vals) != 4:
        raise UserError(f"--seed {text!r}: expected one integer or four comma-separated values "
                        "(random, numpy, torch, few-shot; an integer or None each)", hint="e.g. --seed 42 or "
                        "--seed 0,1234,1234,1234 (lm-eval's default)")
    return vals


def _value(v: str) -> Any:
    """lm-eval's ``k=v`` values: true/false, integers, floats, else the string."""
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def parse_gen_kwargs(text: str | None) -> dict[str, Any] | None:
    """``k=v,k=v`` (lm-eval's syntax) or a JSON object; every key one NCPLM reads."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if text.startswith("{"):
        try:
            kw = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--gen-kwargs: not a JSON object ({e.msg} at character {e.pos})") from None
        if not isinstance(kw, dict):
            raise UserError("--gen-kwargs: expected a JSON object")
    else:
        pairs = [p for p in text.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p]
        if bad:
            raise UserError(f"--gen-kwargs: {bad[0]!r} is not KEY=VALUE",
                            hint="e.g. --gen-kwargs temperature=0.8,do_sample=true; stop strings: a JSON object")
        kw = {k.strip(): _value(v.strip()) for k, v in (p.split("=", 1) for p in pairs)}
    unknown = [k for k in kw if k not in GEN_KEYS]
    if unknown:
        raise UserError(*(f"--gen-kwargs: unknown key {k!r}" for k in unknown),
                        hint=f"generation settings: {', '.join(GEN_KEYS)}")
    return kw


def parse_limit(v: float | int | None) -> int | float | None:
    """An example count (an integer >= 1) or a fraction of each task (0 < v < 1)."""
    if v is None:
        return None
    if not math.isfinite(v) or v <= 0:
        raise UserError(f"--limit {v:g}: expected a number of examples (>= 1) or a fraction (0 < f < 1)")
    if v >= 1:
        if v != int(v):
            raise UserError(f"--limit {v:g}: a limit of 1 or more counts examples (a whole number); "
                            "a fraction of each task is below 1")
        return int(v)
    return float(v)


def task_settings(res: dict[str, Any], request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: settings} for every task and group of lm-eval's results ``res``: the shots it used
    (lm-eval's ``n-shot``, after our override), its examples (``n-samples``), and from the request the
    limit, batch size, seeds and, for a generation task, its effective ``generation_kwargs``."""
    shots, counts, configs = res.get("n-shot") or {}, res.get("n-samples") or {}, res.get("configs") or {}
    out = {}
    for task in [*res.get("results", {}), *res.get("groups", {})]:
        cfg = configs.get(task) or {}
        s: dict[str, Any] = {"num_fewshot": shots.get(task), "limit": request.get("limit"),
                             "examples": (counts.get(task) or {}).get("effective"),
                             "batch_size": request.get("batch_size"), "seed": request.get("seed")}
        if cfg.get("output_type") == "generate_until":
            s["generation_kwargs"] = cfg.get("generation_kwargs")
        if request.get("diffusion_samples") is not None:
            s["diffusion_samples"] = request["diffusion_samples"]
        out[task] = s
    return out


COMPARED = (("num_fewshot", "shots"), ("limit", "limits"), ("seed", "seeds"),
            ("generation_kwargs", "generation settings"), ("diffusion_samples", "Monte Carlo samples"))


def _settings_of(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A results file's per-task settings (``scored``; older files: their request for every task)."""
    scored = res.get("scored")
    if isinstance(scored, dict) and scored:
        return {t: s.get("settings") or {} for t, s in scored.items()}
    req = res.get("request") or {}
    shots = res.get("n-shot") or {}
    return {t: {"limit": req.get("limit"), "num_fewshot": shots.get(t, req.get("num_fewshot"))}
            for t in res.get("results") or {}}


def differences(labels: list[str], results: list[dict[str, Any]]) -> list[str]:
    """One note per setting that differs between the runs on a task they share: which tasks, and
    each run's value (shots, limits, seeds, generation settings, Monte Carlo samples)."""
    per_run = [_settings_of(r) for r in results]
    notes = []
    for key, name in COMPARED:
        tasks: dict[str, list[Any]] = {}
        for task in dict.fromkeys(t for s in per_run for t in s):
            if sum(task in s for s in per_run) < 2:
                continue
            vals = [s[task].get(key) if task in s else "-" for s in per_run]
            shown = [json.dumps(v, sort_keys=True) for v in vals if v != "-"]
            if len(set(shown)) > 1:
                tasks[task] = vals
        if not tasks:
            continue
        by_values: dict[str, list[str]] = {}
        for task, vals in tasks.items():
            text = ", ".join(f"{lab} {_show(v)}" for lab, v in zip(labels, vals) if v != "-")
            by_values.setdefault(text, []).append(task)
        notes += [f"evaluated with different {name}: {', '.join(ts)} ({text})" for text, ts in by_values.items()]
    return notes


def _show(v: Any) -> str:
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    return str(v)

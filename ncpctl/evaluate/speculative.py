"""``ncpctl eval --speculative DRAFTER``: mean accepted length (MAL, NCP-ArchPreview Eq. 27) and
acceptance statistics of a drafter on a checkpoint, per task of a prompt set.

MAL = R^-1 sum_r c_r, c_r the tokens a verification round commits, the target's correction or bonus
token included (so 1 <= c_r <= horizon + 1); counted per row and round (``speculative.SpecStats``).
Decoding is greedy (exact: the tokens are the target's own greedy ones), drafting ``horizon`` tokens
a round (the report: 16; a drafter proposes at most its own K, and the output's ``horizon`` is the
K it drafted, with ``horizon_requested`` where that cut the flag's). The report's baseline selects among
its top-16 paths per position (tree verification); ncpctl verifies one chain, which accepts at most
what the best path would: compare MALs across the two with that in mind.

Prompt sets: a JSONL of {"prompt": TEXT, "task": NAME} (task optional: "prompts"), or by default the
checkpoint's validation split (``task: val``): ``prompt_tokens`` tokens from every 256 of each
document, in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError


def prompt_sets(loaded, path: str | None, limit: int, prompt_tokens: int,
                stride: int = 256) -> dict[str, list[list[int]]]:
    """task -> prompts (token ids), at most ``limit`` per task (the validation split: the first
    ``prompt_tokens`` tokens of every ``stride`` tokens of each document, so a continuation of the
    data follows each prompt)."""
    if path is None:
        from ncpctl.data.indexed import IndexedDataset
        from ncpctl.evaluate.offline import validation_prefix

        prefix, _ = validation_prefix(str(loaded.path))
        ds = IndexedDataset(prefix)
        val = []
        for i in range(len(ds)):
            d = ds[i].tolist()
            val += [d[s : s + prompt_tokens] for s in range(0, len(d) - prompt_tokens, stride)]
            if len(val) >= limit:
                break
        if not val:
            raise UserError(f"{prefix}: no validation document is longer than the {prompt_tokens}-token prompts "
                            "drawn from it", hint="give the prompts as JSON lines with --prompts FILE.jsonl")
        return {"val": val[:limit]}
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.path}: no tokenizer.json to encode the prompts of {path}")
    sets: dict[str, list[list[int]]] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read the prompt set ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, task = row["prompt"], row.get("task", "prompts")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{path}:{n}: expected a JSON object with a \"prompt\" (and optionally \"task\")") from None
        if not isinstance(text, str) or not isinstance(task, (str, int)) or isinstance(task, bool):
            raise UserError(f"{path}:{n}: \"prompt\" must be a string and \"task\" a name, got "
                            f"{type(text).__name__} and {type(task).__name__}")
        task = str(task)
        ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
        if ids and len(sets.setdefault(task, [])) < limit:
            sets[task].append(ids)
    if not sets:
        raise UserError(f"{path}: no non-empty prompt")
    return sets


def speculative_mal(target: str, draft: str, *, horizon: int = 16, prompts: str | None = None, limit: int = 32,
                    prompt_tokens: int = 64, new_tokens: int = 64, batch_size: int = 1,
                    log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """MAL and acceptance of drafter ``draft`` (a drafter checkpoint, an ncpctl model or ``mtp``) on
    checkpoint ``target``, per task and over all tasks (rounds pooled)."""
    import torch

    from ncpctl.inference.drafters import load_speculative
    from ncpctl.inference.generate import SamplingParams, eod_token, generate
    from ncpctl.inference.speculative import SpecStats

    if horizon < 1:
        raise UserError(f"--horizon must be >= 1, got {horizon}")
    loaded = load_model(target)
    spec, info = load_speculative(loaded, draft, horizon)
    asked = info.pop("draft_tokens_requested", None)
    info.pop("draft_tokens")  # the horizon: the K drafted a round, as the drafter allows it
    if asked is not None:
        log(f"note: --horizon {asked} is more than the drafter proposes: {spec.k} a round")
    sets = prompt_sets(loaded, prompts, limit, prompt_tokens)
    _, eod = eod_token(loaded)
    decode = (lambda ids: loaded.tokenizer.decode(ids)) if loaded.tokenizer is not None else (lambda ids: "")
    params = SamplingParams(max_new_tokens=new_tokens, greedy=True)
    tasks, total = {}, SpecStats()
    with torch.no_grad():
        for task, ps in sets.items():
            spec.stats = SpecStats()
            for i in range(0, len(ps), batch_size):
                generate(loaded.model, ps[i : i + batch_size], params, decode, eod_id=eod,
                         vocab_size=loaded.config.vocab_size, max_len=loaded.config.max_seq_len, speculative=spec)
            tasks[task] = {"prompts": len(ps), **spec.stats.as_dict()}
            total.merge(spec.stats)
            log(f"{task}: MAL {_fmt(tasks[task]['mal'])} over {tasks[task]['rounds']} rounds")
    return {"checkpoint": str(loaded.path), **info, "horizon": spec.k,
            **({"horizon_requested": asked} if asked else {}), "greedy": True, "new_tokens": new_tokens,
            "prompt_set": prompts or "val", "tasks": tasks, "all": total.as_dict(),
            # the mean over tasks (Table 9's macro average); a task with no round (1 new token) has no MAL
            "macro_mal": _mean([t["mal"] for t in tasks.values() if t["mal"] is not None]),
            "verification": "one chain (the report's baseline selects among top-16 paths)"}


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def rich_table(payload: dict[str, Any]):
    from rich.table import Table

    asked = f", --horizon {payload['horizon_requested']} cut to the drafter's" if "horizon_requested" in payload else ""
    t = Table(title=f"speculative decoding: {payload['draft']} on {payload['checkpoint']} "
              f"(horizon {payload['horizon']}{asked}, greedy, one chain)")
    for col in ("task", "prompts", "rounds", "MAL", "acceptance"):
        t.add_column(col, justify="left" if col == "task" else "right")
    for name, r in payload["tasks"].items():
        t.add_row(name, str(r["prompts"]), str(r["rounds"]), _fmt(r["mal"]), _fmt(r["acceptance"]))
    a = payload["all"]
    t.add_row("all (pooled rounds)", "", str(a["rounds"]), _fmt(a["mal"]), _fmt(a["acceptance"]))
    t.add_row("macro (mean over tasks)", "", "", _fmt(payload["macro_mal"]), "")
    return t

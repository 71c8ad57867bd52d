"""Reading prompts for ``ncpctl generate --prompts-file``: one per line, or JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

from ncpctl.errors import UserError


def read_prompts(path: str | Path) -> list[str]:
    """``.jsonl`` (or any file whose lines all parse as JSON): ``{"prompt": ...}`` objects or
    JSON strings; otherwise each non-empty line is a prompt (``\\n`` escapes are not expanded)."""
    return [p for p, _ in read_prompt_records(path)]


def read_prompt_records(path: str | Path) -> list[tuple[str, object | None]]:
    """As ``read_prompts``, with each JSON object's ``steer`` value (a steering spec: inline text,
    a mapping, or a list of them; ``ncpctl generate``), None where there is none."""
    p = Path(path)
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise UserError(f"{p}: cannot read prompts ({e.strerror or e})") from None
    if not lines:
        raise UserError(f"{p}: no prompts (empty file)")
    parsed = []
    for ln in lines:
        try:
            parsed.append(json.loads(ln))
        except json.JSONDecodeError:
            if p.suffix == ".jsonl":
                raise UserError(f"{p}: line {lines.index(ln) + 1} is not JSON") from None
            return [(x, None) for x in lines]
    out = []
    for i, obj in enumerate(parsed, 1):
        if isinstance(obj, str):
            out.append((obj, None))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            out.append((obj["prompt"], obj.get("steer")))
        elif p.suffix == ".jsonl":
            raise UserError(f"{p}: line {i}: expected a string or an object with a \"prompt\" string")
        else:
            return [(ln, None) for ln in lines]
    return out

"""A command's output, for the library functions the CLI calls and for the CLI itself.

Output contract: human-readable progress and messages go to stderr; the command's result goes to
stdout — as one JSON object with ``--json``, as a human summary otherwise — so
``ncpctl tokenize r.yaml --json | jq .tokens.train`` works in CI pipelines. A command's library
entry point takes an ``Output`` and reports through it (as ``train(recipe, stage, out)`` does).
This module must stay light: ``ncpctl --help`` may not import torch or DeepSpeed.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable


class Output:
    """stderr console for humans; ``result()`` for the one stdout result."""

    def __init__(self, json_mode: bool):
        from rich.console import Console

        self.json = json_mode
        self.err = Console(stderr=True, highlight=False)
        self.err.soft_wrap = not self.err.is_terminal  # a log file (nohup, Slurm, | tee): one line per message
        self.out = Console(highlight=False, soft_wrap=True)

    def info(self, msg: str) -> None:
        self.err.print(msg)

    def warn(self, msg: str) -> None:
        self.err.print(f"[yellow]warning:[/] {msg}")

    def result(self, data: dict[str, Any], human: Callable[[Any], None] | None = None) -> None:
        if self.json:
            sys.stdout.write(json.dumps({"ok": True, **data}, default=str) + "\n")
            sys.stdout.flush()
        elif human is not None:
            human(self.out)

    def log(self, msg: str) -> None:
        """A dim progress line; ``msg`` is escaped (a skipped task's error may hold [brackets])."""
        from rich.markup import escape

        self.info(f"[dim]{escape(msg)}[/]")


def print_wide(con: Any, renderable: Any) -> None:
    """Print a table whole: piped or redirected, a table would be squeezed to the console's width
    (the terminal's that stdin or stderr still is, or 80 columns) and its names cut; there it gets
    the width it needs. rich caps both a measurement and ``print(width=)`` at the console's width,
    so the table is measured against an unbounded width and printed with the console widened."""
    if con.is_terminal:
        con.print(renderable)
        return
    from rich.measure import Measurement

    width = con.width
    con.width = max(width, Measurement.get(con, con.options.update_width(1 << 16), renderable).maximum)
    try:
        con.print(renderable)
    finally:
        con.width = width

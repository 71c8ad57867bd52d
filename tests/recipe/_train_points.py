"""Run several ``ncpctl pretrain`` invocations in one process (one torch/DeepSpeed import instead
of one per run): the real typer app, with the command line ``ncpctl pretrain RECIPE --json ARGS``.

Reads a JSON list of ``{"name": ..., "args": [...]}`` on stdin; after each run prints one line
``{"point": name, "exit_code": N}`` on stdout, right after that run's own ``--json`` result.
Used by tests/recipe/test_paper_recipes.py (two training steps per ablation recipe).
"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> None:
    from ncpctl.cli.app import app

    for point in json.load(sys.stdin):
        try:
            code = app(prog_name="ncpctl", args=["pretrain", *point["args"]], standalone_mode=False)
        except BaseException:  # noqa: BLE001 - report it as this point's failure and go on
            traceback.print_exc()
            code = 1
        sys.stdout.write(json.dumps({"point": point["name"], "exit_code": code or 0}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

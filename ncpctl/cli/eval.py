"""`ncpctl eval`: evaluation through lm-evaluation-harness (delivered by issue #5)."""

from __future__ import annotations

from typing import Annotated

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, SetOpt, command, not_yet


@command
def main(
    target: Annotated[str, typer.Argument(help="Checkpoint directory or recipe YAML.", show_default=False)],
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Evaluate a checkpoint with lm-evaluation-harness (not implemented yet: issue #5)."""
    not_yet("eval", 5, "evaluation through lm-evaluation-harness", json_out)

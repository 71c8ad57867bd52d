"""`ncpctl generate`: sampling from a checkpoint (delivered by issue #5)."""

from __future__ import annotations

from typing import Annotated

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, SetOpt, command, not_yet


@command
def main(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint directory.", show_default=False)],
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text from a checkpoint (not implemented yet: issue #5)."""
    not_yet("generate", 5, "sampling from a checkpoint", json_out)

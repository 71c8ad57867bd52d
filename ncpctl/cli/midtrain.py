"""`ncpctl midtrain`: continued training from a checkpoint (delivered by issue #4)."""

from __future__ import annotations

from typing import Annotated

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, SetOpt, command, not_yet


@command
def main(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file.", show_default=False)],
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Continue training from a checkpoint with a new data mix (not implemented yet: issue #4)."""
    not_yet("midtrain", 4, "continued training from a checkpoint", json_out)

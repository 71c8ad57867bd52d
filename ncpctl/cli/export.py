"""`ncpctl export`: Hugging Face export (delivered by issue #5)."""

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
    """Export a checkpoint as a Hugging Face directory (not implemented yet: issue #5)."""
    not_yet("export", 5, "Hugging Face export", json_out)

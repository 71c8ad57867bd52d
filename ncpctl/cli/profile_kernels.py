"""`ncpctl profile-kernels`: accounting, kernel timings and traces (delivered by issue #6)."""

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
    """Profile FLOPs, kernels and a training step for a recipe (not implemented yet: issue #6)."""
    not_yet("profile-kernels", 6, "accounting, kernel timings and traces", json_out)

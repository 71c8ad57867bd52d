"""`ncpctl pretrain`: training on DeepSpeed ZeRO (delivered by issue #4)."""

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
    """Pretrain a model from a recipe (not implemented yet: issue #4)."""
    not_yet("pretrain", 4, "training on DeepSpeed ZeRO", json_out)

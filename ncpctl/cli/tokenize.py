"""`ncpctl tokenize RECIPE`: corpus -> BPE tokenizer -> Megatron indexed datasets."""

from __future__ import annotations

from typing import Annotated

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, RecipeArg, SetOpt, command


@command
def main(
    recipe: RecipeArg,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Re-tokenize even if the inputs are unchanged.")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Tokenize the recipe's corpus into run.dir/data (train/val .bin+.idx, tokenizer.json, meta.json).

    Re-running with unchanged inputs is a no-op; an interrupted run leaves no partial dataset.
    """
    from ncpctl.data.tokenize_command import TokenizeRequest, run_tokenize

    run_tokenize(TokenizeRequest(recipe, set_ or [], force=force), Output(json_out))

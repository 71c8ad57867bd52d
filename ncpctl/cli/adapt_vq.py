"""`ncpctl adapt-vq RECIPE`: adapt the codebook and concept heads to new data."""

from __future__ import annotations

from ncpctl.cli._common import BreakLockOpt, DebugOpt, JsonOpt, NoVerifyOpt, Output, RecipeArg, SetOpt, StrategyOpt, command


@command
def main(recipe: RecipeArg, set_: SetOpt = None, json_out: JsonOpt = False, debug: DebugOpt = False,
         strategies: StrategyOpt = None, break_lock: BreakLockOpt = False,
         no_verify: NoVerifyOpt = False) -> None:
    """Adapt the codebook and concept heads to this recipe's data; all else stays frozen.

    Starts from `train.init_from` (NCP-ArchPreview §5.1). The codebook's trained part is its codes
    (`codebook: learned`) or its SimVQ transform; frozen weights stay bit-identical.
    """
    from ncpctl.train.command import StageRequest, run_stage

    run_stage(StageRequest("adapt-vq", recipe, set_ or [], break_lock=break_lock, verify=not no_verify), Output(json_out))

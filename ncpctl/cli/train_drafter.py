"""`ncpctl train-drafter RECIPE`: train a block-parallel drafter against a frozen target."""

from __future__ import annotations

from ncpctl.cli._common import BreakLockOpt, DebugOpt, JsonOpt, NoVerifyOpt, Output, RecipeArg, SetOpt, StrategyOpt, command


@command
def main(recipe: RecipeArg, set_: SetOpt = None, json_out: JsonOpt = False, debug: DebugOpt = False,
         strategies: StrategyOpt = None, break_lock: BreakLockOpt = False,
         no_verify: NoVerifyOpt = False) -> None:
    """Train `train.drafter` (NCP-ArchPreview Sec. 5.3) against the frozen target `train.init_from`.

    The target's weights never change; checkpoints hold the drafter and name its target, so
    `ncpctl generate --draft CKPT` and `ncpctl eval --speculative CKPT` take them directly.
    """
    from ncpctl.train.command import StageRequest, run_stage

    run_stage(StageRequest("train-drafter", recipe, set_ or [], break_lock=break_lock, verify=not no_verify), Output(json_out))

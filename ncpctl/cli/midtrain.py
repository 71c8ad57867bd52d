"""`ncpctl midtrain RECIPE`: continue from a checkpoint with a new data mix and schedule."""

from __future__ import annotations

from ncpctl.cli._common import BreakLockOpt, DebugOpt, JsonOpt, NoVerifyOpt, Output, RecipeArg, SetOpt, StrategyOpt, command


@command
def main(recipe: RecipeArg, set_: SetOpt = None, json_out: JsonOpt = False, debug: DebugOpt = False,
         strategies: StrategyOpt = None, break_lock: BreakLockOpt = False,
         no_verify: NoVerifyOpt = False) -> None:
    """Continue from `train.init_from` (an ncpctl checkpoint or HF directory) with this recipe's data and schedule.

    `train.load: weights` starts a fresh optimizer; `all` also loads the checkpoint's optimizer state.
    """
    from ncpctl.train.command import StageRequest, run_stage

    run_stage(StageRequest("midtrain", recipe, set_ or [], break_lock=break_lock, verify=not no_verify), Output(json_out))

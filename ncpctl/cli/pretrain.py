"""`ncpctl pretrain RECIPE`: train a model from scratch on DeepSpeed ZeRO."""

from __future__ import annotations

from ncpctl.cli._common import BreakLockOpt, DebugOpt, JsonOpt, NoVerifyOpt, Output, RecipeArg, SetOpt, command


@command
def main(recipe: RecipeArg, set_: SetOpt = None, json_out: JsonOpt = False, debug: DebugOpt = False,
         break_lock: BreakLockOpt = False, no_verify: NoVerifyOpt = False) -> None:
    """Pretrain a model from a recipe on DeepSpeed ZeRO (checkpoints in run.dir/checkpoints).

    Several GPUs or nodes: the same command under the launcher, `deepspeed --num_gpus 8 $(which ncpctl) pretrain RECIPE`.

    `train.resume: auto` continues from the newest complete checkpoint; SIGINT/SIGTERM save and exit.
    """
    from ncpctl.train.command import StageRequest, run_stage

    run_stage(StageRequest("pretrain", recipe, set_ or [], break_lock=break_lock, verify=not no_verify), Output(json_out))

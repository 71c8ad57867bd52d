"""`ncpctl profile-kernels RECIPE`: where every FLOP and second goes (issue #6).

Parses options and calls ``ncpctl.profile.command.run_profile`` (which loads the recipe: data and
tokenizer files are not needed, see ``ncpctl.profile.load``).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, RecipeArg, SetOpt, command


@command
def main(
    recipe: RecipeArg,
    set_: SetOpt = None,
    only: Annotated[Optional[str], typer.Option(
        "--only", metavar="SECTIONS",
        help="Comma-separated sections to run: accounting, kernels, step, trace, ops (default: all but ops; "
             "ops counts the operators a training and a decode step launch, on CPU models of the recipe's "
             "shape: shrink a large model's width with --set, the count does not depend on it).")] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Write PNGs (kernel time vs sequence length) to run.dir/profile.")] = False,
    repeats: Annotated[Optional[int], typer.Option(
        "--repeats", min=1, help="Timed repeats per kernel / step (default: 5 / 3 on CPU, 20 / 10 on GPU).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smallest grid, one repeat: a smoke run.")] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present).")] = None,
    realised_ratio: Annotated[Optional[float], typer.Option(
        "--realised-ratio", metavar="TOKENS_PER_CONCEPT",
        help="Accounting of a dynamic segmentation (DLCM) at this measured tokens per concept (validation's "
             "tokens_per_concept) instead of the target model.concept.target_ratio; parameters do not change.")] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Profile a recipe's model: parameters and FLOPs (paper and exact view, vs its base and
    PM siblings), kernel micro-benchmarks (token vs concept layer, SDPA backends, concept path,
    DLCM cross-attention), one training step's FLOP/s vs peak, and a torch.profiler trace.

    Results go to run.dir/profile (trace.json, PNGs with --plot); tables to stdout, or one
    JSON object with --json.
    """
    from ncpctl.profile.command import ProfileRequest, run_profile

    run_profile(ProfileRequest(recipe, set_ or [], only=only, plot=plot, repeats=repeats, quick=quick, device=device,
                               realised_ratio=realised_ratio), Output(json_out))

"""`ncpctl profile-kernels RECIPE`: where every FLOP and second goes (issue #6).

Parses options, loads the recipe (data and tokenizer files are not needed: see
``ncpctl.profile.load``) and calls ``ncpctl.profile.run.profile``.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, RecipeArg, SetOpt, command

SECTIONS = ("accounting", "kernels", "step", "trace", "ops")  # = ncpctl.profile.SECTIONS (no torch import here)
DEFAULT_SECTIONS = SECTIONS[:4]


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
    from ncpctl.errors import UserError

    out = Output(json_out)
    sections = list(DEFAULT_SECTIONS)
    if only:
        sections = [s.strip() for s in only.split(",") if s.strip()]
        bad = [s for s in sections if s not in SECTIONS]
        if bad or not sections:
            raise UserError(f"--only: unknown section(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SECTIONS)}")

    from ncpctl.profile.load import load_for_profile

    r, notes = load_for_profile(recipe, set_ or [])
    for note in notes:
        out.warn(note)

    law = r.model_config.law
    if realised_ratio is not None and not (law is not None and law.variable_length):
        raise UserError("--realised-ratio: the recipe's model has no dynamic segmentation",
                        hint="it applies to a segmentation whose segment lengths depend on the data, such as "
                             "model.concept.segmentation: dynamic (DLCM); fixed blocks have k")
    if realised_ratio is not None and not realised_ratio > 1:
        raise UserError(f"--realised-ratio: must be > 1 (tokens per concept), got {realised_ratio:g}")

    from ncpctl.profile.run import profile

    if device is not None:
        import torch

        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise UserError(f"--device: {device}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device: {device}: no CUDA device here", hint="use --device cpu")
    res = profile(r, sections, device=device, repeats=repeats, quick=quick, plot=plot,
                  realised_ratio=realised_ratio, log=lambda msg: out.info(f"[dim]{msg}[/]"))
    res["notes"] = notes

    def human(con) -> None:
        from ncpctl.profile.render import render

        render(con, res)

    out.result({"command": "profile-kernels", **res}, human)

"""The options of ``ncpctl inspect --generate N`` and ``--find-concept`` (the work:
``ncpctl.inference.inspect_command.generated``, ``ncpctl.interpret.report.find_concept``): the parts of ``inspect`` that Steerling's
notebooks do on a Causal Diffusion LM (library: ``ncpctl.interpret.trace`` and
``ncpctl.interpret.concept_table``). ``--generate`` samples each prompt block by block and explains
every generated token in the state in which it was committed (per-token logit contribution and
concept attribution, chunk-level attribution, and with ``--attribute-inputs`` input attribution);
``--find-concept`` searches a ``--concept-table`` by name and shows what each hit promotes."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

GenerateOpt = Annotated[Optional[int], typer.Option(
    "--generate", min=1, help="A Causal Diffusion LM: generate N tokens from each prompt (block by block) and explain "
    "each in the state in which it was committed: its logit as known + unknown + residual, its top concepts, "
    "chunk-level concept attribution, and with --attribute-inputs its inputs (integrated gradients from [MASK]). "
    "Sampling: --seed, --temperature, --steps-per-block, --steer (as generate).", show_default=False)]
FindOpt = Annotated[Optional[str], typer.Option(
    "--find-concept", help="Search the --concept-table for known concepts by name and description (words weigh "
    "3x in the name) and show the tokens each promotes in this checkpoint.", show_default=False)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="With --generate: the sampling seed.",
                                                show_default=False)]
TemperatureOpt = Annotated[float, typer.Option("--temperature", min=0.0, help="With --generate: 0 = greedy.")]
StepsOpt = Annotated[Optional[int], typer.Option("--steps-per-block", min=1, help="With --generate: denoising steps "
                                                 "per block (default: the block size).", show_default=False)]
SteerOpt = Annotated[Optional[list[str]], typer.Option("--steer", help="With --generate: steer the generation "
                                                       "(generate --steer's specs; repeatable).", show_default=False)]

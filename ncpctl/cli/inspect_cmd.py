"""`ncpctl inspect`: a checkpoint's concepts, read (decomposition), attributed (ablation) and
summarised over a corpus (code dictionaries); ``--attribute-inputs``: one output attributed to the
prompt's tokens against the [MASK] baseline. The work: ``ncpctl.inference.inspect_command`` (the CLI parses and
calls ``inspect_checkpoint``), whose reports are ``ncpctl.interpret.report``'s."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import ConceptTableOpt, DebugOpt, JsonOpt, Output, SetOpt, StrategyOpt, TiktokenOpt, command
from ncpctl.cli.inspect_generated import FindOpt, GenerateOpt, SeedOpt, SteerOpt, StepsOpt, TemperatureOpt

TopOpt = Annotated[Optional[int], typer.Option("--top", min=1, help="Codes shown per segment (the rest as a "
                                               "remainder; default 3); --attribute-inputs: inputs shown (default 10).",
                                               show_default=False)]
# --attribute-inputs (issue 23 item 6; library: ncpctl.interpret.inputs)
AttributeOpt = Annotated[bool, typer.Option(
    "--attribute-inputs", help="Attribute one output to the prompt's tokens: occlusion by the [MASK] token (the "
    "CDLM's in-distribution 'absent') and integrated gradients from the [MASK] embedding. The output: the target's "
    "first token's logit (default: the argmax) at the first [MASK] after the prompt (CDLM) or at the prompt's last "
    "position (autoregressive), or --concept's score.")]
ConceptOpt = Annotated[Optional[str], typer.Option(
    "--concept", help="With --attribute-inputs: attribute this known concept's logit (a concept bottleneck "
    "checkpoint; its name, or #N) f(h)_c, summed over the output block's [MASK] positions (CDLM) or at the prompt's "
    "last position (autoregressive).", show_default=False)]
UnitOpt = Annotated[Optional[str], typer.Option(
    "--unit", help="With --attribute-inputs: occlude each token (token, the default) or whole blocks (block).",
    show_default=False)]
BlockTokensOpt = Annotated[Optional[int], typer.Option(
    "--block-tokens", min=1, help="With --unit block: tokens per block, aligned to positions (default: the CDLM's "
    "diffusion block size, else 16).", show_default=False)]
IgStepsOpt = Annotated[Optional[int], typer.Option(
    "--ig-steps", min=0, help="With --attribute-inputs: integrated-gradients path points (default 16; 0: none).",
    show_default=False)]
BaselineOpt = Annotated[Optional[str], typer.Option(
    "--baseline", help="With --attribute-inputs: the token that stands for 'absent' (its exact text in the "
    "tokenizer). Default: the CDLM's [MASK]; an autoregressive checkpoint has none and needs this.",
    show_default=False)]


@command
def main(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint or run directory.", show_default=False)],
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeatable).",
                                                        show_default=False)] = None,
    prompts_file: Annotated[Optional[str], typer.Option("--prompts-file", help="One prompt per line, or JSON lines.",
                                                        show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="A continuation of the prompt: rank the "
                                                  "codes (and segments) by how much removing each changes its "
                                                  "log-probability.", show_default=False)] = None,
    top: TopOpt = None,
    ablate_codes: Annotated[int, typer.Option("--ablate-codes", min=0, help="With --target: the heaviest codes of "
                                              "each segment ablated one by one (each segment whole too).")] = 3,
    corpus: Annotated[Optional[list[str]], typer.Option("--corpus", help="Build code dictionaries over this "
                                                        "source (data.sources syntax, e.g. builtin:python-stdlib; "
                                                        "repeatable).", show_default=False)] = None,
    windows: Annotated[int, typer.Option("--windows", min=1, help="Corpus windows read for the dictionaries.")] = 64,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Corpus window length in tokens "
                                                   "(default: min(256, the model's max_seq_len)).",
                                                   show_default=False)] = None,
    lift_windows: Annotated[int, typer.Option("--lift-windows", min=0, help="Windows each code's vector is added "
                                              "to, for its lift tokens (0: none).")] = 2,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write PNGs (code-weight heat maps, code usage; "
                                                "input attributions) into this directory.", show_default=False)] = None,
    attribute_inputs: AttributeOpt = False,
    concept: ConceptOpt = None,
    unit: UnitOpt = None,
    block_tokens: BlockTokensOpt = None,
    ig_steps: IgStepsOpt = None,
    baseline: BaselineOpt = None,
    generate: GenerateOpt = None,
    seed: SeedOpt = None,
    temperature: TemperatureOpt = 1.0,
    steps_per_block: StepsOpt = None,
    steer: SteerOpt = None,
    concept_table: ConceptTableOpt = None,
    find_concept: FindOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    strategies: StrategyOpt = None,
    tiktoken: TiktokenOpt = None,
) -> None:
    """Read a checkpoint's concepts: per block the codes each segment mixes (exact decomposition
    of the predicted concept), attribution of a continuation to codes by ablation, and code
    dictionaries (usage, strongest blocks, lift tokens) over a corpus; or (--attribute-inputs)
    each prompt token's contribution to one output, against the [MASK] baseline; or (--generate, a
    Causal Diffusion LM) each generated token explained in the state it was committed in; or
    (--find-concept) a concept table searched by name."""
    from ncpctl.inference.inspect_command import InspectRequest, inspect_checkpoint

    req = InspectRequest(
        checkpoint, prompt=prompt, prompts_file=prompts_file, target=target, top=top, ablate_codes=ablate_codes,
        corpus=corpus, windows=windows, seq_len=seq_len, lift_windows=lift_windows, plot=plot,
        attribute_inputs=attribute_inputs, concept=concept, unit=unit, block_tokens=block_tokens, ig_steps=ig_steps,
        baseline=baseline, generate=generate, seed=seed, temperature=temperature, steps_per_block=steps_per_block,
        steer=steer, concept_table=concept_table, find_concept=find_concept, set_=set_)
    inspect_checkpoint(req, Output(json_out))

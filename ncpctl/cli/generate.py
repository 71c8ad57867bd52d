"""`ncpctl generate`: sampling from a checkpoint on the incremental decoder (a Causal Diffusion LM: block by
block on cached blocks). The work: ncpctl.inference.generate_command."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import (ConceptTableOpt, DebugOpt, JsonOpt, NoVerifyOpt, Output, SetOpt, StrategyOpt,
                                TiktokenOpt, command)

SteerOpt = Annotated[Optional[list[str]], typer.Option(
    "--steer", help="Steer every prompt (repeatable): inline key=value,... (code=S/N, mix=S:N=W+... or "
    "concept=NAME|#N|A+B, strength=6logit | 2norm, at=decoder_input | readout | decoder.L | decoder.L+ | encoder.L, "
    "start, length, penalty) or a spec file (.json/.yaml). A --prompts-file JSON line may carry its own \"steer\". "
    "A Causal Diffusion LM: added at the [MASK] positions while start <= committed tokens < start + length.",
    show_default=False)]


@command
def main(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint or run directory.", show_default=False)],
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeatable).",
                                                        show_default=False)] = None,
    prompts_file: Annotated[Optional[str], typer.Option("--prompts-file", help="One prompt per line, or JSON lines "
                                                        "({\"prompt\": ...}).", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=0, help="New tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = 1.0,
    top_k: Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample from the k most likely tokens.",
                                                 show_default=False)] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.",
                                                   show_default=False)] = None,
    greedy: Annotated[bool, typer.Option("--greedy", help="Always take the most likely token.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable; not included "
                                                      "in the output).", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed: the same seed gives the same text "
                                                "(prompt i uses seed+i).", show_default=False)] = None,
    steps_per_block: Annotated[Optional[int], typer.Option("--steps-per-block", min=1, help="Causal Diffusion LM: "
                                                           "denoising steps per block (default: the block size, one "
                                                           "token a step).", show_default=False)] = None,
    commit_per_step: Annotated[Optional[int], typer.Option("--commit-per-step", min=1, help="Causal Diffusion LM: "
                                                           "commit the K most confident tokens a step (default: the "
                                                           "block's [MASK]s spread evenly over its steps).",
                                                           show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Prompts decoded together.")] = 8,
    steer: SteerOpt = None,
    save_steer: Annotated[Optional[str], typer.Option("--save-steer", help="Write the (one) --steer spec to this "
                                                      "file, units and schedule explicit.", show_default=False)] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Speculative decoding: a drafter checkpoint with the "
                                                 "same tokenizer, or 'mtp' (the checkpoint's own MTP head). The output "
                                                 "distribution is the checkpoint's (greedy: the same tokens).",
                                                 show_default=False)] = None,
    draft_tokens: Annotated[int, typer.Option("--draft-tokens", help="Speculative decoding: tokens drafted per "
                                              "verification round (K; the MTP drafter: at most its depth).")] = 4,
    concept_table: ConceptTableOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    strategies: StrategyOpt = None,
    tiktoken: TiktokenOpt = None,
    no_verify: NoVerifyOpt = False,
) -> None:
    """Generate text from a checkpoint: greedy, temperature, top-k, top-p, stop strings, seeds.

    A single prompt streams to the terminal; --prompts-file decodes prompts in batches. A Causal
    Diffusion LM samples block by block (--steps-per-block, --commit-per-step) and streams each
    committed block; --steer there adds its direction at the [MASK] positions (Steerling's steering).
    """
    from ncpctl.inference.generate_command import GenerateRequest, run_generate

    run_generate(GenerateRequest(
        checkpoint, prompt=prompt, prompts_file=prompts_file, max_tokens=max_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, greedy=greedy, stop=stop, seed=seed, steps_per_block=steps_per_block,
        commit_per_step=commit_per_step, batch_size=batch_size, steer=steer, save_steer=save_steer, draft=draft,
        draft_tokens=draft_tokens, concept_table=concept_table, set_=set_, verify=not no_verify), Output(json_out))

"""`ncpctl generate`: sampling from a checkpoint on the incremental decoder (a Causal Diffusion LM: block by
block on cached blocks)."""

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
    import sys

    from ncpctl.checkpoint import set_verify
    from ncpctl.errors import UserError

    set_verify(not no_verify)

    o = Output(json_out)
    if set_:
        raise UserError("--set does not apply to generate", hint="use the sampling options (see --help)")
    prompts = list(prompt or [])
    own: list = [None] * len(prompts)  # per-prompt steering from the prompts file
    if prompts_file:
        from ncpctl.inference.prompts import read_prompt_records

        records = read_prompt_records(prompts_file)
        prompts += [p for p, _ in records]
        own += [st for _, st in records]
    if not prompts:
        raise UserError("no prompt given", hint="pass --prompt TEXT or --prompts-file FILE")

    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams, generate_texts

    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                greedy=greedy, seed=seed, stop=list(stop or []), steps_per_block=steps_per_block,
                                commit_per_step=commit_per_step)
    except ValueError as e:
        raise UserError(str(e)) from None
    from ncpctl.interpret.steer import SteerSpec, resolve, specs_from

    common = [SteerSpec.parse(x) for x in steer or []]
    if save_steer:
        if len(common) != 1:
            raise UserError(f"--save-steer writes one spec; {len(common)} --steer given")
        common[0].save(save_steer)
    per_prompt = [common + specs_from(st, f"{prompts_file} prompt {i + 1}") for i, st in enumerate(own)]
    loaded = load_model(checkpoint)
    blocks = _sampling(loaded, params)
    spec, spec_info = _speculative(loaded, draft, draft_tokens, o)
    steering = None
    if any(per_prompt):
        from ncpctl.interpret.concept_table import names_for

        names = names_for(loaded, concept_table)
        steering = [[resolve(loaded.model, sp, names) for sp in specs] for specs in per_prompt]
    if seed is not None:
        torch.manual_seed(seed)
    stream = len(prompts) == 1 and not json_out
    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    done = generate_texts(loaded, prompts, params, batch_size=batch_size, steer=steering, speculative=spec,
                          on_text=(lambda i, delta: (sys.stdout.write(delta), sys.stdout.flush())) if stream else None)
    if stream:
        sys.stdout.write("\n")
    results = [{"prompt": p, "text": c.text, "tokens": len(c.tokens), "finish_reason": c.finish_reason}
               for p, c in zip(prompts, done)]
    o.result({"command": "generate", "checkpoint": str(loaded.path), "seed": seed,
              "sampling": {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                           "greedy": params.is_greedy, "stop": params.stop, **blocks},
              "steer": None if steering is None else [[r.describe() for r in row] for row in steering],
              "speculative": None if spec is None else {**spec_info, **spec.stats.as_dict()},
              "completions": results}, _human(results, stream, spec, o))


def _speculative(loaded, draft: str | None, k: int, o: Output):
    """(``Speculative``, its description for the output) for ``--draft``, or (None, None)."""
    if draft is None:
        return None, None
    from ncpctl.inference.drafters import load_speculative

    spec, info = load_speculative(loaded, draft, k)
    if "draft_tokens_requested" in info:
        o.info(f"note: --draft-tokens {k} is more than the drafter proposes: {spec.k} a round")
    return spec, info


def _human(results: list[dict], stream: bool, spec, o: Output):
    """The human-readable output: each completion (unless it was streamed) on stdout, and MAL on
    stderr (statistics, not generated text)."""

    def human(con) -> None:
        for r in [] if stream else results:
            con.print(f"[bold]{r['prompt']}[/]", end="", markup=True, highlight=False)
            con.print(r["text"], markup=False, highlight=False)
            con.print(f"[dim]({r['tokens']} tokens, {r['finish_reason']})[/]")
        if spec is not None and spec.stats.rounds:
            s = spec.stats.as_dict()
            o.info(f"[dim](speculative: {s['rounds']} verification rounds, MAL {s['mal']:.2f} tokens a round, "
                   f"K = {spec.k})[/]")

    return human


def _sampling(loaded, params) -> dict:
    """Check that the checkpoint's objective can generate with ``params``; the block-wise sampling
    settings for the output ({} for token-by-token)."""
    from ncpctl.errors import UserError

    ob = loaded.model.objective
    why = ob.refusal("generate")
    if why:
        raise UserError(f"{loaded.path}: {why}")
    if not ob.block_sampling:
        if params.steps_per_block is not None or params.commit_per_step is not None:
            raise UserError(f"--steps-per-block / --commit-per-step apply to a Causal Diffusion LM; {loaded.path} is "
                            f"objective: {loaded.config.objective}")
        return {}
    return {"steps_per_block": params.steps_per_block or ob.block, "commit_per_step": params.commit_per_step}

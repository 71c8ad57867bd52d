"""`ncpctl generate`: sampling from a checkpoint on the incremental decoder."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, Output, SetOpt, command


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
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Prompts decoded together.")] = 8,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate text from a checkpoint: greedy, temperature, top-k, top-p, stop strings, seeds.

    A single prompt streams to the terminal; --prompts-file decodes prompts in batches.
    """
    import sys

    from ncpctl.errors import UserError

    o = Output(json_out)
    if set_:
        raise UserError("--set does not apply to generate", hint="use the sampling options (see --help)")
    prompts = list(prompt or [])
    if prompts_file:
        from ncpctl.inference.prompts import read_prompts

        prompts += read_prompts(prompts_file)
    if not prompts:
        raise UserError("no prompt given", hint="pass --prompt TEXT or --prompts-file FILE")

    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams, generate_texts

    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                greedy=greedy, seed=seed, stop=list(stop or []))
    except ValueError as e:
        raise UserError(str(e)) from None
    loaded = load_model(checkpoint)
    if seed is not None:
        torch.manual_seed(seed)
    stream = len(prompts) == 1 and not json_out
    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    done = generate_texts(loaded, prompts, params, batch_size=batch_size,
                          on_text=(lambda i, delta: (sys.stdout.write(delta), sys.stdout.flush())) if stream else None)
    if stream:
        sys.stdout.write("\n")
    results = [{"prompt": p, "text": c.text, "tokens": len(c.tokens), "finish_reason": c.finish_reason}
               for p, c in zip(prompts, done)]

    def human(con) -> None:
        if stream:
            return
        for r in results:
            con.print(f"[bold]{r['prompt']}[/]", end="", markup=True, highlight=False)
            con.print(r["text"], markup=False, highlight=False)
            con.print(f"[dim]({r['tokens']} tokens, {r['finish_reason']})[/]")

    o.result({"command": "generate", "checkpoint": str(loaded.path), "seed": seed,
              "sampling": {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                           "greedy": params.is_greedy, "stop": params.stop},
              "completions": results}, human)

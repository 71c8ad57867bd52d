"""What ``ncpctl generate`` calls: ``run_generate(GenerateRequest, out)`` reads the prompts (and their
own steering), loads the checkpoint, checks its objective can sample with the settings, resolves
the steering and the drafter, and decodes (``generate_texts``): a single prompt streams to stdout,
the result (completions, settings, MAL) through ``out``. torch is imported when it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class GenerateRequest:
    """``ncpctl generate``'s arguments as typed (``ncpctl/cli/generate.py`` documents each flag)."""

    checkpoint: str
    prompt: list[str] | None = None
    prompts_file: str | None = None
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    stop: list[str] | None = None
    seed: int | None = None
    steps_per_block: int | None = None
    commit_per_step: int | None = None
    batch_size: int = 8
    steer: list[str] | None = None
    save_steer: str | None = None
    draft: str | None = None
    draft_tokens: int = 4
    concept_table: str | None = None
    set_: list[str] | None = None
    verify: bool = True  # --no-verify: the checkpoint's manifest is not checked


def run_generate(req: GenerateRequest, o: Output) -> None:
    """Generate from ``req.checkpoint`` for each prompt; the completions through ``o``."""
    import sys

    from ncpctl.checkpoint import set_verify

    r = req
    prompt, prompts_file, max_tokens, temperature, top_k, top_p = r.prompt, r.prompts_file, r.max_tokens, r.temperature, \
        r.top_k, r.top_p
    seed, steer, save_steer = r.seed, r.steer, r.save_steer
    set_verify(r.verify)

    if r.set_:
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
                                greedy=r.greedy, seed=seed, stop=list(r.stop or []), steps_per_block=r.steps_per_block,
                                commit_per_step=r.commit_per_step)
    except ValueError as e:
        raise UserError(str(e)) from None
    from ncpctl.interpret.steer import SteerSpec, resolve, specs_from

    common = [SteerSpec.parse(x) for x in steer or []]
    if save_steer:
        if len(common) != 1:
            raise UserError(f"--save-steer writes one spec; {len(common)} --steer given")
        common[0].save(save_steer)
    per_prompt = [common + specs_from(st, f"{prompts_file} prompt {i + 1}") for i, st in enumerate(own)]
    loaded = load_model(r.checkpoint)
    blocks = _sampling(loaded, params)
    spec, spec_info = _speculative(loaded, r.draft, r.draft_tokens, o)
    steering = None
    if any(per_prompt):
        from ncpctl.interpret.concept_table import names_for

        names = names_for(loaded, r.concept_table)
        steering = [[resolve(loaded.model, sp, names) for sp in specs] for specs in per_prompt]
    if seed is not None:
        torch.manual_seed(seed)
    stream = len(prompts) == 1 and not o.json
    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    done = generate_texts(loaded, prompts, params, batch_size=r.batch_size, steer=steering, speculative=spec,
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

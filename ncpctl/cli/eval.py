"""`ncpctl eval`: evaluation through lm-evaluation-harness (ncpctl.evaluate), and `--compare`.

Parses the flags (two modes at once, or a mode's flag without its mode, is refused here) and calls
``ncpctl.evaluate.entry.run_eval``: one library entry point per mode."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, NoVerifyOpt, Output, SetOpt, StrategyOpt, TiktokenOpt, command
from ncpctl.errors import UserError

SpeculativeOpt = Annotated[Optional[str], typer.Option(
    "--speculative", metavar="DRAFTER", help="MAL (NCP-ArchPreview Eq. 27: tokens committed per verification round, "
    "the correction or bonus token included) and acceptance of a drafter on the TARGET checkpoint, greedy, per "
    "task of --prompts (default: the validation split): a drafter checkpoint (`ncpctl train-drafter`), another "
    "ncpctl model, or 'mtp'.", show_default=False)]
HorizonOpt = Annotated[int, typer.Option("--horizon", help="With --speculative: tokens drafted per round (the report: 16).")]
PromptsOpt = Annotated[Optional[str], typer.Option(
    "--prompts", metavar="FILE.jsonl", help="With --speculative: prompts as JSON lines {prompt, task}.",
    show_default=False)]
NewTokensOpt = Annotated[int, typer.Option("--new-tokens", min=1, help="With --speculative: tokens generated per prompt.")]


LevelOpt = Annotated[float, typer.Option("--level", min=0.5, max=0.999, help="--compare with seed arms: the level "
                                         "of the paired bootstrap's interval.")]
ResamplesOpt = Annotated[int, typer.Option("--resamples", min=100, help="--compare with seed arms: bootstrap "
                                           "resamples of the examples (fixed seed 0).")]

TasksOpt = Annotated[Optional[str], typer.Option(
    "--tasks", "-t", help="Comma-separated lm-eval tasks or groups (default: eval.tasks of the recipe, or of "
    "the recipe a checkpoint carries; '' = none, only --heldout). "
    "Offline: ncp_offline; the ConceptLM paper: conceptlm, conceptlm_downstream, conceptlm_ppl; paper tables with "
    "their shots and aggregate: conceptlm_table1, conceptlm_8b, dlcm_table2, archpreview_table1, archpreview_general.",
    show_default=False)]
HeldoutOpt = Annotated[Optional[list[str]], typer.Option(
    "--heldout", metavar="SOURCE", help="Held-out text to score (token/word/byte perplexity, bits per byte), "
    "repeatable: a file, glob, builtin:NAME, or a data.sources entry as YAML, e.g. "
    "'{path: notes.jsonl, field: body, label: notes}' (default: eval.heldout).", show_default=False)]
DiffusionSamplesOpt = Annotated[Optional[int], typer.Option(
    "--diffusion-samples", min=1, help="A Causal Diffusion LM: Monte Carlo samples per request of its "
    "log-likelihood bound (the ELBO; default 8); the output says 'bound'.", show_default=False)]
NoisedOpt = Annotated[bool, typer.Option(
    "--noised-context", help="A Causal Diffusion LM: also report, per perplexity set, its loss with every block "
    "noised, the conditions training reads (the bound conditions each block on clean earlier blocks, as the "
    "sampler does; this is no bound).")]
LimitOpt = Annotated[Optional[float], typer.Option(
    "--limit", help="Examples per task (smoke runs); below 1, a fraction of each task's examples (lm-eval's "
    "rule: 0.1 = the first ceil(10%)).", show_default=False)]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", "-b", min=1, help="Requests per batch.",
                                                 show_default=False)]
ShotsOpt = Annotated[Optional[int], typer.Option(
    "--num-fewshot", min=0, help="Few-shot examples of every task, 0-shot ones and a paper group's members "
    "included (the shots each task used are recorded).", show_default=False)]
SeedOpt = Annotated[Optional[str], typer.Option(
    "--seed", metavar="N|R,N,T,F", help="lm-eval's seeds: Python random, numpy, torch, few-shot sampler (one "
    "integer for all four, or four values; None leaves one unset) [default: 0,1234,1234,1234].",
    show_default=False)]
GenKwargsOpt = Annotated[Optional[str], typer.Option(
    "--gen-kwargs", metavar="K=V,...|JSON", help="Generation tasks' settings, merged into each task's own: "
    "temperature, top_p, top_k, do_sample, max_gen_toks, until (stop strings; a JSON object for those), seed.",
    show_default=False)]
LogSamplesOpt = Annotated[bool, typer.Option(
    "--log-samples", help="Write one JSONL per task beside the results (samples_<checkpoint>/TASK.jsonl): "
    "document id, prompt, response, target, each metric's score.")]
NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", help="Score every request anew (default: answers are kept in eval/cache/ as they are scored, "
    "so an interrupted evaluation resumes; keyed by the checkpoint's manifest).")]


@command
def main(
    ctx: typer.Context,
    targets: Annotated[list[str], typer.Argument(
        help="Checkpoint directory, run directory or recipe YAML (several with --compare).", show_default=False,
        metavar="TARGET")],
    compare: Annotated[bool, typer.Option(
        "--compare", help="Compare the TARGETs' results side by side (Δ to the first); a target without results "
        "is evaluated first. Writes `compare_<runs>.{json,md,png}` to --out (default: the first run's eval/). "
        "A TARGET 'A1,A2,A3' is an arm of runs that differ only by train.seed: mean ± std per arm and a paired "
        "bootstrap over examples of each arm's difference to the first.")] = False,
    tasks: TasksOpt = None,
    heldout: HeldoutOpt = None,
    limit: LimitOpt = None,
    batch_size: BatchOpt = None,
    num_fewshot: ShotsOpt = None,
    seed: SeedOpt = None,
    gen_kwargs: GenKwargsOpt = None,
    log_samples: LogSamplesOpt = False,
    no_cache: NoCacheOpt = False,
    diffusion_samples: DiffusionSamplesOpt = None,
    noised_context: NoisedOpt = False,
    window: Annotated[int, typer.Option("--window", min=1, help="--compare: train loss mean over the last N steps.")] = 200,
    level: LevelOpt = 0.95,
    resamples: ResamplesOpt = 2000,
    out: Annotated[Optional[str], typer.Option("--out", help="Output directory (default run.dir/eval; with "
                                               "--compare the first run's eval/).", show_default=False)] = None,
    concepts: Annotated[bool, typer.Option(
        "--concepts", help="DLCM checkpoints: realised tokens per concept per --heldout corpus (Table 5: one corpus "
        "per domain; without --heldout, per data.sources entry of the run's validation split) and the loss by "
        "position within the concept, 1-20, over all of them (Fig. 7; against --base), at the inference "
        "threshold. Writes concepts.json to --out.")] = False,
    base: Annotated[Optional[str], typer.Option(
        "--base", metavar="CHECKPOINT", help="With --concepts: the base model compared position by position "
        "(same tokenizer).", show_default=False)] = None,
    proxy: Annotated[Optional[str], typer.Option(
        "--proxy", metavar="SPEC.jsonl", help="Capability proxies (NCP-ArchPreview App. C) of each TARGET checkpoint: "
        "a JSONL of {prompt, suffix, source, capability[, choices, label]}; teacher-forced mean suffix NLL averaged "
        "per source then per capability, and the multiple-choice margin. Writes proxy_<step>.json to --out.",
        show_default=False)] = None,
    against: Annotated[Optional[str], typer.Option(
        "--against", metavar="TASK:METRIC", help="With --proxy and several TARGETs: correlate each proxy with this "
        "downstream score from their results_<step>.json (slope, R², Spearman), e.g. hellaswag:acc_norm.",
        show_default=False)] = None,
    code_task: Annotated[Optional[str], typer.Option(
        "--code-task", metavar="FILE.jsonl", help="pass@k of the checkpoint on a code task: JSONL of {prompt, test}; "
        "--samples completions per problem, each run with its test (needs --allow-code-execution). "
        "Writes code_<step>.json to --out. A tiny one: examples/code/tiny.jsonl.", show_default=False)] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="With --code-task: samples per problem "
                                         "(NCP-ArchPreview: 32); pass@1 and, when n >= 10, pass@10.")] = 32,
    allow_code_execution: Annotated[bool, typer.Option(
        "--allow-code-execution", help="Run code tasks (pass@k): execute model-written programs in a subprocess "
        "with CPU, memory and time limits (a guard against accidents, not a sandbox against a hostile model).")] = False,
    speculative: SpeculativeOpt = None, horizon: HorizonOpt = 16, prompts: PromptsOpt = None,
    new_tokens: NewTokensOpt = 64,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    strategies: StrategyOpt = None,
    tiktoken: TiktokenOpt = None,
    no_verify: NoVerifyOpt = False,
) -> None:
    """Evaluate a checkpoint with lm-evaluation-harness; results JSON + markdown go to run.dir/eval/.

    Defaults for tasks, held-out corpora, limit, batch size and few-shot come from the recipe's
    eval section (a checkpoint or run directory: the recipe stored in the checkpoint); flags
    override them.

    Perplexity sets are summarised twice: the mean of the held-out sets' perplexities, each in
    its own unit (the ConceptLM paper's average; sets scored on a training split are listed, not
    averaged), and the token-weighted perplexity over their tokens; the table prints each set's
    unit and the rule.

    With --compare: one table of several runs, from the results they already have.
    """
    from ncpctl.evaluate.entry import EvalRequest, run_eval

    _check_flags(ctx)
    req = EvalRequest(
        targets, compare=compare, tasks=tasks, heldout=heldout, limit=limit, batch_size=batch_size,
        num_fewshot=num_fewshot, seed=seed, gen_kwargs=gen_kwargs, log_samples=log_samples, no_cache=no_cache,
        diffusion_samples=diffusion_samples, noised_context=noised_context, window=window, level=level,
        resamples=resamples, out=out, concepts=concepts, base=base, proxy=proxy, against=against,
        code_task=code_task, samples=samples, allow_code_execution=allow_code_execution, speculative=speculative,
        horizon=horizon, prompts=prompts, new_tokens=new_tokens, set_=set_, verify=not no_verify)
    run_eval(req, Output(json_out))


# eval's modes (one per call), and the flags that only one of them reads
MODES = {"compare": "--compare", "speculative": "--speculative", "code_task": "--code-task", "proxy": "--proxy",
         "concepts": "--concepts"}
MODE_FLAGS = {"window": ("--window", "compare"), "level": ("--level", "compare"),
              "resamples": ("--resamples", "compare"), "horizon": ("--horizon", "speculative"),
              "prompts": ("--prompts", "speculative"), "new_tokens": ("--new-tokens", "speculative"),
              "samples": ("--samples", "code_task"), "against": ("--against", "proxy")}


def _check_flags(ctx: typer.Context) -> None:
    """One line for two modes at once, or a mode's flag without its mode (it would be ignored)."""
    def given(name: str) -> bool:  # typed on the command line (or its environment), not a default
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    modes = [flag for name, flag in MODES.items() if given(name)]
    if len(modes) > 1:
        raise UserError(f"eval: {' and '.join(modes)} are separate modes; give one per call")
    for name, (flag, mode) in MODE_FLAGS.items():
        if given(name) and not given(mode):
            raise UserError(f"eval: {flag} applies only with {MODES[mode]}; without it, it would be ignored",
                            hint=f"add {MODES[mode]}, or drop {flag}")

"""What ``ncpctl eval`` calls: one ``EvalRequest`` (the command line, parsed) and one entry point per
mode, each a function of the request and the command's ``Output`` (``ncpctl.output``).

* ``evaluate_tasks``: lm-eval tasks and held-out perplexity of one checkpoint (``ncpctl.evaluate.run``);
* ``compare_runs``: ``--compare``, several runs side by side, seed arms included (``compare``);
* ``speculative``: ``--speculative``, a drafter's MAL on the target (``speculative``);
* ``code_task``: ``--code-task``, pass@k (``code_exec``);
* ``proxy``: ``--proxy``, capability proxies (``proxy``);
* ``concepts``: ``--concepts``, DLCM tokens per concept and loss by position (``concept_position``).

``run_eval(request, out)`` picks the mode the request names. Nothing heavy is imported at module level
(``ncpctl --help`` stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ncpctl.errors import UserError
from ncpctl.output import Output, print_wide


@dataclass
class EvalRequest:
    """``ncpctl eval``'s arguments as typed (``ncpctl/cli/eval.py`` documents each flag)."""

    targets: list[str]
    compare: bool = False
    tasks: str | None = None
    heldout: list[str] | None = None
    limit: float | None = None
    batch_size: int | None = None
    num_fewshot: int | None = None
    seed: str | None = None
    gen_kwargs: str | None = None
    log_samples: bool = False
    no_cache: bool = False
    diffusion_samples: int | None = None
    noised_context: bool = False
    window: int = 200
    level: float = 0.95
    resamples: int = 2000
    out: str | None = None
    concepts: bool = False
    base: str | None = None
    proxy: str | None = None
    against: str | None = None
    code_task: str | None = None
    samples: int = 32
    allow_code_execution: bool = False
    speculative: str | None = None
    horizon: int = 16
    prompts: str | None = None
    new_tokens: int = 64
    set_: list[str] | None = None
    verify: bool = True
    # parsed by ``parse()``: --limit (a count or a fraction) and --seed, --gen-kwargs, --log-samples, --no-cache
    limit_: int | float | None = field(default=None, init=False)
    how: dict[str, Any] = field(default_factory=dict, init=False)

    def parse(self) -> EvalRequest:
        """Read --limit, --seed and --gen-kwargs (every mode checks them, whether it reads them or not)."""
        from ncpctl.evaluate.settings import parse_gen_kwargs, parse_limit, parse_seed

        if not self.how:
            self.limit_ = parse_limit(self.limit)
            self.how = dict(seed=parse_seed(self.seed) if self.seed is not None else None,
                            gen_kwargs=parse_gen_kwargs(self.gen_kwargs), log_samples=self.log_samples,
                            cache=not self.no_cache)
        return self

    @property
    def mode(self) -> str:
        """The entry point this request names (the CLI refuses two modes at once); the order is
        the order the flags were always read in."""
        if self.compare:
            return "compare"
        if self.speculative is not None:
            return "speculative"
        if self.code_task is not None:
            return "code_task"
        if self.proxy is not None:
            return "proxy"
        if self.concepts or self.base is not None:
            return "concepts"
        return "tasks"


def run_eval(req: EvalRequest, out: Output) -> None:
    """``ncpctl eval``: the request's mode, its result reported through ``out``."""
    from ncpctl.checkpoint import set_verify

    set_verify(req.verify)
    req.parse()
    if req.allow_code_execution and req.mode in ("code_task", "proxy", "tasks", "concepts"):
        _allow_code()  # the opt-in reaches the code runner through the environment (as lm-eval's HF_ALLOW_CODE_EVAL)
    MODES[req.mode](req, out)


def _names(req: EvalRequest) -> list[str] | None:
    return [t.strip() for t in req.tasks.split(",") if t.strip()] if req.tasks is not None else None


def evaluate_tasks(req: EvalRequest, out: Output) -> None:
    """lm-eval tasks and --heldout perplexity of one TARGET: ncpctl.evaluate.run.evaluate."""
    from ncpctl.evaluate.run import evaluate, resolve_target, rich_table

    req.parse()
    if len(req.targets) != 1:
        raise UserError(f"eval takes one TARGET, got {len(req.targets)}", hint="to compare runs: ncpctl eval --compare A B")
    t = resolve_target(req.targets[0], req.set_ or [], _names(req), req.batch_size, req.limit_, req.num_fewshot, req.out,
                       heldout=req.heldout, diffusion_samples=req.diffusion_samples, **req.how)
    t.allow_code, t.noised_context = req.allow_code_execution, req.noised_context
    summary = evaluate(t, log=out.log)
    if summary is not None:  # None: a data-parallel evaluation's rank other than 0 (rank 0 writes and prints)
        out.result({"command": "eval", **summary}, lambda con: (print_wide(con, rich_table(summary)),
                                                                con.print(f"[dim]{files_lines(summary)}[/]")))


def files_lines(summary: dict) -> str:
    """Where the results went, and how many requests the model answered (the rest: the request cache)."""
    files, here = summary["files"], Path(summary["files"]["json"]).parent
    text = f"results: {files['json']}\nmarkdown: {files['markdown']}"
    text += "".join(f"\nsamples: {here / rel}" for rel in (summary.get("samples") or {}).values())
    n, scored = summary.get("requests"), summary.get("model_requests")
    if n is not None and scored is not None and summary.get("cache"):
        text += f"\nrequests: {n:,} ({scored:,} scored by the model, {n - scored:,} from the cache)"
    return text


def compare_runs(req: EvalRequest, out: Output) -> None:
    """``--compare``: ncpctl.evaluate.compare.compare, one table (seed arms and curves in its caption)."""
    from ncpctl.evaluate.compare import compare as run_compare, rich_table as compare_table

    req.parse()
    if req.set_:
        raise UserError("--set does not apply to --compare", hint="each checkpoint carries its own recipe")
    payload = run_compare(req.targets, tasks=_names(req), heldout=req.heldout, limit=req.limit_, num_fewshot=req.num_fewshot,
                          batch_size=req.batch_size, out=req.out, window=req.window, log=out.log, level=req.level,
                          resamples=req.resamples, how=req.how)
    out.result({"command": "eval", "mode": "compare", **payload}, lambda con: (
        print_wide(con, compare_table(payload)),
        con.print("[dim]" + "\n".join(f"{k}: {v}" for k, v in payload["files"].items() if v) + "[/]"),
    ))


def _allow_code() -> None:
    import os

    from ncpctl.evaluate.code_exec import ALLOW_ENV

    os.environ[ALLOW_ENV] = "1"


def speculative(req: EvalRequest, out: Output) -> None:
    """``--speculative``: ncpctl.evaluate.speculative.speculative_mal on one checkpoint."""
    limit = req.parse().limit_
    if isinstance(limit, float):
        raise UserError(f"--speculative: --limit {req.limit:g} is a fraction; it counts prompts here")
    from ncpctl.evaluate.speculative import rich_table, speculative_mal

    if len(req.targets) != 1:
        raise UserError(f"--speculative takes one TARGET (the checkpoint that verifies), got {len(req.targets)}")
    payload = speculative_mal(req.targets[0], req.speculative, horizon=req.horizon, prompts=req.prompts,
                              limit=limit or 32, new_tokens=req.new_tokens, batch_size=req.batch_size or 1, log=out.log)
    out.result({"command": "eval", "mode": "speculative", **payload}, lambda con: print_wide(con, rich_table(payload)))


def code_task(req: EvalRequest, out: Output) -> None:
    """``--code-task``: ncpctl.evaluate.code_exec.run_code_task on one checkpoint."""
    from ncpctl.evaluate.code_exec import run_code_task

    req.parse()  # checked as in every mode, though pass@k reads none of them
    if len(req.targets) != 1:
        raise UserError(f"--code-task takes one TARGET, got {len(req.targets)}")
    path, samples = req.code_task, req.samples
    res = run_code_task(req.targets[0], path, samples, (1, 10) if samples >= 10 else (1,), out=req.out,
                        batch_size=req.batch_size or 8, log=out.log)

    def human(con) -> None:
        ks = [k for k in res if isinstance(k, str) and k.startswith("pass@")]
        con.print(f"{path}: {len(res['problems'])} problems, n = {res['n']} samples each: "
                  + ", ".join(f"{k} = {res[k]:.4f}" for k in ks) + " (unbiased estimator, Chen et al. 2021)")
        for p in res["problems"]:
            con.print(f"  {p['task_id']}: {p['correct']}/{p['n']} passed" + (
                f"; failures: {'; '.join(p['failures'][:3])}" if p["failures"] else ""), markup=False)
        con.print(f"[dim]{res['file']}[/]")

    out.result({"command": "eval", "mode": "code", **res}, human)


def proxy(req: EvalRequest, out: Output) -> None:
    """``--proxy``: ncpctl.evaluate.proxy.evaluate_proxy on each TARGET, one table; the correlation view
    with --against."""
    from ncpctl.evaluate.proxy import evaluate_proxy, rich_tables

    req.parse()  # checked as in every mode
    payload = evaluate_proxy(req.targets, req.proxy, against=req.against, out=req.out, batch_size=req.batch_size or 8,
                             log=out.log)
    out.result({"command": "eval", "mode": "proxy", **payload}, lambda con: [print_wide(con, t) for t in rich_tables(payload)])


def concepts(req: EvalRequest, out: Output) -> None:
    """``--concepts``: ncpctl.evaluate.concept_position.concept_report on the --heldout corpora, or
    without them on the checkpoint's validation split, one corpus per data.sources entry."""
    import json

    from ncpctl.checkpoint import resolve, run_dir_of
    from ncpctl.evaluate.concept_position import concept_report
    from ncpctl.evaluate.heldout import parse_spec
    from ncpctl.fsutil import atomic_write

    req.parse()  # checked as in every mode
    if len(req.targets) != 1:
        raise UserError(f"eval takes one TARGET, got {len(req.targets)}", hint="to compare runs: ncpctl eval --compare A B")
    target = req.targets[0]
    specs = [parse_spec(h) for h in req.heldout or []]
    report = concept_report(target, specs, base=req.base)
    ckpt = resolve(Path(target))
    out_dir = Path(req.out) if req.out else (run_dir_of(ckpt) or ckpt) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "concepts.json", json.dumps(report, indent=2) + "\n")
    report["file"] = str(out_dir / "concepts.json")
    out.result({"command": "eval", "mode": "concepts", **report}, lambda con: _concepts_human(con, report))


def _concepts_human(con: Any, report: dict) -> None:
    from rich.table import Table

    t = Table(title=f"tokens per concept (target R {report['target_ratio']:g}, threshold {report['threshold']:g})")
    for col in ("corpus", "tokens", "concepts", "tokens per concept"):
        t.add_column(col, justify="left" if col == "corpus" else "right")
    for name, row in report["tokens_per_concept_by_source"].items():
        t.add_row(name, f"{row['tokens']:,}", f"{row['concepts']:,}", f"{row['tokens_per_concept']:.2f}")
    con.print(t)
    f7 = report["loss_by_concept_position"]
    t = Table(title="loss by position within the concept")
    for col in ("position", "tokens", "DLCM", "base", "DLCM - base"):
        t.add_column(col, justify="right")
    for i, k in enumerate(f7["positions"]):
        fmt = lambda v: "" if v is None or v != v else f"{v:.4f}"  # noqa: E731
        t.add_row(str(k), f"{f7['counts'][i]:,}", fmt(f7["dlcm"][i]), fmt(f7["base"][i] if f7["base"] else None),
                  fmt(f7["delta"][i] if f7["delta"] else None))
    con.print(t)
    con.print(f"[dim]{report['file']}[/]")


MODES: dict[str, Callable[[EvalRequest, Output], None]] = {
    "tasks": evaluate_tasks, "compare": compare_runs, "speculative": speculative, "code_task": code_task,
    "proxy": proxy, "concepts": concepts}

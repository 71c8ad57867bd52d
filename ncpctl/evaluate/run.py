"""``evaluate``: a checkpoint through lm-evaluation-harness, in-process (``ncpctl eval``).

Writes ``results_<tag>.json`` (lm-eval's results object plus our ``perplexity`` summary)
and ``results_<tag>.md`` (lm-eval's markdown table plus the perplexity summary) into
``run.dir/eval/`` (a checkpoint outside a run directory: ``CHECKPOINT/eval/``). The file of a
checkpoint accumulates the tasks of every evaluation of it (``ncpctl.evaluate.accumulate``; a task
scored again is replaced, ``scored`` says when and with what settings each was scored:
``ncpctl.evaluate.settings``); ``--log-samples`` adds one JSONL per task (``ncpctl.evaluate.samples``);
answers go through a resumable cache (``ncpctl.evaluate.cache``); under a launcher every rank scores
its share and rank 0 writes (``ncpctl.evaluate.parallel``).

Perplexity across sets (the ``perplexity`` entry; sets = the tasks whose lm-eval metrics
include a perplexity):
  * ``per_set[task]``: ``metric`` and ``value``, the set's own lm-eval perplexity (the first
    of token_perplexity, perplexity, word_perplexity, byte_perplexity it reports: ours report
    token perplexity, wikitext word perplexity, LAMBADA the target perplexity), its
    ``token_perplexity`` = exp(NLL / tokens) over its scored tokens, ``tokens`` and ``nll``;
    ``unit`` (token / target / word / byte perplexity) and ``split`` (the split lm-eval scored);
  * ``mean_of_sets`` = the arithmetic mean of the held-out sets' ``value``s (how the ConceptLM
    paper averages its perplexity sets; the units differ between sets, as in the paper). A set
    scored on a training split (``split`` ``train``: lm-eval's ``pile_10k``, its ``pile_*``
    family) is listed with ``averaged: false`` and left out; ``averaged`` / ``excluded`` name
    the sets, ``rule`` says it in one line (printed under the table and in the markdown);
  * ``token_weighted`` = exp(sum of NLL / sum of tokens) over the averaged sets' scored tokens
    (big sets weigh more; one unit: our tokenizer's tokens).

Held-out corpora (``EvalTarget.heldout``: ``--heldout`` or ``eval.heldout``) are tasks of their
own, named by their labels (``ncpctl.evaluate.heldout``); they count as perplexity sets.
The JSON also records what was asked (``request``: tasks, held-out corpora, limit, few-shot,
batch size, seeds, generation settings, checkpoint), which ``ncpctl eval --compare`` reuses to
evaluate a run the same way, and each task's numeric per-example scores (``per_example``: ``doc_id``
and one list per metric; with ``--log-samples`` they are read from the samples files instead), which
its seed arms pair on (``ncpctl.evaluate.compare_arms``). ``--num-fewshot`` applies to every task,
0-shot ones included (``set_shots``: lm-eval's own override skips a task whose config says 0).

A checkpoint whose log-likelihoods are bounds (a Causal Diffusion LM: its held-out ELBO,
``ncpctl.model.designs.causal_diffusion.module``) is scored with ``diffusion_samples`` Monte Carlo samples per
request (``--diffusion-samples``); the results record ``likelihood`` (``kind``: ``exact`` or
``bound``, the estimator, samples and seed), each perplexity set is marked ``bound: true`` with
``nll_per_token`` and its Monte Carlo ``nll_stderr``, and the table and markdown say "bound"
(a perplexity from a bound is an upper bound on the perplexity).

Hub tasks whose data cannot be loaded (no network, no cache) and held-out corpora with no text
fail before any model work, with one line per task or corpus naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from ncpctl.errors import UserError
from ncpctl.evaluate import TASKS_DIR
from ncpctl.evaluate.report import BOUND_METRICS, _ppl_markdown, rich_table  # noqa: F401 (this module's API)
from ncpctl.evaluate.settings import DEFAULT_SEED
from ncpctl.fsutil import atomic_write

PPL_METRICS = ("token_perplexity", "perplexity", "word_perplexity", "byte_perplexity")  # preference order
# what each metric is a perplexity of (lm-eval's `perplexity` of loglikelihood tasks: per target
# continuation, e.g. LAMBADA's last word)
PPL_UNITS = {"token_perplexity": "token perplexity", "perplexity": "target perplexity",
             "word_perplexity": "word perplexity", "byte_perplexity": "byte perplexity"}


@dataclass
class EvalTarget:
    checkpoint: Path
    out_dir: Path
    tasks: list[str]
    batch_size: int
    limit: int | float | None  # examples per task, or a fraction of each task below 1
    num_fewshot: int | None
    heldout: list[Any] = field(default_factory=list)  # [HeldoutSource], scored as tasks named by their labels
    diffusion_samples: int | None = None  # Monte Carlo samples of a bound's estimates (None: NCPLM's default)
    noised_context: bool = False  # a CDLM: its noised-context estimate beside the bound (--noised-context)
    allow_code: bool = False  # run code tasks: execute sampled programs (sandboxed; --allow-code-execution)
    seed: tuple[int | None, ...] = DEFAULT_SEED  # lm-eval's random, numpy, torch and few-shot seeds (--seed)
    gen_kwargs: dict[str, Any] | None = None  # generation tasks' settings (--gen-kwargs)
    log_samples: bool = False  # one JSONL per task beside the results (--log-samples)
    cache: bool = True  # the resumable request cache, eval/cache/ (--no-cache: off)


def resolve_target(target: str, sets: list[str], tasks: list[str] | None, batch_size: int | None,
                   limit: int | float | None, num_fewshot: int | None, out: str | None,
                   heldout: list[Any] | None = None, diffusion_samples: int | None = None,
                   seed: tuple[int | None, ...] | None = None, gen_kwargs: dict[str, Any] | None = None,
                   log_samples: bool = False, cache: bool = True) -> EvalTarget:
    """A recipe YAML (its run dir's newest checkpoint) or a checkpoint / run directory.

    Defaults come from the recipe's ``eval`` section: the YAML's, or the resolved recipe the
    checkpoint carries (style rule 7: a checkpoint needs nothing else). Flags win over both;
    ``tasks=[]`` (``--tasks ''``) means no lm-eval tasks, only the held-out corpora.
    ``heldout``: ``--heldout`` values (strings for ``ncpctl.evaluate.heldout.parse_spec``, or
    ``HeldoutSource``s) replacing ``eval.heldout``; ``[]`` means none. ``seed``, ``gen_kwargs``,
    ``log_samples``, ``cache``: ``EvalTarget``'s (``ncpctl.evaluate.settings`` parses the flags).
    """
    from ncpctl.evaluate.heldout import parse_spec

    from ncpctl.checkpoint import resolve, run_dir_of

    p = Path(target)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        from ncpctl.recipe import load_recipe

        r = load_recipe(p, sets)
        ckpt, ev, run_dir = resolve(r.run_dir), r.eval, r.run_dir
    else:
        if sets:
            raise UserError("--set applies to recipes; a checkpoint carries its own recipe",
                            hint="pass the recipe instead, or use --tasks/--limit/--batch-size")
        ckpt = resolve(p)
        ev, run_dir = _checkpoint_eval(ckpt), run_dir_of(ckpt) or ckpt
    tasks = list(ev.tasks) if tasks is None else tasks
    specs = list(ev.heldout) if heldout is None else [parse_spec(h) if isinstance(h, str) else h for h in heldout]
    if not tasks and not specs:
        raise UserError("no tasks to evaluate", hint="pass --tasks (e.g. --tasks ncp_offline) or --heldout FILES, "
                        "or set eval.tasks / eval.heldout in the recipe")
    return EvalTarget(ckpt, Path(out) if out else run_dir / "eval", tasks, batch_size or ev.batch_size,
                      limit if limit is not None else ev.limit,
                      num_fewshot if num_fewshot is not None else ev.num_fewshot, specs, diffusion_samples,
                      seed=tuple(seed) if seed is not None else DEFAULT_SEED, gen_kwargs=gen_kwargs,
                      log_samples=log_samples, cache=cache)


def _checkpoint_eval(ckpt: Path):  # -> EvalSection
    """The ``eval`` section of the resolved recipe in the checkpoint's ncpctl.json (the schema
    defaults when it carries no recipe, e.g. a checkpoint written by a script)."""
    from pydantic import ValidationError

    from ncpctl.checkpoint import META, read_meta
    from ncpctl.recipe.schema import EvalSection

    raw = (read_meta(ckpt).get("recipe") or {}).get("eval") or {}
    try:
        return EvalSection.model_validate(raw)
    except ValidationError as e:
        raise UserError(*(f"{ckpt / META}: recipe eval.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                          for err in e.errors()), hint="pass --tasks/--limit/--batch-size/--num-fewshot") from None


def our_tasks(tasks_dir: Path = TASKS_DIR) -> dict[str, dict[str, Any]]:
    """Our task and group YAMLs by name (a loader that ignores ``!function`` tags)."""
    class _L(yaml.SafeLoader):
        pass

    _L.add_constructor("!function", lambda loader, node: None)
    out = {}
    for f in sorted(tasks_dir.glob("*.yaml")):
        d = yaml.load(f.read_text(), Loader=_L)  # noqa: S506 - SafeLoader subclass
        out[d.get("group") or d.get("task")] = d
    return out


def leaves(name: str | dict[str, Any], ours: dict[str, dict[str, Any]]) -> list[str]:
    if isinstance(name, dict):  # a group member with overrides: {task: NAME, num_fewshot: N}
        name = name.get("task") or name.get("group")
    d = ours.get(name)
    if d is None or "group" not in d:
        return [name]
    return [leaf for t in d["task"] for leaf in leaves(t, ours)]


def unknown_tasks(names: list[str], tasks_dir: Path = TASKS_DIR) -> list[str]:
    """The names in ``names`` that are neither ours (``ncpctl/evaluate/tasks``) nor lm-eval's, each as
    one line (a recipe's ``train.eval_tasks`` is checked with it before training starts). lm-eval's
    own index (~10 s) is read only when a name is not one of ours."""
    ours = our_tasks(tasks_dir)
    rest = [n for n in names if n not in ours]
    if not rest:
        return []
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir), include_defaults=True)
    known = set(tm.all_tasks) | set(getattr(tm, "all_groups", []))
    return [f"task {n}: unknown to lm-eval" + (f" (did you mean {', '.join(near)}?)" if near else "")
            for n in rest if n not in known for near in [[k for k in known if n in k][:3]]]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def load_tasks(names: list[str], metadata: dict[str, Any], tasks_dir: Path = TASKS_DIR, allow_code: bool = False,
               skip: Callable[[str], None] = lambda m: None, tm: Any = None) -> tuple[Any, list[Any], list[Any]]:
    """(TaskManager, loaded task/group objects, protocols). lm-eval's own ~200 task folders are
    indexed only when a name is not one of ours (that takes ~10 s). Every task that cannot be
    loaded is reported at once, one line each; a protocol group (``ncpctl.evaluate.protocol``)
    instead skips a member it cannot load with one line through ``skip`` and runs the others.
    ``tm``: a TaskManager from an earlier call with the same names (the training loop's evaluations
    reuse theirs: indexing lm-eval's tasks again would cost its ~10 s at every evaluation)."""
    from ncpctl.evaluate import hub, protocol

    ours = our_tasks(tasks_dir)
    hub.check(names, ours, skip)  # before lm-eval's loaders meet an unreachable hub, task after task
    from lm_eval.tasks import TaskManager

    defaults = any(leaf not in ours for n in names for leaf in leaves(n, ours))
    tm = tm or TaskManager(include_path=str(tasks_dir), include_defaults=defaults, metadata=metadata)
    known = set(tm.all_tasks) | set(getattr(tm, "all_groups", []))
    problems, objs, protocols = [], [], []
    for name in names:
        p = protocol.protocol_of(name, ours)
        if p is not None:
            protocol.check_known(p, known)
            objs += protocol.load_members(p, tm, allow_code, skip)
            protocols.append(p)
            continue
        if name not in known:
            near = [k for k in known if name in k][:3]
            problems.append(f"task {name}: unknown to lm-eval" + (f" (did you mean {', '.join(near)}?)" if near else ""))
            continue
        try:
            loaded = tm.load([name])
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a task's data loader can raise anything
            failing = []
            for leaf in leaves(name, ours):  # name the task(s) whose data is unreachable
                if leaf == name:
                    continue
                try:
                    tm.load([leaf])
                except Exception as e2:  # noqa: BLE001
                    failing.append(f"task {leaf} (in {name}): cannot load its data ({_first_line(e2)})")
            problems += failing or [f"task {name}: cannot load its data ({_first_line(e)})"]
            continue
        top = loaded["groups"].get(name) or loaded["tasks"].get(name)
        objs += [top] if top is not None else list(loaded["tasks"].values())
    if problems:
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        why = " (the hub is unreachable)" if hub.went_offline else \
            " (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE are set)" if offline else ""
        raise UserError(*problems, hint=f"hub datasets need the network or a local datasets cache{why}; "
                        "the offline tasks are `ncp_offline`")
    return tm, objs, protocols


class _DropMetadataAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def _quiet_git_hash():
    """lm-eval records ``git describe`` of the working directory and lets git's stderr through:
    outside a repository every eval printed ``fatal: not a git repository``. The same lookup with
    git's stderr discarded (the results' ``git_hash`` is unchanged: None outside a repository)."""
    import subprocess

    from lm_eval import evaluator
    from lm_eval.loggers import utils as log_utils

    def git_hash():
        try:
            out = subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL)  # noqa: S607
            return out.strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return log_utils.get_commit_from_path(os.getcwd())

    before = getattr(evaluator, "get_git_commit_hash", None)
    if before is not None:
        evaluator.get_git_commit_hash = git_hash
    try:
        yield git_hash
    finally:
        if before is not None:
            evaluator.get_git_commit_hash = before


def quiet_lm_eval() -> None:
    """lm-eval's loggers at WARNING. Our offline tasks build their data with a custom_dataset
    function; lm-eval then advises about `--metadata` once per task, which is noise for our users."""
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropMetadataAdvice) for f in task_log.filters):
        task_log.addFilter(_DropMetadataAdvice())


def set_shots(objs: list[Any], num_fewshot: int | None) -> None:
    """``--num-fewshot`` on every leaf task of ``objs``, 0-shot ones included (lm-eval never overrides
    a task whose config says 0, so a paper group's 0-shot members kept 0 under any override)."""
    if num_fewshot is None:
        return
    for obj in objs:
        for task in obj.get_all_tasks() if hasattr(obj, "get_all_tasks") else [obj]:
            task.set_config(key="num_fewshot", value=num_fewshot)


def score(lm, tm, objs: list[Any], protocols: list[Any], limit: int | float | None, num_fewshot: int | None,
          batch_size: int, metadata: dict[str, Any], bootstrap_iters: int = 1000, seed: tuple = DEFAULT_SEED,
          gen_kwargs: dict[str, Any] | None = None, keep_samples: bool = False) -> dict[str, Any]:
    """lm-eval's results object for ``lm`` on the loaded tasks ``objs`` (``load_tasks``), plus our
    ``perplexity`` summary, the paper ``aggregates`` and ``per_example``: what ``ncpctl eval`` writes
    and the training loop's in-loop evaluation logs (``ncpctl.train.downstream``), one code path for
    both. ``bootstrap_iters``: lm-eval's bootstrap of the stderr of non-mean metrics (a process pool;
    the training loop passes 0); ``seed``: lm-eval's four seeds; ``keep_samples``: lm-eval's logged
    samples stay in the result (``samples``). Ranks of a data-parallel evaluation all call it; the
    others get {}."""
    from lm_eval import simple_evaluate

    from ncpctl.evaluate.protocol import aggregate
    from ncpctl.evaluate.quiet import no_progress_bars

    set_shots(objs, num_fewshot)
    r, n, t, f = seed
    with _quiet_git_hash(), no_progress_bars():
        res = simple_evaluate(model=lm, tasks=objs, task_manager=tm, limit=limit, num_fewshot=None,
                              batch_size=batch_size, log_samples=True, bootstrap_iters=bootstrap_iters,
                              metadata=metadata, gen_kwargs=gen_kwargs or None, random_seed=r, numpy_random_seed=n,
                              torch_random_seed=t, fewshot_random_seed=f)
    if hasattr(lm, "gather_stats"):
        lm.gather_stats()  # a collective: before the ranks without results leave
    if res is None:  # lm-eval returns the results only where LOCAL_RANK is 0 (an in-loop evaluation's other ranks)
        return {}
    samples = res.pop("samples", None) or {}
    res["per_example"] = per_example(samples)
    res["perplexity"] = perplexity_summary(res["results"], lm.token_stats, res.get("configs"))
    scores = {**res["results"], **res.get("groups", {})}
    res["aggregates"] = {p.name: aggregate(p, scores, res.get("group_subtasks")) for p in protocols}
    if keep_samples:
        res["samples"] = samples
    return res


def per_example(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[Any]]]:
    """{task: {"doc_id": [...], metric: [...]}} from lm-eval's logged samples (``ncpctl.evaluate.samples``)."""
    from ncpctl.evaluate import samples as logged

    return {task: pe for task, rows in samples.items() if (pe := logged.per_example(rows))}


def _load_in_turn(lm, load: Callable[[], Any]) -> Any:
    """``load()`` on rank 0 first (it builds the offline tasks' files), then on the other ranks of a
    data-parallel evaluation; a failure on any rank is raised on all of them."""
    got, err = None, None
    anywhere = getattr(lm, "any", lambda flag: flag)  # one process (an lm-eval LM of a test): itself
    for first in (True, False):
        if (lm.rank == 0) == first:
            try:
                got = load()
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                err = e
        if anywhere(err is not None):
            raise err or UserError("another rank could not load the tasks (see its error)")
    return got


def _open_lm(t: EvalTarget, ranks: Any, log: Callable[[str], None]):
    """NCPLM on the checkpoint, on this rank's device, with the request cache (``ncpctl.evaluate.cache``)."""
    from ncpctl.evaluate import cache, parallel
    from ncpctl.evaluate.lm import NCPLM

    device = parallel.init(ranks) if ranks.world > 1 else None
    store = None
    if t.cache:
        store = cache.RequestCache(t.out_dir / "cache" / f"{t.checkpoint.name}.sqlite",
                                   cache.checkpoint_identity(t.checkpoint))
        if len(store):
            log(f"request cache {store.path}: {len(store)} answers of this checkpoint kept (--no-cache: score anew)")
    return NCPLM(str(t.checkpoint), batch_size=t.batch_size, device=device, cache=store, ranks=ranks,
                 noised_context=t.noised_context,
                 **({"diffusion_samples": t.diffusion_samples} if t.diffusion_samples else {}))


def evaluate(t: EvalTarget, log: Callable[[str], None] = lambda m: None, lm=None) -> dict[str, Any] | None:
    """Run lm-eval on ``t``; add to the checkpoint's results JSON and markdown; return the summary of
    what this call scored. Under a launcher every rank scores its share and rank 0 writes (the
    other ranks return None)."""
    from ncpctl.evaluate import heldout, offline, parallel

    ranks = parallel.launched() if lm is None else parallel.Ranks()
    say = log if ranks.rank == 0 else (lambda m: None)
    # held-out corpora first: a corpus with no text is an error before lm-eval and the model load
    corpora = heldout.prepare(t.heldout, t.tasks, lm.tok if lm is not None else _tokenizer(t.checkpoint)) \
        if t.heldout else {}
    quiet_lm_eval()
    t0 = time.time()
    lm = lm if lm is not None else _open_lm(t, ranks, say)
    # a data.mix checkpoint: conceptlm_val_ppl per component (conceptlm_val_ppl_NAME), as training validates
    names, per_component = offline.mixture_tasks(t.tasks, t.checkpoint)
    offline.say_mixture(names, t.checkpoint, say)
    meta = {"checkpoint": str(t.checkpoint)}
    tm, objs, protocols = _load_in_turn(lm, lambda: load_tasks(names, meta, allow_code=t.allow_code, skip=say))
    objs += per_component + heldout.tasks(corpora)
    if not objs:
        raise UserError(f"none of {', '.join(t.tasks)} can run on this machine (see the skipped lines above)",
                        hint="hub datasets need the network or a local datasets cache")
    names = [*names, *(o.config.task for o in per_component), *corpora]
    say(f"evaluating {t.checkpoint} on {', '.join(names)}" + (f" (limit {t.limit})" if t.limit else "")
        + (f" on {ranks.world} ranks" if ranks.world > 1 else ""))
    res = score(lm, tm, objs, protocols, t.limit, t.num_fewshot, t.batch_size, meta, seed=t.seed,
                gen_kwargs=t.gen_kwargs, keep_samples=t.log_samples)
    if ranks.rank != 0:
        return None
    res["likelihood"] = likelihood = getattr(lm, "likelihood", {"kind": "exact"})
    res["request"] = _request(t, likelihood, corpora, ranks.world)
    counts = {"requests": getattr(lm, "requests", None), "model_requests": getattr(lm, "model_requests", None)}
    return _write(t, res, counts, time.time() - t0, say)


def _request(t: EvalTarget, likelihood: dict[str, Any], corpora: dict[str, Any], world: int) -> dict[str, Any]:
    """What was asked (``ncpctl eval --compare`` evaluates a run without results the same way)."""
    return {"checkpoint": str(t.checkpoint), "tasks": t.tasks, "limit": t.limit, "batch_size": t.batch_size,
            "num_fewshot": t.num_fewshot, "diffusion_samples": likelihood.get("samples"), "seed": list(t.seed),
            "gen_kwargs": t.gen_kwargs, "log_samples": t.log_samples, "cache": t.cache, "ranks": world,
            "heldout": [dict(s.model_dump(exclude_defaults=True), label=lab) for s, lab in zip(t.heldout, corpora)]}


def _write(t: EvalTarget, res: dict[str, Any], counts: dict[str, int | None], seconds: float,
           log: Callable[[str], None]) -> dict[str, Any]:
    """The results JSON (merged into the checkpoint's earlier results: ``ncpctl.evaluate.accumulate``),
    the logged samples, the markdown; the summary of this call."""
    import datetime

    from lm_eval.utils import handle_non_serializable

    from ncpctl.evaluate import accumulate, report, samples, settings

    tag = t.checkpoint.name
    t.out_dir.mkdir(parents=True, exist_ok=True)
    js, md = t.out_dir / f"results_{tag}.json", t.out_dir / f"results_{tag}.md"
    logged = res.pop("samples", None)
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res["scored"] = {task: {"date": when, "settings": s} for task, s in settings.task_settings(res, res["request"]).items()}
    if logged is not None:
        res["samples"] = samples.write(logged, t.out_dir / f"samples_{tag}", t.out_dir)
        for task in res["samples"]:  # read back from the files (--compare, seed arms), not kept twice
            res["per_example"].pop(task, None)
    old = _read_results(js)
    merged, kept, dropped = accumulate.merge(old, res)
    for task, rel in ((old or {}).get("samples") or {}).items():  # a task re-scored without --log-samples
        if task not in (merged.get("samples") or {}) and (t.out_dir / rel).is_file():
            (t.out_dir / rel).unlink()
    if kept:
        log(f"{js.name} keeps the earlier results of {', '.join(kept)}")
    if dropped:
        log(f"{js.name}: dropped {', '.join(dropped)}: some of their members were re-scored alone (score the group "
            "again for its aggregate)")
    atomic_write(js, json.dumps(merged, indent=2, default=handle_non_serializable) + "\n")
    atomic_write(md, report.markdown(merged, str(t.checkpoint)))
    return {
        **res["request"], "likelihood": res["likelihood"],
        "results": metrics(res["results"]), "groups": metrics(res.get("groups", {})), "perplexity": res["perplexity"],
        "aggregates": res["aggregates"], "kept": kept, "samples": res.get("samples"), **counts,
        "files": {"json": str(js), "markdown": str(md)}, "seconds": round(seconds, 2),
    }


def _read_results(path: Path) -> dict[str, Any] | None:
    """The checkpoint's earlier results (None: none yet); an unreadable file stops before it is replaced."""
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable earlier results ({e}); new results would replace them",
                        hint="move the file away to start a new one") from None
    return old if isinstance(old, dict) and isinstance(old.get("results"), dict) else None


def _tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer alone (cheap), to read held-out corpora before the model loads."""
    from tokenizers import Tokenizer

    from ncpctl.checkpoint import TOKENIZER
    from ncpctl.interop.authors import steerling

    if steerling.detect(checkpoint):  # Steerling's layout: its tiktoken file, converted (issue 43)
        return steerling.tokenizer_of(checkpoint)
    path = checkpoint / TOKENIZER
    if not path.is_file():
        raise UserError(f"{path}: missing (needed to tokenize the held-out corpora)")
    return Tokenizer.from_file(str(path))


def metrics(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} with lm-eval's ``metric,filter`` keys simplified."""
    out: dict[str, dict[str, float]] = {}
    for task, m in results.items():
        row = {}
        for k, v in m.items():
            if "," not in k or "_stderr" in k or not isinstance(v, (int, float)):
                continue
            metric, flt = k.split(",", 1)
            row[metric if flt in ("none", "first_identifier") else f"{metric}[{flt}]"] = v
            se = m.get(f"{metric}_stderr,{flt}")
            if isinstance(se, (int, float)):
                row[(metric if flt in ("none", "first_identifier") else f"{metric}[{flt}]") + "_stderr"] = se
        if row:
            out[task] = row
    return out


def _scored_split(config: dict[str, Any] | None) -> str | None:
    """The split lm-eval scored for a task (its ``test_split``, else ``validation_split``)."""
    if not config:
        return None
    split = config.get("test_split") or config.get("validation_split")
    return None if split is None else str(split)


def perplexity_summary(results: dict[str, dict[str, Any]], stats: dict[str, dict[str, float]],
                       configs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every task with a perplexity metric and scored tokens is a set (``per_set``: its own value,
    its ``unit``, the ``split`` scored); the held-out ones are averaged: a set whose scored split
    is a training split (``train``, e.g. lm-eval's ``pile_10k``) is listed, never averaged.
    ``rule`` says in words which sets the average takes, in which units."""
    sets = {}
    for task, m in results.items():
        reported = {k.split(",")[0]: v for k, v in m.items()
                    if "," in k and k.split(",")[0] in PPL_METRICS and isinstance(v, (int, float))}
        st = stats.get(task)
        if not reported or not st or not st["tokens"]:
            continue
        metric = next(name for name in PPL_METRICS if name in reported)
        split = _scored_split((configs or {}).get(task))
        sets[task] = {"metric": metric, "unit": PPL_UNITS[metric], "value": float(reported[metric]), "split": split,
                      "averaged": split is None or split.split("[")[0] != "train",
                      "token_perplexity": math.exp(st["nll"] / st["tokens"]), "tokens": int(st["tokens"]),
                      "nll": st["nll"]}
        if "mc_var" in st:  # a bound's Monte Carlo estimates (NCPLM: the CDLM's ELBO)
            sets[task].update(bound=True, nll_per_token=st["nll"] / st["tokens"],
                              nll_stderr=math.sqrt(st["mc_var"]) / st["tokens"])
        if "nll_noised" in st:  # and the CDLM's noised-context estimate (training's conditions; no bound)
            sets[task].update(noised_nll_per_token=st["nll_noised"] / st["tokens"],
                              noised_nll_stderr=math.sqrt(st["mc_var_noised"]) / st["tokens"])
    return summarize_sets(sets)


def summarize_sets(sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Both averages over the held-out sets of ``per_set`` entries, and the rule in words (also what
    ``ncpctl.evaluate.accumulate`` recomputes when results of several evaluations are merged)."""
    if not sets:
        return {}
    avg = {k: s for k, s in sets.items() if s["averaged"]}
    nll, n = sum(s["nll"] for s in avg.values()), sum(s["tokens"] for s in avg.values())
    excluded = [k for k in sets if k not in avg]
    terms = " + ".join(f"{k} [{s['unit']}]" for k, s in avg.items())
    rule = (f"mean_of_sets = ({terms}) / {len(avg)}: each held-out set's own perplexity in its own unit "
            "(the ConceptLM paper's Avg PPL)" if avg else "mean_of_sets: no held-out set")
    if excluded:
        rule += "; not averaged (scored on a training split): " + ", ".join(excluded)
    if any(s.get("bound") for s in sets.values()):
        rule += "; from ELBO bounds on the log-likelihood: every perplexity is an upper bound"
    return {"per_set": sets, "mean_of_sets": sum(s["value"] for s in avg.values()) / len(avg) if avg else None,
            "token_weighted": math.exp(nll / n) if avg else None, "averaged": list(avg), "excluded": excluded,
            "rule": rule}



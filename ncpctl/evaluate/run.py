"""``evaluate``: a checkpoint through lm-evaluation-harness, in-process (``ncpctl eval``).

Writes ``results_<tag>.json`` (lm-eval's results object plus our ``perplexity`` summary)
and ``results_<tag>.md`` (lm-eval's markdown table plus the perplexity summary) into
``run.dir/eval/`` (a checkpoint outside a run directory: ``CHECKPOINT/eval/``).

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
batch size, checkpoint), which ``ncpctl eval --compare`` reuses to evaluate a run the same way, and
each task's numeric per-example scores (``per_example``: ``doc_id`` and one list per metric), which
its seed arms pair on (``ncpctl.evaluate.compare_arms``).

A checkpoint whose log-likelihoods are bounds (a Causal Diffusion LM: its held-out ELBO,
``ncpctl.model.diffusion_elbo``) is scored with ``diffusion_samples`` Monte Carlo samples per
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
from ncpctl.fsutil import atomic_write

PPL_METRICS = ("token_perplexity", "perplexity", "word_perplexity", "byte_perplexity")  # preference order
# what each metric is a perplexity of (lm-eval's `perplexity` of loglikelihood tasks: per target
# continuation, e.g. LAMBADA's last word)
# lm-eval metrics that a bound on the log-likelihood makes upper bounds (marked in the table)
BOUND_METRICS = ("token_perplexity", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
PPL_UNITS = {"token_perplexity": "token perplexity", "perplexity": "target perplexity",
             "word_perplexity": "word perplexity", "byte_perplexity": "byte perplexity"}


@dataclass
class EvalTarget:
    checkpoint: Path
    out_dir: Path
    tasks: list[str]
    batch_size: int
    limit: int | None
    num_fewshot: int | None
    heldout: list[Any] = field(default_factory=list)  # [HeldoutSource], scored as tasks named by their labels
    diffusion_samples: int | None = None  # Monte Carlo samples of a bound's estimates (None: NCPLM's default)
    noised_context: bool = False  # a CDLM: its noised-context estimate beside the bound (--noised-context)
    allow_code: bool = False  # run code tasks: execute sampled programs (sandboxed; --allow-code-execution)


def resolve_target(target: str, sets: list[str], tasks: list[str] | None, batch_size: int | None,
                   limit: int | None, num_fewshot: int | None, out: str | None,
                   heldout: list[Any] | None = None, diffusion_samples: int | None = None) -> EvalTarget:
    """A recipe YAML (its run dir's newest checkpoint) or a checkpoint / run directory.

    Defaults come from the recipe's ``eval`` section: the YAML's, or the resolved recipe the
    checkpoint carries (style rule 7: a checkpoint needs nothing else). Flags win over both;
    ``tasks=[]`` (``--tasks ''``) means no lm-eval tasks, only the held-out corpora.
    ``heldout``: ``--heldout`` values (strings for ``ncpctl.evaluate.heldout.parse_spec``, or
    ``HeldoutSource``s) replacing ``eval.heldout``; ``[]`` means none.
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
                      num_fewshot if num_fewshot is not None else ev.num_fewshot, specs, diffusion_samples)


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


def _leaves(name: str | dict[str, Any], ours: dict[str, dict[str, Any]]) -> list[str]:
    if isinstance(name, dict):  # a group member with overrides: {task: NAME, num_fewshot: N}
        name = name.get("task") or name.get("group")
    d = ours.get(name)
    if d is None or "group" not in d:
        return [name]
    return [leaf for t in d["task"] for leaf in _leaves(t, ours)]


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
    from lm_eval.tasks import TaskManager

    from ncpctl.evaluate import protocol

    ours = our_tasks(tasks_dir)
    defaults = any(leaf not in ours for n in names for leaf in _leaves(n, ours))
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
            for leaf in _leaves(name, ours):  # name the task(s) whose data is unreachable
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
        raise UserError(*problems, hint="hub datasets need the network or a local datasets cache"
                        + (" (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE are set)" if offline else "")
                        + "; the offline tasks are `ncp_offline`")
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


def score(lm, tm, objs: list[Any], protocols: list[Any], limit: int | None, num_fewshot: int | None,
          batch_size: int, metadata: dict[str, Any], bootstrap_iters: int = 1000) -> dict[str, Any]:
    """lm-eval's results object for ``lm`` on the loaded tasks ``objs`` (``load_tasks``), plus our
    ``perplexity`` summary, the paper ``aggregates`` and ``per_example`` (``per_example``): what
    ``ncpctl eval`` writes and the training loop's in-loop evaluation logs (``ncpctl.train.downstream``),
    one code path for both. ``bootstrap_iters``: lm-eval's bootstrap of the stderr of non-mean metrics
    (a process pool; the training loop passes 0)."""
    from lm_eval import simple_evaluate

    from ncpctl.evaluate.protocol import aggregate

    with _quiet_git_hash():
        res = simple_evaluate(model=lm, tasks=objs, task_manager=tm, limit=limit, num_fewshot=num_fewshot,
                              batch_size=batch_size, log_samples=True, bootstrap_iters=bootstrap_iters,
                              metadata=metadata)
    if res is None:  # lm-eval returns the results only where LOCAL_RANK is 0 (an in-loop evaluation's other ranks)
        return {}
    res["per_example"] = per_example(res.pop("samples", None) or {})
    res["perplexity"] = perplexity_summary(res["results"], lm.token_stats, res.get("configs"))
    res["aggregates"] = {p.name: aggregate(p, {**res["results"], **res.get("groups", {})}) for p in protocols}
    return res


def per_example(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[Any]]]:
    """{task: {"doc_id": [...], metric: [per-example score, ...]}} from lm-eval's logged samples: the
    numeric per-example scores only (``acc``, ``exact_match``; a perplexity's (loglikelihood, weight)
    pairs are left out), one list per metric (``metric[filter]`` as in ``metrics``), in doc_id order
    (what ``ncpctl eval --compare``'s paired bootstrap pairs on)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for task, rows in samples.items():
        by_doc: dict[int, dict[str, float]] = {}
        for row in rows:
            flt = row.get("filter", "none")
            for m in row.get("metrics") or []:
                v = row.get(m)
                if isinstance(v, bool) or isinstance(v, (int, float)):
                    key = m if flt in ("none", "first_identifier") else f"{m}[{flt}]"
                    by_doc.setdefault(int(row["doc_id"]), {})[key] = float(v)
        if by_doc:
            ids = sorted(by_doc)
            keys = list(dict.fromkeys(k for d in by_doc.values() for k in d))
            out[task] = {"doc_id": ids, **{k: [by_doc[i].get(k) for i in ids] for k in keys}}
    return out


def evaluate(t: EvalTarget, log: Callable[[str], None] = lambda m: None, lm=None) -> dict[str, Any]:
    """Run lm-eval on ``t``; write the JSON and markdown; return the summary."""
    from ncpctl.evaluate import heldout, offline

    # held-out corpora first: a corpus with no text is an error before lm-eval and the model load
    corpora = heldout.prepare(t.heldout, t.tasks, lm.tok if lm is not None else _tokenizer(t.checkpoint)) \
        if t.heldout else {}
    from lm_eval.utils import handle_non_serializable, make_table

    from ncpctl.evaluate.lm import NCPLM

    quiet_lm_eval()
    t0 = time.time()
    if lm is None:
        lm = NCPLM(str(t.checkpoint), batch_size=t.batch_size, noised_context=t.noised_context,
                   **({"diffusion_samples": t.diffusion_samples} if t.diffusion_samples else {}))
    # a data.mix checkpoint: conceptlm_val_ppl per component (conceptlm_val_ppl_NAME), as training validates
    names, per_component = offline.mixture_tasks(t.tasks, t.checkpoint)
    tm, objs, protocols = load_tasks(names, {"checkpoint": str(t.checkpoint)}, allow_code=t.allow_code, skip=log)
    objs += per_component + heldout.tasks(corpora)
    if not objs:
        raise UserError(f"none of {', '.join(t.tasks)} can run on this machine (see the skipped lines above)",
                        hint="hub datasets need the network or a local datasets cache")
    names = [*names, *(o.config.task for o in per_component), *corpora]
    log(f"evaluating {t.checkpoint} on {', '.join(names)}" + (f" (limit {t.limit})" if t.limit else ""))
    res = score(lm, tm, objs, protocols, t.limit, t.num_fewshot, t.batch_size, {"checkpoint": str(t.checkpoint)})
    ppl, aggregates = res["perplexity"], res["aggregates"]
    likelihood = getattr(lm, "likelihood", {"kind": "exact"})
    res["likelihood"] = likelihood
    res["request"] = request = {
        "checkpoint": str(t.checkpoint), "tasks": t.tasks, "limit": t.limit, "batch_size": t.batch_size,
        "num_fewshot": t.num_fewshot, "diffusion_samples": likelihood.get("samples"),
        "heldout": [dict(s.model_dump(exclude_defaults=True), label=lab) for s, lab in zip(t.heldout, corpora)]}
    tag = t.checkpoint.name
    t.out_dir.mkdir(parents=True, exist_ok=True)
    js, md = t.out_dir / f"results_{tag}.json", t.out_dir / f"results_{tag}.md"
    atomic_write(js, json.dumps(res, indent=2, default=handle_non_serializable) + "\n")
    table = make_table(res) + ("\n" + make_table(res, "groups") if res.get("groups") else "")
    atomic_write(md, f"# {t.checkpoint}\n\n{_likelihood_line(likelihood)}{table}\n{_ppl_markdown(ppl)}"
                 f"{_aggregates_markdown(aggregates)}")
    return {
        **request, "likelihood": likelihood,
        "results": metrics(res["results"]), "groups": metrics(res.get("groups", {})), "perplexity": ppl,
        "aggregates": aggregates,
        "files": {"json": str(js), "markdown": str(md)}, "seconds": round(time.time() - t0, 2),
    }


def _aggregates_markdown(aggregates: dict[str, dict[str, Any]]) -> str:
    """The paper aggregates (``ncpctl.evaluate.protocol``), each with its rule in words."""
    lines = []
    for group, a in aggregates.items():
        lines += ["", f"## {group}: {a['name']}", "", "| task | metric | score |", "|---|---|---:|"]
        lines += [f"| {k} | {a['metrics'][k]} | {_num(v)} |" for k, v in a["scores"].items()]
        lines += [f"| {s} AVG | | {_num(v)} |" for s, v in a["sections"].items()]
        lines += [f"| **{a['name']}** | {a['rule']} | {_num(a['value'])} |", "", f"- rule: {a['rule_text']}", ""]
    return "\n".join(lines)


def _likelihood_line(likelihood: dict[str, Any]) -> str:
    """A results file's note on a bound (nothing for exact log-likelihoods)."""
    if likelihood.get("kind") != "bound":
        return ""
    return (f"Log-likelihoods are bounds: {likelihood['estimator']}, {likelihood['samples']} samples per request; "
            "perplexities from them are upper bounds.\n\n")


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


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.4f}"


def _unit(v: dict[str, Any]) -> str:
    """A set's unit, marked when its perplexity comes from a bound (an upper bound on the perplexity)."""
    return f"{v['unit']}, bound" if v.get("bound") else v["unit"]


def _ppl_markdown(ppl: dict[str, Any]) -> str:
    if not ppl:
        return ""
    lines = ["", "## Perplexity across sets", "",
             "| set | unit (lm-eval metric) | split | value | averaged | scored tokens | token perplexity |",
             "|---|---|---|---:|---|---:|---:|"]
    lines += [f"| {k} | {_unit(v)} ({v['metric']}) | {v['split'] or ''} | {v['value']:.4f} | "
              f"{'yes' if v['averaged'] else 'no: training split'} | {v['tokens']} | {v['token_perplexity']:.4f} |"
              for k, v in ppl["per_set"].items()]
    lines += ["", f"- mean of per-set perplexities (the `value` column of the averaged sets; the ConceptLM paper's "
              f"Avg PPL): {_num(ppl['mean_of_sets'])}",
              f"- rule: {ppl['rule']}",
              f"- token-weighted perplexity (the averaged sets' scored tokens pooled): {_num(ppl['token_weighted'])}",
              ""]
    return "\n".join(lines)


def rich_table(summary: dict[str, Any]):
    from rich.table import Table
    from rich.text import Text

    lik = summary.get("likelihood") or {}
    note = f" (log-likelihoods: ELBO bound, {lik['samples']} Monte Carlo samples)" if lik.get("kind") == "bound" else ""
    table = Table(title=f"{summary['checkpoint']}{note}", title_justify="left")
    for col, just in (("task", "left"), ("metric", "left"), ("value", "right"), ("± stderr", "right")):
        table.add_column(col, justify=just)
    for section in ("results", "groups"):
        for task, m in summary[section].items():
            for k, v in m.items():
                if k.endswith("_stderr"):
                    continue
                se = m.get(k + "_stderr")
                shown = f"{k} (upper bound)" if note and k.split("[")[0] in BOUND_METRICS else k
                table.add_row(task, shown, f"{v:.4f}", f"{se:.4f}" if isinstance(se, float) and not math.isnan(se) else "")
    ppl = summary.get("perplexity") or {}
    if ppl:
        table.add_section()
        for task, v in ppl["per_set"].items():  # each set's unit, and whether the average takes it
            table.add_row(task, _unit(v) + ("" if v["averaged"] else " (training split: not averaged)"),
                          f"{v['value']:.4f}", "")
            if v.get("bound"):  # the bound itself, nats per token, with its Monte Carlo error
                table.add_row(task, "NLL bound per token (ELBO, nats)", f"{v['nll_per_token']:.4f}",
                              f"{v['nll_stderr']:.4f}")
            if "noised_nll_per_token" in v:
                table.add_row(task, "noised-context loss per token (training's conditions; no bound)",
                              f"{v['noised_nll_per_token']:.4f}", f"{v['noised_nll_stderr']:.4f}")
        table.add_row("perplexity sets", "mean of per-set ppl (paper's average)", _num(ppl["mean_of_sets"]), "")
        table.add_row("perplexity sets", "token-weighted ppl (tokens pooled)", _num(ppl["token_weighted"]), "")
        table.caption, table.caption_justify = Text(ppl["rule"]), "left"  # Text: its [unit]s are not markup
    _aggregate_rows(table, summary.get("aggregates") or {})
    return table


def _aggregate_rows(table, aggregates: dict[str, dict[str, Any]]) -> None:
    """A paper group's section AVGs and its aggregate, named as the paper names it; the rule goes
    into the caption (one line per group)."""
    from rich.text import Text

    rules = []
    for group, a in aggregates.items():
        table.add_section()
        for s, v in a["sections"].items():
            table.add_row(group, f"{s} AVG ({a['rule']})", _num(v), "")
        table.add_row(group, f"{a['name']} ({a['rule']})", _num(a["value"]), "")
        rules.append(f"{group}: {a['rule_text']}")
    if rules:
        before = table.caption.plain + "\n" if isinstance(table.caption, Text) else ""
        table.caption, table.caption_justify = Text(before + "\n".join(rules)), "left"



"""Downstream evaluation inside the training loop (``train.eval_tasks`` every ``train.eval_tasks_every``
steps and at the end; issue 26 item 3), as gpt-neox and OLMo-core do it.

The live module answers lm-eval's requests through the same lm-eval model as ``ncpctl eval``
(``ncpctl.evaluate.lm.NCPLM`` with ``live=True``: no checkpoint is written or read, the weights stay
where and in the dtype they train) and the same scoring path (``ncpctl.evaluate.run.score``), with the
recipe's ``eval.limit`` / ``eval.num_fewshot`` / ``eval.batch_size``: on a CPU run (fp32) the numbers
at step N are those of ``ncpctl eval`` of the step-N checkpoint. A bf16 run scores in bf16 (the
checkpoint holds fp32 upcasts of the same weights; ``ncpctl eval`` scores in fp32 by default).

Every rank scores the same requests in the same order, so every rank runs the same forwards: under
ZeRO-3 each layer's parameters are gathered on all ranks at once (a rank that skipped a forward would
leave the others waiting in the gather). Rank 0 writes the record. The offline tasks' data is built by
rank 0 before the others read it (``prepare``, before training starts; a task whose data cannot be
loaded stops the run there, every rank at once).

What training sees is unchanged: the time is kept out of ``step_time`` and the rates (the loop times
only its optimizer steps), the module goes back to train mode, and every RNG state (Python, numpy,
torch, CUDA; lm-eval reseeds them all) is put back, so the run is the same as one without it.

Record (metrics.jsonl, ``"split": "downstream"``): ``step``, ``seconds``, and ``eval/<task>/<metric>``
for every task and group metric (lm-eval's ``metric,filter`` simplified as ``ncpctl eval`` does), and
``eval/<group>/<aggregate>`` for a paper table's aggregate (``ncpctl.evaluate.protocol``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ncpctl.checkpoint import LoadedModel
from ncpctl.errors import UserError
from ncpctl.evaluate.run import metrics, quiet_lm_eval, score

SPLIT = "downstream"
_TASK_MANAGERS: dict[tuple[str, ...], Any] = {}  # train.eval_tasks -> its lm-eval TaskManager (indexed once)


def due(train: Any, step: int, last: bool) -> bool:
    """Whether the in-loop evaluation runs after ``step`` (``last``: the run's final step)."""
    if not train.eval_tasks:
        return False
    return last or (train.eval_tasks_every > 0 and step % train.eval_tasks_every == 0)


def _data_dir(recipe: Any) -> Path | None:
    """The tokenized data with the validation split the offline tasks are built from, found as
    ``ncpctl eval`` finds it from a checkpoint of this run (``ncpctl.evaluate.offline.data_dir_for``):
    run.dir/data, else beside data.val_prefix."""
    cands = [recipe.data_dir] + ([Path(recipe.data.val_prefix).parent] if recipe.data.val_prefix else [])
    return next((d for d in cands if (d / "val.idx").is_file() and (d / "val.bin").is_file()), None)


def _metadata(recipe: Any) -> dict[str, Any]:
    d = _data_dir(recipe)
    return {"data": str(d)} if d is not None else {}


def _load(run: Any) -> tuple[Any, list[Any], list[Any]]:
    """(TaskManager, task objects, protocols) of train.eval_tasks on this rank; rank 0 first (it builds
    the offline tasks' JSONL files, which the others then read); a failure on rank 0 stops every rank."""
    from ncpctl.evaluate.run import load_tasks

    d, names = run.d, list(run.recipe.train.eval_tasks)
    tm = _TASK_MANAGERS.get(tuple(names))
    got, err = None, None
    # any failure (not only a UserError) goes through the same all-reduces on every rank before it is
    # raised: a rank that raised alone would leave the others waiting in their next collective
    if d.rank == 0:
        try:
            got = load_tasks(names, _metadata(run.recipe), skip=run.info, tm=tm)
        except Exception as e:
            err = e
    if d.any(err is not None):
        raise err or UserError("train.eval_tasks: rank 0 could not load the tasks (see its error)")
    if d.rank != 0:
        try:
            got = load_tasks(names, _metadata(run.recipe), tm=tm)
        except Exception as e:
            err = e
    if d.any(err is not None):
        raise err or UserError("train.eval_tasks: a rank other than 0 could not load the tasks (see its error)")
    assert got is not None
    _TASK_MANAGERS[tuple(names)] = got[0]
    return got


def prepare(run: Any) -> None:
    """Before training: the model can be evaluated, and every task of train.eval_tasks loads (an
    unknown name was refused with the recipe)."""
    if not run.recipe.train.eval_tasks:
        return
    why = run.engine.module.objective.refusal("eval")
    if why:
        raise UserError(f"train.eval_tasks: {why}")

    quiet_lm_eval()
    _load(run)


def _live_lm(run: Any):
    """``NCPLM`` over the training module, with the run's tokenizer and resolved recipe."""
    from tokenizers import Tokenizer

    from ncpctl.evaluate.lm import NCPLM
    from ncpctl.train.checkpoint import tokenizer_file

    r = run.recipe
    tok_file = tokenizer_file(r)
    if not tok_file.is_file():
        raise UserError(f"train.eval_tasks: {tok_file}: no tokenizer (needed to score lm-eval requests)")
    loaded = LoadedModel(model=run.engine.module, config=r.model_config, tokenizer=Tokenizer.from_file(str(tok_file)),
                         meta={"recipe": r.to_dict()}, path=r.run_dir)
    return NCPLM(loaded=loaded, batch_size=r.eval.batch_size, device=str(run.d.device), live=True)


def evaluate(run: Any) -> dict[str, Any]:
    """The in-loop evaluation on every rank (collective under ZeRO-3); returns the record (every rank)."""
    from ncpctl.train.checkpoint import rng_state, set_rng_state

    r, engine = run.recipe, run.engine  # ranks other than local rank 0 get no results from lm-eval: rank 0 logs
    t0 = time.perf_counter()
    rng = rng_state()
    try:
        tm, objs, protocols = _load(run)
        lm = _live_lm(run)
        res = score(lm, tm, objs, protocols, r.eval.limit, r.eval.num_fewshot, r.eval.batch_size, _metadata(r),
                    bootstrap_iters=0)
    finally:
        engine.train()
        set_rng_state(rng)
    rec: dict[str, Any] = {"split": SPLIT, "step": run.tot.step, "seconds": time.perf_counter() - t0}
    for section in ("results", "groups"):
        for task, row in metrics(res.get(section) or {}).items():
            rec.update({f"eval/{task}/{k}": v for k, v in row.items() if not k.endswith("_stderr")})
    for group, a in (res.get("aggregates") or {}).items():
        if isinstance(a.get("value"), (int, float)):
            rec[f"eval/{group}/{a['name']}"] = a["value"]
    return rec


def line(rec: dict[str, Any]) -> str:
    """The record as one progress line."""
    scores = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in rec.items()
                       if k.startswith("eval/") and isinstance(v, (int, float)))
    return f"downstream at step {rec['step']} ({rec['seconds']:.1f} s): {scores}"

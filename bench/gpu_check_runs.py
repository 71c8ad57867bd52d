"""Section 9 of ``bench/gpu_check.py`` [real_runs]: what issue 27's features (bf16 at ZeRO 0,
``data.document_mask``, ``train.activation_checkpointing``, ``train.compile``) do on the device,
trained through the same DeepSpeed engines as sections 1-8 (``gpu_check``'s ``make_recipe``,
``build_engine``, ``timed``, ``_batch``, ``_mem``, ``release``, ``_free``: the caller passes
its module as ``h``). Four parts, each recorded on its own (a part that fails is written under
``errors`` with its traceback and the others still run):

a. ``bf16``: the ConceptLM at section 3's size, ZeRO stage 0, ``steps`` steps on one stream of
   ``batches`` random batches (cycled), once in fp32 and once in bf16 from the same seed (bf16 at
   stage 0 is DeepSpeed's ``FP16_UnfusedOptimizer``, whose init step ``engine._undo_init_step``
   takes back). Both loss curves; ``mean_abs_diff_last``: mean |bf16 - fp32| over the last
   ``last`` steps, judged within 0.05 nats (tests/train/test_bf16.py's bound on the CPU);
   ``adam_steps``: the inner AdamW's step count after the run (= steps: no hidden step). ``--dry``
   runs the bf16 arm in bf16 on the CPU too (DeepSpeed's same stage-0 wrapper, as the test does).
b. ``documents``: the ConceptLM at section 1's size, T and batch, ZeRO-1, with
   ``data.document_mask`` on: each batch packs random-length documents and its ``doc_ids`` reach
   ``engine(x, y, doc_ids=...)`` through the loop's own hooks (``Hooks.inputs`` ->
   ``DocumentHooks``, from the loader's ``last_documents``). A masked and an unmasked step per
   batch, alternating; the first masked step (FlexAttention compiles there on a GPU) is timed
   apart. ``masked_over_unmasked``: paired median step-time ratio. ``graphs``: dynamo's
   ``unique_graphs`` (and frames compiled) after each masked batch, counted from before the
   first: a new document layout is a new ``BlockMask`` (``patterns.document_masks``) that the
   compiled ``flex_attention`` must take as an input; ``no_recompile``: no graph after the first
   batch. ``mask_build_ms``: building one batch's token masks alone. ``flex``: whether the token
   layers ran FlexAttention (False on a GPU: it failed and was switched off for the process,
   ``flex_off`` says why). On the CPU the masks are boolean (no FlexAttention, no graphs: the
   check holds trivially there).
c. ``checkpointing``: the same engine with ``none`` / ``selective`` / ``full``
   (``ncpctl.train.recompute.apply_activation_checkpointing``, what ``train.activation_checkpointing``
   applies in ``build_engine``). Per mode one step from a freed allocator:
   ``peak_above_bytes`` = ``torch.cuda.max_memory_allocated`` over the step minus what was
   allocated before it (activations + gradient buffers + the optimizer's transients) and
   ``forward_end_bytes`` = allocated after the forward minus before (what the forward saved, and
   the loss), next to ``ncpctl.model.accounting_memory.activation_memory`` for the same config,
   T, batch and precision (flash SDPA): ``estimate_total_bytes`` / ``estimate_saved_bytes`` and
   the ratios measured / estimate (information, no check; None on the CPU). Then ``rounds``
   timed steps per mode, alternating: ``median_s``, ``over_none``.
d. ``compile``: the base model at section 1's size, T and batch, ZeRO-1, eager and with
   ``train.compile: true`` (``ncpctl.train.compiled``: each block compiled in place), same seed
   and batch. ``first_loss_diff`` (tolerance as section 3), the compiled engine's first
   ``warmup`` steps (``compile_s``: their time beyond as many compiled steps), then ``rounds``
   timed steps each, alternating: ``compiled_over_eager``; ``graphs``: dynamo graphs made during
   the warm-up and after it (0: nothing recompiles once warm). ``--dry`` compiles with backend
   ``eager`` (dynamo traces the blocks as on a GPU and runs the graphs without inductor; inductor's
   CPU compile took ~20 s on 2 cores, most of the dry run): ``backend`` says which.

Checks (into ``gpu_check``'s ``checks``): ``bf16_tracks_fp32_zero0`` (a), ``documents_no_recompile``
(b), ``compile_first_loss_matches_eager`` (d).
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ncpctl.profile.timing import paired_ratios

BF16_TOL = 0.05  # nats: tests/train/test_bf16.py's bound, fp32 vs bf16 on the CPU
MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class RunShapes:
    """Section 9's own counts (sizes, T and batch come from gpu_check's ``Shapes``)."""

    bf16_steps: int  # a: steps per precision
    bf16_batches: int  # a: distinct batches, cycled
    bf16_last: int  # a: the last steps compared
    doc_batches: int  # b: batches of different documents (the first compiles)
    doc_lengths: tuple[int, int]  # b: document lengths, uniform in [lo, hi]
    ckpt_rounds: int  # c: timed steps per mode
    compile_warmup: int  # d: compiled steps before timing
    compile_rounds: int  # d: timed steps per engine
    compile_backend: str  # d: torch.compile backend


GPU_RUNS = RunShapes(16, 4, 5, 5, (64, 1024), 2, 2, 3, "inductor")
DRY_RUNS = RunShapes(8, 4, 3, 3, (4, 32), 2, 1, 2, "eager")


def real_runs(sh: Any, env: Any, h: Any, dry: bool,
              progress: Callable[[dict[str, Any]], None] = lambda out: None) -> dict[str, Any]:
    """Section 9: parts a-d (module doc); ``h`` is gpu_check (its helpers), ``sh`` its Shapes;
    ``progress`` gets the result so far after each part (gpu_check rewrites its JSON)."""
    rs = DRY_RUNS if dry else GPU_RUNS
    out: dict[str, Any] = {"shapes": dict(vars(rs)), "errors": {}, "part_s": {}}

    def part(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # one failing part must not cost the others' numbers
            out["errors"][name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:]}
        finally:
            _free(env, h)
            out["part_s"][name] = round(time.perf_counter() - t0, 2)
            progress(out)

    part("bf16", lambda: bf16_vs_fp32(sh, rs, env, h))
    held: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        recipe = h.make_recipe(sh.train_size, sh.seq_len, sh.batch, "concept", 1, env,
                               4 * rs.doc_batches + 4 * rs.ckpt_rounds + 8, ("data.document_mask=true",))
        held.update(recipe=recipe, engine=h.build_engine(recipe, env))
        return {"size": sh.train_size, "variant": "concept", "zero_stage": 1}

    part("concept_engine", build)
    try:
        for name, fn in (("documents", documents_part), ("checkpointing", checkpointing_part)):
            if "engine" in held:
                part(name, lambda: fn(held["engine"], held["recipe"], sh, rs, env, h))
            else:
                out["errors"][name] = {"error": "needs the ConceptLM engine, which failed to build", "traceback": ""}
    finally:
        if "engine" in held:
            h.release(held.pop("engine"))
        _free(env, h)
    part("compile", lambda: compile_part(sh, rs, env, h))
    return out


def _free(env: Any, h: Any) -> None:
    """gpu_check's ``_free`` (garbage collection, the CUDA cache emptied) on a GPU only: on the CPU
    nothing reads the allocator, and each collection of this process costs ~0.2 s."""
    if env.on_gpu:
        h._free(env)


def checks(r: dict[str, Any]) -> dict[str, bool]:
    """Section 9's correctness verdicts, for the parts that ran."""
    out: dict[str, bool] = {}
    if "bf16" in r:
        out["bf16_tracks_fp32_zero0"] = r["bf16"]["ok"]
    if "documents" in r:
        out["documents_no_recompile"] = r["documents"]["no_recompile"] and r["documents"]["finite"]
    if "compile" in r:
        out["compile_first_loss_matches_eager"] = r["compile"]["first_loss_match"]
    return out


def _adam_steps(engine: Any) -> float | None:
    """The inner optimizer's step count (AdamW's bias-correction step), or None without state."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    return max(steps) if steps else None


def bf16_vs_fp32(sh: Any, rs: RunShapes, env: Any, h: Any) -> dict[str, Any]:
    """Part a: the same stream of batches in fp32 and in bf16 at ZeRO 0 from one seed."""
    from ncpctl.profile.step import engine_step, random_windows

    T, B, n = sh.seq_len, sh.batch, rs.bf16_steps
    runs: dict[str, Any] = {}
    windows = None
    for precision in ("fp32", "bf16"):
        recipe = h.make_recipe(sh.zero_size, T, B, "concept", 0, env, n + 2, (f"train.precision={precision}",))
        if windows is None:  # (B, T + 1) random windows, the same stream for both precisions
            windows = [w.to(env.device) for w in random_windows(recipe.model_config.vocab_size, B, T, 7, rs.bf16_batches)]
        engine = h.build_engine(recipe, env, seed=0)
        try:
            losses, secs = [], []
            for s in range(n):
                w = windows[s % len(windows)]
                dt, loss = h.timed(engine_step(engine, w[:, :-1], w[:, 1:]), env)
                losses.append(loss)
                secs.append(dt)
            runs[precision] = {"losses": losses, "median_s": statistics.median(secs[1:] or secs),
                               "optimizer": type(engine.optimizer).__name__, "adam_steps": _adam_steps(engine),
                               "finite": all(math.isfinite(v) for v in losses), "decreased": losses[-1] < losses[0]}
        finally:
            h.release(engine)
            _free(env, h)
    last = rs.bf16_last
    f, b = runs["fp32"]["losses"][-last:], runs["bf16"]["losses"][-last:]
    diff = sum(abs(x - y) for x, y in zip(f, b)) / last
    out = {"size": sh.zero_size, "variant": "concept", "zero_stage": 0, "seq_len": T, "batch": B, "steps": n,
           "batches": rs.bf16_batches, "last": last, "runs": runs, "mean_abs_diff_last": diff,
           "diff_of_means_last": abs(sum(b) / last - sum(f) / last),
           "first_loss_diff": abs(runs["fp32"]["losses"][0] - runs["bf16"]["losses"][0]), "tol": BF16_TOL}
    out["ok"] = (diff <= BF16_TOL and runs["bf16"]["adam_steps"] == n
                 and all(r["finite"] and r["decreased"] for r in runs.values()))
    return out


def packed_documents(B: int, T: int, lengths: tuple[int, int], seed: int) -> Any:
    """(B, T) int64 numpy: each row's per-token document index (0, 0, ..., 1, 1, ...), documents
    of lengths uniform in ``lengths`` (the last one cut by the window), as ``WindowLoader.documents``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        lens: list[int] = []
        while sum(lens) < T:
            lens.append(int(rng.integers(lengths[0], lengths[1] + 1)))
        rows.append(np.repeat(np.arange(len(lens)), lens)[:T])
    return np.stack(rows).astype(np.int64)


class _Packed:
    """The loader method ``DocumentHooks.inputs`` reads: the last batch's per-token document index."""

    def __init__(self, docs: Any):
        self.docs = docs

    def last_documents(self) -> Any:
        return self.docs


def _dynamo_counts() -> tuple[int, int]:
    """(graphs dynamo made, frames it compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(counters["frames"]["ok"])


def documents_part(engine: Any, recipe: Any, sh: Any, rs: RunShapes, env: Any, h: Any) -> dict[str, Any]:
    """Part b: masked (packed documents) vs unmasked steps of one engine, and dynamo's graphs."""
    import torch

    from ncpctl.model import patterns
    from ncpctl.profile.step import random_windows
    from ncpctl.profile.timing import timed as timed_call
    from ncpctl.train.hooks import Hooks

    T, B, n = sh.seq_len, sh.batch, rs.doc_batches
    model, hooks = engine.module, Hooks(recipe)
    windows = [w.to(env.device) for w in random_windows(recipe.model_config.vocab_size, B, T, 11, n)]
    docs = [packed_documents(B, T, rs.doc_lengths, 100 + i) for i in range(n)]

    def step(i: int, masked: bool) -> Callable[[], Any]:
        def run() -> Any:
            # the loop's path: the loader's documents -> DocumentHooks -> {"doc_ids": (B, T) on the device}
            (kw,) = hooks.inputs(_Packed(docs[i]), 1, B, env.device) if masked else ({},)
            o = engine(windows[i][:, :-1], windows[i][:, 1:], **kw)
            engine.backward(o.loss)
            engine.step()
            return o.loss.detach()

        return run

    h.timed(step(0, False), env)  # warm-up of the unmasked path
    g0 = _dynamo_counts()
    first_s, first_loss = h.timed(step(0, True), env)  # FlexAttention compiles here on a GPU
    graphs = [[c - c0 for c, c0 in zip(_dynamo_counts(), g0)]]
    secs: dict[str, list[float]] = {"masked": [], "unmasked": []}
    losses = [first_loss]
    for i in range(1, n):
        for masked in ((True, False) if i % 2 else (False, True)):
            dt, loss = h.timed(step(i, masked), env)
            secs["masked" if masked else "unmasked"].append(dt)
            if masked:
                losses.append(loss)
                graphs.append([c - c0 for c, c0 in zip(_dynamo_counts(), g0)])
    build = []
    for d in docs:  # h.timed reads a loss: the masks' own timing here
        doc = torch.from_numpy(d).to(env.device)
        build.append(timed_call(lambda: patterns.document_masks(set(model.token_patterns), doc),
                                env.device if env.on_gpu else None)[0])
    return {"size": sh.train_size, "seq_len": T, "batch": B, "batches": n, "doc_lengths": list(rs.doc_lengths),
            "documents_per_row": statistics.mean(int(d[r, -1]) + 1 for d in docs for r in range(B)),
            # False on a GPU: FlexAttention failed and is off for the process (flex_off says why)
            "flex": patterns.flex_enabled(env.device), "flex_off": patterns._FLEX_OFF, "first_masked_s": first_s,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in secs.items()},
            "masked_over_unmasked": paired_ratios(secs["masked"], secs["unmasked"])["paired_median"],
            "mask_build_ms": 1e3 * statistics.median(build), "masked_losses": losses,
            "finite": all(math.isfinite(v) for v in losses),
            "graphs": [g for g, _ in graphs], "frames": [f for _, f in graphs],
            "no_recompile": all(g == graphs[0] for g in graphs)}


def checkpointing_part(engine: Any, recipe: Any, sh: Any, rs: RunShapes, env: Any, h: Any) -> dict[str, Any]:
    """Part c: one engine, each checkpointing mode swapped in from outside; memory and step time."""
    import torch

    from ncpctl.model.accounting_memory import activation_memory
    from ncpctl.profile.step import engine_step
    from ncpctl.train.recompute import apply_activation_checkpointing

    T, B = sh.seq_len, sh.batch
    cfg = recipe.model_config
    est = activation_memory(cfg, T, B, "bf16" if env.bf16 else "fp32")  # flash SDPA: no T x T scores
    x, y = h._batch(cfg, B, T, env)
    modes: dict[str, Any] = {}
    try:
        for mode in MODES:
            n_mods = apply_activation_checkpointing(engine.module, mode)
            _free(env, h)
            if env.on_gpu:
                torch.cuda.reset_peak_memory_stats()
            before, after_fwd = h._mem(env, "memory_allocated"), []

            def probed() -> Any:
                o = engine(x, y)
                after_fwd.append(h._mem(env, "memory_allocated"))  # what the forward left saved (and the loss)
                engine.backward(o.loss)
                engine.step()
                return o.loss.detach()

            dt, loss = h.timed(probed, env)
            peak = h._mem(env, "max_memory_allocated")
            m = {"checkpointed_modules": n_mods, "first_step_s": dt, "loss": loss,
                 "estimate_total_bytes": est.total(mode), "estimate_saved_bytes": est.saved(mode),
                 "peak_above_bytes": None if before is None else peak - before,
                 "forward_end_bytes": None if before is None else after_fwd[0] - before}
            m["peak_over_estimate"] = None if before is None else m["peak_above_bytes"] / m["estimate_total_bytes"]
            m["forward_end_over_estimate"] = None if before is None else m["forward_end_bytes"] / m["estimate_saved_bytes"]
            modes[mode] = m
        step = engine_step(engine, x, y)
        secs: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rs.ckpt_rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                apply_activation_checkpointing(engine.module, mode)
                secs[mode].append(h.timed(step, env)[0])
    finally:
        apply_activation_checkpointing(engine.module, "none")
    for mode in MODES:
        modes[mode].update(seconds=secs[mode], median_s=statistics.median(secs[mode]),
                           over_none=paired_ratios(secs[mode], secs["none"])["paired_median"])
    return {"size": sh.train_size, "variant": "concept", "zero_stage": 1, "seq_len": T, "batch": B,
            "precision": est.dtype, "estimate_attention": est.attention, "modes": modes}


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """``build_engine`` compiles the blocks with ``backend`` (``compile_blocks``'s default: inductor)."""
    import ncpctl.train.compiled as compiled

    real = compiled.compile_blocks
    if backend != "inductor":
        compiled.compile_blocks = functools.partial(real, backend=backend)
    try:
        yield
    finally:
        compiled.compile_blocks = real


def compile_part(sh: Any, rs: RunShapes, env: Any, h: Any) -> dict[str, Any]:
    """Part d: the base model eager vs ``train.compile: true``, same seed and batch."""
    from ncpctl.profile.step import engine_step
    from ncpctl.train.compiled import why_not

    T, B, steps = sh.seq_len, sh.batch, rs.compile_warmup + rs.compile_rounds + 2
    engines: dict[str, Any] = {}
    try:
        engines["eager"] = h.build_engine(h.make_recipe(sh.train_size, T, B, "base", 1, env, steps), env, seed=0)
        with compile_backend(rs.compile_backend):
            recipe = h.make_recipe(sh.train_size, T, B, "base", 1, env, steps, ("train.compile=true",))
            engines["compiled"] = h.build_engine(recipe, env, seed=0)
        x, y = h._batch(recipe.model_config, B, T, env)
        run = {n: engine_step(e, x, y) for n, e in engines.items()}
        first_eager_s, first_eager = h.timed(run["eager"], env)
        g0 = _dynamo_counts()
        warm = [h.timed(run["compiled"], env) for _ in range(rs.compile_warmup)]
        g1 = _dynamo_counts()
        secs: dict[str, list[float]] = {n: [] for n in run}
        for r in range(rs.compile_rounds):
            for n in (list(run) if r % 2 == 0 else list(run)[::-1]):
                secs[n].append(h.timed(run[n], env)[0])
        g2 = _dynamo_counts()
        compiled_blocks = sum(getattr(m, "_compiled_call_impl", None) is not None for m in engines["compiled"].module.modules())
    finally:
        for e in engines.values():
            h.release(e)
    med = {n: statistics.median(s) for n, s in secs.items()}
    tol = 1e-2 if env.bf16 else 1e-4
    diff = abs(warm[0][1] - first_eager)
    return {"size": sh.train_size, "variant": "base", "zero_stage": 1, "seq_len": T, "batch": B,
            "backend": rs.compile_backend, "compiled_blocks": compiled_blocks,
            "eager_reason": why_not(1, env.on_gpu, rs.compile_backend),
            "first_loss": {"eager": first_eager, "compiled": warm[0][1]}, "first_loss_diff": diff,
            "first_loss_tol": tol, "first_loss_match": diff <= tol,
            "first_steps_s": {"eager": first_eager_s, "compiled": [dt for dt, _ in warm]},
            "compile_s": sum(dt for dt, _ in warm) - rs.compile_warmup * med["compiled"],
            "median_ms": {n: 1e3 * m for n, m in med.items()},
            "compiled_over_eager": paired_ratios(secs["compiled"], secs["eager"])["paired_median"],
            "graphs": {"warmup": g1[0] - g0[0], "after_warmup": g2[0] - g1[0]},
            "frames": {"warmup": g1[1] - g0[1], "after_warmup": g2[1] - g1[1]}}


def summary_lines(r: dict[str, Any]) -> list[str]:
    """gpu_check's summary lines for section 9."""
    lines = ["[9] real runs (issue 27)"]
    a = r.get("bf16")
    if a:
        f, b = a["runs"]["fp32"], a["runs"]["bf16"]
        lines.append(f"    a bf16 vs fp32, {a['size']} ConceptLM ZeRO-0, {a['steps']} steps: mean|diff| last {a['last']} "
                     f"{a['mean_abs_diff_last']:.4f} nats (tol {a['tol']}); fp32 {f['losses'][0]:.3f} -> {f['losses'][-1]:.3f}, "
                     f"bf16 {b['losses'][0]:.3f} -> {b['losses'][-1]:.3f} ({b['optimizer']}, AdamW steps {b['adam_steps']}); ok {a['ok']}")
    d = r.get("documents")
    if d:
        lines.append(f"    b document mask {d['size']} T={d['seq_len']} B={d['batch']} ({d['documents_per_row']:.1f} docs/row, "
                     f"flex {d['flex']}): masked/unmasked {d['masked_over_unmasked']:.3f} ({d['median_ms']['masked']:.1f} / "
                     f"{d['median_ms']['unmasked']:.1f} ms; first masked {d['first_masked_s']:.1f} s; masks {d['mask_build_ms']:.2f} ms); "
                     f"graphs per batch {d['graphs']}: no recompile {d['no_recompile']}")
    c = r.get("checkpointing")
    if c:
        for mode, m in c["modes"].items():
            mem = ("n/a" if m["peak_above_bytes"] is None else
                   f"{m['peak_above_bytes'] / 2**30:.2f} GiB ({m['peak_over_estimate']:.2f}x est.), forward end "
                   f"{m['forward_end_bytes'] / 2**30:.2f} GiB ({m['forward_end_over_estimate']:.2f}x)")
            lines.append(f"    c checkpointing {mode:9} {m['median_s'] * 1e3:8.1f} ms ({m['over_none']:.3f}x none), step peak "
                         f"above base {mem}; estimate {m['estimate_total_bytes'] / 2**30:.3f} GiB")
    k = r.get("compile")
    if k:
        lines.append(f"    d compile ({k['backend']}, {k['compiled_blocks']} blocks) {k['size']}: compiled/eager "
                     f"{k['compiled_over_eager']:.3f} ({k['median_ms']['compiled']:.1f} / {k['median_ms']['eager']:.1f} ms), "
                     f"compile {k['compile_s']:.1f} s, first-loss diff {k['first_loss_diff']:.2e} (tol {k['first_loss_tol']:g}), "
                     f"graphs {k['graphs']}")
    lines += [f"    ERROR in {n}: {e['error']}" for n, e in r.get("errors", {}).items()]
    return lines

"""Run the chosen ``profile-kernels`` sections for a recipe and collect one result dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ncpctl.profile import DEFAULT_SECTIONS
from ncpctl.profile.accounting import accounting_section, config_summary
from ncpctl.profile.kernels import CPU_GRID, GPU_GRID, QUICK_GRID, kernels_section
from ncpctl.profile.ops import ops_section
from ncpctl.profile.render import plot_kernels
from ncpctl.profile.step import step_section
from ncpctl.profile.trace import trace_section


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def profile(
    recipe: Any,
    only: list[str] | None = None,
    *,
    device: str | None = None,
    repeats: int | None = None,
    quick: bool = False,
    plot: bool = False,
    realised_ratio: float | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> dict[str, Any]:
    """Run ``only`` (default: every section but ``ops``) for ``recipe``; results keyed by section.

    ``quick``: the smallest grid, one repeat, no warm-up beyond one call (tests, smoke runs).
    ``realised_ratio``: the accounting of a dynamic segmentation at this measured tokens per concept.
    """
    sections = list(only or DEFAULT_SECTIONS)
    cfg = recipe.model_config
    T, B = recipe.seq_len, recipe.train.micro_batch_size
    out_dir = Path(out_dir) if out_dir is not None else recipe.run_dir / "profile"
    result: dict[str, Any] = {
        "recipe": str(recipe.path),
        "model": config_summary(cfg),
        "seq_len": T,
        "micro_batch_size": B,
        "sections": sections,
        "out_dir": str(out_dir),
    }
    if "accounting" in sections:
        log("accounting: parameters and FLOPs (recipe, base, PM)")
        result["accounting"] = accounting_section(cfg, T, B, recipe.global_batch_size,
                                                  realised_ratio=realised_ratio,
                                                  precision={"auto": "bf16"}.get(recipe.train.precision, recipe.train.precision))
    heavy = [s for s in sections if s != "accounting"]
    if not heavy:
        return result

    import torch

    dev = torch.device(device or default_device())
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    result["device"] = {"type": dev.type, "name": torch.cuda.get_device_name(dev) if gpu else "cpu",
                        "threads": torch.get_num_threads(), "torch": torch.__version__}
    warmup = 1
    if quick:
        reps, step_reps, grid, peak_reps = 1, 1, QUICK_GRID, 1
    else:
        reps = repeats or (20 if gpu else 5)
        step_reps = repeats or (10 if gpu else 3)
        grid, peak_reps = (GPU_GRID if gpu else CPU_GRID), 5
    if "kernels" in sections:
        log(f"kernels: micro-benchmarks on {dev} ({reps} repeats)")
        result["kernels"] = kernels_section(cfg, T, B, dev, dtype, warmup, reps, grid)
        if plot:
            result["kernels"]["plots"] = [str(p) for p in plot_kernels(result["kernels"], out_dir)]
    if "step" in sections:
        log(f"step: fwd+bwd+AdamW, batch {B} x {T} on {dev} ({step_reps} repeats)")
        result["step"] = step_section(cfg, T, B, dev, dtype, warmup, step_reps, peak_reps)
    if "ops" in sections:
        T = min(T, 128)  # the count does not depend on the length past a few concepts
        log(f"ops: operators per training step and per decode step (CPU, batch 2 x {T}), recipe vs plain sibling")
        result["ops"] = ops_section(cfg, T, 2)
    if "trace" in sections:
        log(f"trace: torch.profiler over {1 if quick else 2} steps -> {out_dir / 'trace.json'}")
        result["trace"] = trace_section(cfg, T, B, dev, dtype, out_dir, steps=1 if quick else 2)
    return result

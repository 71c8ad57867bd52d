"""``trace`` section: a ``torch.profiler`` trace of a few training steps.

Writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev; TensorBoard's
profiler plugin reads the same JSON) to ``<out_dir>/trace.json`` and returns the top
operators by self time (device time on a GPU, CPU time otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ncpctl.fsutil import atomic_write_with
from ncpctl.model.core.config import ModelConfig
from ncpctl.profile.step import make_step


def trace_section(cfg: ModelConfig, seq_len: int, batch: int, device, dtype, out_dir: Path, steps: int = 2,
                  top: int = 15) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    dev = torch.device(device)
    _, step = make_step(cfg, batch, seq_len, dev, dtype)
    step()  # warm-up outside the trace (allocator, kernel selection)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        for i in range(steps):
            with record_function(f"train_step_{i}"):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = atomic_write_with(out_dir / "trace.json", lambda tmp: prof.export_chrome_trace(str(tmp)))

    use_device = dev.type == "cuda"
    events = [e for e in prof.key_averages() if not e.key.startswith(("train_step_", "ProfilerStep"))]

    def self_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) if use_device else e.self_cpu_time_total)

    total = sum(self_us(e) for e in events) or 1.0
    events.sort(key=self_us, reverse=True)
    rows = [{
        "name": e.key,
        "calls": int(e.count),
        "self_s": self_us(e) / 1e6 / steps,
        "share": self_us(e) / total,
    } for e in events[:top]]
    return {
        "device": str(dev),
        "steps": steps,
        "batch_size": batch,
        "seq_len": seq_len,
        "time_kind": "device self time" if use_device else "CPU self time",
        "trace_path": str(path),
        "total_self_s_per_step": total / 1e6 / steps,
        "top_ops": rows,
    }

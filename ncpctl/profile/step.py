"""``step`` section: one full training step (fwd + bwd + AdamW) of the recipe's model.

Achieved FLOP/s = exact training FLOPs of the micro-batch (causal attention count, see
``ncpctl.model.accounting``) / median step time. The denominator of the ratio: on a GPU
the known dense bf16 peak of the device (MFU), on a CPU the measured rate of a square fp32
GEMM on the same threads (what the cores can do on the model's dominant operation).
"""

from __future__ import annotations

from typing import Any

from ncpctl.model.accounting import exact_flops
from ncpctl.model.config import ModelConfig
from ncpctl.profile.timing import gemm_peak, known_bf16_peak, measure


def make_step(cfg: ModelConfig, batch: int, seq_len: int, device, dtype, seed: int = 0):
    """(model, step_fn): a random-token batch; the step is fwd + bwd + AdamW + zero_grad."""
    import torch

    from ncpctl.model.model import NCPModel

    torch.manual_seed(seed)
    model = NCPModel(cfg).to(device)
    gpu = torch.device(device).type == "cuda"
    autocast = dtype == torch.bfloat16 and gpu
    if dtype != torch.float32 and not autocast:
        model = model.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, TypeError):  # fused AdamW not available for this device/dtype
        opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, y)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def step_section(cfg: ModelConfig, seq_len: int, batch: int, device, dtype, warmup: int = 1, repeats: int = 3,
                 peak_repeats: int = 5) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    _, step = make_step(cfg, batch, seq_len, dev, dtype)
    st = measure(step, dev, warmup, repeats)
    flops = exact_flops(cfg, seq_len, batch).training_per_step(causal=True)
    achieved = flops / st.median
    out: dict[str, Any] = {
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_size": batch,
        "seq_len": seq_len,
        "tokens": batch * seq_len,
        "training_flops": flops,
        **st.to_dict(),
        "tokens_per_s": batch * seq_len / st.median,
        "achieved_flop_per_s": achieved,
    }
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = known_bf16_peak(name)
        out["peak"] = {"kind": "known bf16 dense peak", "device_name": name, "flop_per_s": peak,
                       "measured_bf16_gemm": gemm_peak(dev, torch.bfloat16, n=8192, repeats=peak_repeats)}
        if peak is None:  # unknown GPU: fall back to what a big bf16 GEMM reaches
            out["peak"]["kind"] = "measured bf16 GEMM (device not in the known-peak table)"
            out["peak"]["flop_per_s"] = out["peak"]["measured_bf16_gemm"]["flop_per_s"]
        out["mfu"] = achieved / out["peak"]["flop_per_s"]
        out["ratio_to_peak"] = out["mfu"]
    else:
        g = gemm_peak(dev, dtype, n=2048 if peak_repeats >= 3 else 1024, repeats=peak_repeats)
        out["peak"] = {"kind": f"measured {g['n']}^3 {g['dtype']} GEMM (best of {peak_repeats})", **g}
        out["ratio_to_peak"] = achieved / g["flop_per_s"]
    return out

"""``step`` section: one full training step (fwd + bwd + AdamW) of the recipe's model.

Achieved FLOP/s = exact training FLOPs of the micro-batch (attention counted in full, the MFU
convention of the training loop: ``ncpctl.model.accounting.flops.FLOP_CONVENTION``; the causal-mask count
beside it as ``training_flops_causal``) / median step time. The denominator of the ratio: on a GPU
the known dense bf16 peak of the device (MFU), on a CPU the measured rate of a square fp32
GEMM on the same threads (what the cores can do on the model's dominant operation).

The pieces every speed measurement shares live here once (``bench/`` uses them too): random token
batches (``random_windows``, ``next_token_batch``), ``adamw``, one step without an engine
(``training_step``) and one step of a DeepSpeed engine (``engine_step``).
"""

from __future__ import annotations

from typing import Any, Callable

from ncpctl.model.accounting.flops import FLOP_CONVENTION, exact_flops
from ncpctl.model.core.config import ModelConfig
from ncpctl.profile.timing import gemm_peak, known_bf16_peak, measure


def random_windows(vocab_size: int, batch: int, seq_len: int, seed: int = 1, count: int = 1) -> list[Any]:
    """``count`` batches of random token windows (batch, seq_len + 1), CPU, from one generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g) for _ in range(count)]


def next_token_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 1):
    """(x, y) (B, T): random tokens and their next tokens, CPU, the last target -100 (what a
    Hugging Face model's internal shift never scores, so ours and theirs compute the same loss)."""
    (idx,) = random_windows(cfg.vocab_size, batch, seq_len, seed)
    x, y = idx[:, :seq_len], idx[:, 1:].clone()
    y[:, -1] = -100
    return x, y


def adamw(params, lr: float = 1e-4, **kw: Any):
    """torch AdamW, fused where the device and dtype have it (HF Trainer's default on torch >= 2.8)."""
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True, **kw)
    except (RuntimeError, TypeError):  # fused AdamW not available for this device/dtype
        return torch.optim.AdamW(params, lr=lr, **kw)


def training_step(model, opt, batches: list[Any] | None = None, *, forward: Callable[[], Any] | None = None,
                  clip: float | None = None, sync: Callable[[], None] | None = None) -> Callable[[], float]:
    """One optimizer step of ``model`` without an engine, as a function returning the loss: for each
    micro-batch of ``batches`` (windows (micro, T+1)) the model's loss / len(batches) backward, or
    ``forward()``'s loss backward once; [the gradient norm clipped to ``clip``]; ``opt.step``;
    ``zero_grad``; [``sync``]."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        total = 0.0
        for b in batches or ():
            loss = model(b[:, :-1], b[:, 1:]).loss / len(batches)
            loss.backward()
            total += float(loss.detach())
        if forward is not None:
            loss = forward()
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync is not None:
            sync()
        return total

    return step


def engine_step(engine, x, y, report: str | None = None) -> Callable[[], Any]:
    """One training step of a DeepSpeed engine (``ncpctl.train.engine.build_engine``) on (x, y):
    forward, ``engine.backward``, ``engine.step``; returns the total loss, or the loss term
    ``report`` (e.g. ntp_loss), detached (no host sync)."""
    def step() -> Any:
        out = engine(x, y)  # training forward: logits None (fused head), .loss set
        engine.backward(out.loss)
        engine.step()
        return (out.loss if report is None else out.losses[report]).detach()

    return step


def make_step(cfg: ModelConfig, batch: int, seq_len: int, device, dtype, seed: int = 0):
    """(model, step_fn): a random-token batch; the step is fwd + bwd + AdamW + zero_grad."""
    import torch

    from ncpctl.model.core.model import NCPModel

    torch.manual_seed(seed)
    model = NCPModel(cfg).to(device)
    gpu = torch.device(device).type == "cuda"
    autocast = dtype == torch.bfloat16 and gpu
    if dtype != torch.float32 and not autocast:
        model = model.to(dtype)
    opt = adamw(p for p in model.parameters() if p.requires_grad)
    (idx,) = random_windows(cfg.vocab_size, batch, seq_len, seed)
    idx = idx.to(device)
    x, y = idx[:, :-1], idx[:, 1:]

    def forward():
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(x, y).loss

    return model, training_step(model, opt, forward=forward)


def step_section(cfg: ModelConfig, seq_len: int, batch: int, device, dtype, warmup: int = 1, repeats: int = 3,
                 peak_repeats: int = 5) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    _, step = make_step(cfg, batch, seq_len, dev, dtype)
    st = measure(step, dev, warmup, repeats)
    counts = exact_flops(cfg, seq_len, batch)
    flops = counts.training_per_step()  # FLOP_CONVENTION: the training loop's MFU numerator
    achieved = flops / st.median
    out: dict[str, Any] = {
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "batch_size": batch,
        "seq_len": seq_len,
        "tokens": batch * seq_len,
        "flop_convention": FLOP_CONVENTION,
        "training_flops": flops,
        "training_flops_causal": counts.training_per_step(causal=True),
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

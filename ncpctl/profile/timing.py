"""Timing that is honest on a shared CPU and on an asynchronous GPU.

``measure(fn)`` runs ``warmup`` untimed calls, then ``repeats`` timed ones, synchronising
the device around each call (CUDA kernels are asynchronous: without a sync we would time
the launch, not the work). Reports median, min, max and the relative spread
(interquartile range / median), so a noisy machine shows up as a wide spread, not as a
wrong number.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


def synchronize(device: Any) -> None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":  # pragma: no cover - not on our machines
        torch.mps.synchronize()


@dataclass(frozen=True)
class Stats:
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Interquartile range / median (0 with fewer than 4 samples: max-min / median then)."""
        s = sorted(self.seconds)
        if len(s) >= 4:
            q = statistics.quantiles(s, n=4)
            return (q[2] - q[0]) / self.median
        return (s[-1] - s[0]) / self.median if self.median > 0 else 0.0

    def to_dict(self, flops: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "median_s": self.median,
            "min_s": min(self.seconds),
            "max_s": max(self.seconds),
            "spread": self.spread,
            "repeats": len(self.seconds),
        }
        if flops is not None:
            out["flops"] = flops
            out["flop_per_s"] = flops / self.median if self.median > 0 else None
        return out


def measure(fn: Callable[[], Any], device: Any = "cpu", warmup: int = 1, repeats: int = 5) -> Stats:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls, device-synchronised."""
    for _ in range(max(0, warmup)):
        fn()
    synchronize(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return Stats(times)


def gemm_peak(device: Any, dtype: Any, n: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """Measured rate of an n x n x n matmul (2*n^3 FLOPs), best of ``repeats``.

    The best, not the median, because it estimates what the hardware can do: load from
    other processes only ever makes a GEMM slower.
    """
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    st = measure(lambda: torch.mm(a, b), device, warmup=2, repeats=repeats)
    flops = 2.0 * n**3
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "best_s": min(st.seconds),
            "median_s": st.median, "flop_per_s": flops / min(st.seconds)}


# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) of GPUs we know, by name substring.
KNOWN_BF16_PEAK = (
    ("H200", 989e12),
    ("H100", 989e12),  # SXM; PCIe is lower (756e12): matched below first
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("RTX 4090", 165e12),
)


def known_bf16_peak(name: str) -> float | None:
    if "H100" in name and "PCIe" in name:
        return 756e12
    for key, peak in KNOWN_BF16_PEAK:
        if key in name:
            return peak
    return None

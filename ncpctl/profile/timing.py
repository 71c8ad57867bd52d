"""Timing that is honest on a shared CPU and on an asynchronous GPU.

``measure(fn)`` runs ``warmup`` untimed calls, then ``repeats`` timed ones, synchronising
the device around each call (CUDA kernels are asynchronous: without a sync we would time
the launch, not the work). Reports median, min, max and the relative spread
(interquartile range / median), so a noisy machine shows up as a wide spread, not as a
wrong number. ``timed`` / ``clocks`` time one call; ``paired_ratios`` compares two series timed
in alternating rounds; ``gemm_peak`` measures a GEMM and ``device_peak`` gives the MFU peak from
the one table of known GPU peaks (``GPU_BF16_PEAK``), for the training loop, ``ncpctl
profile-kernels`` and ``bench/`` alike.
"""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
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


# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) of the GPUs we know, by the substrings of the
# device name that must all occur; the first match wins, so a variant precedes its family (H100 PCIe
# and NVL before H100, L40S and L40 before L4). The one table for every MFU in ncpctl (the loop's
# metrics, ``ncpctl profile-kernels``, bench/).
GPU_BF16_PEAK = (
    (("H100", "PCIe"), 756e12), (("H100", "NVL"), 835e12), (("GH200",), 989e12), (("H200",), 989e12),
    (("H100",), 989e12),  # SXM
    (("A100",), 312e12), (("L40S",), 362e12), (("L40",), 181e12), (("L4",), 121e12), (("A10G",), 70e12),
    (("RTX 4090",), 165e12), (("RTX 3090",), 71e12),
    (("V100",), 125e12),  # no bf16: its fp16 tensor-core peak
)


def known_bf16_peak(name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``), or None."""
    for keys, peak in GPU_BF16_PEAK:
        if all(k in name for k in keys):
            return peak
    return None


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _max_clock_hz(cpuinfo: str) -> float | None:
    """The highest clock the system states: cpufreq's ``cpuinfo_max_freq``, the cores' ``cpu MHz``
    and a ``@ X.XXGHz`` in the model name (a virtual machine often states only the nominal one)."""
    hz = [float(m) * 1e6 for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.MULTILINE)]
    hz += [float(m) * 1e9 for m in re.findall(r"@\s*([\d.]+)\s*GHz", cpuinfo)]
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            hz.append(float(f.read().strip()) * 1e3)  # kHz
    except (OSError, ValueError):
        pass
    return max(hz) if hz else None


def cpu_isa_peak(threads: int, cpuinfo: str | None = None) -> tuple[float, str] | None:
    """An fp32 upper bound of ``threads`` cores from the instruction set and the clock: threads x
    clock x FLOP/cycle (two FMA pipes: 64 with AVX-512, 32 with AVX2+FMA, 16 with SSE), or None
    when /proc/cpuinfo says nothing."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    clock = _max_clock_hz(info)
    m = re.search(r"^flags\s*:(.*)$", info, re.MULTILINE)
    if clock is None or m is None:
        return None
    flags = set(m.group(1).split())
    per_cycle = 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 16
    return (threads * clock * per_cycle,
            f"{threads} threads x {clock / 1e9:.2f} GHz x {per_cycle} fp32 FLOP/cycle")


def device_peak(on_gpu: bool) -> tuple[float, str]:
    """This process's peak FLOP/s for MFU and where it came from: on a GPU its known dense bf16
    peak (an unknown GPU: what an 8192^3 bf16 GEMM reaches); on the CPU the larger of the
    instruction-set bound (``cpu_isa_peak``) and the measured rate of a 1024^3 fp32 GEMM on this
    process's threads. A GEMM measured on a loaded machine alone understates the peak (an MFU
    above 100% followed); the larger of the two is an upper bound unless the stated clock is below
    the real one, and then the GEMM (on a quiet machine) is."""
    import torch

    if on_gpu:
        name = torch.cuda.get_device_name()
        peak = known_bf16_peak(name)
        if peak is not None:
            return peak, f"{name} bf16 peak"
        g = gemm_peak("cuda", torch.bfloat16, n=8192, repeats=3)
        return g["flop_per_s"], f"{name}: measured bf16 8192^3 GEMM (not in the known-peak table)"
    threads = torch.get_num_threads()
    measured = best_cpu_gemm(gemm_peak("cpu", torch.float32, n=1024, repeats=4)["flop_per_s"], threads)
    isa = cpu_isa_peak(threads)
    gemm = f"best fp32 1024^3 GEMM measured here {measured / 1e9:.0f} GFLOP/s"
    if isa is None or measured >= isa[0]:
        return measured, gemm + ("" if isa is None else f" (above the instruction-set bound {isa[1]})")
    return isa[0], f"instruction-set bound {isa[1]} (above the {gemm})"


def best_cpu_gemm(now: float, threads: int, cache: Path | None = None) -> float:
    """The best GEMM rate ever measured on this CPU model at ``threads`` threads, ``now`` included:
    each measurement runs under whatever load there is (load only makes it slower), so the maximum
    over runs approaches the machine's rate. Kept in ``$XDG_CACHE_HOME/ncpctl/cpu_peak.json``
    (``~/.cache``); an unwritable cache just means this run's number."""
    if cache is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ncpctl" / "cpu_peak.json"
    info = _cpuinfo()
    fields = [re.search(rf"^{f}\s*:\s*(.+)$", info, re.MULTILINE) for f in ("model name", "cpu family", "model")]
    key = "|".join([*(m.group(1).strip() if m else "?" for m in fields), f"{threads} threads", "fp32"])
    try:
        seen = json.loads(cache.read_text()) if cache.is_file() else {}
        best = max(float(seen.get(key, 0.0)), now)
        if best > float(seen.get(key, 0.0)):
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**seen, key: best}))
            os.replace(tmp, cache)
        return best
    except (OSError, ValueError, TypeError, AttributeError):
        return now


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """(seconds, result) of one call of ``fn``, device-synchronised before and after (no device:
    wall time of the call alone)."""
    if device is not None:
        synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if device is not None:
        synchronize(device)
    return time.perf_counter() - t0, result


def clocks(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call, after a garbage collection: on a
    shared machine the CPU time is the work done, the wall time also holds the waits for cores
    other processes held."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def paired_ratios(a: list[float], b: list[float]) -> dict[str, float]:
    """a/b of two series timed in alternating rounds: by the best rounds, by the medians, and the
    median of the per-round ratios (``paired_median``: each pair measured back to back, under the
    same load; the value the benchmarks judge)."""
    return {"best": min(a) / min(b), "median": statistics.median(a) / statistics.median(b),
            "paired_median": statistics.median(x / y for x, y in zip(a, b))}


def package_version(package: str) -> str | None:
    """An installed distribution's version without importing it (a benchmark's environment record:
    DeepSpeed takes seconds to import), or None when it is not installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None

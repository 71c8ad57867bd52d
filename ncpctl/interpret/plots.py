"""``ncpctl inspect --plot DIR``: a heat map of a prompt's code weights over its blocks, and code
usage per segment over a corpus. matplotlib (the ``plots`` extra) is optional: without it the
functions say so and return no files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ncpctl.fsutil import atomic_write_with


def _pyplot(log: Callable[[str], None]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install 'ncpctl[plots]'): no PNG")
        return None
    return plt


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight"))
    return str(path)


def weight_heatmap(weights: np.ndarray, labels: list[str], path: Path, log: Callable[[str], None]) -> str | None:
    """weights (M, S, N): one panel per segment, blocks down, codes across."""
    plt = _pyplot(log)
    if plt is None:
        return None
    M, S, N = weights.shape
    cols = min(S, 4)
    rows = math.ceil(S / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 0.9 + 0.28 * M * rows), squeeze=False)
    for s, ax in enumerate(ax for line in axes for ax in line):
        if s >= S:
            ax.axis("off")
            continue
        im = ax.imshow(weights[:, s, :], aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"segment {s}", fontsize=8)
        ax.set_xlabel("code", fontsize=7)
        ax.set_yticks(range(M), labels if s % cols == 0 else [""] * M, fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.05)
    fig.suptitle("code weights per block (the block's prediction of the next concept)", fontsize=9, y=1.02)
    out = _save(fig, path)
    plt.close(fig)
    return out


def usage_bars(dictionary: dict[str, Any], path: Path, log: Callable[[str], None]) -> str | None:
    """Usage (fraction of blocks where the code is its segment's heaviest) per code, per segment."""
    plt = _pyplot(log)
    if plt is None:
        return None
    S, N = dictionary["segments"], dictionary["codes_per_segment"]
    usage = np.zeros((S, N))
    for c in dictionary["codes"]:
        usage[c["segment"], c["code"]] = c["usage"]
    cols = min(S, 4)
    rows = math.ceil(S / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for s, ax in enumerate(ax for line in axes for ax in line):
        if s >= S:
            ax.axis("off")
            continue
        ax.bar(range(N), usage[s], color="C0")
        ax.set_title(f"segment {s}: {int((usage[s] > 0).sum())}/{N} codes used", fontsize=8)
        ax.set_xlabel("code", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle(f"code usage over {dictionary['blocks']} blocks", fontsize=9, y=1.02)
    out = _save(fig, path)
    plt.close(fig)
    return out


def input_heatmap(rec: dict[str, Any], path: Path, log: Callable[[str], None]) -> str | None:
    """``inspect --attribute-inputs``: the prompt's tokens across, one row per attribution
    (occlusion Δ; IG), a diverging map centred on 0 (red: the input raises the output)."""
    plt = _pyplot(log)
    if plt is None:
        return None
    toks = rec["tokens"]
    occ = [b["occlusion"] for b in rec["blocks"] for _ in range(b["span"][1] - b["span"][0])] \
        if rec["unit"] == "block" else [t["occlusion"] for t in toks]
    rows = {"occlusion Δ" + (" (block)" if rec["unit"] == "block" else ""): occ}
    if toks and toks[0]["ig"] is not None:
        rows["integrated gradients"] = [t["ig"] for t in toks]
    data = np.array(list(rows.values()), dtype=float)  # (rows, T)
    T = data.shape[1]
    fig, axes = plt.subplots(len(rows), 1, figsize=(min(24.0, 1.5 + 0.32 * T), 1.1 + 1.0 * len(rows)), squeeze=False)
    block = rec.get("diffusion_block")
    for r, (ax, (name, values)) in enumerate(zip(axes[:, 0], rows.items())):
        v = np.array(values, dtype=float)[None]
        lim = float(np.abs(v).max()) or 1.0
        im = ax.imshow(v, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        ax.set_yticks([0], [name], fontsize=7)
        last = r == len(rows) - 1  # token labels under the last row only
        ax.set_xticks(range(T), [repr(t["text"])[1:-1][:10] for t in toks] if last else [""] * T,
                      rotation=90, fontsize=6)
        for edge in range(block or T, T, block or T):  # the CDLM's diffusion blocks
            ax.axvline(edge - 0.5, color="k", lw=0.8, ls=":")
        fig.colorbar(im, ax=ax, fraction=0.02)
    what = rec["output"]
    out_def = what["definition"] + (f" {what['token_text']!r}" if what.get("token_text") is not None else "")
    fig.suptitle(f"input attribution against {rec['baseline']['text']!r}: {out_def}", fontsize=8, y=1.02)
    out = _save(fig, path)
    plt.close(fig)
    return out

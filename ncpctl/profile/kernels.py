"""``kernels`` section: timed micro-benchmarks at the recipe's shapes on the current device.

* ``layers``: one token layer on (B, T, d) vs one concept layer on (B, T/k, d), forward +
  backward; the time ratio is what the concept path actually saves per layer (ideal: the
  FLOPs ratio, about 1/k for short sequences).
* ``sdpa``: causal attention of the recipe's shape (B, H, T, hd) through each SDPA backend
  that runs on this device (``torch.nn.attention.sdpa_kernel``).
* ``concept``: the concept path's pieces, forward + backward: pooling (a reshape + mean),
  heads + codebook (one Linear, one einsum), the causal shift, the nearest-code search.
* ``dlcm``: DLCM's token -> concept attention (DLCM Table 6), the model's two declared forms
  (ncp-model.md section 8, ``concept.cross_attention``) as the model runs them
  (``ncpctl.model.designs.cross_attention.module``), on the same queries, concepts and irregular segments: token t
  sees the concepts of the segments closed at t, never its own. ``per_concept``: queries
  (B,H,T,hd) against the M closed concepts' keys with a boolean (T, M) mask, each concept once;
  ``replicated``: concept j's K/V copied onto the tokens of segment j+1 and one plain causal
  attention over the T token-aligned keys (``is_causal=True``, flash kernels; segment 0's slots
  pushed out of the softmax by an extra key coordinate), so a concept weighs by its visible
  copies. Forward, over a grid of sequence lengths x widths (reduced on CPU).
"""

from __future__ import annotations

import math
from typing import Any

from ncpctl.model.core.config import ConfigError, ModelConfig
from ncpctl.profile.timing import measure

GPU_GRID = {"seq_len": [2048, 4096, 8192, 16384], "hidden": [1024, 2048, 4096], "head_dim": 128}
CPU_GRID = {"seq_len": [512, 1024, 2048], "hidden": [256, 512], "head_dim": 64}
QUICK_GRID = {"seq_len": [128, 256], "hidden": [64], "head_dim": 16}


def _row(group: str, name: str, shape: dict[str, Any], st, flops: float | None = None) -> dict[str, Any]:
    return {"group": group, "name": name, "shape": shape, **st.to_dict(flops)}


def _fwd_bwd(fn, inputs):
    def run():
        for t in inputs:
            t.grad = None
        out = fn()
        out.float().sum().backward()
    return run


def layer_rows(cfg: ModelConfig, B: int, T: int, device, dtype, warmup: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    from ncpctl.model.accounting.flops import _stack_flops
    from ncpctl.model.core.layers import Block, Context

    blk = Block(cfg).to(device=device, dtype=dtype)
    rows = []
    for name, n in (("token layer", T), ("concept layer", max(1, _with_concept(cfg).num_concepts(T)))):
        x = torch.randn(B, n, cfg.d_model, device=device, dtype=dtype, requires_grad=True)
        ctx = Context.causal(cfg, torch.arange(n, device=device)[None], [None], dtype)
        st = measure(_fwd_bwd(lambda: x + blk(x, ctx), [x]), device, warmup, repeats)
        f = _stack_flops(cfg, [None], n)
        flops = 3 * B * (f["qkv"] + f["attn_out"] + f["mlp"] + f["attention_causal"])
        rows.append(_row("layers", name, {"B": B, "T": n, "d": cfg.d_model}, st, flops))
    return rows


def sdpa_backends(device) -> list[Any]:
    import torch
    from torch.nn.attention import SDPBackend

    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    if torch.device(device).type != "cuda":
        names = ["FLASH_ATTENTION", "MATH"]  # the CPU has a flash kernel and the math path
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def sdpa_rows(cfg: ModelConfig, B: int, T: int, device, dtype, warmup: int, repeats: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    H, hd = cfg.n_heads, cfg.head_dim
    q, k, v = (torch.randn(B, H, T, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = 3 * 2 * 2 * B * H * hd * T * (T + 1) / 2  # fwd+bwd, causal pairs
    rows = []
    for backend in sdpa_backends(device):
        name = backend.name.lower()

        def run(backend=backend):
            with sdpa_kernel([backend]):
                for t in (q, k, v):
                    t.grad = None
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        try:
            st = measure(run, device, warmup, repeats)
        except RuntimeError as e:  # this backend does not run here (dtype, device, shape)
            rows.append({"group": "sdpa", "name": name, "shape": {"B": B, "H": H, "T": T, "hd": hd},
                         "available": False, "reason": str(e).strip().splitlines()[0][:120]})
            continue
        rows.append({**_row("sdpa", name, {"B": B, "H": H, "T": T, "hd": hd}, st, flops), "available": True})
    return rows


def concept_rows(cfg: ModelConfig, B: int, T: int, device, dtype, warmup: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    from ncpctl.model.core.concept import ConceptModule, nearest_code

    cfg = _with_concept(cfg)
    cm = ConceptModule(cfg).to(device=device, dtype=dtype)
    d, seg = cfg.d_model, cm.segmenter
    S, N = cfg.n_segments, cfg.concept.codes
    h = torch.randn(B, T, d, device=device, dtype=dtype, requires_grad=True)
    segments = seg(h.detach())
    M = segments.concepts.shape[1]
    dc = cm.ccfg.d_model  # the concept transformer's width (its output feeds the heads)
    u = torch.randn(B, M, dc, device=device, dtype=dtype, requires_grad=True)
    shape = {"B": B, "T": T, "M": M, "d": d, "S": S, "N": N}
    rows = []

    st = measure(_fwd_bwd(lambda: seg(h).concepts, [h]), device, warmup, repeats)
    rows.append(_row("concept", f"pooling ({type(seg).__name__})", shape, st,
                     3.0 * B * round(M * cfg.tokens_per_concept) * d))

    def heads_codebook():
        return cm.predict(u, cm.codebook())

    st = measure(_fwd_bwd(heads_codebook, [u]), device, warmup, repeats)
    rows.append(_row("concept", "heads + codebook (Linear + einsum)", shape, st,
                     3.0 * (2 * B * M * S * N * (dc + d))))

    st = measure(_fwd_bwd(lambda: seg.spread(segments, u, T), [u]), device, warmup, repeats)
    rows.append(_row("concept", "causal shift (segmenter.spread)", shape, st))

    codes = cm.codebook().detach()
    c = segments.concepts.detach()  # (B, M, d): the VQ searches the pooled concepts sg(c)
    st = measure(lambda: nearest_code(c, codes), device, warmup, repeats)
    rows.append(_row("concept", "nearest code (VQ, no grad)", shape, st, 2.0 * B * M * S * N * cfg.segment_dim))
    return rows


def _with_concept(cfg: ModelConfig) -> ModelConfig:
    """The recipe's shape with the concept path on, for its kernels; under the default objective
    when the recipe's excludes the concept path (one without the NCP shift)."""
    d = cfg.to_dict()
    d["concept"] = {**d["concept"], "enabled": True}
    d["extra_token_layers"] = 0
    try:
        return ModelConfig.from_dict(d)
    except ConfigError:
        d.pop("objective")
        return ModelConfig.from_dict(d)


def _segments(T: int, mean_len: int, gen) -> list[int]:
    """Irregular segment lengths (uniform in [1, 2*mean-1]) covering T tokens."""
    import torch

    lens, total = [], 0
    while total < T:
        n = int(torch.randint(1, 2 * mean_len, (1,), generator=gen))
        n = min(n, T - total)
        lens.append(n)
        total += n
    return lens


def dlcm_rows(grid: dict[str, Any], k: int, device, dtype, warmup: int, repeats: int) -> list[dict[str, Any]]:
    """The model's own two attention kernels (``ncpctl.model.designs.cross_attention.module.per_concept_attention`` and
    ``replicated_attention``, what ``CrossAttentionCoupling`` runs in a forward) on the same
    queries, concepts and irregular segments, forward, over the grid."""
    import torch

    from ncpctl.model.designs.cross_attention.module import per_concept_attention, replicated_attention

    gen = torch.Generator().manual_seed(0)
    hd = grid["head_dim"]
    rows = []
    for d in grid["hidden"]:
        H = max(1, d // hd)
        for T in grid["seq_len"]:
            lens = torch.tensor(_segments(T, k, gen))
            closed = torch.repeat_interleave(torch.arange(len(lens)), lens).to(device)[None]  # (1, T) own segment
            M, first = len(lens) - 1, int(lens[0])  # closed concepts (the last segment is open)
            if M == 0:
                continue
            q = torch.randn(1, H, T, hd, device=device, dtype=dtype)
            kc = torch.randn(1, H, M, hd, device=device, dtype=dtype)
            vc = torch.randn(1, H, M, hd, device=device, dtype=dtype)
            shape = {"T": T, "d": d, "H": H, "hd": hd, "M": M}
            visible = int((torch.arange(M, device=device)[None, :] < closed[0, :, None]).sum())
            n = T - first
            for name, fn, pairs in (("per_concept", per_concept_attention, T * M),
                                    ("replicated", replicated_attention, T * (T + 1) // 2)):
                with torch.no_grad():
                    st = measure(lambda fn=fn: fn(q, kc, vc, closed), device, warmup, repeats)
                row = _row("dlcm", name, shape, st, 2.0 * 2 * H * hd * pairs)
                row["attended_pairs"] = visible  # (token, concept) pairs the model's attention covers
                row["tokens_with_a_concept"] = n
                rows.append(row)
    return rows


def kernels_section(cfg: ModelConfig, seq_len: int, batch: int, device, dtype, warmup: int = 1, repeats: int = 5,
                    grid: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    if grid is None:
        grid = GPU_GRID if dev.type == "cuda" else CPU_GRID
    from ncpctl.model.accounting.flops import tokens_per_concept

    k = tokens_per_concept(_with_concept(cfg))
    rows = layer_rows(cfg, batch, seq_len, dev, dtype, warmup, repeats)
    tok, con = rows[0], rows[1]
    rows += sdpa_rows(cfg, batch, seq_len, dev, dtype, warmup, repeats)
    rows += concept_rows(cfg, batch, seq_len, dev, dtype, warmup, repeats)
    dlcm = dlcm_rows(grid, k, dev, dtype, warmup, repeats)
    ratio = {
        "concept_over_token_time": con["median_s"] / tok["median_s"],
        "concept_over_token_flops": con["flops"] / tok["flops"],
        "k": k,
    }
    speedup = dlcm_speedup(dlcm)
    return {
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats": repeats,
        "batch_size": batch,
        "seq_len": seq_len,
        "rows": rows,
        "layer_ratio": ratio,
        "dlcm": {"grid": grid, "rows": dlcm, "replicated_over_per_concept": speedup,
                 **faster_form(speedup, cfg.concept.cross_attention if cfg.concept.enabled else None)},
    }


def dlcm_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``dlcm_rows`` -> replicated / per_concept per grid point (< 1: replication is faster here)."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["shape"]["T"], r["shape"]["d"]), {})[r["name"]] = r["median_s"]
    return [{"T": T, "d": d, "replicated_over_per_concept": v["replicated"] / v["per_concept"]}
            for (T, d), v in sorted(by_key.items())]


def faster_form(speedup: list[dict[str, Any]], configured: str | None) -> dict[str, Any]:
    """Which of the two declared attentions was faster on this device (the geometric mean of
    replicated / per_concept over the grid), and whether the recipe's ``concept.cross_attention``
    is it. The two are different functions (Eq. 14's softmax over the closed concepts, Sec. 4.1's
    weighting by copies): a recipe chooses one for what it computes, on every machine alike, and the
    device only the kernel that computes it; this says what that choice costs here."""
    if not speedup:
        return {}
    ratios = [r["replicated_over_per_concept"] for r in speedup]
    gmean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    faster = "replicated" if gmean < 1 else "per_concept"
    return {"faster_form": faster, "replicated_over_per_concept_gmean": gmean,
            "configured_form": configured, "configured_is_faster": None if configured is None else configured == faster}

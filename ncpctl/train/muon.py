"""Muon on the hidden matrices, AdamW on the rest: one torch optimizer that DeepSpeed wraps
(``train.optimizer: muon``; NCP-ArchPreview §3.6, Moonlight's recipe).

The update of a Muon matrix W (d_out, d_in) with gradient G is torch.optim.Muon's, step for step:

    B <- mu B + (1 - mu) G                      momentum (torch's lerp form)
    U <- (1 - mu) G + mu B                      Nesterov
    O <- NS5(U)                                 Newton-Schulz, 5 quintic steps in bf16 (torch's, batched over same-shape matrices)
    W <- W (1 - lr wd) - lr s O                 s = 0.2 sqrt(max(d_in, d_out))   (match_rms_adamw)
                                                  or sqrt(max(d_in, d_out))      (sqrt_max_dim, Eq. 25)

Per logical matrix, as per-matrix Muon: a fused Linear stacks several matrices along its rows
(``attn.qkv`` = [q (H hd); k (Hkv hd); v (Hkv hd)], a SwiGLU ``mlp.fc`` = [gate; up], DLCM's
``wkv`` = [k; v]; the modules declare them, ``ncpctl.train.optimizer.fused_rows``). Each block of
rows gets its own O and its own s from its own shape, e.g. k's (Hkv hd, d): exactly
torch.optim.Muon applied to the split matrices. Orthogonalising the fused matrix instead would
couple them (one block's update depends on the others' gradients: a block with a 10x smaller
gradient gets a 7x smaller update than its neighbours) and scale by the fused shape. Momentum
and weight decay are elementwise, so they are the same either way; the weights stay fused.

One lr (the schedule's) serves Muon and AdamW; weight decay is decoupled and uses the
unadjusted lr, as torch's Muon does. The other groups are torch AdamW, unchanged. Each group's
lr is read per group (``g["lr"]``): under decoupled muP the groups ``muon_token`` /
``muon_concept`` hold train.lr / s of their module (``ncpctl.train.optimizer.param_groups``). The
multiplier is AdamW's: with match_rms_adamw a Muon step has AdamW's per-entry size, so the
1/s that keeps AdamW's hidden updates width-independent applies unchanged (sqrt_max_dim only
rescales every matrix by the same constant 5).

Why our own optimizer, not DeepSpeed's ``optimizer.type: Muon``: DeepSpeed's tags
``use_muon`` by a name rule of its own (overwriting ours), scales by sqrt(max(1, rows/cols))
and runs Newton-Schulz in another precision, so it cannot reproduce torch's Muon.

The one thing DeepSpeed changes: below ZeRO-3 its wrappers (ZeRO-1/2, ``BF16_Optimizer``) hand
``step`` each group as ONE flat fp32 partition (rank r holds elements [r P, (r+1) P) of the
group's flattened parameters), where Newton-Schulz on the flat vector would be meaningless.
``bind(wrapper)`` reads, once after ``deepspeed.initialize``, where each matrix lies in that
flat buffer. A step then keeps the momentum partitioned (it is elementwise), all-gathers U
over the data-parallel group in buckets of whole matrices (``gather_bucket`` elements),
orthogonalises each logical matrix that overlaps the own partition and applies the overlapping
slice (a block of rows of a row-major matrix is itself contiguous in the flat buffer).
Optimizer state stays partitioned as ZeRO saves it, so checkpoints and exact resume work as
for AdamW. ZeRO-3 (every parameter partitioned on its own) is refused when the recipe loads.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

from ncpctl.errors import UserError
from ncpctl.train.guarded import GuardedAdamW

LR_SCALES = {
    "match_rms_adamw": 0.2,  # Moonlight: the update's RMS matches AdamW's (torch: adjust_lr_fn="match_rms_adamw")
    "sqrt_max_dim": 1.0,  # NCP-ArchPreview Eq. 25 as written
}


def muon_lr(lr: float, lr_scale: str, shape: torch.Size | tuple[int, ...]) -> float:
    """The step size of a (d_out, d_in) matrix: lr * c * sqrt(max(d_out, d_in)), in torch's order."""
    return lr * (LR_SCALES[lr_scale] * math.sqrt(max(shape[0], shape[1])))


def row_blocks(shape: torch.Size | tuple[int, ...], rows: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """Row ranges [a, b) of the logical matrices in a (d_out, d_in) matrix: one per entry of
    ``rows`` (a fused matrix, ``fused_rows``), or the whole matrix."""
    bounds = [0, *itertools.accumulate(rows)] if rows else [0, shape[0]]
    return list(zip(bounds[:-1], bounds[1:]))


def newton_schulz_batched(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                          eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz (``_zeropower_via_newtonschulz``) on a batch of same-shape
    matrices g (n, A, B) at once: one batched matmul chain instead of n (a step's launches grow with
    the number of shapes, not of matrices). Each matrix is normalised by its own Frobenius norm and
    transposed alike (one shape): every slice is torch's computation for that matrix, the same bf16
    ops in the same order (on the CPU the batched GEMM may round an entry one bf16 step apart from
    the single one; tests/train/test_muon.py keeps the optimizer within 1e-6 of torch's Muon)."""
    a, b, c = coefficients
    x = g.bfloat16()
    wide = g.size(-2) > g.size(-1)
    if wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (n, A, A)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def by_shape(items: list, shape_of: Callable[[Any], tuple[int, ...]], cap: int) -> list[list]:
    """``items`` grouped by the shape ``shape_of`` gives, in first-seen order, each group cut into
    batches of at most ``cap`` elements (at least one matrix each)."""
    groups: dict[tuple[int, ...], list] = {}
    for it in items:
        groups.setdefault(tuple(shape_of(it)), []).append(it)
    out = []
    for shape, its in groups.items():
        per = max(1, cap // max(1, math.prod(shape)))
        out += [its[i:i + per] for i in range(0, len(its), per)]
    return out


@dataclass
class FlatLayout:
    """Where a group's logical matrices lie in the flat buffer a DeepSpeed wrapper partitions
    (a fused matrix is listed as its blocks of rows)."""

    shapes: list[torch.Size]
    offsets: list[int]  # element offset of each matrix in the whole (unpartitioned) flat buffer
    partition: int  # P: elements per rank
    rank: int
    world: int
    group: Any  # the data-parallel process group
    bucket: int  # elements all-gathered at a time (a larger matrix goes alone)

    def buckets(self) -> list[list[int]]:
        """Indices of consecutive matrices, at most ``bucket`` elements per list (or one matrix)."""
        out: list[list[int]] = []
        size = 0
        for i, shape in enumerate(self.shapes):
            n = math.prod(shape)
            if not out or size + n > self.bucket:
                out.append([])
                size = 0
            out[-1].append(i)
            size += n
        return out

    def gather(self, part: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the whole flat buffer, from this rank's (P,) slice ``part`` and
        the others' (a collective: every rank calls it with the same range)."""
        P = self.partition
        if self.world == 1:
            return part[lo:hi]
        import deepspeed.comm as dist

        spans = [(max(lo, r * P), min(hi, (r + 1) * P)) for r in range(self.world)]  # each rank's share
        width = max(b - a for a, b in spans)
        a, b = spans[self.rank]
        send = part.new_zeros(width)  # all_gather wants equal sizes: pad
        if b > a:
            send[: b - a] = part[a - self.rank * P:b - self.rank * P]
        pieces = [torch.empty_like(send) for _ in range(self.world)]
        dist.all_gather(pieces, send, group=self.group)
        return torch.cat([x[: max(0, b - a)] for x, (a, b) in zip(pieces, spans)])


class MuonAdamW(GuardedAdamW):
    """Groups with ``muon: True`` get Muon (the module doc), the others AdamW. Guarding and
    clipping at stage 0 fp32 are ``GuardedAdamW``'s, over all groups."""

    gather_bucket = 1 << 26  # fp32 elements (256 MB) all-gathered at a time under ZeRO-1/2

    def __init__(self, params: Iterable[dict[str, Any]], *, rows: Mapping[int, tuple[int, ...]] | None = None,
                 momentum: float = 0.95, lr_scale: str = "match_rms_adamw", nesterov: bool = True, **kw: Any):
        """``rows``: ``id(parameter) -> row counts`` of each fused matrix (``fused_rows``); the
        others are one matrix each."""
        groups = [dict(g, params=list(g["params"])) for g in params]
        fused: dict[str, list[tuple[int, ...] | None]] = {}  # by group name, one entry per parameter
        for g in groups:
            if g.get("muon"):
                fused[g["name"]] = [(rows or {}).get(id(p)) for p in g["params"]]
                bad = [(tuple(p.shape), r) for p, r in zip(g["params"], fused[g["name"]]) if r and sum(r) != p.shape[0]]
                assert not bad, f"fused rows do not add up to the matrix: {bad}"
                g.setdefault("momentum", momentum)
                g.setdefault("nesterov", nesterov)
                g.setdefault("lr_scale", lr_scale)
                g.setdefault("ns_steps", DEFAULT_NS_STEPS)
                g.setdefault("ns_coefficients", (DEFAULT_A, DEFAULT_B, DEFAULT_C))
                g.setdefault("ns_eps", EPS)
                bad = [tuple(p.shape) for p in g["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(f"Muon takes 2-D matrices only; group {g.get('name')!r} has {bad}")
        super().__init__(groups, **kw)
        self._layouts: dict[str, FlatLayout] = {}  # by group name (names survive load_state_dict)
        self._fused = fused  # by group name, aligned with the group's parameters as given (not saved: the model's)

    def bind(self, wrapper: Any) -> None:
        """After ``deepspeed.initialize``: record the flat layout of each Muon group from
        ``engine.optimizer``. Stage 0 fp32 (the wrapper is this optimizer) and bf16 stage 0
        (``FP16_UnfusedOptimizer``: per-parameter fp32 copies) keep the matrices' shapes."""
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if wrapper is self or isinstance(wrapper, FP16_UnfusedOptimizer):
            return
        if not isinstance(wrapper, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
            raise UserError(f"train.optimizer: muon: DeepSpeed wrapped the optimizer in {type(wrapper).__name__}, "
                            "whose parameter layout Muon does not know", hint="use ZeRO stage 0, 1 or 2")
        import deepspeed.comm as dist

        for i, g in enumerate(wrapper.optimizer.param_groups):
            if not g.get("muon"):
                continue
            pg = wrapper.real_dp_process_group[i]
            world, rank = dist.get_world_size(group=pg), dist.get_rank(group=pg)
            fused = self._fused[g["name"]]
            if isinstance(wrapper, DeepSpeedZeroOptimizer):  # ZeRO-1/2 (any precision)
                whole = [m.shape for m in wrapper.round_robin_bit16_meta[i]]
                starts = list(wrapper.round_robin_bit16_offsets[i])
                # round_robin_gradients reorders the group's parameters: find each one's place as given
                given = {id(p): k for k, p in enumerate(wrapper.bit16_groups[i])}
                fused = [fused[given[id(p)]] for p in wrapper.round_robin_bit16_groups[i]]
                partition = int(wrapper.partition_size[i])
            else:  # BF16_Optimizer: the group flattened in order, padded at the end only
                whole = [p.shape for p in wrapper.bf16_groups[i]]
                starts = [0, *itertools.accumulate(math.prod(s) for s in whole)][:-1]
                partition = wrapper.bf16_groups_flat[i].numel() // world
            assert len(fused) == len(whole), (g["name"], len(fused), len(whole))
            shapes, offsets = [], []  # each logical matrix: a block of rows, contiguous in the flat buffer
            for shape, start, r in zip(whole, starts, fused):
                for a, b in row_blocks(shape, r):
                    shapes.append(torch.Size((b - a, *shape[1:])))
                    offsets.append(start + a * math.prod(shape[1:]))
            (flat,) = g["params"]
            assert flat.numel() == partition and all(len(s) == 2 for s in shapes), (flat.shape, partition, shapes)
            assert offsets[-1] + math.prod(shapes[-1]) <= partition * world
            self._layouts[g["name"]] = FlatLayout(shapes, offsets, partition, rank, world, pg, self.gather_bucket)

    def _update(self, closure: Callable[[], Any] | None) -> Any:
        groups = self.param_groups  # under ZeRO: the one group being stepped
        for g in groups:
            if g.get("muon"):
                self._muon_step(g)
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            return super()._update(closure)  # AdamW on the rest
        finally:
            self.param_groups = groups

    @torch.no_grad()
    def _muon_step(self, g: dict[str, Any]) -> None:
        layout = self._layouts.get(g["name"])
        lr, wd, mu = g["lr"], g["weight_decay"], g["momentum"]
        fused = self._fused[g["name"]]
        assert layout is not None or len(fused) == len(g["params"]), (g["name"], len(fused), len(g["params"]))
        jobs = []  # (parameter, first row, last row, U of those rows): each logical matrix (b - a, d_in)
        for p, rows in zip(g["params"], fused):
            if p.grad is None:
                continue
            if layout is None and p.ndim != 2:  # a flat partition nobody described: never guess
                raise RuntimeError(f"Muon group {g['name']!r} holds a flat {tuple(p.shape)} tensor; "
                                   "call MuonAdamW.bind(engine.optimizer) after deepspeed.initialize")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0)  # unused by Muon; AdamW's __setstate__ expects it in every state
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if g["nesterov"] else buf
            p.mul_(1 - lr * wd)
            if layout is None:
                jobs += [(p, a, b, update[a:b]) for a, b in row_blocks(p.shape, rows)]
            else:
                self._apply_flat(p, update, layout, g)
        for batch in by_shape(jobs, lambda j: j[3].shape, self.gather_bucket):  # same-shape matrices at once
            o = self._orthogonalise(torch.stack([j[3] for j in batch]), g)  # (n, b - a, d_in)
            for (p, a, b, _), o_i in zip(batch, o):
                p[a:b].add_(o_i, alpha=-muon_lr(lr, g["lr_scale"], o_i.shape))

    @staticmethod
    def _orthogonalise(update: torch.Tensor, g: dict[str, Any]) -> torch.Tensor:
        """(n, A, B) same-shape matrices, each orthogonalised as torch's Muon does."""
        return newton_schulz_batched(update, g["ns_coefficients"], g["ns_steps"], g["ns_eps"])

    def _apply_flat(self, part: torch.Tensor, update: torch.Tensor, layout: FlatLayout, g: dict[str, Any]) -> None:
        """part, update (P,): this rank's weights and U. Bucket by bucket, all-gather U, then
        orthogonalise the logical matrices that overlap [rank P, (rank+1) P), same shapes at once,
        and apply each one's slice there."""
        own_lo, own_hi = layout.rank * layout.partition, (layout.rank + 1) * layout.partition
        for bucket in layout.buckets():
            lo = layout.offsets[bucket[0]]
            hi = layout.offsets[bucket[-1]] + math.prod(layout.shapes[bucket[-1]])
            full = layout.gather(update, lo, hi)  # (hi - lo,) every rank takes part
            mine = [i for i in bucket if max(layout.offsets[i], own_lo) < min(layout.offsets[i] +
                                                                           math.prod(layout.shapes[i]), own_hi)]
            for batch in by_shape(mine, lambda i: layout.shapes[i], layout.bucket):
                views = [full[layout.offsets[i] - lo:layout.offsets[i] - lo + math.prod(layout.shapes[i])]
                         .view(layout.shapes[i]) for i in batch]
                o = self._orthogonalise(torch.stack(views), g)  # (n, d_out, d_in)
                for i, o_i in zip(batch, o):
                    off, n = layout.offsets[i], math.prod(layout.shapes[i])
                    a, b = max(off, own_lo), min(off + n, own_hi)
                    part[a - own_lo:b - own_lo].add_(o_i.reshape(-1)[a - off:b - off],
                                                     alpha=-muon_lr(g["lr"], g["lr_scale"], layout.shapes[i]))

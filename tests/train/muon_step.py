"""One DeepSpeed engine per ZeRO stage with ``train.optimizer: muon``, stepped next to the plain
reference (``torch.optim.Muon`` on the hidden matrices, a fused one split into its logical
matrices, + ``torch.optim.AdamW`` on the rest) on the same gradients; prints one JSON line per
stage with the largest weight difference.

Run by ``test_muon.py`` in one process and under ``deepspeed --num_gpus 2`` (every rank gets the
same batch, so the averaged gradient is the reference's bit for bit):

    python -m tests.train.muon_step --stages 0 1 2 [--steps 3] [--bucket ELEMENTS] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import math
import sys

import torch

from ncpctl.recipe import load_recipe
from tests.conftest import RECIPES


def logical_rows(model: torch.nn.Module) -> dict[int, tuple[int, ...]]:
    """``id(weight) -> row counts`` of each fused Linear, read from the modules' own sizes by the
    layouts their docs give (not from ``fused_rows``): ``attn.qkv`` = [q (H hd); k (Hkv hd);
    v (Hkv hd)], a SwiGLU ``mlp.fc`` = [gate; up], DLCM's cross-attention ``wkv`` = [k; v]."""
    from ncpctl.model.designs.cross_attention.module import CrossAttentionCoupling
    from ncpctl.model.core.layers import MLP, Attention

    out = {}
    for m in model.modules():
        if isinstance(m, Attention):
            out[id(m.qkv.weight)] = (m.n_heads * m.hd, m.n_kv * m.hd, m.n_kv * m.hd)
        elif isinstance(m, MLP) and m.gated:
            out[id(m.fc.weight)] = (m.proj.in_features, m.proj.in_features)
        elif isinstance(m, CrossAttentionCoupling):
            out[id(m.wkv.weight)] = (m.wq.out_features, m.wq.out_features)
    return out


class SplitMuon:
    """``torch.optim.Muon`` on the logical matrices of each fused weight as parameters of their
    own (per-matrix Muon): a step copies the fused weight and gradient into the blocks, steps
    torch's Muon on them (its momentum lives there) and copies the blocks back."""

    def __init__(self, params: list[torch.nn.Parameter], rows: dict[int, tuple[int, ...]], **kw):
        self.parts: list[tuple[torch.nn.Parameter, int, int, torch.nn.Parameter]] = []
        for p in params:
            bounds = [0]
            for r in rows.get(id(p), (p.shape[0],)):
                bounds.append(bounds[-1] + r)
            self.parts += [(p, a, b, torch.nn.Parameter(p.detach()[a:b].clone()))
                           for a, b in zip(bounds[:-1], bounds[1:])]
        self.muon = torch.optim.Muon([q for *_, q in self.parts], **kw)

    @torch.no_grad()
    def step(self) -> None:
        for p, a, b, q in self.parts:
            q.copy_(p[a:b])
            q.grad = p.grad[a:b].clone()
        self.muon.step()
        for p, a, b, q in self.parts:
            p[a:b] = q

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        for p, *_ in self.parts:
            p.grad = None


def reference_optimizers(model: torch.nn.Module, recipe) -> list:
    """torch.optim.Muon on the logical matrices (``SplitMuon``) + torch.optim.AdamW, over the
    groups ``param_groups`` assigns."""
    from ncpctl.train.config import param_groups

    t = recipe.train
    groups = param_groups(model, t.weight_decay, muon=True)
    assert groups[0]["name"] == "muon"
    lr, wd = t.lr, t.weight_decay
    if t.muon_lr_scale == "sqrt_max_dim":  # torch has 0.2 sqrt(max): 5x the lr, wd / 5 keeps lr * wd
        lr, wd = 5 * lr, wd / 5
    muon = SplitMuon(groups[0]["params"], logical_rows(model), lr=lr, weight_decay=wd, momentum=t.muon_momentum,
                     nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{k: v for k, v in g.items() if k != "muon"} for g in groups[1:]], lr=t.lr,
                              betas=(t.betas[0], t.betas[1]), eps=t.eps, weight_decay=t.weight_decay)
    return [muon, adamw]


def split_matrices(optimizer) -> int:
    """Muon matrices that straddle a partition boundary (their NS needs the all-gather)."""
    n = 0
    for lay in getattr(optimizer, "_layouts", {}).values():
        for shape, off in zip(lay.shapes, lay.offsets):
            end = off + math.prod(shape)
            n += (off // lay.partition) != ((end - 1) // lay.partition)
    return n


def gather_buckets(optimizer) -> int:
    return sum(len(lay.buckets()) for lay in getattr(optimizer, "_layouts", {}).values())


def run_stage(stage: int, steps: int, sets: list[str], d) -> dict:
    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.engine import build_engine as _build_engine

    recipe = load_recipe(RECIPES / "debug.yaml", [
        "model.max_seq_len=64", "model.concept.concept_layers=1", "train.seq_len=32", "train.optimizer=muon", "train.grad_clip=0", "train.warmup_steps=0",
        "train.lr=3e-3", "train.min_lr=3e-3", "train.micro_batch_size=2", f"train.global_batch_size={2 * d.world}",
        f"deepspeed.zero_stage={stage}", *sets], world_size=d.world)
    torch.manual_seed(0)
    model = NCPModel(recipe.model_config)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    ref_opts = reference_optimizers(ref, recipe)
    engine, _ = _build_engine(recipe, model, d, lambda msg: None)
    g = torch.Generator().manual_seed(1)
    diffs, losses = [], []
    for _ in range(steps):
        batch = torch.randint(0, recipe.model_config.vocab_size, (2, 33), generator=g)  # the same on every rank
        x, y = batch[:, :-1], batch[:, 1:]
        out = engine(x, y)
        engine.backward(out.loss)
        engine.step()
        ref_loss = ref(x, y).loss
        ref_loss.backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
        losses.append((out.loss.item(), ref_loss.item()))
        diffs.append(max((a - b).abs().max().item() for a, b in zip(engine.module.parameters(), ref.parameters())))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), init.parameters()))
    return {"stage": stage, "world": d.world, "rank": d.rank, "max_diff": diffs, "losses": losses,
            "wrapper": type(engine.optimizer).__name__, "inner": type(inner).__name__,
            "split_matrices": split_matrices(inner), "buckets": gather_buckets(inner), "weights_moved": moved,
            "logical_matrices": sum(len(lay.shapes) for lay in getattr(inner, "_layouts", {}).values()),
            "ds_tagged": sum(hasattr(p, "use_muon") for p in engine.module.parameters())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--bucket", type=int, default=None, help="MuonAdamW.gather_bucket (elements)")
    ap.add_argument("--local_rank", type=int, default=0)  # the launcher's
    args = ap.parse_args(argv)
    if args.bucket:
        from ncpctl.train.muon import MuonAdamW

        MuonAdamW.gather_bucket = args.bucket
    from ncpctl.train.engine import init_distributed

    d = init_distributed()
    for stage in args.stages:
        # one write(2) per line (< PIPE_BUF: atomic), so two ranks sharing the pipe cannot interleave
        sys.stdout.flush()
        os.write(1, (json.dumps(run_stage(stage, args.steps, args.sets, d)) + "\n").encode())
    sys.stdout.flush()


if __name__ == "__main__":
    main()

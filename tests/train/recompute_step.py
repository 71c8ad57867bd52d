"""``train.activation_checkpointing`` and ``train.compile`` against eager, inside the DeepSpeed
engine: per design and ZeRO stage, one engine per mode (none, then full, selective, compile) from
the same initial weights; one step on the same batch (gradients of every parameter, gathered under
ZeRO-3, compared before the update), then the loss of a second batch after the update. Prints one
JSON line per (design, stage) with the largest difference of each mode from ``none``.

``compile`` compiles with ``--backend`` (dynamo's ``eager``: the graph capture alone, seconds; or
``inductor``: C++ kernels, ~30 s of g++ per design on a busy core). At ZeRO-3 one rank is enough:
every parameter is partitioned (its data is empty outside its module's forward; the row's
``released`` counts them), so the gathering hooks run around every compiled block.

Run by ``test_recompute.py`` and ``test_compile.py``:
``python -m tests.train.recompute_step --stages 0 3 --modes full selective compile --designs ...``
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ncpctl.recipe import load_recipe
from tests.conftest import RECIPES

# design -> (recipe, --set overrides at every stage); ArchPreview's Muon is refused at ZeRO-3: AdamW there
DESIGNS = {
    "conceptlm": ("debug.yaml", []),
    "archpreview": ("debug-archpreview.yaml", []),  # IRC, CRC (3 connections), MTP depth 1, post-norm, SWA
    "dlcm": ("debug-dlcm.yaml", []),  # dynamic boundaries, cross-attention coupling, muP
    "bottleneck": ("debug-bottleneck.yaml", []),  # the Steerling bottleneck, dropout 0.1
}
B, T = 2, 32
# mode -> its --set overrides ("none": eager, nothing recomputed)
MODES = {"none": [], "full": ["train.activation_checkpointing=full"],
         "selective": ["train.activation_checkpointing=selective"], "compile": ["train.compile=true"]}


def run_mode(design: str, stage: int, mode: str, d, backend: str = "eager") -> tuple[list[float], dict[str, torch.Tensor], int]:
    import functools

    from deepspeed.utils import safe_get_full_grad

    from ncpctl.model.core.model import NCPModel
    from ncpctl.train import compiled
    from ncpctl.train.engine import build_engine

    path, sets = DESIGNS[design]
    opt = ["train.optimizer=adamw"] if stage == 3 else []
    recipe = load_recipe(RECIPES / path, [*sets, *opt, "model.max_seq_len=64", f"train.seq_len={T}",
                                          "train.precision=fp32", f"train.micro_batch_size={B}",
                                          f"train.global_batch_size={B}", "train.warmup_steps=0",
                                          f"deepspeed.zero_stage={stage}", *MODES[mode]])
    torch.manual_seed(0)
    model = NCPModel(recipe.model_config)
    compile_blocks = compiled.compile_blocks  # build_engine imports it from the module when it runs
    compiled.compile_blocks = functools.partial(compile_blocks, backend=backend)
    try:
        engine, _ = build_engine(recipe, model, d, warn=_refuse)
    finally:
        compiled.compile_blocks = compile_blocks
    engine.train()
    params = list(engine.module.parameters())
    released[:] = [sum(p.data.numel() == 0 for p in params), len(params)]  # ZeRO-3: partitioned away
    calls = [0]  # forwards of the attention projections in step 0: twice per layer where recomputed
    for m in engine.module.modules():  # (not with compile: a hook per block would be a recompile per block)
        if hasattr(m, "qkv") and hasattr(m, "proj") and mode != "compile":
            m.qkv.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(1)
    losses, grads = [], {}
    for step in range(2):
        batch = torch.randint(0, recipe.model_config.vocab_size, (B, T + 1), generator=g)
        labels = torch.rand(B, T, 16, generator=g) < 0.1
        extra = {"concept_labels": labels} if model.bottleneck is not None else {}
        torch.manual_seed(2 + step)  # the bottleneck's dropout: the same mask in every mode
        out = engine(batch[:, :-1], batch[:, 1:], sample_ids=torch.arange(B) + step * B, **extra)
        engine.backward(out.loss)
        losses.append(out.loss.item())
        if step == 0:
            qkv_calls = calls[0]
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                     if p.requires_grad and safe_get_full_grad(p) is not None}
        engine.step()
    return losses, grads, qkv_calls


released = [0, 0]  # parameters whose data is empty after deepspeed.initialize (ZeRO-3 partitioned them), of all


def _refuse(line: str) -> None:
    raise AssertionError(f"the blocks were not compiled: {line}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--designs", nargs="+", default=list(DESIGNS))
    ap.add_argument("--modes", nargs="+", default=["full", "selective"], choices=[m for m in MODES if m != "none"])
    ap.add_argument("--backend", default="eager", help="torch.compile backend of the compile mode")
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    from ncpctl.train.engine import init_distributed

    d = init_distributed()
    for design in args.designs:
        for stage in args.stages:
            ref_loss, ref_grads, ref_calls = run_mode(design, stage, "none", d)
            row = {"design": design, "stage": stage, "qkv_calls": ref_calls}
            for mode in args.modes:
                torch._dynamo.reset()  # compile afresh (the stage-0 graphs would serve stage 3 as well)
                counters.clear()
                loss, grads, calls = run_mode(design, stage, mode, d, args.backend)
                assert grads.keys() == ref_grads.keys(), (design, mode, set(grads) ^ set(ref_grads))
                row[mode] = {"loss": max(abs(a - b) for a, b in zip(loss, ref_loss)),
                             "loss_first": abs(loss[0] - ref_loss[0]),  # the second step's also carries the update
                             "grad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
                             "params": len(grads), "qkv_calls": calls, "released": list(released),
                             "graph_calls": counters["stats"]["calls_captured"], "graph_breaks": sum(counters["graph_break"].values())}
            row["losses"] = ref_loss
            os.write(1, (json.dumps(row) + "\n").encode())


if __name__ == "__main__":
    main()

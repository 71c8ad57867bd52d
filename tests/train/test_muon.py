"""``train.optimizer: muon`` (NCP-ArchPreview §3.6): which parameters Muon takes, its step against
the plain reference (``torch.optim.Muon`` + ``torch.optim.AdamW``) without DeepSpeed and inside
the DeepSpeed engine at ZeRO 0/1/2 (one process and two ranks), two ranks against one process
over 10 steps (the step tests on a GQA SwiGLU model: q, k, v, gate and up orthogonalised each on its
own), exact resume after kill -9, and the refusals (ZeRO-3, offload, nothing to
orthogonalise, another optimizer's checkpoint)."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe
from ncpctl.train.config import GuardedAdamW, make_optimizer, muon_matrices, param_groups
from ncpctl.train.muon import MuonAdamW

from ..conftest import RECIPES
from .conftest import ENV, losses, metrics, ncpctl, result, start, wait_for_step, weights
from .muon_step import reference_optimizers

MUON = ["--set", "train.optimizer=muon"]
BLOCKS = ["encoder.0", "decoder.0", "decoder.1", "decoder.2", "concept.layers.0", "concept.layers.1"]
DEBUG_MUON = [f"{b}.{m}.weight" for b in BLOCKS for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
GQA = ["model.backbone=llama", "model.n_kv_heads=2"]  # debug at d 64: q 4 heads x 16, k and v 2 x 16; SwiGLU


def recipe(*sets: str, world_size: int = 1):
    return load_recipe(RECIPES / "debug.yaml", ["train.optimizer=muon", *sets], world_size=world_size)


def test_muon_takes_exactly_the_hidden_matrices_of_the_debug_model() -> None:
    from ncpctl.model.core.model import NCPModel

    r = recipe()
    model = NCPModel(r.model_config)
    assert list(muon_matrices(model)) == DEBUG_MUON  # the attention and MLP matrices of all 6 blocks
    opt = make_optimizer(model, r, on_gpu=False)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {g["name"]: [names[id(p)] for p in g["params"]] for g in opt.param_groups}
    assert by_group["muon"] == DEBUG_MUON
    # AdamW, decayed: the LM head, the concept heads (S x N code weights), the SimVQ transform
    assert by_group["decay"] == ["concept.heads.weight", "concept.codebook.transform.0.weight",
                                 "concept.codebook.transform.2.weight", "lm_head.weight"]
    plain = by_group["no_decay"]
    assert "embed.weight" in plain and all(n.endswith(("bias", "norm.weight")) or n == "embed.weight" for n in plain)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(DEBUG_MUON) | set(by_group["decay"]) | set(plain) == trainable  # each once
    assert "concept.codebook.base" not in trainable  # SimVQ base: frozen, in no group
    assert {g["name"]: g["weight_decay"] for g in opt.param_groups} == {"muon": 0.1, "decay": 0.1, "no_decay": 0.0}
    # the default is today's AdamW, unchanged
    plain_opt = make_optimizer(model, load_recipe(RECIPES / "debug.yaml", []), on_gpu=False)
    assert type(plain_opt) is GuardedAdamW and [g["name"] for g in plain_opt.param_groups] == ["decay", "no_decay"]


def test_depth_mixers_and_tied_embeddings_stay_on_adamw() -> None:
    from ncpctl.model.core.model import NCPModel
    from tests.model import toys  # noqa: F401  (registers the toy mixer "dense": Linear layers)
    from tests.model._helpers import tiny

    model = NCPModel(tiny("neox", residual="dense", concept={}, tie_embeddings=True))
    mixer = [n for n, _ in model.named_parameters() if ".residual." in n]
    assert any(n.endswith("dyn.0.weight") for n in mixer)  # 2-D Linear weights inside a mixer
    chosen = set(muon_matrices(model))
    assert chosen and not chosen & set(mixer) and "decoder.0.attn.qkv.weight" in chosen
    assert not any(n.startswith(("embed", "lm_head", "concept.heads", "concept.codebook")) for n in chosen)


def test_archpreview_parts_by_rule() -> None:
    """IRC and CRC mixers stay on AdamW (mixing coefficients); the MTP projection and its layer are
    hidden matrices (d -> d features), so Muon takes them; listed by name."""
    from ncpctl.model.core.model import NCPModel

    r = recipe("model.residual=irc", "model.crc_connections=[encoder-concept,encoder-decoder,concept-decoder]",
               "model.mtp_depth=1")
    model = NCPModel(r.model_config)
    chosen = list(muon_matrices(model))
    mtp = ["mtp.depths.0.proj.weight"] + [f"mtp.depths.0.layer.0.{m}.weight"
                                           for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    assert sorted(chosen) == sorted(DEBUG_MUON + mtp)
    mixers = [n for n, _ in model.named_parameters() if ".residual." in n or n.startswith("crc.")]
    assert any(n.startswith("crc.") for n in mixers) and any(".residual." in n for n in mixers)
    groups = {g["name"]: {id(p) for p in g["params"]} for g in make_optimizer(model, r, on_gpu=False).param_groups}
    params = dict(model.named_parameters())
    assert all(id(params[n]) in groups["no_decay"] for n in mixers)


@pytest.mark.parametrize("sets", [["model.residual=irc", "model.crc_mode=input",
                                   "model.crc_connections=[encoder-concept,encoder-decoder,concept-decoder]"],
                                  ["model.residual=block_attnres", "model.attnres_block=2"]])
def test_table3_mixers_stay_on_adamw_without_decay(sets: list[str]) -> None:
    """The input-level CRC's and Block AttnRes's parameters (pseudo-queries and key norms: 2-D
    (n + 1, d) tensors, not Linears) are mixing coefficients: AdamW, no weight decay."""
    from ncpctl.model.core.model import NCPModel

    r = recipe(*sets)
    model = NCPModel(r.model_config)
    assert sorted(muon_matrices(model)) == sorted(DEBUG_MUON)
    mixers = [n for n, _ in model.named_parameters() if ".residual." in n or n.startswith("crc.")]
    assert mixers
    groups = {g["name"]: {id(p) for p in g["params"]} for g in make_optimizer(model, r, on_gpu=False).param_groups}
    params = dict(model.named_parameters())
    assert all(id(params[n]) in groups["no_decay"] for n in mixers)


def test_fused_matrices_are_split_into_their_logical_matrices() -> None:
    """Per-matrix Muon: the row blocks of each fused Linear, by name. GQA's qkv = [q (4 x 16);
    k (2 x 16); v (2 x 16)], SwiGLU's fc = [gate (ffn); up (ffn)], DLCM's cross-attention wkv = [k; v]."""
    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.config import fused_rows

    r = recipe(*GQA)
    ffn = r.model_config.ffn_dim
    expect = {f"{b}.{m}.weight": rows for b in BLOCKS for m, rows in (("attn.qkv", (64, 32, 32)), ("mlp.fc", (ffn, ffn)))}
    assert fused_rows(NCPModel(r.model_config)) == expect
    assert set(fused_rows(NCPModel(recipe().model_config))) == {f"{b}.attn.qkv.weight" for b in BLOCKS}  # GELU: one fc
    dlcm = NCPModel(load_recipe(RECIPES / "debug-dlcm.yaml", ["train.optimizer=muon"]).model_config)
    assert fused_rows(dlcm)["concept.coupling.wkv.weight"] == (64, 64)


@pytest.mark.parametrize("scale", ["match_rms_adamw", "sqrt_max_dim"])
def test_step_is_torch_muon_plus_adamw(scale: str) -> None:
    """Without DeepSpeed (stage 0 fp32, the guard on): 3 steps, bit for bit the reference, which is
    torch.optim.Muon on q, k, v, gate and up as matrices of their own (each scaled by its shape)."""
    from ncpctl.model.core.model import NCPModel

    r = recipe("deepspeed.zero_stage=0", "train.grad_clip=0", "model.max_seq_len=64", "train.seq_len=32",
               f"train.muon_lr_scale={scale}", "train.muon_momentum=0.9", *GQA)
    torch.manual_seed(0)
    model = NCPModel(r.model_config)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    opts = [make_optimizer(model, r, on_gpu=False)], reference_optimizers(ref, r)
    assert opts[0][0].guard
    x = torch.randint(0, r.model_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, group in zip((model, ref), opts):
            m(x[:, :-1], x[:, 1:]).loss.backward()
            for opt in group:
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert (model.decoder[0].attn.qkv.weight - init.decoder[0].attn.qkv.weight).abs().max() > 1e-4  # it moved


def test_nonfinite_gradient_leaves_weights_and_momentum_untouched() -> None:
    r = recipe("deepspeed.zero_stage=0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = make_optimizer(model, r, on_gpu=False)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.grad.fill_(float("nan"))
    opt.step()
    assert opt.overflow and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(state["momentum_buffer"], opt.state[model[0].weight]["momentum_buffer"])


def _engine_steps(world: int) -> list[dict]:
    # two ranks: all-gather buckets of 10,000 elements, so the 16,384-element MLP matrices go alone
    cmd = [sys.executable, "-m", "tests.train.muon_step", "--stages", "0", "1", "2", "--bucket",
           "10000" if world > 1 else "0", *(a for s in GQA for a in ("--set", s))]
    if world > 1:
        import os

        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(world), "--master_port",
               str(31000 + os.getpid() % 2000), "--module", *cmd[2:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"stage"')]


def _check_engine_steps(records: list[dict], world: int) -> None:
    assert sorted((r["stage"], r["rank"]) for r in records) == [(s, k) for s in (0, 1, 2) for k in range(world)]
    for r in records:
        assert max(r["max_diff"]) <= 1e-6, r  # 3 steps against torch.optim.Muon + AdamW
        assert r["weights_moved"] > 1e-3 and r["ds_tagged"] == 0  # DeepSpeed's own Muon is not engaged
        assert r["inner"] == "MuonAdamW"
        assert r["wrapper"] == ("MuonAdamW" if r["stage"] == 0 else "DeepSpeedZeroOptimizer")
        # 5 blocks: qkv, proj, fc, proj = 20 matrices; q, k, v, proj, gate, up, proj = 35 logical ones
        assert r["logical_matrices"] == (0 if r["stage"] == 0 else 35)
        if world > 1 and r["stage"] > 0:
            assert r["split_matrices"] >= 1  # a matrix straddles the two ranks' partitions
            assert r["buckets"] > 10  # gathered in many pieces


def test_engine_step_matches_the_reference_at_zero_0_1_2() -> None:
    _check_engine_steps(_engine_steps(1), 1)


@pytest.mark.slow
def test_engine_step_matches_the_reference_on_two_ranks() -> None:
    _check_engine_steps(_engine_steps(2), 2)


def test_zero3_and_offload_are_refused_when_the_recipe_loads() -> None:
    with pytest.raises(UserError) as e:
        recipe("deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true")
    text = "\n".join(e.value.problems)
    assert "deepspeed.zero_stage: 3 partitions every matrix across ranks; train.optimizer: muon runs at ZeRO " \
           "stage 0, 1 or 2" in text
    assert "deepspeed.offload_optimizer: not supported with train.optimizer: muon" in text
    recipe("deepspeed.zero_stage=2")  # fine
    load_recipe(RECIPES / "debug.yaml", ["deepspeed.zero_stage=3"])  # AdamW at 3: fine


def test_zero3_refusal_through_the_entry_point(make_recipe) -> None:
    proc = ncpctl("pretrain", str(make_recipe("z3")), *MUON, "--set", "deepspeed.zero_stage=3")
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "ZeRO stage 0, 1 or 2" in proc.stderr, proc.stderr


def test_no_hidden_matrix_is_an_error() -> None:
    r = recipe()
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4))
    with pytest.raises(UserError, match="train.optimizer: muon: this model has no trainable hidden matrix"):
        make_optimizer(model, r, on_gpu=False)


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> Path:
    """An uninterrupted 12-step Muon run at ZeRO-2 (flat partitions), checkpoints every 3 steps."""
    from .conftest import RECIPE

    root = tmp_path_factory.mktemp("muon_reference")
    path = root / "ref.yaml"
    path.write_text(RECIPE.format(data=tiny_data, run=root / "run"))
    r = result(ncpctl("pretrain", str(path), "--json", *MUON, "--set", "deepspeed.zero_stage=2"))
    assert r["step"] == 12 and r["nonfinite_steps"] == 0 and r["zero_stage"] == 2
    return root / "run"


def test_muon_resume_after_kill9_is_bit_identical(muon_reference: Path, make_recipe, tmp_path: Path) -> None:
    sets = [*MUON, "--set", "deepspeed.zero_stage=2"]
    recipe_path, run_dir = make_recipe("killed"), tmp_path / "killed"
    proc = start("pretrain", str(recipe_path), *sets, env={"NCPCTL_FAULT": "sleep@0.15"})
    wait_for_step(run_dir, 7, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = result(ncpctl("pretrain", str(recipe_path), "--json", *sets))
    assert r["resumed_from"] and r["step"] == 12 and r["steps_run"] > 0
    assert losses(run_dir) == losses(muon_reference)  # exact, step by step
    a, b = weights(muon_reference / "checkpoints" / "step_0000012"), weights(run_dir / "checkpoints" / "step_0000012")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref = metrics(muon_reference)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.5  # it trains


def test_a_checkpoint_of_another_optimizer_is_refused(muon_reference: Path, make_recipe, tmp_path: Path) -> None:
    from .conftest import copy_run

    copy_run(muon_reference, tmp_path / "other")
    proc = ncpctl("pretrain", str(make_recipe("other")), "--set", "deepspeed.zero_stage=2",
                  "--set", "train.max_steps=14")
    assert proc.returncode == 2 and "train.optimizer: muon in the checkpoint, adamw now" in proc.stderr
    ckpt = muon_reference / "checkpoints" / "step_0000012"
    proc = ncpctl("adapt-vq", str(make_recipe("avq")), *MUON, "--set", "deepspeed.zero_stage=2",
                  "--set", f"train.init_from={ckpt}")  # trains only the concept heads and codebook: all AdamW
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "no trainable hidden matrix" in lines[0], proc.stderr


# micro batch 2, global 8: one process accumulates 4 micro-batches, two ranks 2 each
PARITY = [*MUON, "--set", "train.max_steps=10", "--set", "train.micro_batch_size=2", "--set", "train.eval_every=0",
          "--set", "train.save_every=0"]


@pytest.fixture(scope="module")
def muon_single(tmp_path_factory, tiny_data) -> Path:
    from .conftest import RECIPE

    root = tmp_path_factory.mktemp("muon_single")
    path = root / "one.yaml"
    path.write_text(RECIPE.format(data=tiny_data, run=root / "one"))
    assert result(ncpctl("pretrain", str(path), "--json", *PARITY))["world_size"] == 1
    return root / "one"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_ranks_match_one_process(stage: int, muon_single: Path, make_recipe, tmp_path: Path) -> None:
    proc = ncpctl("pretrain", str(make_recipe(f"z{stage}")), "--json", *PARITY, "--set",
                  f"deepspeed.zero_stage={stage}", launcher_ranks=2, timeout=600)
    r = result(proc)
    assert r["world_size"] == 2 and r["zero_stage"] == stage
    one, two = losses(muon_single), losses(tmp_path / f"z{stage}")
    assert [s for s, _ in two] == [s for s, _ in one] == list(range(1, 11))
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) / abs(a) <= 1e-4, (one, two)
    assert one[-1][1] < one[0][1] - 0.3

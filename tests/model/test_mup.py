"""Decoupled muP (DLCM Sec. 6.1; ncpctl/model/designs/mup/module.py): the coordinate check (activation scales
after a few AdamW steps stay flat as the token and concept widths double twice, and grow without
muP), the keys' validation, the init, the logit divisor on every path, the optimizer groups."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ncpctl.errors import UserError
from ncpctl.model.core.config import ConfigError, build_config
from ncpctl.model.core.model import NCPModel
from ncpctl.recipe.load import load_recipe
from ncpctl.train.config import apply_mup, lr_schedule, make_optimizer, param_groups

from ..conftest import REPO
from ._helpers import build, tiny, tokens

torch.set_num_threads(1)
WIDTHS = (64, 128, 256)


def coordinates(d: int, mup: bool, steps: int = 5, lr: float = 1e-2) -> dict[str, float]:
    """Mean |activation| after ``steps`` AdamW steps on one fixed batch: the decoder output before
    the final norm, the concept stack's output (before its norm), the logits. Head size 16 fixed
    (d / 16 token heads), the concept transformer twice the token width; base width 64."""
    torch.manual_seed(0)
    cfg = build_config("debug", vocab_size=256, d_model=d, n_heads=d // 16, n_layers=3, max_seq_len=64,
                       mup_base_width=64 if mup else None,
                       concept=dict(enabled=True, k=4, encoder_layers=1, concept_layers=1, segments=4, codes=16,
                                    d_concept=2 * d))
    model = NCPModel(cfg)
    opt = torch.optim.AdamW(apply_mup(param_groups(model, 0.0), lr, 1e-8), betas=(0.9, 0.95))
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x[:, :-1], x[:, 1:]).loss.backward()
        opt.step()
    seen: dict[str, float] = {}
    model.final_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("decoder", i[0].abs().mean().item()))
    model.concept.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("concept", i[0].abs().mean().item()))
    with torch.no_grad():
        seen["logits"] = model(x[:, :-1]).logits.abs().mean().item()
    return seen


def test_coordinate_check() -> None:
    """muP: every coordinate's max/min over d = 64, 128, 256 stays below 1.5; the standard
    parametrization at the same lr grows with width (decoder and concept outputs > 4x, logits > 2x),
    so the check can fail. Measured: muP <= 1.23x, standard 3.3x (logits) to 13x (concept)."""
    ratio = lambda vals: max(vals) / min(vals)  # noqa: E731
    mup = [coordinates(d, True) for d in WIDTHS]
    sp = [coordinates(d, False) for d in WIDTHS]
    for key in ("decoder", "concept", "logits"):
        assert ratio([c[key] for c in mup]) < 1.5, (key, mup)
    assert sp[-1]["decoder"] > 4 * sp[0]["decoder"] and sp[-1]["concept"] > 4 * sp[0]["concept"], sp
    assert sp[-1]["logits"] > 2 * sp[0]["logits"], sp


@pytest.mark.parametrize("key, value", [("mup_base_width", 0), ("mup_base_width", -64), ("mup_base_width", "64"),
                                        ("mup_base_width", True), ("mup_base_concept_width", 0)])
def test_bad_widths_name_the_key(key: str, value) -> None:
    kw = {"mup_base_width": 64, key: value}
    with pytest.raises(ConfigError) as e:
        build_config("debug", **kw)
    assert [k for k, _ in e.value.problems] == [key]


def test_a_concept_base_needs_the_token_base() -> None:
    with pytest.raises(ConfigError, match="mup_base_concept_width: decoupled muP is off"):
        build_config("debug", mup_base_concept_width=64)


def test_recipe_error_is_one_line_naming_the_key() -> None:
    with pytest.raises(UserError) as e:
        load_recipe(REPO / "recipes" / "debug.yaml", ["model.mup_base_width=0"])
    assert "model.mup_base_width" in str(e.value) and "\n" not in str(e.value)


def test_widths_and_default_concept_base() -> None:
    cfg = build_config("debug", mup_base_width=32, concept=dict(enabled=True, d_concept=128))
    assert cfg.mup_widths == (2.0, 4.0)
    cfg = build_config("debug", mup_base_width=32, mup_base_concept_width=64, concept=dict(enabled=True, d_concept=128))
    assert cfg.mup_widths == (2.0, 2.0)
    assert build_config("debug").mup_widths is None


def test_at_the_base_width_mup_is_the_standard_model() -> None:
    """s = 1 everywhere: the same init (bit for bit), the same logits, every lr the base one."""
    outs = []
    for base in (None, 64):
        torch.manual_seed(0)
        m = NCPModel(build_config("debug", mup_base_width=base, concept=dict(enabled=True)))
        outs.append((m.state_dict(), m(torch.arange(24)[None]).logits, param_groups(m, 0.1)))
    (sd0, l0, g0), (sd1, l1, g1) = outs
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0) and torch.equal(l0, l1)
    assert {g.get("lr_mult", 1.0) for g in g1} == {1.0}


@pytest.mark.parametrize("init", ["hf", "gpt-neox"])
def test_init_scales_hidden_variance_per_module(init: str) -> None:
    """Hidden matrices: the base std / sqrt(s) of their module; embeddings and LM head: the base std."""
    torch.manual_seed(0)
    cfg = build_config("debug", d_model=256, n_heads=16, vocab_size=4096, init=init, mup_base_width=64,
                       concept=dict(enabled=True, d_concept=512))
    m = NCPModel(cfg)
    base = 0.02 if init == "hf" else math.sqrt(2 / (5 * 64))
    expect = {"embed.weight": base, "lm_head.weight": base, "encoder.0.attn.qkv.weight": base / 2,
              "decoder.1.mlp.fc.weight": base / 2, "concept.up.weight": base / 2,
              "concept.layers.0.mlp.fc.weight": base / math.sqrt(8), "concept.heads.weight": base / math.sqrt(8)}
    params = dict(m.named_parameters())
    for name, std in expect.items():
        assert params[name].std().item() == pytest.approx(std, rel=0.05), name


def test_logits_divided_by_s_token_on_every_path() -> None:
    """forward, the fused loss, prefill + decode_step, from_decoder_input and MTP all read
    lm_head(h) / s_token (DLCM design: dynamic boundaries, cross-attention, a wider concept stack)."""
    cfg = tiny("llama", mup_base_width=16, mtp_depth=1,
               concept=dict(segmentation="dynamic", coupling="cross_attention", d_concept=64))
    assert cfg.mup_widths == (2.0, 4.0)
    model = build(cfg, seed=1)
    x = tokens(cfg, 2, 17)
    with torch.no_grad():
        out = model(x, return_hidden=True)
        assert torch.allclose(out.logits, F.linear(out.hidden, model.lm_head.weight) / 2, atol=1e-6)
        loss = model(x[:, :-1], x[:, 1:]).losses["ntp_loss"]
        ref = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
        again = model.from_decoder_input(out.concept.z, concept=out.concept)
        assert (again - out.logits).abs().max() <= 1e-5
        logits, state = model.prefill(x[:, :9], [9, 9])
        assert (logits - out.logits[:, :9]).abs().max() <= 1e-5
        for t in range(9, 17):
            assert (model.decode_step(state, x[:, t]) - out.logits[:, t]).abs().max() <= 1e-5
    model.train()
    out = model(x[:, :-1], x[:, 1:], sample_ids=torch.arange(2))
    assert math.isfinite(out.losses["mtp_loss"].item())


def test_bottleneck_attribution_stays_exact_after_the_division() -> None:
    """The division comes after the bottleneck: each logit = (W_y . (k K + u U + e)) / s_token,
    which the attribution reads through ``logit_weight``."""
    cfg = tiny("neox", mup_base_width=8, bottleneck=dict(enabled=True, concepts=6))
    model = build(cfg, seed=2)
    x = tokens(cfg, 2, 11)
    with torch.no_grad():
        out = model(x, return_bottleneck=True)
        ids = out.logits.argmax(-1)
        att = model.bottleneck.attribute(out.bottleneck, model.logit_weight, ids)
        assert (att.logit - out.logits.gather(-1, ids[..., None])[..., 0]).abs().max() <= 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_groups_carry_the_multipliers(optimizer: str) -> None:
    """Token hidden matrices lr / s_token, concept ones lr / s_concept (AdamW epsilon alike), the
    rest the base lr; the LambdaLR schedule multiplies each group's own initial lr."""
    r = load_recipe(REPO / "recipes" / "debug-dlcm.yaml", ["model.mup_base_width=32", f"train.optimizer={optimizer}"])
    model = NCPModel(r.model_config)
    opt = make_optimizer(model, r, on_gpu=False)
    t, names = r.train, {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: g for g in opt.param_groups}
    prefix = "muon" if optimizer == "muon" else "decay"
    assert set(groups) == {f"{prefix}_token", f"{prefix}_concept", "decay", "no_decay"} | (
        {"decay_concept"} if optimizer == "muon" else set())  # Muon: the concept heads stay on AdamW
    for name, s in ((f"{prefix}_token", 2.0), (f"{prefix}_concept", 4.0)):
        assert groups[name]["lr"] == pytest.approx(t.lr / s) and groups[name]["eps"] == pytest.approx(t.eps / s)
    member = {names[id(p)]: g["name"] for g in opt.param_groups for p in g["params"]}
    assert member["encoder.0.attn.qkv.weight"] == f"{prefix}_token" and member["concept.up.weight"] == f"{prefix}_token"
    assert member["concept.layers.0.mlp.proj.weight"] == f"{prefix}_concept"
    assert member["concept.heads.weight"].endswith("_concept")
    for base in ("embed.weight", "lm_head.weight", "final_norm.weight", "encoder.0.attn.qkv.bias"):
        assert groups[member[base]]["lr"] == t.lr, base
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(r))
    for _ in range(3):
        opt.step()  # no gradients: nothing moves, only the order LambdaLR expects
        sched.step()
    f = lr_schedule(r)(3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([t.lr * g.get("lr_mult", 1.0) * f
                                                                 for g in opt.param_groups])


def test_reset_hyperparameters_keeps_each_groups_multiplier() -> None:
    """midtrain ``load: all``: the loaded groups get this recipe's lr and epsilon, times their muP multiplier."""
    from ncpctl.train.engine import reset_hyperparameters as _reset_hyperparameters

    r = load_recipe(REPO / "recipes" / "debug-dlcm.yaml", ["model.mup_base_width=32"])
    model = NCPModel(r.model_config)
    opt = make_optimizer(model, r, on_gpu=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(r))
    for g in opt.param_groups:  # what a checkpoint of another recipe would have left
        g.update(lr=1.0, initial_lr=1.0, eps=1.0)
    _reset_hyperparameters(SimpleNamespace(optimizer=opt, module=model, lr_scheduler=sched), r)
    t, f = r.train, lr_schedule(r)(0)
    for g in opt.param_groups:
        m = g.get("lr_mult", 1.0)
        assert g["lr"] == pytest.approx(t.lr * m * f) and g["initial_lr"] == pytest.approx(t.lr * m)
        assert g["eps"] == pytest.approx(t.eps * m)
    assert sched.base_lrs == [g["initial_lr"] for g in opt.param_groups]
    assert {g.get("lr_mult") for g in opt.param_groups} == {None, 0.5, 0.25}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_three_base_rates_reach_their_groups(optimizer: str) -> None:
    """DLCM Sec. 6.1.1's three base rates: eta_E,D = train.mup_lr_token / s_token, eta_M =
    train.mup_lr_concept / s_concept, eta_base_others = train.lr for the rest, in the optimizer's
    groups, under the schedule and after midtrain's reset (s_token 2, s_concept 4 at base 32)."""
    from ncpctl.train.engine import reset_hyperparameters as _reset_hyperparameters

    lrs = dict(token=1e-3, concept=2e-3, others=5e-4)
    r = load_recipe(REPO / "recipes" / "debug-dlcm.yaml", [
        "model.mup_base_width=32", f"train.optimizer={optimizer}", f"train.lr={lrs['others']}",
        f"train.mup_lr_token={lrs['token']}", f"train.mup_lr_concept={lrs['concept']}", "train.min_lr=1e-5"])
    s_token, s_concept = r.model_config.mup_widths
    assert (s_token, s_concept) == (2.0, 4.0)
    model = NCPModel(r.model_config)
    opt = make_optimizer(model, r, on_gpu=False)
    want = {g["name"]: lrs[g.get("mup", "others")] / {"token": s_token, "concept": s_concept}.get(g.get("mup"), 1.0)
            for g in opt.param_groups}
    prefix = "muon" if optimizer == "muon" else "decay"
    assert want[f"{prefix}_token"] == lrs["token"] / 2 and want[f"{prefix}_concept"] == lrs["concept"] / 4
    assert want["decay"] == want["no_decay"] == lrs["others"]
    assert {g["name"]: g["lr"] for g in opt.param_groups} == pytest.approx(want)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(r))
    for g in opt.param_groups:  # what a checkpoint of another recipe would have left
        g.update(lr=1.0, initial_lr=1.0)
    _reset_hyperparameters(SimpleNamespace(optimizer=opt, module=model, lr_scheduler=sched), r)
    assert {g["name"]: g["initial_lr"] for g in opt.param_groups} == pytest.approx(want)


def test_base_rates_need_mup() -> None:
    with pytest.raises(UserError) as e:
        load_recipe(REPO / "recipes" / "debug.yaml", ["train.mup_lr_concept=1e-3"])
    assert "train.mup_lr_concept" in str(e.value) and "mup_base_width" in str(e.value)


def test_which_matrices_are_hidden() -> None:
    """The fan-in rule (mup.py): W_up and the coupling are token-hidden, the concept heads
    concept-hidden; the LM head, codebook, bottleneck K / A B and its rank-r factor are not."""
    from ncpctl.model.designs.mup.module import hidden_linears

    cfg = tiny("llama", mup_base_width=16, bottleneck=dict(enabled=True, concepts=6, unknown_head="low_rank"),
               concept=dict(segmentation="dynamic", coupling="cross_attention", d_concept=64))
    kinds = {name: kind for name, (_, kind, _) in hidden_linears(NCPModel(cfg)).items()}
    for name in ("concept.up", "concept.coupling.wq", "concept.segmenter.q", "bottleneck.known",
                 "bottleneck.unknown.0", "encoder.0.mlp.fc", "decoder.1.attn.proj"):
        assert kinds.pop(name) == "token", name
    for name in ("concept.heads", "concept.layers.1.attn.qkv"):
        assert kinds.pop(name) == "concept", name
    assert not any(n.startswith(("lm_head", "concept.codebook", "bottleneck.unknown.1")) for n in kinds), kinds

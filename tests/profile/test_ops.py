"""Host overhead that a CPU can count (issue "Fast where users train"): the operator counter of
``profile-kernels --only ops``, the per-layer goal it drives, and the fused pieces behind it
(``DepthMix``, the RoPE table, batched Newton-Schulz), each exact against what it replaces."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
from torch.optim._muon import _zeropower_via_newtonschulz

from ncpctl.model.core.layers import inv_freq, rope
from ncpctl.model.designs.residual.module import mix_depths
from ncpctl.profile.load import load_for_profile
from ncpctl.profile.ops import count_ops, ops_section, training_step_ops
from ncpctl.train.muon import newton_schulz_batched

from ..conftest import RECIPES
from ..model._helpers import tiny

torch.set_num_threads(1)


def test_the_counter_sees_forward_backward_and_optimizer_but_not_views() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1)

    def step() -> None:
        loss = (x.view(8, 4).t() * 2).sum()  # view, t: free; mul, sum, and their backward count
        loss.backward()
        opt.step()

    counts = count_ops(step)
    assert counts["mul"] >= 1 and counts["sum"] == 1  # the forward
    assert sum(counts.values()) > 3  # the backward's and the optimizer's kernels too
    assert not {"view", "t", "transpose", "_unsafe_view", "empty"} & set(counts)


def test_conceptlm_costs_at_most_1_1x_the_plain_models_operators_per_layer() -> None:
    """The CPU goal at the shape of the GPU check's ConceptLM (pythia-160m): per layer of each model
    (token and concept layers counted), a training step launches at most 1.1x the base model's."""
    recipe, _ = load_for_profile(RECIPES / "pythia160m.yaml", ["model.d_model=64", "model.n_heads=4"])
    res = ops_section(recipe.model_config, seq_len=32, batch=2)  # the count does not depend on the width
    assert res["sibling"]["train_step"]["layers"] == 12 and res["recipe"]["train_step"]["layers"] == 14
    assert res["comparison"]["train_step"]["per_layer_ratio"] <= 1.10, res["comparison"]
    assert res["recipe"]["decode_step"]["total"] > 0


def test_irc_and_crc_cost_the_same_operators_at_every_depth() -> None:
    """IRC mixes l + 2 candidates after layer l: with one batched mix per layer its operators per layer
    do not grow with depth (they grew by ~6 per candidate with a multiply-add each)."""
    def per_extra_layer(n: int) -> float:
        cfg = tiny("llama", residual="irc", crc_connections=["encoder-decoder"], n_layers=n,
                   concept=dict(encoder_layers=1, concept_layers=1))
        return sum(training_step_ops(cfg, 2, 16).values())

    a, b, c = (per_extra_layer(n) for n in (4, 6, 8))
    assert b - a == c - b  # linear in depth: the same count for every added layer


@pytest.mark.parametrize("n", [1, 3])
def test_depth_mix_is_the_weighted_sum_with_its_gradient(n: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(2, 3, n, dtype=torch.float64, requires_grad=True)
    values = [torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    ref = sum(w[..., j : j + 1] * values[j] for j in range(n))
    torch.testing.assert_close(mix_depths(w, values), ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda w, *v: mix_depths(w, list(v)), (w, *values))


def test_rope_from_the_table_is_the_formula_bit_for_bit() -> None:
    cfg = tiny("llama")
    positions = torch.tensor([[0, 5, 63, 200], [3, 3, 1, 0]])  # past max_seq_len too: the table grows
    freqs = positions[..., None].float() * inv_freq(cfg, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = rope(positions, cfg, torch.float32, limit=201)
    assert torch.equal(cos, emb.cos()[:, None]) and torch.equal(sin, emb.sin()[:, None])


@pytest.mark.parametrize("shape", [(16, 32), (32, 16), (24, 24)])
def test_batched_newton_schulz_is_torch_muons_per_matrix(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    g = torch.randn(5, *shape)
    coef = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    ref = torch.stack([_zeropower_via_newtonschulz(m, coef, DEFAULT_NS_STEPS, EPS) for m in g])
    out = newton_schulz_batched(g, coef, DEFAULT_NS_STEPS, EPS)
    # bf16 throughout: the CPU's batched and single GEMMs may round an entry differently, and five
    # iterations carry it (at 16 x 32, 1% of entries, at most 0.006 of ~0.3; the other shapes here: none).
    # test_muon's optimizer steps stay within 1e-6 of torch's Muon.
    out, ref = out.float(), ref.float()
    assert (out - ref).norm() <= 1e-2 * ref.norm() and (out - ref).abs().max() <= 1e-2


def test_on_a_gpu_adamw_is_one_fused_kernel_and_steps_as_the_loop_does() -> None:
    """make_optimizer(on_gpu=True) asks torch for its fused AdamW (one kernel per group, not a loop
    over parameters); torch also has it on the CPU, where it steps as the per-parameter loop does, to
    float rounding (two steps of lr 3e-3: within 1% of one step's size; 7e-6 measured)."""
    import copy

    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe
    from ncpctl.train.config import make_optimizer

    r = load_recipe(RECIPES / "debug.yaml", ["deepspeed.zero_stage=0", "train.grad_clip=0"])
    torch.manual_seed(0)
    model = NCPModel(r.model_config)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    fused, loop = make_optimizer(model, r, on_gpu=True), make_optimizer(ref, r, on_gpu=False)
    assert fused.defaults["fused"] and not loop.defaults.get("fused")
    x = torch.randint(0, r.model_config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    for m, opt in ((model, fused), (ref, loop)):
        for _ in range(2):
            m(x[:, :-1], x[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * r.train.lr, msg=name)
    assert (model.lm_head.weight - init.lm_head.weight).abs().max() > r.train.lr  # two steps moved it

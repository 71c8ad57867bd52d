"""DLCM's dynamic segmentation (ncpctl/model/designs/dynamic/module.py): the boundary predictor against its
formula, identity init, p_0 = 1, the inference threshold, sampling keyed by the global sample
index, gradients (the LM loss never reaches W_q / W_k, the balance loss does), Eq. 10 and its
gradient, global vs per-sequence balance, the previous step's global F, one process vs two
simulated ranks, causality in training mode with fixed noise, and decoding that sees the
full forward's boundaries. (Causality at inference and cached decoding for ragged batches
run with the other designs in test_designs.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from ncpctl.model.core.config import ConfigError
from ncpctl.model.designs.dynamic.module import DynamicSegmenter, balance_loss, keyed_uniform
from ncpctl.model.core.model import NCPModel

from ._helpers import build, ragged_batch, tiny, tokens


def dlcm(backbone: str = "llama", **concept) -> object:
    """A tiny DLCM-segmented model; the published objective (no NCP or VQ term) unless asked."""
    return tiny(backbone, concept={"segmentation": "dynamic", "ncp_weight": 0.0, "vq_weight": 0.0, **concept})


def _segmenter(seed: int = 0, **concept) -> DynamicSegmenter:
    torch.manual_seed(seed)
    seg = DynamicSegmenter(dlcm(**concept)).double()
    with torch.no_grad():
        if seg.mode == "predictor":
            seg.q.weight.add_(torch.randn_like(seg.q.weight) * 0.3)
            seg.k.weight.add_(torch.randn_like(seg.k.weight) * 0.3)
    return seg


def _direct_p(seg: DynamicSegmenter, h: torch.Tensor) -> torch.Tensor:
    B, T, _ = h.shape
    p = torch.ones(B, T, dtype=h.dtype)
    for b in range(B):
        for t in range(1, T):
            q, k = seg.q.weight @ h[b, t - 1], seg.k.weight @ h[b, t]
            p[b, t] = (1 - torch.dot(q, k) / (q.norm() * k.norm())) / 2
    return p


def _direct_segments(h: torch.Tensor, b: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Per row: the means of the closed segments and closed(t), from boundaries b (T,) by hand."""
    means, closed = [], []
    for row in range(h.shape[0]):
        starts = [t for t in range(h.shape[1]) if b[row, t]]
        ends = starts[1:]  # segment i = [starts[i], starts[i+1]) is closed at starts[i+1]
        means.append([h[row, s:e].mean(0) for s, e in zip(starts, ends)])
        closed.append([sum(1 for e in ends if e <= t) for t in range(h.shape[1])])
    return means, closed


def test_boundary_probability_is_the_formula_and_p0_is_one():
    seg = _segmenter()
    h = torch.randn(2, 9, 32, dtype=torch.float64)
    p = seg.probabilities(h)
    assert torch.equal(p[:, 0], torch.ones(2, dtype=p.dtype))
    assert (p - _direct_p(seg, h).to(p.dtype)).abs().max() <= 1e-6  # fp32 cosine


def test_projections_start_at_the_identity():
    model = NCPModel(dlcm())  # init_weights must leave the segmenter's own init alone
    eye = torch.eye(32)
    assert torch.equal(model.concept.segmenter.q.weight, eye) and torch.equal(model.concept.segmenter.k.weight, eye)
    h = torch.randn(1, 6, 32)
    p = model.concept.segmenter.probabilities(h)  # identity: p = (1 - cos(h[t-1], h[t]))/2
    ref = (1 - torch.nn.functional.cosine_similarity(h[0, :-1], h[0, 1:], dim=-1)) / 2
    assert (p[0, 1:] - ref).abs().max() <= 1e-6


def test_inference_cuts_at_the_threshold_and_pools_closed_segments_only():
    seg = _segmenter().eval()
    h = torch.randn(3, 11, 32, dtype=torch.float64)
    s = seg(h)
    b = seg.probabilities(h) >= 0.5
    b[:, 0] = True
    means, closed = _direct_segments(h, b)
    assert s.closed.tolist() == closed
    M = max(len(m) for m in means)
    assert s.concepts.shape == (3, M, 32) and s.valid.tolist() == [[j < len(m) for j in range(M)] for m in means]
    assert s.n_closed.tolist() == [len(m) for m in means]
    for row, ms in enumerate(means):
        for j, mean in enumerate(ms):
            assert (s.concepts[row, j] - mean).abs().max() <= 1e-12
        assert torch.equal(s.concepts[row, len(ms):], torch.zeros_like(s.concepts[row, len(ms):]))
    assert s.positions.tolist() == [list(range(M))]


def test_boundary_rule_compares_adjacent_states_against_tau():
    seg = DynamicSegmenter(dlcm(boundary_mode="boundary", boundary_tau=0.6)).train()  # the same in training
    assert not list(seg.parameters())
    h = torch.randn(2, 10, 32)
    s = seg(h)
    cos = torch.nn.functional.cosine_similarity(h[:, :-1], h[:, 1:], dim=-1)
    b = torch.cat([torch.ones(2, 1, dtype=torch.bool), (1 - cos) / 2 >= 0.6], 1)
    assert s.closed.tolist() == (torch.cumsum(b.long(), 1) - 1).tolist()
    assert "balance_loss" not in s.losses and seg.loss_weights() == {}


def test_sampling_is_keyed_by_the_global_sample_index():
    seg = _segmenter(boundary_temperature=1.0).train()  # unsharpened: the noise decides often
    h = torch.randn(2, 40, 32, dtype=torch.float64)
    ids = torch.tensor([1000, 7])
    both = seg(h, sample_ids=ids).closed
    assert torch.equal(seg(h, sample_ids=ids).closed, both)  # reproducible
    swapped = seg(h.flip(0), sample_ids=ids.flip(0)).closed  # batch position 0 <-> 1
    assert torch.equal(swapped.flip(0), both)
    alone = [seg(h[i : i + 1], sample_ids=ids[i : i + 1]).closed for i in range(2)]  # "rank 0" and "rank 1"
    assert torch.equal(torch.cat(alone), both)
    other = seg(h, sample_ids=ids + 1).closed
    assert not torch.equal(other, both)  # another sample index, other noise


def test_the_noise_is_uniform_and_the_sharpening_rule_holds():
    u = keyed_uniform(torch.arange(500), 64)
    assert u.shape == (500, 64) and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs((u < 0.1).float().mean().item() - 0.1) < 0.005
    seg = _segmenter(boundary_temperature=0.5).train()
    p = torch.full((500, 64), 0.3)
    b = seg.decide(p, torch.arange(500))
    sharp = 0.3**2 / (0.3**2 + 0.7**2)  # sigmoid(logit(p) / 0.5)
    assert abs(b[:, 1:].float().mean().item() - sharp) < 0.01 and b[:, 0].all()


def test_the_lm_loss_never_reaches_the_predictor_and_the_balance_loss_does():
    cfg = dlcm(ncp_weight=1.0, vq_weight=1.0)
    model = build(cfg).train()
    x = tokens(cfg, 2, 17)
    seg = model.concept.segmenter
    seg.on_step_end({"boundaries": 1.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})  # F far from 1/R
    out = model(x[:, :-1], x[:, 1:], sample_ids=torch.tensor([3, 4]))
    (out.losses["ntp_loss"] + out.losses["ncp_loss"] + out.losses["vq_loss"]).backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in (seg.q.weight, seg.k.weight))
    model.zero_grad(set_to_none=True)
    out.losses["balance_loss"].backward()
    assert seg.q.weight.grad.abs().sum() > 0 and seg.k.weight.grad.abs().sum() > 0
    # h is detached into the predictor: the balance loss moves W_q, W_k only
    assert all(p.grad is None or not p.grad.any() for p in model.encoder.parameters())


def test_the_balance_loss_reaches_the_encoder_only_when_asked():
    cfg = dlcm(boundary_grad_to_encoder=True)
    model = build(cfg).train()
    model.concept.segmenter.on_step_end({"boundaries": 1.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})
    x = tokens(cfg, 2, 17)
    model(x[:, :-1], x[:, 1:], sample_ids=torch.tensor([3, 4])).losses["balance_loss"].backward()
    assert any(p.grad is not None and p.grad.any() for p in model.encoder.parameters())


def test_balance_loss_formula_and_gradient():
    R, F_rate, G = 4.0, 0.3, torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    L = balance_loss(torch.tensor(F_rate, dtype=torch.float64), G, R)
    assert abs(L.item() - (4 / 3 * (3 * 0.3 * 0.2 + 0.7 * 0.8) - 1)) <= 1e-12
    L.backward()
    assert abs(G.grad.item() - R / (R - 1) * (R * F_rate - 1)) <= 1e-12
    on_target = balance_loss(torch.tensor(0.25), torch.tensor(0.25), R)  # F = G = 1/R: the minimum 0
    assert abs(on_target.item()) <= 1e-6


def _terms(seg: DynamicSegmenter, p: torch.Tensor, b: torch.Tensor):
    from ncpctl.model.core.segment import Segments

    s = Segments(torch.zeros(p.shape[0], 0, 4), torch.zeros(1, 0))
    seg._terms(s, p, b)
    return s


def test_global_balance_gradient_per_probability_and_the_previous_steps_rate():
    seg = _segmenter().train()
    p = torch.rand(3, 8, dtype=torch.float64, requires_grad=True)
    b = torch.rand(3, 8) < 0.4
    b[:, 0] = True
    F_local = b.double().mean().item()
    s = _terms(seg, p, b)  # the first step has no F yet: F = 1/R, where L_aux = 0 with no gradient
    assert s.losses["balance_loss"].item() == 0.0
    seg.on_step_end({"boundaries": 30.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})
    assert seg.rate_counts.tolist() == [30, 100] and "rate_counts" in seg.state_dict()  # checkpointed
    s = _terms(seg, p, b)
    expect = balance_loss(torch.tensor(0.3, dtype=torch.float64), p.mean(), 4.0).item()
    assert abs(s.losses["balance_loss"].item() - expect) <= 1e-12
    s.losses["balance_loss"].backward()  # dL/dp_t = R/(R-1) (R F - 1) / (number of tokens)
    assert torch.allclose(p.grad, torch.full_like(p, 4 / 3 * (4 * 0.3 - 1) / p.numel()), atol=1e-12)
    assert abs(s.metrics["boundary_rate"].item() - F_local) <= 1e-12  # the logged F is the realised one
    assert abs(s.metrics["tokens_per_concept"].item() - 1 / F_local) <= 1e-9
    assert s.stats["boundaries"].item() == b.sum().item() and s.stats["boundary_tokens"].item() == 24
    seg.eval()  # evaluation: the batch's own F
    s = _terms(seg, p, b)
    assert abs(s.losses["balance_loss"].item() - balance_loss(torch.tensor(F_local), p.mean(), 4.0).item()) <= 1e-9


def test_global_and_per_sequence_balance_differ():
    p = torch.tensor([[1.0, 0.9, 0.8, 0.7], [1.0, 0.1, 0.1, 0.2]], dtype=torch.float64)
    b = torch.tensor([[True, True, True, True], [True, False, False, False]])
    glob = _terms(_segmenter().eval(), p, b).losses["balance_loss"].item()  # F, G of this batch
    per = _terms(_segmenter(balance="sequence").train(), p, b).losses["balance_loss"].item()
    rows = [balance_loss(b[i].double().mean(), p[i].mean(), 4.0).item() for i in range(2)]
    assert abs(per - sum(rows) / 2) <= 1e-12
    assert abs(glob - balance_loss(b.double().mean(), p.mean(), 4.0).item()) <= 1e-12
    assert abs(glob - per) > 0.1


def test_two_ranks_give_the_statistics_loss_and_gradient_of_one_process():
    """The Global Parser under data parallelism, simulated: the halves' statistics add up to the
    whole batch's, the mean of their balance losses is the whole batch's (linear in G, with the
    previous step's F) and so is the mean of their gradients (DeepSpeed's average over ranks)."""
    cfg = dlcm()
    model = build(cfg).train()
    model.concept.segmenter.on_step_end({"boundaries": 35.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})
    x = tokens(cfg, 4, 17)
    ids = torch.arange(100, 104)
    grads, outs = [], []
    for rows in (slice(0, 4), slice(0, 2), slice(2, 4)):
        model.zero_grad(set_to_none=True)
        out = model(x[rows, :-1], x[rows, 1:], sample_ids=ids[rows])
        out.losses["balance_loss"].backward()
        outs.append(out)
        grads.append(model.concept.segmenter.q.weight.grad.clone())
    whole, a, b = outs
    for k in ("boundaries", "boundary_tokens", "boundary_prob_sum"):
        assert abs(whole.stats[k].item() - a.stats[k].item() - b.stats[k].item()) <= 1e-4
    mean = (a.losses["balance_loss"] + b.losses["balance_loss"]) / 2
    assert abs(whole.losses["balance_loss"].item() - mean.item()) <= 1e-5
    assert (grads[0] - (grads[1] + grads[2]) / 2).abs().max() <= 1e-5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causal_in_training_with_random_boundaries_and_fixed_noise(seed):
    """Sampled boundaries (a random sample index: random cuts) with the noise fixed: changing the
    tokens after p changes no logit at or before p; the decoder reads closed segments only."""
    torch.manual_seed(seed)
    cfg = dlcm(boundary_temperature=1.0)
    # float64: a different number of (masked) concepts changes fp32 summation order at ~1e-5
    model = build(cfg, seed=seed, scale=0.3).train().double()
    T = 13
    x = tokens(cfg, 1, T, seed=seed)
    ids = torch.randint(0, 2**40, (1,))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref = model(x, sample_ids=ids).logits
        for p in range(T - 1):
            y = x.clone()
            y[:, p + 1 :] = torch.randint(0, cfg.vocab_size, (1, T - p - 1), generator=g)
            got = model(y, sample_ids=ids).logits
            assert torch.allclose(got[:, : p + 1], ref[:, : p + 1], atol=1e-10, rtol=0), p


def test_decoding_sees_the_boundaries_of_the_full_forward():
    """Ragged prompts, then tokens one by one: the closed-segment count of every row after each
    step equals the full forward's closed(t) (the same boundaries), and the logits agree. The
    concept step runs on the closing rows only (decode.py), so a step where some rows but not
    all close must occur here, or the check would not cover that path."""
    cfg = dlcm()
    model = build(cfg, scale=0.2).double()
    lengths, n_new = [6, 2, 5], 9
    seqs, prompt = ragged_batch(cfg, lengths, n_new)
    seg, seen = model.concept.segmenter, []
    step_of = seg.decode_step
    seg.decode_step = lambda *a: seen.append(step_of(*a)) or seen[-1]
    with torch.no_grad():
        full = [model(seqs[b : b + 1, : n + n_new]) for b, n in enumerate(lengths)]
        _, state = model.prefill(prompt, lengths)
        for t in range(n_new):
            step = model.decode_step(state, torch.stack([seqs[b, n + t] for b, n in enumerate(lengths)]))
            for b, n in enumerate(lengths):
                assert state.seg["n"][b].item() == full[b].concept.segments.closed[0, n + t].item(), (t, b)
                assert (step[b] - full[b].logits[0, n + t]).abs().max() <= 1e-9
    closes = sum(f.concept.segments.n_closed.item() for f in full)
    assert closes >= 3  # the check saw segments close during decoding
    assert all(c.rows == c.closed.nonzero()[:, 0].tolist() for c in seen)
    assert any(0 < len(c.rows) < len(lengths) for c in seen)  # the subset path ran


@pytest.mark.parametrize("concept,key", [
    (dict(target_ratio=1), "concept.target_ratio"),
    (dict(target_ratio=0.5), "concept.target_ratio"),
    (dict(boundary_threshold=1.0), "concept.boundary_threshold"),
    (dict(boundary_threshold=0.0), "concept.boundary_threshold"),
    (dict(boundary_temperature=0), "concept.boundary_temperature"),
    (dict(boundary_mode="boundary"), "concept.boundary_tau"),
    (dict(boundary_mode="boundary", boundary_tau=1.5), "concept.boundary_tau"),
    (dict(balance="local"), "concept.balance"),
    (dict(balance_weight=-1), "concept.balance_weight"),
    (dict(d_concept=60, concept_heads=8), "concept.d_concept"),
    (dict(d_concept=64, concept_heads=7), "concept.d_concept"),
    (dict(d_concept=0), "concept.d_concept"),
    (dict(d_concept=64, concept_heads=1), "concept.concept_heads"),  # tiny llama: 2 query heads per KV head
])
def test_bad_dynamic_keys_are_config_errors(concept, key):
    with pytest.raises(ConfigError) as e:
        dlcm(**concept)
    assert [k for k, _ in e.value.problems] == [key]


def test_the_law_sizes_caches_and_the_cost_model():
    cfg = dlcm(target_ratio=3)
    assert cfg.num_concepts(12) == 11 and cfg.expected_concepts(12) == 4 and cfg.tokens_per_concept == 3.0
    assert math.isclose(cfg.block_equivalents, 3 + 2 / 3)


def test_accounting_counts_the_predictor_and_the_cross_attention_at_the_target_ratio():
    from ncpctl.model.accounting.flops import exact_flops

    T, d = 64, 32
    plain = exact_flops(dlcm(), T).components
    cross = exact_flops(dlcm(coupling="cross_attention"), T).components
    M = T // 4  # concepts at the target ratio R = 4 (the law's num_concepts, T - 1, only sizes caches)
    assert exact_flops(dlcm(), T).concept_positions == M
    assert plain["concept.boundary_predictor"] == 4 * T * d * d and "concept.cross_attention" not in plain
    assert cross["concept.cross_attention"] == 4 * T * d * d + 4 * M * d * d + 4 * T * M * d
    rule = exact_flops(dlcm(boundary_mode="boundary", boundary_tau=0.5), T).components
    assert "concept.boundary_predictor" not in rule


def test_only_a_keyed_segmentation_asks_the_loop_for_sample_ids():
    assert NCPModel(dlcm()).uses_sample_ids
    assert not NCPModel(tiny("llama", concept={})).uses_sample_ids and not NCPModel(tiny("llama")).uses_sample_ids


def test_a_wider_concept_transformer_is_lifted_by_w_up():
    """DLCM Sec. 3.3.2: pooled concepts (d) -> W_up -> a concept transformer at d_concept with its own
    heads; the heads read the wide states; parameters and FLOPs are counted at that width."""
    from ncpctl.model.accounting.flops import count_parameters, exact_flops

    cfg = dlcm(d_concept=64, coupling="cross_attention")
    cc = cfg.concept_cfg
    assert (cc.d_model, cc.n_heads, cc.n_kv_heads, cc.head_dim, cc.ffn_dim) == (64, 8, 4, 8, 256)
    same = dlcm()
    assert same.concept_cfg is same  # same width: the config itself
    model = NCPModel(cfg)
    cm = model.concept
    assert (cm.up.in_features, cm.up.out_features, cm.heads.in_features) == (32, 64, 64)
    assert cm.layers[0].attn.qkv.in_features == 64 and cm.layers[0].mlp.proj.out_features == 64
    counts = count_parameters(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.components["concept_layers"] == sum(p.numel() for n, p in model.named_parameters()
                                                      if n.startswith(("concept.layers.", "concept.up.")))
    T, M = 64, 16
    f = exact_flops(cfg, T).components
    assert f["concept.up"] == 2 * M * 32 * 64
    assert f["concept_layers.qkv"] == 2 * 2 * M * 64 * (64 + 2 * 32)  # 2 layers, q 64 + k, v 32 (GQA)
    assert f["concept.heads"] == 2 * M * 64 * 4 * 8
    with pytest.raises(ConfigError, match="need concept.d_concept = d_model"):
        tiny("llama", crc_connections=["concept-decoder"], concept=dict(d_concept=64))


def test_long_segments_pool_accurately_in_bf16():
    """A 600-token segment in bf16 (a GPU run's dtype): the forward's pooled mean (one GEMM with
    fp32 accumulation) and the decode step's running sum (kept in fp32) both give the segment's
    mean to bf16 rounding; summed in bf16 the count would stop at 256 (256 + 1 = 256 there)."""
    from ncpctl.model.core.segment import segment_means

    g = torch.Generator().manual_seed(0)
    d, n = 16, 600
    base = torch.randn(d, generator=g, dtype=torch.float64)
    h = base + 0.1 * torch.randn(1, n, d, generator=g, dtype=torch.float64)  # one slowly varying segment
    want = h[0].mean(0)
    means, counts = segment_means(h.bfloat16(), torch.zeros(1, n, dtype=torch.long), 1)
    assert counts.item() == n and (means[0, 0].double() - want).abs().max() < 0.02 * want.abs().max()

    cfg = tiny("llama", concept=dict(segmentation="dynamic", boundary_mode="boundary", boundary_tau=0.5))
    seg = DynamicSegmenter(cfg).eval()
    x = torch.cat([h, -base[None, None]], 1).bfloat16()  # then a token pointing the other way: p = 1
    st = seg.decode_init(1, d, x.device, torch.bfloat16)
    for t in range(n + 1):
        closing = seg.decode_step(st, x[:, t], torch.tensor([t]), [t])
    assert closing.rows == [0] and closing.concept.dtype == torch.bfloat16
    assert (closing.concept[0].double() - want).abs().max() < 0.02 * want.abs().max()

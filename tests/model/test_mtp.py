"""Multi-token prediction (ncpctl/model/designs/mtp/module.py; NCP-ArchPreview Sec. 5.2): depth k predicts
x[t+k+1] from the previous depth and embed(x[t+k]) through one layer and the shared head, its
loss is weighted into the total in training only, shifts across an end-of-document token are
not scored, the weight follows its schedule, and the export keeps the main head alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ncpctl.model.core.config import ConfigError
from ncpctl.model.core.head import top1_hits
from ncpctl.model.core.layers import Context

from ._helpers import build, tiny, tokens


def test_depths_predict_further_tokens_with_the_shared_head():
    cfg = tiny("llama", mtp_depth=2, concept={})
    model = build(cfg).train()
    idx = tokens(cfg, 2, 17)
    x, y = idx[:, :-1], idx[:, 1:]
    out = model(x, y)
    with torch.no_grad():  # the reference, by hand: h0 = main final-norm states
        h = model(x, return_hidden=True, compute_logits=False).hidden
        prev, want = h, []
        for k, depth in enumerate(model.mtp.depths, start=1):
            n = 16 - k
            pos = torch.arange(n)[None]
            emb = model.embed_tokens(y[:, k - 1 : k - 1 + n], pos)  # x[t + k]
            prev = depth.layer(depth.proj(torch.cat([depth.norm_e(emb), depth.norm_h(prev[:, :n])], -1)),
                               Context.causal(cfg, pos, [None], h.dtype))
            logits = model.lm_head(model.final_norm(prev))
            want.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten()))  # x[t + k + 1]
    torch.testing.assert_close(out.losses["mtp_loss"], torch.stack(want).mean(), rtol=1e-5, atol=1e-6)
    main = out.losses["ntp_loss"] + out.losses["ncp_loss"] + out.losses["vq_loss"] + out.losses["commitment_loss"]
    torch.testing.assert_close(out.loss, main + 0.3 * out.losses["mtp_loss"])
    assert out.metrics["mtp_acc"].shape == (2,)
    out.loss.backward()
    assert model.mtp.depths[1].proj.weight.grad.abs().sum() > 0
    names = [k.name for k in model.log_keys()]
    assert names[-2:] == ["mtp_loss", "mtp_acc"]
    model.eval()  # validation / evaluation: the main head alone
    with torch.no_grad():
        ev = model(x, y)
    assert "mtp_loss" not in ev.losses and torch.allclose(ev.loss, main, atol=1e-5)


def test_shifts_do_not_cross_an_end_of_document():
    cfg = tiny("neox", mtp_depth=2, mtp_stop_token=0)
    model = build(cfg).train()
    y = torch.tensor([[5, 6, 0, 7, 8, 9, 10, 11]])  # x[1..8]: an end of document at x[3]
    x = torch.tensor([[4, *y[0, :-1].tolist()]])
    seen = []
    real = model.lm_head.forward

    def spy(h, targets=None, top1=False):
        if top1:
            seen.append(targets.clone())
        return real(h, targets, top1)

    model.lm_head.forward = spy
    model(x, y)
    # x = [4, 5, 6, 0, 7, ...]: depth 1 at t predicts x[t+2] from x[t+1]: not scored when x[t+1]
    # is the end of document (t = 2); predicting the end of document itself is (t = 1, target 0)
    assert seen[0].tolist() == [[6, 0, -100, 8, 9, 10, 11]]
    # depth 2 predicts x[t+3] from x[t+1], x[t+2]: t = 1 and t = 2 have the end of document among them
    assert seen[1].tolist() == [[0, -100, -100, 9, 10, 11]]


def test_weight_schedule_and_bad_depth():
    cfg = tiny("neox", mtp_depth=1, mtp_weight=0.3, mtp_weight_schedule=[[100, 0.1]])
    model = build(cfg)
    model.on_step_begin(99)
    assert model.mtp.weight == 0.3
    model.on_step_begin(100)
    assert model.mtp.weight == 0.1
    with pytest.raises(ConfigError, match="mtp_depth: must be >= 1"):
        tiny("neox", mtp_depth=0)


def test_top1_hits_from_the_fused_head_equal_argmax():
    torch.manual_seed(0)
    h = torch.randn(40, 32, requires_grad=True)
    model = build(tiny("neox"))
    t = torch.randint(0, 200, (40,))
    t[:5] = -100
    _, loss, hits = model.lm_head(h, t, top1=True)  # the fused training path
    logits = model.lm_head(h.detach())
    assert hits.item() == ((logits.argmax(-1) == t) & (t != -100)).sum().item() == top1_hits(logits, t).item()
    loss.backward()
    assert h.grad is not None

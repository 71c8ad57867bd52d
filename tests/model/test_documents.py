"""Packed documents (``data.document_mask``, ncpctl/model/core/documents.py): attention, positions and
concept segments stay inside each document of a window."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.core import patterns
from ncpctl.model.core.documents import document_refusal
from ncpctl.model.core.patterns import BlockCausal, Causal, dense_mask, document_mod, document_positions

from ._helpers import build, tiny, tokens

LENS = [9, 2, 13]  # document lengths of a 24-token window: a short one, and a partial fixed block at each end


def doc_ids(lens: list[int], B: int = 2) -> torch.Tensor:
    """(B, sum(lens)) document index of each position, the same documents in every row."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None].expand(B, -1).contiguous()


def designs() -> dict:
    return {
        "conceptlm": tiny("llama", concept={}),
        "dlcm": tiny("llama", concept={"segmentation": "dynamic", "coupling": "cross_attention"}),
        "dlcm-replicated": tiny("neox", concept={"segmentation": "dynamic", "coupling": "cross_attention",
                                                 "cross_attention": "replicated"}),
        "archpreview-mtp": tiny("llama", concept={"code_weights": "softmax"}, mtp_depth=1, sliding_window=6),
        "irc-crc": tiny("llama", concept={}, residual="irc",
                        crc_connections=["encoder-concept", "encoder-decoder", "concept-decoder"]),
        "gpt2": tiny("gpt2", max_seq_len=32),
    }


@pytest.mark.parametrize("name", list(designs()))
def test_changing_a_document_never_changes_the_logits_of_the_documents_after_it(name):
    """In fp64 (a leak shows at O(1), rounding at 1e-15): every document's logits are those of the
    document alone (positions restart), whatever the documents before it hold."""
    model = build(designs()[name], scale=0.3).double()
    doc = doc_ids(LENS)
    x = tokens(model.cfg, 2, sum(LENS))
    other = x.clone()
    other[:, : LENS[0]] = tokens(model.cfg, 2, LENS[0], seed=7)  # document A changed
    with torch.no_grad():
        a, b = model(x, doc_ids=doc).logits, model(other, doc_ids=doc).logits
        assert (a[:, : LENS[0]] - b[:, : LENS[0]]).abs().max() > 1e-2  # A's own logits did change
        # exact up to fp64 rounding (A's segments shift the concept indices, so shapes may differ)
        assert (a[:, LENS[0]:] - b[:, LENS[0]:]).abs().max() < 1e-10
        assert not torch.equal(model(x).logits[:, LENS[0]:], model(other).logits[:, LENS[0]:])  # unmasked: A leaks
        start = sum(LENS[:2])
        alone = model(x[:, start:]).logits  # document C as its own sequence
    assert (a[:, start:] - alone).abs().max() < 1e-10


@pytest.mark.parametrize("name", list(designs()))
def test_one_document_windows_equal_the_unmasked_model(name):
    """In training mode (the losses, DLCM's sampled boundaries and the MTP depth included)."""
    model = build(designs()[name], scale=0.3).double().train()
    x = tokens(model.cfg, 2, 17)
    y = tokens(model.cfg, 2, 17, seed=3)
    ids = torch.tensor([4, 9])
    plain = model(x, y, sample_ids=ids)
    one = model(x, y, sample_ids=ids, doc_ids=torch.zeros_like(x))
    assert plain.losses.keys() == one.losses.keys()
    assert (plain.logits is None and one.logits is None) or torch.equal(plain.logits, one.logits)
    # exact but for the order of a masked mean's sum (the concepts are marked valid one by one)
    for k in ["loss", *plain.losses]:
        a, b = (plain.loss, one.loss) if k == "loss" else (plain.losses[k], one.losses[k])
        assert (a - b).abs() <= 1e-12 * a.abs().clamp_min(1), k
    grads = []
    for out in (plain, one):
        model.zero_grad()
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all((grads[0][n] - grads[1][n]).abs().max() <= 1e-9 * grads[0][n].abs().max().clamp_min(1) for n in grads[0])


@pytest.mark.parametrize("segmentation", ["fixed", "dynamic"])
def test_concept_segments_never_straddle_a_document_boundary(segmentation):
    """Pooling each token's one-hot document: every real concept is one document's exactly; a token
    sees only its own document's closed concepts; fixed blocks count from each document's start and
    drop a block cut by the document's end."""
    cfg = tiny("llama", concept={"segmentation": segmentation})
    model = build(cfg).train()
    seg_mod = model.concept.segmenter
    doc = doc_ids(LENS, B=3)
    B, T = doc.shape
    h = torch.nn.functional.one_hot(doc, cfg.d_model).float() + 0.01 * torch.randn(B, T, cfg.d_model)
    kw = {"sample_ids": torch.arange(B)} if seg_mod.keyed else {}
    seg = seg_mod(h, doc=doc, **kw)
    pooled = seg.concepts[..., : len(LENS)]  # (B, M, docs): a mean of one-hots plus noise
    for b in range(B):
        real = seg.valid[b]
        assert torch.allclose(pooled[b][real].round(), torch.nn.functional.one_hot(seg.docs[b][real], len(LENS)).float())
        lo, hi = seg.first[b], seg.closed[b]  # token t uses concepts lo[t] .. hi[t] - 1
        for t in range(T):
            assert (seg.docs[b, lo[t]:hi[t]] == doc[b, t]).all()
            assert lo[t] == (seg.docs[b][real] < doc[b, t]).sum()
    pairs = seg.pairs()  # (B, M-1): NCP targets, only a concept of the same document
    assert torch.equal(pairs, seg.valid[:, 1:] & (seg.docs[:, 1:] == seg.docs[:, :-1]))
    assert (~pairs & seg.valid[:, 1:]).any()  # the first concept of a later document is nobody's target
    if segmentation == "fixed":
        assert seg.valid.sum(1).tolist() == [sum(n // 4 for n in LENS)] * B  # 2 + 0 + 3 complete blocks
        assert seg.positions[0, : int(seg.valid[0].sum())].tolist() == [0, 1, 0, 1, 2]  # restart per document
    else:
        starts = torch.tensor([0, 9, 11])
        assert (seg.closed[:, starts[1:]] > seg.closed[:, starts[1:] - 1]).all()  # a document start is a boundary


def test_positions_restart_at_every_document():
    assert document_positions(doc_ids([3, 1, 2], B=1)).tolist() == [[0, 1, 2, 0, 0, 1]]


@pytest.mark.parametrize("pattern", [Causal(None), Causal(3), BlockCausal(2), BlockCausal(2, 4)])
def test_document_mask_mod_is_the_boolean_mask_and_flexattention_runs_it(pattern, monkeypatch):
    """The one declared function: FlexAttention's ``create_mask`` of ``document_mod`` equals the
    boolean mask built from it, which is the pattern's own mask within each document and nothing
    across; forced onto FlexAttention (its CPU reference), a model gives the boolean path's logits."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    doc = doc_ids([5, 3, 4], B=2)
    doc[1] = doc_ids([2, 10], B=1)[0]
    B, T = doc.shape
    mod = document_mod(pattern, doc)
    dense = dense_mask(mod, B, T, "cpu")
    assert torch.equal(create_mask(mod, B, 1, T, T, device="cpu"), dense)
    pos = torch.arange(T)[None]
    same = doc[:, :, None] == doc[:, None, :]
    assert torch.equal(dense, pattern.mask(pos, pos) & same[:, None])
    if pattern != Causal(3):
        return
    model = build(tiny("llama", concept={}, sliding_window=3), scale=0.3).eval()
    x = tokens(model.cfg, B, T)
    with torch.no_grad():
        ref = model(x, doc_ids=doc).logits
        monkeypatch.setattr(patterns, "flex_enabled", lambda device: True)
        # the eager BlockMask builder: the compiled one is the next test's
        monkeypatch.setattr(patterns, "_CREATE", {"cpu": create_block_mask})
        flex = model(x, doc_ids=doc).logits
    assert (flex - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_models_that_cannot_keep_documents_apart_say_why():
    from ncpctl.model.core.config import ModelConfig

    cdlm = tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=4, mask_id=3))
    assert "causal objectives only" in document_refusal(cdlm)
    bottleneck = tiny("neox", bottleneck=dict(enabled=True, concepts=4))
    assert "bottleneck" in document_refusal(bottleneck)
    assert all(document_refusal(c) is None for c in designs().values())
    model = build(cdlm)
    x = tokens(cdlm, 1, 8)
    with pytest.raises(ValueError, match="causal objectives only"):
        model(x, doc_ids=torch.zeros_like(x))
    assert isinstance(cdlm, ModelConfig)


def test_mtp_depths_neither_attend_nor_score_across_documents():
    """With document A's own targets ignored (-100), the training loss (the main head and two MTP
    depths) does not depend on A's tokens: a depth's layer attends inside a document and position t
    is not scored when its fed token x[t + k] is in the next document."""
    model = build(tiny("llama", mtp_depth=2), scale=0.3).double().train()
    doc = doc_ids(LENS)
    x = tokens(model.cfg, 2, sum(LENS))
    y = torch.cat([x[:, 1:], tokens(model.cfg, 2, 1, seed=4)], dim=1)  # next tokens
    y[:, : LENS[0]] = -100  # nothing predicted from A's positions
    other = x.clone()
    other[:, : LENS[0]] = tokens(model.cfg, 2, LENS[0], seed=7)
    a, b = model(x, y, doc_ids=doc), model(other, y, doc_ids=doc)
    assert (a.losses["mtp_loss"] - b.losses["mtp_loss"]).abs() < 1e-12 and (a.loss - b.loss).abs() < 1e-12
    assert (model(x, y).losses["mtp_loss"] - model(other, y).losses["mtp_loss"]).abs() > 1e-6  # unmasked: A leaks


def test_attention_stats_see_the_training_forwards_documents():
    """The stability diagnostics' forward takes the step's ``doc_ids``: one document per row gives
    the unmasked maxima, packed ones other maxima (the pairs across documents are gone)."""
    model = build(tiny("llama", concept={}, mtp_depth=1), scale=0.3).double()
    x = tokens(model.cfg, 2, sum(LENS))
    y = tokens(model.cfg, 2, sum(LENS), seed=3)
    plain, one = model.attention_stats(x, y), model.attention_stats(x, y, doc_ids=torch.zeros_like(x))
    packed = model.attention_stats(x, y, doc_ids=doc_ids(LENS))
    assert plain.keys() == one.keys() == packed.keys() and "attn/mtp.depths.0.layer.0/max_logit" in plain
    assert all(torch.allclose(plain[k], one[k], rtol=1e-12) for k in plain)
    assert any(not torch.allclose(plain[k], packed[k]) for k in plain)


def test_compiled_flexattention_is_not_recompiled_for_each_batchs_documents(monkeypatch):
    """On a GPU every batch brings new documents, so ``document_masks`` builds a new BlockMask (with
    the compiled ``create_block_mask``: eager, it materialises the (B, T, T) mask every batch) whose
    ``mask_mod`` closes over a new ``doc`` tensor, and the compiled FlexAttention
    (``layers.flex_attention`` compiles it once per device) reads it. Both must take the documents
    as inputs, not specialise on them: no new graph after a shape's first batch, each BlockMask
    that of eager ``create_block_mask``, each output that of its own boolean mask. Run here with
    dynamo's ``eager`` backend: recompiles are dynamo's guards, the same whatever backend (or device)
    runs the graph, and the backend's C++ build would cost ~20 s here."""
    import functools

    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    from ncpctl.model.core import layers
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setitem(layers._FLEX, "cpu", torch.compile(flex, dynamic=False))
    monkeypatch.setattr(patterns, "_CREATE", {})
    monkeypatch.setattr(patterns, "flex_enabled", lambda device: True)
    B, H, T, hd = 2, 2, 128, 16
    g = torch.Generator().manual_seed(0)
    graphs = []
    for lens in ([40, 30, 58], [5, 100, 23], [128], [64, 64]):
        doc = doc_ids(lens, B)
        doc[1] = doc_ids(lens[::-1], 1)[0]
        mod = document_mod(Causal(None), doc)
        mask = patterns.document_masks([Causal(None)], doc)[Causal(None).key]
        assert patterns.is_block_mask(mask) and patterns._CREATE["cpu"] is not create_block_mask
        eager = create_block_mask(mod, B, None, T, T, device="cpu")
        assert torch.equal(mask.to_dense(), eager.to_dense())
        assert torch.equal(mask.full_kv_num_blocks, eager.full_kv_num_blocks)
        q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
        out = layers.flex_attention(q, k, v, mask, gqa=False)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mod, B, T, "cpu"))
        assert (out - ref).abs().max() <= 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0]] * 4 and graphs[0] >= 2  # the builder's graph and the kernel's


def test_a_block_mask_builder_that_fails_to_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask

    def broken(*a, **k):
        raise RuntimeError("no inductor here\nsecond line")

    monkeypatch.setattr(patterns, "_CREATE", {"cpu": broken})
    doc = doc_ids([5, 3, 4], B=2)
    mod = document_mod(Causal(None), doc)
    with pytest.warns(RuntimeWarning, match="built eagerly from now on .*RuntimeError: no inductor here\\)"):
        got = patterns.batch_block_mask(mod, 2, 12, torch.device("cpu"))
    assert torch.equal(got.to_dense(), create_block_mask(mod, 2, None, 12, 12, device="cpu").to_dense())
    assert patterns._CREATE["cpu"] is create_block_mask

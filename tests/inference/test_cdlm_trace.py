"""Issue 43 item 4: a Causal Diffusion LM's generation explained token by token in the state in which
each token was committed (ncpctl.interpret.trace: Steerling's DiffusionTrace, faithful concept and
input attribution, chunk-level attribution, logit contribution); ``inspect --generate``,
``inspect --find-concept`` with a ``--concept-table`` (ncpctl.interpret.concept_table)."""

from __future__ import annotations

import json

import pytest
import torch

from ncpctl.inference import SamplingParams
from ncpctl.interpret import concept_table as CT, trace as TR
from ncpctl.interpret.steer import SteerSpec, resolve

from .test_cdlm_steer import BLOCK, MASK, NAMES, V, cli, prompts
from .test_cdlm_steer import model  # noqa: F401  (the module's fixture)

TABLE = """concept_id,concept_name,concept_description,head,is_steerable
0,function definition,A function is defined with def,known,true
1,function call,Calling a function; the call passes arguments,known,true
2,loop,A for or while loop,known,false
0,call site cluster,discovered,unknown,
"""


@pytest.fixture(scope="module")
def steered_trace(model):  # noqa: F811
    """A steered, sampled generation of 11 tokens (prompt of 6: two partial blocks and two whole)."""
    r = resolve(model, SteerSpec.parse("concept=call,strength=4logit,at=decoder.1+,length=6"), NAMES)
    p = SamplingParams(max_new_tokens=11, seed=5, steps_per_block=2)  # two tokens a step: groups of 2
    return TR.record(model, prompts(6)[0], p, [r])


def test_each_snapshot_is_the_state_its_tokens_were_committed_in(model, steered_trace):  # noqa: F811
    tr = steered_trace
    P = len(tr.prompt)
    assert sorted(p for g in tr.groups for p in g.positions) == list(range(P, 20))  # the last block whole
    assert [g.committed for g in tr.groups] == [sum(len(h.tokens) for h in tr.groups[:i]) for i in range(len(tr.groups))]
    for g, grp in enumerate(tr.groups):
        snap = tr.snapshot(g)
        assert len(snap) % BLOCK == 0 and max(grp.positions) < len(snap) <= max(grp.positions) + BLOCK
        revealed = {p for h in tr.groups[:g] for p in h.positions}
        assert [p for p in range(P, len(snap)) if snap[p] != MASK] == sorted(p for p in revealed if p < len(snap))
    assert tr.generated == sample_tokens(model, tr)
    recs, summary = TR.concept_attribution(model, tr, NAMES)
    assert summary["replay_error"] < 1e-4  # the full forward of each snapshot gives the sampled logits
    # a token committed at a later step of its block: its logit in its own state, not at the block's first step
    moved = []
    for r in recs:
        first = min(g.order for g in tr.groups if any(p // BLOCK == r["position"] // BLOCK for p in g.positions))
        if r["commit_order"] > first:
            ids, out = TR.replay(model, tr, first)
            moved.append(abs(float(out.logits[0, r["position"], r["token"]]) - r["logit"]))
        assert r["logit"] == pytest.approx(r["sampled_logit"], abs=1e-4)
    assert moved and max(moved) > 1e-2


def sample_tokens(model, tr) -> list[int]:  # noqa: F811
    """The same generation through ncpctl.inference.generate's sampler (no trace)."""
    from ncpctl.interpret.steer import block_steering
    from ncpctl.model.designs.causal_diffusion.sampler import sample_blocks

    p = SamplingParams(max_new_tokens=11, seed=5, steps_per_block=2)
    return sample_blocks(model, [tr.prompt], p, vocab_size=V, steer=block_steering([tr.steer]))[0]


def test_concept_and_chunk_attribution_are_exact_in_each_commit_state(model, steered_trace):  # noqa: F811
    """logit = known + unknown + residual + steering; known and unknown = the sums of their concepts'
    terms; chunk contributions are each token's terms over its magnitude, averaged; the shares add to 1."""
    recs, summary = TR.concept_attribution(model, steered_trace, NAMES, top=3, keep_terms=True)
    bn = model.bottleneck
    for r in recs:
        assert r["known"] + r["unknown"] + r["residual"] + r["steering"] == pytest.approx(r["logit"], abs=1e-4)
        k_idx, kn, u_idx, un = r["_terms"]
        assert len(k_idx) == bn.n and len(u_idx) == bn.m  # dense heads: every concept's term
        assert float(kn.sum()) == pytest.approx(r["known"], abs=1e-4) and float(un.sum()) == pytest.approx(r["unknown"], abs=1e-4)
        assert sum(r["shares"].values()) == pytest.approx(1.0) and len(r["concepts"]) == 3
        assert abs(r["concepts"][0]["term"]) >= abs(r["concepts"][-1]["term"])
    assert all(r["steering"] == 0.0 for r in recs)  # decoder.1+: inside the stack, not a readout term
    P = len(steered_trace.prompt)
    chunks = TR.chunk_attribution(recs, bn.bcfg.chunk, P, NAMES, top=50)
    assert [c["span"][0] for c in chunks] == [P, 8, 12, 16]
    first = [r for r in recs if r["position"] < 8]
    kn = torch.stack([r["_terms"][1] for r in first])  # (T', n): dense, concept c at column c
    un = torch.stack([r["_terms"][3] for r in first])
    total = kn.abs().sum(-1) + un.abs().sum(-1) + torch.tensor([abs(r["residual"]) for r in first])
    want = (kn[:, 1] / total).mean()
    got = next(c for c in chunks[0]["concepts"] if c["type"] == "known" and c["concept"] == 1)
    assert got["name"] == "call" and got["contribution"] == pytest.approx(float(want), abs=1e-6)
    assert 0 < summary["mean_shares"]["residual"] < 1


def test_input_attribution_explains_each_token_on_its_snapshot(model, steered_trace):  # noqa: F811
    """Integrated gradients from [MASK] on each snapshot, steered as sampled (the path's end is the
    sampled logit): still-[MASK] positions get 0; complete as the path is resolved (a step's group
    at 192 points)."""
    import dataclasses

    tr = steered_trace
    P = len(tr.prompt)
    ig = TR.input_attribution(model, tr, steps=4, top=3)
    recs = {r["position"]: r for r in TR.concept_attribution(model, tr, NAMES)[0]}
    for g, grp in enumerate(tr.groups):
        snap = tr.snapshot(g)
        for p in grp.positions:
            if p >= P + 11:
                assert p not in ig  # past the tokens returned: part of the states, not explained
                continue
            a = ig[p]
            assert all(a["per_position"][i] == 0.0 for i, t in enumerate(snap) if t == MASK)
            assert len(a["per_position"]) == len(snap) and len(a["top"]) <= 3
            assert a["value"] == pytest.approx(recs[p]["logit"], abs=1e-4)  # the steered state's logit
    fine = TR.input_attribution(model, dataclasses.replace(tr, groups=tr.groups[2:3]), steps=192)
    for a in fine.values():
        assert abs(a["completeness_error"]) < 0.02 * abs(a["value"] - a["baseline_value"])


def test_the_concept_table_reads_csv_and_parquet_and_ranks_by_name(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "t.csv").write_text(TABLE)
    rows = CT.load(tmp_path / "t.csv")
    pq.write_table(pa.Table.from_pylist([{"concept_id": c.concept_id, "concept_name": c.name,
                                          "concept_description": c.description, "head": c.head,
                                          "is_steerable": c.steerable} for c in rows]), tmp_path / "t.parquet")
    assert CT.load(tmp_path / "t.parquet") == rows
    hits = CT.search(rows, "call")
    # 3 (the name) + 1 (the description's "call"; "Calling" is another word); the unknown concept is left out
    assert [(c.name, s) for c, s in hits] == [("function call", 4)]
    assert [c.name for c, _ in CT.search(rows, "function")] == ["function definition", "function call"]
    assert CT.search(rows, "loop") == [] and [c.name for c, _ in CT.search(rows, "loop", steerable_only=False)] == ["loop"]
    assert CT.known_names(rows, 4) == ["function definition", "function call", "loop", "#3"]
    (tmp_path / "bad.csv").write_text("concept_id,concept_name\nx,a\n")
    from ncpctl.errors import UserError

    with pytest.raises(UserError, match="row 1: concept_id"):
        CT.load(tmp_path / "bad.csv")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from .test_attribute_inputs import _checkpoints

    tmp = tmp_path_factory.mktemp("cdlm-tools")
    (tmp / "concept_labels.csv").write_text(TABLE)
    return _checkpoints(tmp)[0], str(tmp / "concept_labels.csv")


def test_cli_inspect_generate_explains_each_token(checkpoint):
    ck, table = checkpoint
    code, out = cli("inspect", ck, "-p", "def main(argv):", "--generate", "6", "--seed", "1", "--steer",
                    "concept=function call,strength=2logit,at=decoder.1+", "--concept-table", table,
                    "--attribute-inputs", "--ig-steps", "4", "--top", "2")
    assert code == 0, out
    (g,) = out["generations"]
    assert out["steer"][0]["direction"] == "concept:function call" and g["summary"]["replay_error"] < 1e-4
    assert len(g["tokens"]) == 6 and [t["position"] for t in g["tokens"]] == sorted(t["position"] for t in g["tokens"])
    t = g["tokens"][0]
    assert t["concepts"][0]["name"] in ("function definition", "function call", "loop") and len(t["concepts"]) == 2
    assert set(t["inputs"]) == {"sum", "completeness_error", "top"} and len(t["inputs"]["top"]) <= 2
    assert g["chunks"] and g["chunks"][0]["span"][0] == g["prompt_tokens"]
    code, out = cli("inspect", ck, "--find-concept", "function call", "--concept-table", table)
    assert code == 0 and [h["name"] for h in out["hits"]][:1] == ["function call"], out
    assert len(out["hits"][0]["promotes"]) == 10
    for args, why in (((ck, "--find-concept", "x"), "pass --concept-table"),
                      ((ck, "-p", "x", "--seed", "3"), "apply with --generate"),
                      ((ck, "-p", "x", "--generate", "4", "--corpus", "builtin:python-stdlib"), "do not apply")):
        code, out = cli("inspect", *args)
        assert code == 2 and len(out["errors"]) == 1 and why in out["errors"][0], (args, out)

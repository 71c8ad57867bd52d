"""Issue 43 item 4 on the authors' own model: ncpctl's tools on the imported Steerling fixture
(tests/fixtures/authors/steerling/interpretable, made by their code: tools/reference/steerling.py)
give what their tools gave: greedy generation (``generate_full``), its commit order and committed
logits (their ``DiffusionTrace``), each token's known and discovered concept contributions and
residual (``FaithfulConceptAttributor``), the chunk-level attribution (``chunk_attribution``), the
amplified and unlearned generations (``SteeringConfig.injection`` / ``injection_relu``, their ReLU
logit mask), and concept search (``ConceptCatalog.search`` / ``group``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ncpctl.inference import SamplingParams
from ncpctl.interpret import concept_table as CT, trace as TR
from ncpctl.interpret.steer import SteerSpec, block_steering, resolve
from ncpctl.model.designs.causal_diffusion.sampler import sample_blocks

from ..conftest import REPO

FIX = REPO / "tests" / "fixtures" / "authors" / "steerling" / "interpretable"
TOL = 1e-5  # relative to the largest magnitude compared, as tests/interop/test_steerling.py


@pytest.fixture(scope="module")
def authors():
    from ncpctl.checkpoint import load_model

    loaded = load_model(FIX / "model", with_tokenizer=False)
    meta = json.loads((FIX / "reference.json").read_text())
    return loaded, load_file(str(FIX / "reference.safetensors")), meta


def close(ours, theirs) -> None:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(theirs, dtype=torch.float32)
    assert ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= TOL * float(theirs.abs().max()), \
        (ours, theirs)


def test_generation_trace_and_per_token_attribution_equal_theirs(authors):
    loaded, ref, meta = authors
    model, g = loaded.model, meta["generation"]
    prompt, n = g["prompt_ids"], g["config"]["max_new_tokens"]
    tr = TR.record(model, prompt, SamplingParams(max_new_tokens=n, greedy=True))
    assert prompt + tr.generated == ref["gen_tokens"].tolist()
    assert [p for grp in tr.groups for p in grp.positions] == ref["gen_commit_positions"].tolist()
    close([x for grp in tr.groups for x in grp.logits], ref["gen_commit_target_logits"])
    recs, summary = TR.concept_attribution(model, tr, keep_terms=True, top=50)
    assert summary["replay_error"] <= TOL * float(ref["gen_commit_target_logits"].abs().max())
    by_pos = {r["position"]: r for r in recs}
    order = ref["gen_commit_positions"].tolist()
    for c, p in enumerate(order):  # their buffers: indices in commit order, contributions by position
        k_idx, k_terms, u_idx, u_terms = by_pos[p]["_terms"]
        for idx, terms, their_idx, theirs in ((k_idx, k_terms, "gen_commit_known_indices", "gen_attr_known_contributions"),
                                              (u_idx, u_terms, "gen_commit_unk_indices", "gen_attr_unk_contributions")):
            ours = {j: t for j, t in zip(idx.tolist(), terms.tolist()) if t != 0.0}  # a top-k head's others: 0
            assert sorted(ours) == sorted(ref[their_idx][c].tolist())
            close([ours[j] for j in ref[their_idx][c].tolist()], ref[theirs][p])
    close([by_pos[p]["residual"] for p in order], ref["gen_attr_epsilon"][order])
    # chunk-level: their one chunk (no end-of-chunk token) over the generated tokens
    (chunk,) = TR.chunk_attribution(recs, 10_000, len(prompt), top=1000)
    (theirs,) = g["chunks"]
    for kind, their_kind in (("known", "known"), ("unknown", "discovered")):
        ours = sorted(e["contribution"] for e in chunk["concepts"] if e["type"] == kind)
        want = sorted(e["contribution"] for e in theirs["entries"] if e["label"].startswith(
            "Known" if their_kind == "known" else "Discovered") and not e["label"].startswith("Discovered: discovered"))
        assert len(ours) >= len(want) and all(any(abs(o - w) <= 1e-6 for o in ours) for w in want), (ours, want)
    assert abs(100 * chunk["residual_share"] - theirs["epsilon_pct"]) <= 1e-4


def test_amplified_and_unlearned_generations_equal_theirs(authors):
    """``injection(concept 3, target 4, inject_layer 2)`` is ``concept=#3,strength=4logit,at=decoder.1+``
    (length: their cutoff); ``injection_relu(3, group [11], -2 raw, inject_layer 1, relu 3)`` is a
    group injection ``concept=#3+#11,strength=-2norm,at=decoder.0+`` and a penalty on concept 3 alone
    whose vector is their ReLU logit mask (penalty = 3 ||K_3|| peak)."""
    loaded, ref, meta = authors
    model, g = loaded.model, meta["generation"]
    prompt, n, V = g["prompt_ids"], g["config"]["max_new_tokens"], loaded.config.vocab_size
    amp, un = g["amplify"], g["unlearn"]
    p = SamplingParams(max_new_tokens=n, greedy=True)
    (a,) = [resolve(model, SteerSpec.parse(f"concept=#3,strength={amp['mai_lm_target']}logit,at=decoder."
                                           f"{amp['inject_layer'] - 1}+,length={amp['cutoff_tokens']}"))]
    got = sample_blocks(model, [prompt], p, vocab_size=V, steer=block_steering([[a]]))[0]
    assert prompt + got == ref["gen_amplified_tokens"].tolist()
    K3 = model.bottleneck.K.detach()[3]
    peak = float((model.logit_weight.detach()[:V] @ (K3 / K3.norm())).max())
    inject = resolve(model, SteerSpec.parse(f"concept=#3+#11,strength={un['mai_lm_target']}norm,"
                                            f"at=decoder.{un['inject_layer'] - 1}+"))
    mask = resolve(model, SteerSpec.parse(f"concept=#3,strength=0norm,penalty={un['relu_strength'] * K3.norm() * peak}"))
    close(mask.penalty, ref["relu_suppression"][:V])
    got = sample_blocks(model, [prompt], p, vocab_size=V, steer=block_steering([[inject, mask]]))[0]
    assert prompt + got == ref["gen_unlearned_tokens"].tolist()
    plain = sample_blocks(model, [prompt], p, vocab_size=V)[0]
    assert got != plain  # the unlearning changed the generation, as theirs did


def test_concept_search_and_groups_equal_theirs(authors):
    _, _, meta = authors
    table = CT.load(FIX / "concepts.csv")
    for query, want in meta["search"].items():
        if query == "group_of_3":
            assert CT.group(table, 3) == want
        else:
            assert [c.concept_id for c, _ in CT.search(table, query)] == want, query


def test_cli_inspect_generate_on_their_directory_gives_their_commits(authors, tmp_path):
    """``ncpctl inspect DIR --tiktoken FILE --generate 8 --temperature 0`` on their directory (a tiny
    tiktoken file: one byte a token): their committed tokens, order and logits, named by their table."""
    from ncpctl.interop.authors.tiktoken_bpe import set_tiktoken

    from ..interop.test_steerling import as_text, tiny_tiktoken
    from .test_cdlm_steer import cli

    _, ref, meta = authors
    g = meta["generation"]
    bpe = tiny_tiktoken(tmp_path / "tiny.tiktoken")
    try:
        code, out = cli("inspect", str(FIX / "model"), "--tiktoken", str(bpe), "-p", as_text(torch.tensor(g["prompt_ids"])),
                        "--generate", "8", "--temperature", "0", "--concept-table", str(FIX / "concepts.csv"))
    finally:
        set_tiktoken(None)  # the CLI's process-wide setting: in process here
    assert code == 0, out
    (gen,) = out["generations"]
    P = len(g["prompt_ids"])
    assert [t["token"] for t in gen["tokens"]] == ref["gen_tokens"][P:].tolist()
    order = ref["gen_commit_positions"].tolist()
    assert [next(t["commit_order"] for t in gen["tokens"] if t["position"] == p) for p in order] == list(range(8))
    close([next(t["logit"] for t in gen["tokens"] if t["position"] == p) for p in order], ref["gen_commit_target_logits"])
    names = {c.name for c in CT.load(FIX / "concepts.csv") if c.head == "known"}
    assert {c["name"] for t in gen["tokens"] for c in t["concepts"]} <= names

"""Issue 25: speculative decoding in generate (ncpctl/inference/speculative.py, drafters.py): greedy
output equals plain greedy token for token, the sampled distribution is the target's (and a broken
acceptance rule is caught by the same test), rollback leaves the caches of the accepted prefix."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2

from ncpctl.inference import SamplingParams, generate
from ncpctl.inference.drafters import ModelDrafter, MtpDrafter
from ncpctl.inference.speculative import Cursor, Speculative
from ncpctl.model.core.interventions import AddToResidual, CodeEdit
from ncpctl.model.core.layers import Context

from ..conftest import run_cli
from ..model._helpers import build, tiny

DLCM = {"segmentation": "dynamic", "ncp_weight": 0.0, "vq_weight": 0.0}
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
CONFIGS = {
    "fixed-blocks": lambda: tiny("neox", concept=dict(k=3)),
    "dlcm": lambda: tiny("llama", concept=DLCM),
    "dlcm-cross-attention": lambda: tiny("llama", concept={**DLCM, "coupling": "cross_attention"}),
}
ARCHPREVIEW = lambda: tiny("llama", n_layers=4, norm_placement="post", residual="irc", mtp_depth=2,  # noqa: E731
                           crc_connections=["encoder-concept", "encoder-decoder", "concept-decoder"],
                           sliding_window=3, full_attn_every=2,
                           concept=dict(k=4, encoder_layers=2, concept_layers=1, code_weights="softmax"))
ONE = [[5, 17, 3, 99, 42]]
RAGGED = [[5, 17, 3, 99, 42], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def f64(cfg, seed: int = 0, scale: float = 0.05):
    return build(cfg, seed=seed, scale=scale).double()


def noisy(model, scale: float, seed: int = 5):
    """A drafter close to the target: it agrees often, not always (partial acceptance)."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return d


def _gen(model, prompts, spec=None, **kw):
    return [c.tokens for c in generate(model, prompts, SamplingParams(**kw), str, speculative=spec)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculative_equals_plain_greedy(name):
    torch.manual_seed(0)
    model = f64(CONFIGS[name](), scale=0.2)
    drafter = noisy(model, 0.005)
    n = 24
    E, D = len(model.encoder), len(model.decoder)
    iv = [AddToResidual(start=4, vector=torch.randn(model.cfg.d_model, dtype=torch.float64), stack="decoder",
                        layer=D - 1, rows=[0])]
    if model.concept is not None and name == "fixed-blocks":
        S, N = model.cfg.concept.segments, model.cfg.concept.codes
        iv.append(CodeEdit(start=1, scale=torch.zeros(S, N, dtype=torch.float64).index_fill_(1, torch.tensor([0]), 1)))
    assert E >= 1

    def penalty(step, logits):  # steering's logit penalty: it depends on the generated token's index
        return logits - 2.0 * (torch.arange(logits.shape[1]) % 5 == step % 5)

    for prompts, ivs, adj in ((ONE, None, None), (RAGGED, None, None), (RAGGED, iv, penalty)):
        plain = [c.tokens for c in generate(model, prompts, SamplingParams(max_new_tokens=n, greedy=True), str,
                                            interventions=ivs, logit_adjust=adj)]
        for K in (1, 3):
            spec = Speculative(ModelDrafter(drafter), K)
            got = [c.tokens for c in generate(model, prompts, SamplingParams(max_new_tokens=n, greedy=True), str,
                                              interventions=ivs, logit_adjust=adj, speculative=spec)]
            assert got == plain, (prompts, K)
            st = spec.stats.as_dict()
            if len(prompts) == 1:  # one row: rounds that accept some drafts and reject others
                assert 1.0 < st["mal"] < K + 1, st
    # a drafter that is the target accepts everything: K + 1 tokens a round, except the last round of
    # each row, which commits only the tokens left of max_new_tokens (issue 41 item 8: the 4.0 this
    # asserted counted the dropped ones): n - 1 = 23 tokens after the first in ceil(23 / 4) = 6 rounds
    spec = Speculative(ModelDrafter(model), 3)
    assert _gen(model, RAGGED, spec, max_new_tokens=n, greedy=True) == _gen(model, RAGGED, max_new_tokens=n,
                                                                             greedy=True)
    st = spec.stats.as_dict()
    assert st["mal"] == (n - 1) / 6 and st["committed_per_round"] == {"3": 3, "4": 15}


def test_mtp_self_drafter_greedy_and_cached_heads():
    """Greedy output with the MTP drafter is the target's; its drafts come from per-depth caches
    kept across rounds that commit 1, 2 or 3 tokens, and equal the MTP head (mtp.py's
    teacher-forced forward, uncached) run on the whole committed sequence. The target is
    debug-archpreview's design (IRC, all three CRC links, post-norm, windows), whose multi-token
    verification step must carry the CRC state token by token too."""
    model = f64(ARCHPREVIEW(), scale=0.2)
    plain = _gen(model, RAGGED, max_new_tokens=20, greedy=True)
    for K in (1, 2):
        spec = Speculative(MtpDrafter(model), K)
        assert _gen(model, RAGGED, spec, max_new_tokens=20, greedy=True) == plain
    spec = Speculative(ModelDrafter(noisy(model, 0.005)), 3)
    assert _gen(model, ONE, spec, max_new_tokens=20, greedy=True) == plain[:1]
    assert 1.0 < spec.stats.as_dict()["mal"] < 4, spec.stats.as_dict()
    committed = list(ONE[0])
    x = torch.tensor([11])
    target = Cursor(model, torch.tensor([committed]), [len(committed)], 40)
    dr = MtpDrafter(model)
    dr.start(target, torch.tensor([committed]), [len(committed)], 40)
    params, gen = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
    for r, m in enumerate([1, 2, 3, 1, 3, 2, 2]):
        drafts, q = dr.propose(x, 2, params, [gen], None)
        target.feed(torch.cat([x[:, None], drafts], 1))
        target.commit([m])
        dr.commit([m])
        committed += [int(x)] + drafts[0, : m - 1].tolist()
        x = torch.tensor([(7 * r + 3) % 200])  # the round's correction (any token)
    drafts, q = dr.propose(x, 2, params, [gen], None)
    with torch.no_grad():
        seq = torch.tensor([committed + [int(x), int(drafts[0, 0])]])  # (1, T + 2)
        T = len(committed)
        prev = model(seq[:, :T], return_hidden=True).hidden  # (1, T, d) h_0
        pos = torch.arange(T)[None]
        ctx = Context.causal(model.cfg, pos, [None], prev.dtype)
        for k, depth in enumerate(model.mtp.depths, start=1):  # depth k reads the token k ahead
            prev = depth(prev, model.embed_tokens(seq[:, k : T + k], pos), ctx)
            ref = model.head(model.final_norm(prev[:, -1:]))[0, 0].float().softmax(-1)
            assert torch.allclose(q[0, k - 1], ref, atol=1e-6), k


def _enumerate(model, prompt, V, n=3):
    """The target's exact probability of every n-token continuation (V**n,), from full forwards."""
    probs = []
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n):
            x = torch.tensor([prompt + list(seq)])
            lp = model(x).logits[0, len(prompt) - 1 : -1, :V].float().log_softmax(-1)  # (n, V)
            probs.append(float(lp.gather(1, torch.tensor(seq)[:, None]).sum().exp()))
    return torch.tensor(probs)


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against probabilities p, cells with expected count < 5 pooled."""
    N = counts.sum()
    small = N * p < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([N * p[~small], N * p[small].sum()[None]]) if small.any() else N * p
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def test_sampled_distribution_is_the_targets_and_a_broken_rule_is_caught():
    """The first three sampled tokens on a 4-token vocabulary: a chi-square test against the target's
    exact enumeration (64 cells, those expected below 5 pooled) at significance 0.001, seeded, so
    deterministic. Batches of 4 identical prompts (each row its own seed) keep it fast and cover the
    ragged commit. The same statistic rejects always-accept, whose drafted tokens follow the drafter."""
    V, B, batches, alpha = 4, 4, 300, 1e-3
    cfg = tiny("neox", vocab_size=V, pad_vocab_multiple=4, n_layers=2)  # the rule is under test, not concepts
    model = f64(cfg, scale=0.3)
    drafter = noisy(model, 0.1)  # accepts about 40% of drafts here
    prompt = [1, 2, 3]
    p = _enumerate(model, prompt, V)
    assert abs(float(p.sum()) - 1) < 1e-6
    index = {s: i for i, s in enumerate(itertools.product(range(V), repeat=3))}

    def counts(accept):
        c = torch.zeros(V ** 3)
        spec = Speculative(ModelDrafter(drafter), 2, accept=accept)
        for r in range(batches):
            for toks in _gen(model, [prompt] * B, spec, max_new_tokens=3, temperature=1.0, seed=r * B):
                c[index[tuple(toks)]] += 1
        return c, spec.stats.as_dict()

    good, st = counts(None)
    stat, df = _chi_square(good, p)
    assert stat < chi2.ppf(1 - alpha, df), (stat, df)
    assert 0.2 < st["acceptance"] < 0.9 and st["mal"] > 1.2, st  # drafts accepted, rejected, several a round
    bad, _ = counts(lambda pd, qd: torch.ones(()))  # always accept
    stat_bad, df_bad = _chi_square(bad, p)
    assert stat_bad > chi2.ppf(1 - alpha, df_bad), (stat_bad, df_bad)


def _live(state, b: int, closed: int) -> dict:
    """What row b of a decode state's future depends on: its token cache slots (from its first real
    one to its next), its first ``closed`` concept cache entries and coupling concept keys, and its
    rows of the per-row state dicts."""
    lo, hi = state.pad[b], state.row_slots[b]
    out = {f"tok{i}": torch.cat([c.k[b, :, lo:hi], c.v[b, :, lo:hi]])
           for i, c in enumerate([*state.enc, *state.dec])}
    out.update({f"con{i}": torch.cat([c.k[b, :, :closed], c.v[b, :, :closed]]) for i, c in enumerate(state.con)})
    for name in ("seg", "cpl", "crc"):
        for k, v in getattr(state, name).items():
            out[f"{name}.{k}"] = v[b, :, :closed] if k in ("k", "v") else v[b]  # (H, M, hd): the first closed live
    return out


@pytest.mark.parametrize("name", ["fixed-blocks", "dlcm-cross-attention"])
def test_caches_after_a_rejection_equal_the_accepted_prefix(name):
    """A 7-token draft (concepts close inside it), of which row 0 keeps 3 and row 1 keeps 5: each
    row's caches and concept state equal those of that row's accepted prefix decoded alone, and so
    do the logits of what comes next."""
    model = f64(CONFIGS[name](), scale=0.3)
    k = model.cfg.concept.k
    prompt = torch.tensor([[0, 0, 5, 17, 3], [9, 10, 11, 12, 13]])  # row 0 left-padded
    lengths, keep = [3, 5], [3, 5]
    more = torch.tensor([[4, 8, 15, 16, 23, 42, 7], [1, 2, 3, 4, 5, 6, 7]])
    spec = Cursor(model, prompt, lengths, 24)
    spec.feed(more)
    spec.commit(keep)
    nxt = torch.tensor([[3, 1, 4], [1, 5, 9]])
    after = spec.feed(nxt)  # (B, 3, V) every row from its own slot
    spec.commit([0, 0])
    for b, n in enumerate(lengths):
        ref = Cursor(model, prompt[b : b + 1, -n:], [n], 24)
        ref.feed(more[b : b + 1, : keep[b]])
        closed = (n + keep[b]) // k if "n" not in ref.state.seg else int(ref.state.seg["n"][0])
        got, want = _live(spec.state, b, closed), _live(ref.state, 0, closed)
        assert got.keys() == want.keys()
        for key in got:
            assert torch.allclose(got[key], want[key], atol=1e-12, rtol=0), (b, key)
        assert torch.allclose(after[b], ref.feed(nxt[b : b + 1])[0], atol=1e-12), b


def _checkpoint(tmp: Path, name: str, tokenizer: Path = TOKENIZER, **cfg) -> str:
    from ncpctl.checkpoint import save_model_files

    model = build(tiny("llama", vocab_size=320, max_seq_len=64, **cfg), scale=0.3)
    save_model_files(tmp / name, model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tokenizer)
    return str(tmp / name)


def test_cli_generate_speculative_json_and_refusals(tmp_path):
    from tokenizers import Tokenizer

    from ncpctl.checkpoint import load_model
    from ncpctl.errors import UserError
    from ncpctl.inference import generate_texts
    from ncpctl.inference.drafters import load_speculative

    target = _checkpoint(tmp_path, "target", mtp_depth=2)
    draft = _checkpoint(tmp_path, "draft", n_layers=1)
    plain = [c.text for c in generate_texts(load_model(target), ["def main(", "x"],
                                            SamplingParams(max_new_tokens=9, greedy=True))]
    for how in (["--draft", draft, "--draft-tokens", "3"], ["--draft", "mtp", "--draft-tokens", "2"]):
        r = run_cli("generate", target, "-p", "def main(", "-p", "x", "-n", "9", "--greedy", "--json", *how)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert [c["text"] for c in out["completions"]] == plain
        s = out["speculative"]
        assert s["draft_tokens"] == int(how[-1]) and s["rounds"] >= 1 and 1.0 <= s["mal"] <= int(how[-1]) + 1
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.add_special_tokens(["<|other|>"])
    tok.save(str(tmp_path / "other.json"))
    other = _checkpoint(tmp_path, "other", tokenizer=tmp_path / "other.json")
    r = run_cli("generate", target, "--draft", other, "-p", "x", "-n", "3")
    assert r.returncode == 2 and "another tokenizer or vocabulary" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    cdlm = _checkpoint(tmp_path, "cdlm", objective="causal_diffusion", diffusion=dict(block_size=4, mask_id=3))
    for ck, args, msg in ((target, (draft, 0), "--draft-tokens must be >= 1"),
                          (draft, ("mtp", 2), "has no MTP head"),
                          (cdlm, (draft, 2), "speculative decoding needs next-token decoding"),
                          (target, (cdlm, 2), "drafting needs next-token decoding")):
        with pytest.raises(UserError, match=msg) as e:
            load_speculative(load_model(ck), *args)
        assert len(e.value.problems) == 1 and "\n" not in e.value.problems[0] and e.value.hint is None


def test_rounds_at_the_window_edge_with_learned_positions():
    """Prompts and new tokens filling a gpt2 model's whole window (learned positions): a last round
    drafts past it for rows that are done; those throw-away tokens must not index past the table."""
    model = f64(tiny("gpt2", max_seq_len=24, concept=dict(k=2)), scale=0.2)
    prompts = [list(range(1, 11)), [5, 6], [7]]
    spec = Speculative(ModelDrafter(noisy(model, 0.01)), 4)
    got = [c.tokens for c in generate(model, prompts, SamplingParams(max_new_tokens=14, greedy=True), str,
                                      max_len=24, speculative=spec)]
    assert got == [c.tokens for c in generate(model, prompts, SamplingParams(max_new_tokens=14, greedy=True), str,
                                              max_len=24)]
    assert spec.stats.as_dict()["mal"] > 1.5


def test_mal_counts_only_the_committed_tokens():
    """Issue 41 item 8: MAL (Eq. 27) counted the tokens a last round drew past --new-tokens (62
    against 60 produced). Over any run, the tokens the rounds committed are the completions' tokens
    after the first (which comes from the prefill), ragged rows and an early end included."""
    model = f64(CONFIGS["fixed-blocks"](), scale=0.2)
    for n, K in ((5, 4), (9, 3), (12, 5)):
        spec = Speculative(ModelDrafter(model), K)  # the target itself: every draft accepted
        done = generate(model, RAGGED, SamplingParams(max_new_tokens=n, greedy=True), str, speculative=spec)
        assert [len(c.tokens) for c in done] == [n] * len(RAGGED)
        assert spec.stats.committed == sum(len(c.tokens) - 1 for c in done), (n, K, spec.stats)
        assert max(int(m) for m in spec.stats.as_dict()["committed_per_round"]) <= min(K + 1, n - 1)
    plain = generate(model, ONE, SamplingParams(max_new_tokens=12, greedy=True), str)[0].tokens
    spec = Speculative(ModelDrafter(model), 4)
    done = generate(model, ONE, SamplingParams(max_new_tokens=12, greedy=True), str, eod_id=plain[3], speculative=spec)
    assert done[0].tokens == plain[: plain.index(plain[3]) + 1] and spec.stats.committed == len(done[0].tokens) - 1


def test_the_k_actually_drafted_is_reported_and_statistics_go_to_stderr(tmp_path):
    """Issue 46 item 5: `--draft mtp` with the default --draft-tokens 4 on a depth-1 MTP head drafts
    one token a round while the JSON said 4, `eval --speculative mtp` printed horizon 16, and the
    statistics line was on stdout with the generated text (in-process: typer's CliRunner)."""
    from typer.testing import CliRunner

    from ncpctl.checkpoint import load_model
    from ncpctl.cli.app import app
    from ncpctl.evaluate.speculative import rich_table, speculative_mal
    from ncpctl.inference import generate_texts

    target = _checkpoint(tmp_path, "target", mtp_depth=1)
    plain = generate_texts(load_model(target), ["def main("], SamplingParams(max_new_tokens=6, greedy=True))[0].text
    args = ["generate", target, "-p", "def main(", "-n", "6", "--greedy", "--draft", "mtp"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    s = json.loads(r.stdout)["speculative"]
    assert (s["draft_tokens"], s["draft_tokens_requested"]) == (1, 4) and s["committed_per_round"].keys() <= {"1", "2"}
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout == "def main(" + plain + "\n"  # the streamed text, and nothing else
    assert "note: --draft-tokens 4 is more than the drafter proposes: 1 a round" in r.stderr
    assert "verification rounds, MAL" in r.stderr and "K = 1" in r.stderr, r.stderr
    (tmp_path / "p.jsonl").write_text('{"prompt": "def main("}\n')
    payload = speculative_mal(target, "mtp", horizon=16, prompts=str(tmp_path / "p.jsonl"), limit=1, new_tokens=6)
    assert (payload["horizon"], payload["horizon_requested"]) == (1, 16) and "draft_tokens" not in payload
    assert "(horizon 1, --horizon 16 cut" in rich_table(payload).title

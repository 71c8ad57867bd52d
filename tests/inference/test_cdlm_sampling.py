"""Issue 23 item 3: block-wise sampling from a Causal Diffusion LM (ncpctl/inference/causal_diffusion.py):
cached blocks give the tokens of a full recomputation at every step (greedy and seeded sampling, a
ragged batch of prompts that end inside a block), the cached block logits are the full forward's, a
row's output does not depend on its batch, the commit schedules, EOD / stop strings / streaming
through ``generate``, and ``ncpctl generate`` on a CDLM checkpoint (its flags and refusals)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ncpctl.inference import SamplingParams, generate
from ncpctl.inference.causal_diffusion import _Cached, sample_blocks, schedule

from ..conftest import run_cli
from ..model._helpers import build, tiny

torch.set_num_threads(1)
BLOCK, MASK, V = 4, 1, 200
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens


def cdlm(**kw):
    cfg = tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=MASK), **kw)
    return build(cfg, scale=0.3)


def prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return cdlm()


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=1.0, seed=4),
                                dict(temperature=0.8, top_k=20, top_p=0.9, seed=1, steps_per_block=2),
                                dict(greedy=True, commit_per_step=3, steps_per_block=3)])
def test_cached_sampling_equals_full_recomputation(model, kw):
    """Ragged prompts (5, 11, 2, 8 tokens: three end inside a block, one on a boundary) in one batch."""
    ps = prompts(5, 11, 2, 8)
    p = SamplingParams(max_new_tokens=13, **kw)
    cached = sample_blocks(model, ps, p, vocab_size=V, cache=True)
    full = sample_blocks(model, ps, p, vocab_size=V, cache=False)
    assert cached == full and [len(t) for t in cached] == [13] * 4
    assert all(MASK not in t and max(t) < V for t in cached)  # never [MASK], never a padded-vocab id


def test_cached_block_logits_equal_the_full_forward(model):
    """Each call of the cached path (the previous, clean block written to the caches with the
    current one) gives the current block's logits of a full forward of the row's sequence."""
    seqs = prompts(13, 6, 21, seed=8)  # 13 + 6 + 21 tokens: rows of 4, 2 and 6 blocks
    C = max(len(s) // BLOCK for s in seqs)
    pad = torch.tensor([(C - len(s) // BLOCK) * BLOCK for s in seqs])
    x = torch.full((3, (C + 2) * BLOCK), MASK, dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, int(pad[b]) : int(pad[b]) + len(s)] = torch.tensor(s)
    fwd = _Cached(model, x, pad)
    with torch.no_grad():
        for lo in (C * BLOCK, C * BLOCK, (C + 1) * BLOCK):  # a block twice (two steps), then the next one
            got = fwd(x, lo, BLOCK)
            for b in range(3):
                row = x[b, int(pad[b]) : lo + BLOCK][None]
                want = model(row).logits[0, -BLOCK:]
                assert torch.allclose(got[b], want, atol=1e-5, rtol=1e-5), (lo, b)


def test_a_rows_output_does_not_depend_on_its_batch(model):
    ps = prompts(5, 11, 2)
    p = SamplingParams(max_new_tokens=9, temperature=1.0, top_k=50, seed=7)
    batch = sample_blocks(model, ps, p, vocab_size=V)
    for b in range(3):  # row b samples with seed + b
        assert sample_blocks(model, ps[b : b + 1], replace(p, seed=7 + b), vocab_size=V)[0] == batch[b]
    assert sample_blocks(model, ps[:1], replace(p, seed=8), vocab_size=V)[0] != batch[0]


def test_one_token_per_step_when_steps_equal_the_block_size(model):
    """Greedy with steps_per_block = block size: one forward per new token, each committing one
    [MASK]: after the forward of step i the block has exactly i + 1 new tokens. A [MASK] in the
    prompt stays: it is not a position to fill."""
    ps = prompts(6)  # 2 prompt tokens in its last block: 2 + 4 + 4 new tokens over 3 blocks
    ps[0][5] = MASK
    calls, commits = [], []
    import ncpctl.model.designs.causal_diffusion.sampler as bs  # the sampler (ncpctl.inference.causal_diffusion re-exports it)

    real = bs._commit

    def counting(blk, open_, *a):
        before = int(open_.sum())
        done = real(blk, open_, *a)
        commits.append(before - int(open_.sum()))
        return done

    bs._commit = counting
    try:
        out = sample_blocks(model, ps, SamplingParams(max_new_tokens=10, greedy=True), vocab_size=V,
                            on_forward=lambda: calls.append(1))
    finally:
        bs._commit = real
    assert len(out[0]) == 10 and len(calls) == 10 and commits == [1] * 10
    assert schedule(8, 3, None) == [3, 3, 2] and schedule(8, 3, 2) == [2, 2, 4] and schedule(2, 4, None) == [1, 1, 0, 0]


def test_generate_ends_a_row_at_eod_and_streams_each_block(model):
    ps = prompts(5, 9)
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    p = SamplingParams(max_new_tokens=14, greedy=True)
    free = generate(model, ps, p, decode, vocab_size=V)
    assert [c.finish_reason for c in free] == ["length", "length"] and [len(c.tokens) for c in free] == [14, 14]
    eod = free[0].tokens[5]
    first = free[0].tokens.index(eod)
    streamed: dict[int, list[str]] = {0: [], 1: []}
    out = generate(model, ps, p, decode, eod_id=eod, vocab_size=V, on_text=lambda b, d: streamed[b].append(d))
    assert out[0].finish_reason == "eod" and out[0].tokens == free[0].tokens[: first + 1]
    assert out[0].text == decode(free[0].tokens[:first])
    assert "".join(streamed[0]) == out[0].text and "".join(streamed[1]) == out[1].text
    assert len(streamed[0]) <= 2  # at most once per block: its prompt's last block (3 tokens), then 4
    stop = decode(free[1].tokens[3:5])
    cut = generate(model, ps, replace(p, stop=[stop]), decode, vocab_size=V)[1]
    assert cut.finish_reason == "stop" and cut.text == free[1].text[: free[1].text.find(stop)]
    with pytest.raises(ValueError, match="steering"):
        generate(model, ps, p, decode, logit_adjust=lambda step, lg: lg)


def _checkpoint(tmp: Path, name: str, **cfg) -> str:
    from ncpctl.checkpoint import save_model_files

    model = build(tiny("llama", vocab_size=320, max_seq_len=64, **cfg), scale=0.3)
    save_model_files(tmp / name, model, step=0, tokens_seen=0, recipe=None, tokenizer_path=TOKENIZER)
    return str(tmp / name)


def test_cli_generate_samples_a_cdlm_checkpoint(tmp_path):
    ck = _checkpoint(tmp_path, "cdlm", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=MASK))
    streamed = run_cli("generate", ck, "-p", "def main(", "-n", "10", "--greedy")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.startswith("def main(") and len(streamed.stdout) > len("def main(\n")
    r = run_cli("generate", ck, "-p", "import", "-p", "x = 1", "-n", "9", "--seed", "2", "--steps-per-block", "2",
                "--commit-per-step", "3", "--top-k", "40", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [c["tokens"] for c in out["completions"]] == [9, 9]
    assert out["sampling"]["steps_per_block"] == 2 and out["sampling"]["commit_per_step"] == 3
    # steering a CDLM is built (issue 43 item 4: tests/inference/test_cdlm_steer.py); a code direction needs a codebook
    steer = run_cli("generate", ck, "-p", "x", "--steer", "code=0/0,strength=6logit")
    assert steer.returncode == 2 and "no concept path, so no codebook to steer with" in steer.stderr
    assert len(steer.stderr.strip().splitlines()) == 1, steer.stderr


def test_cli_block_flags_on_an_autoregressive_checkpoint_exit_2(tmp_path):
    ck = _checkpoint(tmp_path, "ar")
    r = run_cli("generate", ck, "-p", "x", "--steps-per-block", "4")
    assert r.returncode == 2 and "--steps-per-block / --commit-per-step apply to a Causal Diffusion LM" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

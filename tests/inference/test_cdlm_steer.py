"""Issue 43 item 4: steering a Causal Diffusion LM's block-wise sampling as Steerling's generator does
(ncpctl/model/designs/causal_diffusion/sampler.py's ``steer`` hook, ``ncpctl.interpret.steer.BlockSteering``): the
vector at the still-[MASK] positions of every forward, after every layer from L on (``decoder.L+``),
while the row's committed tokens lie in [start, start + length), and the ReLU logit penalty; the
cached sampler equals the full recomputation under steering; ``generate --steer`` on a CDLM."""

from __future__ import annotations

import json

import pytest
import torch

from ncpctl.inference import SamplingParams
from ncpctl.interpret.steer import BlockSteering, SteerSpec, block_steering, resolve
from ncpctl.model.designs.causal_diffusion.sampler import _Cached, sample_blocks

from ..model._helpers import build, tiny

torch.set_num_threads(1)
BLOCK, MASK, V = 4, 1, 200
BN = dict(enabled=True, concepts=3, chunk=BLOCK, rank=8, dropout=0.0, teacher_forcing_start=0.0,
          teacher_forcing_end=0.0)
NAMES = ["def", "call", "loop"]


@pytest.fixture(scope="module")
def model():
    return build(tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=MASK),
                      bottleneck=BN), scale=0.3)


def prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lengths]


def steering(model, *texts: str) -> list:
    return [resolve(model, SteerSpec.parse(t), NAMES) for t in texts]


@torch.no_grad()
def test_the_steered_forward_is_steerlings_injection_at_the_mask_positions(model):
    """One cached sampler call (a row whose block is part prompt, part [MASK], one [MASK] already
    committed) against an independent reference: forward hooks that add gamma * K_c/||K_c|| to the
    output of every decoder layer from L on, at the [MASK] positions only (Steerling's
    ``_forward_with_injection`` with ``_position_injection``)."""
    (r,) = steering(model, "concept=call,strength=3logit,at=decoder.1+")
    row = prompts(7)[0] + [MASK] * 5  # 7 prompt tokens, then [MASK] to the end of block 2 (positions 7..11)
    row[9] = 55  # a token committed earlier: no longer [MASK], so not steered
    x = torch.tensor([row])
    holes = torch.arange(12)[None] >= 7
    holes[0, 9] = False
    got = _Cached(model, x, torch.tensor([0]))(x, 8, BLOCK, (), holes, BlockSteering([[r]]), [1])  # (1, 4, V)
    where = (x == MASK)[..., None].float()  # (1, T, 1)
    hooks = [model.decoder[i].register_forward_hook(lambda m, a, out: out + where * r.vector)
             for i in range(1, len(model.decoder))]
    try:
        want = model(x).logits[:, 8:12]
    finally:
        for h in hooks:
            h.remove()
    plain = model(x).logits[:, 8:12]
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5) and (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("specs", [
    ("concept=call,strength=3logit,at=decoder.1+,length=5",),
    ("concept=def+loop,strength=2norm,at=readout,penalty=4", "concept=#1,strength=1logit,at=decoder_input,start=3"),
])
def test_steered_cached_sampling_equals_the_full_recomputation(model, specs):
    """Ragged prompts (5, 11, 2 tokens), each row with its own specs; sampled and greedy."""
    ps = prompts(5, 11, 2)
    steer = block_steering([steering(model, *specs), [], steering(model, *specs)])
    for p in (SamplingParams(max_new_tokens=9, greedy=True), SamplingParams(max_new_tokens=9, seed=2, top_k=30)):
        cached = sample_blocks(model, ps, p, vocab_size=V, steer=steer)
        full = sample_blocks(model, ps, p, vocab_size=V, steer=steer, cache=False)
        plain = sample_blocks(model, ps, p, vocab_size=V)
        assert cached == full and cached[1] == plain[1]  # row 1 is not steered
        assert cached[0] != plain[0] and cached[2] != plain[2]


def test_positional_interventions_apply_in_every_forward_cached_or_not(model):
    """``generate(..., interventions=...)`` on a CDLM (refused before issue 43): an intervention by
    position applies to every slot each forward computes, so the cached sampler (a finished block's
    keys and values computed with it) equals the full recomputation."""
    from ncpctl.model.core.interventions import AddToDecoderInput, AddToResidual

    v = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(2))
    ivs = [AddToDecoderInput(start=3, length=6, vector=v), AddToResidual(start=9, vector=-v, layer=1, rows=[1])]
    ps, p = prompts(5, 11), SamplingParams(max_new_tokens=9, greedy=True)
    cached = sample_blocks(model, ps, p, vocab_size=V, interventions=ivs)
    assert cached == sample_blocks(model, ps, p, vocab_size=V, interventions=ivs, cache=False)
    assert cached != sample_blocks(model, ps, p, vocab_size=V)


def test_the_schedule_counts_committed_tokens(model):
    """Steering is on while start <= committed < start + length (Steerling's hard_cutoff: start 0,
    length = cutoff_tokens); a start past the generation never steers; the penalty applies with it."""
    (r,) = steering(model, "concept=call,strength=6logit,at=decoder.1+,start=40,penalty=5")
    assert not BlockSteering.active(r.spec, 39) and BlockSteering.active(r.spec, 40)
    (c,) = steering(model, "concept=call,strength=6logit,at=decoder.1+,length=2")
    assert [BlockSteering.active(c.spec, n) for n in range(4)] == [True, True, False, False]
    ps, p = prompts(6), SamplingParams(max_new_tokens=10, greedy=True)
    plain = sample_blocks(model, ps, p, vocab_size=V)
    assert sample_blocks(model, ps, p, vocab_size=V, steer=block_steering([[r]])) == plain
    seen = []
    sample_blocks(model, ps, p, vocab_size=V, steer=block_steering([[c]]), on_commit=lambda e: seen.append(e.committed))
    assert seen == list(range(10))  # one token a step: the schedule sees 0, 1, 2, ...
    lg = torch.zeros(3, V)
    adjusted = BlockSteering([[r]]).adjust(0, 40, lg)
    assert torch.allclose(-adjusted[0], r.penalty) and adjusted.min() == pytest.approx(-5.0)  # at most the penalty


def test_a_prompt_start_is_refused_for_block_sampling(model):
    from ncpctl.errors import UserError

    with pytest.raises(UserError, match="never samples"):
        block_steering([steering(model, "concept=call,strength=1logit,start=prompt")])


def cli(*args: str):
    """The CLI in process (typer's CliRunner): (exit code, the JSON document on stdout)."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, json.loads(r.stdout)


def test_cli_generate_steers_a_cdlm(tmp_path):
    """``ncpctl generate --steer`` on a CDLM checkpoint (refused before issue 43), by name and by index."""
    from .test_attribute_inputs import _checkpoints

    ck, _ = _checkpoints(tmp_path)
    args = ("generate", ck, "-p", "def main(argv):", "-n", "8", "--greedy")
    code, out = cli(*args)
    plain = out["completions"][0]
    code, out = cli(*args, "--steer", "concept=call,strength=8logit,at=decoder.1+,length=4", "--steer",
                    "concept=#2,strength=1norm,at=readout,penalty=2")
    assert code == 0, out
    (row,) = out["steer"]
    assert [s["direction"] for s in row] == ["concept:call", "concept:#2"] and row[0]["at"] == "decoder.1+"
    got = out["completions"][0]
    assert got["tokens"] == plain["tokens"] == 8 and got["text"] != plain["text"]
    code, out = cli("generate", ck, "-p", "x", "--steer", "concept=call,strength=1logit,start=prompt")
    assert code == 2 and len(out["errors"]) == 1 and "never samples" in out["errors"][0], out

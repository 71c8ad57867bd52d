"""Issue 23 item 6: input attribution against the [MASK] baseline (ncpctl.interpret.inputs,
``ncpctl inspect --attribute-inputs``): occlusion equals a hand-computed change; under block-causal
attention a token after the output's block has a change of exactly 0; integrated gradients are
complete (their sum equals output(input) - output(all [MASK])) within an error that shrinks with the
steps; the CLI's JSON, and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ncpctl.interpret import inputs as I

from ..conftest import run_cli
from ..model._helpers import build, tiny

torch.set_num_threads(1)
BLOCK, MASK = 4, 1
FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
BN = dict(enabled=True, concepts=3, chunk=BLOCK, rank=8, dropout=0.0, teacher_forcing_start=0.0,
          teacher_forcing_end=0.0)


def cdlm(mask: int = MASK, **kw):
    return build(tiny("llama", objective="causal_diffusion", diffusion=dict(block_size=BLOCK, mask_id=mask), **kw),
                 scale=0.3)


@pytest.fixture(scope="module")
def model():
    return cdlm()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_cdlm_output_is_read_at_the_first_mask_after_the_prompt(model):
    ids, pos = I.sequence(model, prompt(10))
    assert ids[:10] == prompt(10) and ids[10:] == [MASK, MASK] and pos == (10, 11)  # to the end of the block
    ids, pos = I.sequence(model, prompt(8))
    assert ids[8:] == [MASK] * BLOCK and pos == (8, 9, 10, 11)  # a prompt ending on a boundary: a whole block
    assert I.units(10, "block", BLOCK) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    rec = I.attribute_prompt(model, prompt(70), baseline=MASK, ig_steps=0, max_len=64)  # max_seq_len 64
    assert rec["sequence"] == {"tokens": 64, "prompt_tokens": 63, "text_after_prompt": str([MASK])}
    assert [t["id"] for t in rec["tokens"]] == prompt(70)[7:]  # the prompt's end is kept


def test_occlusion_equals_the_hand_computed_change(model):
    ids, pos = I.sequence(model, prompt(10))
    x = torch.tensor(ids)[None]
    out = I.Output("logit", pos[:1], token=7)
    base, deltas = I.occlusion(model, x, out, I.units(10, "token", BLOCK), MASK, batch=4)  # several batches
    with torch.no_grad():
        ref = float(model(x).logits[0, 10, 7])
        for i in (0, 5, 9):
            y = x.clone()
            y[0, i] = MASK
            assert deltas[i] == pytest.approx(ref - float(model(y).logits[0, 10, 7]), abs=1e-5)
    assert base == pytest.approx(ref, abs=1e-5) and min(abs(d) for d in deltas) < max(abs(d) for d in deltas)


def test_occluding_a_token_after_the_output_block_changes_nothing(model):
    ids, pos = I.sequence(model, prompt(10))  # 12 tokens: the output block is positions 8..11
    x = torch.tensor(ids + prompt(8, seed=1))[None]  # two later blocks
    for out in (I.Output("logit", pos[:1], token=7), I.Output("logit", (11,), token=3)):
        _, deltas = I.occlusion(model, x, out, I.units(20, "token", BLOCK), MASK)
        assert all(d == 0.0 for d in deltas[12:]), deltas[12:]  # exactly: block-causal attention
        assert all(d != 0.0 for d in deltas[:10])  # every prompt token is seen (earlier blocks and its own)


def test_integrated_gradients_are_complete_within_an_error_that_shrinks_with_steps(model):
    ids, pos = I.sequence(model, prompt(10))
    x = torch.tensor(ids)[None]
    out = I.Output("logit", pos[:1], token=7)
    with torch.no_grad():
        y = x.clone()
        y[0, :10] = MASK
        gap = float(model(x).logits[0, 10, 7] - model(y).logits[0, 10, 7])  # output(x) - output(all [MASK])
    errors = []
    for steps in (16, 64):
        ig = I.integrated_gradients(model, x, out, range(10), MASK, steps=steps)
        assert ig.value - ig.baseline_value == pytest.approx(gap, abs=1e-4)
        assert ig.per_position[10:] == [0.0, 0.0]  # the output's [MASK]s are not attributed
        errors.append(abs(ig.completeness_error))
    assert abs(gap) > 1.0 and errors[0] < 0.02 * abs(gap) and errors[1] < min(errors[0] / 4, 0.002 * abs(gap)), errors


def test_a_concept_output_sums_the_known_logit_over_the_output_block():
    model = cdlm(bottleneck=BN)
    ids, pos = I.sequence(model, prompt(9))
    x = torch.tensor(ids)[None]
    out = I.Output("concept", pos, concept=2)
    base, deltas = I.occlusion(model, x, out, I.units(9, "block", BLOCK), MASK)
    with torch.no_grad():
        z = model(x, return_bottleneck=True).bottleneck.k_logits[0, :, 2]  # (T,) f(h)_c
        y = x.clone()
        y[0, 4:8] = MASK
        z_occ = model(y, return_bottleneck=True).bottleneck.k_logits[0, :, 2]
    assert pos == (9, 10, 11) and base == pytest.approx(float(z[9:12].sum()), abs=1e-5)
    assert deltas[1] == pytest.approx(float(z[9:12].sum() - z_occ[9:12].sum()), abs=1e-5)
    ig = I.integrated_gradients(model, x, out, range(9), MASK, steps=32)
    assert abs(ig.completeness_error) < 0.02 * abs(ig.value - ig.baseline_value)


# ----------------------------------------------------------------------------- the CLI


def _mask_tokenizer(tmp: Path) -> tuple[Path, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIXTURE_TOKENIZER))
    tok.add_special_tokens(["<|mask|>"])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path, tok.token_to_id("<|mask|>")


def _checkpoints(tmp: Path) -> tuple[str, str]:
    """(a CDLM with a concept bottleneck and <|mask|> in its tokenizer, an autoregressive model without)."""
    from ncpctl.checkpoint import save_model_files

    tok, mask = _mask_tokenizer(tmp)
    model = cdlm(mask=mask, vocab_size=321, bottleneck=BN)
    save_model_files(tmp / "cdlm", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok,
                     extra={"concept_names": ["def", "call", "loop"]})
    ar = build(tiny("llama", vocab_size=320), scale=0.3)
    save_model_files(tmp / "ar", ar, step=0, tokens_seen=0, recipe=None, tokenizer_path=FIXTURE_TOKENIZER)
    return str(tmp / "cdlm"), str(tmp / "ar")


def test_cli_attribute_inputs_writes_json_and_a_heat_map(tmp_path):
    ck, ar = _checkpoints(tmp_path)
    r = run_cli("inspect", ck, "--attribute-inputs", "-p", "def main(argv):", "--target", " return", "--json",
                "--plot", str(tmp_path / "plots"))
    assert r.returncode == 0, r.stderr[-2000:]
    (a,) = json.loads(r.stdout)["attributions"]
    P = a["sequence"]["prompt_tokens"]
    assert a["objective"] == "causal_diffusion" and a["baseline"]["text"] == "<|mask|>" and not a["baseline"]["given"]
    assert a["output"]["kind"] == "logit" and a["output"]["positions"] == [P]
    assert "first [MASK] after the prompt" in a["output"]["definition"] and a["target"] == " return"
    assert [t["position"] for t in a["tokens"]] == list(range(P)) and a["sequence"]["tokens"] % BLOCK == 0
    assert all(isinstance(t["occlusion"], float) and isinstance(t["ig"], float) for t in a["tokens"])
    g = a["ig"]
    assert g["steps"] == 16 and g["sum"] == pytest.approx(sum(t["ig"] for t in a["tokens"]), abs=1e-5)
    assert g["completeness_error"] == pytest.approx(g["sum"] - (g["value"] - g["baseline_value"]), abs=1e-5)
    assert g["value"] == pytest.approx(a["output"]["value"], abs=1e-4)
    assert Path(json.loads(r.stdout)["files"][0]).is_file()
    r = run_cli("inspect", ar, "--attribute-inputs", "-p", "x = 1")  # no [MASK]: the real entry point's one line
    assert r.returncode == 2 and "never trained with a [MASK] token" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_attribute_inputs_concept_blocks_and_refusals(tmp_path):
    """In-process (typer's CliRunner): the human rendering of a concept over blocks, bad input."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    ck, ar = _checkpoints(tmp_path)
    r = CliRunner().invoke(app, ["inspect", ck, "--attribute-inputs", "-p", "for x in y:", "--concept", "loop",
                                 "--unit", "block", "--ig-steps", "0"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "strongest blocks" in r.stdout and "summed over the output block" in r.stdout, r.stdout
    # an autoregressive checkpoint with a baseline of the user's choice: the output at the prompt's last token
    r = CliRunner().invoke(app, ["inspect", ar, "--attribute-inputs", "-p", "x = 1", "--baseline", "<|endoftext|>",
                                 "--ig-steps", "2", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    (a,) = json.loads(r.stdout)["attributions"]
    P = a["sequence"]["prompt_tokens"]
    assert a["objective"] == "next_token" and a["baseline"] == {"id": 0, "text": "<|endoftext|>", "given": True}
    assert a["output"]["positions"] == [P - 1] and a["sequence"]["tokens"] == P and len(a["tokens"]) == P
    for args, why in (
        ((ar, "--attribute-inputs", "-p", "x = 1"), "never trained with a [MASK] token"),
        ((ar, "--attribute-inputs", "-p", "x = 1", "--baseline", "<|nosuch|>"), "is not a token of this"),
        ((ar, "--attribute-inputs", "-p", "x", "--baseline", "<|endoftext|>", "--concept", "c"), "has none"),
        ((ck, "--attribute-inputs", "-p", "x = 1", "--concept", "nosuch"), "no such known concept"),
        ((ck, "-p", "x = 1", "--ig-steps", "4"), "apply with --attribute-inputs"),
        ((ck, "--attribute-inputs", "-p", "x = 1", "--target", ""), "--target is empty"),
    ):
        r = CliRunner().invoke(app, ["inspect", *args, "--json"])
        assert r.exit_code == 2, (args, r.output, r.exception)
        out = json.loads(r.stdout)
        assert out["ok"] is False and len(out["errors"]) == 1 and why in out["errors"][0], (args, out)

"""Steering in ``ncpctl generate`` (ncpctl.interpret.steer): the spec (inline and as a file, units
required), the nominal-logit strength, cached decoding equal to a full recompute under greedy
steering (decoder input, a layer, the logit penalty), per-prompt specs in one batch, the schedule,
a measurable effect, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError
from ncpctl.inference import SamplingParams
from ncpctl.inference.generate import generate_texts
from ncpctl.interpret.steer import (SteerSpec, direction_vector, interventions_for, logit_adjuster, resolve,
                                    specs_from)

from ..conftest import run_cli

torch.set_num_threads(1)
PROMPTS = ["def read_file(path):", "import os\n", "class Foo:\n    def"]
GREEDY = SamplingParams(max_new_tokens=16, greedy=True)


@pytest.fixture(scope="module")
def lm(runs):
    return load_model(runs["concept"])


def test_spec_inline_file_and_units(tmp_path):
    s = SteerSpec.parse("code=2/5,at=decoder.1,strength=6logit,start=2,length=8,penalty=1.5")
    assert s == SteerSpec("code:2/5", 6.0, "logit", "decoder.1", 2, 8, 1.5)
    path = tmp_path / "s.json"
    s.save(path)
    assert json.loads(path.read_text()) == {"direction": "code:2/5", "strength": 6.0, "units": "logit",
                                            "at": "decoder.1", "start": 2, "length": 8, "penalty": 1.5}
    assert SteerSpec.parse(str(path)) == s
    (tmp_path / "s.yaml").write_text("mix: '1:3=0.5+4=0.5'\nstrength: -2norm\nstart: prompt\n")
    assert SteerSpec.parse(str(tmp_path / "s.yaml")) == SteerSpec("mix:1:3=0.5+4=0.5", -2.0, "norm", start="prompt")
    assert specs_from(["code=0/1,strength=1norm", {"code": "0/2", "strength": "3logit"}], "x")[1].units == "logit"
    with pytest.raises(UserError, match="strength 6 has no units: write e.g. 6logit"):
        SteerSpec.parse("code=2/5,strength=6")
    with pytest.raises(UserError, match="unknown key 'strenght'"):
        SteerSpec.parse("code=2/5,strenght=6logit")


def test_logit_units_are_nominal_logits(lm):
    m = lm.model
    r = resolve(m, SteerSpec.parse("code=1/3,strength=7logit"))
    resp = m.lm_head.weight.detach()[: lm.config.vocab_size] @ r.vector  # the LM head read of the vector
    assert float(resp.max()) == pytest.approx(7.0, rel=1e-5)
    n = resolve(m, SteerSpec.parse("code=1/3,strength=2.5norm"))
    assert float(n.vector.norm()) == pytest.approx(2.5, rel=1e-6)
    e = direction_vector(m, n.spec)  # code 3 of segment 1 sits in segment 1's slice only
    ds = lm.config.d_model // lm.config.n_segments
    assert e[:ds].abs().sum() == 0 and e[2 * ds:].abs().sum() == 0 and e[ds : 2 * ds].abs().sum() > 0


def _recompute(lm, prompt_ids, resolved, n):
    """Greedy decoding by full forwards with the same interventions and penalty."""
    ids = list(prompt_ids)
    ivs = interventions_for([resolved], [len(prompt_ids)])
    adjust = logit_adjuster([resolved])
    out = []
    with torch.no_grad():
        for step in range(n):
            logits = lm.model(torch.tensor(ids)[None], interventions=ivs).logits[:, -1, : lm.config.vocab_size]
            if adjust is not None:
                logits = adjust(step, logits)
            t = int(logits.argmax(-1))
            out.append(t)
            ids.append(t)
    return out


@pytest.mark.parametrize("spec", ["code=1/0,strength=10logit,length=6",
                                  "mix=3:0=0.5+5=0.5,strength=8logit,at=decoder.0,start=2",
                                  "code=0/0,strength=-6logit,penalty=3,start=prompt,length=4",
                                  "code=2/3,strength=3logit,at=readout,length=5"])
def test_cached_steered_decoding_equals_full_recompute(lm, spec):
    r = resolve(lm.model, SteerSpec.parse(spec))
    p = SamplingParams(max_new_tokens=10, greedy=True, stop=[])
    got = generate_texts(lm, PROMPTS[:1], p, steer=[[r]])[0].tokens
    ids = lm.tokenizer.encode(PROMPTS[0], add_special_tokens=False).ids
    want = _recompute(lm, ids, [r], len(got))
    assert got == want
    plain = generate_texts(lm, PROMPTS[:1], p)[0].tokens
    assert got != plain  # the steering did something


def test_per_prompt_specs_in_one_batch_and_the_schedule(lm):
    r = resolve(lm.model, SteerSpec.parse("code=1/0,strength=10logit,start=3"))
    plain = generate_texts(lm, PROMPTS, GREEDY)
    alone = generate_texts(lm, PROMPTS[:1], GREEDY, steer=[[r]])[0]
    mixed = generate_texts(lm, PROMPTS, GREEDY, steer=[[r], [], []])
    assert mixed[1].tokens == plain[1].tokens and mixed[2].tokens == plain[2].tokens  # rows untouched
    assert mixed[0].tokens == alone.tokens != plain[0].tokens
    assert alone.tokens[:3] == plain[0].tokens[:3]  # steering starts at generated token 3


def test_steering_raises_the_directions_tokens(lm):
    """The concept score of the benchmark, in small: how often the token a code's direction
    promotes most (through the LM head) appears in greedy continuations, steered vs not."""
    m = lm.model
    base = generate_texts(lm, PROMPTS, GREEDY)
    rises = 0
    for spec in ("code=0/0,strength=10logit", "code=1/0,strength=10logit", "code=3/0,strength=10logit"):
        r = resolve(m, SteerSpec.parse(spec))
        peak = int((m.lm_head.weight.detach()[: lm.config.vocab_size] @ r.vector).argmax())
        steered = generate_texts(lm, PROMPTS, GREEDY, steer=[[r]] * len(PROMPTS))
        rises += sum(c.tokens.count(peak) for c in steered) > sum(c.tokens.count(peak) for c in base)
    assert rises >= 2


def test_cli_steer_save_and_prompts_file(runs, tmp_path):
    spec = tmp_path / "steer.json"
    r = run_cli("generate", str(runs["concept"]), "-p", PROMPTS[0], "-n", "8", "--greedy", "--json",
                "--steer", "code=1/0,strength=10logit,length=4", "--save-steer", str(spec))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert json.loads(spec.read_text())["units"] == "logit" and res["steer"][0][0]["gamma"] > 0
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": PROMPTS[0], "steer": str(spec)}) + "\n" + json.dumps({"prompt": PROMPTS[0]})
                  + "\n")
    r2 = run_cli("generate", str(runs["concept"]), "--prompts-file", str(pf), "-n", "8", "--greedy", "--json")
    a, b = json.loads(r2.stdout)["completions"]
    assert a["text"] == res["completions"][0]["text"] and b["text"] != a["text"]


@pytest.mark.parametrize("spec,message", [
    ("code=0/999,strength=2logit", "code 999 does not exist (16 codes per segment)"),
    ("code=9/0,strength=2logit", "segment 9 does not exist"),
    ("code=0/1,strength=2", "has no units"),
    ("code=0/1,strength=2logit,at=decoder.7", "the decoder has"),
    ("concept:def,strength=2logit", "is not key=value"),
    ("direction=concept:class_def,strength=2logit", "this checkpoint has no concept bottleneck (model.bottleneck)"),
])
def test_bad_specs_are_one_error_line(runs, spec, message):
    r = run_cli("generate", str(runs["concept"]), "-p", "x", "-n", "2", "--steer", spec)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_readout_steering_moves_the_logits_by_exactly_the_strength(lm):
    """At the LM head's input the logit units are exact: the logits move by W_lm . vector, whose
    largest entry is the strength."""
    r = resolve(lm.model, SteerSpec.parse("code=1/3,strength=5logit,at=readout"))
    ids = torch.tensor(lm.tokenizer.encode(PROMPTS[0], add_special_tokens=False).ids)[None]
    (iv,) = interventions_for([[r]], [1])  # a prompt of length 1: positions from 0 on
    with torch.no_grad():
        a = lm.model(ids).logits[0, :, : lm.config.vocab_size]
        b = lm.model(ids, interventions=[iv]).logits[0, :, : lm.config.vocab_size]
    assert float((b - a).max(-1).values.min()) == pytest.approx(5.0, abs=1e-4)
    assert float((b - a).max(-1).values.max()) == pytest.approx(5.0, abs=1e-4)


def test_an_unknown_concept_name_gets_a_suggestion_and_the_whole_list():
    """Issue 28 item 7: no did-you-mean for a steering concept, and the known names were cut at 12 with '...'."""
    from types import SimpleNamespace

    names = [f"concept_{i:02d}" for i in range(14)] + ["exception_handling", "file_io"]
    model = SimpleNamespace(bottleneck=object(), concept=None)
    with pytest.raises(UserError) as e:
        direction_vector(model, SteerSpec("concept:exceptoin_handling", 2.0, "logit"), names)
    (line,) = e.value.problems
    assert "unknown concept 'exceptoin_handling' (did you mean 'exception_handling'?); the 16 known: " in line
    assert line.endswith(", ".join(names)) and "..." not in line

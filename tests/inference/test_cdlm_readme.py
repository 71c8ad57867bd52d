"""Issue 43 item 4: the docs' "Using the released models" commands (docs/released-models.md) for
Steerling's tools (on a Causal Diffusion LM with a concept bottleneck) run verbatim, in process, on a
test checkpoint of that kind: each ``ncpctl`` line of the section's code block, with the run directory
mapped to the checkpoint and ``concept_labels.csv`` to a tiny local concept table."""

from __future__ import annotations

import re
import shlex

import pytest

from ..docs_site import section
from .test_cdlm_steer import cli

SECTION = "Steerling's tools: generation, steering, attribution, concept search"
TABLE = """concept_id,concept_name,concept_description,head,is_steerable
0,function definition,A def statement,known,true
1,exception handling,try / except blocks and raise statements: handling errors,known,true
2,loops,for and while loops,known,true
"""


def readme_commands() -> list[list[str]]:
    body = section(SECTION)  # to the next heading of its level, on whichever page of the docs holds it
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("ncpctl ")]


def test_the_readme_commands_run_on_a_steerling_kind_checkpoint(tmp_path, monkeypatch):
    from .test_attribute_inputs import _checkpoints

    ck, _ = _checkpoints(tmp_path)
    (tmp_path / "concept_labels.csv").write_text(TABLE)
    monkeypatch.chdir(tmp_path)
    commands = readme_commands()
    assert len(commands) == 7 and {c[0] for c in commands} == {"generate", "inspect"}
    outs = []
    for args in commands:
        args = [ck if a == "runs/debug-cdlm-bottleneck" else a for a in args]
        code, out = cli(*[a for a in args if a != "--json"])
        assert code == 0, (args, out)
        outs.append(out)
    plain, found, amplified, suppressed, explained, inputs, text = outs
    assert found["hits"][0]["name"] == "exception handling" and found["hits"][0]["concept_id"] == 1
    for steered, strength in ((amplified, 8.0), (suppressed, -7.0)):
        (spec,) = steered["steer"][0]
        assert spec["direction"] == "concept:exception handling" and spec["strength"] == strength
    assert amplified["completions"][0]["text"] != plain["completions"][0]["text"]
    assert suppressed["steer"][0][0]["penalty"] == 20.0 and suppressed["steer"][0][0]["units"] == "norm"
    (g,) = explained["generations"]
    assert len(g["tokens"]) == 16 and g["summary"]["replay_error"] < 1e-4 and g["chunks"]
    assert {c["name"] for t in g["tokens"] for c in t["concepts"]} <= {"function definition", "exception handling",
                                                                       "loops"}
    (g,) = inputs["generations"]
    assert all(len(t["inputs"]["top"]) > 0 for t in g["tokens"])
    (p,) = text["prompts"]
    assert p["bottleneck"]["attribution_error"] < 1e-4
    assert {c["concept"] for q in p["bottleneck"]["positions"] for c in q["concepts"]} <= \
        {"function definition", "exception handling", "loops"}

"""`ncpctl eval`'s modes take their own flags: two modes at once, or a mode's flag without its mode
(which the command would silently ignore), is one line and exit 2 before any checkpoint is read."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ncpctl.cli.app import app


@pytest.mark.parametrize("args, message", [
    (["--window", "5"], "--window applies only with --compare"),
    (["--level", "0.9"], "--level applies only with --compare"),
    (["--horizon", "4"], "--horizon applies only with --speculative"),
    (["--prompts", "p.jsonl"], "--prompts applies only with --speculative"),
    (["--new-tokens", "8"], "--new-tokens applies only with --speculative"),
    (["--samples", "3"], "--samples applies only with --code-task"),
    (["--against", "ncp_cloze:acc"], "--against applies only with --proxy"),
    (["--compare", "--speculative", "mtp"], "--compare and --speculative are separate modes"),
    (["--proxy", "s.jsonl", "--code-task", "c.jsonl"], "--code-task and --proxy are separate modes"),
])
def test_a_flag_of_another_mode_is_one_line(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["--json", "eval", "no-such-checkpoint", *args])
    assert r.exit_code == 2, (r.output, r.exception)
    out = json.loads(r.stdout)
    assert out["ok"] is False and len(out["errors"]) == 1 and message in out["errors"][0], out


def test_a_modes_own_flags_pass_the_check() -> None:
    r = CliRunner().invoke(app, ["--json", "eval", "no-such-checkpoint", "--speculative", "mtp", "--horizon", "4",
                                 "--new-tokens", "8"])
    assert r.exit_code == 2 and "no such checkpoint" in json.loads(r.stdout)["errors"][0], r.output

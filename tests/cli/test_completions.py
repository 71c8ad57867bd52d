"""completions/ holds bash, zsh and fish scripts generated from the app, and they work."""

from __future__ import annotations

import os
import subprocess

from ncpctl.cli.completions import SHELLS, script

from ..conftest import REPO, ncpctl_cmd


def test_shipped_completions_are_current() -> None:
    for shell, name in SHELLS.items():
        shipped = (REPO / "completions" / name).read_text()
        assert shipped == script(shell), f"completions/{name} is stale: run python -m ncpctl.cli.completions"


def test_completion_protocol_answers_commands_and_options() -> None:
    """What the bash script runs at TAB time returns the real commands and options."""
    env = {**os.environ, "_NCPCTL_COMPLETE": "complete_bash", "COMP_WORDS": "ncpctl to", "COMP_CWORD": "1"}
    out = subprocess.run(ncpctl_cmd(), env=env, capture_output=True, text=True).stdout.split()
    assert out == ["tokenize"]
    env.update(COMP_WORDS="ncpctl tokenize --", COMP_CWORD="2")
    out = subprocess.run(ncpctl_cmd(), env=env, capture_output=True, text=True).stdout.split()
    assert {"--set", "--force", "--json", "--debug"} <= set(out)

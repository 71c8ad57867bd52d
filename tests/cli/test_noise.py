"""Issue 46 item 10, the CLI's own noise: ``--help`` printed ``<bool>`` beside every flag, and
``inspect --attribute-inputs`` cut the prompt in its header with nothing to say so."""

from __future__ import annotations

import io

from rich.console import Console

from ..conftest import run_cli


def test_help_shows_no_type_beside_flags() -> None:
    for args in (["--help"], ["pretrain", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "--json" in r.stdout, r.stderr
        assert "<bool>" not in r.stdout, r.stdout
    assert "KEY.PATH=VALUE" in r.stdout  # an option that takes a value keeps its type


def test_a_cut_prompt_ends_in_an_ellipsis() -> None:
    from ncpctl.interpret.report_human import clip, human_inputs as _human_inputs

    prompt = "def main(argv):\n    parser = argparse.ArgumentParser(description='a long description')\n"
    rows = [{"position": i, "text": "x" * 40 if i == 0 else "y", "occlusion": 0.5 - i / 10, "ig": None} for i in range(3)]
    report = {"files": [], "attributions": [{
        "prompt": prompt, "unit": "token", "tokens": rows, "baseline": {"text": "<|mask|>"},
        "output": {"definition": "logit of", "token_text": " return", "value": 1.25}}]}
    buf = io.StringIO()
    _human_inputs(Console(file=buf, width=200, force_terminal=False), report, 3)
    header = buf.getvalue().splitlines()[0]
    assert header.startswith(repr(prompt[:59] + "…")) and clip(prompt, 500) == prompt
    assert repr("x" * 27 + "…") in buf.getvalue()  # a cell's token text too

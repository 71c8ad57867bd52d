"""The prompt sets of ``ncpctl eval --speculative`` (ncpctl/evaluate/speculative.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ncpctl.errors import UserError


def test_short_validation_documents_name_a_flag_that_exists(monkeypatch, tmp_path):
    """Validation documents no longer than the prompt: the line says so and points at --prompts,
    an option `ncpctl eval` has (not a --prompt-tokens it has not)."""
    from ncpctl.cli.eval import main
    from ncpctl.data import indexed
    from ncpctl.evaluate import offline
    from ncpctl.evaluate.speculative import prompt_sets

    class Short:
        def __init__(self, prefix):
            pass

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.arange(10)

    monkeypatch.setattr(offline, "validation_prefix", lambda ck: (tmp_path / "val", tmp_path / "tok.json"))
    monkeypatch.setattr(indexed, "IndexedDataset", Short)
    with pytest.raises(UserError) as e:
        prompt_sets(SimpleNamespace(path=tmp_path), None, limit=4, prompt_tokens=64)
    text = " ".join([*e.value.problems, e.value.hint or ""])
    flags = set(__import__("re").findall(r"--[a-z][a-z-]+", text))
    import inspect
    import typing

    import typer

    hints = typing.get_type_hints(inspect.unwrap(main), include_extras=True)
    declared = {f for h in hints.values() for a in getattr(h, "__metadata__", ()) if isinstance(a, typer.models.OptionInfo)
                for f in (a.default if isinstance(a.default, str) else "", *(a.param_decls or ())) if f.startswith("--")}
    assert "--speculative" in declared and "--prompts" in declared
    assert flags and flags <= declared, (flags, text)


@pytest.mark.parametrize("line", ['{"prompt": 5}', '{"prompt": null}', '{"prompt": ["a"]}', '{"prompt": "x", "task": {}}'])
def test_a_prompt_that_is_not_text_is_one_line(tmp_path, line):
    """A JSON line whose prompt is not a string is the user's mistake (exit 2, file:line), not an
    internal error from the tokenizer."""
    from tokenizers import Tokenizer, models

    from ncpctl.evaluate.speculative import prompt_sets

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    tok = Tokenizer(models.WordLevel({"fine": 0, "x": 1, "[UNK]": 2}, unk_token="[UNK]"))
    with pytest.raises(UserError, match=r"p\.jsonl:2: "):
        prompt_sets(SimpleNamespace(path=tmp_path, tokenizer=tok), str(f), limit=4, prompt_tokens=8)

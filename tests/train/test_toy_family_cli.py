"""A toy backbone family added through the public API only (tests/model/toy_families.py: ScaleNorm
and a squared-ReLU MLP; named in the recipe by import path, as a user's would be) trains through
the real ``ncpctl`` entry point with the concept path on, and a run killed inside a checkpoint
write resumes bit for bit; ``export`` refuses it by its key (the exported code carries only the
built-in families)."""

from __future__ import annotations

from tests.conftest import REPO

from . import conftest
from .conftest import crash_and_resume, losses, same_weights

PATH = "tests.model.toy_families:ReLU2"
SETS = ["--set", f"model.backbone={PATH}", "--set", "train.max_steps=6", "--set", "train.eval_every=6"]


def test_toy_family_resumes_bit_identically_and_is_not_exported(make_recipe, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(conftest.ENV, "PYTHONPATH", str(REPO))  # the toy is importable in the runs
    ref, crash = crash_and_resume(make_recipe, "relu2", SETS)
    assert losses(crash) == losses(ref) and len(losses(ref)) == 6
    assert same_weights(ref, crash, 6)

    from safetensors.torch import load_file

    names = load_file(str(ref / "checkpoints" / "step_0000006" / "model.safetensors"))
    assert "decoder.0.mlp_norm.g" in names and "decoder.0.mlp_norm.weight" not in names  # the toy's ScaleNorm

    import pytest

    from ncpctl.errors import UserError
    from ncpctl.interop.hf_export import export
    from ncpctl.model.core.config import trust

    trust(PATH)  # as --strategy does
    out = tmp_path / "hf"
    with pytest.raises(UserError, match="model.backbone: 'tests.model.toy_families:ReLU2' is not built into ncpctl"):
        export(ref, out)
    assert not out.exists()

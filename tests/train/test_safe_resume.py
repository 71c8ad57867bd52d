"""Resuming runs no code from the checkpoint (issue 21 item 1), through the real entry point.

DeepSpeed 0.19 opens its own files with ``torch.load(weights_only=False)``; ncpctl routes those
loads through ``ncpctl.safe_load``. One tiny ZeRO-1 run (so that DeepSpeed writes both its model
states and a separate optimizer-states file, with its loss scaler, ZeRO stage enum and fragment
addresses) is shared by every test: a malicious pickle in each file kind is refused with one
line and nothing runs; a clean resume from it is still bit-identical."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from .conftest import RECIPE, copy_run, ncpctl, result, same_weights

ZERO1 = ["--set", "train.max_steps=6", "--set", "deepspeed.zero_stage=1"]


@pytest.fixture(scope="module")
def zero1_run(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> Path:
    """A 6-step ZeRO-1 pretrain run with checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("safe_resume")
    recipe = root / "run.yaml"
    recipe.write_text(RECIPE.format(data=tiny_data, run=root / "run"))
    r = result(ncpctl("pretrain", str(recipe), *ZERO1, "--json"))
    assert r["step"] == 6 and r["zero_stage"] == 1
    return root / "run"


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "rng_rank0.pt"])
def test_a_malicious_checkpoint_file_is_refused_on_resume(name: str, zero1_run: Path, tmp_path: Path) -> None:
    run = copy_run(zero1_run, tmp_path / "run")
    target, marker = run / "checkpoints" / "step_0000006" / name, tmp_path / "ran"
    assert target.is_file()
    torch.save({"state": _Evil(marker)}, target)
    recipe = zero1_run.parent / "run.yaml"
    # The manifest would already reject the changed file (and fall back to step 3); --no-verify
    # skips it, so this tests the second line of defence: the load itself runs nothing.
    proc = ncpctl("pretrain", str(recipe), *ZERO1, "--set", f"run.dir={run}", "--set", "train.resume=auto",
                  "--set", "train.max_steps=9", "--no-verify")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert str(target) in errors[0] and "refused to load" in errors[0]
    assert not marker.exists()  # nothing ran ...
    assert not (run / "checkpoints" / "step_0000009").exists()  # ... not even training


def test_a_clean_zero1_resume_is_bit_identical(zero1_run: Path, tmp_path: Path) -> None:
    """Every DeepSpeed file of a ZeRO-1 checkpoint loads through the allow-list, and the RNG state
    (now tensors) restores exactly: resuming from step 3 gives step 6's weights bit for bit."""
    run = copy_run(zero1_run, tmp_path / "run")
    recipe = zero1_run.parent / "run.yaml"
    r = result(ncpctl("pretrain", str(recipe), *ZERO1, "--set", f"run.dir={run}", "--json",
                      "--set", f"train.resume={run / 'checkpoints' / 'step_0000003'}"))
    assert r["resumed_from"].endswith("step_0000003") and r["step"] == 6 and r["steps_run"] == 3
    assert same_weights(zero1_run, run, 6)

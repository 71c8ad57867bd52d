"""Bad input reaches the user through the real entry point as one `error:` line per problem,
exit code 2, no traceback (issue #2): ids that do not fit the token dtype, a truncated .bin,
an .idx that disagrees with its .bin. (Missing/empty corpora and undecodable files:
tests/data/test_tokenize.py, also through the CLI.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ncpctl.data.indexed import IndexedDatasetWriter

from ..conftest import run_cli


def _errors(r) -> list[str]:
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return [line for line in r.stderr.splitlines() if line.startswith("error: ")]


def test_vocab_that_does_not_fit_the_dtype(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata: {{sources: [builtin:python-stdlib], dtype: uint16}}\n"
                 "tokenizer: {vocab_size: 70000}\n")
    (err,) = _errors(run_cli("tokenize", str(p)))
    assert err == (f"error: {p}: data.dtype: uint16 holds ids below 65536, but the tokenizer has 70000 tokens; "
                   "use int32 or auto")
    assert not (tmp_path / "run").exists()  # reported before any work


def _dataset(prefix: Path) -> None:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.arange(3000) % 500, np.array([1000, 1000, 1000]))


@pytest.mark.parametrize("corrupt,message", [
    (lambda b, i: b.write_bytes(b.read_bytes()[:-1]), "train.bin: truncated .bin (5999 bytes is not a multiple"),
    (lambda b, i: b.write_bytes(b.read_bytes()[:-2]), "train.idx: index does not match train.bin (sequences end at "
                                                      "byte 6000, .bin has 5998 bytes)"),
])
def test_corrupt_dataset_through_pretrain(tmp_path: Path, corrupt, message: str) -> None:
    for split in ("train", "val"):
        _dataset(tmp_path / split)
    corrupt(tmp_path / "train.bin", tmp_path / "train.idx")
    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\n"
                 f"data: {{train_prefix: {tmp_path / 'train'}, val_prefix: {tmp_path / 'val'}}}\n"
                 "tokenizer: {vocab_size: 512}\nmodel: {size: debug, concept: {enabled: true}}\n"
                 "train: {max_steps: 2, micro_batch_size: 2, seq_len: 64}\n")
    r = run_cli("pretrain", str(p), "--json")
    (err,) = _errors(r)
    assert message in err and str(tmp_path) in err
    assert json.loads(r.stdout)["errors"] == [err.removeprefix("error: ")]
    assert not list((tmp_path / "run").glob("checkpoints/*"))


@pytest.mark.parametrize("sets,message", [
    (["model.mtp_depth=0"], "model.mtp_depth: must be >= 1 (null turns MTP off), got 0"),
    (["model.concept.enabled=false"], "model.crc_connections: cross-module residuals connect the encoder, concept "
                                      "and decoder modules: they need the concept path"),
    (["model.irc_normalize=sum"], "model.irc_normalize: Input should be 'none' or 'softmax', got 'sum'"),
    (["deepspeed.zero_stage=3"], "train.optimizer: muon runs at ZeRO stage 0, 1 or 2"),
])
def test_archpreview_design_errors(sets: list[str], message: str) -> None:
    """NCP-ArchPreview's keys (IRC, CRC, MTP, Muon) on its debug recipe: one line, exit 2."""
    from ..conftest import RECIPES

    r = run_cli("profile-kernels", str(RECIPES / "debug-archpreview.yaml"), "--only", "accounting",
                *(x for s in sets for x in ("--set", s)))
    (err,) = _errors(r)
    assert message in err, err


def test_one_layer_modules_with_irc_are_legal() -> None:
    """Table 8's OLMo-3-3B split 8/1/7 has a one-layer concept module: IRC there mixes two states."""
    from ..conftest import RECIPES

    r = run_cli("profile-kernels", str(RECIPES / "debug-archpreview.yaml"), "--only", "accounting", "--json",
                "--set", "model.n_layers=3", "--set", "model.concept.encoder_layers=1",
                "--set", "model.concept.concept_layers=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"]


@pytest.mark.parametrize("concept,message", [
    ("target_ratio: 1", "model.concept.target_ratio: R must be a number > 1 (the target boundary rate is 1/R), got 1"),
    ("boundary_mode: boundary",
     "model.concept.boundary_tau: boundary_mode: boundary compares (1 - cos(h[t-1], h[t]))/2 against tau; none given"),
    ("boundary_threshold: 1.5", "model.concept.boundary_threshold: must be in (0, 1), got 1.5"),
])
def test_bad_dlcm_segmentation_keys(tmp_path: Path, concept: str, message: str) -> None:
    """DLCM's keys (segmentation: dynamic) are checked with the recipe, before any work."""
    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ntokenizer: {{vocab_size: 512}}\n"
                 f"model: {{size: debug, concept: {{enabled: true, segmentation: dynamic, {concept}}}}}\n")
    (err,) = _errors(run_cli("pretrain", str(p)))
    assert err.startswith(f"error: {p}") and message in err
    assert not (tmp_path / "run").exists()

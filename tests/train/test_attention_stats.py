"""``train.attention_stats_every`` through the real ``ncpctl pretrain`` (NCP-ArchPreview Sec. 4.6):
the stability records land at the right steps with a key per attention layer, the plot is
written, training is bit-identical with the diagnostics on or off, and a bad value is one error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ..conftest import RECIPES
from .conftest import metrics, ncpctl, result, weights

LAYERS = ["encoder.0", "concept.layers.0", "concept.layers.1", "decoder.0", "decoder.1", "decoder.2"]
QUANTITIES = ("max_logit", "max_q_norm", "max_k_norm")


def _sets(tiny_data: Path, run_dir: Path, every: int, steps: int = 6) -> list[str]:
    """recipes/debug.yaml on the shared tiny corpus: 2 micro-batches of 2 per step."""
    sets = [f"data.train_prefix={tiny_data / 'train'}", f"data.val_prefix={tiny_data / 'val'}",
            f"tokenizer.path={tiny_data / 'tokenizer.json'}", f"run.dir={run_dir}", f"train.max_steps={steps}",
            "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0",
            "train.eval_batches=1", "train.save_every=0", "train.precision=fp32",
            f"train.attention_stats_every={every}"]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path) -> dict[int, Path]:
    """The debug recipe, 6 steps, with the diagnostics every 3 steps and off."""
    root = tmp_path_factory.mktemp("attention_stats")
    out = {}
    for every in (3, 0):
        run_dir = root / f"every{every}"
        r = result(ncpctl("pretrain", str(RECIPES / "debug.yaml"), "--json", *_sets(tiny_data, run_dir, every)))
        assert r["step"] == 6 and r["nonfinite_steps"] == 0
        out[every] = run_dir
    return out


def test_stability_records_at_step_one_and_every_nth(runs: dict[int, Path]) -> None:
    recs = metrics(runs[3], "stability")
    assert [r["step"] for r in recs] == [1, 3, 6]
    want = {"split", "step", "seconds", *(f"attn/{q}" for q in QUANTITIES),
            *(f"attn/{layer}/{q}" for layer in LAYERS for q in QUANTITIES)}
    for r in recs:
        assert set(r) == want
        assert all(math.isfinite(v) for k, v in r.items() if k.startswith("attn/"))
        assert all(r[f"attn/{layer}/max_q_norm"] > 0 and r[f"attn/{layer}/max_k_norm"] > 0 for layer in LAYERS)
        for q in QUANTITIES:  # the overall value is the max over the layers
            assert r[f"attn/{q}"] == max(r[f"attn/{layer}/{q}"] for layer in LAYERS)
        assert 0 < r["seconds"] < 60
    assert [r["step"] for r in metrics(runs[3])] == list(range(1, 7))  # the train records as ever
    assert (runs[3] / "attention_stats.png").is_file() and (runs[3] / "loss_curves.png").is_file()


def test_training_is_bit_identical_with_the_diagnostics_off(runs: dict[int, Path]) -> None:
    on, off = runs[3], runs[0]
    assert metrics(off, "stability") == [] and not (off / "attention_stats.png").exists()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(on)] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(off)]
    a, b = weights(on / "checkpoints" / "step_0000006"), weights(off / "checkpoints" / "step_0000006")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_archpreview_design_logs_windows_and_the_mtp_layer(tiny_data: Path, tmp_path: Path) -> None:
    """debug-archpreview (llama, window 32 < seq_len 64, layer-wise QK-norm, IRC + CRC, MTP, Muon):
    every attention layer, the MTP depth's included, at every step."""
    sets = _sets(tiny_data, tmp_path / "run", every=1, steps=2)
    r = result(ncpctl("pretrain", str(RECIPES / "debug-archpreview.yaml"), "--json", *sets))
    assert r["step"] == 2
    recs = metrics(tmp_path / "run", "stability")
    assert [x["step"] for x in recs] == [1, 2]
    layers = {k.split("/")[1] for k in recs[0] if k.count("/") == 2}
    assert layers == {"encoder.0", "encoder.1", "concept.layers.0", "decoder.0", "decoder.1", "mtp.depths.0.layer.0"}
    assert all(math.isfinite(v) for x in recs for k, v in x.items() if k.startswith("attn/"))


def test_negative_every_is_one_error(tiny_data: Path, tmp_path: Path) -> None:
    proc = ncpctl("pretrain", str(RECIPES / "debug.yaml"), *_sets(tiny_data, tmp_path / "bad", every=-1))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.attention_stats_every" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "bad" / "metrics.jsonl").exists()


def check_two_ranks_log_the_max_over_both_ranks(recipe: Path, run_dir: Path) -> None:
    """Two ranks under the launcher: each computes the diagnostics on its own first micro-batch and
    the record is their max. At step 1 (the seeded init weights) with a global batch of 8, shards
    of 4 and micro-batches of 2, those are windows 0-1 (rank 0) and 4-5 (rank 1): recomputed here.
    Run by tests/train/test_parity.py's ZeRO-2 case (``train.attention_stats_every=1`` on its
    two-rank launch), which would otherwise start the launcher a second time for the same run."""
    import torch

    from ncpctl.data.indexed import IndexedDataset
    from ncpctl.data.windows import WindowLoader
    from ncpctl.model.core.model import NCPModel
    from ncpctl.recipe import load_recipe

    recs = metrics(run_dir, "stability")
    assert [r["step"] for r in recs] == [r["step"] for r in metrics(run_dir)]  # every step
    rec = recs[0]
    assert rec["step"] == 1
    rc = load_recipe(recipe)
    torch.manual_seed(rc.train.seed)  # as the loop seeds before building the model
    model = NCPModel(rc.model_config)
    loader = WindowLoader(IndexedDataset(rc.data.train_prefix), rc.seq_len, rc.global_batch_size, seed=rc.train.seed)
    batch = torch.from_numpy(next(loader))  # (8, T+1): the global batch of step 1
    ranks = [model.attention_stats(b[:, :-1], b[:, 1:]) for b in (batch[0:2], batch[4:6])]
    keys = [k for k in rec if k.startswith("attn/")]
    assert keys == list(ranks[0])
    for k in keys:
        assert rec[k] == pytest.approx(max(float(s[k]) for s in ranks), rel=1e-5), k
    assert any(float(ranks[1][k]) > float(ranks[0][k]) * (1 + 1e-4) for k in keys)  # not rank 0's alone

"""recipes/adapt/: NCP-ArchPreview Sec. 5.1's three adaptations of one checkpoint (VQ, LoRA, full
fine-tuning) load against stand-ins of their files, differ from their common file only in what
makes them that arm, and train the parameter counts their comments give (meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.model.accounting import count_parameters
from ncpctl.recipe import load_recipe
from ncpctl.train.loop import make_stage

from ..conftest import RECIPES
from .test_paper_recipes import _diff, _stand_ins

ADAPT = RECIPES / "adapt"
COUNTS = {"vq": ("adapt-vq", 17_301_504), "lora": ("midtrain", 18_421_760), "full": ("midtrain", 8_935_055_360)}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The data, the 100,278-token tokenizer and a checkpoint directory (its ncpctl.json only:
    make_stage resolves it; the model comes from the recipe)."""
    root = tmp_path_factory.mktemp("adapt")
    ckpt = root / "stage1" / "checkpoints" / "step_0001000"
    ckpt.mkdir(parents=True)
    (ckpt / "ncpctl.json").write_text(json.dumps({"format": "ncpctl-checkpoint"}))
    return [*_stand_ins(root / "files", 100278, "int32"), f"train.init_from={ckpt}"]


def test_the_family_is_common_plus_three_arms() -> None:
    assert {p.stem for p in ADAPT.glob("*.yaml")} == {"common", *COUNTS}


@pytest.mark.parametrize("arm", list(COUNTS))
def test_arm_loads_and_trains_its_count(arm: str, stand_ins: list[str]) -> None:
    pytest.importorskip("peft")
    r = load_recipe(ADAPT / f"{arm}.yaml", stand_ins)
    cfg = r.model_config
    assert cfg.name == "ncp-archpreview-8.9b" and cfg.concept.codebook == "learned"
    assert r.seq_len == 8192 and load_recipe(ADAPT / f"{arm}.yaml", stand_ins, world_size=8).grad_accum_steps == 8
    command, count = COUNTS[arm]
    stage = make_stage(r, command)
    assert (stage.freeze is None) == (arm == "full")
    assert count_parameters(cfg, stage.freeze).trainable == count


def test_arms_differ_only_in_their_method(stand_ins: list[str]) -> None:
    got = {n: load_recipe(ADAPT / f"{n}.yaml", stand_ins).to_dict() for n in ("common", *COUNTS)}
    assert _diff(got["common"], got["vq"]) == set()
    assert _diff(got["common"], got["lora"]) == {f"train.lora.{k}" for k in ("rank", "alpha", "dropout", "targets")}
    assert got["lora"]["train"]["lora"] == {"rank": 7, "alpha": 14, "dropout": 0.0,
                                            "targets": ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]}
    assert _diff(got["common"], got["full"]) == {"train.lr", "train.min_lr", "deepspeed.zero_stage"}


def test_bench_picks_the_rank_the_recipe_gives() -> None:
    """bench/adapt.py's LoRA arm uses the same rule as lora.yaml: the rank whose count is closest
    to adapt-vq's (at 8.9B: rank 7; at the bench's CPU shape its own rank)."""
    import importlib.util

    pytest.importorskip("peft")
    from ncpctl.model.config import build_config

    spec = importlib.util.spec_from_file_location("bench_adapt", RECIPES.parent / "bench" / "adapt.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.lora_rank(build_config("ncp-archpreview-8.9b", concept=dict(codebook="learned"))) == (7, 18_421_760)
    rank, count = bench.lora_rank(bench._config())
    assert (rank, count) == (7, 287_840)

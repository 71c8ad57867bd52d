"""recipes/adapt/: NCP-ArchPreview Sec. 5.1's three adaptations of one checkpoint (VQ, LoRA, full
fine-tuning). They take the model from the checkpoint they start from (train.init_from): at 8.9B
they load against stand-ins of their files and of a Stage-1 checkpoint's metadata, differ from
their common file only in what makes them that arm, and train the parameter counts their comments
give (meta device); as shipped, sized down with --set only, they train 5 steps each from a real
tiny Stage-1 checkpoint of the ArchPreview design (recipes/debug-archpreview.yaml)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ncpctl.model.accounting.flops import count_parameters
from ncpctl.recipe import load_recipe
from ncpctl.train.stages import make_stage
from tests.train.conftest import ENV, tiny_data, weights  # noqa: F401 - the shared tokenized test corpus

from ..conftest import RECIPES, ncpctl_cmd
from ._archpreview import OLMO3_VOCAB
from .test_paper_recipes import _diff, _stand_ins

ADAPT = RECIPES / "adapt"
# at 8.9B as ../ncp-archpreview-8.9b.yaml ships it (IRC + CRC, learned codes): full = every weight
COUNTS = {"vq": ("adapt-vq", 17_301_504), "lora": ("midtrain", 18_421_760), "full": ("midtrain", 8_946_089_476)}


@pytest.fixture(scope="module")
def stage1_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The model config a checkpoint of ../ncp-archpreview-8.9b.yaml records."""
    sets = _stand_ins(tmp_path_factory.mktemp("dolma3"), OLMO3_VOCAB, "int32")
    return load_recipe(RECIPES / "ncp-archpreview-8.9b.yaml", sets).model_config.to_dict()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory, stage1_config: dict) -> list[str]:
    """The data, the 100,278-token tokenizer and a Stage-1 checkpoint directory holding its
    ncpctl.json only (no weights: the recipe loader reads the model from it)."""
    root = tmp_path_factory.mktemp("adapt")
    ckpt = root / "stage1" / "checkpoints" / "step_0001000"
    ckpt.mkdir(parents=True)
    (ckpt / "ncpctl.json").write_text(json.dumps({"format": "ncpctl-checkpoint", "model_config": stage1_config}))
    return [*_stand_ins(root / "files", 100278, "int32"), f"train.init_from={ckpt}"]


def test_the_family_is_common_plus_three_arms() -> None:
    assert {p.stem for p in ADAPT.glob("*.yaml")} == {"common", *COUNTS}


@pytest.mark.parametrize("arm", list(COUNTS))
def test_arm_loads_and_trains_its_count(arm: str, stand_ins: list[str], stage1_config: dict) -> None:
    pytest.importorskip("peft")
    r = load_recipe(ADAPT / f"{arm}.yaml", stand_ins)
    cfg = r.model_config
    assert cfg.to_dict() == stage1_config  # the checkpoint's design: post-norm, IRC + CRC, learned codes
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
    from ncpctl.model.core.config import build_config

    spec = importlib.util.spec_from_file_location("bench_adapt", RECIPES.parent / "bench" / "adapt.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.lora_rank(build_config("ncp-archpreview-8.9b", concept=dict(codebook="learned"))) == (7, 18_421_760)
    rank, count = bench.lora_rank(bench._config())
    assert (rank, count) == (7, 287_840)


# ----------------------------------------------------------------------------- from a real checkpoint


def _run(command: str, recipe: Path, sets: list[str]) -> dict:
    """``ncpctl COMMAND RECIPE --json --set ...`` (the real entry point); its summary."""
    proc = subprocess.run([*ncpctl_cmd(), command, str(recipe), "--json", *(f"--set={s}" for s in sets)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stage1(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A real Stage-1 checkpoint of the ArchPreview design as shipped (post-norm, IRC + CRC,
    learned codes, Eq. 21/22 losses): 2 steps of recipes/debug-archpreview.yaml at a tiny size."""
    run = tmp_path_factory.mktemp("stage1") / "run"
    res = _run("pretrain", RECIPES / "debug-archpreview.yaml", [
        f"data.train_prefix={tiny_data / 'train'}", f"data.val_prefix={tiny_data / 'val'}",
        f"tokenizer.path={tiny_data / 'tokenizer.json'}", f"run.dir={run}", "train.max_steps=2", "train.seq_len=32",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_every=0", "train.eval_batches=1",
        "train.save_every=0", "train.precision=fp32"])
    assert res["step"] == 2
    return Path(res["checkpoint"])


# what each arm trains, by weight name: the rest stays bit-identical to Stage 1's
TRAINED = {"vq": lambda k: k in ("concept.heads.weight", "concept.codebook.base"),
           "lora": lambda k: k.endswith(("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")),
           "full": lambda k: True}


@pytest.mark.parametrize("arm", list(COUNTS))
def test_arm_trains_from_a_real_stage1_checkpoint(arm: str, stage1: Path, tiny_data: Path,  # noqa: F811
                                                  tmp_path: Path) -> None:
    """The shipped arm, sized down with --set only (sequence, batch, steps, precision, ZeRO stage,
    data), trains 5 steps from the Stage-1 checkpoint: the model is the checkpoint's, and only what
    the arm trains moves."""
    if arm == "lora":
        pytest.importorskip("peft")
    command = COUNTS[arm][0]
    res = _run(command, ADAPT / f"{arm}.yaml", [
        f"train.init_from={stage1}", f"data.train_prefix={tiny_data / 'train'}",
        f"data.val_prefix={tiny_data / 'val'}", f"tokenizer.path={stage1 / 'tokenizer.json'}",
        f"run.dir={tmp_path / arm}", "train.max_steps=5", "train.seq_len=32", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.precision=fp32", "deepspeed.zero_stage=0"])
    assert (res["step"], res["steps_run"], res["nonfinite_steps"]) == (5, 5, 0)
    before, meta = json.loads((stage1 / "ncpctl.json").read_text()), json.loads((Path(res["checkpoint"]) /
                                                                                "ncpctl.json").read_text())
    assert meta["model_config"] == before["model_config"]
    cfg = meta["model_config"]
    assert (cfg["norm_placement"], cfg["residual"], cfg["concept"]["codebook"], cfg["concept"]["commitment"]) == \
        ("post", "irc", "learned", 0.0) and len(cfg["crc_connections"]) == 3
    w0, w1 = weights(stage1), weights(Path(res["checkpoint"]))
    assert w0.keys() == w1.keys()
    moved = {k for k in w0 if not (w0[k] == w1[k]).all()}
    assert moved and all(TRAINED[arm](k) for k in moved), sorted(moved)
    if arm == "vq":
        assert moved == {"concept.heads.weight", "concept.codebook.base"}

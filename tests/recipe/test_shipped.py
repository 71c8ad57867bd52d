"""Every shipped recipe loads and validates; the Pythia trio differs in one key each. The paper's
other recipes (GPT-2, Llama-3.1-8B, recipes/ablations/) are tested in test_paper_recipes.py, the
NCP-ArchPreview ones (recipes/ncp-archpreview-*, debug-archpreview, recipes/archpreview/) in
test_archpreview_recipes.py, the DLCM ones (recipes/dlcm-*, recipes/dlcm/) in test_dlcm_recipes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.data.indexed import IndexedDatasetWriter
from ncpctl.recipe import load_recipe

from ..conftest import RECIPES
from ._archpreview import TOP as ARCHPREVIEW_RECIPES
from .test_dlcm_recipes import TOP as DLCM_RECIPES
from .test_paper_recipes import PAPER_RECIPES, PPL_SETS, eval_leaves

PYTHIA = ["pythia70m", "pythia160m", "pythia160m-base", "pythia160m-pm", "pythia410m"]


@pytest.fixture(scope="module")
def pile_like(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Stand-ins for the files the Pythia recipes point at: a Megatron dataset and a
    tokenizer.json with Pythia's 50,277 tokens."""
    from tokenizers import Tokenizer, models

    root = tmp_path_factory.mktemp("pile")
    for split in ("train", "val"):
        with IndexedDatasetWriter(root / split, "uint16") as w:
            w.add_document([1, 2, 3, 0])
    vocab = {f"t{i}": i for i in range(50277)}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(root / "tokenizer.json"))
    return [f"data.train_prefix={root / 'train'}", f"data.val_prefix={root / 'val'}",
            f"tokenizer.path={root / 'tokenizer.json'}"]


def test_every_recipe_file_is_covered() -> None:
    shipped = {p.stem for p in RECIPES.glob("*.yaml")}
    assert shipped == {"debug", "debug-bottleneck", "debug-bottleneck-steer", "debug-dlcm", "debug-cdlm", "debug-cdlm-bottleneck",
                       "debug-mix",
                       "steerling-8b", "steerling-8b-midtrain", "pythia-common", *PYTHIA, *PAPER_RECIPES,
                       *ARCHPREVIEW_RECIPES, *DLCM_RECIPES}


def test_debug_bottleneck_recipe() -> None:
    """Steerling's bottleneck scaled down, on the built-in corpus labelled by the ast labeller
    (trained through the CLI in tests/train/test_bottleneck_training.py)."""
    from ncpctl.data.labels import PYTHON_CONCEPTS

    r = load_recipe(RECIPES / "debug-bottleneck.yaml", need_sources=True)
    b = r.model_config.bottleneck
    assert r.data.labels == "python-ast" and b.enabled and b.concepts == len(PYTHON_CONCEPTS)
    assert (b.chunk, b.dropout, b.teacher_forcing_start, b.teacher_forcing_end) == (16, 0.1, 1.0, 0.5)
    assert r.model_config.bottleneck_unknown == 3 * b.concepts and r.run_dir == Path("runs/debug-bottleneck")


def test_the_steering_stage_recipe_continues_debug_bottleneck(tmp_path: Path, monkeypatch) -> None:
    """Steerling's mid-training changes (dropout 0.3, teacher forcing 0) and the steering terms, on
    debug-bottleneck's data and weights; only training terms differ from its model (STAGE_KEYS).
    Its data paths are relative to the working directory: stand-ins for debug-bottleneck's run there."""
    from ncpctl.train.checkpoint import STAGE_KEYS, config_differences

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "runs" / "debug-bottleneck" / "data"
    data.mkdir(parents=True)
    for split in ("train", "val"):
        with IndexedDatasetWriter(data / split, "uint16") as w:
            w.add_document([1, 2, 3, 0])
    base = load_recipe(RECIPES / "debug-bottleneck.yaml")
    r = load_recipe(RECIPES / "debug-bottleneck-steer.yaml")
    b = r.model_config.bottleneck
    assert (b.dropout, b.teacher_forcing_start, b.teacher_forcing_end) == (0.3, 0.0, 0.0)
    assert (b.respond_weight, b.express_weight, b.steer_at, b.steer_strength) == (0.0, 1.0, "readout", 2.0)
    assert r.train.init_from == "runs/debug-bottleneck" and r.data.train_prefix == "runs/debug-bottleneck/data/train"
    assert r.train.max_steps == 90  # Steerling's steering stages: 90 steps each
    diffs = config_differences(base.model_config.to_dict(), r.model_config.to_dict())
    assert diffs and all(d.split(":")[0].removeprefix("model.") in STAGE_KEYS for d in diffs)


def test_debug_recipe() -> None:
    r = load_recipe(RECIPES / "debug.yaml", need_sources=True)
    cfg = r.model_config
    assert r.run_dir == Path("runs/debug")
    assert cfg.concept.enabled and cfg.name == "debug" and cfg.vocab_size == r.tokenizer.vocab_size
    assert r.seq_len == 256 and r.global_batch_size == 8


def test_debug_mix_recipe() -> None:
    """The debug model on a weighted mixture of three built-in corpora (run once: docs/data.md)."""
    r = load_recipe(RECIPES / "debug-mix.yaml", need_sources=True)
    assert [(c.name, c.weight) for c in r.data.mix] == [("pydantic", 0.5), ("cli", 0.3), ("networkx", 0.2)]
    assert not r.data.sources and all(c.sources and c.prefix is None for c in r.data.mix)
    assert r.run_dir == Path("runs/debug-mix") and r.model_config.name == "debug"


def test_debug_dlcm_recipe() -> None:
    """DLCM at the debug size: dynamic boundaries, cross-attention, CE + lambda L_aux only."""
    r = load_recipe(RECIPES / "debug-dlcm.yaml", need_sources=True)
    c = r.model_config.concept
    assert (c.segmentation, c.coupling, c.cross_attention, c.boundary_mode) == (
        "dynamic", "cross_attention", "per_concept", "predictor")
    assert (c.target_ratio, c.balance, c.balance_weight, c.ncp_weight, c.vq_weight) == (4, "global", 0.03, 0, 0)
    assert r.run_dir == Path("runs/debug-dlcm") and r.seq_len == 256
    assert (r.model_config.concept_cfg.d_model, r.model_config.concept_cfg.n_heads) == (128, 8)


@pytest.mark.parametrize("name", PYTHIA)
def test_pythia_recipes_validate(name: str, pile_like: list[str]) -> None:
    r = load_recipe(RECIPES / f"{name}.yaml", pile_like)
    cfg = r.model_config
    assert cfg.vocab_size == 50277 and cfg.padded_vocab_size == 50304  # Pythia's padding
    assert r.seq_len == 2048 and r.global_batch_size == 1024 and r.grad_accum_steps == 128
    assert r.deepspeed.zero_stage == 1 and r.train.precision == "bf16"
    assert r.run_dir == Path("runs") / name
    assert cfg.name == {"pythia70m": "pythia-70m", "pythia410m": "pythia-410m"}.get(name, "pythia-160m")
    # on 8 ranks the same recipe needs 16 micro-batches of 8 per step
    assert load_recipe(RECIPES / f"{name}.yaml", pile_like, world_size=8).grad_accum_steps == 16


# ConceptLM's peak learning rates for its Pythia backbones (App. B; the notes' Sec. 3.1 lists
# 1e-3, 6e-4, 4e-4 for 70M, 160M, 410M), cosine down to 10%
PAPER_LR = {"pythia-70m": 1e-3, "pythia-160m": 6e-4, "pythia-410m": 4e-4}


@pytest.mark.parametrize("name", PYTHIA)
def test_pythia_recipes_use_the_papers_lr(name: str, pile_like: list[str]) -> None:
    r = load_recipe(RECIPES / f"{name}.yaml", pile_like)
    lr = PAPER_LR[r.model_config.name]
    assert r.train.lr == lr and r.train.min_lr == pytest.approx(lr / 10)


def test_pythia_recipes_average_the_piles_validation_set(pile_like: list[str]) -> None:
    """ConceptLM's four perplexity sets, the training-distribution one (conceptlm_val_ppl: the
    recipe's data.val_prefix) being the Pile's validation set, never Pile training documents."""
    import yaml

    data = yaml.safe_load((RECIPES / "pythia-common.yaml").read_text())["data"]
    assert data["val_prefix"] == "/data/pile/pile_val_text_document" != data["train_prefix"]
    for path in [*(RECIPES / f"{n}.yaml" for n in PYTHIA), RECIPES / "ablations" / "pythia160m-30b.yaml"]:
        assert "val_prefix" not in (yaml.safe_load(path.read_text()).get("data") or {}), path
        leaves = eval_leaves(load_recipe(path, pile_like))
        assert PPL_SETS <= leaves and not any(t.startswith("pile") for t in leaves), path


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v)
    return out


def test_three_way_comparison_differs_in_one_key(pile_like: list[str]) -> None:
    """ConceptLM vs base vs parameter-matched: one model key apart (plus the run's name)."""
    flat = {n: _flat(load_recipe(RECIPES / f"{n}.yaml", pile_like).to_dict())
            for n in ("pythia160m", "pythia160m-base", "pythia160m-pm")}

    def diff(a: str, b: str) -> set[str]:
        return {k for k in flat[a] if flat[a][k] != flat[b][k]} - {"run.dir", "run.name"}

    assert diff("pythia160m", "pythia160m-base") == {"model.concept.enabled"}
    assert diff("pythia160m-base", "pythia160m-pm") == {"model.extra_token_layers"}

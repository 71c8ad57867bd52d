"""Issue 23 (the Causal Diffusion LM, first step): recipes/debug-cdlm.yaml loads; ``tokenize`` adds
the [MASK] token after EOD and records its id in meta.json, which the recipe loader reads into
``model.diffusion.mask_id``; the bad inputs (a tokenizer without [MASK], a block size that does not
divide train.seq_len, data tokenized without it) are refused by key (the CLI prints them as one
line, exit 2: a CDLM checkpoint given to generate is the CLI case, tests/train/test_cdlm_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from ncpctl.data.tokenize import tokenize
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe
from ncpctl.train.data import check_special_tokens

from ..conftest import RECIPES

CDLM = "model: {size: debug, objective: causal_diffusion, diffusion: {block_size: 16}}\n"


def _recipe(tmp_path: Path, text_corpus: Path, extra: str = "") -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(f"run: {{dir: {tmp_path / 'run'}}}\ndata: {{sources: ['{text_corpus}/*.txt'], val_fraction: 0.2}}\n"
                 f"tokenizer: {{vocab_size: 300}}\n{CDLM}train: {{seq_len: 64, micro_batch_size: 2}}\n{extra}")
    return p


def test_debug_cdlm_recipe(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no data tokenized yet: the BPE's order puts [MASK] after EOD
    r = load_recipe(RECIPES / "debug-cdlm.yaml", need_sources=True)
    cfg = r.model_config
    assert cfg.objective == "causal_diffusion" and not cfg.concept.enabled
    assert (cfg.diffusion.block_size, cfg.diffusion.mask_id, cfg.diffusion.schedule) == (16, 1, "uniform")
    assert r.seq_len == 128 and r.run_dir == Path("runs/debug-cdlm")


def test_debug_cdlm_bottleneck_recipe(tmp_path: Path, monkeypatch) -> None:
    """debug-cdlm with debug-bottleneck's bottleneck (python-ast labels), label chunk = diffusion block."""
    from ncpctl.data.labels import PYTHON_CONCEPTS

    monkeypatch.chdir(tmp_path)
    r = load_recipe(RECIPES / "debug-cdlm-bottleneck.yaml", need_sources=True)
    cdlm = load_recipe(RECIPES / "debug-cdlm.yaml", need_sources=True)
    cfg, b = r.model_config, r.model_config.bottleneck
    assert cfg.objective == "causal_diffusion" and cfg.diffusion == cdlm.model_config.diffusion
    assert r.data.labels == "python-ast" and b.enabled and b.concepts == len(PYTHON_CONCEPTS)
    assert (b.chunk, cfg.diffusion.block_size, b.teacher_forcing_start, b.teacher_forcing_end) == (16, 16, 1.0, 0.5)
    assert (r.seq_len, r.train.max_steps) == (cdlm.seq_len, cdlm.train.max_steps)
    assert r.run_dir == Path("runs/debug-cdlm-bottleneck")


def test_tokenize_adds_the_mask_token_and_the_loader_reads_its_id(tmp_path: Path, text_corpus: Path) -> None:
    meta = tokenize(load_recipe(_recipe(tmp_path, text_corpus), need_sources=True))
    data = tmp_path / "run" / "data"
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    assert tok.token_to_id("<|mask|>") == 1 and meta["tokenizer"]["special_tokens"] == {"<|mask|>": 1}
    assert json.loads((data / "meta.json").read_text())["tokenizer"]["special_tokens"] == {"<|mask|>": 1}
    assert tok.encode("a <|mask|> b").ids.count(1) == 1  # one token, never split
    r = load_recipe(_recipe(tmp_path, text_corpus))
    assert r.model_config.diffusion.mask_id == 1
    check_special_tokens(r.model_config, meta, data / "meta.json")  # the data and the model agree
    plain = {"tokenizer": {k: v for k, v in meta["tokenizer"].items() if k != "special_tokens"}}
    with pytest.raises(UserError, match="has no '<|mask|>' token, but model.diffusion.mask_id is 1"):
        check_special_tokens(r.model_config, plain, data / "meta.json")  # data tokenized for another objective


def _word_level(path: Path, mask: bool) -> Path:
    vocab = {"<|endoftext|>": 0, **({"<|mask|>": 7} if mask else {}), **{f"t{i}": i + 10 for i in range(50)}}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(path))
    return path


def test_a_tokenizer_without_the_mask_token_is_refused(tmp_path: Path, text_corpus: Path) -> None:
    p = _recipe(tmp_path, text_corpus)
    with_mask = _word_level(tmp_path / "with.json", True)
    assert load_recipe(p, [f"tokenizer.path={with_mask}"]).model_config.diffusion.mask_id == 7
    without = _word_level(tmp_path / "without.json", False)
    with pytest.raises(UserError) as e:
        load_recipe(p, [f"tokenizer.path={without}"])
    assert "tokenizer.path" in str(e.value) and "has no '<|mask|>' token" in str(e.value)
    (tmp_path / "broken.json").write_text("{not json")
    for bad, why in (("broken.json", "not a valid tokenizer.json"), ("missing.json", "file not found")):
        with pytest.raises(UserError) as e:  # reported once, as without the objective
            load_recipe(p, [f"tokenizer.path={tmp_path / bad}"])
        assert why in str(e.value) and "<|mask|>" not in str(e.value)


def test_a_block_size_that_does_not_divide_seq_len_is_refused(tmp_path: Path, text_corpus: Path) -> None:
    with pytest.raises(UserError) as e:
        load_recipe(_recipe(tmp_path, text_corpus), ["train.seq_len=56"])
    assert "train.seq_len" in str(e.value) and "multiple of model.diffusion.block_size=16" in str(e.value)



def test_steerling_8b_recipe_has_the_public_configurations_shape(tmp_path: Path) -> None:
    """recipes/steerling-8b.yaml against guidelabs/steerling configs/causal_diffusion.py (GQA 32/4,
    RoPE base 5e5, post-norm RMSNorm eps 1e-5, per-head QK-norm, clip_qkv 10, context 4096, block
    64, SwiGLU 4x, tied embeddings, no biases) and its tokenizer (<|mask|> = 100280), with the concept
    bottleneck on (issue 23 item 5): ~8.06B backbone + 0.33B concept module."""
    from ncpctl.data.indexed import IndexedDatasetWriter
    from ncpctl.model.accounting.params import count_parameters

    for split in ("train", "val"):
        with IndexedDatasetWriter(tmp_path / split, "int32") as w:
            w.add_document([1, 2, 3, 0])
    vocab = {f"t{i}": i for i in range(100280)} | {"<|mask|>": 100280}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(tmp_path / "tok.json"))
    r = load_recipe(RECIPES / "steerling-8b.yaml", [f"data.train_prefix={tmp_path / 'train'}",
                                                     f"data.val_prefix={tmp_path / 'val'}",
                                                     f"tokenizer.path={tmp_path / 'tok.json'}"])
    c = r.model_config
    shape = (c.backbone, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.max_seq_len, c.rope_base,
             c.norm_eps, c.norm_placement, c.qk_norm, c.clip_qkv, c.bias, c.tie_embeddings, c.rotary_pct)
    assert shape == ("llama", 4096, 32, 32, 4, 16384, 4096, 5e5, 1e-5, "post", "head", 10.0, False, True, 1.0)
    d = c.diffusion
    assert (c.objective, d.block_size, d.mask_id, d.schedule, r.seq_len) == ("causal_diffusion", 64, 100280,
                                                                             "gaussian", 4096)
    assert (c.bottleneck.concepts, c.bottleneck.unknown, c.bottleneck.rank) == (33732, 101196, 256)
    assert c.bottleneck.enabled and c.bottleneck.chunk == d.block_size
    # issue 43: their released ConceptHead (steerling 0.2.0) has no biases and clamps its logits at 15
    assert (c.bottleneck.bias, c.bottleneck.logit_clamp) == (False, 15.0)
    assert 8.3e9 < count_parameters(c).total < 8.5e9


def test_the_four_families_differ_only_in_objective_and_concept_module(tmp_path: Path, monkeypatch) -> None:
    """recipes/families/: AR and CDLM, each with and without the bottleneck (Steerling Sec. 8), on the
    same data, shape and budget: the resolved recipes differ in model.objective and model.bottleneck
    (and the [MASK] id a CDLM reads from its tokenizer) only."""
    from .test_paper_recipes import _diff

    monkeypatch.chdir(tmp_path)  # no data tokenized yet
    fam = RECIPES / "families"
    assert {p.stem for p in fam.glob("*.yaml")} == {"ar", "ar-concepts", "cdlm", "cdlm-concepts"}
    got = {f: load_recipe(fam / f"{f}.yaml", need_sources=True) for f in ("ar", "ar-concepts", "cdlm", "cdlm-concepts")}
    d = {f: r.to_dict() for f, r in got.items()}
    assert _diff(d["ar"], d["cdlm"]) <= {"model.objective", "model.diffusion.mask_id"}
    assert _diff(d["ar-concepts"], d["cdlm-concepts"]) <= {"model.objective", "model.diffusion.mask_id"}
    assert {k.split(".")[1] for k in _diff(d["ar"], d["ar-concepts"])} == {"bottleneck"}
    assert {k.split(".")[1] for k in _diff(d["cdlm"], d["cdlm-concepts"])} == {"bottleneck"}
    assert [got[f].model_config.objective for f in got] == ["next_token"] * 2 + ["causal_diffusion"] * 2
    assert len({r.run_dir for r in got.values()}) == 4 and all(r.data.labels == "python-ast" for r in got.values())


def _resolved_steerling(tmp_path: Path):
    """recipes/steerling-8b.yaml and its mid-training, resolved on stand-in data and tokenizer."""
    from ncpctl.data.indexed import IndexedDatasetWriter

    vocab = {f"t{i}": i for i in range(100280)} | {"<|mask|>": 100280}
    Tokenizer(models.WordLevel(vocab, unk_token="t1")).save(str(tmp_path / "tok.json"))
    (tmp_path / "pre").mkdir()
    for split in ("train", "val"):
        with IndexedDatasetWriter(tmp_path / split, "int32") as w:
            w.add_document([1, 2, 3, 0])
    sets = [f"tokenizer.path={tmp_path / 'tok.json'}"]
    base = load_recipe(RECIPES / "steerling-8b.yaml", [*sets, f"data.train_prefix={tmp_path / 'train'}",
                                                       f"data.val_prefix={tmp_path / 'val'}"])
    mid = load_recipe(RECIPES / "steerling-8b-midtrain.yaml", [*sets, f"train.init_from={tmp_path / 'pre'}"])
    return base, mid


def test_steerling_budget_and_sparsity_follow_the_notes(tmp_path: Path) -> None:
    """Issue 41 items 1-2: pre-training trains on the notes' ~1.2T tokens (not 105B) with the
    Gaussian curriculum's move spanning it, its concept heads dense; mid-training (150B tokens) is
    shorter and turns top-k on (known 32, unknown 128)."""
    base, mid = _resolved_steerling(tmp_path)
    tokens = base.train.max_steps * base.global_batch_size * base.seq_len
    assert tokens >= 1.1e12
    assert base.model_config.diffusion.gaussian_steps == base.train.max_steps
    assert (base.model_config.bottleneck.top_k_known, base.model_config.bottleneck.top_k_unknown) == (None, None)
    assert (mid.model_config.bottleneck.top_k_known, mid.model_config.bottleneck.top_k_unknown) == (32, 128)
    assert mid.train.max_steps * mid.global_batch_size * mid.seq_len < tokens


def test_steerling_midtraining_is_a_labelled_mixture_from_the_pretrained_run(tmp_path: Path) -> None:
    """recipes/steerling-8b-midtrain.yaml: Steerling's mid-training (uniform masking, dropout 0.3,
    teacher forcing 0.5 -> 0, 150B tokens) from the pre-training run, on a data.mix of three labelled
    components (placeholder prefixes and weights: the notes give none); only stage keys of the model
    change (a new stage may change them: STAGE_KEYS)."""
    import yaml

    from ncpctl.train.checkpoint import STAGE_KEYS, config_differences

    base, r = _resolved_steerling(tmp_path)
    assert r.data.train_prefix is None and r.data.val_prefix is None
    assert [(c.name, c.weight) for c in r.data.mix] == [("general", 0.5), ("math", 0.25), ("code", 0.25)]
    assert all(c.prefix and c.val_prefix for c in r.data.mix)
    raw = yaml.safe_load((RECIPES / "steerling-8b-midtrain.yaml").read_text())
    assert raw["train"]["init_from"] == "runs/steerling-8b" == str(base.run_dir) and r.train.load == "weights"
    b, d = r.model_config.bottleneck, r.model_config.diffusion
    assert (d.schedule, b.dropout, b.teacher_forcing_start, b.teacher_forcing_end) == ("uniform", 0.3, 0.5, 0.0)
    assert r.train.max_steps * r.global_batch_size * r.seq_len == pytest.approx(150e9, rel=1e-5)
    diffs = config_differences(base.model_config.to_dict(), r.model_config.to_dict())
    assert diffs and all(x.split(":")[0].removeprefix("model.") in STAGE_KEYS for x in diffs), diffs

"""``train.init_from`` = a Hugging Face directory: the recipe's model config is resolved when
the recipe loads (the HF config.json + the recipe's model keys), and its problems are recipe
errors (one line each, exit 2) before any heavy work, e.g. an unsupported model type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe

from ..conftest import run_cli

RECIPE = """\
run: {{dir: {run}}}
data: {{sources: [builtin:python-stdlib]}}
tokenizer: {{vocab_size: 512}}
model: {{size: debug, max_seq_len: 64, concept: {{enabled: true, codes: 8}}}}
train: {{max_steps: 2, micro_batch_size: 2, seq_len: 32, init_from: {init}}}
"""


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-NeoX with d_model 96 (the recipe's `debug` size has 64) and 640 tokens."""
    from ncpctl.model.core.config import build_config
    from ncpctl.model.families.hf import hf_config

    d = tmp_path_factory.mktemp("hf") / "neox"
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(hf_config(build_config("debug", vocab_size=600, d_model=96))).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF model type the importer does not read (OPT; GPT-2 is supported since issue 11)."""
    d = tmp_path_factory.mktemp("hf") / "opt"
    cfg = transformers.OPTConfig(num_hidden_layers=1, hidden_size=32, ffn_dim=64, num_attention_heads=2,
                                 vocab_size=100, word_embed_proj_dim=32)
    cfg.save_pretrained(d)
    transformers.OPTForCausalLM(cfg).save_pretrained(d)
    return d


def _recipe(tmp_path: Path, init: Path) -> Path:
    p = tmp_path / "mid.yaml"
    p.write_text(RECIPE.format(run=tmp_path / "run", init=init))
    return p


def test_model_config_is_the_hf_one_with_the_recipe_keys(neox_dir: Path, tmp_path: Path) -> None:
    r = load_recipe(_recipe(tmp_path, neox_dir))
    cfg = r.model_config
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size) == (96, 4, 4, 640)  # the HF model's
    assert cfg.max_seq_len == 64 and cfg.concept.enabled and cfg.concept.codes == 8  # the recipe's
    assert cfg.concept.k == 4 and cfg.n_segments == 4  # the `debug` size's concept defaults
    # the resolved recipe pins that config and loads back to it
    again = load_recipe(r.write_resolved(tmp_path / "resolved"))
    assert again.model_config == cfg


def test_impossible_combination_is_a_recipe_error(neox_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, neox_dir)
    with pytest.raises(UserError) as e:  # 64 divides the debug size's d_model, not the HF model's 96
        load_recipe(recipe, ["model.concept.segments=64"])
    assert e.value.problems == [f"--set: model.concept.segments: 64 does not divide d_model=96 "
                                f"(with the Hugging Face model {neox_dir})"]


def test_unreadable_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(UserError) as e:
        load_recipe(_recipe(tmp_path, bad))
    (line,) = e.value.problems
    assert line.startswith(f"{tmp_path / 'mid.yaml'}: train.init_from: {bad / 'config.json'}: unreadable")


def test_an_unsupported_model_type_is_refused_in_one_line(opt_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, opt_dir)
    with pytest.raises(UserError) as e:
        load_recipe(recipe)
    assert e.value.problems == [f"{recipe}: train.init_from: {opt_dir / 'config.json'}: model_type: "
                                "unsupported Hugging Face model type 'opt' "
                                "(supported: gpt_neox, llama, qwen3, olmo2, olmo3, gpt2)"]
    # the real entry point: exit 2, that one line, no traceback, before any training set-up
    proc = run_cli("midtrain", str(recipe))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "unsupported Hugging Face model type 'opt'" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()

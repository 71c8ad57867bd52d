"""`ncpctl midtrain` from local Hugging Face directories the paper's backbones need: a random
GPT-2 and a random Llama with Llama-3.1 RoPE scaling start a run (base model, no concept
path), take one step at lr 1e-12 and export again with the original's logits; an HF config
the importer does not understand is one `error:` line, exit 2, before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from .conftest import ncpctl, result

RECIPE = """\
model:
  concept: {{enabled: false}}
tokenizer:
  path: {data}/tokenizer.json
data:
  train_prefix: {data}/train
  val_prefix: {data}/val
run:
  dir: {run}
train:
  init_from: {hf}
  max_steps: 1
  seq_len: 32
  micro_batch_size: 4
  global_batch_size: 8
  lr: 1.0e-12
  min_lr: 1.0e-12
  warmup_steps: 0
  eval_every: 0
  eval_batches: 1
  save_every: 0
  plots: false
deepspeed:
  zero_stage: 0
"""

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
HF = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)),
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=64, rope_parameters=LLAMA3_ROPE)),
}


def _save(kind: str, root: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = HF[kind]().eval()
    model.save_pretrained(root / f"hf-{kind}")
    return root / f"hf-{kind}", model


@pytest.mark.parametrize("kind", list(HF))
def test_midtrain_from_hf_and_export_again(kind, tmp_path, tiny_data):
    hf_dir, original = _save(kind, tmp_path)
    recipe = tmp_path / "mid.yaml"
    recipe.write_text(RECIPE.format(data=tiny_data, run=tmp_path / "run", hf=hf_dir))
    r = result(ncpctl("midtrain", str(recipe), "--json"))
    assert r["step"] == 1 and r["init_from"] == str(hf_dir)
    out = result(ncpctl("export", str(tmp_path / "run"), "--out", str(tmp_path / "again"), "--json"))
    assert out["architecture"] == type(original).__name__
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    x = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (again(input_ids=x).logits - original(input_ids=x).logits).abs().max() <= 1e-4


def test_an_unsupported_rope_type_is_one_line(tmp_path, tiny_data):
    hf_dir, _ = _save("llama3", tmp_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "mid.yaml"
    recipe.write_text(RECIPE.format(data=tiny_data, run=tmp_path / "run", hf=hf_dir))
    proc = ncpctl("midtrain", str(recipe))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rope_type 'yarn' is not supported" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()

"""The ConceptLM authors' own models (issue 43): the fixtures their code made
(tests/fixtures/authors/conceptlm, tools/reference/conceptlm.py) open through ``load_model`` with
their logits at every position and their losses, export back to their layout, and run through
the real CLI (export, generate, inspect, eval); what does not fit is one line naming the key."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ncpctl.checkpoint import load_model
from ncpctl.errors import UserError
from ncpctl.interop.authors import conceptlm_io as io
from ncpctl.interop.authors.conceptlm_export import export

from ..conftest import REPO, run_cli

FIXTURES = REPO / "tests" / "fixtures" / "authors" / "conceptlm"
NAMES = ["pythia", "gpt2", "llama"]
TOL = 1e-5  # relative to max |logit| (or to the loss)

# Their NCP loss, in ncpctl's terms: Pythia and GPT-2 return MSE(pred[:-1], c[1:]) (our ncp_loss);
# their VQ loss is, per segment, SimVQ's commitment (1 + 0.25) mse plus a reconstruction mse, i.e.
# 2 vq_loss + commitment_loss, averaged over the segments (GPT-2: summed, x S).
THEIR_NCP = {"pythia": "eval.VQ_HLM_loss", "gpt2": "eval.VQ_CE_loss"}
THEIR_VQ = {"pythia": ("eval.VQ_MSE_loss", 1), "gpt2": ("train.VQ_MSE_loss", 4), "llama": ("train.VQ_cmt_loss", 1)}


@functools.lru_cache(maxsize=None)
def _run(name: str):
    loaded = load_model(FIXTURES / name)
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    their = json.loads((FIXTURES / name / "reference.json").read_text())["losses"]
    x = ref["tokens"]
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)  # their labels = input_ids, shifted
    with torch.no_grad():
        out = loaded.model(x, targets)
    return loaded, ref, their, out


def _close(a, b) -> bool:
    return abs(float(a) - float(b)) <= TOL * abs(float(b))  # (under no_grad: plain numbers)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_losses_equal_the_authors_code(name):
    loaded, ref, their, out = _run(name)
    got = out.logits[..., : loaded.config.vocab_size]
    assert got.shape == ref["logits"].shape
    assert ((got - ref["logits"]).abs() <= TOL * ref["logits"].abs().max()).all()  # every position
    assert _close(out.ntp_loss, their["eval.loss"])
    key, segments = THEIR_VQ[name]
    assert _close(segments * (2 * out.vq_loss + out.commitment_loss), their[key])
    if name in THEIR_NCP:
        assert _close(out.ncp_loss, their[THEIR_NCP[name]])


def test_their_llama_ncp_loss_is_a_difference_kept_on_purpose():
    """Their Llama's pred_loss targets the codes of the prediction's own argmax one block later,
    MSE(pred[:-1], codes[argmax w][1:]) (recomputed here from ncpctl's model: equal); ncpctl keeps
    the paper's NCP, MSE(pred[:-1], c[1:]) (docs: the differences kept on purpose)."""
    loaded, _, their, out = _run("llama")
    codes = loaded.model.concept.codebook()  # (S, N, ds)
    idx = out.concept.weights.argmax(-1)  # (B, M, S)
    S = codes.shape[0]
    target = codes[torch.arange(S), idx].flatten(2)  # (B, M, d)
    with torch.no_grad():
        theirs = torch.nn.functional.mse_loss(out.pred[:, :-1], target[:, 1:])
    assert _close(theirs, their["train.pred_loss"])
    assert not _close(out.ncp_loss, their["train.pred_loss"])


def _their_weights(directory: Path) -> dict:
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("name", NAMES)
def test_export_back_to_their_layout(name, tmp_path):
    loaded = _run(name)[0]
    info = export(FIXTURES / name, tmp_path / name)
    assert info["verify"]["max_abs_diff"] == 0.0
    mine, theirs = _their_weights(tmp_path / name), _their_weights(FIXTURES / name)
    assert set(mine) == set(theirs) and info["architecture"] in (FIXTURES / name / "config.json").read_text()
    S = loaded.config.n_segments
    unused = [k for k in theirs if ".ctx_lm_head." in k and int(k.split(".ctx_lm_head.")[1].split(".")[0]) >= S]
    assert (name == "pythia") == bool(unused)  # Pythia's vq_patch_ratio 2: heads 2, 3 are saved, never run
    for k in theirs:
        assert torch.equal(mine[k], torch.zeros_like(theirs[k]) if k in unused else theirs[k]), k
    again = load_model(tmp_path / name).config
    assert again.to_dict() == loaded.config.to_dict()


def test_their_llamas_cached_buffers_are_not_weights(tmp_path):
    """Their Llama writes cached_* buffers during a forward; a checkpoint saved after one holds them:
    they are activations, ignored on import (and never exported: test_export_back_to_their_layout)."""
    from safetensors.torch import save_file

    d = Path(shutil.copytree(FIXTURES / "llama", tmp_path / "llama"))
    sd = _their_weights(d)
    sd.update({f"model.cached_encoder_hs_{i}": torch.randn(2, 1, 32) for i in range(1, 5)},
              **{"model.cached_pred_high_level_hs": torch.randn(2, 4, 32)})
    save_file(sd, str(d / "model.safetensors"))
    ref = load_file(str(d / "reference.safetensors"))
    with torch.no_grad():
        got = load_model(d).model(ref["tokens"]).logits[..., :64]
    assert ((got - ref["logits"]).abs() <= TOL * ref["logits"].abs().max()).all()
    save_file({**sd, "model.extra.weight": torch.zeros(2)}, str(d / "model.safetensors"))
    with pytest.raises(UserError, match="weights ncpctl does not read: model.extra.weight"):
        load_model(d)


def test_what_their_code_cannot_run_is_one_line_per_key(tmp_path):
    d = Path(shutil.copytree(FIXTURES / "pythia", tmp_path / "pythia"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_norm_option="norm", dist_topk=4, new_switch=1)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        load_model(d)
    lines = "\n".join(e.value.problems)
    assert len(e.value.problems) == 3
    assert "layer_norm_option" in lines and "dist_topk" in lines and "new_switch" in lines


def test_a_model_their_layout_cannot_hold_names_the_keys():
    from ncpctl.interop.authors.conceptlm import export_problems

    loaded = _run("gpt2")[0]
    cfg = loaded.config.__class__.from_dict({**loaded.config.to_dict(), "concept": {
        **loaded.config.to_dict()["concept"], "add": "normed", "codebook_per_segment": False}})
    problems = export_problems(cfg)
    assert any(p.startswith("concept.add: 'normed'") for p in problems)
    assert any(p.startswith("concept.codebook_per_segment: False") for p in problems)
    assert export_problems(loaded.config) == []


def test_train_init_from_their_directory(tmp_path):
    """midtrain / adapt-vq start from their weights: a recipe without a model section takes the
    imported model (as from an ncpctl checkpoint); optimizer state (train.load: all) is refused."""
    from ncpctl.recipe import load_recipe
    from ncpctl.train.stages import build_model, make_stage

    recipe = tmp_path / "mid.yaml"
    recipe.write_text(f"tokenizer: {{vocab_size: 64}}\nrun: {{dir: {tmp_path / 'run'}}}\ntrain:\n"
                      f"  init_from: {FIXTURES / 'llama'}\n  seq_len: 16\n  micro_batch_size: 2\n"
                      "  global_batch_size: 2\n")
    r = load_recipe(recipe, [])
    loaded = _run("llama")[0]
    assert r.model_config.to_dict() == loaded.config.to_dict()
    model = build_model(r, make_stage(r, "midtrain"), fresh=True, info=lambda m: None)
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.model.state_dict().items())
    with pytest.raises(UserError, match="train.load: all needs an ncpctl checkpoint"):
        make_stage(load_recipe(recipe, ["train.load=all"]), "midtrain")


def _tokenizer(path: Path) -> None:
    """A 64-word tokenizer for the fixtures' 64-token vocabulary (their directories ship their own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(62)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path))


def _invoke(*args: str) -> dict:
    """The CLI in-process (the entry point itself runs once, for generate: no second import)."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    r = CliRunner().invoke(app, [*args, "--json"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_cli_reads_their_directory(tmp_path):
    """GPT-2 (the shared final norm on the added concept): greedy generation equals the argmax chain of
    the full forward, inspect reads the concepts, eval scores held-out text, export writes their layout."""
    d = Path(shutil.copytree(FIXTURES / "gpt2", tmp_path / "gpt2"))
    _tokenizer(d / "tokenizer.json")
    prompt = "w1 w7 w3 w9 w20 w5"
    r = run_cli("generate", str(d), "-p", prompt, "-n", "6", "--greedy", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    text = json.loads(r.stdout)["completions"][0]["text"]
    loaded = load_model(d)
    ids = loaded.tokenizer.encode(prompt).ids
    want = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(6):
            nxt = loaded.model(want).logits[0, -1, : loaded.config.vocab_size].argmax()
            want = torch.cat([want, nxt.view(1, 1)], dim=1)
    assert text == loaded.tokenizer.decode(want[0, len(ids):].tolist())
    assert _invoke("inspect", str(d), "-p", prompt, "--target", "w2 w4")["add"] == "final_norm"
    (tmp_path / "held.txt").write_text(" ".join(f"w{(7 * i) % 62}" for i in range(60)))
    ev = _invoke("eval", str(d), "--tasks", "", "--heldout", str(tmp_path / "held.txt"), "--out", str(tmp_path / "ev"))
    assert ev["perplexity"]["per_set"]
    back = _invoke("export", str(d), "--format", "conceptlm", "--out", str(tmp_path / "back"))
    assert back["verify"]["max_abs_diff"] == 0.0 and (tmp_path / "back" / "tokenizer.json").is_file()


def test_export_back_replaces_its_own_export_and_refuses_a_changed_one(tmp_path):
    """Issue 42 item 2 for this layout too: the export carries the marker (sizes and checksums), so a
    second export replaces the first, while one whose weights the user changed is refused in one line
    (``move_aside`` moves it aside whole; nothing is deleted)."""
    from ncpctl.errors import UserError

    out = tmp_path / "back"
    export(FIXTURES / "gpt2", out, verify=False)
    assert (out / ".ncpctl-export.json").is_file()
    export(FIXTURES / "gpt2", out, verify=False)  # its own earlier export: replaced
    (out / "model.safetensors").write_bytes(b"the user's weights")
    with pytest.raises(UserError, match="model.safetensors"):
        export(FIXTURES / "gpt2", out, verify=False)
    assert (out / "model.safetensors").read_bytes() == b"the user's weights"
    info = export(FIXTURES / "gpt2", out, verify=False, move_aside=True)
    assert (Path(info["moved_aside"]) / "model.safetensors").read_bytes() == b"the user's weights"

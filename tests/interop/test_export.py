"""`ncpctl export`: complete HF directories that reload with equal logits; ConceptLM through
remote code with ncpctl unimportable (its cached generate continues like ncpctl's own decoder);
a wrong conversion is caught and nothing is kept."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import transformers

from ncpctl.checkpoint import load_model, save_model_files
from ncpctl.errors import UserError
from ncpctl.interop import hf_export
from ncpctl.interop.hf_export import export
from ncpctl.interop.hf_import import load_hf_pretrained

from ..conftest import run_cli, run_without_ncpctl
from ..model._helpers import build, tiny

torch.set_num_threads(1)


def test_base_export_is_native_and_sharded(runs, tmp_path):
    out = tmp_path / "hf"
    info = export(runs["base"], out, max_shard_size="200KB")
    assert info["architecture"] == "GPTNeoXForCausalLM" and info["shards"] > 1
    assert info["verify"]["max_abs_diff"] <= 1e-5
    for f in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (out / f).is_file(), f
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(out).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    src = load_model(runs["base"])
    ids = tok("def f(x):\n    return x\n", return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == src.tokenizer.encode("def f(x):\n    return x\n").ids
    with torch.no_grad():
        assert (hf(ids).logits - src.model(ids).logits).abs().max() <= 1e-5
    assert tok.eos_token == "<|endoftext|>" and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0


def test_conceptlm_loads_without_ncpctl(runs, tmp_path):
    out = tmp_path / "ncp"
    info = export(runs["concept"], out)
    assert info["architecture"] == "NCPForCausalLM" and info["remote_code"]
    assert {"modeling_ncp.py", "configuration_ncp.py"} <= set(info["files"])
    src = load_model(runs["concept"]).model
    x = torch.randint(0, 1024, (2, 45), generator=torch.Generator().manual_seed(1))
    # ncpctl's own incremental decoder on two left-padded prompts (13 and 6 tokens): the greedy
    # continuation that the remote code's cached generate must reproduce
    xp = torch.zeros(2, 13, dtype=torch.long)
    xp[0], xp[1, 7:] = x[0, :13], x[1, :6]
    mask = (torch.arange(13) >= torch.tensor([[0], [7]])).long()
    with torch.no_grad():
        ref = src(x).logits
        logits, state = src.prefill(xp, [13, 6], max_len=13 + 12)
        new = [logits[:, -1].argmax(-1)]
        for _ in range(11):
            new.append(src.decode_step(state, new[-1]).argmax(-1))
    torch.save({"x": x, "ref": ref, "xp": xp, "mask": mask, "new": torch.stack(new, 1)}, tmp_path / "probe.pt")
    stdout = run_without_ncpctl(f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        AutoTokenizer.from_pretrained({str(out)!r})
        p = torch.load({str(tmp_path / 'probe.pt')!r})
        with torch.no_grad():
            d = (m(input_ids=p["x"]).logits - p["ref"]).abs().max().item()
        kw = dict(attention_mask=p["mask"], max_new_tokens=12, do_sample=False, eos_token_id=None)
        out = m.generate(p["xp"], return_dict_in_generate=True, **kw)
        assert type(out.cache).__name__ == "NCPCache", type(out.cache)
        assert torch.equal(out.sequences[:, 13:], p["new"]), (out.sequences, p["new"])
        assert torch.equal(m.generate(p["xp"], use_cache=False, **kw), out.sequences)
        assert type(m).__name__ == "NCPForCausalLM" and "ncpctl" not in sys.modules, sys.modules.keys()
        print("DIFF", d)
    """, tmp_path, timeout=120)
    assert float(stdout.split("DIFF")[-1]) <= 1e-5


def test_bf16_export_verifies(runs, tmp_path):
    info = export(runs["concept"], tmp_path / "bf16", dtype="bf16")
    v = info["verify"]
    assert v["max_abs_diff"] <= v["tolerance"] and v["max_abs_diff_vs_fp32_source"] > 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16


def test_wrong_conversion_is_caught_and_nothing_kept(runs, tmp_path, monkeypatch):
    real = hf_export._save_weights

    def broken(state, d, dtype, shard):
        state = dict(state)
        k = next(k for k in state if "dense_h_to_4h.weight" in k)
        state[k] = state[k] + 0.01
        return real(state, d, dtype, shard)

    monkeypatch.setattr(hf_export, "_save_weights", broken)
    with pytest.raises(UserError, match="export check failed"):
        export(runs["base"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))
    export(runs["base"], tmp_path / "unchecked", verify=False)  # --skip-verify keeps it
    assert (tmp_path / "unchecked" / "config.json").is_file()


def test_cli_export_json(runs, tmp_path):
    r = run_cli("export", str(runs["concept"]), "--out", str(tmp_path / "x"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["architecture"] == "NCPForCausalLM" and out["verify"]["max_abs_diff"] <= 1e-5
    bad = run_cli("export", str(runs["concept"]), "--out", str(tmp_path / "y"), "--dtype", "fp16")
    assert bad.returncode == 2 and "fp16" in bad.stderr


def test_exported_code_is_the_model_package():
    """The export's modeling code is ncpctl's own model modules, copied: nothing imports ncpctl,
    and every model module the adapter reaches is included (flattened into one folder, issue 44:
    ``core/model.py`` ships as ``core_model.py``; only its import lines differ from the source)."""
    import re

    files = {s.name: s for s in hf_export.remote_files()}
    assert {"modeling_ncp.py", "configuration_ncp.py", "core_model.py", "core_layers.py", "core_concept.py",
            "core_segment.py", "core_coupling.py", "core_decode.py", "core_head.py", "core_config.py",
            "designs_dynamic_module.py"} <= set(files)
    for name, shipped in files.items():
        text = shipped.text
        assert not re.search(r"^\s*(from|import)\s+ncpctl\b", text, re.MULTILINE), name
        if name not in ("modeling_ncp.py", "configuration_ncp.py"):
            assert shipped.source.is_relative_to(hf_export.MODEL_PACKAGE)  # a copy, not a second implementation
            src = shipped.source.read_text().splitlines()
            assert len(src) == len(text.splitlines())
            changed = [(a, b) for a, b in zip(src, text.splitlines()) if a != b]
            assert all(re.match(r"\s*from ncpctl\.model\.", a) or re.search(r"[\"']\.[\w.]+:", a)
                       for a, _ in changed), changed[:3]


def test_exported_code_is_flat():
    """transformers' remote-code loader copies the files of ``from .x import y`` lines only
    (``.x`` a sibling file): every relative import of the shipped code names a shipped file, and
    none is a dotted path (``from .core.layers import`` would not be copied)."""
    import re

    files = {s.name: s.text for s in hf_export.remote_files()}
    for name, text in files.items():
        for target in re.findall(r"^\s*from\s+\.(\S+)\s+import", text, re.MULTILINE):
            assert "." not in target and f"{target}.py" in files, (name, target)
    with pytest.raises(ValueError, match="imports the model package only"):
        hf_export._flatten("from ncpctl.errors import UserError\n", "x.py")


def test_a_design_outside_the_package_is_not_exported():
    from ncpctl.model.core.config import build_config

    from ..model import toys  # noqa: F401  (registers the toy segmentation "alt23")

    cfg = build_config("debug", concept=dict(enabled=True, segmentation="alt23"))
    with pytest.raises(UserError, match="model.concept.segmentation: 'alt23' is not built into ncpctl"):
        hf_export._check_builtin(cfg)


@pytest.mark.parametrize("arch, window", [("Olmo2ForCausalLM", None), ("Olmo3ForCausalLM", 5)])
def test_post_norm_base_exports_as_olmo(tmp_path, arch, window):
    """A post-norm llama with layer-wise QK-norm exports as native OLMo-2 (OLMo-3 with a sliding
    window: the 37-token probe spans several windows) that reloads with equal logits, and
    imports back (``train.init_from``'s path) to the same model."""
    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
    cfg = tiny("llama", vocab_size=320, norm_placement="post", qk_norm="layer", sliding_window=window,
               full_attn_every=3, n_layers=3)
    model = build(cfg, seed=2)
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    info = export(tmp_path / "ck", tmp_path / "hf")
    assert info["architecture"] == arch and not info["remote_code"]
    assert info["verify"]["max_abs_diff"] <= 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [arch]
    hf = getattr(transformers, arch).from_pretrained(tmp_path / "hf").eval()
    back = load_hf_pretrained(tmp_path / "hf", pad_vocab_multiple=64).eval()
    assert (back.cfg.norm_placement, back.cfg.sliding_window) == ("post", window)
    x = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(x).logits
        assert (hf(x).logits - ref).abs().max() <= 1e-5
        assert (back(x).logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("attention, width", [("per_concept", None), ("replicated", None), ("per_concept", 64)])
def test_dlcm_exports_through_remote_code(tmp_path, attention, width):
    """DLCM (dynamic segmentation, cross-attention, the balance's step counts as a buffer)
    exports with remote code; the export's own check (full forward and cached generate at the
    inference boundaries) passes and the reloaded model gives the same logits."""
    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
    cfg = tiny("llama", vocab_size=320, concept=dict(segmentation="dynamic", coupling="cross_attention",
                                                     cross_attention=attention, d_concept=width))
    model = build(cfg, seed=3)
    model.concept.segmenter.on_step_end({"boundaries": 30.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    info = export(tmp_path / "ck", tmp_path / "hf")
    assert info["remote_code"] and info["verify"]["max_abs_diff"] <= 1e-5
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    x = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(input_ids=x).logits - model(x).logits).abs().max() <= 1e-5
    xp = torch.zeros(2, 9, dtype=torch.long)  # ragged, left-padded prompts (9 and 4 tokens)
    xp[0], xp[1, 5:] = x[0, :9], x[1, :4]
    kw = dict(attention_mask=(torch.arange(9) >= torch.tensor([[0], [5]])).long(), max_new_tokens=10,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    cached = hf.generate(xp, **kw)
    assert torch.equal(hf.generate(xp, use_cache=False, **kw), cached)


def test_mup_base_model_exports_natively_with_the_divisor_folded(tmp_path):
    """Decoupled muP's logit divisor 1/s_token is folded into an untied native LM head (and
    multiplied back on import); a tied head cannot hold it: one error naming the key."""
    from ncpctl.model.core.config import ConfigError
    from ncpctl.model.families.hf import hf_config

    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
    cfg = tiny("neox", vocab_size=320, mup_base_width=8)  # s_token = 4
    model = build(cfg, seed=5)
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    info = export(tmp_path / "ck", tmp_path / "hf")
    assert info["architecture"] == "GPTNeoXForCausalLM" and info["verify"]["max_abs_diff"] <= 1e-5
    back = load_hf_pretrained(tmp_path / "hf", cfg=cfg).eval()
    x = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(x).logits - model(x).logits).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match="mup_base_width"):
        hf_config(tiny("neox", vocab_size=320, mup_base_width=8, tie_embeddings=True))


def test_mup_dlcm_exports_through_remote_code(tmp_path):
    """The remote code is ncpctl's own: the config carries mup_base_width and the export's check passes."""
    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"
    cfg = tiny("llama", vocab_size=320, mup_base_width=16,
               concept=dict(segmentation="dynamic", coupling="cross_attention", d_concept=64))
    model = build(cfg, seed=3)
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    info = export(tmp_path / "ck", tmp_path / "hf")
    assert info["remote_code"] and info["verify"]["max_abs_diff"] <= 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["ncp"]["mup_base_width"] == 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    x = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (hf(input_ids=x).logits - model(x).logits).abs().max() <= 1e-5


def test_dlcm_export_is_causal_and_decodes_without_ncpctl(tmp_path):
    """The DLCM export with ncpctl hidden (only transformers and the copied remote code): its
    logits equal ncpctl's, changing the tokens after position p changes no logit at or before p
    (float64: a changed concept count moves fp32 sums at ~1e-6), and its cached greedy generate on
    ragged prompts equals use_cache=False and ncpctl's own incremental decoder."""
    tok = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox" / "tokenizer.json"  # 320 tokens
    cfg = tiny("llama", vocab_size=320, concept=dict(segmentation="dynamic", coupling="cross_attention"))
    model = build(cfg, seed=3)
    model.concept.segmenter.on_step_end({"boundaries": 30.0, "boundary_tokens": 100.0, "boundary_prob_sum": 0.0})
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    out = tmp_path / "hf"
    export(tmp_path / "ck", out)
    x = torch.randint(0, 320, (2, 29), generator=torch.Generator().manual_seed(4))
    xp = torch.zeros(2, 11, dtype=torch.long)  # ragged, left-padded prompts (11 and 5 tokens)
    xp[0], xp[1, 6:] = x[0, :11], x[1, :5]
    mask = (torch.arange(11) >= torch.tensor([[0], [6]])).long()
    with torch.no_grad():
        ref = model(x).logits
        logits, state = model.prefill(xp, [11, 5], max_len=11 + 10)
        new = [logits[:, -1, :320].argmax(-1)]
        for _ in range(9):
            new.append(model.decode_step(state, new[-1])[:, :320].argmax(-1))
    torch.save({"x": x, "ref": ref, "xp": xp, "mask": mask, "new": torch.stack(new, 1)}, tmp_path / "probe.pt")
    stdout = run_without_ncpctl(f"""
        import torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        p = torch.load({str(tmp_path / 'probe.pt')!r})
        with torch.no_grad():
            d = (m(input_ids=p["x"]).logits - p["ref"]).abs().max().item()
            m64, x = m.double(), p["x"]
            worst, moved = 0.0, 1.0
            for cut in (3, 10, 20):
                y = x.clone()
                y[:, cut + 1:] = (y[:, cut + 1:] * 7 + 11) % 320  # every later token changed
                a, b = m64(input_ids=x).logits, m64(input_ids=y).logits
                worst = max(worst, (a[:, : cut + 1] - b[:, : cut + 1]).abs().max().item())
                moved = min(moved, (a[:, cut + 1:] - b[:, cut + 1:]).abs().max().item())  # it did change later
            m = m.float()
        kw = dict(attention_mask=p["mask"], max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        cached = m.generate(p["xp"], **kw)
        assert torch.equal(m.generate(p["xp"], use_cache=False, **kw), cached)
        assert torch.equal(cached[:, 11:], p["new"]), (cached[:, 11:], p["new"])
        assert "ncpctl" not in sys.modules
        assert moved > 1e-3, moved
        print("DIFF", d, "CAUSAL", worst)
    """, tmp_path, timeout=180)
    diff, causal = (float(v) for v in stdout.split("DIFF")[-1].split("CAUSAL"))
    assert diff <= 1e-5 and causal <= 1e-10, stdout


# ---- exports write only what they own (issue 21) ----

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_v1_neox"  # a tiny ConceptLM checkpoint


def _tree(d: Path) -> dict[str, object]:
    """Everything under ``d`` that an overwrite could change: names, bytes, modes."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None, p.stat().st_mode)
            for p in sorted(d.rglob("*"))} | {".": d.stat().st_mode}


def _hf_model_dir(d: Path, mode: int = 0o751) -> Path:
    """Someone else's Hugging Face model directory: a config.json, weights and a subfolder."""
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "gpt_neox"}\n')
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "sub" / "notes.txt").write_text("mine\n")
    d.chmod(mode)
    return d


def test_export_refuses_a_directory_it_did_not_write(tmp_path):
    victim = _hf_model_dir(tmp_path / "hf-model")
    before = _tree(victim)
    r = run_cli("export", str(FIXTURE), "--out", str(victim), "--skip-verify")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and str(victim) in errors[0], r.stderr
    assert "Traceback" not in r.stderr and _tree(victim) == before
    assert not list(tmp_path.glob(".hf-model.*"))


def test_export_does_not_follow_export_out_from_the_checkpoint(tmp_path):
    """A checkpoint's recorded recipe names a directory: export writes to RUN/export instead."""
    victim = _hf_model_dir(tmp_path / "elsewhere")
    before = _tree(victim)
    ck = Path(shutil.copytree(FIXTURE, tmp_path / "run" / "checkpoints" / "step_0000020"))
    meta = json.loads((ck / "ncpctl.json").read_text())
    meta["recipe"]["export"]["out"] = str(victim)
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    r = CliRunner().invoke(app, ["export", str(ck), "--skip-verify", "--json"], env={"COLUMNS": "400"})  # in-process: no second import
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["out"] == str(tmp_path / "run" / "export") and str(victim) in r.stderr
    assert _tree(victim) == before
    assert (tmp_path / "run" / "export" / "config.json").is_file()


def test_reexport_replaces_its_own_export_and_keeps_modes(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    out = tmp_path / "hf"
    info = export(FIXTURE, out, verify=False)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    assert hf_export.MARKER in info["files"] and json.loads((out / hf_export.MARKER).read_text())["files"] == \
        sorted(set(info["files"]) - {hf_export.MARKER})
    out.chmod(0o750)
    (out / "config.json").write_text('{"ncp": 1}')  # a file the user changed (issue 42 item 2): kept, export refused
    before = _tree(out)
    with pytest.raises(UserError, match="config.json changed since ncpctl export wrote it"):
        export(FIXTURE, out, verify=False)
    assert _tree(out) == before
    (out / "config.json").unlink()  # an earlier export, unchanged but for a file removed: replaced
    export(FIXTURE, out, verify=False)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750 and json.loads((out / "config.json").read_text())["ncp"]
    assert not list(tmp_path.glob("hf.prev-*"))  # nothing the user wrote was there to keep
    (out / "README.md").write_text("my model card\n")  # a file the export did not write: kept, export refused
    before = _tree(out)
    with pytest.raises(UserError, match="README.md, which the earlier export did not write"):
        export(FIXTURE, out, verify=False)
    assert _tree(out) == before and not list(tmp_path.glob(".hf.*"))


def test_reexport_over_save_pretrained_keeps_the_users_weights(tmp_path):
    """Issue 42 item 2, the tester's sequence: ``model.save_pretrained(export_dir)`` (the user's own
    weights, under the names the export wrote) then ``ncpctl export ... --out export_dir``: one line
    naming the file, exit 2, the directory untouched; ``--move-aside`` keeps it whole as
    ``export_dir.prev-TIME`` and exports."""
    from typer.testing import CliRunner

    from ncpctl.cli.app import app

    out = tmp_path / "export_dir"
    export(FIXTURE, out, verify=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(0.5)  # the user's fine-tuned weights
    hf.save_pretrained(out)
    before = _tree(out)
    r = CliRunner().invoke(app, ["export", str(FIXTURE), "--out", str(out), "--skip-verify"], env={"COLUMNS": "400"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and str(out) in errors[0], r.stderr
    assert "config.json, model.safetensors changed since ncpctl export wrote them" in errors[0]
    assert _tree(out) == before
    r = CliRunner().invoke(app, ["export", str(FIXTURE), "--out", str(out), "--skip-verify", "--move-aside", "--json"],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    (aside,) = tmp_path.glob("export_dir.prev-*")
    assert json.loads(r.stdout)["moved_aside"] == str(aside)
    assert _tree(aside) == {**before, ".": before["."]}  # the user's directory, whole
    assert hf_export.existing(out) == "ours"  # the new export, as written


def test_export_fills_an_empty_directory_in_place(tmp_path):
    out = tmp_path / "empty"
    out.mkdir(mode=0o705)
    out.chmod(0o705)
    inode = out.stat().st_ino
    export(FIXTURE, out, verify=False)
    assert out.stat().st_ino == inode and stat.S_IMODE(out.stat().st_mode) == 0o705
    assert (out / "config.json").is_file() and (out / hf_export.MARKER).is_file()
    assert not list(tmp_path.glob(".empty.*"))


def test_cdlm_exports_through_remote_code_with_its_block_causal_forward(tmp_path):
    """Issue 23 item 8: a Causal Diffusion LM exports with ncpctl's modeling code; the export's own
    check passes, the reloaded model's logits are ncpctl's (a later block never reaches an earlier
    one; a left-padded row computes what it would alone), ``labels`` score the masked positions
    unshifted, and caches are refused in one line; its generate samples block by block without ncpctl
    (issue 43 item 7: ``_generates_block_by_block_without_ncpctl``)."""
    from ..inference.test_attribute_inputs import _mask_tokenizer

    tok, mask = _mask_tokenizer(tmp_path)  # the fixture's 320 tokens and <|mask|>
    cfg = tiny("llama", vocab_size=321, objective="causal_diffusion", diffusion=dict(block_size=4, mask_id=mask))
    model = build(cfg, seed=5)
    save_model_files(tmp_path / "ck", model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tok)
    info = export(tmp_path / "ck", tmp_path / "hf")
    assert info["remote_code"] and info["architecture"] == "NCPForCausalLM" and info["verify"]["max_abs_diff"] <= 1e-5
    assert (tmp_path / "hf" / "designs_causal_diffusion_module.py").is_file() and info["mask_token"] == "<|mask|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    w = torch.randint(2, 320, (2, 15), generator=torch.Generator().manual_seed(6))  # never <|mask|> (320)
    x, y = model.objective.keyed_batch(w, torch.tensor([3, 9]))  # [MASK]s in the input, targets where masked
    with torch.no_grad():
        ref = model(x)
        got = hf(input_ids=x, labels=y)
        assert (got.logits - ref.logits).abs().max() <= 1e-5
        assert abs(got.loss.item() - model(x, y).loss.item()) <= 1e-5
        xp = torch.zeros(2, 14, dtype=torch.long)  # row 1 left-padded by 5: its blocks follow its own positions
        xp[0], xp[1, 5:] = x[0, :14], x[1, :9]
        am = (torch.arange(14) >= torch.tensor([[0], [5]])).long()
        padded = hf(input_ids=xp, attention_mask=am).logits
        assert (padded[1, 5:] - model(x[1:, :9]).logits[0]).abs().max() <= 1e-5
        assert (padded[0] - model(x[:1, :14]).logits[0]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="no incremental decoding"):
        hf(input_ids=x, use_cache=True)
    with pytest.raises(ValueError, match="pad on the left: a right-padded slot would sit inside a real token"):
        hf(input_ids=x, attention_mask=(torch.arange(15) < 12).long().expand(2, 15))
    _generates_block_by_block_without_ncpctl(model, tmp_path / "hf", mask, tmp_path)


def _generates_block_by_block_without_ncpctl(model, hf_dir: Path, mask: int, tmp_path: Path) -> None:
    """Issue 43 item 7: the export names its [MASK] where transformers looks (``config.mask_token_id``,
    the tokenizer's ``mask_token``) and its ``generate`` is ncpctl's block sampler, shipped in the
    remote code: with ncpctl hidden, greedy and seeded generation of ragged, left-padded prompts give
    ncpctl's tokens; a row stops at the end of the block where it produced EOS, padded after it."""
    from ncpctl.inference import SamplingParams
    from ncpctl.model.designs.causal_diffusion.sampler import sample_blocks

    assert (hf_dir / "designs_causal_diffusion_sampler.py").is_file()
    ps = [torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 6)]
    want = {k: sample_blocks(model, ps, SamplingParams(max_new_tokens=7, **kw), vocab_size=321)
            for k, kw in (("greedy", dict(greedy=True)), ("seeded", dict(seed=3, top_k=50)))}
    xp = torch.zeros(2, 9, dtype=torch.long)
    xp[0], xp[1, 3:] = torch.tensor(ps[0]), torch.tensor(ps[1])
    eos = want["greedy"][1][2]  # row 1's third new token as EOS: it stops at the end of that block
    torch.save({"xp": xp, "am": (xp != 0) | (torch.arange(9) >= torch.tensor([[0], [3]])), "want": want, "eos": eos},
               tmp_path / "probe.pt")
    stdout = run_without_ncpctl(f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d = {str(hf_dir)!r}
        m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
        t = AutoTokenizer.from_pretrained(d)
        p = torch.load({str(tmp_path / "probe.pt")!r})
        am = p["am"].long()
        assert t.mask_token == "<|mask|>" and t.mask_token_id == m.config.mask_token_id == {mask}, t.mask_token
        g = m.generate(p["xp"], attention_mask=am, max_new_tokens=7, do_sample=False, eos_token_id=None)
        assert g.shape == (2, 16) and torch.equal(g[:, :9], p["xp"]), g
        assert g[:, 9:].tolist() == p["want"]["greedy"], (g[:, 9:].tolist(), p["want"]["greedy"])
        s = m.generate(p["xp"], attention_mask=am, max_new_tokens=7, do_sample=True, top_k=50, seed=3)
        assert s[:, 9:].tolist() == p["want"]["seeded"], (s[:, 9:].tolist(), p["want"]["seeded"])
        e = m.generate(p["xp"], attention_mask=am, max_new_tokens=7, do_sample=False, eos_token_id=p["eos"],
                       pad_token_id=0)
        row = e[1, 9:].tolist()
        cut = row.index(p["eos"]) + 1
        assert row[:cut] == p["want"]["greedy"][1][:cut] and set(row[cut:]) <= {{0}}, row
        print("OK")
    """, tmp_path, timeout=240)
    assert "OK" in stdout

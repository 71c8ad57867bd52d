"""The `accounting` section against the papers: ConceptLM App. C (4.6875% saving vs PM at
T=8192, d=4096) and NCP-ArchPreview Table 2 (34 block-equivalents for 40 blocks of
parameters), through the library and through the real CLI."""

from __future__ import annotations

import json

import pytest

from ncpctl.model.core.config import build_config
from ncpctl.profile.accounting import accounting_section, siblings

from ..conftest import RECIPES, run_cli

APPC = dict(d_model=4096, n_layers=32, n_heads=32, max_seq_len=8192)


def test_siblings_are_base_and_pm() -> None:
    cfg = build_config("pythia-160m", concept=dict(enabled=True, concept_layers=2))
    sib = siblings(cfg)
    assert sib["recipe"] is cfg
    assert not sib["base"].concept.enabled and sib["base"].n_token_layers == 12
    assert not sib["pm"].concept.enabled and sib["pm"].n_token_layers == 14


def test_appc_saving_through_the_section() -> None:
    cfg = build_config("pythia-160m", **APPC, concept=dict(enabled=True, k=4, encoder_layers=1, concept_layers=2))
    a = accounting_section(cfg, seq_len=8192, micro_batch=1, params=False)
    v = a["variants"]
    assert v["pm"]["paper"]["formula"] == "408*T*d^2 + 68*T^2*d"
    assert v["recipe"]["paper"]["formula"] == "390*T*d^2 + 64.25*T^2*d"
    assert a["savings"]["recipe_vs_pm"]["paper"] == 0.046875  # ConceptLM App. C: 4.6875%
    # the exact view counts what the formula leaves out (LM head, heads, codebook, causal attention)
    assert 0 < a["savings"]["recipe_vs_pm"]["exact"] < 0.1
    assert 0 < v["recipe"]["exact"]["concept_share"] < 0.05


def test_archpreview_34_of_40_through_the_section() -> None:
    a = accounting_section(build_config("ncp-archpreview-8.9b"), seq_len=8192, params=False)
    r = a["variants"]["recipe"]
    assert r["block_equivalents"] == 34 and r["parameter_equivalent_layers"] == 40
    assert a["variants"]["pm"]["token_layers"] == 40  # PM: base 32 + C=8 token layers


def test_dlcm_paper_view_counts_concept_layers_at_their_width() -> None:
    """DLCM 2.3B (d 1536, d_concept 3072, 16 token + 16 concept layers, R = 4) at T = 8192. App. C's
    concept layer at width d_c on T/k positions costs 12 (T/k) d_c^2 + 2 (T/k)^2 d_c: in the token
    width, w^2/k token layers in the T d^2 term and w/k^2 in the T^2 d term (w = d_c/d = 2). So
    16 + 16 * 4/4 = 32 block-equivalents, PM's 32 token layers: the paper view saves only in the
    attention term (36 against 64 T^2 d). The exact count (real shapes) saves 17.3% with attention
    counted in full (the one FLOP convention, issue 40 item 3) and 10.2% under the causal mask: the
    issue's 10.4% less DLCM's pooling, which is one (M, T) x (T, d) GEMM of the segment indicator
    (``segment_means``: 2 M T d, an eighth of an attention layer's 4 T^2 d at R = 4), not
    T d adds."""
    cfg = build_config("dlcm-2.3b")
    T, d, dc = 8192, cfg.d_model, cfg.concept_cfg.d_model
    L, C, k, w = cfg.n_token_layers, cfg.concept.concept_layers, cfg.concept.target_ratio, dc / d
    assert (L, C, k, w) == (16, 16, 4, 2)
    a = accounting_section(cfg, seq_len=T, params=False)
    v, s = a["variants"], a["savings"]["recipe_vs_pm"]
    be = L + C * w**2 / k
    assert v["recipe"]["block_equivalents"] == cfg.block_equivalents == be == 32 == v["pm"]["block_equivalents"]
    assert v["recipe"]["paper"]["formula"] == f"{12 * be:g}*T*d^2 + {2 * (L + C * w / k**2):g}*T^2*d"
    per_token = {n: 3 * (12 * b * d * d + 2 * a2 * T * d) for n, (b, a2) in
                 {"recipe": (be, L + C * w / k**2), "pm": (L + C, L + C)}.items()}
    assert v["recipe"]["paper"]["training_per_token"] == pytest.approx(per_token["recipe"], rel=1e-12)
    assert s["paper"] == pytest.approx(1 - per_token["recipe"] / per_token["pm"], rel=1e-12)
    assert round(s["exact_causal"], 3) == 0.102 and round(s["exact"], 3) == 0.173


@pytest.mark.parametrize("sets,check", [
    # App. C through the CLI: a 32-layer ConceptLM at d=4096, T=8192
    (["model.size=pythia-160m", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32",
      "model.max_seq_len=8192", "train.seq_len=8192"],
     lambda a: a["savings"]["recipe_vs_pm"]["paper"] == 0.046875),
    (["model.size=ncp-archpreview-8.9b", "model.max_seq_len=8192", "train.seq_len=8192"],
     lambda a: (a["variants"]["recipe"]["block_equivalents"], a["variants"]["recipe"]["parameter_equivalent_layers"])
     == (34, 40)),
])
def test_paper_numbers_through_the_cli(sets, check) -> None:
    args = [x for s in sets for x in ("--set", s)]
    r = run_cli("profile-kernels", str(RECIPES / "debug.yaml"), "--only", "accounting", "--json", *args)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["ok"] and res["sections"] == ["accounting"]
    assert check(res["accounting"])


def test_pythia_recipe_without_data_files_profiles_the_shapes() -> None:
    r = run_cli("profile-kernels", str(RECIPES / "pythia160m.yaml"), "--only", "accounting", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert "file not found" in r.stderr and res["notes"]
    v = res["accounting"]["variants"]
    assert res["model"]["padded_vocab_size"] == 50304
    assert v["base"]["params"]["total"] == 162_322_944  # spec section 4: Pythia-160M exactly


def test_gpt2_124m_base_recipe_counts_hfs_parameters(cli):
    """`profile-kernels recipes/gpt2-124m-base.yaml --only accounting`: the base holds GPT-2's
    124,439,808 parameters at vocab 50257 (padded count beside it), with its ConceptLM and PM
    siblings' counts."""
    import json

    from ncpctl.model.accounting.flops import count_parameters
    from ncpctl.model.core.config import build_config

    r = cli("profile-kernels", str(RECIPES / "gpt2-124m-base.yaml"), "--only", "accounting", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    v = json.loads(r.stdout)["accounting"]["variants"]
    assert v["recipe"]["params"]["unpadded_total"] == 124_439_808
    assert v["recipe"]["params"]["total"] == 124_439_808 + (50304 - 50257) * 768
    # the sibling turns on the recipe's own concept settings (gpt2-common.yaml: the authors' code's)
    from ncpctl.profile.load import load_for_profile

    keys = load_for_profile(RECIPES / "gpt2-124m-base.yaml", [])[0].model_config.to_dict()["concept"]
    concept = build_config("gpt2-124m", concept={**keys, "enabled": True})
    assert v["conceptlm"]["params"]["total"] == count_parameters(concept).total > v["recipe"]["params"]["total"]
    assert v["pm"]["params"]["unpadded_total"] == 124_439_808 + 2 * 7_087_872  # two GPT-2 blocks


def test_one_flop_convention_for_budgets_fits_and_mfu() -> None:
    """Issue 40 item 3: the tiny study's d16l2 costs 679,477,248 training FLOPs per step with attention
    counted in full (1471 steps at 1e12, as train.max_flops resolves them) and 579,207,168 under the causal
    mask; the accounting section and the step's MFU numerator use the full count, the causal one has its
    own key, and the outputs that print FLOPs or MFU name the convention."""
    import io

    import torch
    from rich.console import Console

    from ncpctl.train.command import human as _human
    from ncpctl.profile.load import load_for_profile
    from ncpctl.profile.render import render
    from ncpctl.profile.step import step_section

    shape = ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "tokenizer.vocab_size=2048"]
    r, _ = load_for_profile(str(RECIPES / "scaling" / "base.yaml"), [*shape, "train.max_flops=1e12"])
    cfg = r.model_config
    assert (r.flops_per_step(), r.train.max_steps) == (679_477_248, 1471)
    a = accounting_section(cfg, seq_len=256, micro_batch=8, global_batch=8, params=False)
    exact = a["variants"]["recipe"]["exact"]
    assert (exact["training_per_step"], exact["training_per_step_causal"]) == (679_477_248, 579_207_168)
    assert exact["flop_convention"].startswith("full attention")
    step = step_section(cfg, 256, 8, "cpu", torch.float32, warmup=0, repeats=1, peak_repeats=1)
    assert (step["training_flops"], step["training_flops_causal"]) == (679_477_248, 579_207_168)
    con = Console(file=io.StringIO(), width=400)
    render(con, {"recipe": "d16l2", "model": {"name": "d16l2", "backbone": "gpt-neox", "d_model": 16,
                                              "n_token_layers": 2, "padded_vocab_size": 2048},
                 "micro_batch_size": 8, "seq_len": 256, "accounting": a, "step": step})
    text = con.file.getvalue()
    assert "exact FLOPs: full attention" in text and "ratio to GEMM peak" in text and "(full attention" in text
    _human(con, {"stage": "pretrain", "interrupted": False, "step": 10, "max_steps": 10, "tokens": 20480,
                 "trainable_parameters": 72128, "parameters": 72128,
                 "val": {}, "budget": {"kind": "flops", "value": 1e10, "flops": 6.8e9}, "steps_per_s": 15.0,
                 "tokens_per_s": 3e4, "mfu": 0.065, "steps_run": 10, "peak_flop_per_s": 1e11,
                 "peak_source": "measured", "nonfinite_steps": 0, "checkpoint": None})
    lines = con.file.getvalue().splitlines()
    assert any("MFU 6.5% (mean over 10 steps, full-attention FLOPs)" in x for x in lines), lines[-3:]
    assert any("training FLOPs spent (full-attention FLOPs)" in x for x in lines), lines[-3:]

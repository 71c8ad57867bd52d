"""``ncpctl profile-kernels recipes/ncp-archpreview-8.9b.yaml --only accounting --json`` against the
report (Table 2: 34 block-equivalents of compute for 40 blocks of parameters; Table 3: IRC + CRC
cost a small share of the FLOPs) and against exact parameter counts, pinned.

Hand check of the plain count (no IRC/CRC), 8,935,055,360:
  embeddings = LM head = 100,352 x 4,096                                  =   411,041,792 each
  token layer = 4 x 4096^2 (q, k, v, o) + 3 x 4096 x 11008 (SwiGLU)
                + 4 x 4096 (attention/MLP norms, layer-wise q/k norms)     =   202,391,552
  32 token layers 6,476,529,664 + 8 concept layers 1,619,132,416
  concept heads 4096 x (32 x 128) = 16,777,216; codebook 32 x 128 x 128 = 524,288 (learned codes, Sec.
  2.3: no SimVQ transform); final + concept norms 2 x 4096 = 8,192
  total = 822,083,584 + 6,476,529,664 + 1,619,132,416 + 16,777,216 + 524,288 + 8,192.
Unpadded: minus the 2 x (100,352 - 100,278) x 4,096 = 606,208 padding rows. IRC + CRC add
11,034,116 (IRC 5,255,644 + CRC 5,778,472: tests/model/test_accounting.py's formula at d=4096,
hidden 32, E/C/D = 16/8/16). The base sibling (32 plain layers) is OLMo-3-7B's 7,298,617,344; the PM
sibling (40 layers, Table 2's size-aligned arm) 8,917,749,760.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.model.accounting.flops import count_parameters, exact_flops
from ncpctl.recipe import load_recipe

from ..conftest import RECIPES, run_cli
from ..recipe._archpreview import OLMO3_VOCAB
from ..recipe.test_paper_recipes import _stand_ins

PLAIN, PLAIN_UNPADDED = 8_935_055_360, 8_934_449_152
IRC_CRC, IRC_CRC_UNPADDED = 8_946_089_476, 8_945_483_268
DYNAMIC_RESIDUALS = 11_034_116
BASE_32, PM_40 = 7_298_617_344, 8_917_749_760
# IRC and CRC matmul FLOPs of one 8192-token forward (ncpctl.model.accounting.flops), and their share
RESIDUAL_FLOPS = {"residual.irc": 94_318_886_912, "residual.crc": 105_731_063_808}
RESIDUAL_SHARE = 0.0014060324953376222  # 0.14% (the paper's 1B: +0.051%; see test_archpreview_recipes)
PLAIN_SETS = ["--set", "model.residual=plain", "--set", "model.crc_connections=[]"]


@pytest.fixture(scope="module")
def recipe() -> Path:
    return RECIPES / "ncp-archpreview-8.9b.yaml"


def test_counts_and_residual_share_in_process(recipe: Path, tmp_path: Path) -> None:
    cfg = load_recipe(recipe, _stand_ins(tmp_path, OLMO3_VOCAB, "int32")).model_config
    p = count_parameters(cfg)
    assert (p.total, p.unpadded_total, p.components["dynamic_residuals"]) == (IRC_CRC, IRC_CRC_UNPADDED,
                                                                               DYNAMIC_RESIDUALS)
    assert p.trainable == IRC_CRC and p.components["codebook"] == 524_288  # every weight, the learned codes too
    plain = cfg.to_dict() | {"residual": "plain", "crc_connections": []}
    q = count_parameters(type(cfg).from_dict(plain))
    assert (q.total, q.unpadded_total) == (PLAIN, PLAIN_UNPADDED) and IRC_CRC - PLAIN == DYNAMIC_RESIDUALS
    e = exact_flops(cfg, 8192)
    assert {k: v for k, v in e.components.items() if k.startswith("residual.")} == RESIDUAL_FLOPS
    assert e.residual_share == pytest.approx(RESIDUAL_SHARE, rel=1e-12)
    assert (cfg.block_equivalents, cfg.n_token_layers + cfg.concept.concept_layers) == (34, 40)


def _accounting(recipe: Path, *sets: str) -> tuple[dict, str]:
    r = run_cli("profile-kernels", str(recipe), "--only", "accounting", "--json", *sets)
    out = json.loads(r.stdout) if r.returncode == 0 else {}
    return out, r.stderr


def test_cli_without_irc_crc_34_of_40(recipe: Path) -> None:
    """The recipe with plain residuals: the exact counts with and without the padding rows, and
    the 34 vs 40 blocks of Table 2 (the concept model vs its size-aligned PM sibling)."""
    res, err = _accounting(recipe, *PLAIN_SETS)
    assert res.get("ok"), err[-2000:]
    assert "file not found" in err  # the data and tokenizer placeholders: shapes only
    v = res["accounting"]["variants"]
    assert res["model"]["padded_vocab_size"] == 100352 and res["model"]["vocab_size"] == OLMO3_VOCAB
    assert (v["recipe"]["params"]["total"], v["recipe"]["params"]["unpadded_total"]) == (PLAIN, PLAIN_UNPADDED)
    assert (v["recipe"]["block_equivalents"], v["recipe"]["parameter_equivalent_layers"]) == (34, 40)
    assert (v["pm"]["token_layers"], v["pm"]["block_equivalents"], v["pm"]["params"]["total"]) == (40, 40, PM_40)
    assert (v["base"]["token_layers"], v["base"]["params"]["total"]) == (32, BASE_32)
    # the paper formula's T*d^2 terms: 12 x 34 vs 12 x 40 (85%); attention adds 2 x (32 + 8/4^2) vs 2 x 40
    assert (v["recipe"]["paper"]["formula"], v["pm"]["paper"]["formula"]) == \
        ("408*T*d^2 + 65*T^2*d", "480*T*d^2 + 80*T^2*d")


def test_cli_with_irc_crc(recipe: Path) -> None:
    """The recipe as shipped (IRC + CRC): its counts and the IRC/CRC share of the forward FLOPs."""
    res, err = _accounting(recipe)
    assert res.get("ok"), err[-2000:]
    r = res["accounting"]["variants"]["recipe"]
    # the base and PM siblings keep IRC (a per-stack mixer) and drop CRC (no modules to connect)
    assert all(res["accounting"]["variants"][v]["exact"]["components"].get("residual.crc", 0) == 0
               and res["accounting"]["variants"][v]["exact"]["components"]["residual.irc"] > 0 for v in ("base", "pm"))
    assert (r["params"]["total"], r["params"]["unpadded_total"]) == (IRC_CRC, IRC_CRC_UNPADDED)
    assert (r["block_equivalents"], r["parameter_equivalent_layers"]) == (34, 40)
    comps = r["exact"]["components"]  # one sequence of 8192 tokens (micro batch 1)
    assert {k: comps[k] for k in RESIDUAL_FLOPS} == RESIDUAL_FLOPS
    assert sum(RESIDUAL_FLOPS.values()) / sum(comps.values()) == pytest.approx(RESIDUAL_SHARE, rel=1e-9)

"""Every `profile-kernels` section on the `debug` recipe, through the real CLI with --json
and --quick (one repeat, the smallest grid): the JSON schema, the trace file, the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ..conftest import RECIPES, run_cli

NUM = (int, float)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, str]:
    run_dir = tmp_path_factory.mktemp("profile-run")
    r = run_cli("profile-kernels", str(RECIPES / "debug.yaml"), "--quick", "--plot", "--json",
                "--set", f"run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), run_dir, r.stderr


def _has(d: dict, schema: dict) -> None:
    for key, kind in schema.items():
        assert key in d, f"missing {key}"
        assert isinstance(d[key], kind), f"{key}: {type(d[key]).__name__} is not {kind}"


def test_top_level(run) -> None:
    res, run_dir, _ = run
    _has(res, {"ok": bool, "command": str, "recipe": str, "model": dict, "seq_len": int, "micro_batch_size": int,
               "sections": list, "out_dir": str, "device": dict, "notes": list})
    assert res["ok"] and res["command"] == "profile-kernels"
    assert res["sections"] == ["accounting", "kernels", "step", "trace"]
    assert Path(res["out_dir"]) == run_dir / "profile"


def test_accounting_schema(run) -> None:
    a = run[0]["accounting"]
    _has(a, {"seq_len": int, "micro_batch_size": int, "global_batch_size": int, "tokens_per_step": int,
             "variants": dict, "savings": dict})
    assert set(a["variants"]) == {"recipe", "base", "pm"}
    for v in a["variants"].values():
        _has(v, {"token_layers": int, "concept_layers": int, "block_equivalents": NUM, "params": dict,
                 "paper": dict, "exact": dict})
        _has(v["params"], {"components": dict, "total": int, "trainable": int})
        _has(v["paper"], {"formula": str, "training_per_token": NUM, "training_per_step": NUM})
        _has(v["exact"], {"components": dict, "training_per_token": NUM, "training_per_step": NUM,
                          "concept_share": NUM})
    assert a["variants"]["recipe"]["exact"]["concept_share"] > 0 == a["variants"]["pm"]["exact"]["concept_share"]
    for s in a["savings"].values():
        _has(s, {"paper": NUM, "exact": NUM, "flops_ratio_exact": NUM})


def test_kernels_schema(run) -> None:
    k = run[0]["kernels"]
    _has(k, {"device": str, "dtype": str, "repeats": int, "warmup": int, "rows": list, "layer_ratio": dict,
             "dlcm": dict, "plots": list})
    groups = {r["group"] for r in k["rows"]}
    assert groups == {"layers", "sdpa", "concept"}
    for r in k["rows"]:
        _has(r, {"group": str, "name": str, "shape": dict})
        if r.get("available", True):
            _has(r, {"median_s": NUM, "min_s": NUM, "max_s": NUM, "spread": NUM, "repeats": int})
            assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert [r["name"] for r in k["rows"] if r["group"] == "layers"] == ["token layer", "concept layer"]
    assert any(r["group"] == "sdpa" and r.get("available") for r in k["rows"])
    _has(k["layer_ratio"], {"concept_over_token_time": NUM, "concept_over_token_flops": NUM, "k": int})
    d = k["dlcm"]
    _has(d, {"grid": dict, "rows": list, "replicated_over_per_concept": list})
    n = len(d["grid"]["seq_len"]) * len(d["grid"]["hidden"])
    assert len(d["rows"]) == 2 * n and len(d["replicated_over_per_concept"]) == n
    assert {r["name"] for r in d["rows"]} == {"per_concept", "replicated"}
    ratios = [r["replicated_over_per_concept"] for r in d["replicated_over_per_concept"]]
    gmean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert d["replicated_over_per_concept_gmean"] == pytest.approx(gmean)
    assert d["faster_form"] == ("replicated" if gmean < 1 else "per_concept")
    assert d["configured_is_faster"] == (d["configured_form"] == d["faster_form"])


def test_plot_written(run) -> None:
    plots = run[0]["kernels"]["plots"]
    assert plots and all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)


def test_step_schema(run) -> None:
    s = run[0]["step"]
    _has(s, {"device": str, "batch_size": int, "seq_len": int, "training_flops": NUM, "median_s": NUM,
             "tokens_per_s": NUM, "achieved_flop_per_s": NUM, "peak": dict, "ratio_to_peak": NUM})
    _has(s["peak"], {"kind": str, "flop_per_s": NUM})
    assert s["ratio_to_peak"] > 0


def test_trace_is_loadable(run) -> None:
    t = run[0]["trace"]
    _has(t, {"trace_path": str, "steps": int, "top_ops": list, "time_kind": str})
    trace = json.loads(Path(t["trace_path"]).read_text())
    assert trace["traceEvents"]
    assert t["top_ops"] and all({"name", "calls", "self_s", "share"} <= set(r) for r in t["top_ops"])


def test_human_output_has_every_table(tmp_path: Path) -> None:
    r = run_cli("profile-kernels", str(RECIPES / "debug.yaml"), "--quick", "--only", "accounting,trace",
                "--set", f"run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "accounting" in r.stdout and "saving of recipe vs PM" in r.stdout and "top operators" in r.stdout
    assert (tmp_path / "profile" / "trace.json").is_file()


def test_bad_section_is_a_user_error() -> None:
    r = run_cli("profile-kernels", str(RECIPES / "debug.yaml"), "--only", "accounting,nope", "--json")
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["ok"] is False


def test_kernels_on_the_dlcm_recipe(tmp_path) -> None:
    """debug-dlcm (dynamic segments, a concept transformer twice as wide): the kernels section runs."""
    r = run_cli("profile-kernels", str(RECIPES / "debug-dlcm.yaml"), "--quick", "--only", "kernels", "--json",
                "--set", f"run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    k = json.loads(r.stdout)["kernels"]
    assert {r["name"] for r in k["dlcm"]["rows"]} == {"per_concept", "replicated"}
    heads = next(r for r in k["rows"] if r["name"].startswith("heads"))
    assert heads["median_s"] > 0

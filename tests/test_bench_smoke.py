"""Every bench/ script runs at its smallest size (issue 41 item 3: ``bench/cdlm.py`` crashed at HEAD
once ``token_context`` took ``doc_ids``, and nothing noticed). These are smoke tests: they check
that a script runs to the end and reports what it promises, never its timings.

Most scripts run in this process (``main`` with a patched ``sys.argv``: a new interpreter costs
~3 s of imports each); a script's own child processes (``adapt.py``, ``memory.py``: one per arm)
run in this process too, through their ``--child`` entry points, by patching the script's
``subprocess.run``. ``checksum.py`` (a DeepSpeed engine) and ``versions.py`` (workers reading
stdin) run as real processes. ``gpu_check.py --dry``, ``replicate_conceptlm.py`` and
``run_all.py`` and ``cdlm_bound.py`` have tests of their own (tests/profile/test_gpu_check.py,
tests/test_replicate_bench.py, tests/test_bench_run_all.py, tests/model/test_diffusion_elbo.py)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .conftest import REPO

BENCH = REPO / "bench"
# scripts tested elsewhere (see the docstring)
ELSEWHERE = {"gpu_check", "replicate_conceptlm", "run_all", "cdlm_bound"}  # cdlm_bound: tests/model/test_diffusion_elbo.py


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_smoke_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bench(monkeypatch, capsys):
    """``bench(name, *argv) -> (exit code, stdout)``: the script's ``main`` in this process, with its
    torch threads and ``sys.path`` edits undone afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(name: str, *argv: str, mod=None):
        mod = mod or _load(name)
        monkeypatch.setattr(sys, "argv", [str(BENCH / f"{name}.py"), *argv])
        capsys.readouterr()
        try:
            rc = mod.main()
        except SystemExit as e:
            rc = e.code
        return rc or 0, capsys.readouterr().out

    yield run
    torch.set_num_threads(threads)


def _children_in_process(mod, monkeypatch) -> None:
    """The script's ``subprocess.run([python, script, *args])`` answered by its own ``main(args)``
    in this process (stdout captured as the child's)."""
    def run(cmd, **kw):
        assert Path(cmd[1]).resolve() == Path(mod.__file__).resolve(), cmd
        out, argv = io.StringIO(), sys.argv
        sys.argv = [cmd[1], *cmd[2:]]  # for a main() that reads sys.argv
        try:
            with redirect_stdout(out):
                rc = mod.main()
        finally:
            sys.argv = argv
        return SimpleNamespace(returncode=rc or 0, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(mod.subprocess, "run", run)


def _last_json(out: str):
    """The JSON object a script prints last (indented or on one line)."""
    lines = out.splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("{"))
    return json.loads("\n".join(lines[first:]))


def test_every_bench_script_has_a_smoke_test() -> None:
    """A new script gets a test here (or one of its own, listed in ELSEWHERE)."""
    text = Path(__file__).read_text()
    untested = [p.stem for p in BENCH.glob("*.py")
                if p.stem not in ELSEWHERE and f"def test_{p.stem}_" not in text]
    assert not untested, f"bench scripts without a smoke test: {untested}"


def test_cdlm_runs_at_debug_size(bench) -> None:
    """The crash of issue 41 item 3: the two-copy model's token context takes doc_ids."""
    rc, out = bench("cdlm", "--sizes", "debug", "--seq-len", "32", "--block", "16", "--rounds", "1",
                    "--threads", "1", "--json")
    res = _last_json(out)["results"][0]
    assert rc == 0 and set(res["ratios"]) == {"cdlm/ar", "cdlm/bd"}
    assert all(v > 0 for v in res["first_loss"].values())


def test_attention_stats_runs(bench) -> None:
    rc, out = bench("attention_stats", "--set", "train.seq_len=32", "--micro-batch", "1", "--rounds", "1",
                    "--threads", "1", "--json")
    res = _last_json(out)
    assert rc == 0 and res["seq_len"] == 32 and res["per_call/step"]["wall"] > 0


def test_cdlm_sampling_runs(bench) -> None:
    rc, out = bench("cdlm_sampling", "--prompt", "3", "--new", "16", "--repeats", "1", "--json")
    res = _last_json(out)
    assert rc == 0 and res["same_tokens"] and res["new_tokens"] == 16


def test_dlcm_decode_runs(bench) -> None:
    rc, out = bench("dlcm_decode", "--d-model", "64", "--prompt", "8", "--steps", "4", "--repeats", "1",
                    "--batches", "1", "--json")
    res = _last_json(out)
    assert rc == 0 and set(res["batches"]) == {"1"} and res["batches"]["1"]["ratio_matched"] > 0


def test_fit_coverage_runs_two_replicates(bench) -> None:
    rc, out = bench("fit_coverage", "--replicates", "2", "--resamples", "4", "--starts", "1", "--json")
    res = _last_json(out)
    assert rc == 0 and res["replicates"] == 2 and 0 <= res["coverage_90"] <= 1


def test_optim_runs(bench) -> None:
    rc, out = bench("optim", "--d-model", "64", "--seq-len", "32", "--micro-batch", "2", "--tokens-per-d", "1",
                    "--rounds", "1", "--threads", "1", "--json")
    res = _last_json(out)
    assert rc == 0 and res["muon/adamw"] > 0 and res["muon_matrices"] > 0


def test_adapt_runs_its_three_arms(bench, monkeypatch) -> None:
    mod = _load("adapt")
    _children_in_process(mod, monkeypatch)
    monkeypatch.setattr(mod, "T", 32)  # the script's CPU shape, narrower, at 32 tokens
    monkeypatch.setattr(mod, "SHAPE", {**mod.SHAPE, "d_model": 64, "n_heads": 4, "ffn_dim": 172, "vocab_size": 512})
    rc, out = bench("adapt", "--rounds", "1", "--steps", "1", "--threads", "1", "--json", mod=mod)
    res = _last_json(out)
    assert rc in (0, 1) and set(res["memory_mb"]) == {"vq", "lora", "full"}  # 1: a goal missed
    assert res["trainable"]["vq"] < res["trainable"]["full"] and res["median_ratios"]["vq/full tokens/s"] > 0


def test_memory_runs_two_arms(bench, monkeypatch) -> None:
    mod = _load("memory")
    _children_in_process(mod, monkeypatch)
    monkeypatch.setattr(mod, "T", 32)
    monkeypatch.setattr(mod, "B", 2)
    monkeypatch.setattr(mod, "SETS", [s for s in mod.SETS if "seq_len" not in s and "n_layers" not in s])
    rc, out = bench("memory", "--arms", "none", "full", "--warmup", "0", "--steps", "1", "--json", mod=mod)
    res = _last_json(out)
    assert rc in (0, 1) and set(res["arms"]) == {"none", "full"}
    assert res["loss_vs_none"]["full"] < 1e-6  # checkpointing recomputes the same step


def test_tokenize_runs_on_a_small_corpus(bench, text_corpus) -> None:
    rc, out = bench("tokenize", "--corpus", f"{text_corpus}/*.txt", "--repeat", "1", "--no-num-proc", "--json")
    res = _last_json(out)
    assert rc in (0, 1) and res["tokens"] > 0


def test_train_step_runs_at_debug_size(bench, monkeypatch) -> None:
    mod = _load("train_step")
    gemm = mod.cpu_gemm_peak
    monkeypatch.setattr(mod, "cpu_gemm_peak", lambda n=2048, repeats=5: gemm(n=256, repeats=1))  # not 2048^3
    rc, out = bench("train_step", "--sizes", "debug", "--concept-size", "debug", "--seq-len", "32", "--rounds", "1",
                    "--threads", "1", "--json", mod=mod)
    res = _last_json(out)
    assert rc == 0 and {"ours/hf debug", "flops/peak debug", "concept/pm debug"} <= set(res["ratios"])


def test_eval_runs_at_a_tiny_shape(bench) -> None:
    # a vocabulary the model does not pad: the export's padded rows would take probability from HF's
    rc, out = bench("eval", "--vocab", "512", "--requests", "4", "--batch-size", "2", "--new-tokens", "8",
                    "--decode-steps", "4", "--d-model", "64", "--layers", "1", "--heads", "2", "--json")
    res = _last_json(out)
    assert rc == 0 and res["loglikelihood"]["max_abs_ll_diff"] < 1e-3 and len(res["ratios"]) == 3


def test_speculative_runs_on_a_debug_checkpoint(bench, runs, tmp_path) -> None:
    (tmp_path / "prompts.txt").write_text("def main(argv):\nimport os\n")
    rc, out = bench("speculative", "--target", str(runs["base"]), "--draft", str(runs["base"]), "-k", "2",
                    "--prompts", str(tmp_path / "prompts.txt"), "--new", "6", "--batch", "1", "--repeats", "1",
                    "--json")
    (row,) = _last_json(out)["results"]
    assert rc == 0 and row["same_tokens"] and row["draft_tokens"] == 2 and row["mal"] > 1  # drafting itself


def test_target_outputs_runs_on_a_debug_checkpoint(bench, runs, tmp_path) -> None:
    from ncpctl.data.indexed import IndexedDataset

    data = runs["base"].parents[1] / "data"  # run.dir/data
    rc, out = bench("target_outputs", "--target", str(runs["base"]), "--data", str(data), "--out",
                    str(tmp_path / "own"), "--sequences", "2", "--prompt", "4", "--new", "3", "--batch", "2")
    assert rc == 0 and len(IndexedDataset(tmp_path / "own" / "train")) == 2
    assert [len(d) for d in IndexedDataset(tmp_path / "own" / "val")] == [7]


def test_steering_runs_on_a_bottleneck_checkpoint(bench, tmp_path) -> None:
    """The scoring half on an untrained debug-size bottleneck model with the ast labeller's
    concepts (training one is ``ncpctl pretrain``'s business, tested with it)."""
    from ncpctl.checkpoint import save_model_files
    from ncpctl.data.labels import PYTHON_CONCEPTS
    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel

    names = list(PYTHON_CONCEPTS)
    torch.manual_seed(0)
    cfg = build_config("debug", vocab_size=320, max_seq_len=64, concept=dict(enabled=False),
                       bottleneck=dict(enabled=True, concepts=len(names), rank=8, chunk=16))
    ck = tmp_path / "run" / "checkpoints" / "step_0000001"
    save_model_files(ck, NCPModel(cfg).eval(), step=1, tokens_seen=0, recipe=None,
                     tokenizer_path=REPO / "tests" / "fixtures" / "ckpt_v1_neox" / "tokenizer.json",
                     extra={"concept_names": names})
    (ck.parent / "latest").write_text(ck.name + "\n")
    rc, out = bench("steering", "--run-dir", str(tmp_path / "run"), "--no-steering-stage", "--prompts", "1",
                    "--samples", "1", "--tokens", "3", "--strengths", "1", "--threads", "1", "--json")
    res = _last_json(out)["pretrained"]
    assert rc == 0 and set(res["summary"]) == {"none", "prompt", "steer@1"} and res["rows"]


def _script(name: str, *argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *argv], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{name} {shlex.join(argv)}:\n{proc.stderr[-3000:]}"
    return proc


def test_checksum_runs_one_small_save(tmp_path) -> None:
    """Its own process: it starts a DeepSpeed engine (a process group) for a real save."""
    res = _last_json(_script("checksum", "--mb", "1", "--repeat", "1", "--saves", "1", "--json",
                             tmp_path=tmp_path).stdout)
    assert res["speed"]["file_mb_s"] > 0 and 0 < res["debug_save"]["share"] < 1


def test_versions_runs_this_tree_against_itself(tmp_path) -> None:
    """Its workers read requests on stdin: real processes, one per (tree, model)."""
    proc = _script("versions", "--before", str(REPO), "--after", str(REPO), "--pairs", "1", "--models", "ours",
                   "--size", "debug", "--seq-len", "16", "--repeats", "1", "--threads", "1", "--json", tmp_path=tmp_path)
    ours = _last_json(proc.stdout)["models"]["ours"]
    assert ours["first_loss"]["before"] == ours["first_loss"]["after"] and len(ours["pairs"]) == 1


def test_steerling_load_maps_a_tiny_steerling_directory(bench, monkeypatch, tmp_path) -> None:
    """The script's synthetic Steerling directory at a tiny shape (its 1.1B model is 2.3 GB), loaded
    by its child entry point in this process."""
    mod = _load("steerling_load")
    _children_in_process(mod, monkeypatch)
    monkeypatch.setattr(mod, "ARCH", {**mod.ARCH, "n_layers": 1, "n_head": 4, "n_embd": 64, "n_kv_heads": 2,
                                      "block_size": 128, "vocab_size": 320, "mask_token_id": 319})
    monkeypatch.setattr(mod, "CONCEPT", {**mod.CONCEPT, "n_concepts": 16, "n_unknown_concepts": 48, "concept_dim": 64,
                                         "topk_known": 4, "topk_known_features": 4, "unknown_topk": 8,
                                         "factorize_rank": 8})
    rc, out = bench("steerling_load", "--dir", str(tmp_path / "steerling"), "--json", mod=mod)
    res = _last_json(out)
    assert rc == 0 and res["parameters"] > 0 and res["peak_over_weights"] > 0

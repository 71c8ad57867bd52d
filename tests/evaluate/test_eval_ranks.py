"""Data-parallel scoring under a launcher (issue 47 item 5): two CPU ranks (torchrun, gloo) each score
their share of `ncp_offline` (a perplexity, a multiple-choice and a generation task; 5 documents, so
the ranks hold 3 and 2 and one repeats a request to even out the batches) and rank 0 writes one
result: equal to one process's (log-likelihoods to 1e-6, the same greedy generations)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ncpctl.evaluate.run import evaluate, resolve_target
from ncpctl.evaluate.samples import per_example_of


def _samples(res: dict, results_file: Path, task: str) -> list[dict]:
    path = results_file.parent / res["samples"][task]
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_give_one_ranks_result(runs, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["concept"].parent.parent, run, symlinks=True, ignore=shutil.ignore_patterns("eval"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with socket.socket() as sock:  # a free port for the rendezvous (other launches may run beside this one)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    args = ["eval", str(run), "--tasks", "ncp_offline", "--limit", "5", "--batch-size", "2", "--log-samples",
            "--no-cache", "--json"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                        "-m", "ncpctl", *args, "--out", str(tmp_path / "two")], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    printed = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    two = json.loads(printed[0])
    assert len(printed) == 1 and two["ranks"] == 2  # rank 0 alone prints and writes
    one = evaluate(resolve_target(str(run), [], ["ncp_offline"], 2, 5, None, str(tmp_path / "one"), log_samples=True,
                                  cache=False))
    # summed over the ranks: every request once, plus the repeats that even out the ranks' batches (3 vs 2 docs)
    assert one["requests"] < two["requests"] <= one["requests"] + 4 + 1 + 1
    f1, f2 = Path(one["files"]["json"]), tmp_path / "two" / Path(one["files"]["json"]).name
    r1, r2 = (json.loads(f.read_text()) for f in (f1, f2))
    assert set(r1["results"]) == set(r2["results"])
    for task, row in r1["results"].items():
        for k, v in row.items():
            if isinstance(v, float):
                assert r2["results"][task][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (task, k)
    assert r2["n-samples"] == r1["n-samples"]
    for task in ("ncp_cloze", "ncp_last_ident"):  # every example's scores, on the same examples
        assert per_example_of(r2, f2, task) == per_example_of(r1, f1, task)
    gen1, gen2 = (_samples(r, f, "ncp_last_ident") for r, f in ((r1, f1), (r2, f2)))
    assert [g["response"] for g in gen2] == [g["response"] for g in gen1]  # greedy generations: identical
    lls1, lls2 = (_samples(r, f, "ncp_cloze") for r, f in ((r1, f1), (r2, f2)))
    for a, b in zip(lls1, lls2):
        assert b["loglikelihoods"] == pytest.approx(a["loglikelihoods"], rel=1e-6)
    s1, s2 = (r["perplexity"]["per_set"]["ncp_heldout_ppl"] for r in (r1, r2))
    assert s2["tokens"] == s1["tokens"] and s2["nll"] == pytest.approx(s1["nll"], rel=1e-6)  # summed over the ranks

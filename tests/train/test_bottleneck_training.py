"""The concept bottleneck trained through the CLI on labelled data (``data.labels: python-ast``):
the loop hands each micro-batch its label evidence, validation reports the held-out detection
AUC, checkpoints record the concept names, ``generate --steer concept=NAME`` resolves them; and
the mismatches (no labels, a wrong concept count, an unknown concept) are one error line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ..conftest import RECIPES, ncpctl_cmd
from .conftest import ENV, metrics, ncpctl, result


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in corpus cut to 80 documents with python-ast labels, 512-token BPE."""
    root = tmp_path_factory.mktemp("labelled")
    recipe = root / "tok.yaml"
    recipe.write_text("data:\n  sources: [builtin:python-stdlib]\n  max_documents: 80\n  val_fraction: 0.1\n"
                      f"  labels: python-ast\ntokenizer:\n  vocab_size: 512\nrun:\n  dir: {root / 'run'}\n")
    proc = subprocess.run([*ncpctl_cmd(), "tokenize", str(recipe)], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return root / "run" / "data"


def _sets(data: Path, run: Path, *extra: str) -> list[str]:
    sets = [f"data.train_prefix={data / 'train'}", f"data.val_prefix={data / 'val'}",
            f"tokenizer.path={data / 'tokenizer.json'}", f"run.dir={run}", "tokenizer.vocab_size=512",
            "train.max_steps=40", "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.eval_every=40", "train.eval_batches=4", "train.save_every=40", "train.plots=false",
            "train.attention_stats_every=0", "model.max_seq_len=64", "model.bottleneck.teacher_forcing_steps=20",
            *extra]
    return [x for s in sets for x in ("--set", s)]


@pytest.fixture(scope="module")
def trained(labelled: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("bottleneck") / "run"
    r = result(ncpctl("pretrain", str(RECIPES / "debug-bottleneck.yaml"), "--json", *_sets(labelled, run)))
    assert r["step"] == 40 and r["nonfinite_steps"] == 0
    return run


def test_the_loop_feeds_labels_and_reports_detection(trained: Path, labelled: Path) -> None:
    train = metrics(trained)
    assert all("concept_loss" in m and "teacher_forcing" in m for m in train)
    first, last = train[0]["concept_loss"], train[-1]["concept_loss"]
    assert last < 0.8 * first  # the known head learns the labels it is fed
    (val,) = metrics(trained, "val")
    # held-out chunks of the validation split: the per-concept (macro) AUC with its interval, over the
    # concepts the split can score, and the pooled AUC beside the input-free base rate's (issue 20 item 8)
    assert val["concept_auc_low"] <= val["concept_auc"] <= val["concept_auc_high"], val
    assert val["concept_auc_concepts"] + val["concept_auc_skipped"] == 16 and val["concept_auc_concepts"] >= 4
    assert 0.5 < val["concept_auc_pooled_base_rate"] < 1 and 0 < val["concept_auc_pooled"] <= 1
    ck = trained / "checkpoints" / "step_0000040"
    names = json.loads((ck / "ncpctl.json").read_text())["concept_names"]
    assert names == json.loads((labelled / "meta.json").read_text())["labels"]["vocabulary"]


def test_steering_by_concept_name(trained: Path) -> None:
    ck = str(trained / "checkpoints" / "step_0000040")
    base = result(ncpctl("generate", ck, "-p", "def main(argv):", "-n", "12", "--greedy", "--json"))
    steer = result(ncpctl("generate", ck, "-p", "def main(argv):", "-n", "12", "--greedy", "--json",
                          "--steer", "concept=exception_handling,strength=6logit,at=decoder.3"))
    assert steer["steer"][0][0]["direction"] == "concept:exception_handling"
    assert steer["completions"][0]["text"] != base["completions"][0]["text"]
    bad = ncpctl("generate", ck, "-p", "x", "-n", "2", "--steer", "concept=nope,strength=2logit")
    assert bad.returncode == 2
    (err,) = [x for x in bad.stderr.splitlines() if x.startswith("error: ")]
    assert "unknown concept 'nope'; the 16 known: class_definition, function_definition" in err


@pytest.mark.parametrize("extra,message", [
    (["model.bottleneck.concepts=12"], "model.bottleneck.concepts: 12, but the dataset's label vocabulary has 16 names"),
])
def test_label_mismatches(labelled: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    r = ncpctl("pretrain", str(RECIPES / "debug-bottleneck.yaml"), *_sets(labelled, tmp_path / "r", *extra))
    assert r.returncode == 2
    (err,) = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert message in err, r.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_dataset_without_labels(tiny_data: Path, tmp_path: Path) -> None:
    r = ncpctl("pretrain", str(RECIPES / "debug-bottleneck.yaml"), *_sets(tiny_data, tmp_path / "r"))
    assert r.returncode == 2
    (err,) = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert "the dataset has no concept labels, but model.bottleneck is on" in err


def test_inspect_reports_the_exact_attribution(trained: Path) -> None:
    """``ncpctl inspect`` on a bottleneck checkpoint: every scored logit is known + unknown +
    residual to float precision, the concepts carry their names, and --target scores the target."""
    ck = str(trained / "checkpoints" / "step_0000040")
    prompt = "import re\ntry:\n    m = re.match(p, s)\nexcept ValueError:\n    raise"
    r = result(ncpctl("inspect", ck, "-p", prompt, "--json"))
    (p,) = r["prompts"]
    rep = p["bottleneck"]
    assert rep["attribution_error"] < 1e-4 and len(rep["positions"]) == p["tokens"]
    for q in rep["positions"]:
        assert q["known"] + q["unknown"] + q["residual"] == pytest.approx(q["logit"], abs=1e-4)
        assert 0.0 <= q["share"] <= 1.0
    names = json.loads((Path(ck) / "ncpctl.json").read_text())["concept_names"]
    assert {c["concept"] for ch in rep["chunks"] for c in ch["concepts"]} <= set(names)
    t = result(ncpctl("inspect", ck, "-p", "import os\n", "--target", "import sys", "--json"))
    tgt = t["prompts"][0]["bottleneck"]["positions"]
    assert [q["text"] for q in tgt] and "".join(q["text"] for q in tgt) == "import sys"


def test_a_steering_stage_continues_a_bottleneck_run(trained: Path, labelled: Path, tmp_path: Path) -> None:
    """``ncpctl midtrain recipes/debug-bottleneck-steer.yaml`` from a bottleneck run: the stage may
    change the bottleneck's training terms (Steerling's mid-training: dropout, teacher forcing, the
    steering weights) but not its shape; it derives lift tokens from the train split's labels,
    logs the respond and express losses in training only, and with the injection in a layer's
    stream (L_respond on) the injected direction comes to raise k_c: L_respond falls."""
    run = tmp_path / "steer"
    ck = trained / "checkpoints" / "step_0000040"
    sets = _sets(labelled, run, f"train.init_from={ck}", "train.max_steps=30", "train.eval_every=30",
                 "train.save_every=30", "train.lr=3e-3", "model.bottleneck.respond_weight=1",
                 "model.bottleneck.steer_at=decoder.2")
    proc = ncpctl("midtrain", str(RECIPES / "debug-bottleneck-steer.yaml"), "--json", *sets)
    r = result(proc)
    assert r["step"] == 30 and r["nonfinite_steps"] == 0
    assert "steering stage: 16 lift tokens per concept from the train split's labels" in proc.stderr
    train, (val,) = metrics(run), metrics(run, "val")
    assert all("respond_loss" in m and "express_loss" in m for m in train)
    assert "respond_loss" not in val and "express_loss" not in val
    first = sum(m["respond_loss"] for m in train[:5]) / 5
    last = sum(m["respond_loss"] for m in train[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert (run / "checkpoints" / "step_0000030" / "tokenizer.json").is_file()
    # a key that shapes the weights still has to match the checkpoint
    bad = ncpctl("midtrain", str(RECIPES / "debug-bottleneck-steer.yaml"), *sets,
                 "--set", "model.bottleneck.rank=16", "--set", f"run.dir={tmp_path / 'bad'}")
    assert bad.returncode == 2
    (err,) = [x for x in bad.stderr.splitlines() if x.startswith("error: ")]
    assert "model.bottleneck.rank" in err, bad.stderr


def test_zero3_trains_the_bottleneck_and_its_steering_stage_as_zero2(trained: Path, labelled: Path,
                                                                      tmp_path: Path) -> None:
    """Two ranks, the steering stage (which reads K and the LM head's weight in NCPModel.forward,
    outside their modules: declared to ZeRO-3 by the loop) and the bottleneck's parts (returned as
    a dict, so ZeRO-3 gathers K, A and B again for their backward): ZeRO-3 gives ZeRO-2's losses."""
    ck = trained / "checkpoints" / "step_0000040"
    losses = {}
    for stage in (2, 3):
        run = tmp_path / f"z{stage}"
        sets = _sets(labelled, run, f"train.init_from={ck}", "train.max_steps=3", "train.eval_every=0",
                     "train.save_every=0", f"deepspeed.zero_stage={stage}", "model.bottleneck.respond_weight=1",
                     "model.bottleneck.steer_at=decoder.2")
        result(ncpctl("midtrain", str(RECIPES / "debug-bottleneck-steer.yaml"), "--json", *sets, launcher_ranks=2))
        losses[stage] = [(m["loss"], m["respond_loss"], m["express_loss"]) for m in metrics(run)]
    assert len(losses[2]) == 3
    for a, b in zip(losses[2], losses[3]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_document_level_labels_are_recorded_and_never_teacher_forced(tmp_path: Path) -> None:
    """Issue 20 item 9: a ``field`` dataset records which concepts came as document labels (on every
    token of their document); teacher forcing with them is refused in one line before training."""
    text = "import os\n\ndef f(x):\n    return os.path.join(x, 'a')\n\n" * 6
    docs = [{"text": text, "concepts": ["python", {"concept": "imports", "start": 0, "end": 9}]} for _ in range(29)]
    docs.append({"text": text, "concepts": [{"concept": "stdlib"}]})  # a span over the whole text: document-level
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    tok = tmp_path / "tok.yaml"
    tok.write_text(f"data:\n  sources: [{src}]\n  val_fraction: 0.2\n  labels: field\ntokenizer:\n  vocab_size: 300\n"
                   f"run:\n  dir: {tmp_path / 'run'}\n")
    proc = subprocess.run([*ncpctl_cmd(), "tokenize", str(tok)], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = tmp_path / "run" / "data"
    labels = json.loads((data / "meta.json").read_text())["labels"]
    assert labels["vocabulary"] == ["python", "imports", "stdlib"]
    assert labels["document_level"] == ["python", "stdlib"]
    r = ncpctl("pretrain", str(RECIPES / "debug-bottleneck.yaml"),
               *_sets(data, tmp_path / "r", "model.bottleneck.concepts=3", "model.bottleneck.rank=4",
                        "tokenizer.vocab_size=300"))
    assert r.returncode == 2
    (err,) = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert ("teacher forcing with document-level labels (python, stdlib) would show every position its "
            "document's future") in err
    assert not (tmp_path / "r" / "checkpoints").exists()

"""recipes/drafters/: NCP-ArchPreview Table 9's drafter pair (without / with Eq. 26's concept
injection) at debug size and at the report's 1.1B shape; each pair differs only in the injection,
and the 1.1B drafter has the report's size; the debug pair trains with ``ncpctl train-drafter`` and
its checkpoint drives ``ncpctl eval --speculative``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from ncpctl.recipe import load_recipe
from ncpctl.train.stages import make_stage
from tests.train.conftest import ENV, tiny_data  # noqa: F401 - the shared tokenized test corpus

from ..conftest import RECIPES, ncpctl_cmd
from ..model._helpers import build, tiny
from .test_adapt_recipes import stage1_config  # noqa: F401 - the 8.9B target's model config
from .test_paper_recipes import _diff, _stand_ins

DRAFTERS = RECIPES / "drafters"
INJECTION = {"train.drafter.concept_injection", "train.drafter.concept_source"}


def _target(root: Path, vocab: int, tokenizer: Path | None, cfg: dict | None = None) -> str:
    """A target checkpoint: a tiny model's weights, or only the ncpctl.json of ``cfg`` (the 8.9B)."""
    from ncpctl.checkpoint import save_model_files

    if cfg is not None:
        ck = root / "checkpoints" / "step_0000001"
        ck.mkdir(parents=True)
        (ck / "ncpctl.json").write_text(json.dumps({"format": "ncpctl-checkpoint", "model_config": cfg}))
        return str(ck)
    model = build(tiny("neox", vocab_size=vocab, concept=dict(k=4)), scale=0.05)
    save_model_files(root, model, step=0, tokens_seen=0, recipe=None, tokenizer_path=tokenizer)
    return str(root)


def test_the_family(tmp_path: Path) -> None:
    assert {p.stem for p in DRAFTERS.glob("*.yaml")} == {
        f"{s}-{arm}" for s in ("debug", "archpreview-1.1b") for arm in ("common", "base", "concept")}


def test_the_debug_pair_differs_only_in_the_injection(tmp_path: Path, tiny_data: Path) -> None:  # noqa: F811
    target = _target(tmp_path / "target", 512, tiny_data / "tokenizer.json")
    sets = [f"train.init_from={target}", f"data.train_prefix={tiny_data}/train", f"data.val_prefix={tiny_data}/val",
            "train.seq_len=32"]
    got = {arm: load_recipe(DRAFTERS / f"debug-{arm}.yaml", sets).to_dict() for arm in ("common", "base", "concept")}
    assert _diff(got["common"], got["base"]) == set()
    assert _diff(got["base"], got["concept"]) == {"train.drafter.concept_injection"}
    assert got["base"]["train"]["seed"] == got["concept"]["train"]["seed"]


def test_the_1_1b_pair_has_the_report_shape(tmp_path: Path, stage1_config: dict) -> None:
    from ncpctl.model.designs.drafter.module import BlockDrafter
    from ncpctl.train.designs.drafter import drafter_config

    sets = [*_stand_ins(tmp_path / "files", 100278, "int32"),
            f"train.init_from={_target(tmp_path / 'target', 0, None, stage1_config)}"]
    got = {arm: load_recipe(DRAFTERS / f"archpreview-1.1b-{arm}.yaml", sets) for arm in ("common", "base", "concept")}
    assert _diff(got["common"].to_dict(), got["base"].to_dict()) == set()
    assert _diff(got["base"].to_dict(), got["concept"].to_dict()) == INJECTION - {"train.drafter.concept_source"}
    counts = {}
    for arm in ("base", "concept"):
        r = got[arm]
        assert make_stage(r, "train-drafter").wrap is not None and r.model_config.to_dict() == stage1_config
        cfg = drafter_config(r)
        assert cfg.target_layers == [0, 8, 16, 23, 31] and cfg.k == 16  # five layers spread evenly, horizon 16
        with torch.device("meta"):
            counts[arm] = sum(p.numel() for p in BlockDrafter(cfg).parameters())
    assert counts["base"] == 1_095_815_168 and counts["concept"] - counts["base"] == 40_960  # 1.1B, +0.04M


def test_debug_concept_drafter_trains_and_reports_mal(tmp_path: Path, tiny_data: Path) -> None:  # noqa: F811
    """The +concept debug recipe (the base one differs only in the switch, above), sized down with
    --set only, against a tiny target on the test corpus: 2 steps; its checkpoint describes itself
    (config, concept source, target) to ``eval --speculative``'s library, which reports MAL per task
    (the command's refusals run through the CLI in tests/inference/test_block_drafter.py)."""
    from ncpctl.evaluate.speculative import speculative_mal

    target = _target(tmp_path / "target", 512, tiny_data / "tokenizer.json")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "task": t}) + "\n"
                               for p, t in (("def main(", "code"), ("import os", "code"), ("The ", "text"))))
    small = [f"train.init_from={target}", f"data.train_prefix={tiny_data}/train", f"data.val_prefix={tiny_data}/val",
             "train.seq_len=32", "train.micro_batch_size=4", "train.max_steps=2", "train.eval_every=0",
             "train.eval_batches=1", "train.drafter.k=4", "train.drafter.window=8", "train.drafter.anchors=4"]
    for arm in ("concept",):
        sets = [*small, f"run.dir={tmp_path / arm}"]
        r = subprocess.run([*ncpctl_cmd(), "--json", "train-drafter", str(DRAFTERS / f"debug-{arm}.yaml"),
                            *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, env=ENV,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        ck = Path(json.loads(r.stdout)["checkpoint"])
        meta = json.loads((ck / "ncpctl.json").read_text())["drafter"]
        assert meta["config"]["concept_injection"] and meta["config"]["concept_source"] == "pooled"
        assert meta["target"] == target
        out = speculative_mal(target, str(ck), prompts=str(prompts), new_tokens=12, horizon=4)  # eval --speculative
        assert set(out["tasks"]) == {"code", "text"} and out["horizon"] == 4
        assert all(1.0 <= t["mal"] <= 5.0 and t["rounds"] >= 1 for t in out["tasks"].values())
        assert out["concept_source"] == "pooled" and "one chain" in out["verification"]


def test_resuming_another_drafter_is_refused(tmp_path: Path, tiny_data: Path) -> None:  # noqa: F811
    """A run.dir whose checkpoints hold another drafter (here: the other concept source, same
    weights' shapes) is not resumed silently."""
    from ncpctl.errors import UserError
    from ncpctl.train.designs.drafter import drafter_config

    target = _target(tmp_path / "target", 512, tiny_data / "tokenizer.json")
    sets = [f"train.init_from={target}", f"data.train_prefix={tiny_data}/train", f"data.val_prefix={tiny_data}/val",
            "train.seq_len=32"]
    r = load_recipe(DRAFTERS / "debug-concept.yaml", sets)
    stage = make_stage(r, "train-drafter")
    mine = drafter_config(r).to_dict()
    stage.check_resume(tmp_path, {"drafter": {"config": mine}})  # the same drafter: resumes
    with pytest.raises(UserError, match=r"concept_source \('predicted', now 'pooled'\)") as e:
        stage.check_resume(tmp_path, {"drafter": {"config": {**mine, "concept_source": "predicted"}}})
    assert len(e.value.problems) == 1


def test_drafter_runs_only_as_train_drafter_on_a_plain_target(tmp_path: Path, tiny_data: Path) -> None:  # noqa: F811
    """train.drafter belongs to the stage that declares it trains one (any other refuses it), and a
    train-drafter run carries no hooks but those that declare they go with a drafter."""
    from ncpctl.errors import UserError

    target = _target(tmp_path / "target", 512, tiny_data / "tokenizer.json")
    sets = [f"train.init_from={target}", f"data.train_prefix={tiny_data}/train", f"data.val_prefix={tiny_data}/val",
            "train.seq_len=32"]
    r = load_recipe(DRAFTERS / "debug-concept.yaml", sets)
    assert make_stage(r, "train-drafter").trains_drafter
    for name in ("pretrain", "midtrain"):
        with pytest.raises(UserError, match="a drafter is trained with `ncpctl train-drafter`"):
            make_stage(r, name)
    plain = r"a drafter trains against a plain target run; this one adds train.plots \(the codebook plots\)"
    with pytest.raises(UserError, match=plain):
        make_stage(load_recipe(DRAFTERS / "debug-concept.yaml", [*sets, "train.plots=true"]), "train-drafter")

"""Paper protocols (ncpctl.evaluate.protocol): per-task shots reach lm-eval, each paper aggregate equals
the hand computation, a group naming an unknown task is one line, a member without data is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncpctl.errors import UserError
from ncpctl.evaluate import protocol
from ncpctl.evaluate.run import load_tasks, our_tasks

PAPER_GROUPS = ("conceptlm_table1", "conceptlm_8b", "dlcm_table2", "archpreview_table1", "archpreview_general")


def _tiny_tasks(root: Path, members: str) -> Path:
    """A local multiple-choice task (10 docs 'Q: qN' -> 'A: aN') and a protocol group over it."""
    rows = [{"q": f"q{i}", "choices": [f"a{i}", f"b{i}"], "label": 0} for i in range(10)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_qa.yaml").write_text(
        "task: tiny_qa\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{train: {root / 'qa.jsonl'}, test: {root / 'qa.jsonl'}}}}}\n"
        "output_type: multiple_choice\ntraining_split: train\ntest_split: test\n"
        "doc_to_text: 'Q: {{q}}\nA:'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\nmetadata: {version: 1.0}\n")
    (root / "tiny_group.yaml").write_text(
        f"group: tiny_group\ntask:\n{members}\n"
        "metadata: {version: 1.0, aggregate: {name: Avg Acc, rule: unweighted_mean}}\n")
    return root


class _Recorder:
    """An lm-eval LM that records each context and prefers the first choice."""

    def __new__(cls):
        from lm_eval.api.model import LM

        class Rec(LM):
            contexts: list[str] = []

            def loglikelihood(self, requests):
                out = []
                for r in requests:
                    ctx, cont = r.args
                    Rec.contexts.append(ctx)
                    out.append((-float(cont.strip().startswith("b")), True))
                return out

            def loglikelihood_rolling(self, requests):
                raise NotImplementedError

            def generate_until(self, requests):
                raise NotImplementedError

        return Rec()


def test_per_task_shots_reach_the_prompt(tmp_path: Path) -> None:
    from lm_eval import simple_evaluate

    root = _tiny_tasks(tmp_path, "  - {task: tiny_qa, num_fewshot: 5}")
    skipped: list[str] = []
    tm, objs, protocols = load_tasks(["tiny_group"], {}, tasks_dir=root, skip=skipped.append)
    lm = _Recorder()
    res = simple_evaluate(model=lm, tasks=objs, task_manager=tm, limit=2, num_fewshot=None, log_samples=False,
                          bootstrap_iters=0)
    # 5 shots + the question itself: 6 'Q:' per prompt, every prompt
    assert lm.contexts and all(c.count("Q: ") == 6 for c in lm.contexts), lm.contexts[0]
    agg = protocol.aggregate(protocols[0], res["results"])
    assert agg["value"] == pytest.approx(1.0) and agg["name"] == "Avg Acc" and not skipped


def test_unknown_member_is_one_line(tmp_path: Path) -> None:
    root = _tiny_tasks(tmp_path, "  - {task: tiny_qa, num_fewshot: 5}\n  - {task: no_such_task_xyz, num_fewshot: 1}")
    p = protocol.protocol_of("tiny_group", our_tasks(root))
    # the set of names lm-eval knows (load_tasks passes the TaskManager's index: indexing lm-eval's own
    # task folders takes ~10 s, too slow for this test)
    with pytest.raises(UserError) as e:
        protocol.check_known(p, {"tiny_qa", "tiny_group", "arc_easy"})
    assert e.value.problems == ["task group tiny_group: member no_such_task_xyz is not a task or group lm-eval knows"]


def test_member_without_data_is_skipped_with_one_line(tmp_path: Path) -> None:
    root = _tiny_tasks(tmp_path, "  - tiny_qa\n  - broken_qa")
    (root / "broken_qa.yaml").write_text(
        (root / "tiny_qa.yaml").read_text().replace("tiny_qa", "broken_qa").replace("qa.jsonl", "missing.jsonl"))
    skipped: list[str] = []
    _, objs, _ = load_tasks(["tiny_group"], {}, tasks_dir=root, skip=skipped.append)
    assert [o.task_name for o in objs] == ["tiny_qa"]
    assert len(skipped) == 1 and skipped[0].startswith("tiny_group: skipping broken_qa (data not on this machine")
    assert "\n" not in skipped[0]


def _fixed(p: protocol.Protocol, value_of) -> dict[str, dict[str, float]]:
    return {m.name: {m.metric: value_of(i)} for i, m in enumerate(p.members)}


def test_paper_aggregates_equal_hand_computation() -> None:
    ours = our_tasks()
    ps = {g: protocol.protocol_of(g, ours) for g in PAPER_GROUPS}
    assert all(ps.values()) and len(ps["archpreview_table1"].members) == 26
    assert [len(p.members) for p in ps.values()] == [9, 4, 12, 26, 5]
    # ConceptLM Table 3, Trained-8B row: 64.3, 34.8, 54.2, 36.7 -> Avg 47.5
    p8 = ps["conceptlm_8b"]
    a = protocol.aggregate(p8, _fixed(p8, lambda i: [64.3, 34.8, 54.2, 36.7][i]))
    assert a["value"] == pytest.approx(47.5) and a["name"] == "Avg"
    assert {m.name: m.num_fewshot for m in p8.members} == {"mmlu": 5, "arc_challenge": 25, "agieval": 3, "squadv2": 1}
    assert {m.name: m.metric for m in p8.members}["arc_challenge"] == "acc_norm,none"
    # ArchPreview: Overall AVG = mean of the 26 leaves (not of the section AVGs); section AVGs too
    pa = ps["archpreview_table1"]
    a = protocol.aggregate(pa, _fixed(pa, lambda i: float(i)))
    assert a["value"] == pytest.approx(sum(range(26)) / 26) and a["name"] == "Overall AVG"
    assert a["sections"]["Math"] == pytest.approx((5 + 6 + 7 + 8) / 4)
    assert a["sections"]["MC-STEM"] == pytest.approx((15 + 16) / 2)
    # DLCM: unweighted mean, the note says the paper's 43.92 matches no rule; a missing task is named
    pd = ps["dlcm_table2"]
    res = _fixed(pd, lambda i: float(i))
    res.pop("cmmlu")
    a = protocol.aggregate(pd, res)
    assert a["value"] == pytest.approx(sum(range(11)) / 11) and a["missing"] == ["cmmlu"]
    assert "43.92" in a["rule_text"] and "11 of 12" in a["rule_text"]
    pg = ps["archpreview_general"]
    a = protocol.aggregate(pg, _fixed(pg, lambda i: [60.0, 80.0, 70.0, 30.0, 90.0][i]))
    assert a["value"] == pytest.approx(66.0) and a["name"] == "General AVG"
    pc = ps["conceptlm_table1"]
    a = protocol.aggregate(pc, _fixed(pc, lambda i: 0.1 * (i + 1)))
    assert a["value"] == pytest.approx(0.5) and a["name"] == "Avg Acc"


def test_code_members_need_the_opt_in() -> None:
    p = protocol.protocol_of("archpreview_table1", our_tasks())
    skipped: list[str] = []

    class NoLoad:
        def load(self, specs):
            raise AssertionError("code members are not loaded without --allow-code-execution")

    code = protocol.Protocol(p.name, [m for m in p.members if m.is_code], p.label, p.rule)
    assert protocol.load_members(code, NoLoad(), allow_code=False, skip=skipped.append) == []
    assert len(skipped) == 6 and all("--allow-code-execution" in s for s in skipped)


def test_evaluate_writes_the_aggregate_with_its_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`evaluate` (what `ncpctl eval` calls) on a protocol group: the JSON's `aggregates` and the
    markdown carry the paper's name of the aggregate, its value and the rule line."""
    import functools

    from ncpctl.evaluate import run

    root = _tiny_tasks(tmp_path, "  - {task: tiny_qa, num_fewshot: 2}")
    monkeypatch.setattr(run, "load_tasks", functools.partial(load_tasks, tasks_dir=root))
    lm = _Recorder()
    lm.token_stats = {}
    t = run.EvalTarget(tmp_path / "ck", tmp_path / "out", ["tiny_group"], batch_size=4, limit=3, num_fewshot=None)
    summary = run.evaluate(t, lm=lm)
    agg = summary["aggregates"]["tiny_group"]
    assert agg["value"] == pytest.approx(1.0) and agg["name"] == "Avg Acc"
    md = Path(summary["files"]["markdown"]).read_text()
    assert "## tiny_group: Avg Acc" in md and "unweighted arithmetic mean" in md
    assert json.loads(Path(summary["files"]["json"]).read_text())["aggregates"]["tiny_group"]["value"] == 1.0


def test_num_fewshot_overrides_a_zero_shot_member_and_the_shots_are_recorded(tmp_path: Path, monkeypatch) -> None:
    """lm-eval never overrides a task whose config says 0 shots (conceptlm_table1, dlcm_table2): ncpctl
    applies --num-fewshot itself, records the shots each task used, and --compare flags a difference."""
    import functools

    from ncpctl.evaluate import run, settings

    root = _tiny_tasks(tmp_path, "  - {task: tiny_qa, num_fewshot: 0}")
    monkeypatch.setattr(run, "load_tasks", functools.partial(load_tasks, tasks_dir=root))
    results = []
    for shots in (2, None):
        lm = _Recorder()
        lm.token_stats = {}
        t = run.EvalTarget(tmp_path / "ck", tmp_path / f"out{shots}", ["tiny_group"], batch_size=4, limit=3,
                           num_fewshot=shots)
        s = run.evaluate(t, lm=lm)
        assert lm.contexts and all(c.count("Q: ") == (shots or 0) + 1 for c in lm.contexts), lm.contexts[0]
        res = json.loads(Path(s["files"]["json"]).read_text())
        assert res["scored"]["tiny_qa"]["settings"]["num_fewshot"] == res["n-shot"]["tiny_qa"] == (shots or 0)
        results.append(res)
    notes = settings.differences(["two", "zero"], results)
    assert any(n.startswith("evaluated with different shots: tiny_qa") and "(two 2, zero 0)" in n for n in notes), notes


def test_archpreview_mmlu_is_the_unweighted_mean_of_its_subjects_and_math500_is_marked_assumed() -> None:
    """NCP-ArchPreview's MMLU is the equal-weight mean over its 57 subjects (the notes), not lm-eval's
    group score (weighted by each subject's questions); MATH-500's greedy exact match is marked assumed."""
    ours = our_tasks()
    subs = {"mmlu": ["mmlu_stem", "mmlu_other"], "mmlu_stem": ["mmlu_anatomy", "mmlu_astronomy"],
            "mmlu_other": ["mmlu_virology"]}
    res = {"mmlu_anatomy": {"acc,none": 0.2}, "mmlu_astronomy": {"acc,none": 0.4}, "mmlu_virology": {"acc,none": 0.9},
           "mmlu": {"acc,none": 0.77}, "mmlu_stem": {"acc,none": 0.35}, "mmlu_other": {"acc,none": 0.9},
           "arc_easy": {"acc,none": 0.5}, "hellaswag": {"acc_norm,none": 0.6},
           "nq_open": {"exact_match,remove_whitespace": 0.1}, "sciq": {"acc,none": 0.8}}
    a = protocol.aggregate(protocol.protocol_of("archpreview_general", ours), res, subs)
    assert a["scores"]["mmlu"] == pytest.approx(0.5) and a["value"] == pytest.approx((0.5 + 0.5 + 0.6 + 0.1 + 0.8) / 5)
    pt = protocol.protocol_of("archpreview_table1", ours)
    domains = {"mmlu_stem": ["s1", "s2", "s3"], "mmlu_humanities": ["h1"], "mmlu_social_sciences": ["c1", "c2"],
               "mmlu_other": ["o1"]}
    vals = {"s1": 0.1, "s2": 0.2, "s3": 0.6, "h1": 0.5, "c1": 0.3, "c2": 0.7, "o1": 0.9}
    res = {leaf: {"acc,none": v} for leaf, v in vals.items()} | {d: {"acc,none": 0.99} for d in domains}
    a = protocol.aggregate(pt, res, domains)
    assert a["scores"]["mmlu_stem"] == pytest.approx(0.3) and a["scores"]["mmlu_social_sciences"] == pytest.approx(0.5)
    assert a["summaries"]["MMLU (57 subjects)"] == pytest.approx(sum(vals.values()) / len(vals))
    assert "assumed: minerva_math500 (greedy exact match of one completion; the notes score Pass@1 over 32" in \
        a["rule_text"]

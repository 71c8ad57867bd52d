"""Evaluation friction a newcomer met (issue 46 item 7): an unreachable hub is asked once and each
hub task then fails at once with its one line (it cost a minute of retries per task); the `ncp_*` tasks
on a run trained on a data.mix of corpora say what they read, as docs/evaluation.md says."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

TINY_HUB = """\
task: tiny_hub
dataset_path: nobody-xyz/no_such_dataset
output_type: multiple_choice
test_split: test
doc_to_text: '{{q}}'
doc_to_choice: '{{choices}}'
doc_to_target: label
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
metadata: {version: 1.0}
"""


def test_an_unreachable_hub_is_asked_once_and_a_hub_task_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "tiny_hub.yaml").write_text(TINY_HUB)
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import lm_eval.tasks, datasets  # imported before the clock starts
        from ncpctl.errors import UserError
        from ncpctl.evaluate.run import load_tasks
        lines, problems = [], []
        t0 = time.time()
        try:
            load_tasks(["tiny_hub"], {{}}, tasks_dir=Path({str(tmp_path)!r}), skip=lines.append)
        except UserError as e:
            problems = e.problems
        print(repr((time.time() - t0, lines, problems)))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT="http://hub.invalid", HF_HOME=str(tmp_path / "hf"))  # a name no resolver knows
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    seconds, lines, problems = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert len(lines) == 1 and lines[0].startswith("the Hugging Face hub (http://hub.invalid) is unreachable")
    assert len(problems) == 1 and problems[0].startswith("task tiny_hub: cannot load its data")
    assert "Retrying" not in r.stderr and seconds < 10  # before: five retries, 1 + 2 + 4 + 8 + 8 s apart


def test_ncp_tasks_on_a_data_mix_of_corpora_say_they_read_the_union(runs, tmp_path: Path) -> None:
    from ncpctl.evaluate.offline import say_mixture

    run = tmp_path / "mix"
    shutil.copytree(runs["concept"].parent.parent, run, symlinks=True, ignore=shutil.ignore_patterns("eval"))
    ck = run / "checkpoints" / runs["concept"].name
    meta = json.loads((ck / "ncpctl.json").read_text())
    data = meta["recipe"]["data"]
    data.update(sources=[], train_prefix=None, val_prefix=None,
                mix=[{"name": "stdlib", "weight": 0.5, "sources": ["builtin:python-stdlib"]},
                     {"name": "more", "weight": 0.5, "sources": ["builtin:python-stdlib"]}])
    (ck / "ncpctl.json").write_text(json.dumps(meta))
    said: list[str] = []
    say_mixture(["ncp_offline"], ck, said.append)
    assert len(said) == 1 and said[0].startswith("ncp_heldout_ppl, ncp_cloze, ncp_last_ident: ")
    assert f"{run / 'data' / 'val'}: the union of the components' validation documents, not weighted" in said[0]
    say_mixture(["ncp_offline"], runs["concept"], said.append)  # one corpus: nothing to say
    assert len(said) == 1

"""Evaluation through lm-evaluation-harness.

* ``ncpctl.evaluate.lm``: ``NCPLM``, our model as the lm-eval model ``ncpctl``.
* ``ncpctl.evaluate.offline``: offline tasks from the tokenized validation split.
* ``ncpctl.evaluate.heldout``: perplexity tasks on the user's own corpora (``--heldout``).
* ``ncpctl.evaluate.compare``: ``ncpctl eval --compare``, several runs' results side by side
  (``compare_curves``: training curves; ``compare_arms``: seed arms with the paired bootstrap).
* ``ncpctl.evaluate.protocol``: paper-table groups: per-task shots and metric, the paper's aggregate.
* ``ncpctl.evaluate.code_exec``: code tasks and the unbiased pass@k; ``sandbox`` (with the script
  ``sandbox_supervisor.py``) runs each program: the verdict and the containment.
* ``ncpctl.evaluate.proxy``: capability proxies (``ncpctl eval --proxy``); ``proxy_build`` makes a set.
* ``ncpctl.evaluate.uncertainty``: tokens-to-reach, window and seed aggregates, paired bootstrap.
* ``ncpctl.evaluate.tasks/``: task YAMLs (``ncp_offline``; the ConceptLM paper groups; the paper tables).
* ``ncpctl.evaluate.entry``: what ``ncpctl eval`` calls: ``run_eval(EvalRequest, out)``, one entry point per mode.
* ``ncpctl.evaluate.run``: ``evaluate(...)``, lm-eval tasks of one checkpoint (``report``: its markdown and table).
* ``ncpctl.evaluate.settings``: ``--seed``, ``--gen-kwargs``, fractional ``--limit``; per-task settings.
* ``ncpctl.evaluate.samples``: logged samples (``--log-samples``), per-example scores read back.
* ``ncpctl.evaluate.accumulate``: results of several evaluations of one checkpoint, merged by task.
* ``ncpctl.evaluate.cache``: the resumable request cache, keyed by the checkpoint's manifest.
* ``ncpctl.evaluate.parallel``: data-parallel scoring under a launcher (torchrun, deepspeed).
* ``ncpctl.evaluate.hub``: one reachability check of the Hugging Face hub before hub tasks load.
* ``python -m ncpctl.evaluate ...``: the ``lm_eval`` command line with ``--model ncpctl``
  registered and our task directory included (lm-eval 0.4 has no plugin discovery).

Nothing heavy is imported here (``ncpctl --help`` stays fast).
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
OFFLINE_TASKS = ("ncp_offline", "ncp_heldout_ppl", "ncp_cloze", "ncp_last_ident")

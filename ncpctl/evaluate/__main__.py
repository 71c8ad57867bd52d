"""``python -m ncpctl.evaluate run --model ncpctl --model_args checkpoint=DIR --tasks ncp_offline``

lm-eval's own command line (every option of ``lm_eval``), with the ``ncpctl`` model
registered and ``ncpctl/evaluate/tasks`` added to ``--include_path``. lm-eval 0.4.x has no
entry-point discovery for external models (its registry is filled from a fixed table), so
``lm_eval --model ncpctl`` works only from a process that imported ``ncpctl.evaluate.lm``
first: this module is that process.
"""

from __future__ import annotations

import sys

from ncpctl.errors import EXIT_USER, UserError
from ncpctl.evaluate import TASKS_DIR
import ncpctl.evaluate.lm


def main(argv: list[str] | None = None) -> int | None:
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--tasks" or a.startswith("--tasks=") for a in args):
        if "--include_path" in args[:-1]:
            i = args.index("--include_path") + 1
            args[i] = f"{args[i]}:{TASKS_DIR}"
        else:
            args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *args]

    try:
        return cli_evaluate()
    except UserError as e:  # a bad model arg or checkpoint: one line each, exit 2, as ncpctl's own commands
        for line in e.problems:
            sys.stderr.write(f"error: {line}\n")
        return EXIT_USER


if __name__ == "__main__":
    sys.exit(main())

"""Scaling studies: the points of trained runs (``points``), the parametric law and its fit
(``law``), the analyses of ``ncpctl fit`` (``fit``) and their report files (``report``); what the
commands call: ``fit_command.run_fit`` and ``sweep_command.run_sweep``."""

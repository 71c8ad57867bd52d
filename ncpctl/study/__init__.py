"""Scaling studies: the points of trained runs (``points``), the parametric law and its fit
(``law``), the analyses of ``ncpctl fit`` (``fit``) and their report files (``report``)."""

"""Reading and acting on a model's concepts: ``concepts`` (decomposition, ablation attribution,
code dictionaries), and ``report`` (what ``ncpctl inspect`` calls: ``inspect_checkpoint(InspectRequest, out)``;
``report_generated``: --generate and --find-concept; ``report_human``: its tables)."""

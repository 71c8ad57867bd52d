"""Reading and acting on a model's concepts: ``concepts`` (decomposition, ablation attribution,
code dictionaries), and ``report`` (``ncpctl inspect``'s reports, picked by
``ncpctl.inference.inspect_command``; ``report_human``: their tables)."""

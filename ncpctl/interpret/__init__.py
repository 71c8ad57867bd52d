"""Reading and acting on a model's concepts: ``concepts`` (decomposition, ablation attribution,
code dictionaries; ``ncpctl inspect``)."""

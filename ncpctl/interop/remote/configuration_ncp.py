"""NCP (Next Concept Prediction) model configuration for HF transformers.

Written by ``ncpctl export`` next to ``modeling_ncp.py``; needs only ``transformers``.
``ncp`` holds the ncpctl ``ModelConfig`` fields (resolved), ``derived`` the numbers
ncpctl derived from them (head size, padded vocabulary, ...), so nothing is recomputed here.
"""

from transformers import PretrainedConfig


class NCPConfig(PretrainedConfig):
    model_type = "ncp"

    def __init__(self, ncp=None, derived=None, **kwargs):
        self.ncp = dict(ncp or {})
        self.derived = dict(derived or {})
        d = self.ncp
        if d:
            kwargs.setdefault("vocab_size", self.derived.get("padded_vocab_size"))
            kwargs.setdefault("hidden_size", d.get("d_model"))
            kwargs.setdefault("num_attention_heads", d.get("n_heads"))
            kwargs.setdefault("num_hidden_layers", self.derived.get("n_token_layers"))
            kwargs.setdefault("max_position_embeddings", d.get("max_seq_len"))
            kwargs.setdefault("initializer_range", d.get("init_std", 0.02))
            kwargs.setdefault("tie_word_embeddings", bool(d.get("tie_embeddings", False)))
        super().__init__(**kwargs)

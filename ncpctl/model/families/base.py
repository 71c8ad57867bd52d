"""Backbone families as records (issue 22): everything ncpctl knows of ``neox``, ``llama`` or
``gpt2`` lives in one module per family (``family_neox.py``, ``family_llama.py``,
``family_gpt2.py``), registered by name in ``config.STRATEGIES["backbone"]``; the recipe key
``model.backbone`` picks one. A new family is one module with a ``Family`` subclass plus a
registry line (``register("backbone", "mine", Mine)``, or ``backbone: package.module:Class``).

A family says, in one place:

* ``defaults(cfg)``: its values of the keys a recipe leaves null (``ffn_dim``, ``rotary_pct``,
  ``parallel_residual``, ``bias``); ``learned_positions``: a (max_seq_len, d) position embedding
  instead of RoPE; ``mlp_matrices``: the d x ffn_dim matrices of its MLP (the cost model's
  count); ``check(cfg)``: its own recipe checks. Standard library only, so that a recipe is
  validated without torch.
* ``norm(cfg, dim)`` and ``mlp(cfg)``: the modules the blocks are built with, and ``block(cfg,
  window, cross)``: the block itself (``layers.Block``; another layout subclasses it). Called
  once at construction: the hot paths hold the chosen modules and never ask again. An MLP maps d -> d,
  names its output projection ``proj`` (the residual-output init scales it) and may declare
  ``fused_rows`` (the matrices stacked in a fused Linear, for per-matrix Muon).
* Hugging Face: ``hf_model_types`` (the HF ``model_type``s it imports, with the config fields each
  reads in ``hf_read``), ``hf_config(cfg, problems)`` (ours -> an HF config, or a ``ConfigError``
  naming what HF cannot hold), ``from_hf(hf)`` (an HF config -> our keys), ``hf_architectures``
  (model type -> the ``*ForCausalLM`` class an export names), ``hf_names(cfg)`` (top-level weight
  names, ours -> HF), ``hf_layers`` (the HF prefix of the layers) and ``layer_to_hf`` /
  ``layer_from_hf`` (one block's weights). A family without an HF model keeps the defaults,
  which refuse the conversion by name.

torch and transformers are imported inside the methods that need them; this module and the
family modules import nothing outside ``ncpctl/model`` (they travel with exported code).
"""

from __future__ import annotations

from typing import Any

from ncpctl.model.core.config_base import ConfigError
from ncpctl.model.registry import STRATEGIES, family

Problems = list[tuple[str, str]]


class Family:
    """A backbone family (see the module docstring). Subclass it and override what differs."""

    is_family = True  # what registry.family checks (it cannot import this class: it is below it)
    learned_positions = False
    # d x ffn_dim matrices of its MLP (GELU: up, down = 2; SwiGLU: gate, up, down = 3), for the
    # torch-free cost model (accounting.py)
    mlp_matrices = 2
    hf_model_types: tuple[str, ...] = ()
    hf_read: dict[str, set[str]] = {}
    hf_architectures: dict[str, str] = {}
    hf_layers = ""

    # ---- config (standard library only) ----
    def defaults(self, cfg: Any) -> dict[str, Any]:
        """The family's values of ``ffn_dim``, ``rotary_pct``, ``parallel_residual``, ``bias``
        (used where the recipe left them null)."""
        return dict(ffn_dim=4 * cfg.d_model, rotary_pct=1.0, parallel_residual=False, bias=False)

    def check(self, cfg: Any) -> Problems:
        """The family's own recipe checks: ``[(model key, message)]``."""
        return []

    # ---- modules (called once per module at construction) ----
    def norm(self, cfg: Any, dim: int) -> Any:
        from torch import nn

        return nn.LayerNorm(dim, eps=cfg.norm_eps)

    def mlp(self, cfg: Any) -> Any:
        from ncpctl.model.core.layers import MLP

        return MLP(cfg)

    def block(self, cfg: Any, window: Any, cross: Any = None) -> Any:
        """One layer of a stack (``layers.Block``, which builds its norms and MLP with ``norm``
        and ``mlp``); a family with another layout returns a ``Block`` subclass."""
        from ncpctl.model.core.layers import Block

        return Block(cfg, window, cross)

    # ---- Hugging Face (configs, weights) ----
    def _no_hf(self, cfg: Any) -> ConfigError:
        return ConfigError([("backbone", f"{cfg.backbone!r} has no Hugging Face model (its family declares no "
                                         "HF mapping)")])

    def hf_config(self, cfg: Any, problems: Problems) -> Any:
        raise self._no_hf(cfg)

    def from_hf(self, hf: Any) -> dict[str, Any]:
        raise ConfigError([("model_type", f"{hf.model_type!r}: no importer")])

    def hf_names(self, cfg: Any) -> dict[str, str]:
        """Top-level (non-layer) weight names, ours -> HF (the LM head is added by hf.py)."""
        raise self._no_hf(cfg)

    def check_weights(self, cfg: Any) -> None:
        """Raise a ``ConfigError`` if ``cfg``'s weights cannot convert to or from the HF model."""
        if not self.hf_layers:
            raise self._no_hf(cfg)

    def layer_to_hf(self, cfg: Any, sd: dict, ours: str, hf: str) -> dict:
        """One block: our keys under prefix ``ours`` -> HF keys under prefix ``hf``."""
        raise self._no_hf(cfg)

    def layer_from_hf(self, cfg: Any, sd: dict, hf: str, ours: str) -> dict:
        raise self._no_hf(cfg)


def registered() -> dict[str, Family]:
    """Every registered family by name (the built-ins and those ``register`` added)."""
    return {name: family(name) for name in STRATEGIES["backbone"]}


# ---- shared by the HF mappings of the built-in families (no torch) ----

POST = "post-norm blocks export as OLMo-2/3 (backbone: llama, qk_norm: layer)"


def refuse(problems: Problems, checks) -> None:
    """Add the ``(key, bad, why)`` checks that are bad to ``problems``; raise if any."""
    problems.extend((name, why) for name, bad, why in checks if bad)
    if problems:
        raise ConfigError(problems)


def hf_common(cfg: Any) -> dict[str, Any]:
    """The HF config fields GPT-NeoX and the Llama-like models share."""
    return dict(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_token_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
    )


def layer_types(cfg: Any) -> list[str]:
    return ["full_attention" if w is None else "sliding_attention" for w in cfg.token_windows]


def rope_fields(hf: Any, rp: dict[str, Any]) -> dict[str, Any]:
    """The fields GPT-NeoX and the Llama-like models share, with the RoPE ``rp`` (HF's
    ``rope_parameters``: default, or llama3 scaling)."""
    base = dict(vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layers=hf.num_hidden_layers,
                n_heads=hf.num_attention_heads, ffn_dim=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
                tie_embeddings=bool(hf.tie_word_embeddings), init_std=hf.initializer_range)
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "llama3"):
        raise ConfigError([("rope_parameters", f"rope_type {kind!r} is not supported (default, llama3)")])
    if kind == "llama3":
        base["rope_scaling"] = {k: rp.get(k) for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                                       "original_max_position_embeddings")}
    base["rope_base"] = rp["rope_theta"]
    return base

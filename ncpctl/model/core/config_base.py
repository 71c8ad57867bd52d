"""What the config modules share (stdlib only, no import from ``ncpctl``): the error type, the
documented field, the segmentation law and the ``Section`` protocol of a design's recipe keys.

A design's keys are a *section*: a dataclass mixin next to the design (``config_dynamic.py``,
``config_bottleneck.py``, ``config_residual.py``, ...) whose fields are documented with ``option``
and whose ``section_check`` returns the problems of those keys. ``ModelConfig`` (and
``ConceptConfig``, for the concept path's keys) inherit the sections, so a recipe still writes
``model.irc_hidden`` or ``model.concept.boundary_mode`` and a checkpoint stores them where it did;
the holder runs every section's hooks without naming one (``section_problems``, ``section_settle``).
A registered design declares its keys the same way, as a dataclass of ``option`` fields named by
its class attribute ``options`` (recipe ``model.options.NAME.KEY``; see ``config.register``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class ConfigError(ValueError):
    """Impossible model configuration; ``problems`` is a list of (field path, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))


def option(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation (the recipe schema and reference read it); a
    type as ``default`` (``list``, ``dict``) is a factory."""
    if isinstance(default, type):
        return field(default_factory=default, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class SegmentationLaw:
    """What the rest of ncpctl may know of a segmentation without running it (torch-free).

    ``concepts(c, T)``: concepts a T-token sequence gives (an upper bound for data-dependent
    segmentations: it sizes caches); ``tokens_per_concept(c)``: the mean segment length, for
    the cost model (a concept layer runs on T / tokens_per_concept positions)."""

    concepts: Callable[[Any, int], int]
    tokens_per_concept: Callable[[Any], float]
    length_key: str | None = None  # the concept.* key that sets the segment length (for errors)
    # pooling depends on positions only (not on the states): any tensor, e.g. every encoder depth
    # for the encoder-concept cross-module residual, can be pooled by the same segments
    pools_any_width: bool = False
    # the segmentation's own recipe checks: (concept config, model config) -> [(concept key, message)]
    check: Callable[[Any, Any], list] | None = None
    # data-dependent segmentations: the concepts the cost model counts in T tokens (None: ``concepts``)
    expected_concepts: Callable[[Any, int], int] | None = None

    @property
    def variable_length(self) -> bool:
        """Segment lengths depend on the data (the mean is a target, e.g. DLCM's R): the realised
        tokens per concept is a measurement, not a key."""
        return self.expected_concepts is not None


@dataclass(frozen=True)
class DesignSpec:
    """A built-in design, declared once, in its own room (``designs/NAME/spec.py``), and registered
    by one line of ``registry.DESIGNS``. The registry derives from these records the extension
    points' strategy table (``STRATEGIES``), the segmentations' laws (``LAWS``), the cost models
    (``COSTS``), the training hooks (``HOOKS``, run by ``ncpctl.train.hooks``) and the config
    sections ``ModelConfig`` and ``ConceptConfig`` compose; the export ships the modules they name.
    Torch-free: import paths are strings, ``module:attr`` relative to ``ncpctl.model``."""

    name: str  # the room
    # extension point -> {strategy name: ".module:Class"} (segmentation, coupling, residual, objective, backbone)
    strategies: dict[str, dict[str, str]] = field(default_factory=dict)
    laws: dict[str, SegmentationLaw] = field(default_factory=dict)  # segmentation name -> its law
    # (extension point, strategy name) -> ".module:Cost": the cost model of a strategy with matmuls of its own
    costs: dict[tuple[str, str], str] = field(default_factory=dict)
    model_sections: tuple[type, ...] = ()  # the design's keys at model.* (bases of ModelConfig, in order)
    concept_sections: tuple[type, ...] = ()  # its keys at model.concept.* (bases of ConceptConfig)
    hooks: tuple[str, ...] = ()  # its training hooks, "package.module:Class" (ncpctl.train.hooks.DesignHooks)
    modes: tuple[str, ...] = ()  # the option values that select its variants (names only it may branch on)


class Section:
    """A design's recipe keys, mixed into ``ModelConfig`` or ``ConceptConfig`` as a dataclass.

    ``section_check(self, cfg, law)``: the problems of this section's keys as ``(key, message)``,
    keys relative to the holder (``self``: the model or the concept config; ``cfg``: the model
    config; ``law``: the segmentation's law, None without the concept path or when it is broken).
    ``section_settle(self, cfg)``: after every check passed and the derived numbers are known,
    normalise keys and return late problems. Each section defines its own hooks; the holder calls
    each class's (``section_problems``, ``section_settle``), so sections never override each other."""

    def section_check(self, cfg: Any, law: SegmentationLaw | None) -> list[tuple[str, str]]:
        return []

    def section_settle(self, cfg: Any) -> list[tuple[str, str]]:
        return []

    def section_tokens(self, cfg: Any) -> dict[str, str]:
        """Special tokens the design needs in the tokenizer: the key path of the id it is read
        into (relative to the holder, e.g. ``diffusion.mask_id``) -> the token's text."""
        return {}

    def section_seq_len(self, cfg: Any, seq_len: int) -> list[tuple[str, str]]:
        """Problems (recipe key, message) of running on windows of ``seq_len`` tokens."""
        return []


def _own(holder: Any, hook: str) -> list:
    return [vars(k)[hook] for k in reversed(type(holder).__mro__) if hook in vars(k) and k is not Section]


def section_problems(holder: Any, cfg: Any, law: SegmentationLaw | None) -> list[tuple[str, str]]:
    """Every section's ``section_check`` of ``holder``, in declaration order."""
    return [p for check in _own(holder, "section_check") for p in check(holder, cfg, law)]


def section_settle(holder: Any, cfg: Any) -> list[tuple[str, str]]:
    """Every section's ``section_settle`` of ``holder``."""
    return [p for settle in _own(holder, "section_settle") for p in settle(holder, cfg)]


def section_tokens(holder: Any, cfg: Any) -> dict[str, str]:
    """Every section's ``section_tokens`` of ``holder``, merged."""
    return {k: v for hook in _own(holder, "section_tokens") for k, v in hook(holder, cfg).items()}


def section_seq_len(holder: Any, cfg: Any, seq_len: int) -> list[tuple[str, str]]:
    """Every section's ``section_seq_len`` of ``holder``."""
    return [p for hook in _own(holder, "section_seq_len") for p in hook(holder, cfg, seq_len)]

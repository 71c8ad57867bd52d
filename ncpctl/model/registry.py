"""The registry of the extension points (torch-free): the strategies the model knows by name
(built-ins, plus whatever ``register`` adds at run time), the segmentations' laws and the recipe
keys registered designs declare (``options``).

A name of the form ``package.module:Class`` is imported when the config is built, except inside
``from_checkpoint(...)`` (a config read from a checkpoint): there only import paths the user
named too (a recipe, ``--strategy``, code: ``trust``) are imported, so that opening a checkpoint
never imports a module it names (issue 21). A segmentation also declares its ``SegmentationLaw``
(how many concepts a T-token sequence gives): accounting, cache sizes and the export probe ask it
instead of assuming a fixed k. A design that declares ``options`` (a dataclass of ``option``
fields, config_base.py) gets the recipe keys ``model.options.NAME.KEY``.

The built-in strategies, laws, costs, training hooks and config sections are derived from the
built-in designs' records (``DesignSpec``, core/config_base.py), one line of ``DESIGNS`` each.

Stdlib only, like every config module: copied into exported Hugging Face directories.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

from ncpctl.model.core.config_base import ConfigError, DesignSpec, SegmentationLaw

# The built-in designs: one registration line each, the import path of the record (a ``DesignSpec``)
# its room declares. Everything below is derived from these records.
DESIGNS: tuple[str, ...] = (
    ".core.spec:BASE",
    ".families.spec:SPEC",
    ".designs.causal_diffusion.spec:SPEC",
    ".designs.bottleneck.spec:SPEC",
    ".designs.mup.spec:SPEC",
    ".designs.mtp.spec:SPEC",
    ".designs.residual.spec:SPEC",
    ".designs.dynamic.spec:SPEC",
    ".designs.cross_attention.spec:SPEC",
    ".core.spec:CONCEPT",
    ".core.spec:DOCUMENTS",
    ".designs.drafter.spec:SPEC",
)
KINDS = ("segmentation", "coupling", "residual", "objective", "backbone")  # the extension points

# Names of the extension points' strategies: name -> a class, a "module:attr" import path
# (relative paths are resolved in this package) or, for segmentations, also its law.
STRATEGIES: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
LAWS: dict[str, SegmentationLaw] = {}
# The cost model of the built-in strategies with matmuls of their own (accounting): torch-free
# classes in the design's config module. A registered class carries its own as the attribute ``cost``.
COSTS: dict[tuple[str, str], str] = {}
HOOKS: list[str] = []  # the built-in designs' training hooks, in the order they run (ncpctl.train.hooks)
SPECS: list[DesignSpec] = []


def sections(where: str) -> tuple[type, ...]:
    """The config sections the built-in designs declare at ``where`` ("model" or "concept"), in order:
    the bases of ``ModelConfig`` / ``ConceptConfig``."""
    return tuple(c for spec in SPECS for c in getattr(spec, f"{where}_sections"))


def derive() -> None:
    """(Re)build the tables above from the records ``DESIGNS`` names (in place: their importers keep
    the same objects; strategies registered at run time stay)."""
    SPECS[:] = [_load(target) for target in DESIGNS]
    names = [spec.name for spec in SPECS]
    if len(set(names)) != len(names):
        raise ValueError(f"registry.DESIGNS: a design is registered twice: {names}")
    for spec in SPECS:
        if not isinstance(spec, DesignSpec):
            raise TypeError(f"registry.DESIGNS: {spec!r} is not a DesignSpec")
        for kind, table in spec.strategies.items():
            STRATEGIES[kind].update(table)
        LAWS.update(spec.laws)
        COSTS.update(spec.costs)
    HOOKS[:] = [h for spec in SPECS for h in spec.hooks]


def register(kind: str, name: str, cls: Any = None) -> Any:
    """Make ``cls`` the strategy ``name`` of extension point ``kind`` (``segmentation``,
    ``coupling``, ``residual``, ``objective`` or ``backbone``: a ``Family``, family.py); then
    ``model.concept.segmentation: name`` (etc.) selects it.
    A segmentation class must declare its ``law`` (a ``SegmentationLaw``). A class may declare
    its own recipe keys: ``options``, a dataclass of ``option`` fields (``model.options.NAME.KEY``,
    read back with ``cfg.design_options(kind)``). Usable as a class decorator:
    ``@register("segmentation", "mine")``. Returns ``cls``."""
    if kind not in STRATEGIES:
        raise ValueError(f"unknown extension point {kind!r}; known: {', '.join(STRATEGIES)}")

    def add(c: Any) -> Any:
        if kind == "segmentation":
            law = getattr(c, "law", None)
            if not isinstance(law, SegmentationLaw):
                raise TypeError(f"{c!r}: a segmentation declares its SegmentationLaw as the class attribute `law`")
            LAWS[name] = law
        options = getattr(c, "options", None)
        if options is not None:
            _declare_options(kind, name, options)
        STRATEGIES[kind][name] = c
        return c

    return add if cls is None else add(cls)


def unregister(kind: str, name: str) -> None:
    """Forget the strategy ``name`` of ``kind`` (its law and options too); built-ins stay."""
    if isinstance(STRATEGIES[kind].get(name), str):
        raise ValueError(f"{kind} {name!r} is built in")
    STRATEGIES[kind].pop(name, None)
    if OPTIONS.get(name, (kind,))[0] == kind:
        OPTIONS.pop(name, None)
    if kind == "segmentation":
        LAWS.pop(name, None)


# name -> (kind, options dataclass) of the registered designs that declare recipe keys (``options``)
OPTIONS: dict[str, tuple[str, type]] = {}


def _declare_options(kind: str, name: str, options: Any) -> None:
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(f"{name!r}: `options` must be a dataclass (its fields are the recipe keys "
                        f"model.options.{name}.KEY), got {options!r}")
    if OPTIONS.get(name, (kind,))[0] != kind:
        raise TypeError(f"{name!r}: a {OPTIONS[name][0]} of that name already declares options "
                        f"(model.options.{name}); register this {kind} under another name")
    OPTIONS[name] = (kind, options)


# import paths (package.module:Class) the user named: a recipe, --strategy, a config built in code
_TRUSTED: set[str] = set()
UNTRUSTED = "is named only by the checkpoint"  # the refusal's words (the recipe loader looks for them)
# the checkpoint whose config is being read (from_checkpoint), None elsewhere
_CHECKPOINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ncpctl_checkpoint", default=None)


def trust(*targets: str) -> None:
    """Let configs read from checkpoints import these strategies (``package.module:Class``), as
    when the user names them (``--strategy``)."""
    _TRUSTED.update(targets)


@contextlib.contextmanager
def from_checkpoint(where: Any) -> Any:
    """Within: configs are read from checkpoint ``where``, whose strategy import paths are
    imported only if the user named them too (``trust``); others are a ``ConfigError``."""
    token = _CHECKPOINT.set(str(where))
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def strategy(kind: str, name: str) -> Any:
    """The class registered as ``name`` for extension point ``kind``, importing it if named by
    an import path (``package.module:Class``). Raises ``ConfigError`` for an unknown name, and
    for an import path that only a checkpoint names (``from_checkpoint``)."""
    target = STRATEGIES[kind].get(name, name if ":" in name else None)
    if target is None:
        known = ", ".join(sorted(STRATEGIES[kind]))
        raise ConfigError([(kind, f"unknown {kind} {name!r}; known: {known} (or package.module:Class)")])
    if not isinstance(target, str):
        return target
    if name not in STRATEGIES[kind]:  # an import path the user or a checkpoint gave
        where = _CHECKPOINT.get()
        if where is None:
            _TRUSTED.add(name)
        elif name not in _TRUSTED:
            raise ConfigError([(kind, f"{name!r} {UNTRUSTED} {where}, and ncpctl does not "
                                      f"import code a checkpoint names; if you trust it, name it yourself: "
                                      f"--strategy {name} (or in a recipe)")])
    try:
        return _load(target)
    except (ImportError, AttributeError) as e:
        raise ConfigError([(kind, f"cannot import {target!r} ({e})")]) from None


def _load(target: str) -> Any:
    """The object ``module:attr`` names (a leading dot: a module of this package)."""
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module, package=__package__ if module.startswith(".") else None), attr)


_FAMILIES: dict[Any, Any] = {}


def family(name: str) -> Any:
    """The backbone family ``name`` (a ``Family``, families/base.py): a registered name or
    ``package.module:Class`` (one instance per class). A ``ConfigError`` names an unknown family or a
    class that is not a ``Family``. Here, below the families and the layers that ask it, so that
    neither imports the other's module to find one."""
    if not isinstance(name, str):
        raise ConfigError([("backbone", f"must be a name, got {name!r}")])
    cls = strategy("backbone", name)
    if cls not in _FAMILIES:
        if not (isinstance(cls, type) and getattr(cls, "is_family", False) is True):
            raise ConfigError([("backbone", f"{name!r}: {cls!r} is not a Family subclass (ncpctl.model.families.base)")])
        _FAMILIES[cls] = cls()
    return _FAMILIES[cls]


def segmentation_law(name: str) -> SegmentationLaw:
    """The law of segmentation ``name`` (a class named by import path declares it as ``law``)."""
    if name not in LAWS:
        law = getattr(strategy("segmentation", name), "law", None)
        if not isinstance(law, SegmentationLaw):
            raise ConfigError([("segmentation", f"{name!r} declares no SegmentationLaw (a class attribute `law`)")])
        LAWS[name] = law
    return LAWS[name]


def _options_of(kind: str, name: str) -> type | None:
    """The options dataclass the chosen strategy declares (built-ins keep their keys in sections)."""
    target = STRATEGIES[kind].get(name)
    if target is None:  # an import path, imported by now
        target = strategy(kind, name)
    options = None if isinstance(target, str) else getattr(target, "options", None)
    return options if isinstance(options, type) and dataclasses.is_dataclass(options) else None


def _option_problems(name: str, options: type, values: Any) -> list[tuple[str, str]]:
    """Unknown keys and values of another type than the key's default (a plugin's ``check`` does the rest)."""
    if not isinstance(values, dict):
        return [(f"options.{name}", f"must be a mapping of {name}'s keys, got {values!r}")]
    fields = {f.name: f for f in dataclasses.fields(options) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        return [(f"options.{name}", f"unknown key(s) {', '.join(map(str, unknown))}; {name} declares "
                                    f"{', '.join(fields) or 'none'}")]
    out = []
    for key, v in values.items():
        default = fields[key].default
        want = type(default) if isinstance(default, (bool, int, float, str)) else None
        ok = want is None or (isinstance(v, want) and (want is bool or not isinstance(v, bool))) or \
            (want is float and isinstance(v, int) and not isinstance(v, bool))
        if not ok:
            out.append((f"options.{name}.{key}", f"must be {want.__name__}, got {v!r}"))
    return out


def _check_options(cfg: "ModelConfig") -> list[tuple[str, str]]:
    """Build ``cfg.options``' entries into their dataclasses (the chosen designs' defaults filled
    in) and collect their problems; ``check(cfg)`` of an options class adds its own."""
    if not isinstance(cfg.options, dict):
        return [("options", f"must be a mapping of design name to its keys, got {cfg.options!r}")]
    chosen = {name: _options_of(kind, name) for kind, (_, name) in cfg.designs().items()}
    known = {**{name: o for name, (_, o) in OPTIONS.items()}, **{n: o for n, o in chosen.items() if o is not None}}
    cfg.options, problems = dict(cfg.options), []
    for name, values in cfg.options.items():
        options = known.get(name)
        if options is None:
            problems.append((f"options.{name}", f"no registered design {name!r} declares options (known: "
                                                f"{', '.join(sorted(known)) or 'none'})"))
        elif not isinstance(values, options):
            bad = _option_problems(name, options, values)
            problems += bad
            if not bad:
                cfg.options[name] = options(**values)
    for name, options in chosen.items():
        if options is not None and not any(k.startswith(f"options.{name}") for k, _ in problems):
            o = cfg.options.setdefault(name, options())
            problems += [(f"options.{name}.{k}", m) for k, m in (o.check(cfg) if hasattr(o, "check") else [])]
    return problems


def design_cost(kind: str, name: str) -> Any:
    """The cost model of strategy ``name`` of ``kind`` (None: no matmuls of its own). Segmentations
    and couplings: ``flops(cfg, T, M) -> {component: forward FLOPs}``; depth mixers: ``key`` and
    ``flops(cfg, stack, shape) -> forward FLOPs`` of one stack (accounting.py)."""
    target = COSTS.get((kind, name))
    if target is None:
        if isinstance(STRATEGIES[kind].get(name), str):
            return None  # a built-in without a cost model: nothing of its own to count
        return getattr(strategy(kind, name), "cost", None)
    return _load(target)


derive()

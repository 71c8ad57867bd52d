"""What a design adds to a training run: the loop's hooks (``ncpctl.train.loop`` names no design).

A design whose training needs more than its forward (data beside the tokens, a metric that must
see every rank's validation at once, something to write into the checkpoint or plot) subclasses
``DesignHooks``, overrides the methods it needs (every one has a do-nothing default) and is
named by its ``DesignSpec`` (``BUILTIN``) or given to ``register_hooks``. For each run the loop builds the hooks of
every design whose ``applies(recipe)`` holds and calls them at four points:

    prepare      ``loader_args(split, ds, info)``: extra ``WindowLoader`` arguments for the train
                 or the validation split (labels, token sources), checked before any heavy work;
                 ``prepare(model, train_ds, loader, info)``: once the model exists (fresh or
                 resumed), before the engine wraps it.
    inputs       ``inputs(loader, micro, evaluating)``: one dict of extra ``forward`` keyword
                 arguments per micro-batch of the batch the loader just read (CPU tensors; the
                 loop moves them to the device), or None.
    evaluation   ``eval_begin(model, final)``; ``eval_micro(i, out)`` after micro-batch i of each
                 validation batch; ``eval_end(d)``: the design's validation keys (it reduces over
                 ranks itself, every rank the same collectives).
    results      ``checkpoint_meta()``: keys for ncpctl.json; ``plots()``: keyword arguments for
                 ``ncpctl.train.metrics.write_plots``.

Model-side hooks need no registration: the model's ``on_step_begin`` / ``on_step_end``,
``log_keys`` / ``stat_keys`` (``ncpctl.model``) and a component's ``external_parameters``
(``ncpctl.train.engine``) are found on the modules. A hooks module may read files (it lives
in ``ncpctl.train``); ``ncpctl.model`` stays free of I/O.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

import torch

from ncpctl.model.registry import HOOKS
from ncpctl.recipe.load import Recipe

# the shipped designs' hooks, "module:Class" (imported when a run starts), in the order they run: their
# DesignSpecs' (ncpctl.model.registry.DESIGNS)
BUILTIN = HOOKS
_registered: list[type["DesignHooks"]] = []


class DesignHooks:
    """A design's part in a training run; see the module doc. ``recipe``: the run's recipe."""

    # whether a train-drafter run (a plain frozen target wrapped with a drafter) may carry these
    # hooks; those of a design that changes the target's run are refused there
    with_drafter: bool = False
    # the recipe key that brings these hooks into a run, as refusals name it
    recipe_key: str = ""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    @classmethod
    def applies(cls, recipe: Recipe) -> bool:
        """Whether this design is in ``recipe``'s model (its hooks run)."""
        return False

    # ---- prepare
    def loader_args(self, split: str, ds: Any, info: Callable[[str], None]) -> dict[str, Any]:
        return {}

    def prepare(self, model: torch.nn.Module, *, train_ds: Any, loader: Any, info: Callable[[str], None]) -> None:
        pass

    # ---- per micro-batch
    def inputs(self, loader: Any, micro: int, evaluating: bool) -> list[dict[str, Any]] | None:
        return None

    # ---- evaluation
    def eval_begin(self, model: torch.nn.Module, final: bool) -> None:
        pass

    def eval_micro(self, i: int, out: Any) -> None:
        pass

    def eval_end(self, d: Any) -> dict[str, float]:
        return {}

    # ---- results
    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def plots(self) -> dict[str, Any]:
        return {}


def register_hooks(cls: type[DesignHooks]) -> type[DesignHooks]:
    """Add a design's hooks (usable as a class decorator); they run after the built-in ones."""
    if not (isinstance(cls, type) and issubclass(cls, DesignHooks)):
        raise TypeError(f"register_hooks: {cls!r} is not a DesignHooks subclass")
    if cls not in _registered:
        _registered.append(cls)
    return cls


def _classes() -> list[type[DesignHooks]]:
    builtin = []
    for spec in BUILTIN:
        module, _, name = spec.partition(":")
        builtin.append(getattr(importlib.import_module(module), name))
    return builtin + [c for c in _registered if c not in builtin]


def dataset_meta(ds: Any) -> tuple[Path, dict[str, Any] | None]:
    """The meta.json ``ncpctl tokenize`` writes beside a dataset's PREFIX.bin/.idx, and its
    contents (None when there is none: a dataset made elsewhere)."""
    from ncpctl.data import meta

    path = Path(str(ds.bin_path)[: -len(".bin")]).parent / "meta.json"
    return path, meta.read(path)


def micro_split(per_token: Any, micro: int) -> list[torch.Tensor]:
    """A batch's per-token numpy array (rows first) as one CPU tensor per micro-batch."""
    return list(torch.from_numpy(per_token).split(micro))


class Hooks:
    """The hooks of one run's designs, called together (the loop's only handle on them)."""

    def __init__(self, recipe: Recipe):
        self.each = [cls(recipe) for cls in _classes() if cls.applies(recipe)]

    def loader_args(self, split: str, ds: Any, info: Callable[[str], None]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h in self.each:
            out.update(h.loader_args(split, ds, info))
        return out

    def prepare(self, model: torch.nn.Module, **kw: Any) -> None:
        for h in self.each:
            h.prepare(model, **kw)

    def inputs(self, loader: Any, n_micro: int, micro: int, device: torch.device,
               evaluating: bool = False) -> list[dict[str, Any]]:
        """Per micro-batch, every design's extra forward arguments, tensors on ``device``."""
        out: list[dict[str, Any]] = [{} for _ in range(n_micro)]
        for h in self.each:
            for kw, mine in zip(out, h.inputs(loader, micro, evaluating) or ()):
                kw.update({k: v.to(device) if torch.is_tensor(v) else v for k, v in mine.items()})
        return out

    def eval_begin(self, model: torch.nn.Module, final: bool) -> None:
        for h in self.each:
            h.eval_begin(model, final)

    def eval_micro(self, i: int, out: Any) -> None:
        for h in self.each:
            h.eval_micro(i, out)

    def eval_end(self, d: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for h in self.each:
            out.update(h.eval_end(d))
        return out

    def checkpoint_meta(self) -> dict[str, Any]:
        return {k: v for h in self.each for k, v in h.checkpoint_meta().items()}

    def plots(self) -> dict[str, Any]:
        return {k: v for h in self.each for k, v in h.plots().items()}

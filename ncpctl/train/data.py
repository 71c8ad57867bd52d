"""A training run's data: the train and validation splits, checked against the model and the
batch before any heavy work (clear errors first), and their window loaders. What a design adds
to a loader (concept labels, token sources) comes from its hooks (``ncpctl.train.hooks``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ncpctl.data.indexed import IndexedDataset, paths
from ncpctl.data.mix import MixLoader, normalised, open_parts
from ncpctl.data.windows import WindowLoader
from ncpctl.errors import UserError
from ncpctl.interop.hf_import import is_hf_dir
from ncpctl.recipe.load import Recipe
from ncpctl.train.hooks import Hooks, dataset_meta


@dataclass
class TrainData:
    """The splits, the train loader and what the designs add to the validation loader."""

    train_ds: IndexedDataset  # with data.mix: the first component's
    val_ds: IndexedDataset | None  # None: data.mix with per-component validation (val_parts)
    loader: WindowLoader | MixLoader
    val_args: dict[str, Any] = field(default_factory=dict)
    val_parts: list[tuple[str, float, IndexedDataset]] = field(default_factory=list)
    val_part_args: list[dict[str, Any]] = field(default_factory=list)  # what the designs add, per val_parts entry

    def train_tokens(self) -> Any:
        """The train tokens (num_tokens,), or with data.mix (normalised weight, tokens) per component."""
        if isinstance(self.loader, MixLoader):
            return [(w, p.dataset.tokens) for w, p in zip(self.loader.weights, self.loader.parts)]
        return self.train_ds.tokens

    def val_loaders(self, recipe: Recipe, rank: int, world: int) -> list[tuple[str | None, float, WindowLoader, int]]:
        """``(component name or None, weight, loader, batches)`` per validation split: the one split,
        or each data.mix component's (round(eval_batches x its normalised weight) batches, at least one)."""
        if not self.val_parts:
            return [(None, 1.0, *self.val_loader(recipe, rank, world))]
        t, T, G = recipe.train, recipe.seq_len, recipe.global_batch_size
        shares = normalised([w for _, w, _ in self.val_parts])  # normalised first: subnormal weights too
        out = []
        args = self.val_part_args or [{} for _ in self.val_parts]
        for (name, w, ds), extra, share in zip(self.val_parts, args, shares):
            val = WindowLoader(ds, T, G, seed=t.seed, rank=rank, world_size=world,
                               vocab_size=recipe.model_config.vocab_size, vocab_from=vocab_from(recipe)[0], **extra)
            n = min(max(1, round(t.eval_batches * share)), math.ceil(val.num_windows / G))
            out.append((name, w, val, n))
        return out

    def val_loader(self, recipe: Recipe, rank: int, world: int) -> tuple[WindowLoader, int]:
        """A fresh validation loader (the same fixed batches at every evaluation) and how many of
        its batches an evaluation reads (``train.eval_batches``, at most one pass)."""
        t, T, G = recipe.train, recipe.seq_len, recipe.global_batch_size
        val = WindowLoader(self.val_ds, T, G, seed=t.seed, rank=rank, world_size=world,
                           vocab_size=recipe.model_config.vocab_size, vocab_from=vocab_from(recipe)[0], **self.val_args)
        return val, min(t.eval_batches, math.ceil(val.num_windows / G))


def open_data(recipe: Recipe, rank: int, world: int, hooks: Hooks, info: Callable[[str], None]) -> TrainData:
    """Train and validation data (and what the designs read beside the tokens), checked against
    the model and the batch (clear errors first)."""
    if recipe.data.mix and not recipe.data.train_prefix:
        return _open_mix(recipe, rank, world, hooks, info)
    t, T, G = recipe.train, recipe.seq_len, recipe.global_batch_size
    train_ds, val_ds = dataset(recipe, "train"), dataset(recipe, "val")
    vocab = recipe.model_config.vocab_size
    for ds in (train_ds, val_ds):
        check_vocab(recipe, ds, vocab)
    train_args = hooks.loader_args("train", train_ds, info)
    val_args = hooks.loader_args("val", val_ds, info)
    loader = WindowLoader(train_ds, T, G, seed=t.seed, rank=rank, world_size=world, vocab_size=vocab,
                          vocab_from=vocab_from(recipe)[0], **train_args)
    if loader.num_windows < G:
        raise UserError(f"{train_ds.bin_path}: {train_ds.num_tokens:,} tokens make {loader.num_windows} windows of "
                        f"seq_len+1 = {T + 1} tokens, fewer than one global batch of {G}",
                        hint="use more data, or lower train.seq_len / train.global_batch_size")
    WindowLoader(val_ds, T, G, seed=t.seed)  # raises if validation has not one window
    return TrainData(train_ds, val_ds, loader, val_args)


def _open_mix(recipe: Recipe, rank: int, world: int, hooks: Hooks, info: Callable[[str], None]) -> TrainData:
    """data.mix: the components' train datasets behind one ``MixLoader``; validation per component
    that has a validation split (at least one window), else the run's one validation split."""
    t, T, G = recipe.train, recipe.seq_len, recipe.global_batch_size
    vocab = recipe.model_config.vocab_size
    parts = open_parts(recipe, "train", info)
    part_args = []
    for name, _, ds in parts:
        check_vocab(recipe, ds, vocab)
        part_args.append(_component_args(hooks, "train", name, ds, info))  # its own labels, aligned with its tokens
    loader = MixLoader(parts, T, G, seed=t.seed, rank=rank, world_size=world, vocab_size=vocab,
                       vocab_from=vocab_from(recipe)[0], part_args=part_args)
    val_parts, val_args = [], []
    for name, w, ds in open_parts(recipe, "val", info):
        if (ds.num_tokens - 1) // T < 1:
            info(f"data.mix: component {name} has no validation window of {T + 1} tokens; not evaluated on its own")
            continue
        check_vocab(recipe, ds, vocab)
        val_parts.append((name, w, ds))
        val_args.append(_component_args(hooks, "val", name, ds, info))
    val_ds, one_val_args = None, {}
    if not val_parts:
        val_ds = dataset(recipe, "val")
        check_vocab(recipe, val_ds, vocab)
        one_val_args = hooks.loader_args("val", val_ds, info)
        WindowLoader(val_ds, T, G, seed=t.seed)  # raises if validation has not one window
    info("data.mix: " + ", ".join(f"{n} {w:.3f} ({p.num_windows:,} windows)"
                                  for n, w, p in zip(loader.names, loader.weights, loader.parts)))
    return TrainData(parts[0][2], val_ds, loader, one_val_args, val_parts=val_parts, val_part_args=val_args)


def _component_args(hooks: Hooks, split: str, name: str, ds: IndexedDataset, info: Callable[[str], None]) -> dict[str, Any]:
    """What the designs read beside a data.mix component's tokens (its concept labels); their
    errors (a component without labels, another label vocabulary) name the component."""
    try:
        return hooks.loader_args(split, ds, info)
    except UserError as e:
        raise UserError(*(f"data.mix component {name!r} ({split}): {p}" for p in e.problems), hint=e.hint) from None


def dataset(recipe: Recipe, split: str) -> IndexedDataset:
    given = recipe.data.train_prefix if split == "train" else recipe.data.val_prefix
    prefix = given or str(recipe.data_dir / split)
    missing = [str(p) for p in paths(prefix) if not p.is_file()]
    if missing:
        raise UserError(f"no {split} data: {' and '.join(missing)} not found",
                        hint=f"run `ncpctl tokenize {recipe.path}` first, or set data.{split}_prefix")
    return IndexedDataset(prefix)


def vocab_from(recipe: Recipe) -> tuple[str, str]:
    """Which recipe key set the model's vocabulary size (for messages: name only keys that exist
    and were used) and what to change: (origin, hint)."""
    t, tok, n = recipe.train, recipe.tokenizer, recipe.model_config.vocab_size
    if recipe.model.vocab_size is not None:
        return "model.vocab_size", "raise model.vocab_size to the data tokenizer's vocabulary size"
    if t.init_from and (not recipe.model.model_fields_set or is_hf_dir(t.init_from)):
        return (f"the model of train.init_from {t.init_from}",
                "tokenize the data with that model's tokenizer (tokenizer.path)")
    if tok.path:
        return (f"tokenizer.path {tok.path}; model.vocab_size is unset",
                "set tokenizer.path to the tokenizer the data was made with, or tokenize the data again")
    return (f"tokenizer.vocab_size {n}; model.vocab_size is unset",
            "set tokenizer.vocab_size to the data tokenizer's vocabulary size, or tokenize the data again")


def check_special_tokens(cfg: Any, meta: dict, meta_path: Any) -> None:
    """The special tokens the model's designs need (a [MASK]) must be the data tokenizer's, at
    the ids the model config holds (``tokenize`` records them in meta.json)."""
    have = (meta.get("tokenizer") or {}).get("special_tokens") or {}
    for key, text in cfg.special_tokens().items():
        want = functools.reduce(getattr, key.split("."), cfg)
        if have.get(text) != want:
            got = f"has it at id {have[text]}" if have.get(text) is not None else f"has no {text!r} token"
            raise UserError(f"{meta_path}: the data's tokenizer {got}, but model.{key} is {want} "
                            f"(model.objective: {cfg.objective})",
                            hint="tokenize again (ncpctl tokenize adds the token), or set that key")


def check_vocab(recipe: Recipe, ds: IndexedDataset, vocab: int) -> None:
    """The data's token ids must fit the model's embedding (checked before training from what
    meta.json says; the loaders check every batch as it is read)."""
    origin, hint = vocab_from(recipe)
    meta_path, meta = dataset_meta(ds)  # checked: a JSON object whose fields have their types
    data_vocab = ((meta or {}).get("tokenizer") or {}).get("vocab_size")
    if meta is not None and data_vocab is not None:
        check_special_tokens(recipe.model_config, meta, meta_path)
        if data_vocab > vocab:
            raise UserError(f"{meta_path}: the data's tokenizer has {data_vocab} tokens but the model's vocabulary "
                            f"has {vocab} ({origin})", hint=hint)
        top = ((meta.get("splits") or {}).get(Path(ds.prefix).name) or {}).get("max_id")  # recorded by tokenize
        if isinstance(top, int) and top >= vocab:
            raise UserError(f"{meta_path}: {ds.bin_path.name} holds token id {top}, outside the model's vocabulary "
                            f"of {vocab} ids ({origin})", hint=hint)
        return
    top = int(np.asarray(ds.tokens[:10_000_000]).max(initial=0))  # no meta.json (a foreign dataset): sample
    if top >= vocab:
        raise UserError(f"{ds.bin_path}: token id {top} is outside the model's vocabulary of {vocab} ids ({origin})",
                        hint=hint)

"""Load a recipe for profiling: the model's shapes matter, its data files do not.

The Pythia recipes point at the Pile and Pythia's tokenizer.json. Profiling needs neither,
so when the only problems are missing data/tokenizer files, the recipe is loaded again
without them (``data.*_prefix`` and ``tokenizer.path`` unset) and the vocabulary comes from
``model.size`` (Pythia: 50304): the numbers are those of the real model. Every other
recipe problem is still an error, and an explicit ``--set`` always wins.
"""

from __future__ import annotations

from typing import Iterable

from ncpctl.errors import UserError

_FILE_KEYS = ("data.train_prefix", "data.val_prefix", "tokenizer.path")


def _missing_file_keys(err: UserError) -> set[str] | None:
    """The file keys the error is about, or None if any problem is about something else."""
    keys = set()
    for line in err.problems:
        hit = [k for k in _FILE_KEYS if f": {k}: " in line and ("not found" in line)]
        if not hit:
            return None
        keys.update(hit)
    return keys


def load_for_profile(path: str, sets: Iterable[str] = (), world_size: int | None = None,
                     drop_missing_sets: bool = False):  # -> (Recipe, notes)
    """``drop_missing_sets``: a ``--set`` of a file key whose file is missing is dropped too (a
    sweep's ``--dry`` lists points whose shared data is tokenized later); otherwise it wins."""
    from ncpctl.model.core.config import build_config
    from ncpctl.recipe import load_recipe

    sets = list(sets)
    try:
        return load_recipe(path, sets, world_size=world_size), []
    except UserError as e:
        keys = _missing_file_keys(e)
        if not keys:
            raise
    if drop_missing_sets:
        sets = [s for s in sets if s.split("=", 1)[0].strip() not in keys]
    extra = [f"{k}=null" for k in _FILE_KEYS]
    r = load_recipe(path, extra + sets, world_size=world_size)  # shapes only; user --set values still win
    notes = [f"{', '.join(sorted(keys))}: file not found; profiling the model shapes only"]
    user_vocab = any(s.split("=", 1)[0].strip() in ("model.vocab_size", "tokenizer.vocab_size") for s in sets)
    if "tokenizer.path" in keys and r.model.vocab_size is None and not user_vocab:
        vocab = build_config(r.model.size).vocab_size
        r = load_recipe(path, extra + [f"tokenizer.vocab_size={vocab}"] + sets, world_size=world_size)
        notes.append(f"vocab_size {vocab} from model.size={r.model.size} (the tokenizer file is missing)")
    return r, notes

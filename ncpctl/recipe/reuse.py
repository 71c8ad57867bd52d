"""``data.from_run``: train on another run's tokenized data (issue 46 item 9). One key instead of
three (``data.train_prefix``, ``data.val_prefix``, ``tokenizer.path``): it takes that run's
directory (or its ``data/`` directory itself) and fills each of the three that is unset from what
``ncpctl tokenize`` wrote there; one already set to something else is an error, so a resolved
recipe (which records all four) loads again as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

Problem = tuple[str, str]


def data_dir_of(given: str) -> Path:
    """A run directory's ``data/``, or the directory itself when it holds the data."""
    p = Path(given).expanduser()
    return p / "data" if (p / "data").is_dir() and not (p / "train.bin").is_file() else p


def expand_from_run(data: Any, tok: Any) -> list[Problem]:
    """Fill ``data.train_prefix``, ``data.val_prefix`` and ``tokenizer.path`` from ``data.from_run``
    (in place); the problems, keyed ``data.from_run``."""
    if data is None or not data.from_run:
        return []
    d = data_dir_of(data.from_run)
    missing = [n for n in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json") if not (d / n).is_file()]
    if missing:
        return [("data.from_run", f"{data.from_run}: no tokenized data there ({d}: {', '.join(missing)} not found); "
                                  "give a run directory that `ncpctl tokenize` has filled, or its data/ directory")]
    wanted = [(data, "train_prefix", "data.train_prefix", str(d / "train")),
              (data, "val_prefix", "data.val_prefix", str(d / "val"))]
    if tok is not None:
        wanted.append((tok, "path", "tokenizer.path", str(d / "tokenizer.json")))
    problems = []
    for section, attr, key, value in wanted:
        have = getattr(section, attr)
        if have is None:
            setattr(section, attr, value)
        elif Path(have).expanduser().resolve() != Path(value).resolve():
            problems.append(("data.from_run", f"sets {key} to {value}, but the recipe sets it to {have}; "
                                              f"give one or the other"))
    return problems

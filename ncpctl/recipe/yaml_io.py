"""Reading recipe YAML safely: floats as users write them (``6e-4``) and a bound on what YAML
aliases may expand to (the "billion laughs" bomb). Used by the recipe loader (``load.py``)."""

from __future__ import annotations

import re
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``6e-4`` as a float (YAML 1.1 wants ``6.0e-4``; users write ``6e-4``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one line (its problem; PyYAML's messages span lines: "...\\n  in <unicode
    string>, position 0")."""
    return " ".join(str(getattr(e, "problem", None) or e).split())


# Values a recipe document may hold with every alias expanded. A real recipe has a few hundred;
# YAML aliases let a few lines name a billion (the "billion laughs" bomb), which everything after
# parsing (origin recording, validation, the resolved recipe, the checkpoint's JSON) would expand.
MAX_YAML_VALUES = 100_000


class _Unbounded(Exception):
    pass


def alias_problem(doc: Any, limit: int = MAX_YAML_VALUES) -> str | None:
    """Why a parsed YAML document is refused, else None: more than ``limit`` values once its aliases
    are expanded, or an alias inside the value it names (a recursive structure, infinite expanded).
    Time and memory are linear in the document as parsed: a value shared through an alias is
    sized once (memo by identity), never expanded."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in open_:
            raise _Unbounded("a YAML alias is used inside the value it names (a recursive structure)")
        open_.add(id(v))
        n = 1
        for sub in (v.values() if isinstance(v, dict) else v):
            n += size(sub)
            if n > limit:
                raise _Unbounded(f"YAML aliases expand it to more than {limit:,} values (an alias bomb?)")
        open_.discard(id(v))
        sizes[id(v)] = n
        return n

    try:
        size(doc)
    except _Unbounded as e:
        return f"{e}; refusing to read it"
    return None

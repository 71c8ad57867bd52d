"""The recipe reference (docs/recipes.md), generated from the schema where every field is
documented once. Regenerate with ``python -m ncpctl.recipe.reference``; a test checks it is current."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ncpctl.recipe.schema import SECTIONS, design_options


def _type_name(tp: Any) -> str:
    """A type as a reader writes it: ``Optional[X]`` -> X (the default column shows null), a
    constrained ``Annotated[X, ...]`` -> X, ``Literal['a', 'b']``, ``list[float]``, a class by its name."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in args if a is not type(None)]
        return _type_name(parts[0]) if len(parts) == 1 else " | ".join(_type_name(a) for a in parts)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        nested = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None and typing.get_origin(ann) is not list:  # lists of sources: one row, entries below
            rows += _rows(nested, f"{prefix}{name}.")
            continue
        if f.is_required():
            shown = "required"
        elif prefix.startswith("model.") and name != "size":
            shown = "(from model.size)"
        else:
            shown = f"`{f.get_default(call_default_factory=True)!r}`"
        desc = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type_name(ann).replace('|', '/')} | {shown} | {desc} |")
    return rows


def _option_rows() -> list[str]:
    """``model.options.NAME.KEY`` rows of the registered designs that declare keys."""
    rows = []
    for name, kind, options in design_options():
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            if not f.init:
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            desc = (f"{kind} {name}: " + f.metadata.get("doc", "")).replace("|", "\\|")
            rows.append(f"| `model.options.{name}.{f.name}` | {_type_name(hints[f.name]).replace('|', '/')} | "
                        f"`{default!r}` | {desc} |")
    return rows


def render() -> str:
    out = ["# Recipe reference", "",
           "Generated from `ncpctl/recipe/schema.py` and `ncpctl/model/core/config.py` by "
           "`python -m ncpctl.recipe.reference`; do not edit by hand.", "",
           "Precedence: defaults < recipe YAML (a child over what it `extends:`) < `--set KEY.PATH=VALUE`.", ""]
    for section, model in SECTIONS.items():
        out += [f"## `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += _rows(model, f"{section}.")
        if section == "model":
            out += _option_rows()
        if section == "data":
            from ncpctl.recipe.schema import SourceSpec

            out += ["", "Each entry of `data.sources` (a bare string is shorthand for `{path: ...}`):", "",
                    "| key | type | default | meaning |", "|---|---|---|---|"]
            out += _rows(SourceSpec, "")
            from ncpctl.recipe.schema import MixComponent

            out += ["", "Each entry of `data.mix` (`sources` entries as those of `data.sources`):", "",
                    "| key | type | default | meaning |", "|---|---|---|---|"]
            out += _rows(MixComponent, "")
        if section == "eval":
            from ncpctl.recipe.schema import HeldoutSource, SourceSpec

            out += ["", "Each entry of `eval.heldout`: the keys of a `data.sources` entry, plus:", "",
                    "| key | type | default | meaning |", "|---|---|---|---|"]
            out += [r for r in _rows(HeldoutSource, "") if r.split("`")[1] not in SourceSpec.model_fields]
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> Path:
    """``[--import MODULE ...] [OUT]``: import the modules (plugins that register designs with
    their own keys) and write the reference to OUT (default docs/recipes.md)."""
    import importlib

    args = list(argv)
    while "--import" in args:
        i = args.index("--import")
        importlib.import_module(args[i + 1])
        del args[i:i + 2]
    target = Path(args[0]) if args else Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render())
    return target


if __name__ == "__main__":
    print(main(sys.argv[1:]))

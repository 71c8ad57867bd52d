"""A sweep point's name: its values, written so that the name survives a shell and a comma-separated
list (``ncpctl eval --compare A,B C,D``), and stays a file name.

A name is the point's parts joined by ``+``: a zip row's or an explicit point's ``name``, else
``label=value`` per key (the label is the key's last part, unless two keys end alike). Numbers are
written compactly (``max_flops=1e11``, ``lr=0.003``), anything but letters, digits and ``._=+-`` becomes
``_``, a name never starts with ``.`` or ``-``, and one longer than ``MAX_NAME`` characters is cut and
ends with a hash of the whole (two long names stay apart).

Sweeps of ncpctl before this scheme joined the parts with commas and wrote numbers in full
(``d16l2,max_flops=100000000000``): ``legacy_name`` is that name, so a sweep directory written then
is still recognised (``ncpctl.study.sweep.adopt_legacy_names``) and a finished study is not run again.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Iterable, Sequence

MAX_NAME = 120  # characters; OUT/points/NAME.yaml and OUT/logs/NAME.log must stay under 255 bytes
SEP = "+"

# a part of a name: (None, text) for a given name, (label, value) for a key's value
Part = tuple[str | None, Any]


def label(key: str, keys: Iterable[str]) -> str:
    """The short name of ``key`` in point names: its last part, unless another key ends the same."""
    last = key.rsplit(".", 1)[-1]
    return key if sum(k.rsplit(".", 1)[-1] == last for k in keys) > 1 else last


def _exponent(x: float) -> str:
    """``x`` as the shortest exact mantissa-exponent form, without ``+`` or leading zeros: 1e11, 2.5e-5."""
    for digits in range(17):
        text = f"{x:.{digits}e}"
        if float(text) == x:
            break
    mantissa, exp = text.split("e")
    return f"{mantissa}e{int(exp)}"


def compact(v: Any) -> str:
    """A value as a point name writes it: numbers compactly, booleans and null as in YAML."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        plain = str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))
        plain = re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), plain)
        short = _exponent(float(v))
        return short if len(short) <= len(plain) - 3 else plain  # 1e11, but 10000 and 0.0003 as they are
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_").lstrip(".-") or "point"


def _cap(name: str) -> str:
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return name[:MAX_NAME - len(digest) - 1].rstrip("_+-") + "-" + digest


def name_of(parts: Sequence[Part]) -> str:
    """The point's name (see the module docstring)."""
    return _cap(SEP.join(_slug(str(text) if key is None else f"{key}={compact(text)}") for key, text in parts))


def _legacy_fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    return json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else str(v)


def legacy_name(parts: Sequence[Part]) -> str:
    """The name ncpctl gave the point before ``name_of`` (commas, numbers in full), to recognise an
    older sweep's run directories."""
    text = ",".join(str(t) if k is None else f"{k}={_legacy_fmt(t)}" for k, t in parts)
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text).strip("_") or "point"

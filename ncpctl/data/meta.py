"""Reading a dataset's ``meta.json`` (the record ``ncpctl tokenize`` writes beside PREFIX.bin/.idx):
one reader that checks the fields ncpctl reads from it before anyone indexes into them (issue 42
item 6), so a file that is not a JSON object (``[]``), or whose fields have other types, is one
line naming the file and the key, not a ``TypeError`` deep inside a check.

Checked (when present; every other field passes as it is): ``tokenizer`` (an object: ``vocab_size``
a positive integer, ``sha256`` a string, ``eod_id`` an integer, ``special_tokens`` {text: id}),
``splits`` ({split: {``tokens``, ``documents``, ``max_id`` integers, ``documents_per_source`` a
list of integers}}), ``source_labels`` (strings), ``labels`` (an object: ``vocabulary`` and
``document_level`` lists of strings, ``labeller`` a string), ``fingerprint`` (a string).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ncpctl.errors import UserError

HINT = ("it is the record `ncpctl tokenize` writes beside the data: tokenize again (or remove it for a dataset "
        "made elsewhere)")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Tokenizer(_Loose):
    vocab_size: Optional[StrictInt] = Field(None, ge=1)
    sha256: Optional[StrictStr] = None
    eod_id: Optional[StrictInt] = None
    special_tokens: Optional[dict[StrictStr, StrictInt]] = None


class _Split(_Loose):
    tokens: Optional[StrictInt] = Field(None, ge=0)
    documents: Optional[StrictInt] = Field(None, ge=0)
    max_id: Optional[StrictInt] = None
    documents_per_source: Optional[list[StrictInt]] = None


class _Labels(_Loose):
    vocabulary: Optional[list[StrictStr]] = None
    document_level: Optional[list[StrictStr]] = None
    labeller: Optional[StrictStr] = None


class _Meta(_Loose):
    tokenizer: Optional[_Tokenizer] = None
    splits: Optional[dict[StrictStr, _Split]] = None
    source_labels: Optional[list[StrictStr]] = None
    labels: Optional[_Labels] = None
    fingerprint: Optional[StrictStr] = None


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def check(path: Path, data: Any) -> dict[str, Any]:
    """``data`` (parsed from ``path``) as a meta.json: a JSON object whose known fields have their
    types; else a ``UserError`` naming the file and the first wrong key."""
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object ({_kind(data)}): not the meta.json of a dataset", hint=HINT)
    try:
        _Meta.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        raise UserError(f"{path}: {key}: {err['msg']} (got {_kind(err.get('input'))})", hint=HINT) from None
    return data


def read(path: Path) -> dict[str, Any] | None:
    """The meta.json at ``path``, checked (``check``); None when there is none (a dataset made
    elsewhere). Unreadable or not JSON: a ``UserError`` naming it."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: unreadable ({(str(e).splitlines() or [''])[0][:120]})", hint=HINT) from None
    return check(path, data)

"""Where one long document may be cut so that encoding its pieces gives exactly the ids of
encoding it whole (``ncpctl tokenize`` streams a huge single document in bounded memory).

The cut: after a printable ASCII character other than the space (``!`` .. ``~``) that is
followed by a space, so the next piece starts with that space. Why no id changes, for the
pipelines ``cut_refusal`` accepts (and nothing else is cut):

* The pre-tokenizer's regex (GPT-2's, which ``ByteLevel(use_regex=True)`` applies, and the
  cl100k / Llama-3 and Qwen-2 patterns of ``Split`` + ``ByteLevel(use_regex=False)``) has no
  alternative that matches a non-whitespace character followed by a space: a space occurs
  only as the optional first character of a match (`` ?\\p{L}+``, ``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+``,
  ...) or inside a whitespace-only match. So no pre-token of the whole text crosses the cut,
  some match ends exactly there, and the search restarts there as it does at the start of
  the second piece (the patterns have no look-behind; their only look-ahead, ``(?!\\S)``,
  ends whitespace runs, which cannot end at a non-space). The first piece ends with the same
  match as in the whole text: the character after it (a space, or the end of the piece)
  ends every alternative alike. BPE (or any model) then sees the same pre-tokens.
* ``ByteLevel(add_prefix_space)`` adds a space only to a text that does not start with one:
  every piece after the first starts with one; the first starts where the document does.
* Unicode normalization (NFC, NFD, NFKC, NFKD): a space never composes with the character
  before it and both characters at the cut are starters, so normalizing the pieces and
  joining them equals normalizing the whole.
* Added tokens (``<|endoftext|>``, ...) are split out before all that: one that contains a
  non-space character followed by a space could cross the cut, and one with ``rstrip`` or
  ``single_word`` looks at its neighbours, so a tokenizer with such a token is not cut.

A run without such a place (30 MB of one "word", CJK text without spaces) stays one piece:
under these regexes it is one pre-token, which no exact encoding can split.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3, OLMo 2/3
QWEN2 = CL100K.replace(r"\p{N}{1,3}", r"\p{N}")
SAFE_REGEXES = (GPT2, CL100K, QWEN2)
NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")
_CUT = re.compile(r"[!-~](?= )")  # match.end() is a cut


def cut_refusal(tokenizer: Any) -> str | None:
    """None when documents may be cut (see the module doc), else why not (for the log).
    ``tokenizer``: a ``tokenizers.Tokenizer``."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "the tokenizer truncates or pads"
    norm = spec.get("normalizer")
    norms = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    if any(n.get("type") not in NORMALIZERS for n in norms):
        return "its normalizer is not Unicode normalization alone"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level_regex = [s.get("type") for s in steps] == ["ByteLevel"] and steps[0].get("use_regex", True)
    split_then_bytes = (
        [s.get("type") for s in steps] == ["Split", "ByteLevel"]
        and (steps[0].get("pattern") or {}).get("Regex") in SAFE_REGEXES
        and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
        and not steps[1].get("use_regex", True))
    if not (byte_level_regex or split_then_bytes):
        return "its pre-tokenizer is not one whose splits are known (GPT-2, cl100k or Qwen-2 byte-level)"
    if (spec.get("model") or {}).get("dropout"):
        return "its BPE has dropout"
    for tok in spec.get("added_tokens") or []:
        if tok.get("rstrip") or tok.get("single_word") or re.search(r"\S ", tok.get("content", "")):
            return f"its added token {tok.get('content')!r} may reach across a cut"
    return None


def pieces(text: str, size: int) -> Iterator[str]:
    """``text`` as consecutive pieces that join to it: each cut at the first cut place at least
    ``size`` characters into the piece; the rest, when no cut place follows, is the last piece."""
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size - 1)
        if m is None:
            break
        yield text[start:m.end()]
        start = m.end()
    yield text[start:]

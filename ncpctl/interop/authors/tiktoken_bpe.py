"""Steerling's tokenizer as the ``tokenizers`` BPE ncpctl uses (issue 43 item 5).

Theirs (``steerling/data/tokenizer.py``) is tiktoken's ``cl100k_base`` (100,256 byte-level BPE ranks,
cl100k's own special tokens: ``<|endoftext|>`` 100257, the fill-in-the-middle ones 100258-100260,
``<|endofprompt|>`` 100276) plus its own specials after them: ``<|pad|>`` 100277, ``<|bos|>`` 100278,
``<|endofchunk|>`` 100279, ``<|mask|>`` 100280 (and the instruct model's ``<|start_header_id|>``,
``<|end_header_id|>``, ``<|eot_id|>``). The ranks are a tiktoken BPE file (``cl100k_base.tiktoken``:
one ``base64(token bytes) rank`` per line), which tiktoken downloads at run time and a release
directory does not hold: ncpctl reads it from the model directory (any ``*.tiktoken`` there) or from
the file the user names (``--tiktoken FILE``), and refuses with one line without one.

The conversion is transformers' ``TikTokenConverter`` (vocabulary and merges from the ranks, cl100k's
split pattern, byte-level pre-tokenizer and decoder), with the file read here (its reader needs the
``tiktoken`` package for a format of two columns); the special tokens keep their ids (the model's ids
come from its ``config.json`` and ``tokenizer_config.json``). Encoding equals tiktoken's greedy
lowest-rank merging (tests/interop/test_steerling.py, on a small ranks file made there).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from ncpctl.errors import UserError

# cl100k_base's own special tokens (tiktoken's openai_public.py) and its split pattern (transformers'
# TikTokenConverter default, the pattern of cl100k_base)
CL100K_SPECIALS = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                   "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}
# their special tokens: the config field holding the id -> the token's text
STEERLING_SPECIALS = {"eos_token_id": "<|endoftext|>", "pad_token_id": "<|pad|>", "bos_token_id": "<|bos|>",
                      "endofchunk_token_id": "<|endofchunk|>", "mask_token_id": "<|mask|>",
                      "start_header_id": "<|start_header_id|>", "end_header_id": "<|end_header_id|>",
                      "eot_id": "<|eot_id|>"}
URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

_NAMED: list[Path | None] = [None]  # --tiktoken FILE of the running command (set_tiktoken)


def set_tiktoken(path: str | Path | None) -> None:
    """The tiktoken BPE file the user named (``--tiktoken``), used where a directory holds none."""
    _NAMED[0] = Path(path) if path else None


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken BPE file: ``base64(token) rank`` per line -> {token bytes: rank}."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise UserError(f"{path}: unreadable tiktoken BPE file ({e.strerror or e})") from None
    out: dict[bytes, int] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            out[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise UserError(f"{path}: line {i} is not 'base64-token rank' (not a tiktoken BPE file)") from None
    if not out:
        raise UserError(f"{path}: empty tiktoken BPE file")
    return out


def specials(directory: Path, config: dict[str, Any]) -> dict[str, int]:
    """Their special tokens and ids: cl100k's, then the directory's (``config.json``, overridden by
    ``tokenizer_config.json`` where it has the field)."""
    ids = dict(config)
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        try:
            ids.update({k: v for k, v in json.loads(tc.read_text()).items() if k in STEERLING_SPECIALS})
        except (OSError, ValueError) as e:
            raise UserError(f"{tc}: unreadable ({e})") from None
    vocab = ids.get("vocab_size")
    out = {t: i for t, i in CL100K_SPECIALS.items() if not isinstance(vocab, int) or i < vocab}  # the model's ids only
    out.update({text: ids[k] for k, text in STEERLING_SPECIALS.items() if isinstance(ids.get(k), int)})
    return out


def bpe_file(directory: Path) -> Path | None:
    """The ranks file: the one the user named, else the directory's ``*.tiktoken`` (None: neither)."""
    if _NAMED[0] is not None:
        if not _NAMED[0].is_file():
            raise UserError(f"--tiktoken {_NAMED[0]}: no such file")
        return _NAMED[0]
    found = sorted(directory.glob("*.tiktoken"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise UserError(f"{directory}: several tiktoken files ({names}); name one with --tiktoken")
    return found[0] if found else None


def convert(ranks_file: Path, special: dict[str, int]):
    """A ``tokenizers.Tokenizer``: the BPE of ``ranks_file`` with ``special`` tokens at their ids."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks(ranks_file)
    clash = {t: i for t, i in special.items() if i < len(ranks)}
    if clash:
        raise UserError(f"{ranks_file}: special token ids {clash} fall inside its {len(ranks)} BPE ranks "
                        "(not the ranks file of this model)")

    class Converter(TikTokenConverter):
        def tokenizer(self):  # TikTokenConverter's, with the special tokens in the vocabulary at their ids
            vocab, merges = self.extract_vocab_merges_from_model(self.vocab_file)
            tok = Tokenizer(BPE({**vocab, **special}, merges, fuse_unk=False))
            tok.model.ignore_merges = True
            return tok

    Converter.load_tiktoken_bpe = staticmethod(lambda _: ranks)  # the file read above (no tiktoken needed)
    tok = Converter(vocab_file=str(ranks_file)).converted()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def tokenizer(directory: Path, config: dict[str, Any], required: bool):
    """The model's tokenizer (``tokenizers.Tokenizer``): a ``tokenizer.json`` in the directory, else its
    or the named tiktoken file converted; None when neither exists and not ``required``."""
    if (directory / "tokenizer.json").is_file() and _NAMED[0] is None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    path = bpe_file(directory)
    if path is None:
        if not required:
            return None
        raise UserError(f"{directory}: no tokenizer: Steerling's is tiktoken cl100k_base plus special tokens, and "
                        f"the directory holds no *.tiktoken file; name one with --tiktoken FILE "
                        f"(cl100k_base.tiktoken: {URL})")
    return convert(path, specials(directory, config))

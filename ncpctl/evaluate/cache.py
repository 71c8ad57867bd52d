"""A request cache that resumes (``ncpctl eval``; issue 47 item 4), in the spirit of lm-eval's
``--use_cache``, but kept as the requests are scored.

Every request the model answers (a log-likelihood, a rolling log-likelihood, a greedy generation)
is stored under a key of its kind, its arguments (the exact strings lm-eval built, few-shot
examples included) and the scoring settings that change the answer (``NCPLM.cache_settings``:
context length, dtype, a bound's Monte Carlo samples and seed, the default generation length).
The store is one SQLite file per checkpoint, ``eval/cache/<checkpoint name>.sqlite``, committed
after every chunk of requests (``CHUNK`` batches), so an evaluation killed at 90% resumes from
its last chunk and a re-run with one more task scores only that task. A sampled generation
(``do_sample``) is never cached (each of its repeats must be a new draw, as in lm-eval).

The checkpoint's identity is its manifest (every file's size and xxh3-128, ``ncpctl.manifest``;
a checkpoint without one: the same digest of its files, computed here): a file that holds
another identity is emptied before use, so a changed checkpoint never reuses old scores. Ranks
of a data-parallel evaluation share the file (SQLite's locking serialises their commits).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any, Callable, Sequence

from ncpctl import manifest

FORMAT = 1  # bump when what a cached value means changes
CHUNK = 4  # batches of requests scored between two commits


def checkpoint_identity(checkpoint: Path) -> str:
    """sha256 of the checkpoint's manifest entries (sizes and xxh3-128 of every file); computed from
    the files themselves when it has no manifest."""
    files = manifest.read(checkpoint)
    if files is None:
        files = manifest.describe(checkpoint, manifest.files_of(checkpoint))
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


class RequestCache:
    """One checkpoint's cached answers: ``get`` / ``put`` by key (``key``)."""

    def __init__(self, path: Path, identity: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(str(path), timeout=120)  # another rank may be committing
        with self.db:
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            self.db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, value TEXT)")
            row = self.db.execute("SELECT v FROM meta WHERE k = 'identity'").fetchone()
            stamp = f"{FORMAT}:{identity}"
            if row is None or row[0] != stamp:  # another checkpoint (or none yet): nothing here is ours
                self.db.execute("DELETE FROM answers")
                self.db.execute("INSERT OR REPLACE INTO meta VALUES ('identity', ?)", (stamp,))

    @staticmethod
    def key(kind: str, args: Any, settings: dict[str, Any]) -> str:
        text = json.dumps([kind, args, settings], sort_keys=True, default=str, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, keys: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        keys = list(dict.fromkeys(keys))
        for s in range(0, len(keys), 500):  # SQLite's bound-variable limit
            part = keys[s : s + 500]
            q = f"SELECT key, value FROM answers WHERE key IN ({','.join('?' * len(part))})"
            out.update((k, json.loads(v)) for k, v in self.db.execute(q, part))
        return out

    def put(self, items: dict[str, Any]) -> None:
        with self.db:  # one transaction: committed whole, or not at all (a kill inside it)
            self.db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?)",
                                [(k, json.dumps(v)) for k, v in items.items()])

    def __len__(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    def close(self) -> None:
        self.db.close()


def through(cache: RequestCache | None, kind: str, requests: Sequence[Any], settings: dict[str, Any],
            compute: Callable[[list[Any]], list[Any]], chunk: int,
            cacheable: Callable[[Any], bool] = lambda r: True) -> tuple[list[Any], int]:
    """(one answer per request, how many requests the model scored): cached answers where the cache
    has them; the rest scored by ``compute`` ``chunk`` requests at a time, each chunk committed
    before the next starts. Equal requests (a data-parallel rank's padding repeats its last one)
    are scored once."""
    if cache is None:
        return compute(list(requests)), len(requests)
    keys = [RequestCache.key(kind, r.args, settings) if cacheable(r) else None for r in requests]
    got = cache.get([k for k in keys if k is not None])
    todo: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k is not None and k not in got:
            todo.setdefault(k, i)
    firsts = list(todo.items())
    for s in range(0, len(firsts), chunk):
        part = firsts[s : s + chunk]
        answers = compute([requests[i] for _, i in part])
        new = {k: a for (k, _), a in zip(part, answers)}
        cache.put(new)
        got.update(new)
    rest = [i for i, k in enumerate(keys) if k is None]  # never cached: scored every time
    fresh = dict(zip(rest, compute([requests[i] for i in rest]))) if rest else {}
    return [fresh[i] if k is None else got[k] for i, k in enumerate(keys)], len(firsts) + len(rest)

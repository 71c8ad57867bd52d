"""One exception type for user mistakes (style rule 11).

A ``UserError`` is printed as one line per problem (plus an optional hint) with exit
code 2 and no traceback unless ``--debug``; anything else is an internal failure (exit 1).
"""

from __future__ import annotations

import errno
import os

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USER = 2


class UserError(Exception):
    """A mistake the user can fix: bad recipe, bad input, missing file.

    ``problems`` holds one line per problem so that every problem is reported at once. A problem
    that quotes the user's input (a YAML key, a ``--set`` item, a file name) stays one line: its
    control characters (a newline, a tab, a terminal escape) are shown escaped.
    """

    def __init__(self, *problems: str, hint: str | None = None):
        if not problems:
            raise ValueError("UserError needs at least one problem line")
        self.problems = [one_line(p) if isinstance(p, str) else p for p in problems]
        self.hint = one_line(hint) if isinstance(hint, str) else hint
        super().__init__("\n".join(self.problems))


def one_line(text: str) -> str:
    """``text`` with its non-printable characters escaped (``\\n``, ``\\t``, ``\\x1b``): one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


# What a full, read-only or forbidden disk means, as the one line the user sees (exit 2).
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}


def disk_error(e: OSError, path: str | os.PathLike[str] | None = None, doing: str = "writing") -> UserError | None:
    """The UserError for an OSError of a full, read-only or forbidden file system, naming the file
    (the error's own, else ``path``); None for any other error (a bug, or not the disk's fault)."""
    meaning = DISK_ERRNOS.get(e.errno or -1)
    if meaning is None:
        return None
    where = e.filename if e.filename is not None else path
    return UserError(f"{meaning} {doing} {os.fspath(where) if where is not None else '(unknown file)'}",
                     hint="free space (or fix the permissions) there, or point run.dir somewhere else")

"""One exception type for user mistakes (style rule 11).

A ``UserError`` is printed as one line per problem (plus an optional hint) with exit
code 2 and no traceback unless ``--debug``; anything else is an internal failure (exit 1).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USER = 2


class UserError(Exception):
    """A mistake the user can fix: bad recipe, bad input, missing file.

    ``problems`` holds one line per problem so that every problem is reported at once.
    """

    def __init__(self, *problems: str, hint: str | None = None):
        if not problems:
            raise ValueError("UserError needs at least one problem line")
        self.problems = [p for p in problems]
        self.hint = hint
        super().__init__("\n".join(self.problems))

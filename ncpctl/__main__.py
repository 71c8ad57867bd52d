"""``python -m ncpctl``: the CLI, with the working directory taken off the import path first.

``python -m`` puts the working directory at the front of ``sys.path``, so a ``yaml.py`` (or a
module a checkpoint names) lying in the directory a user runs ncpctl from would be imported
instead of the real one: running in a downloaded checkpoint's folder would run its code
(issue 21). The installed ``ncpctl`` command never has it there; this makes ``-m`` the same.
A directory the user puts on ``PYTHONPATH`` on purpose stays.
"""

import os
import sys


def _drop_working_directory() -> None:
    if sys.path and (sys.path[0] in ("", ".") or os.path.realpath(sys.path[0]) == os.path.realpath(os.getcwd())):
        del sys.path[0]


_drop_working_directory()

from ncpctl.cli.app import main  # noqa: E402  (after the import path is safe)

main()

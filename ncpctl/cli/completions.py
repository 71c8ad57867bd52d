"""Shell completion scripts for bash, zsh and fish, generated from the typer app.

The scripts ask `ncpctl` itself for candidates at TAB time (click's completion protocol),
so they always match the installed commands and options. Regenerate the shipped copies in
completions/ with ``python -m ncpctl.cli.completions``; a test checks they are current.
"""

from __future__ import annotations

import sys
from pathlib import Path

SHELLS = {"bash": "ncpctl.bash", "zsh": "_ncpctl", "fish": "ncpctl.fish"}


def script(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    text = get_completion_script(prog_name="ncpctl", complete_var="_NCPCTL_COMPLETE", shell=shell)
    return text.rstrip("\n") + "\n"


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for shell, name in SHELLS.items():
        path = directory / name
        path.write_text(script(shell))
        out.append(path)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "completions"
    for p in write_all(target):
        print(p)

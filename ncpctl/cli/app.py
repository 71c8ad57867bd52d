"""The `ncpctl` typer app: global options and the subcommand table.

Each subcommand lives in its own module (style rule 4) and only parses, loads the recipe
and calls library code. Nothing here imports torch or DeepSpeed, so `ncpctl --help` is fast.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl import __version__
from ncpctl.cli import adapt_vq, eval as eval_cmd, export, fit, generate, inspect_cmd, midtrain, pretrain, profile_kernels, \
    tokenize
from ncpctl.cli._common import STATE

app = typer.Typer(
    name="ncpctl",
    help="Train and study Next Concept Prediction (NCP) language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # our own error handling: one line, tracebacks with --debug
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ncpctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable result on stdout.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Full tracebacks.")] = False,
) -> None:
    """Train and study Next Concept Prediction (NCP) language models.

    Every subcommand but fit reads a YAML recipe (see recipes/) and accepts --set KEY.PATH=VALUE
    overrides; all accept --json and --debug, and exit 0 (success), 2 (user error) or 1 (internal).
    """
    STATE.json, STATE.debug = json_out, debug


app.command("tokenize")(tokenize.main)
app.command("pretrain")(pretrain.main)
app.command("midtrain")(midtrain.main)
app.command("adapt-vq")(adapt_vq.main)
app.command("eval")(eval_cmd.main)
app.command("generate")(generate.main)
app.command("export")(export.main)
app.command("inspect")(inspect_cmd.main)
app.command("profile-kernels")(profile_kernels.main)
app.command("fit")(fit.main)


def main() -> None:
    import sys

    # The deepspeed launcher runs `ncpctl --local_rank=N <command> ...`; the rank comes from
    # the environment it also sets (LOCAL_RANK), so the flag is dropped before typer sees it.
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
    app(prog_name="ncpctl", args=args)

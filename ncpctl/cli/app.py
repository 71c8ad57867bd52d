"""The `ncpctl` typer app: global options and the subcommand table.

Each subcommand lives in its own module (style rule 4) and only parses, loads the recipe
and calls library code. Nothing here imports torch or DeepSpeed, so `ncpctl --help` is fast.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from ncpctl.threads import prefer_passive_waiting

prefer_passive_waiting()  # before anything imports torch: its OpenMP runtime reads it once (ncpctl.threads)

import typer  # noqa: E402

from ncpctl import __version__  # noqa: E402
from ncpctl.cli import adapt_vq, eval as eval_cmd, export, fit, generate, inspect_cmd, midtrain, pretrain, profile_kernels, \
    sweep, tokenize, train_drafter  # noqa: E402
from ncpctl.cli._common import STATE, report_failure  # noqa: E402



def _flags_without_a_type() -> None:
    """typer 0.29's rich help prints ``<bool>`` in the type column of every flag (``--json``,
    ``--help``, ...), which takes no value (issue 46 item 10): flags show no type there."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)  # typer before 0.2x: no type column to fix
    if shown is None or getattr(shown, "ncpctl", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich.ncpctl = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich


_flags_without_a_type()

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
app.command("train-drafter")(train_drafter.main)
app.command("eval")(eval_cmd.main)
app.command("generate")(generate.main)
app.command("export")(export.main)
app.command("inspect")(inspect_cmd.main)
app.command("profile-kernels")(profile_kernels.main)
app.command("fit")(fit.main)
app.command("sweep")(sweep.main)


def main() -> None:
    import sys

    # The deepspeed launcher runs `ncpctl --local_rank=N <command> ...`; the rank comes from
    # the environment it also sets (LOCAL_RANK), so the flag is dropped before typer sees it.
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
    json_mode = "--json" in args
    _refuse_dotted_options(args, json_mode)
    if not json_mode:
        app(prog_name="ncpctl", args=args)
        return
    # --json: a usage error (an unknown option, a missing argument) reaches stdout as JSON too
    try:  # typer >= 0.2x vendors its own click
        from typer._click import exceptions as cx
    except ImportError:  # pragma: no cover (older typer: click itself)
        from click import exceptions as cx

    try:
        rv = app(prog_name="ncpctl", args=args, standalone_mode=False)
    except cx.ClickException as e:
        _fail_usage([e.format_message() if e.__class__.__name__ != "NoArgsIsHelpError" else "no command given"],
                    "see ncpctl -h", e.exit_code, True)
    except cx.Abort:
        _fail_usage(["aborted"], None, 1, True)
    sys.exit(rv if isinstance(rv, int) else 0)


def _refuse_dotted_options(args: list[str], json_mode: bool) -> None:
    """``--train.max_steps 30`` (litgpt's habit) names a recipe key as an option: say how ncpctl sets it."""
    for i, a in enumerate(args):
        name = a.split("=", 1)[0]
        if name.startswith("--") and "." in name and (i == 0 or args[i - 1] != "--set"):
            key = name[2:]
            value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "VALUE")
            _fail_usage([f"{name}: no such option; recipe keys are set with --set KEY.PATH=VALUE"],
                        f"--set {key}={value}", 2, json_mode)


def _fail_usage(lines: list[str], hint: str | None, code: int, json_mode: bool) -> None:
    import sys

    report_failure(json_mode, lines, hint, code)
    sys.exit(code)

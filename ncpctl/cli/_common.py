"""What every subcommand shares: options (defined once), output, and error handling.

Output contract (``ncpctl.output.Output``, which each command hands its library entry point):
human-readable progress and messages go to stderr; the command's result goes to stdout — as one
JSON object with ``--json``, as a human summary otherwise — so
``ncpctl tokenize r.yaml --json | jq .tokens.train`` works in CI pipelines.
Exit codes: 0 success, 2 user error (bad recipe, bad input), 1 internal failure.
This module must stay light: ``ncpctl --help`` may not import torch or DeepSpeed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Optional

import typer

from ncpctl.errors import EXIT_INTERNAL, EXIT_USER, UserError, disk_error
from ncpctl.output import Output  # noqa: F401 (the commands build it; defined below the CLI, where the library reports through it)

RecipeArg = Annotated[str, typer.Argument(help="Recipe YAML file (see recipes/).", show_default=False)]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", metavar="KEY.PATH=VALUE",
                 help="Override a recipe key (repeatable; wins over the YAML).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (human output to stderr).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
StrategyOpt = Annotated[
    Optional[list[str]],
    typer.Option("--strategy", metavar="PACKAGE.MODULE:CLASS",
                 help="Import this strategy (segmentation, coupling, residual, objective, backbone) where a "
                      "checkpoint names it (repeatable). A strategy named only by a checkpoint is never imported: "
                      "opening a checkpoint runs no code from it.", show_default=False),
]
BreakLockOpt = Annotated[bool, typer.Option(
    "--break-lock", help="Take the run directory's lock (run.dir/ncpctl.lock) even if another host holds it.")]
TiktokenOpt = Annotated[Optional[str], typer.Option(
    "--tiktoken", metavar="FILE", help="A model directory in Steerling's layout: the tiktoken BPE file of its tokenizer "
    "(cl100k_base.tiktoken), when the directory holds none.", show_default=False)]
NoVerifyOpt = Annotated[bool, typer.Option(
    "--no-verify", help="Do not check the checkpoint's files against its manifest (sizes and xxh3-128 checksums).")]
ConceptTableOpt = Annotated[Optional[str], typer.Option(
    "--concept-table", help="A concept bottleneck's labels: a table with concept_id, concept_name (and "
    "concept_description, head, is_steerable), .parquet/.csv/.jsonl/.json, such as Steerling's "
    "concept_labels.parquet. Names the known concepts (steer by name, reports) instead of the checkpoint's own "
    "names.", show_default=False)]


@dataclass
class GlobalState:
    json: bool = False
    debug: bool = False


STATE = GlobalState()


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a subcommand: merge global --json/--debug, format errors, set exit codes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        json_mode = kwargs.get("json_out", False) or STATE.json
        debug = kwargs.get("debug", False) or STATE.debug
        kwargs["json_out"], kwargs["debug"] = json_mode, debug
        try:
            _trust_strategies(kwargs.get("strategies"))
            if kwargs.get("tiktoken"):
                from ncpctl.interop.authors.tiktoken_bpe import set_tiktoken  # light: no torch

                set_tiktoken(kwargs["tiktoken"])
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except UserError as e:
            if debug:
                traceback.print_exc()
            _fail(json_mode, e.problems, e.hint, EXIT_USER)
        except KeyboardInterrupt:
            _fail(json_mode, ["interrupted"], None, 130)
        except OSError as e:  # a full, read-only or forbidden disk is the user's to fix, not a bug
            err = disk_error(e, doing="accessing")
            if err is None:
                raise _internal(e, json_mode, debug)
            if debug:
                traceback.print_exc()
            _fail(json_mode, err.problems, err.hint, EXIT_USER)
        except Exception as e:  # internal bug: say so loudly, traceback with --debug
            if _peer_lost(e) and not debug:
                _fail(json_mode, [f"stopped because another rank did: the collective this rank waited in failed "
                                  f"({_first_line(e)[:160]})"],
                      "the other rank's own error line (above, or in its log) names the cause", EXIT_USER)
            raise _internal(e, json_mode, debug)

    return wrapper


# what torch.distributed raises on the ranks that are left when one rank exits or is killed (gloo, NCCL)
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|Socket Timeout|"
                        r"Timed out waiting|NCCL communicator was aborted")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _peer_lost(e: Exception) -> bool:
    """Whether ``e`` is a collective that failed because another rank of a multi-process run went away
    (a consequence, not the cause: that rank reports the cause itself)."""
    return _world() > 1 and isinstance(e, RuntimeError) and _PEER_LOST.search(str(e)) is not None


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank_prefix() -> str:
    """``rank R of N: `` in a multi-process run (the launcher's RANK and WORLD_SIZE; every rank prints
    its own error, so each line says whose it is), else nothing."""
    rank = os.environ.get("RANK", "")
    return f"rank {rank} of {_world()}: " if _world() > 1 and rank.isdigit() else ""


def _trust_strategies(targets: list[str] | None) -> None:
    """``--strategy`` values: the import paths the user names, which a checkpoint may then use."""
    if not targets:
        return
    from ncpctl.model.core.config import trust  # pure Python: no torch

    bad = [t for t in targets if t.count(":") != 1 or not all(t.split(":"))]
    if bad:
        raise UserError(*(f"--strategy {t!r}: expected package.module:Class" for t in bad))
    trust(*targets)


def _internal(e: Exception, json_mode: bool, debug: bool) -> Exception:
    if debug:
        return e
    _fail(json_mode, [f"internal error: {type(e).__name__}: {_first_line(e)}"],
          "rerun with --debug for the traceback, and please report it", EXIT_INTERNAL)
    return e  # not reached: _fail raises typer.Exit


def _fail(json_mode: bool, lines: list[str], hint: str | None, code: int) -> None:
    report_failure(json_mode, lines, hint, code)
    raise typer.Exit(code)


def report_failure(json_mode: bool, lines: list[str], hint: str | None, code: int) -> None:
    """The documented error style: ``error:`` lines and a ``hint:`` on stderr, and with ``--json``
    the JSON error document on stdout (the caller exits with ``code``). In a multi-process run each
    line names its rank (``rank_prefix``)."""
    lines = [rank_prefix() + line for line in lines]
    for line in lines:
        sys.stderr.write(f"error: {line}\n")
    if hint:
        sys.stderr.write(f"hint: {hint}\n")
    if json_mode:
        sys.stdout.write(json.dumps({"ok": False, "exit_code": code, "errors": lines, "hint": hint}) + "\n")

"""The CLI through its real entry point (the installed `ncpctl` script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ncpctl import __version__
from ncpctl.cli._common import DebugOpt, JsonOpt, command
from ncpctl.errors import UserError

from ..conftest import RECIPES, run_cli

COMMANDS = ["tokenize", "pretrain", "midtrain", "adapt-vq", "train-drafter", "eval", "generate", "export", "profile-kernels", "inspect", "fit",
            "sweep"]
RECIPE_COMMANDS = [c for c in COMMANDS if c not in ("fit", "sweep")]  # they read runs / sweep files: no --set


def test_help_lists_commands_and_imports_no_torch() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert name in r.stdout
    # `ncpctl --help` must stay light: building the app imports neither torch nor deepspeed
    code = ("import sys, ncpctl.cli.app as a; a.app(['--help'], standalone_mode=False); "
            "bad = [m for m in ('torch', 'deepspeed', 'datasets', 'pydantic') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_and_shared_options(name: str) -> None:
    r = run_cli(name, "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--json", "--debug", *(("--set",) if name in RECIPE_COMMANDS else ())):
        assert opt in r.stdout


def test_version() -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ncpctl {__version__}"


def test_bad_recipe_exit_2_one_line_each_no_traceback(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("model: {size: debug, concept: {enabled: true, segments: 5}}\ntrain: {max_steps: many}\nfoo: 1\n")
    r = run_cli("tokenize", str(p))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 4  # unknown section, wrong type, S not dividing d, no sources
    assert all(str(p) in line for line in lines)
    assert any("model.concept.segments" in line for line in lines)
    # the global --json (before the command) and the per-command one behave the same
    for args in (["--json", "tokenize", str(p)], ["tokenize", str(p), "--json"]):
        r = run_cli(*args)
        assert r.returncode == 2
        out = json.loads(r.stdout)
        assert out["ok"] is False and out["exit_code"] == 2 and len(out["errors"]) == 4


def test_debug_shows_traceback_for_user_errors(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train: {max_steps: many}\n")
    r = run_cli("--debug", "tokenize", str(p))
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_missing_recipe_and_bad_set_are_user_errors(tmp_path: Path) -> None:
    r = run_cli("tokenize", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "file not found" in r.stderr
    r = run_cli("tokenize", str(RECIPES / "debug.yaml"), "--set", "nonsense")
    assert r.returncode == 2 and "KEY.PATH=VALUE" in r.stderr
    r = run_cli("tokenize")  # usage error from the parser: exit 2 as well
    assert r.returncode == 2


def test_python_dash_m_entry_point() -> None:
    r = subprocess.run([sys.executable, "-m", "ncpctl", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout


def test_help_paragraphs_flow_to_the_terminal_width() -> None:
    """A command's description is wrapped by the terminal, not where its docstring's source lines
    break (at 200 columns a sentence the source splits is one line), and markup in it renders:
    backticks as code, a literal <name> kept."""
    export = run_cli("export", "--help").stdout
    assert "ConceptLM models carry their own modeling code (load with trust_remote_code=True)" in export
    pretrain = run_cli("pretrain", "--help").stdout
    assert "`" not in pretrain.split("Arguments")[0] and "train.resume: auto continues" in pretrain
    assert "compare_<runs>.{json,md,png}" in run_cli("eval", "--help").stdout


def test_help_is_light_through_the_entry_point() -> None:
    """`ncpctl --help` and every `ncpctl CMD --help` run with torch and deepspeed made
    unimportable (so none of them imports either), and `ncpctl --help` costs under a second
    of CPU time (CPU, not wall time: the test box is shared)."""
    code = ("import sys; sys.modules.update(torch=None, deepspeed=None, transformers=None, datasets=None); "
            "from ncpctl.cli.app import main; sys.argv = ['ncpctl', *sys.argv[1:]]; main()")
    for args in (["--help"], *([name, "--help"] for name in COMMANDS)):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        assert "Usage" in r.stdout, args
    import resource

    best = float("inf")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert run_cli("--help").returncode == 0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    assert best < 1.0, f"ncpctl --help took {best:.2f} s of CPU"


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("where", ["global", "command"])
def test_json_on_every_command(name: str, where: str, tmp_path: Path) -> None:
    """--json (before or after the command) puts exactly one JSON object on stdout, also on
    errors; human messages stay on stderr."""
    target = str(tmp_path / "missing.yaml")
    args = ["--json", name, target] if where == "global" else [name, target, "--json"]
    if name in ("generate", "inspect"):
        args += ["--prompt", "x"]
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    out = json.loads(r.stdout)  # the whole stdout is one JSON document
    assert out["ok"] is False and out["exit_code"] == 2 and out["errors"]
    assert all(target in e for e in out["errors"]), out
    assert f"error: {out['errors'][0]}" in r.stderr and "Traceback" not in r.stderr


def test_internal_failure_is_exit_1_and_debug_reraises() -> None:
    """Exit codes of the shared wrapper: a bug is exit 1 with one line (traceback with --debug);
    a UserError is exit 2; --json reports either as JSON on stdout."""
    app = typer.Typer()

    @app.command()
    @command
    def boom(kind: str, json_out: JsonOpt = False, debug: DebugOpt = False) -> None:
        if kind == "bug":
            raise ZeroDivisionError("division by zero\nsecond line")
        raise UserError("bad input", "another problem")

    runner = CliRunner()
    r = runner.invoke(app, ["bug"])
    assert r.exit_code == 1
    assert "error: internal error: ZeroDivisionError: division by zero\n" in r.output
    assert "second line" not in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["bug", "--debug"])
    assert isinstance(r.exception, ZeroDivisionError)  # re-raised: the full traceback
    r = runner.invoke(app, ["bug", "--json"])
    assert r.exit_code == 1 and '"exit_code": 1' in r.output
    r = runner.invoke(app, ["user"])
    assert r.exit_code == 2 and "error: bad input\nerror: another problem\n" in r.output


def test_each_rank_of_a_multi_process_run_names_itself_and_a_lost_peer_is_no_internal_error(monkeypatch) -> None:
    """Issue 42 item 6: a 2-rank failure printed one gloo line (an "internal error") without saying
    which rank, or why. Under a launcher (RANK, WORLD_SIZE) every error line names its rank; the
    error a rank gets when another rank went away says so (the cause is that rank's own line), exit 2."""
    app = typer.Typer()

    @app.command()
    @command
    def boom(kind: str, json_out: JsonOpt = False, debug: DebugOpt = False) -> None:
        if kind == "gloo":  # what torch.distributed raises on rank 1 when rank 0 exits
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                               "[127.0.0.1]:17828. This is typically caused by a remote worker crashing.")
        raise UserError("/run/checkpoints/latest: is a directory")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    runner = CliRunner()
    r = runner.invoke(app, ["user"])
    assert r.exit_code == 2 and "error: rank 1 of 2: /run/checkpoints/latest: is a directory\n" in r.output
    r = runner.invoke(app, ["gloo", "--json"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "internal error" not in r.output, r.output
    assert errors[0].startswith("error: rank 1 of 2: stopped because another rank did") and "Connection closed" in errors[0]
    assert json.loads(r.stdout)["errors"] == [errors[0].removeprefix("error: ")]
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no rank in the line, and no peer to have lost
    r = runner.invoke(app, ["gloo"])
    assert r.exit_code == 1 and "error: internal error: RuntimeError" in r.output


@pytest.mark.parametrize("argv,error,hint", [
    # litgpt's habit: a recipe key as an option
    (["pretrain", "r.yaml", "--train.max_steps", "30"], "--train.max_steps: no such option; recipe keys are set "
     "with --set KEY.PATH=VALUE", "--set train.max_steps=30"),
    (["pretrain", "r.yaml", "--model.concept.k=3", "--json"], "--model.concept.k: no such option; recipe keys are "
     "set with --set KEY.PATH=VALUE", "--set model.concept.k=3"),
    # any other usage error under --json: one JSON document on stdout too (it printed nothing there)
    (["--json", "pretrain", "r.yaml", "--bogus"], "No such option: --bogus", "see ncpctl -h"),
    (["--json"], "Missing command.", "see ncpctl -h"),
])
def test_usage_errors_in_the_documented_style(argv, error, hint, monkeypatch, capsys) -> None:
    """Issue 28 item 7: one line and a hint on stderr, exit 2, and with --json the JSON error on stdout."""
    from ncpctl.cli import app as app_module

    monkeypatch.setattr(sys, "argv", ["ncpctl", *argv])
    with pytest.raises(SystemExit) as e:
        app_module.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2
    assert err.splitlines()[-2:] == [f"error: {error}", f"hint: {hint}"]
    if "--json" in argv:
        assert json.loads(out) == {"ok": False, "exit_code": 2, "errors": [error], "hint": hint}
    else:
        assert out == ""

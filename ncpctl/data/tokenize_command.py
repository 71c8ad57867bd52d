"""What ``ncpctl tokenize`` calls: ``run_tokenize(TokenizeRequest, out)`` loads the recipe, tokenizes
its corpus with a progress bar on stderr (``ncpctl.data.tokenize.tokenize``) and reports the splits.
rich and the tokenizer are imported when it runs (``ncpctl --help`` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class TokenizeRequest:
    """``ncpctl tokenize``'s arguments: the recipe file, its ``--set`` overrides, ``--force``."""

    recipe: str
    sets: list[str] = field(default_factory=list)
    force: bool = False


def run_tokenize(req: TokenizeRequest, out: Output) -> None:
    """Tokenize the recipe's corpus into run.dir/data; the result (splits, tokenizer) through ``out``."""
    from ncpctl.recipe import load_recipe

    r = load_recipe(req.recipe, req.sets, need_sources=True)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from ncpctl.data.tokenize import tokenize

    columns = (
        SpinnerColumn(), TextColumn("[bold]tokenize[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("docs"),
        TextColumn("{task.fields[tokens]:,} tok  {task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(),
    )
    bar = Progress(*columns, console=out.err)
    task = bar.add_task("tokenize", total=None, start=False, tokens=0, rate=0.0)
    tokens = 0

    def on_total(n: int | None) -> None:  # called once encoding starts: show the bar from then on
        bar.update(task, total=n)
        bar.start_task(task)
        bar.start()

    def on_progress(docs: int, toks: int) -> None:
        nonlocal tokens
        tokens += toks
        bar.update(task, advance=docs, tokens=tokens, rate=tokens / (bar.tasks[task].elapsed or 1e-9))

    try:
        meta = tokenize(r, force=req.force, on_progress=on_progress, on_total=on_total,
                        log=lambda msg: out.info(f"[dim]{msg}[/]"))
        if not meta["up_to_date"]:
            bar.update(task, total=bar.tasks[task].completed)  # skipped docs never advance the bar
    finally:
        bar.stop()

    skipped = meta["skipped"]
    if skipped["undecodable"]:
        out.warn(f"skipped {skipped['undecodable']} documents with undecodable (non UTF-8) bytes, e.g. "
                 + ", ".join(skipped["undecodable_examples"]))
    result = {"command": "tokenize", "data_dir": str(r.data_dir), **meta}
    out.result(result, lambda con: human(con, r.data_dir, meta))


def human(con: Any, data_dir: Any, meta: dict[str, Any]) -> None:
    """The splits written (or found up to date) and the tokenizer, for people."""
    from rich.table import Table

    state = "up to date (inputs unchanged; --force to redo)" if meta["up_to_date"] else "written"
    table = Table(title=f"{data_dir}: {state}", title_justify="left")
    for col in ("split", "documents", "tokens"):
        table.add_column(col, justify="right" if col != "split" else "left")
    for split, s in meta["splits"].items():
        table.add_row(split, f"{s['documents']:,}", f"{s['tokens']:,}")
    con.print(table)
    for name, tokens in (meta.get("mix") or {}).items():  # data.mix: each component's own prefix
        con.print(f"data.mix component {name}: {tokens['prefix_dir']}/{{train,val}}: {tokens['train']:,} and "
                  f"{tokens['val']:,} tokens")
    tok = meta["tokenizer"]
    con.print(f"tokenizer: vocab {tok['vocab_size']:,} ({'trained' if tok['trained'] else 'loaded'}), "
              f"EOD id {tok['eod_id']}, dtype {meta['dtype']}, "
              + (f"{meta['tokens_per_second']:,} tokens/s" if not meta["up_to_date"]
                 else f"nothing encoded now (written at {meta['tokens_per_second']:,} tokens/s)"))

"""`ncpctl export`: a checkpoint -> a complete, self-checked Hugging Face directory."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ncpctl.cli._common import DebugOpt, JsonOpt, NoVerifyOpt, Output, SetOpt, StrategyOpt, TiktokenOpt, command


@command
def main(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint or run directory.", show_default=False)],
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Output directory: new, empty, or an earlier "
                                               "export (default: RUN/export of the checkpoint's run directory; a "
                                               "checkpoint's export.out is not followed).", show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Weight dtype: fp32 or bf16 (default export.dtype).",
                                                 show_default=False)] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Do not reload the export and compare logits.")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="Shard safetensors above this "
                                                          "size, e.g. 5GB (default export.max_shard_size).",
                                                          show_default=False)] = None,
    move_aside: Annotated[bool, typer.Option("--move-aside", help="An earlier export at --out that holds files "
                                             "ncpctl did not write, or changed since it wrote them: move it to "
                                             "OUT.prev-TIME (kept whole) instead of refusing.")] = False,
    format_: Annotated[str, typer.Option("--format", help="hf: a Hugging Face directory; steerling: Steerling's "
                                         "own layout (their config.json and weight names, loadable by "
                                         "SteerlingGenerator.from_pretrained); conceptlm: the ConceptLM authors' "
                                         "layout (their config.json and weight names, fp32, loadable by their "
                                         "ConceptLM_* classes).")] = "hf",
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    strategies: StrategyOpt = None,
    no_verify: NoVerifyOpt = False,
    tiktoken: TiktokenOpt = None,
) -> None:
    """Export a checkpoint as a Hugging Face model directory (config, safetensors, tokenizer).

    Base models become native GPTNeoXForCausalLM / LlamaForCausalLM; ConceptLM models carry their
    own modeling code (load with trust_remote_code=True). The export reloads itself and compares
    logits with the source on a probe batch; above tolerance nothing is written. An existing
    directory that export did not write (no .ncpctl-export.json) is never replaced, nor is an
    earlier export whose files changed since (their sizes and checksums are in that marker).
    """
    from pathlib import Path

    from ncpctl.checkpoint import read_meta, resolve, run_dir_of, set_verify
    from ncpctl.errors import UserError
    from ncpctl.interop.hf_export import export

    set_verify(not no_verify)
    o = Output(json_out)
    if set_:
        raise UserError("--set does not apply to export (a checkpoint carries its recipe)",
                        hint="use --out/--dtype/--max-shard-size/--skip-verify")
    ck = resolve(checkpoint)
    section = ((read_meta(ck).get("recipe") or {}).get("export") or {})
    # Where to write is the user's choice (--out), never the checkpoint's: a shared or downloaded
    # checkpoint's recipe could name any directory (issue 21). Its export.out is only mentioned.
    target = Path(out) if out else (run_dir_of(ck) or ck) / "export"
    if not out and section.get("out") and Path(section["out"]) != target:
        from rich.markup import escape

        o.warn(escape(f"the checkpoint's recipe sets export.out={section['out']}, which export follows only from "
                      f"--out; writing to {target}"))
    verify = not skip_verify and section.get("verify", True)
    formats = {"steerling": "steerling_export", "conceptlm": "conceptlm_export"}  # the authors' layouts (issue 43)
    if format_ != "hf" and format_ not in formats:
        raise UserError(f"--format: {format_!r} is not one of hf, {', '.join(formats)}")
    if format_ in formats:  # ncpctl/interop/authors/<module>.py
        import importlib

        export = importlib.import_module(f"ncpctl.interop.authors.{formats[format_]}").export
    extra = {"move_aside": True} if move_aside else {}
    info = export(ck, target, dtype=dtype or section.get("dtype", "fp32"), verify=verify,
                  max_shard_size=max_shard_size or section.get("max_shard_size", "5GB"),
                  log=lambda m: o.info(f"[dim]{m}[/]"), **extra)

    def human(con) -> None:
        con.print(f"exported {ck} -> [bold]{info['out']}[/] as {info.get('architecture', info.get('format'))} ({info['dtype']}, "
                  f"{info['parameters']:,} parameters, {info['shards']} shard(s))")
        if info.get("moved_aside"):
            con.print(f"  the earlier export (changed since ncpctl wrote it) was moved to {info['moved_aside']}")
        if info.get("remote_code"):
            con.print("  load with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True); the tokenizer "
                      "with PreTrainedTokenizerFast.from_pretrained(DIR)")
        v = info.get("verify")
        same = "; tokenizer identical" if info.get("format", "hf") == "hf" else " (imported back)"
        con.print(f"  verified: max |logit diff| {v['max_abs_diff']:.3g} <= {v['tolerance']:.3g}{same}"
                  if v else "  [yellow]not verified (--skip-verify)[/]")

    o.result({"command": "export", "checkpoint": str(ck), **info}, human)

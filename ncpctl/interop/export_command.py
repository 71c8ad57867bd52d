"""What ``ncpctl export`` calls: ``run_export(ExportRequest, out)`` exports a checkpoint as a Hugging
Face directory (``hf_export``) or in an author's own layout (``authors/steerling_export``,
``authors/conceptlm_io``), after the checks that need no model; the summary through ``out``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class ExportRequest:
    """``ncpctl export``'s arguments as typed (``ncpctl/cli/export.py`` documents each flag)."""

    checkpoint: str
    out: str | None = None
    dtype: str | None = None
    skip_verify: bool = False
    max_shard_size: str | None = None
    move_aside: bool = False
    format: str = "hf"
    set_: list[str] | None = None
    verify: bool = True  # --no-verify: the checkpoint's manifest is not checked


def run_export(req: ExportRequest, o: Output) -> None:
    """Export ``req.checkpoint`` to ``req.out`` (default RUN/export); its summary through ``o``."""
    from ncpctl.checkpoint import read_meta, resolve, run_dir_of, set_verify
    from ncpctl.interop.hf_export import export

    checkpoint, out, dtype, max_shard_size, format_ = req.checkpoint, req.out, req.dtype, req.max_shard_size, req.format
    set_verify(req.verify)
    if req.set_:
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
    verify = not req.skip_verify and section.get("verify", True)
    formats = {"steerling": "steerling_export", "conceptlm": "conceptlm_io"}  # the authors' layouts (issue 43)
    if format_ != "hf" and format_ not in formats:
        raise UserError(f"--format: {format_!r} is not one of hf, {', '.join(formats)}")
    if format_ in formats:  # ncpctl/interop/authors/<module>.py
        import importlib

        export = importlib.import_module(f"ncpctl.interop.authors.{formats[format_]}").export
    extra = {"move_aside": True} if req.move_aside else {}
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

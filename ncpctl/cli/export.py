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
    from ncpctl.interop.export_command import ExportRequest, run_export

    run_export(ExportRequest(checkpoint, out=out, dtype=dtype, skip_verify=skip_verify, max_shard_size=max_shard_size,
                             move_aside=move_aside, format=format_, set_=set_, verify=not no_verify), Output(json_out))

"""What ``ncpctl inspect`` calls: one ``InspectRequest`` (the command line, parsed) and
``inspect_checkpoint(request, out)``: the checks that need no model, then the report the request
names: ``ncpctl.interpret.report`` reads concepts, attributes inputs or searches a concept table;
``generated`` (here, on the sampler: ``--generate``) samples each prompt block by block and explains
every generated token in the state in which it was committed (per-token logit contribution and
concept attribution, chunk-level attribution, and with ``--attribute-inputs`` input attribution).
It sits on the inference floor because prompts files and sampling are inference's; the reports
below it are interpret's. Nothing heavy is imported at module level."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


@dataclass
class InspectRequest:
    """``ncpctl inspect``'s arguments as typed (``ncpctl/cli/inspect_cmd.py`` documents each flag)."""

    checkpoint: str
    prompt: list[str] | None = None
    prompts_file: str | None = None
    target: str | None = None
    top: int | None = None
    ablate_codes: int = 3
    corpus: list[str] | None = None
    windows: int = 64
    seq_len: int | None = None
    lift_windows: int = 2
    plot: str | None = None
    attribute_inputs: bool = False
    concept: str | None = None
    unit: str | None = None
    block_tokens: int | None = None
    ig_steps: int | None = None
    baseline: str | None = None
    generate: int | None = None
    seed: int | None = None
    temperature: float = 1.0
    steps_per_block: int | None = None
    steer: list[str] | None = None
    concept_table: str | None = None
    find_concept: str | None = None
    set_: list[str] | None = None


def inspect_checkpoint(req: InspectRequest, o: Output) -> None:
    """``ncpctl inspect``: the checks that need no model, then the mode the request names."""
    from ncpctl.interpret.report import attribute_inputs, find_concept, read_concepts

    if req.find_concept is not None:
        return find_concept(o, req.checkpoint, req.find_concept, req.concept_table, req.top)
    sampling = dict(seed=req.seed, steps_per_block=req.steps_per_block, steer=req.steer)
    if req.generate is None and (any(v for v in sampling.values()) or req.temperature != 1.0):
        raise UserError("--seed, --temperature, --steps-per-block and --steer apply with --generate")
    prompts = _checked_prompts(req.checkpoint, req.prompt, req.prompts_file, req.corpus, req.target, req.set_)
    if req.generate is not None:
        if req.corpus or req.target is not None or req.plot:
            raise UserError("--generate explains its own generation: --corpus, --target and --plot do not apply")
        return generated(o, req.checkpoint, prompts, req.generate, top=req.top, attribute_inputs=req.attribute_inputs,
                           ig_steps=req.ig_steps, temperature=req.temperature, concept_table=req.concept_table,
                           **sampling)
    attr = dict(concept=req.concept, unit=req.unit, block_tokens=req.block_tokens, ig_steps=req.ig_steps,
                baseline=req.baseline)
    if req.attribute_inputs or any(v is not None for v in attr.values()):
        return attribute_inputs(o, req.checkpoint, prompts, req.target, req.corpus, req.top, req.plot,
                                req.attribute_inputs, req.concept_table, **attr)
    read_concepts(o, req.checkpoint, prompts, req.target, 3 if req.top is None else req.top, req.ablate_codes,
                  req.corpus, req.windows, req.seq_len, req.lift_windows, req.plot, req.concept_table)


def _checked_prompts(checkpoint: str, prompt: list[str] | None, prompts_file: str | None,
                     corpus: list[str] | None, target: str | None, set_: list[str] | None) -> list[str]:
    """The prompts to inspect (--prompt, then --prompts-file), after the checks that need no
    model: a missing checkpoint and an empty request are reported together."""
    from ncpctl.checkpoint import resolve

    if set_:
        raise UserError("--set does not apply to inspect", hint="use the options (see --help)")
    prompts = list(prompt or [])
    if prompts_file:
        from ncpctl.inference.prompts import read_prompts

        prompts += read_prompts(prompts_file)
    problems = []
    try:
        resolve(checkpoint)
    except UserError as e:
        problems += e.problems
    if not prompts and not corpus:
        problems.append("nothing to inspect: pass --prompt TEXT, --prompts-file FILE or --corpus SOURCE")
    if problems:
        raise UserError(*problems)
    if target is not None and len(prompts) != 1:
        raise UserError(f"--target needs exactly one prompt, got {len(prompts)}")
    return prompts


def generated(o: Output, checkpoint: str, prompts: list[str], n: int, *, top: int | None, attribute_inputs: bool,
              ig_steps: int | None, seed: int | None, temperature: float, steps_per_block: int | None,
              steer: list[str] | None, concept_table: str | None) -> None:
    """``--generate``: per prompt, a trace of its generation and the attributions of its tokens."""
    from ncpctl.checkpoint import load_model
    from ncpctl.inference import SamplingParams
    from ncpctl.inference.generate import fit_prompts
    from ncpctl.interpret import trace as TR
    from ncpctl.interpret.concept_table import names_for
    from ncpctl.interpret.steer import SteerSpec, resolve

    specs = [SteerSpec.parse(x) for x in steer or []]
    loaded = load_model(checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint")
    if not getattr(model.objective, "block_sampling", False):
        raise UserError(f"--generate explains a Causal Diffusion LM's block-wise generation; {loaded.path} is "
                        f"objective: {loaded.config.objective} (inspect it without --generate)")
    names = names_for(loaded, concept_table)
    resolved = [resolve(model, sp, names) for sp in specs]
    params = SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, steps_per_block=steps_per_block)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    top = 5 if top is None else top
    report: dict[str, Any] = {"command": "inspect", "checkpoint": str(loaded.path), "generations": [],
                              "steer": [r.describe() for r in resolved]}
    S = model.objective.block
    for text in prompts:
        ids = tok.encode(text, add_special_tokens=False).ids
        if not ids:
            raise UserError("--generate needs a non-empty prompt")
        (ids,) = fit_prompts([ids], loaded.config.max_seq_len // S * S, n)
        tr = TR.record(model, ids, params, resolved)
        recs, summary = TR.concept_attribution(model, tr, names, top, keep_terms=True)
        for r in recs:
            r["text"] = decode([r["token"]])
        entry: dict[str, Any] = {"prompt": text, "prompt_tokens": len(ids), "text": decode(tr.generated),
                                 "summary": summary}
        if getattr(model, "bottleneck", None) is not None:
            entry["chunks"] = TR.chunk_attribution(recs, model.bottleneck.bcfg.chunk, len(ids), names, top)
            for ch in entry["chunks"]:
                ch["text"] = decode([r["token"] for r in recs if ch["span"][0] <= r["position"] < ch["span"][1]])
        if attribute_inputs:
            ig = TR.input_attribution(model, tr, steps=16 if ig_steps is None else max(ig_steps, 1), top=top)
            for r in recs:
                a = ig[r["position"]]
                for x in a["top"]:
                    x["text"] = decode([x["token"]])
                r["inputs"] = {k: a[k] for k in ("sum", "completeness_error", "top")}
        for r in recs:
            r.pop("_terms", None)
        entry["tokens"] = recs
        report["generations"].append(entry)
    o.result(report, lambda con: _human(con, report))


def _human(con, report: dict[str, Any]) -> None:
    from rich.table import Table

    for g in report["generations"]:
        s = g["summary"]
        con.print(f"[bold]{g['prompt']}[/]", end="", markup=True, highlight=False)
        con.print(g["text"], markup=False, highlight=False)
        t = Table(title=f"each token in the state it was committed in (replay error {s['replay_error']:.1e})",
                  title_justify="left")
        for col in ("pos", "token", "order", "logit", "known / unknown / residual", "top concepts (term)", "inputs (IG)"):
            t.add_column(col)
        for r in g["tokens"]:
            sh = r.get("shares")
            t.add_row(str(r["position"]), repr(r["text"]), str(r["commit_order"]), f"{r['logit']:.2f}",
                      f"{sh['known']:.0%} / {sh['unknown']:.0%} / {sh['residual']:.0%}" if sh else "",
                      ", ".join(f"{c['name'][:16]} {c['term']:+.2f}" for c in r.get("concepts", [])[:2]),
                      ", ".join(f"{x['text']!r} {x['ig']:+.2f}" for x in r.get("inputs", {}).get("top", [])[:2]))
        width = con.width
        if not con.is_terminal:  # piped: the whole table, not squeezed to 80 columns (print's width= cannot widen)
            con.width = max(width, 150)
        con.print(t)
        con.width = width
        if "mean_shares" in s:
            m = s["mean_shares"]
            con.print(f"mean share of |logit|: known {m['known']:.1%}, unknown {m['unknown']:.1%}, "
                      f"residual {m['residual']:.1%}")
        for ch in g.get("chunks", []):
            con.print(f"chunk {ch['span']} {ch['text'][:40]!r} (residual {ch['residual_share']:.0%}): "
                      + ", ".join(f"{c['name']} {c['contribution']:+.2%}" for c in ch["concepts"][:5]))

"""`ncpctl inspect`: a checkpoint's concepts, read (decomposition), attributed (ablation) and
summarised over a corpus (code dictionaries); ``--attribute-inputs``: one output attributed to the
prompt's tokens against the [MASK] baseline. Library code: ``ncpctl.interpret`` (inputs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ncpctl.cli._common import ConceptTableOpt, DebugOpt, JsonOpt, Output, SetOpt, StrategyOpt, TiktokenOpt, command
from ncpctl.cli.inspect_generated import FindOpt, GenerateOpt, SeedOpt, SteerOpt, StepsOpt, TemperatureOpt

TopOpt = Annotated[Optional[int], typer.Option("--top", min=1, help="Codes shown per segment (the rest as a "
                                               "remainder; default 3); --attribute-inputs: inputs shown (default 10).",
                                               show_default=False)]
# --attribute-inputs (issue 23 item 6; library: ncpctl.interpret.inputs)
AttributeOpt = Annotated[bool, typer.Option(
    "--attribute-inputs", help="Attribute one output to the prompt's tokens: occlusion by the [MASK] token (the "
    "CDLM's in-distribution 'absent') and integrated gradients from the [MASK] embedding. The output: the target's "
    "first token's logit (default: the argmax) at the first [MASK] after the prompt (CDLM) or at the prompt's last "
    "position (autoregressive), or --concept's score.")]
ConceptOpt = Annotated[Optional[str], typer.Option(
    "--concept", help="With --attribute-inputs: attribute this known concept's logit (a concept bottleneck "
    "checkpoint; its name, or #N) f(h)_c, summed over the output block's [MASK] positions (CDLM) or at the prompt's "
    "last position (autoregressive).", show_default=False)]
UnitOpt = Annotated[Optional[str], typer.Option(
    "--unit", help="With --attribute-inputs: occlude each token (token, the default) or whole blocks (block).",
    show_default=False)]
BlockTokensOpt = Annotated[Optional[int], typer.Option(
    "--block-tokens", min=1, help="With --unit block: tokens per block, aligned to positions (default: the CDLM's "
    "diffusion block size, else 16).", show_default=False)]
IgStepsOpt = Annotated[Optional[int], typer.Option(
    "--ig-steps", min=0, help="With --attribute-inputs: integrated-gradients path points (default 16; 0: none).",
    show_default=False)]
BaselineOpt = Annotated[Optional[str], typer.Option(
    "--baseline", help="With --attribute-inputs: the token that stands for 'absent' (its exact text in the "
    "tokenizer). Default: the CDLM's [MASK]; an autoregressive checkpoint has none and needs this.",
    show_default=False)]


@command
def main(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint or run directory.", show_default=False)],
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeatable).",
                                                        show_default=False)] = None,
    prompts_file: Annotated[Optional[str], typer.Option("--prompts-file", help="One prompt per line, or JSON lines.",
                                                        show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="A continuation of the prompt: rank the "
                                                  "codes (and segments) by how much removing each changes its "
                                                  "log-probability.", show_default=False)] = None,
    top: TopOpt = None,
    ablate_codes: Annotated[int, typer.Option("--ablate-codes", min=0, help="With --target: the heaviest codes of "
                                              "each segment ablated one by one (each segment whole too).")] = 3,
    corpus: Annotated[Optional[list[str]], typer.Option("--corpus", help="Build code dictionaries over this "
                                                        "source (data.sources syntax, e.g. builtin:python-stdlib; "
                                                        "repeatable).", show_default=False)] = None,
    windows: Annotated[int, typer.Option("--windows", min=1, help="Corpus windows read for the dictionaries.")] = 64,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Corpus window length in tokens "
                                                   "(default: min(256, the model's max_seq_len)).",
                                                   show_default=False)] = None,
    lift_windows: Annotated[int, typer.Option("--lift-windows", min=0, help="Windows each code's vector is added "
                                              "to, for its lift tokens (0: none).")] = 2,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write PNGs (code-weight heat maps, code usage; "
                                                "input attributions) into this directory.", show_default=False)] = None,
    attribute_inputs: AttributeOpt = False,
    concept: ConceptOpt = None,
    unit: UnitOpt = None,
    block_tokens: BlockTokensOpt = None,
    ig_steps: IgStepsOpt = None,
    baseline: BaselineOpt = None,
    generate: GenerateOpt = None,
    seed: SeedOpt = None,
    temperature: TemperatureOpt = 1.0,
    steps_per_block: StepsOpt = None,
    steer: SteerOpt = None,
    concept_table: ConceptTableOpt = None,
    find_concept: FindOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    strategies: StrategyOpt = None,
    tiktoken: TiktokenOpt = None,
) -> None:
    """Read a checkpoint's concepts: per block the codes each segment mixes (exact decomposition
    of the predicted concept), attribution of a continuation to codes by ablation, and code
    dictionaries (usage, strongest blocks, lift tokens) over a corpus; or (--attribute-inputs)
    each prompt token's contribution to one output, against the [MASK] baseline; or (--generate, a
    Causal Diffusion LM) each generated token explained in the state it was committed in; or
    (--find-concept) a concept table searched by name."""
    from ncpctl.cli import inspect_generated as G
    from ncpctl.errors import UserError

    o = Output(json_out)
    if find_concept is not None:
        return G.find_concept(o, checkpoint, find_concept, concept_table, top)
    sampling = dict(seed=seed, steps_per_block=steps_per_block, steer=steer)
    if generate is None and (any(v for v in sampling.values()) or temperature != 1.0):
        raise UserError("--seed, --temperature, --steps-per-block and --steer apply with --generate")
    prompts = _checked_prompts(checkpoint, prompt, prompts_file, corpus, target, set_)
    if generate is not None:
        if corpus or target is not None or plot:
            raise UserError("--generate explains its own generation: --corpus, --target and --plot do not apply")
        return G.generated(o, checkpoint, prompts, generate, top=top, attribute_inputs=attribute_inputs,
                           ig_steps=ig_steps, temperature=temperature, concept_table=concept_table, **sampling)
    attr = dict(concept=concept, unit=unit, block_tokens=block_tokens, ig_steps=ig_steps, baseline=baseline)
    if attribute_inputs or any(v is not None for v in attr.values()):
        return _attribute_inputs(o, checkpoint, prompts, target, corpus, top, plot, attribute_inputs, concept_table,
                                 **attr)
    _read_concepts(o, checkpoint, prompts, target, 3 if top is None else top, ablate_codes, corpus, windows, seq_len,
                   lift_windows, plot, concept_table)


def _read_concepts(o: Output, checkpoint: str, prompts: list[str], target: str | None, top: int, ablate_codes: int,
                   corpus: list[str] | None, windows: int, seq_len: int | None, lift_windows: int, plot: str | None,
                   concept_table: str | None) -> None:
    """The decomposition, ablations and code dictionaries of the prompts (and corpus): ``main`` without
    --attribute-inputs, --generate or --find-concept."""
    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.interpret import concepts as C, plots
    from ncpctl.errors import UserError
    from ncpctl.interpret.concept_table import names_for

    loaded = load_model(checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint")
    has_bottleneck = getattr(model, "bottleneck", None) is not None
    if model.concept is None and not has_bottleneck:
        raise UserError("this checkpoint has neither a concept path (model.concept.enabled) nor a concept "
                        "bottleneck (model.bottleneck): nothing to inspect")
    if corpus and model.concept is None:
        raise UserError("--corpus builds code dictionaries of the concept path's codebook; this checkpoint has none")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    plot_dir = Path(plot) if plot else None
    files: list[str] = []
    report: dict[str, Any] = {"command": "inspect", "checkpoint": str(loaded.path),
                              "add": loaded.config.concept.add, "prompts": []}
    for i, text in enumerate(prompts):
        ids = tok.encode(text, add_special_tokens=False).ids
        n_prompt = len(ids)
        if target is not None:
            ids = ids + tok.encode(target, add_special_tokens=False).ids
        cut = max(0, len(ids) - loaded.config.max_seq_len)  # keep the end: the target and its context
        ids, n_prompt = ids[cut:], n_prompt - cut
        if target is not None and n_prompt <= 0:
            raise UserError(f"--target is {len(ids)} tokens: no room for the prompt in max_seq_len="
                            f"{loaded.config.max_seq_len}")
        x = torch.tensor(ids, dtype=torch.long)[None]
        entry: dict[str, Any] = {"prompt": text, "tokens": len(ids)}
        if has_bottleneck:
            rep = C.bottleneck_report(model, x, names_for(loaded, concept_table), top=top,
                                      target_start=n_prompt if target is not None else None)
            for pos in rep["positions"]:
                pos["text"] = decode([pos["token"]])
            for ch in rep["chunks"]:
                ch["text"] = decode(ids[ch["span"][0]:ch["span"][1]])
            entry["bottleneck"] = rep
        if model.concept is None:
            report["prompts"].append(entry)
            continue
        view = C.concept_view(model, x)
        blocks = C.decompose(view, top)
        for b in blocks:
            a, e = b["span"]
            b["text"] = decode(ids[a:e])
        # tokens after the last complete concept close none yet (a trailing partial block): said, not dropped
        tail = len(ids) - (blocks[-1]["span"][1] if blocks else 0)
        entry.update(blocks=blocks, max_reconstruction_error=max((b["reconstruction_error"] for b in blocks), default=0.0),
                     unpooled_tail={"tokens": tail, "text": decode(ids[len(ids) - tail:]) if tail else ""})
        if target is not None:
            abl = C.default_ablations(blocks, len(ids), ablate_codes)
            base, rows = C.ablate(model, x, n_prompt, abl, view)
            entry["target"] = {"text": target, "logprob": base, "ablations": rows}
        if plot_dir is not None:
            out = plots.weight_heatmap(view.weights.numpy(), [f"{b['block']}: {clip(b['text'], 14)!r}" for b in blocks],
                                           plot_dir / f"weights_prompt{i}.png", o.info)
            files += [out] if out else []
        report["prompts"].append(entry)
    if corpus:
        L = seq_len or min(256, loaded.config.max_seq_len)
        wins = C.corpus_windows(tok, corpus, L, windows + lift_windows)
        lift, wins = wins[:lift_windows], wins[lift_windows:] or wins[:lift_windows]
        report["dictionary"] = C.code_dictionary(model, wins, decode, lift_windows=lift)
        report["dictionary"].update(corpus=list(corpus), windows=len(wins), seq_len=L)
        if plot_dir is not None:
            out = plots.usage_bars(report["dictionary"], plot_dir / "code_usage.png", o.info)
            files += [out] if out else []
    report["files"] = files
    o.result(report, lambda con: _human(con, report))


def _human(con, report: dict[str, Any]) -> None:
    from rich.table import Table

    normed = report["add"] == "normed"
    for p in report["prompts"]:
        if "bottleneck" in p:
            _human_bottleneck(con, p)
        if "blocks" not in p:
            continue
        text = f"{clip(p['prompt'], 60)!r}" + (f" + target {clip(p['target']['text'], 30)!r}" if "target" in p else "")
        t = Table(title=f"{text}: each block's predicted concept as codes per segment"
                        + (" (pred before the coupling's norm)" if normed else ""), title_justify="left")
        t.add_column("block")
        t.add_column("text")
        t.add_column("segments: top codes (weight), rest = the other codes' summed weight (signed)")
        for b in p["blocks"]:
            segs = "; ".join(
                f"s{s['segment']}: " + ", ".join(f"{c['code']} ({c['weight']:.2f})" for c in s["top"])
                + f", rest {s['remainder']['weight']:+.2f}" for s in b["segments"])
            t.add_row(str(b["block"]), repr(clip(b["text"], 22)), segs)
        con.print(t)
        tail = p.get("unpooled_tail", {})
        if tail.get("tokens"):
            con.print(f"the last {tail['tokens']} token(s) {clip(tail['text'], 30)!r} close no concept yet (a partial "
                      "block): not shown")
        con.print(f"reconstruction of pred from the codes: max error {p['max_reconstruction_error']:.2e}")
        if "target" in p:
            tg = p["target"]
            con.print(f"target {tg['text']!r}: log p = {tg['logprob']:.4f}; the ablations that lower it most:")
            for r in tg["ablations"][:10]:
                con.print(f"  {r['ablation']:28s} delta {r['delta']:+.4f}")
    d = report.get("dictionary")
    if d:
        t = Table(title=f"code dictionary over {d['blocks']} blocks of {', '.join(d['corpus'])}", title_justify="left")
        for col in ("code", "usage", "strongest block", "lift tokens"):
            t.add_column(col)
        for c in sorted(d["codes"], key=lambda c: -c["usage"])[:20]:
            blk = c["top_blocks"][0]["text"] if c["top_blocks"] else ""
            lifts = " ".join(repr(x["token"]) for x in c.get("lift_tokens", [])[:5])
            t.add_row(f"s{c['segment']}/{c['code']}", f"{c['usage']:.3f}", repr(clip(blk, 28)), lifts)
        con.print(t)
    for f in report["files"]:
        con.print(f"wrote {f}")


def clip(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters, the cut marked with an ellipsis (issue 46 item 10: a prompt
    cut in a header read as the whole prompt)."""
    return text if len(text) <= n else text[: n - 1] + "…"


def _human_bottleneck(con, p: dict[str, Any]) -> None:
    from rich.table import Table

    rep = p["bottleneck"]
    t = Table(title=f"{clip(p['prompt'], 60)!r}: each logit = known + unknown + residual (exact; error "
                    f"{rep['attribution_error']:.1e}), concept share {rep['mean_share']:.2f}", title_justify="left")
    for col in ("pos", "scores", "logit", "known", "unknown", "residual", "top known concepts (term)"):
        t.add_column(col)
    for q in rep["positions"][-16:]:
        t.add_row(str(q["position"]), repr(q["text"]), f"{q['logit']:.2f}", f"{q['known']:.2f}", f"{q['unknown']:.2f}",
                  f"{q['residual']:.2f}", ", ".join(f"{c['concept']} ({c['term']:+.2f})" for c in q["concepts"][:3]))
    con.print(t)
    for ch in rep["chunks"]:
        con.print(f"chunk {ch['chunk']} {clip(ch['text'], 40)!r}: "
                  + ", ".join(f"{c['concept']} {c['probability']:.2f}" for c in ch["concepts"][:4]))


def _checked_prompts(checkpoint: str, prompt: list[str] | None, prompts_file: str | None,
                     corpus: list[str] | None, target: str | None, set_: list[str] | None) -> list[str]:
    """The prompts to inspect (--prompt, then --prompts-file), after the checks that need no
    model: a missing checkpoint and an empty request are reported together."""
    from ncpctl.checkpoint import resolve
    from ncpctl.errors import UserError

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


def _attribute_inputs(o: Output, checkpoint: str, prompts: list[str], target: str | None,
                      corpus: list[str] | None, top: int | None, plot: str | None, asked: bool, table: str | None, *,
                      concept: str | None, unit: str | None, block_tokens: int | None, ig_steps: int | None,
                      baseline: str | None) -> None:
    """``--attribute-inputs``: checks, then per prompt ``inputs.attribute_prompt``; JSON, table, heat map."""
    from ncpctl.errors import UserError

    if not asked:
        given = [f for f, v in (("--concept", concept), ("--unit", unit), ("--block-tokens", block_tokens),
                                ("--ig-steps", ig_steps), ("--baseline", baseline)) if v is not None]
        raise UserError(f"{', '.join(given)} apply with --attribute-inputs")
    if corpus:
        raise UserError("--corpus builds code dictionaries; --attribute-inputs reads prompts only")
    if not prompts:
        raise UserError("--attribute-inputs needs a prompt: pass --prompt TEXT")
    if unit not in (None, "token", "block"):
        raise UserError(f"--unit must be token or block, got {unit!r}")
    if block_tokens is not None and unit != "block":
        raise UserError("--block-tokens applies with --unit block")
    if concept is not None and target is not None:
        raise UserError("--concept and --target choose the output two ways: give one")

    from ncpctl.checkpoint import load_model
    from ncpctl.interpret import inputs, plots

    loaded = load_model(checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise UserError(f"{loaded.path}: no tokenizer.json in the checkpoint")
    if baseline is not None:
        base_id = tok.token_to_id(baseline)
        if base_id is None:
            raise UserError(f"--baseline {baseline!r} is not a token of this checkpoint's tokenizer (give one "
                            "token's exact text)")
    else:
        base_id = inputs.default_baseline(model)
        if base_id is None:
            raise UserError(f"--attribute-inputs: this checkpoint (model.objective: {loaded.config.objective}) was "
                            "never trained with a [MASK] token, so it has no in-distribution 'absent' baseline; "
                            "pass --baseline TOKEN to occlude with a token of your choice")
    c_index = None
    if concept is not None:
        if getattr(model, "bottleneck", None) is None:
            raise UserError("--concept reads the concept bottleneck's known concepts; this checkpoint has none "
                            "(model.bottleneck)")
        from ncpctl.interpret.concept_table import names_for

        c_index = inputs.concept_index(names_for(loaded, table), concept, model.bottleneck.n)
    size = block_tokens or (model.objective.block if inputs.is_cdlm(model) else 16)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    report: dict[str, Any] = {"command": "inspect", "checkpoint": str(loaded.path), "attributions": []}
    files: list[str] = []
    for i, text in enumerate(prompts):
        rec = inputs.attribute_prompt(model, encode(text), baseline=base_id,
                                      target=None if target is None else encode(target),
                                      concept=c_index, unit=unit or "token", block_tokens=size,
                                      ig_steps=16 if ig_steps is None else ig_steps,
                                      max_len=loaded.config.max_seq_len, decode=decode)
        rec["baseline"]["given"] = baseline is not None
        if concept is not None:
            rec["output"]["concept_name"] = concept
        rec.update(prompt=text, target=target)
        if plot:
            out = plots.input_heatmap(rec, Path(plot) / f"inputs_prompt{i}.png", o.info)
            files += [out] if out else []
        report["attributions"].append(rec)
    report["files"] = files
    o.result(report, lambda con: _human_inputs(con, report, 10 if top is None else top))


def _human_inputs(con, report: dict[str, Any], top: int) -> None:
    from rich.table import Table

    for r in report["attributions"]:
        out, block = r["output"], r["unit"] == "block"
        con.print(f"{clip(r['prompt'], 60)!r}: output = {out['definition']}"
                  + (f" {out['token_text']!r}" if out["token_text"] is not None else f" ({out.get('concept_name')})")
                  + f" = {out['value']:.4f}; baseline {r['baseline']['text']!r}")
        rows = r["blocks"] if block else r["tokens"]
        t = Table(title=f"the {min(top, len(rows))} strongest {'blocks' if block else 'tokens'} by |occlusion "
                        "delta| (output(input) - output(occluded))", title_justify="left")
        for col in ("span" if block else "pos", "text", "occlusion", "IG"):
            t.add_column(col)
        for x in sorted(rows, key=lambda x: -abs(x["occlusion"]))[:top]:
            t.add_row(str(x["span"] if block else x["position"]), repr(clip(x["text"], 28)), f"{x['occlusion']:+.4f}",
                      "" if x["ig"] is None else f"{x['ig']:+.4f}")
        con.print(t)
        if "ig" in r:
            g = r["ig"]
            gap = g["value"] - g["baseline_value"]
            coarse = abs(g["completeness_error"]) > 0.05 * max(abs(gap), 1e-3)
            con.print(f"IG ({g['steps']} steps): sum {g['sum']:+.4f} vs output(input) - output(all baseline) "
                      f"{gap:+.4f} (completeness error {g['completeness_error']:+.1e}"
                      + ("; the path is not resolved: raise --ig-steps)" if coarse else ")"))
    for f in report["files"]:
        con.print(f"wrote {f}")

"""``ncpctl inspect --generate N`` and ``--find-concept`` (``ncpctl.interpret.report.inspect`` calls
them): the parts of ``inspect`` that Steerling's notebooks do on a Causal Diffusion LM (library:
``ncpctl.interpret.trace`` and ``ncpctl.interpret.concept_table``). ``generated`` samples each prompt
block by block and explains every generated token in the state in which it was committed (per-token
logit contribution and concept attribution, chunk-level attribution, and with ``--attribute-inputs``
input attribution); ``find_concept`` searches a ``--concept-table`` by name and shows what each hit
promotes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ncpctl.errors import UserError

if TYPE_CHECKING:
    from ncpctl.output import Output


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


def find_concept(o: Output, checkpoint: str, query: str, table: str | None, top: int | None) -> None:
    """``--find-concept``: the table's best matches with the tokens each promotes in the checkpoint."""
    from ncpctl.checkpoint import load_model
    from ncpctl.interpret import concept_table as CT

    if table is None:
        raise UserError("--find-concept searches a concept table: pass --concept-table FILE (Steerling's is "
                        "concept_labels.parquet on its hub page)")
    concepts = CT.load(table)
    loaded = load_model(checkpoint)
    if getattr(loaded.model, "bottleneck", None) is None:
        raise UserError(f"{loaded.path}: no concept bottleneck (model.bottleneck), so no concepts to find")
    tok = loaded.tokenizer
    hits = []
    for c, score in CT.search(concepts, query, limit=10 if top is None else top):
        row = {"concept_id": c.concept_id, "name": c.name, "description": c.description, "score": score,
               "steerable": c.steerable, "group": CT.group(concepts, c.concept_id)}
        if c.concept_id < loaded.model.bottleneck.n:
            row["promotes"] = [{"token": t, "text": tok.decode([t]) if tok is not None else str(t), "alignment": v}
                               for t, v in CT.top_tokens(loaded.model, c.concept_id)]
        hits.append(row)
    report = {"command": "inspect", "checkpoint": str(loaded.path), "query": query, "table": table,
              "concepts_in_table": len(concepts), "hits": hits}

    def human(con) -> None:
        if not hits:
            con.print(f"no known concept of {table} matches {query!r}")
        for h in hits:
            promotes = " ".join(repr(p["text"]) for p in h.get("promotes", [])[:8])
            group = "+".join(f"#{g}" for g in h["group"])
            con.print(f"#{h['concept_id']} {h['name']} (score {h['score']}): {h['description'][:60]}"
                      + (f"\n    promotes: {promotes}" if promotes else "")
                      + (f"\n    its group: concept={group}" if len(h["group"]) > 1 else ""))

    o.result(report, human)

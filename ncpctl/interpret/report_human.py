"""``ncpctl inspect``'s human output: the tables of ``ncpctl.interpret.report``'s reports (the JSON
result is the report itself). rich is imported when a table is drawn."""

from __future__ import annotations

from typing import Any


def human_concepts(con, report: dict[str, Any]) -> None:
    from rich.table import Table

    normed = report["add"] == "normed"
    for p in report["prompts"]:
        if "bottleneck" in p:
            human_bottleneck(con, p)
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


def human_bottleneck(con, p: dict[str, Any]) -> None:
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


def human_inputs(con, report: dict[str, Any], top: int) -> None:
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

"""The reports of ``ncpctl inspect`` (``ncpctl.inference.inspect_command.inspect_checkpoint`` picks
one): a checkpoint's concepts read (decomposition, ablation attribution, code dictionaries:
``read_concepts``), an output attributed to the prompt's tokens (``attribute_inputs``), and a concept
table searched by name (``find_concept``). The tokenizing and the report are built here;
``report_human`` draws the tables. Nothing heavy is imported at module level (``ncpctl --help``
stays fast)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncpctl.errors import UserError
from ncpctl.interpret.report_human import clip, human_concepts, human_inputs

if TYPE_CHECKING:
    from ncpctl.output import Output


def read_concepts(o: Output, checkpoint: str, prompts: list[str], target: str | None, top: int, ablate_codes: int,
                   corpus: list[str] | None, windows: int, seq_len: int | None, lift_windows: int, plot: str | None,
                   concept_table: str | None) -> None:
    """The decomposition, ablations and code dictionaries of the prompts (and corpus): ``main`` without
    --attribute-inputs, --generate or --find-concept."""
    import torch

    from ncpctl.checkpoint import load_model
    from ncpctl.interpret import concepts as C, plots
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
    o.result(report, lambda con: human_concepts(con, report))


def attribute_inputs(o: Output, checkpoint: str, prompts: list[str], target: str | None,
                      corpus: list[str] | None, top: int | None, plot: str | None, asked: bool, table: str | None, *,
                      concept: str | None, unit: str | None, block_tokens: int | None, ig_steps: int | None,
                      baseline: str | None) -> None:
    """``--attribute-inputs``: checks, then per prompt ``inputs.attribute_prompt``; JSON, table, heat map."""

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
    o.result(report, lambda con: human_inputs(con, report, 10 if top is None else top))


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

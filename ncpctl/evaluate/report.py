"""How ``ncpctl eval``'s results are shown: the markdown file beside the JSON and the terminal table
(``ncpctl.evaluate.run`` computes them)."""

from __future__ import annotations

import math
from typing import Any

# lm-eval metrics that a bound on the log-likelihood makes upper bounds (marked in the table)
BOUND_METRICS = ("token_perplexity", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")


def markdown(res: dict[str, Any], checkpoint: str) -> str:
    """``results_<tag>.md``: lm-eval's tables, the perplexity sets and the paper aggregates."""
    from lm_eval.utils import make_table

    table = make_table(res) + ("\n" + make_table(res, "groups") if res.get("groups") else "")
    return (f"# {checkpoint}\n\n{_likelihood_line(res.get('likelihood') or {})}{table}\n"
            f"{ppl_markdown(res.get('perplexity') or {})}{_aggregates_markdown(res.get('aggregates') or {})}")


def _aggregates_markdown(aggregates: dict[str, dict[str, Any]]) -> str:
    """The paper aggregates (``ncpctl.evaluate.protocol``), each with its rule in words."""
    lines = []
    for group, a in aggregates.items():
        lines += ["", f"## {group}: {a['name']}", "", "| task | metric | score |", "|---|---|---:|"]
        lines += [f"| {k} | {a['metrics'][k]} | {_num(v)} |" for k, v in a["scores"].items()]
        lines += [f"| {s} AVG | | {_num(v)} |" for s, v in a["sections"].items()]
        lines += [f"| **{a['name']}** | {a['rule']} | {_num(a['value'])} |"]
        lines += [f"| {s} | reported, not in {a['name']} | {_num(v)} |" for s, v in (a.get("summaries") or {}).items()]
        lines += ["", f"- rule: {a['rule_text']}", ""]
    return "\n".join(lines)


def _likelihood_line(likelihood: dict[str, Any]) -> str:
    """A results file's note on a bound (nothing for exact log-likelihoods)."""
    if likelihood.get("kind") != "bound":
        return ""
    return (f"Log-likelihoods are bounds: {likelihood['estimator']}, {likelihood['samples']} samples per request; "
            "perplexities from them are upper bounds.\n\n")



def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.4f}"


def _unit(v: dict[str, Any]) -> str:
    """A set's unit, marked when its perplexity comes from a bound (an upper bound on the perplexity)."""
    return f"{v['unit']}, bound" if v.get("bound") else v["unit"]


def ppl_markdown(ppl: dict[str, Any]) -> str:
    if not ppl:
        return ""
    lines = ["", "## Perplexity across sets", "",
             "| set | unit (lm-eval metric) | split | value | averaged | scored tokens | token perplexity |",
             "|---|---|---|---:|---|---:|---:|"]
    lines += [f"| {k} | {_unit(v)} ({v['metric']}) | {v['split'] or ''} | {v['value']:.4f} | "
              f"{'yes' if v['averaged'] else 'no: training split'} | {v['tokens']} | {v['token_perplexity']:.4f} |"
              for k, v in ppl["per_set"].items()]
    lines += ["", f"- mean of per-set perplexities (the `value` column of the averaged sets; the ConceptLM paper's "
              f"Avg PPL): {_num(ppl['mean_of_sets'])}",
              f"- rule: {ppl['rule']}",
              f"- token-weighted perplexity (the averaged sets' scored tokens pooled): {_num(ppl['token_weighted'])}",
              ""]
    return "\n".join(lines)


def rich_table(summary: dict[str, Any]):
    from rich.table import Table
    from rich.text import Text

    lik = summary.get("likelihood") or {}
    note = f" (log-likelihoods: ELBO bound, {lik['samples']} Monte Carlo samples)" if lik.get("kind") == "bound" else ""
    table = Table(title=f"{summary['checkpoint']}{note}", title_justify="left")
    for col, just in (("task", "left"), ("metric", "left"), ("value", "right"), ("± stderr", "right")):
        table.add_column(col, justify=just)
    for section in ("results", "groups"):
        for task, m in summary[section].items():
            for k, v in m.items():
                if k.endswith("_stderr"):
                    continue
                se = m.get(k + "_stderr")
                shown = f"{k} (upper bound)" if note and k.split("[")[0] in BOUND_METRICS else k
                table.add_row(task, shown, f"{v:.4f}", f"{se:.4f}" if isinstance(se, float) and not math.isnan(se) else "")
    ppl = summary.get("perplexity") or {}
    if ppl:
        table.add_section()
        for task, v in ppl["per_set"].items():  # each set's unit, and whether the average takes it
            table.add_row(task, _unit(v) + ("" if v["averaged"] else " (training split: not averaged)"),
                          f"{v['value']:.4f}", "")
            if v.get("bound"):  # the bound itself, nats per token, with its Monte Carlo error
                table.add_row(task, "NLL bound per token (ELBO, nats)", f"{v['nll_per_token']:.4f}",
                              f"{v['nll_stderr']:.4f}")
            if "noised_nll_per_token" in v:  # a CDLM's noised-context estimate (--noised-context)
                table.add_row(task, "noised-context loss per token (training's conditions; no bound)",
                              f"{v['noised_nll_per_token']:.4f}", f"{v['noised_nll_stderr']:.4f}")
        table.add_row("perplexity sets", "mean of per-set ppl (paper's average)", _num(ppl["mean_of_sets"]), "")
        table.add_row("perplexity sets", "token-weighted ppl (tokens pooled)", _num(ppl["token_weighted"]), "")
        table.caption, table.caption_justify = Text(ppl["rule"]), "left"  # Text: its [unit]s are not markup
    _aggregate_rows(table, summary.get("aggregates") or {})
    return table


def _aggregate_rows(table, aggregates: dict[str, dict[str, Any]]) -> None:
    """A paper group's section AVGs and its aggregate, named as the paper names it; the rule goes
    into the caption (one line per group)."""
    from rich.text import Text

    rules = []
    for group, a in aggregates.items():
        table.add_section()
        for s, v in a["sections"].items():
            table.add_row(group, f"{s} AVG ({a['rule']})", _num(v), "")
        table.add_row(group, f"{a['name']} ({a['rule']})", _num(a["value"]), "")
        for s, v in (a.get("summaries") or {}).items():  # reported beside the aggregate, not in it
            table.add_row(group, f"{s} (reported, not in {a['name']})", _num(v), "")
        rules.append(f"{group}: {a['rule_text']}")
    if rules:
        before = table.caption.plain + "\n" if isinstance(table.caption, Text) else ""
        table.caption, table.caption_justify = Text(before + "\n".join(rules)), "left"



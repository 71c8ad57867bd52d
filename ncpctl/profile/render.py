"""Rich tables for each ``profile-kernels`` section and the ``--plot`` PNGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {p}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def render(con: Any, res: dict[str, Any]) -> None:
    from rich.table import Table

    m = res["model"]
    con.print(f"[bold]{res['recipe']}[/]: {m['name']} ({m['backbone']}, d={m['d_model']}, "
              f"{m['n_token_layers']} token layers, vocab {m['padded_vocab_size']:,}), "
              f"batch {res['micro_batch_size']} x {res['seq_len']}")

    if "accounting" in res:
        a = res["accounting"]
        at = f", concepts at {a['realised_ratio']:g} tokens each (target R {a['target_ratio']:g})" \
            if a.get("realised_ratio") else ""
        t = Table(title=f"accounting: T={a['seq_len']}, {a['tokens_per_step']:,} tokens per optimizer step{at}; "
                        f"exact FLOPs: {a['flop_convention']}", title_justify="left")
        for col in ("", *a["variants"]):
            t.add_column(col, justify="left" if not col else "right")
        v = a["variants"]
        groups = list(next(iter(v.values()))["params"]["components"]) if next(iter(v.values()))["params"] else []
        rows: list[tuple[str, Any]] = [
            ("token / concept layers", lambda x: f"{x['token_layers']} / {x['concept_layers']}"),
            ("block-equivalents", lambda x: f"{x['block_equivalents']:g}"),
            ("param-equivalent layers", lambda x: str(x["parameter_equivalent_layers"])),
        ]
        rows += [(f"params {g}", (lambda g: lambda x: f"{x['params']['components'][g]:,}")(g)) for g in groups]
        rows += [
            ("params total", lambda x: f"{x['params']['total']:,}" if x["params"] else "-"),
            ("params unpadded vocab", lambda x: f"{x['params']['unpadded_total']:,}" if x["params"] else "-"),
            ("paper: forward formula", lambda x: x["paper"]["formula"]),
            ("paper: train FLOPs/token", lambda x: _si(x["paper"]["training_per_token"])),
            ("exact: train FLOPs/token", lambda x: _si(x["exact"]["training_per_token"])),
            ("exact, causal mask", lambda x: _si(x["exact"]["training_per_token_causal"])),
            ("paper: train FLOPs/step", lambda x: _si(x["paper"]["training_per_step"])),
            ("exact: train FLOPs/step", lambda x: _si(x["exact"]["training_per_step"])),
            ("exact, causal mask", lambda x: _si(x["exact"]["training_per_step_causal"])),
            ("concept share (exact)", lambda x: f"{x['exact']['concept_share']:.2%}"),
        ]
        # activations saved per micro-batch (and one recomputed module's internals), per checkpointing mode
        rows += [(f"activations {m} (GiB)", (lambda m: lambda x: f"{x['activation_memory']['total'][m] / 2**30:.3g}")(m))
                 for m in ("none", "selective", "full")]
        for label, fn in rows:
            t.add_row(label, *(fn(x) for x in v.values()))
        con.print(t)
        r = v["recipe"]
        if r.get("d_concept") and r["d_concept"] != r["d_model"]:  # App. C's concept layer at its own width
            w, k = r["d_concept"] / r["d_model"], r["k"]
            con.print(f"paper view: concept layers at d_concept={r['d_concept']} (w = {w:g} x d): each counts as "
                      f"w^2/k = {w * w / k:g} token layers in T*d^2, w/k^2 = {w / (k * k):g} in T^2*d")
        s = a["savings"]
        con.print("saving of recipe vs PM: paper {:.4%}, exact {:.4%} (causal {:.4%});  vs base: paper {:.4%}, exact "
                  "{:.4%} (causal {:.4%})".format(
                      s["recipe_vs_pm"]["paper"], s["recipe_vs_pm"]["exact"], s["recipe_vs_pm"]["exact_causal"],
                      s["recipe_vs_base"]["paper"], s["recipe_vs_base"]["exact"], s["recipe_vs_base"]["exact_causal"]))

    if "ops" in res:
        _render_ops(con, res["ops"])

    if "device" in res:
        d = res["device"]
        con.print(f"device: {d['name']} ({d['type']}), {d['threads']} threads, torch {d['torch']}")

    if "kernels" in res:
        k = res["kernels"]
        t = Table(title=f"kernels: median of {k['repeats']} (after {k['warmup']} warm-up), {k['dtype']}",
                  title_justify="left")
        for col, j in (("group", "left"), ("kernel", "left"), ("shape", "left"), ("median ms", "right"),
                       ("spread", "right"), ("FLOP/s", "right")):
            t.add_column(col, justify=j)
        for r in k["rows"]:
            shape = " ".join(f"{a}={b}" for a, b in r["shape"].items())
            if r.get("available") is False:
                t.add_row(r["group"], r["name"], shape, "n/a", "", r.get("reason", ""))
                continue
            t.add_row(r["group"], r["name"], shape, _ms(r["median_s"]), f"{r['spread']:.0%}",
                      _si(r.get("flop_per_s")))
        con.print(t)
        lr = k["layer_ratio"]
        con.print(f"concept layer / token layer (k={lr['k']}): time {lr['concept_over_token_time']:.3f}, "
                  f"FLOPs {lr['concept_over_token_flops']:.3f}")
        t = Table(title="DLCM token->concept attention (forward): per_concept (T, M) mask vs replicated K/V + causal",
                  title_justify="left")
        for col in ("T", "d", "per_concept ms", "replicated ms", "replicated / per_concept"):
            t.add_column(col, justify="right")
        by: dict[tuple, dict[str, float]] = {}
        for r in k["dlcm"]["rows"]:
            by.setdefault((r["shape"]["T"], r["shape"]["d"]), {})[r["name"]] = r["median_s"]
        for (T, dd), x in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            t.add_row(str(T), str(dd), _ms(x["per_concept"]), _ms(x["replicated"]),
                      f"{x['replicated'] / x['per_concept']:.2f}")
        con.print(t)
        dl = k["dlcm"]
        if "faster_form" in dl:
            line = (f"faster on {k['device']}: {dl['faster_form']} (replicated / per_concept, geometric mean "
                    f"{dl['replicated_over_per_concept_gmean']:.2f})")
            if dl["configured_form"] is not None:  # different functions: the recipe chooses, not the device
                line += (f"; this recipe declares {dl['configured_form']} (model.concept.cross_attention: the function "
                         "it trains, the same on every device)")
            con.print(line)
        for p in k.get("plots", []):
            con.print(f"plot: {p}")

    if "step" in res:
        s = res["step"]
        ratio = "MFU" if "mfu" in s else "ratio to GEMM peak"
        con.print(f"[bold]step[/]: {s['batch_size']} x {s['seq_len']} {s['dtype']}: {s['median_s']:.3f} s median "
                  f"(spread {s['spread']:.0%}, {s['repeats']} steps), {s['tokens_per_s']:,.0f} tokens/s, "
                  f"{_si(s['achieved_flop_per_s'], 'FLOP/s')}; peak {_si(s['peak']['flop_per_s'], 'FLOP/s')} "
                  f"({s['peak']['kind']}); {ratio} {s['ratio_to_peak']:.3f} ({s['flop_convention']})")

    if "trace" in res:
        tr = res["trace"]
        t = Table(title=f"trace: top operators by {tr['time_kind']} (per step, {tr['steps']} steps) "
                        f"-> {tr['trace_path']}", title_justify="left")
        for col, j in (("operator", "left"), ("calls", "right"), ("self ms/step", "right"), ("share", "right")):
            t.add_column(col, justify=j)
        for r in tr["top_ops"]:
            t.add_row(r["name"][:70], str(r["calls"]), _ms(r["self_s"]), f"{r['share']:.1%}")
        con.print(t)


def _render_ops(con: Any, o: dict[str, Any]) -> None:
    """Operators per training step and per decode step, recipe vs its plain sibling, per layer."""
    from rich.table import Table

    t = Table(title=f"ops: {o['kind']}, batch {o['batch_size']} x {o['seq_len']}", title_justify="left")
    for col in ("model", "layers", "train step", "per layer", "decode step", "per layer"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for key in ("recipe", "sibling"):
        if key in o:
            e, tr = o[key], o[key]["train_step"]
            dec = e.get("decode_step")
            t.add_row(e["name"], str(tr["layers"]), str(tr["total"]), f"{tr['per_layer']:.1f}",
                      str(dec["total"]) if dec else "-", f"{dec['per_layer']:.1f}" if dec else "-")
    con.print(t)
    for step, c in o.get("comparison", {}).items():
        con.print(f"{step.replace('_', ' ')}: {c['ratio']:.3f}x the plain sibling's operators, "
                  f"{c['per_layer_ratio']:.3f}x per layer (+{c['overhead_per_layer']:.1f} per layer of the design)")


def plot_kernels(k: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG: DLCM variants, time vs sequence length, one line per variant and width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in k["dlcm"]["rows"]:
        series.setdefault((r["name"], r["shape"]["d"]), []).append((r["shape"]["T"], r["median_s"]))
    styles = {n: ("-", "--", ":", "-.")[i % 4] for i, n in enumerate(sorted({n for n, _ in series}))}  # one per form
    for (name, d), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o",
                linestyle=styles[name], label=f"{name}, d={d}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("forward time (ms, median)")
    ax.set_title(f"DLCM token->concept attention on {k['device']} ({k['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "kernels_dlcm.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

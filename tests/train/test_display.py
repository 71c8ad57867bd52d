"""The live display is generic over the model's log keys: every ``*_loss`` term is shown,
today's keys exactly as before."""

from __future__ import annotations

import io

from rich.console import Console

from ncpctl.train.display import TrainDisplay

REC = {"split": "train", "step": 3, "lr": 1e-3, "tokens": 768, "tokens_per_s": 12345.0, "mfu": 0.2, "nonfinite": 0,
       "loss": 5.5, "ntp_loss": 5.25, "ncp_loss": 0.125, "vq_loss": 0.0625, "code_perplexity": 2.0,
       "code_usage": 0.25, "code_usage_per_segment": [0.25, 0.25]}


def _shown(rec: dict, val: dict) -> tuple[str, str]:
    buf = io.StringIO()
    display = TrainDisplay(Console(file=buf, width=300, force_terminal=False), "pretrain")
    display.start(10, 0)
    display.step(rec)
    terms = display.progress.tasks[0].fields["terms"]
    display.validation(rec["step"], val)
    display.stop()
    return terms, buf.getvalue()


def test_todays_keys_and_a_new_loss_term() -> None:
    terms, out = _shown(REC, {"loss": 5.5, "ntp_loss": 5.25, "ncp_loss": 0.125, "vq_loss": 0.0625})
    assert terms == "loss 5.5000  ntp 5.2500  ncp 0.1250  vq 0.0625  codes 25%  lr 1.00e-03  12,345 tok/s  MFU 20.0%"
    assert "step 3: val loss 5.5000 (ntp 5.2500)" in out
    terms, out = _shown({**REC, "balance_loss": 0.5}, {"loss": 5.5, "ntp_loss": 5.5})  # base model: one term
    assert "vq 0.0625  balance 0.5000  codes 25%" in terms
    assert "step 3: val loss 5.5000\n" in out


def test_validation_shows_the_realised_compression_and_its_sources() -> None:
    val = {"loss": 5.5, "ntp_loss": 5.25, "balance_loss": 0.01, "tokens_per_concept": 3.9,
           "tokens_per_concept/python_stdlib": 3.71, "tokens_per_concept/prose_txt": 5.125}
    _, out = _shown(REC, val)
    assert "step 3: val loss 5.5000 (ntp 5.2500), 3.90 tokens per concept (python_stdlib 3.71, prose_txt 5.12)" in out
    _, out = _shown(REC, {"loss": 5.5, "ntp_loss": 5.25, "balance_loss": 0.01, "tokens_per_concept": 3.9,
                          "tokens_per_concept/python_stdlib": 3.71})
    assert "step 3: val loss 5.5000 (ntp 5.2500), 3.90 tokens per concept\n" in out


def test_validation_shows_the_macro_auc_and_the_pooled_one_beside_its_base_rate() -> None:
    """Issue 20 item 8: the headline is the per-concept AUC with its interval and coverage; the pooled
    AUC never appears without the base rate's."""
    val = {"loss": 5.5, "ntp_loss": 5.25, "concept_loss": 0.1, "concept_auc": 0.725, "concept_auc_low": 0.69,
           "concept_auc_high": 0.829, "concept_auc_concepts": 13, "concept_auc_skipped": 3,
           "concept_auc_pooled": 0.925, "concept_auc_pooled_base_rate": 0.885}
    _, out = _shown(REC, val)
    assert ("step 3: val loss 5.5000 (ntp 5.2500), concept AUC 0.725 [0.690, 0.829] (macro over 13/16 concepts; "
            "pooled 0.925, base rate 0.885)") in out


def test_without_a_terminal_every_logged_step_prints_a_plain_line_counter_and_eta_first() -> None:
    """Issue 28 item 2: under nohup, Slurm or ``| tee`` a live bar prints nothing between
    evaluations; each logged step prints one plain line there, the step counter and ETA first."""
    buf = io.StringIO()
    display = TrainDisplay(Console(file=buf, width=80, force_terminal=False), "pretrain")  # a log file: never wrapped
    display.start(10, 0)
    display.t0 -= 6.0  # 6 s for the first 3 steps: 2 s per step, 7 steps left
    display.step(REC)
    display.stop()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1 and "\x1b" not in lines[0]
    assert lines[0].startswith("pretrain step 3/10 (30%) ETA 0:00:14 elapsed 0:00:06 | loss 5.5000  ntp 5.2500")


def test_on_a_100_column_terminal_the_counter_and_eta_lead_the_bar() -> None:
    buf = io.StringIO()
    display = TrainDisplay(Console(file=buf, width=100, force_terminal=True), "pretrain")
    assert not display.plain
    display.task = display.progress.add_task("train", total=600, completed=0, terms="")
    display.step({**REC, "step": 120})
    out = io.StringIO()
    Console(file=out, width=100, force_terminal=False).print(display.progress.get_renderable())
    first = out.getvalue().splitlines()[0]
    assert first.startswith("pretrain 120/600 ETA") and len(first) <= 100


def test_validation_shows_a_monte_carlo_estimate_with_its_standard_error() -> None:
    """A CDLM's held-out ELBO (issue 23 item 4): a key with its ``_stderr`` beside it."""
    _, out = _shown(REC, {"loss": 6.3956, "diffusion_loss": 6.3956, "diffusion_elbo": 6.34972,
                          "diffusion_elbo_stderr": 0.00521})
    assert "step 3: val loss 6.3956, diffusion_elbo 6.3497 ± 0.0052\n" in out


def test_the_summary_labels_each_figure_with_its_step_leads_with_the_objectives_term_and_states_the_peak() -> None:
    """Issue 28 item 1: after Ctrl-C the validation is older than the last step (say so); an
    ArchPreview total summed over d must not lead (the NTP term first, the total last); the
    bottleneck's detection is shown; MFU states the peak it divides by."""
    from ncpctl.train.command import human as _human

    s = {"stage": "pretrain", "interrupted": True, "step": 69, "max_steps": 100, "tokens": 1000,
         "trainable_parameters": 10, "parameters": 10, "unigram_entropy": 6.5, "train_loss": 6.1,
         "train_loss_step": 69, "val_step": 50,
         "val": {"loss": 154.25, "ntp_loss": 6.45, "ncp_loss": 147.0, "vq_loss": 0.8, "concept_auc": 0.725,
                 "concept_auc_low": 0.69, "concept_auc_high": 0.829, "concept_auc_concepts": 13,
                 "concept_auc_skipped": 3, "concept_auc_pooled": 0.925, "concept_auc_pooled_base_rate": 0.885},
         "steps_per_s": 2.0, "tokens_per_s": 500.0, "mfu": 0.25, "steps_run": 19, "peak_flop_per_s": 156e9,
         "peak_source": "instruction-set bound 2 threads x 2.45 GHz x 32 fp32 FLOP/cycle", "world_size": 1,
         "nonfinite_steps": 0, "checkpoint": None}
    buf = io.StringIO()
    _human(Console(file=buf, width=400, force_terminal=False), s)
    out = buf.getvalue()
    assert "val at step 50: ntp 6.4500, ncp 147.0000, vq 0.8000, total 154.2500, concept AUC 0.725" in out
    assert "train loss at step 69: 6.1000" in out
    # the FLOP convention named (issue 40 item 3: attention counted in full)
    assert "MFU 25.0% (mean over 19 steps, full-attention FLOPs) of 156 GFLOP/s (instruction-set bound 2 threads x 2.45 GHz" in out


def test_the_cpu_peak_is_the_instruction_set_bound_or_the_best_measured_gemm_whichever_is_larger(monkeypatch, tmp_path) -> None:
    from ncpctl.profile import timing

    info = "model name\t: AMD EPYC\ncpu MHz\t\t: 2445.406\nflags\t\t: fpu sse avx avx2 fma\n"
    peak, how = timing.cpu_isa_peak(2, info)
    assert peak == 2 * 2445.406e6 * 32 and how == "2 threads x 2.45 GHz x 32 fp32 FLOP/cycle"
    assert timing.cpu_isa_peak(1, info.replace("avx2 fma", "avx2 fma avx512f"))[0] == 2445.406e6 * 64
    monkeypatch.setattr(timing, "_cpuinfo", lambda: info)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(timing, "gemm_peak", lambda *a, **k: {"flop_per_s": 50e9})  # a loaded machine
    assert timing.device_peak(False)[0] >= 2445.406e6 * 32  # never below the bound (1 thread or more)
    monkeypatch.setattr(timing, "gemm_peak", lambda *a, **k: {"flop_per_s": 1e15})  # faster than stated
    assert timing.device_peak(False)[0] == 1e15
    monkeypatch.setattr(timing, "gemm_peak", lambda *a, **k: {"flop_per_s": 2e14})  # loaded again: the best stays
    peak, how = timing.device_peak(False)
    assert peak == 1e15 and "best fp32 1024^3 GEMM measured here 1000000 GFLOP/s" in how


def test_validation_shows_each_mixture_components_loss() -> None:
    val = {"loss": 5.5, "ntp_loss": 5.25, "loss/web": 5.25, "ntp_loss/web": 5.0, "loss/code": 6.0, "ntp_loss/code": 5.75}
    _, out = _shown(REC, val)
    assert "step 3: val loss 5.5000 (web 5.2500, code 6.0000)\n" in out  # one loss term: no (ntp ...)

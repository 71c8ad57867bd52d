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

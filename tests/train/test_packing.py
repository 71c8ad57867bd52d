"""The named step vector (ncpctl.train.packing): round trip by name, per-segment keys,
statistics summed over micro-batches, the layout of the shipped models."""

from __future__ import annotations

import pytest
import torch

from ncpctl.model.core.outputs import LogKey, NCPOutput
from ncpctl.train.packing import StepPacking

KEYS = [LogKey("loss"), LogKey("ntp_loss"), LogKey("aux_loss"), LogKey("usage", 3, per="segment"),
        LogKey("acc", 3)]


def _out(loss: float, aux: float, usage: list[float], acc: list[float], stats: dict[str, float]) -> NCPOutput:
    t = torch.tensor
    return NCPOutput(logits=None, loss=t(loss), losses={"ntp_loss": t(loss - aux), "aux_loss": t(aux)},
                     metrics={"usage": t(usage), "acc": t(acc)}, stats={k: t(v) for k, v in stats.items()})


def test_round_trip_by_name() -> None:
    pk = StepPacking(KEYS, ["hits", "tokens"], ["skipped", "stop"])
    assert pk.n_terms == 1 + 1 + 1 + 3 + 3 and pk.size == pk.n_terms + 2 + 2
    o = _out(2.0, 0.5, [0.25, 0.5, 0.75], [0.1, 0.2, 0.3], {"hits": 7, "tokens": 64})
    vec = pk.join(pk.terms(o), pk.stat_sums(o), {"skipped": True, "stop": False})
    assert vec.shape == (pk.size,) and vec.dtype == torch.float32
    got = pk.split(vec.double())
    want = {"loss": [2.0], "ntp_loss": [1.5], "aux_loss": [0.5], "usage": [0.25, 0.5, 0.75], "acc": [0.1, 0.2, 0.3]}
    assert list(got.terms) == list(want)
    for name, values in want.items():
        assert got.terms[name].tolist() == pytest.approx(values), name
    assert got.stats == {"hits": 7.0, "tokens": 64.0} and got.flags == {"skipped": 1.0, "stop": 0.0}
    # the train record: scalars, the mean of vector keys, per-element lists only for `per` keys
    rec = pk.record(got.terms)
    assert list(rec) == ["loss", "ntp_loss", "aux_loss", "usage", "usage_per_segment", "acc"]
    assert rec["usage"] == pytest.approx(0.5) and rec["usage_per_segment"] == [0.25, 0.5, 0.75]
    assert rec["acc"] == pytest.approx(0.2)
    # validation: the means of the keys not logged per element
    assert list(pk.scalars(got.terms)) == ["loss", "ntp_loss", "aux_loss", "acc"]


def test_micro_batches_and_ranks() -> None:
    """Terms are averaged (the loop divides by accumulation steps, then ranks), statistics summed."""
    pk = StepPacking(KEYS, ["hits"], ["skipped"])
    outs = [_out(2.0, 0.5, [0.0, 0.5, 1.0], [0.0, 0.0, 0.0], {"hits": 3}),
            _out(4.0, 1.5, [1.0, 0.5, 0.0], [1.0, 1.0, 1.0], {"hits": 5})]
    terms = sum(pk.terms(o) for o in outs)
    stats = sum(pk.stat_sums(o) for o in outs)
    rank = pk.join(terms / len(outs), stats, {"skipped": False})
    other = pk.join(terms / len(outs), stats, {"skipped": True})  # a second rank, same numbers
    got = pk.split((rank + other).double(), mean_over=2)
    assert got.terms["loss"].item() == pytest.approx(3.0) and got.terms["aux_loss"].item() == pytest.approx(1.0)
    assert got.terms["usage"].tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert got.stats == {"hits": 16.0}  # (3 + 5) micro-batches x 2 ranks: sums, never averaged
    assert got.flags == {"skipped": 1.0}


def test_injected_loss_missing_keys_and_size_checks() -> None:
    pk = StepPacking(KEYS, ["hits"])
    o = _out(2.0, 0.5, [0.1, 0.2, 0.3], [0.0, 0.0, 0.0], {})
    del o.metrics["acc"]
    got = pk.split_terms(pk.terms(o, loss=o.loss * float("nan")))
    assert got["loss"].isnan().all() and got["ntp_loss"].item() == pytest.approx(1.5)
    assert got["acc"].tolist() == [0.0, 0.0, 0.0]  # absent from this output: zeros
    assert pk.stat_sums(o).tolist() == [0.0]
    o.metrics["usage"] = torch.tensor([0.1, 0.2])  # the model declared 3 elements
    with pytest.raises(ValueError, match="usage: log_keys"):
        pk.terms(o)
    with pytest.raises(ValueError, match="repeated: lr"):
        StepPacking(KEYS, ["lr"], reserved=["lr", "step"])
    with pytest.raises(ValueError, match="repeated: usage_per_segment"):
        StepPacking([*KEYS, LogKey("usage_per_segment")])
    with pytest.raises(ValueError, match="'loss'"):
        StepPacking(KEYS[1:])


@pytest.mark.parametrize("concept", [False, True])
def test_shipped_models_log_what_they_always_did(concept: bool) -> None:
    """The debug model's keys give today's train and val records, with values from its forward."""
    from ncpctl.model.core.config import build_config
    from ncpctl.model.core.model import NCPModel
    from ncpctl.train.loop import FLAGS, RECORD_FIELDS

    torch.manual_seed(0)
    model = NCPModel(build_config("debug", vocab_size=128, max_seq_len=32, concept={"enabled": concept}))
    pk = StepPacking.for_model(model, FLAGS, reserved=RECORD_FIELDS)
    x = torch.randint(0, 128, (2, 17))
    with torch.no_grad():
        o = model(x[:, :-1], x[:, 1:])
    terms = pk.split_terms(pk.terms(o).double())
    rec = pk.record(terms)
    want = ["loss", "ntp_loss"]
    if concept:
        want += ["ncp_loss", "vq_loss", "commitment_loss", "ncp_rel", "code_perplexity", "ncp_code_acc", "code_usage",
                 "code_usage_per_segment"]  # ncp_rel: issue 46 item 8
        assert rec["code_usage"] == pytest.approx(o.code_usage.double().mean().item())
        assert rec["code_perplexity"] == pytest.approx(o.code_perplexity.double().mean().item())
        assert len(rec["code_usage_per_segment"]) == model.cfg.n_segments
    assert list(rec) == want
    assert rec["loss"] == pytest.approx(o.loss.item()) and rec["ntp_loss"] == pytest.approx(o.ntp_loss.item())
    assert list(pk.scalars(terms)) == [k for k in want if not k.startswith("code_usage")]

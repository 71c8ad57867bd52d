"""train.wandb (issue 27 item 5) through the real ``ncpctl pretrain``, W&B offline (no network): the
offline run files hold the metrics.jsonl numbers, the resolved recipe and the plots, and a resumed
job continues the same W&B run; without wandb installed, one line naming the install command."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import ENV, metrics, ncpctl, result

pytest.importorskip("wandb")


def wandb_records(path: Path) -> list[tuple[str, Any]]:
    """The records of an offline run's ``run-ID.wandb`` file: LevelDB's log format (a 7-byte
    header ``:W&B``, magic, version; 32 KiB blocks of chunks, each ``crc32 u32, length u16, type u8``
    then the bytes: 1 full, 2 first, 3 middle, 4 last), each record a ``wandb_internal_pb2.Record``.
    Returns ``(kind, message)`` per record: ``history``, ``config``, ``run``, ..."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block = path.read_bytes(), 32768
    assert raw[:4] == b":W&B"
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero-filled rest of a block
            pos += block - pos % block if pos % block else 0
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            which = rec.WhichOneof("record_type")
            out.append((which, getattr(rec, which)))
    return out


def history(records: list[tuple[str, Any]]) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of the logged rows (values as W&B stored them, JSON)."""
    rows: dict[int, dict[str, Any]] = {}
    for kind, msg in records:
        if kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in msg.item}
            rows.setdefault(int(row.pop("_step")), {}).update(row)
    return rows


def test_offline_run_records_the_metrics_and_a_resume_keeps_the_run_id(make_recipe, tmp_path: Path) -> None:
    recipe, wandb_dir = make_recipe("wb"), tmp_path / "wandb_files"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
           "WANDB_DISABLE_CODE": "true"}
    base = ["--set", "train.wandb={project: ncp-test}", "--set", "train.eval_every=2", "--set", "train.eval_batches=1",
            "--set", "train.attention_stats_every=0", "--json"]
    first = ncpctl("pretrain", str(recipe), *base, "--set", "train.max_steps=3", env=env)
    result(first)
    run_dir = tmp_path / "wb"
    run_id = (run_dir / "wandb-run-id").read_text().strip()
    second = ncpctl("pretrain", str(recipe), *base, "--set", "train.max_steps=5", "--set", "train.plots=true",
                    env=env)
    assert result(second)["resumed_from"].endswith("step_0000003")
    assert f"W&B run {run_id} (continued" in second.stderr
    assert (run_dir / "wandb-run-id").read_text().strip() == run_id

    runs = sorted(wandb_dir.glob("wandb/offline-run-*"))  # one directory per job, both of the same run
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    jobs = [wandb_records(r / f"run-{run_id}.wandb") for r in runs]
    for job in jobs:
        (run,) = [m for k, m in job if k == "run"]
        assert run.run_id == run_id and run.project == "ncp-test"
        config = {item.key: json.loads(item.value_json) for item in run.config.update}  # the resolved recipe
        assert config["train"]["seq_len"] == 32 and config["train"]["wandb"]["project"] == "ncp-test"
    rows = {**history(jobs[0]), **history(jobs[1])}
    assert sorted(history(jobs[0])) == [1, 2, 3] and sorted(history(jobs[1])) == [4, 5]
    for rec in metrics(run_dir):  # every train record, same numbers (JSON floats both ways)
        for key in ("loss", "lr", "tokens", "grad_norm"):
            assert rows[rec["step"]][f"train/{key}"] == rec[key]
    for rec in metrics(run_dir, "val"):
        assert rows[rec["step"]]["val/loss"] == rec["loss"]
    assert rows[5]["plots/loss_curves/_type"] == "image-file"  # train.plots: the PNGs as images, files kept
    assert (runs[1] / "files" / rows[5]["plots/loss_curves/path"]).stat().st_size == rows[5]["plots/loss_curves/size"]


def test_wandb_requested_but_not_installed_is_one_line_naming_the_install(make_recipe) -> None:
    """wandb hidden from the interpreter (``sys.modules['wandb'] = None`` makes its import fail)."""
    code = ("import sys; sys.modules['wandb'] = None; from ncpctl.cli.app import main; "
            f"sys.argv = ['ncpctl', 'pretrain', {str(make_recipe('nowb'))!r}, '--set', "
            "'train.wandb={project: p}']; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "train.wandb is set but wandb is not installed" in lines[0] and "Traceback" not in proc.stderr
    assert "pip install 'ncpctl[wandb]'" in proc.stderr

"""bench/ is a set of scripts over the package, not a second library: no script loads another
(through importlib or by name), and what they share (the DeepSpeed engine, the GPU peak table,
the GEMM peak) is written once, in ``ncpctl`` (issue 22 item 4)."""

from __future__ import annotations

import ast

import pytest

from .conftest import REPO

BENCH = sorted((REPO / "bench").glob("*.py"))
SOURCES = sorted((REPO / "ncpctl").rglob("*.py")) + BENCH


def _imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_bench_script_loads_another() -> None:
    assert len(BENCH) >= 10
    scripts = {p.stem for p in BENCH}
    for path in BENCH:
        text = path.read_text()
        assert "importlib" not in _imports(path) and "spec_from_file_location" not in text, path.name
        # `tokenize` is also the stdlib module bench scripts must reach: only the file path counts there
        siblings = (_imports(path) & scripts) - {"tokenize"}
        assert not siblings, f"{path.name} imports the bench script(s) {siblings}"
        assert "runpy" not in _imports(path) and "__import__(" not in text, path.name


@pytest.mark.parametrize("needle, home", [
    ("deepspeed.initialize(", "ncpctl/train/engine.py"),  # the engine, as the loop builds it
    ("def gemm_peak(", "ncpctl/profile/timing.py"),
    ("989e12", "ncpctl/profile/timing.py"),  # the H100/H200 bf16 peak: one table of GPU peaks
    ("def init_distributed(", "ncpctl/train/engine.py"),
])
def test_shared_pieces_exist_once(needle: str, home: str) -> None:
    where = [str(p.relative_to(REPO)) for p in SOURCES if needle in p.read_text()]
    assert where == [home]


def test_the_peak_table_knows_each_h100() -> None:
    """The two tables disagreed on the H100 PCIe (989 TFLOP/s in the loop's, 756 in profile's):
    the loop's MFU now divides by the PCIe card's own dense bf16 peak."""
    from ncpctl.profile.timing import known_bf16_peak

    assert known_bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert known_bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert known_bf16_peak("NVIDIA H200") == known_bf16_peak("NVIDIA GH200 480GB") == 989e12
    assert known_bf16_peak("NVIDIA L40S") == 362e12 and known_bf16_peak("NVIDIA L4") == 121e12
    assert known_bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert known_bf16_peak("Some Future GPU") is None


def test_the_training_loop_uses_that_table(monkeypatch) -> None:
    import torch

    from ncpctl.train import prepare

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert prepare.device_peak(True) == (756e12, "NVIDIA H100 PCIe bf16 peak")

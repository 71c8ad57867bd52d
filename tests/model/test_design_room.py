"""Issue 44 item 3: a built-in design is its room plus one registration line. The toy segmentation
``Alternating23`` (a plugin in tests/model/toys.py, registered with ``register``) is moved into the
built-in path: its code copied verbatim into a room (``designs/alt23_room/module.py``), a three-line
record (``spec.py``) and one line of ``registry.DESIGNS``. Nothing else is touched, and the model
it builds is the plugin's: the same logits, law and cost; the room check finds nothing to object to."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
import torch

from ncpctl.model import designs, registry
from ncpctl.model.core.config import build_config
from ncpctl.model.core.model import NCPModel

from .. import test_no_design_branches as rooms
from . import toys

LINE = '    ".designs.alt23_room.spec:SPEC",\n'
SPEC = '''"""The toy room's registration record."""

from ncpctl.model.core.config_base import DesignSpec

SPEC = DesignSpec("alt23_room", strategies={"segmentation": {"alt23_room": ".designs.alt23_room.module:Alternating23"}},
                  costs={("segmentation", "alt23_room"): ".designs.alt23_room.module:_SegmentMeansCost"})
'''


def _room(where: Path) -> None:
    """The toy's room: its code as the plugin has it (the module header and the three objects), its record."""
    room = where / "alt23_room"
    room.mkdir(parents=True)
    header = inspect.getsource(toys).split("\ndef _alt_concepts")[0]
    body = "\n\n".join(inspect.getsource(o) for o in (toys._alt_concepts, toys._SegmentMeansCost, toys.Alternating23))
    (room / "__init__.py").write_text('"""A toy room (tests/model/test_design_room.py)."""\n')
    (room / "module.py").write_text(header + "\n" + body)
    (room / "spec.py").write_text(SPEC)


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The room on ``ncpctl.model.designs``' path and its one line in ``DESIGNS``; the derived tables
    restored afterwards."""
    _room(tmp_path)
    monkeypatch.setattr(designs, "__path__", [*designs.__path__, str(tmp_path)])
    saved = ({k: dict(v) for k, v in registry.STRATEGIES.items()}, dict(registry.LAWS), dict(registry.COSTS),
             list(registry.HOOKS))
    monkeypatch.setattr(registry, "DESIGNS", (*registry.DESIGNS, LINE.strip().rstrip(",").strip('"')))
    registry.derive()
    yield
    for kind, table in saved[0].items():
        registry.STRATEGIES[kind].clear()
        registry.STRATEGIES[kind].update(table)
    for live, old in zip((registry.LAWS, registry.COSTS), saved[1:3]):
        live.clear()
        live.update(old)
    registry.HOOKS[:] = saved[3]


def _logits(segmentation: str) -> torch.Tensor:
    cfg = build_config("debug", concept=dict(enabled=True, segmentation=segmentation))
    torch.manual_seed(0)
    model = NCPModel(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x).logits


def test_the_toy_moved_into_a_room_is_a_built_in(registered):
    assert isinstance(registry.STRATEGIES["segmentation"]["alt23_room"], str)  # built in: an import path
    law = registry.segmentation_law("alt23_room")  # the class attribute, as for the plugin
    assert law.concepts(None, 12) == toys.Alternating23.law.concepts(None, 12) == 5  # 2,3,2,3,2 tokens
    assert registry.design_cost("segmentation", "alt23_room").flops(build_config("debug"), 10, 4) == \
        toys._SegmentMeansCost.flops(build_config("debug"), 10, 4)
    assert torch.equal(_logits("alt23_room"), _logits("alt23"))  # the plugin's model, to the bit


def test_the_room_touches_only_its_folder_and_one_line(tmp_path):
    """On a copy of the model package: the room added and its line registered, the room check is
    content; without the line it names the missing registration."""
    copy = tmp_path / "model"
    shutil.copytree(rooms.MODEL, copy, ignore=shutil.ignore_patterns("__pycache__"))
    _room(copy / "designs")
    assert rooms.room_problems(copy) == ["registry.py: 0 registration lines for the room 'alt23_room' (one wanted)"]
    text = (copy / "registry.py").read_text()
    anchor = '    ".designs.drafter.spec:SPEC",\n'
    (copy / "registry.py").write_text(text.replace(anchor, anchor + LINE))
    assert rooms.room_problems(copy) == []

from __future__ import annotations

import pytest

from ._fixtures import make_runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.getbasetemp() / "ncp-debug-runs")

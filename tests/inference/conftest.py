from __future__ import annotations

import pytest

from ..evaluate._fixtures import make_runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Trained debug checkpoints (shared with tests/evaluate through the session's basetemp)."""
    return make_runs(tmp_path_factory.getbasetemp() / "ncp-debug-runs")

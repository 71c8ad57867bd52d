"""How ``./dev.sh test`` (``pytest -n 2 --dist loadgroup``) hands tests to its two xdist workers.

A test that uses a module-scoped fixture (a trained run, a loaded model) runs on the worker that
runs the rest of its module's such tests: handed out one test at a time (xdist's ``load``), a
module cut between the two workers builds its fixtures twice. Every other test is handed out on
its own as a worker frees up, and the groups, largest first, go out before them, then the
multi-process (``slow``) tests.

xdist's own ``loadgroup`` reads ``xdist_group`` marks through the test ids, which pytest 9.2 no
longer lets it change (pytest-dev/pytest-xdist#1386: the groups are silently ignored), so the
workers write each grouped test's module to a file the controller's scheduler reads.
Hooks, imported by tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

ENV = "NCPCTL_TEST_GROUPS"  # the file: {test id: group} (set by the controller, read by its workers)


def _grouping(config: pytest.Config) -> bool:
    return config.getoption("dist", default="no") == "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    if _grouping(config) and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, before its workers start
        fd, path = tempfile.mkstemp(prefix="ncpctl-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[ENV] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if _grouping(config) and not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(ENV):
        Path(os.environ.pop(ENV)).unlink(missing_ok=True)


def module_groups(items: list[pytest.Item]) -> dict[str, str]:
    """{test id: its module's path} for each test that uses a module-, class- or package-scoped fixture."""
    out = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope in ("module", "class", "package") for d in defs):
            out[item.nodeid] = item.nodeid.split("::", 1)[0]
    return out


@pytest.hookimpl(trylast=True)  # after any hook that deselects or reorders
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    worker, path = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(ENV)
    if worker and path:  # set by a grouping controller; every worker collects the same tests: the same file
        groups = module_groups(items)
        # the multi-process tests (``slow``, 15-45 s each) go out first among the ungrouped ones, not
        # last (tests/train sorts last): a long test started at the end keeps one worker busy alone
        items.sort(key=lambda it: not (it.get_closest_marker("slow") and it.nodeid not in groups))
        tmp = f"{path}.{worker}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (its LoadGroupScheduling)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not _grouping(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        """xdist's scope scheduler with a test's scope read from the workers' file: its module's path,
        or (no module-scoped fixture) the test itself; called once every worker has collected."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[ENV]).read_text() or "{}")
            return self.groups.get(nodeid, nodeid)

    return ModuleGroups(config, log)

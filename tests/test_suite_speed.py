"""The suite's own machinery for time (issue 44 item 7): a read-only fixture built once per run for
every xdist worker (tests/shared.py) and the grouping of a module's tests that share a
module-scoped fixture on one worker (tests/scheduling.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduling import module_groups
from tests.shared import DIGEST, shared


def test_a_shared_fixture_is_built_once_and_a_write_into_it_fails(tmp_path_factory) -> None:
    built = []

    def build(root: Path) -> None:
        built.append(root)
        (root / "weights").write_bytes(b"trained")
        (root / "link").symlink_to(root / "weights")

    first = shared(tmp_path_factory, "probe", build, Path(__file__))
    root = next(first)
    second = shared(tmp_path_factory, "probe", build, Path(__file__))  # another worker asks
    assert next(second) == root and built == [root] and (root / DIGEST).is_file()
    next(second, None)  # its teardown: nothing changed
    (root / "weights").write_bytes(b"overwritten by a test")
    with pytest.raises(AssertionError, match=r"wrote into the shared fixture .*\['weights'\]"):
        next(first, None)


def test_a_half_built_or_changed_builder_is_built_again(tmp_path_factory, tmp_path) -> None:
    calls = []
    src = tmp_path / "builder.py"
    src.write_text("v1")
    gen = shared(tmp_path_factory, "half", lambda root: calls.append(1), src)
    root = next(gen)
    gen.close()
    (root / DIGEST).unlink()  # a build that died before its digest was written
    (root / "partial").write_text("?")
    gen = shared(tmp_path_factory, "half", lambda root: calls.append(2), src)
    assert next(gen) == root and calls == [1, 2] and not (root / "partial").exists()
    gen.close()
    src.write_text("v2")  # the builder changed: another directory, never the old one
    gen = shared(tmp_path_factory, "half", lambda root: calls.append(3), src)
    assert next(gen) != root and calls == [1, 2, 3]
    gen.close()


@pytest.fixture(scope="module")
def module_thing() -> int:
    return 1


def test_uses_a_module_fixture(module_thing: int) -> None:
    assert module_thing == 1


def test_only_tests_using_a_module_fixture_are_grouped_by_their_module(request) -> None:
    groups = module_groups(request.session.items)
    here = request.node.nodeid.split("::")[0]
    user = f"{here}::test_uses_a_module_fixture"
    assert request.node.nodeid not in groups and f"{here}::test_a_half_built_or_changed_builder_is_built_again" not in groups
    if any(it.nodeid == user for it in request.session.items):  # collected in this run (not when run alone)
        assert groups[user] == here

"""What README.md and the docs site (docs/, every page) promise, checked against the code and the tests
that back it."""

from __future__ import annotations

import re
from pathlib import Path

from .docs_site import SITE, site_text

REPO = Path(__file__).resolve().parents[1]
DOCS = SITE  # README.md and every docs/**/*.md


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, with list items (``* `` / ``- ``) as blocks of their own."""
    return [p for block in re.split(r"\n\s*\n", text) for p in re.split(r"\n(?=\s*[*-] )", block) if p.strip()]


def test_bit_exact_resume_is_claimed_only_with_one_thread() -> None:
    """Bit-identical resume holds with OMP_NUM_THREADS=1 only (two 2-thread runs already differ
    at ~1e-6): every claim of it names that condition, and the test that checks it runs so."""
    claims = [(doc.name, p) for doc in DOCS for p in _paragraphs(doc.read_text())
              if re.search(r"resum", p, re.I) and re.search(r"bit for bit|bit-exact|bit-identical|bitwise", p, re.I)]
    assert claims, "the README no longer states when resume is exact"
    for name, p in claims:
        assert "OMP_NUM_THREADS=1" in p, (name, p)
    from tests.train.conftest import ENV

    assert ENV["OMP_NUM_THREADS"] == "1"  # test_resume_after_kill9_is_bit_identical runs under it


def test_no_recipe_key_promises_determinism() -> None:
    """The condition is the thread count; the docs must not point at a recipe key that does not exist."""
    from ncpctl.recipe.schema import TrainSection

    assert "deterministic" not in TrainSection.model_fields
    assert not any("train.deterministic" in doc.read_text() for doc in DOCS)


def test_readme_points_at_the_shipped_pipeline() -> None:
    import os

    script = REPO / "examples" / "pipeline.sh"
    assert "examples/pipeline.sh" in site_text()
    assert script.is_file() and os.access(script, os.X_OK)
    assert "set -euo pipefail" in script.read_text()


def test_readme_points_at_the_seed_arms_example() -> None:
    """The docs' seed-arm and in-loop evaluation output comes from examples/seed_arms.sh."""
    import os

    script = REPO / "examples" / "seed_arms.sh"
    readme = site_text()
    assert "examples/seed_arms.sh" in readme and script.is_file() and os.access(script, os.X_OK)
    text = script.read_text()
    assert "set -euo pipefail" in text and "recipes/debug.yaml" in text and (REPO / "recipes" / "debug.yaml").is_file()
    assert "examples/proxy/python_packages.jsonl" in text and (REPO / "examples/proxy/python_packages.jsonl").is_file()
    for cmd in ("train.eval_tasks=[ncp_cloze]", "eval --compare runs/debug-s1,runs/debug-s2", "--against ncp_cloze:acc"):
        assert cmd in text and cmd in readme

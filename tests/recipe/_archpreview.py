"""Shared by the NCP-ArchPreview recipe tests (tests/recipe/test_archpreview_recipes.py,
tests/profile/test_archpreview_accounting.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..conftest import RECIPES

# the top-level ArchPreview recipes (tests/recipe/test_shipped.py checks recipes/ is covered)
TOP = ("ncp-archpreview-8.9b", "ncp-archpreview-8.9b-stage2", "debug-archpreview")
ARCHPREVIEW = RECIPES / "archpreview"
OLMO3_VOCAB = 100278  # OLMo-3's tokenizer (dolma2); the embedding is padded to 100,352 rows


def uses_muon(path: Path) -> bool:
    doc = yaml.safe_load(path.read_text()) or {}
    return (doc.get("train") or {}).get("optimizer") == "muon"

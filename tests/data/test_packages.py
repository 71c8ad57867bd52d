"""``builtin:python-packages``: selection syntax, dedup by content (the earliest copy wins,
before selection), vendored and test folders skipped, package names in meta.json, hold-out,
fingerprint, determinism, and a no-match selection through the real CLI.

A fake site-packages tree (``site_roots`` monkeypatched) tests the rules; a few small
packages certainly installed in the dev venv (yaml, mdurl, shellingham) test the real thing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ncpctl.corpora import packages
from ncpctl.data.sources import ReadStats, fingerprint, iter_documents, package_listing, source_problem
from ncpctl.data.tokenize import tokenize
from ncpctl.errors import UserError
from ncpctl.recipe import load_recipe
from ncpctl.recipe.schema import SourceSpec

from ..conftest import run_cli
from .test_tokenize import recipe_file

P = packages.SOURCE
SHARED = "def shared(x):\n    return [x * i for i in range(10)]  # installed twice\n"


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake site-packages: alpha and beta share one file; test, vendored and non-package
    folders that must be skipped; a top-level module; the corpus reads only this tree."""
    root = tmp_path / "site-packages"
    files = {
        "alpha/__init__.py": "from .core import shared\nALPHA = 'alpha package'\n",
        "alpha/core.py": SHARED,
        "alpha/sub/deep.py": "def deep():\n    return 'alpha deep module'\n",
        "alpha/tests/test_core.py": "def test_shared():\n    assert True  # a test suite\n",
        "alpha/_vendor/dep.py": "VENDORED = 'a vendored dependency'\n",
        "alpha/externals/loky.py": "VENDORED = 'another vendored dependency'\n",
        "beta/__init__.py": "BETA = 'beta package, different text'\n",
        "beta/copy_of_core.py": SHARED,  # same bytes as alpha/core.py: alpha's copy wins
        "beta/util.py": "def util(y):\n    return {y: 'beta utility'}\n",
        "beta/vendored_templates/t.py": "TEMPLATE = 'vendored template'\n",
        "gamma.py": "GAMMA = 'a top-level module, package gamma'\n",
        "onlytests/tests/test_x.py": "def test_x():\n    pass\n",
        "tests/test_top.py": "def test_top():\n    pass  # a stray top-level test folder\n",
        "gamma-1.0.dist-info/fake.py": "NOT = 'a package: the name is no identifier'\n",
        "numpy.libs/x.py": "NOT = 'a package either'\n",
        "__editable___thing_finder.py": "GENERATED = 'editable finder'\n",
        "alpha/__pycache__/junk.py": "JUNK = 1\n",
    }
    for rel, text in files.items():
        _write(root, rel, text)
    monkeypatch.setattr(packages, "site_roots", lambda: [root])
    return root


def _rel(root: Path, src: str, include_tests: bool = False) -> list[tuple[str, str]]:
    lst = package_listing(SourceSpec(path=src, include_tests=include_tests))
    return [(f.package, f.path.relative_to(root).as_posix()) for f in lst.files]


def test_listing_dedup_skips_and_package_names(site: Path) -> None:
    everything = _rel(site, P)
    assert everything == [
        ("alpha", "alpha/__init__.py"), ("alpha", "alpha/core.py"), ("alpha", "alpha/sub/deep.py"),
        ("beta", "beta/__init__.py"), ("beta", "beta/util.py"),  # beta/copy_of_core.py: a copy of alpha's
        ("gamma", "gamma.py"),
    ]
    lst = package_listing(SourceSpec(path=P))
    assert lst.included == {"alpha": 3, "beta": 2, "gamma": 1, "onlytests": 0}
    assert lst.held_out == [] and lst.duplicates == 1
    with_tests = _rel(site, P, include_tests=True)
    assert {"alpha/tests/test_core.py", "onlytests/tests/test_x.py", "tests/test_top.py"} <= {p for _, p in with_tests}
    assert not any("vendor" in p or "externals" in p for _, p in with_tests)

    # the shared file belongs to alpha before any selection: held out with alpha, never in beta
    assert ("beta", "beta/copy_of_core.py") not in _rel(site, f"{P}:include=beta")
    held, kept = _rel(site, f"{P}:include=alpha"), _rel(site, f"{P}:exclude=alpha")
    assert not set(held) & set(kept) and sorted(held + kept) == sorted(everything)
    # the URL habit is the same selection
    assert _rel(site, f"{P}:include=alpha+gamma") == _rel(site, f"{P}?include=alpha, gamma") != held

    # documents come out in the listing's order, one per file
    docs = [t for batch in iter_documents(SourceSpec(path=f"{P}:exclude=gamma"), ReadStats(), batch=2) for t in batch]
    assert docs == [(site / p).read_text() for _, p in _rel(site, f"{P}:exclude=gamma")]


@pytest.mark.parametrize(("path", "message"), [
    (f"{P}:include=alhpa", "no installed package 'alhpa' (did you mean 'alpha'?)"),
    (f"{P}:exclude=numpy.libs", "no installed package 'numpy.libs'"),
    (f"{P}:include=onlytests", "the selection matches no file"),
    (f"{P}:exclude=alpha+beta+gamma+onlytests", "the selection matches no file"),
    (f"{P}:inclde=alpha", "'inclde=alpha' is not a selection"),
    (f"{P}?include=alpha&exclude=beta", "either include= or exclude=, not both"),
    (f"{P}:include=alpha++beta", "needs package names joined by '+'"),
    ("builtin:python-stdlib:include=json", "takes no selection"),
    ("builtin:python-modules", "unknown builtin corpus 'builtin:python-modules'; available: builtin:python-stdlib, "
                               "builtin:python-packages"),
])
def test_bad_selections_are_one_line_problems_naming_the_source(site: Path, path: str, message: str) -> None:
    problem = source_problem(SourceSpec(path=path))
    assert problem is not None and message in problem and path in problem and "\n" not in problem
    with pytest.raises(UserError, match=re.escape(problem)):
        next(iter_documents(SourceSpec(path=path), ReadStats()))


def test_fingerprint_follows_what_the_selection_reads(site: Path) -> None:
    src = [SourceSpec(path=f"{P}:include=alpha")]
    packages._digests.clear()
    before = fingerprint(src)
    hashed = {Path(p).relative_to(site).as_posix() for p, _, _ in packages._digests}
    assert hashed == {"alpha/core.py", "beta/copy_of_core.py"}  # only same-size files are hashed
    _write(site, "delta/__init__.py", "DELTA = 'an unrelated package installed later'\n")
    assert fingerprint(src) == before  # does not change what include=alpha reads
    _write(site, "aaa/first.py", SHARED)  # sorts first: now owns the shared file, alpha loses it
    assert fingerprint(src) != before and ("alpha", "alpha/core.py") not in _rel(site, f"{P}:include=alpha")
    (site / "aaa" / "first.py").unlink()
    assert fingerprint(src) == before
    _write(site, "alpha/sub/deep.py", "def deep():\n    return 'changed'\n")
    assert fingerprint(src) != before


def test_tokenize_holds_out_a_package_and_meta_names_it(site: Path, tmp_path: Path) -> None:
    path = f"{P}:exclude=beta"
    # unquoted in a YAML flow list (where '?' is a syntax error and ',' splits the source)
    r = load_recipe(recipe_file(tmp_path, "[" + path + "]"), ["data.val_fraction=0.3"], need_sources=True)
    assert [s.path for s in r.data.sources] == [path]
    meta = tokenize(r)
    assert meta["documents"] == 4
    assert meta["packages"] == {path: {"included": {"alpha": 3, "gamma": 1, "onlytests": 0}, "held_out": ["beta"],
                                       "duplicates_dropped": 0, "site_packages": [str(site)]}}
    assert json.loads((r.data_dir / "meta.json").read_text())["packages"] == meta["packages"]


def test_real_packages_deterministic_with_names(tmp_path: Path) -> None:
    """A few small packages of the running environment, twice: identical datasets."""
    path = f"{P}:include=yaml+mdurl+shellingham"
    lst = package_listing(SourceSpec(path=path))
    assert set(lst.included) == {"yaml", "mdurl", "shellingham"} and all(lst.included.values())
    assert "typer" in lst.held_out and "yaml" not in lst.held_out
    assert all(f.path.suffix == ".py" and "__pycache__" not in f.path.parts for f in lst.files)
    runs = []
    for run in ("a", "b"):
        r = load_recipe(recipe_file(tmp_path, f"[{path}]", run=run), need_sources=True)
        runs.append((r, tokenize(r)))
    (a, meta), (b, _) = runs
    assert meta["documents"] + meta["skipped"]["too_short"] == len(lst.files)
    assert meta["packages"][path]["included"] == lst.included
    for name in ("train.bin", "train.idx", "val.bin", "val.idx", "tokenizer.json"):
        assert (a.data_dir / name).read_bytes() == (b.data_dir / name).read_bytes(), name


def test_no_match_is_one_error_line_through_the_cli(tmp_path: Path) -> None:
    path = f"{P}:include=no_such_package_xyz"
    r = run_cli("tokenize", str(recipe_file(tmp_path, "[builtin:python-stdlib]")), "--set", f"data.sources=[{path}]")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and path in errors[0] and "no installed package 'no_such_package_xyz'" in errors[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "data").exists()

"""Issue 44 item 6: the docs a newcomer can walk. README.md is a landing page (at most about 300 lines,
every link resolves); the manual is a MkDocs Material site (mkdocs.yml, docs/) that builds with
``--strict`` and has every page in its nav; and every command shown in a ``bash`` block anywhere in the
docs is run by a named test or marked as needing a GPU or data, while every ``ncpctl`` command shown
(in a block or inline) names a real subcommand with real options, real recipe keys and shipped files that
exist."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from .docs_site import README, REPO, SITE

DOCS = REPO / "docs"
# the line just above a bash block (blank lines between allowed) says how its commands are covered, in
# clauses split by "; ": `run by tests/x.py::test_a, tests/y.py::test_b` (the tests that run these commands,
# at a test's size), `needs gpu: WHY`, `needs data: WHY` (a corpus, weights, or the runs a block trains first)
MARK = re.compile(r"<!-- docs: (.+?) -->")
CLAUSE = re.compile(r"run by (?P<tests>\S.*)|needs (?:gpu|data): \S.*")
COMMAND = re.compile(r"^\s*(?:\w+=\S*\s+)*(?:ncpctl|deepspeed|torchrun|python3?|\.venv/bin/\S+|\./dev\.sh|examples/\S+"
                     r"|bash|for|P=)\b")
# every recipe key, from the generated reference (tests/recipe/test_reference.py keeps it equal to the schema)
RECIPE_KEYS = set(re.findall(r"^\| `([\w.]+)` \|", (REPO / "docs" / "recipes.md").read_text(), re.M))
FILES = re.compile(r"(?<![\w./-])((?:bench/)?recipes/[\w./-]+\.yaml|examples/[\w./-]+|bench/[\w-]+\.py)")


def bash_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the fence, the nearest non-blank line above it, the block's body) per ```bash block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].strip().startswith("```"))
            if fence == "```bash":
                above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                out.append((i + 1, above, "\n".join(lines[i + 1:j])))
            i = j
        i += 1
    return out


def unmarked_blocks(text: str, name: str) -> list[str]:
    """Bash blocks holding a command with no mark above them, and marks naming a test that does not exist."""
    bad = []
    for line, above, body in bash_blocks(text):
        if not any(COMMAND.match(x) for x in body.splitlines()):
            continue
        m = MARK.search(above)
        clauses = [CLAUSE.fullmatch(c.strip()) for c in m.group(1).split("; ")] if m else [None]
        if not all(clauses):
            bad.append(f"{name}:{line}: no <!-- docs: run by TEST | needs gpu: WHY | needs data: WHY --> above it")
            continue
        for ref in [r for c in clauses if c.group("tests") for r in c.group("tests").split(",")]:
            path, _, test = ref.strip().partition("::")
            src = REPO / path
            if not (src.is_file() and re.search(rf"^\s*def {re.escape(test)}\(", src.read_text(), re.M)):
                bad.append(f"{name}:{line}: {ref.strip()} names no test")
    return bad


def _cli_tree():
    import typer.main

    from ncpctl.cli.app import app

    return typer.main.get_command(app)


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))} | {"--help"}


def ncpctl_invocations(text: str) -> list[list[str]]:
    """The argument lists after ``ncpctl`` of every command shown: in bash blocks (continuations joined,
    ``&&`` / ``;`` / ``|`` chains split, ``$(which ncpctl)`` under a launcher) and in inline code spans."""
    shown = [ln for _, _, b in bash_blocks(text) for ln in b.replace("\\\n", " ").splitlines()]
    shown += [m.group(1).replace("\n", " ") for m in re.finditer(r"(?<!`)`(ncpctl [^`]+)`", text)]
    out = []
    for line in shown:
        for part in re.split(r"&&|;|\|(?!\|)", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split()
            first = next((i for i, w in enumerate(words) if not re.match(r"\w+=", w)), len(words))
            # ncpctl itself, or under a launcher: `deepspeed ... $(which ncpctl)`, `torchrun ... -m ncpctl`
            at = next((i for i, w in enumerate(words) if (w == "ncpctl" or w.endswith("/ncpctl"))
                       and (i == first or words[i - 1] in ("-m", "do", "then")) or w == "ncpctl)"), None)
            if at is not None:
                out.append([w.strip("[]") for w in words[at + 1:] if w.strip("[]")])
    return out


def bad_invocations(text: str, name: str, tree) -> list[str]:
    """Every ncpctl command shown names a subcommand of the app and only options that it (or the app) has."""
    bad = []
    for args in ncpctl_invocations(text):
        cmd, known = tree, _options(tree)
        words = list(args)
        while words and words[0].startswith("-") and words[0].split("=")[0] in known:
            words.pop(0)
        if words and not words[0].startswith("-"):
            sub = tree.commands.get(words[0]) if hasattr(tree, "commands") else None
            if sub is None:
                bad.append(f"{name}: ncpctl {' '.join(args)}: no subcommand {words[0]!r}")
                continue
            cmd, known, words = sub, known | _options(sub), words[1:]
            while words and hasattr(cmd, "commands") and words[0] in cmd.commands:  # a command group's own subcommands
                cmd, words = cmd.commands[words[0]], words[1:]
                known |= _options(cmd)
        for w, value in zip(words, [*words[1:], ""]):
            flag = w.split("=")[0].rstrip(":,")
            if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and flag not in known:
                bad.append(f"{name}: ncpctl {' '.join(args)}: {cmd.name} has no option {flag}")
            key = value.split("=")[0]
            if flag == "--set" and key not in RECIPE_KEYS and not key.startswith("model.options."):
                bad.append(f"{name}: ncpctl {' '.join(args)}: --set {key}: no such recipe key")
    return bad


def missing_files(text: str, name: str) -> list[str]:
    """Shipped recipes, examples and bench scripts that a bash block names exist (brace and glob forms skipped)."""
    bad = []
    for _, _, body in bash_blocks(text):
        for path in FILES.findall(body):
            if not any(c in path for c in "{*$") and not (REPO / path).exists():
                bad.append(f"{name}: {path} does not exist")
    return bad


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` (what CI runs, here in the suite): a broken link or anchor fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "reliability" / "index.html").is_file()


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_page_is_in_the_nav() -> None:
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages and len(nav) == len(set(nav))


def _slugs(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(text: str, base: Path) -> list[str]:
    """Relative links (and their #anchors into a page) that do not resolve from ``base``."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve() if path else None
        if dest is not None and not dest.exists():
            bad.append(target)
        elif anchor and dest is not None and dest.suffix == ".md" and anchor not in _slugs(dest):
            bad.append(target)
    return bad


def test_the_readme_is_a_landing_page_whose_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for cmd in ("./dev.sh demo", "./dev.sh test"):
        assert cmd in text
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert sum(t.startswith("docs/") for t in links) >= 10  # where to go next: into the site
    assert broken_links(text, REPO) == []
    assert broken_links("[x](docs/nowhere.md) [y](docs/reliability.md#no-such-heading)", REPO) == \
        ["docs/nowhere.md", "docs/reliability.md#no-such-heading"]


def test_every_command_shown_is_run_by_a_test_or_marked() -> None:
    bad = [b for page in SITE for b in unmarked_blocks(page.read_text(), str(page.relative_to(REPO)))]
    assert bad == [], "\n".join(bad)
    marked = sum(len(bash_blocks(p.read_text())) for p in SITE)
    assert marked >= 30
    # the check can fail: a bare block, a mark naming a test that is not there, a mark that says nothing known
    sample = ("text\n\n```bash\nncpctl pretrain recipes/debug.yaml\n```\n"
              "<!-- docs: run by tests/test_docs_site.py::nope -->\n```bash\nncpctl eval runs/debug\n```\n"
              "<!-- docs: needs patience -->\n```bash\nncpctl eval runs/x\n```\n")
    said = [b.split(": ", 1)[1] for b in unmarked_blocks(sample, "x")]
    assert [s.split(" ")[0] for s in said] == ["no", "tests/test_docs_site.py::nope", "no"], said


def test_every_ncpctl_command_shown_exists_with_its_options_and_files() -> None:
    tree = _cli_tree()
    bad = [b for page in SITE for b in bad_invocations(page.read_text(), str(page.relative_to(REPO)), tree)]
    bad += [b for page in SITE for b in missing_files(page.read_text(), str(page.relative_to(REPO)))]
    assert bad == [], "\n".join(bad)
    assert sum(len(ncpctl_invocations(p.read_text())) for p in SITE) > 150
    sample = "```bash\nncpctl pretrian recipes/debug.yaml\nncpctl eval runs/x --tasks a --limt 3\n" \
             "ncpctl tokenize recipes/nope.yaml\n```\nthen `ncpctl generate CKPT --steerr X` or `ncpctl pretrain R " \
             "--set train.max_stpes=3`"
    assert [b.split(": ", 1)[1] for b in bad_invocations(sample, "x", tree) + missing_files(sample, "x")] == [
        "ncpctl pretrian recipes/debug.yaml: no subcommand 'pretrian'",
        "ncpctl eval runs/x --tasks a --limt 3: eval has no option --limt",
        "ncpctl generate CKPT --steerr X: generate has no option --steerr",
        "ncpctl pretrain R --set train.max_stpes=3: --set train.max_stpes: no such recipe key",
        "recipes/nope.yaml does not exist"]


PATH_NAMED = re.compile(r"(?<![\w./-])((?:ncpctl|tests|bench|recipes|examples|tools|docs)/[\w./-]*[\w/])")
OUTPUTS = ("bench/results/",)  # what a command shown writes, not a file of the repository


def stale_paths(text: str, name: str) -> list[str]:
    """Repository paths the prose and the bash blocks name that do not exist, and ``tests/x.py::name`` (or a
    following ``::name``, of the last file named) that names no test or class. Output blocks (no language)
    are left out: they show what a command printed, paths of the machine it ran on included."""
    kept, fence = [], None
    for line in text.split("\n"):
        if line.strip().startswith("```"):
            fence = line.strip()[3:] if fence is None else None
        elif fence in (None, "bash"):
            kept.append(line)
    kept, bad = "\n".join(kept), []
    for m in PATH_NAMED.finditer(kept):
        path, after = m.group(1).rstrip("."), kept[m.end():m.end() + 1]
        if after in "-{*[" and after or path.startswith(OUTPUTS) or (REPO / path).exists():
            continue
        bad.append(f"{name}: {path} does not exist")
    last = None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)(\*?)[^`]*`", kept):
        last = m.group(1) or last
        src, tail = (REPO / last if last else None), (r"\w*" if m.group(3) else r"\b")  # test_x_* : a prefix
        defined = rf"^\s*(def|class) {m.group(2)}{tail}"
        if not (src is not None and src.is_file() and re.search(defined, src.read_text(), re.M)):
            bad.append(f"{name}: {m.group(0)} names no test in {last}")
    return bad


def test_every_path_and_test_the_docs_name_exists() -> None:
    """The reliability promises name the tests that prove them, and every page names files: when a move
    leaves one stale, this lists it (page, path)."""
    bad = [b for page in SITE for b in stale_paths(page.read_text(), str(page.relative_to(REPO)))]
    assert bad == [], "\n".join(bad)
    promises = (DOCS / "reliability.md").read_text()
    assert promises.startswith("# Reliability: what ncpctl promises on disk") and promises.count("::test_") >= 30
    sample = "See `ncpctl/nowhere.py` and `tests/test_docs_site.py::test_every_page_is_in_the_nav`, `::nope`.\n" \
             "```\nncpctl/printed/by/a/command.py\n```\n"
    assert stale_paths(sample, "x") == ["x: ncpctl/nowhere.py does not exist",
                                        "x: `::nope` names no test in tests/test_docs_site.py"]

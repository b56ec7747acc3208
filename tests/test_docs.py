"""The documentation: the site builds in strict mode, links resolve, the README keeps its promises
to CI, generated sections are current and ``benchmarks/results/`` holds only cited files.

The site's tools (mkdocs, mkdocstrings) come with the ``test`` extra, so nothing here skips.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

README_MAX_LINES = 300
RESULTS_MAX_FILES = 30
# What a result measures, then the date of the run or a commit: bench_hd128_8k_2026-12-04.md,
# or a folder of one run such as e2e_2026-12-10.
RESULT_NAME = re.compile(
    r"[a-z0-9]+(?:_[a-z0-9]+)*_(?:\d{4}-\d{2}-\d{2}|[0-9a-f]{7,40})(?:\.[a-z]+)?"
)
# Markdown links and images, and HTML image sources.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
RESULT_MENTION = re.compile(r"benchmarks/results/([\w.-]+\.(?:md|json|log|png|txt|csv))")


def _slug(heading: str) -> str:
    """GitHub's (and mkdocs') anchor of a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [m.group(1) or m.group(2) for m in LINK.finditer(text)]


def test_mkdocs_builds_in_strict_mode(tmp_path: Path) -> None:
    """Every page and every API object the reference names must render without a warning."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        "mkdocs build --strict failed (the test extra installs mkdocs and mkdocstrings):\n"
        + result.stdout
        + result.stderr
    )
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("flashmask_attention", "apply_flashmask", "pack_sft", "make_plan"):
        assert name in api, f"the API reference lost {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Links that leave a page (to other pages, results, sources) point at existing files and,
    into Markdown, at existing headings; mkdocs checks only links inside ``docs/``."""
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and resolved.suffix == ".md" and resolved.exists()
        if not resolved.exists() or (missing_anchor and anchor not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_readme_fits_its_budget() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_readme_test_command_is_the_ci_command() -> None:
    """The Quick start's test command is the one `.ci/run` runs, character for character."""
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    command = ci_lines[-1].strip()
    assert command.startswith("pip install"), command
    assert command in README.read_text().splitlines()


def test_readme_table_headers_name_columns_not_numbers() -> None:
    """A table header holds names: a measured figure there (``557 / 400 (1.39x)``) is an edit
    that landed in the wrong table."""
    lines = README.read_text().splitlines()
    headers = [
        line
        for line, below in itertools.pairwise(lines)
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", below.strip())
    ]
    assert headers
    figures = [h for h in headers if re.search(r"\d+(\.\d+)?x\b|\d+ / \d+", h)]
    assert not figures, f"table headers with figures: {figures}"


def test_results_are_few_named_and_cited() -> None:
    """Only files the README and docs cite (a run's folder counts each file in it), named by
    what they measure plus a date or commit."""
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= RESULTS_MAX_FILES, f"{len(files)} files in benchmarks/results"
    entries = sorted(p.name for p in RESULTS.iterdir())
    misnamed = [
        name
        for name in entries
        if not RESULT_NAME.fullmatch(name) or re.search(r"(?:^|_)s\d{1,2}(?:_|\.|$)", name)
    ]
    assert not misnamed, f"not named <what>_<date or commit>[.<ext>]: {misnamed}"
    text = "\n".join(page.read_text() for page in PAGES)
    uncited = [name for name in entries if name not in text]
    assert not uncited, f"results that no page cites (cite or remove them): {uncited}"
    missing = sorted({m for m in RESULT_MENTION.findall(text) if not (RESULTS / m).exists()})
    assert not missing, f"pages cite results that do not exist: {missing}"


def _make_gallery():
    spec = importlib.util.spec_from_file_location("make_gallery", DOCS / "make_gallery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(text: str, key: str) -> str:
    match = re.search(
        rf"<!-- BEGIN generated: {key} -->\n(.*?)\n<!-- END generated: {key} -->", text, re.DOTALL
    )
    assert match, f"no '{key}' markers"
    return match.group(1)


def test_generated_sections_are_current() -> None:
    """The README's mask table and tile picture and the text gallery of docs/masks.md are what
    ``python docs/make_gallery.py`` writes from the library as it is."""
    gallery = _make_gallery()
    readme = README.read_text()
    assert _section(readme, "mask table") == gallery.mask_table()
    assert _section(readme, "tile picture") == gallery.tile_picture()
    masks_page = (DOCS / "masks.md").read_text()
    assert _section(masks_page, "text gallery") == gallery.text_gallery()

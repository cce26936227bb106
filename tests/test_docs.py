"""The front page and the docs/ pages: their Python examples run, their links resolve.

Every ```python block of README.md and docs/*.md is executed, page by page: a page's blocks run in
order in one fresh namespace (a later block may use what an earlier one defined), in a temporary
working directory (so ``quantkit.save(qmodel, "out/...")`` writes nowhere else), with quantkit's
registries copied for the page (what an example registers is gone after it). A block whose first
line is ``# doc: skip (reason)`` is not run (GPU, torchrun, big models); the reason is required.
Shell blocks are not run, except that the README must keep the ```bash block with ``pytest -q``
(CI's .ci/run runs that command). The pages are found beside this tests/ folder (tests/../README.md),
so the examples run against whichever quantkit the tests import (the installed wheel in CI).
"""

from __future__ import annotations

import importlib
import re
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# issue 27: one page per topic
REQUIRED = {"schemes", "calibration", "execution", "llms", "distributed", "export", "security"}
MAX_README_LINES = 150  # issue 27: the README is a front page

# The registries an example may add to (a preset, a config type, an emitter, a calibration hook, a
# lowering pass, an observer name). Each page runs against copies of them, so nothing a page registers
# outlives it: later tests see the library's registrations and their own only (e.g. test_toy_scheme
# expects its preset to be the last one).
REGISTRIES = [("quantkit.quantizers._scheme", "_SCHEMES"), ("quantkit.quantizers._scheme", "_TYPES"),
              ("quantkit.quantizers._scheme", "_QUANTIZERS"), ("quantkit.pipeline.emit._registry", "_EMITTERS"),
              ("quantkit.pipeline._hooks", "_HOOKS"), ("quantkit.lowering._registry", "_REGISTRY"),
              ("quantkit.observers._registry", "_REGISTRY")]

_SKIP = re.compile(r"#\s*doc:\s*skip\b(.*)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a name of a private module or function reached through quantkit (quantkit._qmath, quantkit.pipeline._convert)
_PRIVATE = re.compile(r"\bquantkit(?:\.\w+)*\._\w+")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def links(text: str) -> list[str]:
    """The targets of the Markdown links of a text, outside code blocks and code spans."""
    prose = re.sub(r"^\s*(```+).*?^\s*\1\s*$", "", text, flags=re.M | re.S)
    return _LINK.findall(re.sub(r"`[^`\n]*`", "", prose))


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """Every fenced block of a Markdown text as ``(language, first line number, code)``.

    A fence may be indented (a block inside a list item); its indentation is removed from the
    block's lines. The language is the fence's info string up to the first space ("" if none).
    """
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([^\s`]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        blocks.append((lang, i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks(page: Path) -> list[tuple[int, int, str, str | None]]:
    """``(block number, line, code, skip reason or None)`` for every ```python block of a page."""
    out = []
    for n, (lang, line, code) in enumerate([b for b in fenced_blocks(page.read_text()) if b[0] == "python"], 1):
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        m = _SKIP.match(first.strip())
        out.append((n, line, code, m.group(1).strip() if m else None))
    return out


def test_required_pages_exist():
    assert README.is_file()
    missing = REQUIRED - {p.stem for p in DOCS.glob("*.md")}
    assert not missing, f"docs/ lacks {sorted(missing)}"


@pytest.fixture
def isolated_registries(monkeypatch):
    """Swap every registry in ``REGISTRIES`` for a copy (dicts of dicts copied one level down) for the
    test's duration; monkeypatch puts the originals back."""
    for module, name in REGISTRIES:
        mod = importlib.import_module(module)
        table = getattr(mod, name, None)
        assert isinstance(table, dict), f"{module}.{name} is gone or no longer a dict: update REGISTRIES"
        monkeypatch.setattr(mod, name, {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()})


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_examples_run(page, tmp_path, monkeypatch, isolated_registries):
    """Each runnable ```python block, in order, in one namespace; a failure names the page and block."""
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for n, line, code, skip in blocks:
        if skip is not None:
            continue
        where = f"{_rel(page)}, python block {n} (line {line})"
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as e:  # report which block, with the snippet's own traceback
            pytest.fail(f"{where} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}", pytrace=False)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_skipped_blocks_say_why(page):
    bad = [n for n, _, _, skip in python_blocks(page) if skip is not None and not re.match(r"\(.+\)", skip)]
    assert not bad, f"{_rel(page)}: python blocks {bad} are skipped without a reason: '# doc: skip (reason)'"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve(page):
    """Every relative link of a page points at a file or folder of the repository (and at a heading
    of it, for a ``page.md#anchor`` link)."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path) if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{_rel(page)}: links to missing files or headings {broken}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_examples_use_public_names(page):
    """Examples import quantkit's public API only (no quantkit._private / quantkit.pkg._private)."""
    private = sorted({m for _, _, code, _ in python_blocks(page) for m in _PRIVATE.findall(code)})
    assert not private, f"{_rel(page)}: examples use private names {private}"


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert not _PRIVATE.findall(README.read_text()), "README.md names private quantkit modules"
    assert "lower_weight_only" not in README.read_text(), "README.md points at a private function"


def test_readme_links_every_docs_page():
    linked = {(REPO / t.split("#", 1)[0]).resolve() for t in links(README.read_text())
              if t.startswith("docs/")}
    assert linked, "README.md links no docs/ page"
    missing = sorted(str(t.relative_to(REPO)) for t in linked if not t.is_file())
    assert not missing, f"README.md links missing pages {missing}"
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


def test_readme_keeps_the_test_command():
    """CI (.ci/run) runs the README's test command: a shell block holding exactly ``pytest -q``."""
    shell = [code for lang, _, code in fenced_blocks(README.read_text()) if lang in ("bash", "sh", "shell", "")]
    assert any("pytest -q" in [line.strip() for line in code.splitlines()] for code in shell), \
        "README.md lost its ```bash block with `pytest -q`"

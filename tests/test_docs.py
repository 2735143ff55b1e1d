"""Every Python block of README.md and docs/*.md runs, so the docs cannot rot.

A page's ```` ```python ```` blocks run in order in one namespace (a page is one session: its
first block builds the tiny model the others use), in a temporary working directory. A block
that cannot run here (CUDA only, several processes, a serving engine) is preceded by
``<!-- no-run: <reason> -->`` and is only compiled; the reason is required. Fences of other
languages (``bash``, plain text) are not executed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = re.compile(r"<!--\s*no-run:(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^```(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int            # 1-based line of the first line of code
    language: str
    code: str
    no_run: str | None   # the reason, "" when the mark gives none; None: the block runs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the no-run mark of the line before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines) and lines[i] != "```":
            i += 1
        previous = lines[start - 1] if start else ""
        mark = NO_RUN.search(previous)
        found.append(Block(page, start + 2, fence["info"].strip(),
                           "\n".join(lines[start + 1:i]) + "\n",
                           None if mark is None else mark["reason"].strip()))
        i += 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.language == "python"]


#: pages whose examples decode, export or convert Hugging Face models end to end: in the slow
#: tier, as such test modules are (the README's and kernels.md's short examples stay fast)
SLOW_PAGES = {"inference.md", "serving.md", "huggingface.md", "usage.md"}
RUNNABLE = [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW_PAGES else [])
            for p in PAGES if any(b.no_run is None for b in python_blocks(p))]


def test_the_pages_have_python_blocks_to_run():
    """A parse that found nothing would make the other tests pass vacuously."""
    assert (ROOT / "docs" / "index.md") in PAGES
    assert sum(b.no_run is None for p in PAGES for b in python_blocks(p)) >= 15


def test_every_no_run_mark_gives_a_reason_and_marks_a_python_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        marked = {b.line - 2 for b in blocks(page) if b.no_run is not None}
        for n, line in enumerate(lines):
            if NO_RUN.search(line):
                assert n + 1 in marked, f"{page.name}:{n + 1}: a no-run mark not before a block"
        for b in python_blocks(page):
            if b.no_run is not None:
                assert len(b.no_run.split()) >= 3, f"{b.where}: no-run needs its reason"


def test_every_python_block_compiles():
    for page in PAGES:
        for b in python_blocks(page):
            compile(b.code, b.where, "exec")
    assert any(b.no_run for p in PAGES for b in python_blocks(p))


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    for b in python_blocks(page):
        if b.no_run is None:
            exec(compile(b.code, b.where, "exec"), namespace)


def test_links_between_pages_resolve():
    link = re.compile(r"\]\((?!https?://|#)(?P<target>[^)#\s]+)")
    for page in PAGES:
        for target in link.findall(page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"
            assert f"(docs/{page.name})" in readme, f"README.md does not link {page.name}"


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs exactly the README's "Tests" command, as its first command after the
    fresh environment, then the fast tier on the oldest and newest torch (and the "Main job"
    command stays)."""
    readme = [b.code.strip() for b in blocks(ROOT / "README.md") if b.language == "bash"]
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    tests = next(c for c in readme if c.endswith("-m pytest -q -n auto"))
    assert commands[commands.index("rm -rf .venv") + 1] == tests
    tiers = [c for c in commands if c.startswith("tools/torch-release")]
    assert tiers == ['tools/torch-release "$release" -m "not slow and not distributed and '
                     'not inductor"']
    assert "for release in 2.11.0 2.15.0; do" in commands
    assert any(c.endswith("HF_HUB_OFFLINE=1 .venv/bin/python -m bench") for c in readme)

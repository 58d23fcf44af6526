"""Every ```python block of README.md and docs/*.md runs as written.

Markers: an HTML comment on the last non-blank line before a block's opening fence excludes it from running:

    <!-- snippet: skip (needs the Hub) -->
    <!-- snippet: skip (needs a GPU) -->

Skipped blocks are still compiled and name-checked. The blocks of one file share one namespace and run in
order, so a later block may use what an earlier one defined (as a reader of the page would).

Two parts:
* default suite: every block compiles and reads no name that the file's blocks (up to and including it) never
  bind or import (catches a missing import or an undefined ``path``); files whose runnable blocks load nothing
  heavy are also executed;
* ``pytest -m slow``: files whose blocks call ``load_bundled_model`` (the real SmolLM2-135M) are executed.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\b[^>]*-->")
_SLOW_MARK = "load_bundled_model"


@dataclass(frozen=True)
class Snippet:
    file: Path
    line: int  # line of the opening fence
    code: str
    skip: bool

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = [line for line in text[: match.start()].splitlines() if line.strip()]
        skip = bool(before) and bool(_SKIP.search(before[-1]))
        found.append(Snippet(path, text[: match.start()].count("\n") + 1, match.group(1), skip))
    return found


def bound_names(tree: ast.AST) -> set[str]:
    """Names a block binds anywhere (assignments, imports, loop/with/except targets, defs, arguments)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def undefined_names(blocks: list[Snippet]) -> list[str]:
    """``"file:line: name"`` for every name read in a block but bound by none of the file's blocks so far."""
    known, problems = set(dir(builtins)), []
    for block in blocks:
        tree = ast.parse(block.code, filename=block.where)
        known |= bound_names(tree)
        loads = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        problems += [f"{block.where}: {name}" for name in sorted(loads - known)]
    return problems


def _is_slow(blocks: list[Snippet]) -> bool:
    return any(_SLOW_MARK in block.code for block in blocks if not block.skip)


def run_file(blocks: list[Snippet]) -> None:
    import hf_kvspec

    namespace: dict = {"__name__": "__doc_snippet__"}
    try:
        for block in blocks:
            if not block.skip:
                exec(compile(block.code, block.where, "exec"), namespace)  # running the docs is the test
    finally:
        hf_kvspec.unregister()  # a page may register attention; leave the registry as found


_FILES = {path.relative_to(ROOT).as_posix(): snippets(path) for path in DOC_FILES}
_FAST = [name for name, blocks in _FILES.items() if blocks and not _is_slow(blocks)]
_SLOW = [name for name, blocks in _FILES.items() if blocks and _is_slow(blocks)]


def test_every_doc_block_is_found():
    assert sum(len(blocks) for blocks in _FILES.values()) >= 8  # README + docs hold at least this many today


@pytest.mark.parametrize("name", sorted(_FILES))
def test_blocks_compile_and_define_every_name(name):
    assert undefined_names(_FILES[name]) == []


@pytest.mark.parametrize("name", _FAST or [pytest.param(None, marks=pytest.mark.skip("every page loads the bundled model: see the slow part"))])
def test_blocks_without_a_model_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that write files (relative paths) write them here, not into the checkout
    run_file(_FILES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", _SLOW)
def test_blocks_with_the_bundled_model_run(name, bundled, tmp_path, monkeypatch):  # ``bundled``: converted once
    monkeypatch.chdir(tmp_path)  # snippets that write files (relative paths) write them here, not into the checkout
    run_file(_FILES[name])


def test_undefined_name_check_catches_a_missing_import():
    """The checker itself: the load-time snippet as docs/attention.md once had it is refused."""
    block = Snippet(ROOT / "README.md", 1, "import hf_kvspec\nhf_kvspec.register()\n"
                    "model = AutoModelForCausalLM.from_pretrained(path)\n", skip=False)
    assert undefined_names([block]) == ["README.md:1: AutoModelForCausalLM", "README.md:1: path"]


def test_skip_marker_is_read_from_the_line_before_the_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- snippet: skip (needs the Hub) -->\n\n```python\nx = 1\n```\n\ntext\n```python\ny = x\n```\n")
    first, second = snippets(page)
    assert first.skip and not second.skip and (first.line, second.line) == (3, 8)

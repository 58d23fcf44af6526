"""Every ``python`` block of docs/evaluation.md runs as written (blocks that load the bundled model: slow)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
MARKS = [pytest.mark.slow if "load_bundled_model" in block else () for block in BLOCKS]


@pytest.mark.parametrize("block", [pytest.param(b, marks=m, id=f"block{i}") for i, (b, m) in
                                   enumerate(zip(BLOCKS, MARKS))])
def test_doc_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks may write files (cached answers)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(DOC), "exec"), {"__name__": "__main__"})
    promised = re.findall(r"^print\(.*\)\s+# ([\d\[{].*?)(?::|$)", block, flags=re.M)
    for values in promised:  # values the page shows after a print must be what the block prints
        assert values.strip() in printed.getvalue(), (values, printed.getvalue())


def test_the_page_has_blocks_of_both_kinds():
    assert len(BLOCKS) >= 5 and sum("load_bundled_model" in b for b in BLOCKS) >= 2
    assert len(re.findall(r"^print\(.*\)\s+# [\d\[{]", DOC.read_text(), flags=re.M)) >= 2  # values are checked

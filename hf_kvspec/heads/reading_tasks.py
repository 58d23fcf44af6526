"""Reading tasks for self-distillation: a passage from an offline corpus plus an instruction about it.

Boundary: corpus names and a seed in, user prompts (``ReadingTask``) out. Reads files through ``hf_kvspec.corpus``
(Python docs fetched from the Debian archive on first use; the standard library's sources from this machine); knows
nothing about models. Nothing here is model output: the answers come later from the target itself.

Passages:
    ``python-docs``    prose paragraphs of the reST sources (no directives, lists, tables or code), roles flattened
                       (``:func:`open``` -> ``open``), 200-600 characters.
    ``python-stdlib``  top-level functions with a docstring, 4-30 lines of source.
Instructions cover four kinds of reading: summarise, explain, extract, and answer a question about the passage.
Deterministic for a fixed seed: files are sorted, sampled with ``random.Random(seed)``, and parsed in that order.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

PROSE_INSTRUCTIONS = (
    ("summarise", "Summarize the following passage in one or two sentences.\n\n{p}"),
    ("explain", "Explain this passage in plain words for someone new to Python.\n\n{p}"),
    ("extract", "List every Python name (function, class, module or keyword) mentioned in this passage, with a "
                "few words on each.\n\n{p}"),
    ("question", "Write one question that this passage answers, then answer it using the passage.\n\n{p}"),
    ("question", "Read the passage and say what a programmer should remember from it.\n\n{p}"),
)
CODE_INSTRUCTIONS = (
    ("explain", "Explain what this Python function does, step by step.\n\n```python\n{p}\n```"),
    ("summarise", "Describe this function in one sentence, then list its parameters.\n\n```python\n{p}\n```"),
    ("extract", "Which other functions or modules does this code call? List them.\n\n```python\n{p}\n```"),
    ("question", "Write a short example that calls this function, and say what it returns.\n\n```python\n{p}\n```"),
)
_ROLE = re.compile(r":[a-z:]+:`[~!]?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`open` / :ref:`text <target>` -> text
_SKIP_START = (" ", "\t", "..", "*", "-", "+", "=", "|", ">>>", "#")


@dataclass(frozen=True)
class ReadingTask:
    corpus: str
    kind: str       # summarise / explain / extract / question
    prompt: str


def prose_paragraphs(text: str, min_chars: int = 200, max_chars: int = 600) -> list[str]:
    """Plain prose paragraphs of a reST source: no directives, tables, lists, code or headings."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if not lines or any(line.startswith(_SKIP_START) for line in lines):
            continue
        paragraph = _ROLE.sub(r"\1", " ".join(line.strip() for line in lines)).replace("``", "")
        if min_chars <= len(paragraph) <= max_chars and paragraph[0].isupper() and paragraph.endswith("."):
            found.append(paragraph)
    return found


def documented_functions(source: str, min_lines: int = 4, max_lines: int = 30) -> list[str]:
    """Source of each top-level function with a docstring and ``min_lines..max_lines`` lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a few stdlib files are deliberately broken (lib2to3 fixtures, ...)
        return []
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
            text = ast.get_source_segment(source, node) or ""
            if min_lines <= text.count("\n") + 1 <= max_lines:
                found.append(text)
    return found


def _passages(corpus: str, needed: int, rng: random.Random) -> list[str]:
    """At least ``needed`` passages of one corpus (fewer if it has fewer), from files in a seeded random order."""
    from hf_kvspec.corpus import corpus_files

    files = corpus_files(corpus, "train")
    rng.shuffle(files)
    extract = prose_paragraphs if corpus == "python-docs" else documented_functions
    passages: list[str] = []
    for path in files:
        found = extract(path.read_text(encoding="utf-8", errors="replace"))
        passages += rng.sample(found, min(len(found), 3))  # at most 3 per file: spread over many files
        if len(passages) >= needed:
            break
    return passages


CORPORA = ("python-docs", "python-stdlib")  # the corpora reading_tasks has instructions for


def reading_tasks(count: int, seed: int = 0, corpora: tuple[str, ...] = ("python-docs", "python-stdlib"),
                  oversample: float = 2.0) -> list[ReadingTask]:
    """Up to ``oversample * count`` tasks, corpora and instructions in turn (callers filter, then keep ``count``)."""
    known = {"python-docs": PROSE_INSTRUCTIONS, "python-stdlib": CODE_INSTRUCTIONS}  # keys: CORPORA
    unknown = [c for c in corpora if c not in known]
    if unknown:
        raise ValueError(f"No reading instructions for corpora {unknown}; known: {sorted(known)}.")
    rng = random.Random(seed)
    per_corpus = -(-int(oversample * count) // max(len(corpora), 1))
    tasks = []
    for corpus in corpora:
        instructions = known[corpus]
        for i, passage in enumerate(_passages(corpus, per_corpus, rng)[:per_corpus]):
            kind, template = instructions[i % len(instructions)]
            tasks.append(ReadingTask(corpus, kind, template.format(p=passage)))
    rng.shuffle(tasks)
    return tasks

"""Training text for the heads: any ``datasets`` source turned into token sequences.

Boundary: source specs in, examples (``{"input_ids": [...], "prompt_length": int}``) out. Plain-text rows are cut
into windows; prompt rows become chat conversations whose responses are the dataset's own or, with self-distillation,
the target's (``distill.py``).

Source specs (``--dataset`` may be repeated):
    ``corpus:python-docs``       an offline corpus from ``hf_kvspec.corpus`` (split from ``--dataset_split``)
    ``path/to/file.txt|.md|.rst`` local text files (one example per paragraph)
    ``path/to/file.jsonl|.json``  local JSON lines (a text column, or a prompt column [+ response column])
    ``name`` or ``name:config``   anything ``datasets.load_dataset`` accepts
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_TEXT_SUFFIXES = (".txt", ".md", ".rst")
_JSON_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class Columns:
    text: str = "text"
    prompt: str = "prompt"
    response: str = "response"


def load_source(spec: str, split: str = "train"):
    """A ``datasets.Dataset`` for one source spec (see the module docstring)."""
    import datasets

    if spec.startswith("corpus:"):
        from hf_kvspec.corpus import load_text_corpus

        return load_text_corpus(spec.removeprefix("corpus:"), split)
    path = Path(spec)
    if path.suffix in _TEXT_SUFFIXES + _JSON_SUFFIXES and not path.exists():
        raise FileNotFoundError(f"--dataset {spec}: no such file.")
    if path.suffix in _TEXT_SUFFIXES:
        return datasets.load_dataset("text", data_files=str(path), sample_by="paragraph", split="train")
    if path.suffix in _JSON_SUFFIXES:
        return datasets.load_dataset("json", data_files=str(path), split="train")
    name, _, config = spec.partition(":")
    return datasets.load_dataset(name, config or None, split=split)


def read_prompts(path: str, column: str = "prompt") -> list[str]:
    """Prompts from a JSONL/JSON-lines file (``column`` of each row) or a text file (one per non-empty line)."""
    text = Path(path).read_text()
    if path.endswith((".jsonl", ".json")):
        return [json.loads(line)[column] for line in text.splitlines() if line.strip()]
    return [line for line in text.splitlines() if line.strip()]


def text_windows(tokenizer, texts: list[str], max_length: int, min_length: int = 16) -> list[dict]:
    """Tokenize texts and cut them into windows of at most ``max_length`` tokens (shorter tails kept if long enough)."""
    examples = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), max_length):
            window = ids[start:start + max_length]
            if len(window) >= min_length:
                examples.append({"input_ids": window, "prompt_length": 0})
    return examples


def conversation_example(conversation, max_length: int) -> dict:
    """A ``distill.Conversation`` as an example, truncated to ``max_length`` tokens."""
    ids = conversation.input_ids[:max_length]
    return {"input_ids": ids, "prompt_length": min(conversation.prompt_length, len(ids))}


def split_rows(dataset, columns: Columns) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(plain texts, (prompt, response-or-None) pairs) from a dataset's rows."""
    names = set(dataset.column_names)
    if columns.prompt in names:
        responses = dataset[columns.response] if columns.response in names else [None] * len(dataset)
        return [], list(zip(dataset[columns.prompt], responses))
    if columns.text in names:
        return list(dataset[columns.text]), []
    raise ValueError(f"Dataset columns {sorted(names)} have neither a text column {columns.text!r} nor a prompt "
                     f"column {columns.prompt!r}; name yours with --text_column / --prompt_column.")


def cap_tokens(examples: list[dict], max_tokens: int | None) -> list[dict]:
    """Keep examples in order until ``max_tokens`` tokens are used (None: keep all)."""
    if max_tokens is None:
        return examples
    kept, used = [], 0
    for example in examples:
        if used >= max_tokens:
            break
        kept.append(example)
        used += len(example["input_ids"])
    return kept

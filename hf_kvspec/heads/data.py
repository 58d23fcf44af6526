"""Training text for the heads: any ``datasets`` source turned into token sequences.

Boundary: source specs in, examples (``{"input_ids": [...], "prompt_length": int}``) out. Plain-text rows are cut
into windows; prompt rows become chat conversations whose responses are the dataset's own or, with self-distillation,
the target's (``distill.py``).

Source specs (``--dataset`` may be repeated):
    ``corpus:python-docs``       an offline corpus from ``hf_kvspec.corpus`` (split from ``--dataset_split``)
    ``path/to/file.txt|.md|.rst`` local text files (one example per paragraph)
    ``path/to/file.jsonl|.json``  local JSON lines (a text column, a prompt column [+ response column], or a
                                  ``messages`` column of whole chats, as ``scripts/make_distill_data.py`` writes)
    ``path/to/file.jsonl.gz``     any local file above, gzip-compressed (how chats are committed to the repo)
    ``name`` or ``name:config``   anything ``datasets.load_dataset`` accepts

Held out: ``HeldOut`` keeps the evaluation prompts, their topics and their templates out of training; any training
prompt that repeats one (normalised text), names a held-out topic or follows a held-out template is a leak, and
``HeldOut.check`` refuses the set.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_TEXT_SUFFIXES = (".txt", ".md", ".rst")
_JSON_SUFFIXES = (".json", ".jsonl")
MESSAGES = "messages"
#: skeletons of the bundled held-out prompts (``scripts/train_configs/chat_prompts_heldout.jsonl``): held out whole
HELD_OUT_TEMPLATES = ("Explain {t} to a high-school student.", "What should everyone know about {t}?",
                      "Describe the history of {t} briefly.")
#: patterns whose slot is a held-out topic although the template itself is shared with training
HELD_OUT_TOPIC_PATTERNS = ("Write a Python function that {t}.",)


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
    suffix = file_format(path)
    if suffix in _TEXT_SUFFIXES + _JSON_SUFFIXES and not path.exists():
        raise FileNotFoundError(f"--dataset {spec}: no such file.")
    if suffix in _TEXT_SUFFIXES:  # datasets decompresses .gz data files itself
        return datasets.load_dataset("text", data_files=str(path), sample_by="paragraph", split="train")
    if suffix in _JSON_SUFFIXES:
        return datasets.load_dataset("json", data_files=str(path), split="train")
    name, _, config = spec.partition(":")
    return datasets.load_dataset(name, config or None, split=split)


def file_format(path: Path) -> str:
    """The format suffix of a local file, looking through gzip: ``chats.jsonl.gz`` -> ``.jsonl``."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


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


def message_example(tokenizer, messages: list[dict], max_length: int) -> dict:
    """A chat whose last turn is the assistant's as an example: loss on that last answer only (``prompt_length``
    covers every earlier turn), ids truncated to ``max_length``."""
    from hf_kvspec.heads.distill import Conversation, chat_ids

    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError(f"A {MESSAGES!r} row must end with an assistant turn, got roles "
                         f"{[m['role'] for m in messages]}.")
    prompt = chat_ids(tokenizer, messages[:-1])
    answer = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return conversation_example(Conversation(prompt, answer + eos), max_length)


def user_turns(dataset, prompt_column: str = "prompt") -> list[str]:
    """Every user message of a prompt-column or messages-column dataset (what the held-out check reads)."""
    names = set(dataset.column_names)
    if MESSAGES in names:
        return [m["content"] for chat in dataset[MESSAGES] for m in chat if m["role"] == "user"]
    return list(dataset[prompt_column]) if prompt_column in names else []


def normalise(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed: the form in which duplicates and leaks are compared."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


class HeldOutLeakError(ValueError):
    """Training prompts repeat held-out prompts, name held-out topics or follow held-out templates."""


def _slot(template: str) -> re.Pattern:
    head, _, tail = template.partition("{t}")
    return re.compile(re.escape(head) + "(.+)" + re.escape(tail), re.IGNORECASE)


def _topic_pattern(topic: str) -> re.Pattern:
    core = re.sub(r"^(the|a|an) ", "", normalise(topic)).removesuffix("s")
    return re.compile(r"\b" + re.escape(core) + r"s?\b")  # "earthquakes" also catches "earthquake"


@dataclass(frozen=True)
class HeldOut:
    """What training must not see: held-out prompts (normalised), their topics, and whole templates."""

    prompts: frozenset[str]
    topics: tuple[str, ...]
    templates: tuple[str, ...] = HELD_OUT_TEMPLATES

    @classmethod
    def from_prompts(cls, prompts: list[str], templates=HELD_OUT_TEMPLATES,
                     topic_patterns=HELD_OUT_TOPIC_PATTERNS) -> HeldOut:
        """Topics are the slots of ``templates`` and ``topic_patterns`` that the held-out prompts fill."""
        topics = {match.group(1).lower() for prompt in prompts for tpl in (*templates, *topic_patterns)
                  if (match := _slot(tpl).fullmatch(prompt.strip()))}
        return cls(frozenset(map(normalise, prompts)), tuple(sorted(topics)), tuple(templates))

    @classmethod
    def from_file(cls, path: str, column: str = "prompt", **kwargs) -> HeldOut:
        return cls.from_prompts(read_prompts(path, column), **kwargs)

    def leak(self, text: str) -> str | None:
        """Why ``text`` leaks held-out material (a short reason), or None."""
        if normalise(text) in self.prompts:
            return "repeats a held-out prompt"
        for template in self.templates:
            if _slot(template).fullmatch(text.strip()):
                return f"follows the held-out template {template!r}"
        flat = normalise(text)
        for topic in self.topics:
            if _topic_pattern(topic).search(flat):
                return f"names the held-out topic {topic!r}"
        return None

    def check(self, texts: list[str], what: str = "training prompts") -> None:
        """Raise ``HeldOutLeakError`` listing the first leaks, if any of ``texts`` leaks."""
        leaks = [(text, reason) for text in texts if (reason := self.leak(text))]
        if leaks:
            shown = "; ".join(f"{text[:80]!r} {reason}" for text, reason in leaks[:5])
            raise HeldOutLeakError(f"{len(leaks)} of {len(texts)} {what} leak held-out material: {shown}. Drop them "
                                   "(make_distill_data.py filters them) or choose another held-out set.")

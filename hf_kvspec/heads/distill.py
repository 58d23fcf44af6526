"""Self-distillation data: the target model's own answers to chat prompts, generated in batches and cached on disk.

Boundary: prompts in, token ids out (prompt ids rendered with the chat template, response ids from greedy or sampled
``generate``). Knows nothing about heads or features.

Why: heads that learn the target's *own* continuations are accepted more often than heads fitted to human text
(Medusa-2 and EAGLE both train on self-distilled data for this reason). The cache file is keyed by the target's
fingerprint, the prompt and the generation settings, so a re-run only generates what is missing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class DistillSettings:
    max_new_tokens: int = 128
    batch_size: int = 8
    do_sample: bool = False
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DistillSettings needs a positive int {name}, got {name}={value!r}.")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"DistillSettings(do_sample=True) needs temperature > 0, got {self.temperature!r}; for "
                             "greedy answers use do_sample=False.")


@dataclass(frozen=True)
class Conversation:
    """One prompt and the target's response, as token ids; ``prompt_length`` = len(prompt_ids)."""

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a one-turn user message plus the assistant header (the tokenizer's chat template)."""
    return chat_ids(tokenizer, [{"role": "user", "content": prompt}])


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (``[{"role", "content"}, ...]``) plus the assistant header; without a chat template, the
    turns' contents joined by blank lines."""
    if tokenizer.chat_template is None:
        return tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _key(fingerprint: str, prompt_ids: list[int], settings: DistillSettings) -> str:
    recipe = {k: v for k, v in asdict(settings).items() if k != "batch_size"}  # batching does not change the recipe
    blob = json.dumps([fingerprint, prompt_ids, recipe]).encode()
    return hashlib.sha256(blob).hexdigest()


def _load_cache(path: Path) -> dict[str, list[int]]:
    if not path.is_file():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["key"]: row["response_ids"] for row in rows}


@torch.no_grad()
def generate_batch(model, batch: list[list[int]], pad_id: int, settings: DistillSettings) -> list[list[int]]:
    """Left-padded batched ``generate``; returns each row's new tokens, cut after its first EOS."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    device = next(model.parameters()).device
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=settings.max_new_tokens,
                         do_sample=settings.do_sample, temperature=settings.temperature if settings.do_sample else None,
                         top_p=None, top_k=None, pad_token_id=pad_id)
    eos = set(_eos_ids(model))
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
        responses.append(row[:cut])
    return responses


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def self_distill(model, tokenizer, prompts: list[str], cache_file: str | Path, fingerprint: str,
                 settings: DistillSettings = DistillSettings(), progress: bool = True) -> list[Conversation]:
    """The target's responses to ``prompts`` (generated once, then read from ``cache_file`` JSONL)."""
    if isinstance(prompts, str):
        raise TypeError("self_distill takes a list of prompts, got one string (it would be read character by "
                        "character); wrap it: [prompt].")
    cache_file = Path(cache_file)
    cache = _load_cache(cache_file)
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    keys = [_key(fingerprint, ids, settings) for ids in prompt_ids]
    todo = sorted({k: ids for k, ids in zip(keys, prompt_ids) if k not in cache}.items(), key=lambda kv: len(kv[1]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_ids(model)[0]
    torch.manual_seed(settings.seed)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="self-distill", disable=not progress or not todo)
    with cache_file.open("a") as sink:
        for start in range(0, len(todo), settings.batch_size):
            chunk = todo[start:start + settings.batch_size]  # similar lengths together: little padding
            for (key, _), response in zip(chunk, generate_batch(model, [ids for _, ids in chunk], pad_id, settings)):
                cache[key] = response
                sink.write(json.dumps({"key": key, "response_ids": response}) + "\n")
            sink.flush()
            bar.update(len(chunk))
    bar.close()
    return [Conversation(ids, cache[key]) for ids, key in zip(prompt_ids, keys)]

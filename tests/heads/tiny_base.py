"""A tiny random Llama + character-level tokenizer saved to disk, so scripts can load it by path (no network)."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import tiny_model

SPECIALS = ["<pad>", "<unk>", "<eos>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character; ids 0..2 are pad/unk/eos (matching tiny_models' special ids)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(string.printable) - set("\x0b\x0c")))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_base(directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Llama (vocab = the char tokenizer's) and its tokenizer to ``directory``."""
    directory = Path(directory)
    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_corpus(path: str | Path, lines: int = 64) -> Path:
    """A small, learnable text corpus: repeated counting sentences, one paragraph each."""
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    rows = [" ".join(words[(i + j) % len(words)] for j in range(12)) for i in range(lines)]
    Path(path).write_text("\n\n".join(rows) + "\n")
    return Path(path)




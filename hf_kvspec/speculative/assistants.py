"""Build an assistant from a short spec string (the CLI's ``--assistant`` and the benchmarks).

Boundary: maps names to drafter constructors; knows nothing about the decode loop.

    ngram                   NgramAssistant(max_ngram=3)
    draft:<dir>             DraftModelAssistant(AutoModelForCausalLM.from_pretrained(<dir>)): a causal LM directory
                            with the target's tokenizer
    draft:truncated:<N>     DraftModelAssistant(truncated_draft(target, N)): the target's first N layers + final
                            norm + LM head (the stand-in until a trained drafter exists)
"""

from __future__ import annotations

from pathlib import Path

ASSISTANT_HELP = "ngram | draft:<causal LM dir> | draft:truncated:<N layers of the target>"


def make_assistant(spec: str, target, num_draft_tokens: int | str = 4):
    """The drafter named by ``spec`` for ``target``; ``num_draft_tokens`` is K or ``"auto"``."""
    from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
    from hf_kvspec.speculative.drafters.ngram import NgramAssistant

    if spec == "ngram":
        return NgramAssistant(max_ngram=3, num_draft_tokens=num_draft_tokens)
    if spec.startswith("draft:truncated:"):
        from hf_kvspec.speculative.drafters.truncated import truncated_draft

        layers = spec.removeprefix("draft:truncated:")
        if not layers.isdigit():
            raise ValueError(f"draft:truncated:<N> needs a layer count, got {spec!r}")
        return DraftModelAssistant(truncated_draft(target, int(layers)), num_draft_tokens=num_draft_tokens)
    if spec.startswith("draft:"):
        return DraftModelAssistant(_load_draft(Path(spec.removeprefix("draft:")), target),
                                   num_draft_tokens=num_draft_tokens)
    raise ValueError(f"Unknown assistant {spec!r}; use {ASSISTANT_HELP}")


def parse_num_draft_tokens(value: str) -> int | str:
    """``"auto"`` or a non-negative int (argparse ``type=``)."""
    if value == "auto":
        return value
    if not value.isdigit():
        raise ValueError(f"--num-draft-tokens takes an int or 'auto', got {value!r}")
    return int(value)


def _load_draft(path: Path, target):
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ValueError(f"draft:{path}: not a model directory (no config.json); save one with save_pretrained()")
    return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()

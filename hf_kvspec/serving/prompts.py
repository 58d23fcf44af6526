"""Turning what a caller hands ``Engine.add_request`` into token ids and ``SamplingSettings``.

Boundary: the only serving module that touches the tokenizer for input (chat templates, plain text) or reads a
``GenerationConfig``; the engine itself works on token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .request import SamplingSettings

Prompt = Sequence[int] | torch.Tensor | str | Sequence[Mapping[str, str]]


#: a sampled request's temperature below this decodes greedily: dividing fp32 scores by less overflows them to
#: inf (NaN probabilities) for large enough logits, and the distribution is the argmax anyway (vLLM's
#: ``_SAMPLING_EPS`` = 1e-5 makes the same call)
GREEDY_BELOW_TEMPERATURE = 1e-5


def prompt_ids(prompt: Prompt, tokenizer, vocab_size: int | None = None) -> list[int]:
    """Token ids of a prompt: ids (list or 1-D tensor), chat messages (``[{"role", "content"}, ...]``, rendered
    with the tokenizer's chat template and a generation prompt) or plain text. ``vocab_size``: ids must be below it
    (an id past the model's embedding table would fail every round it takes part in)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1:
            raise ValueError(f"A tensor prompt must be 1-D token ids, got shape {tuple(prompt.shape)}; pass one "
                             "request per add_request call.")
        ids = prompt.tolist()
    elif isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)):
        ids = _tokenize(prompt, _need_tokenizer(tokenizer, prompt))
    else:
        ids = list(prompt)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("A prompt needs at least one token id, and ids must be non-negative integers.")
    check_vocabulary("prompt", ids, vocab_size)
    return ids


def check_vocabulary(name: str, ids: Sequence[int], vocab_size: int | None) -> None:
    """Every id of ``ids`` is below ``vocab_size`` (no check when it is None), else a ValueError naming ``name``."""
    if vocab_size is None:
        return
    outside = sorted({t for t in ids if t >= vocab_size})
    if outside:
        raise ValueError(f"{name} has token id(s) {outside[:5]} outside the model's vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1}); check the tokenizer matches the model.")


def _need_tokenizer(tokenizer, prompt):
    if tokenizer is None:
        kind = "text" if isinstance(prompt, str) else "chat messages"
        raise ValueError(f"A {kind} prompt needs a tokenizer: Engine(model, tokenizer, ...), or pass token ids.")
    return tokenizer


def _tokenize(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def eos_ids(eos_token_id, generation_config) -> tuple[int, ...]:
    """The request's end-of-sequence ids: the given int / list, else the model's ``generation_config``'s."""
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, (int, Sequence, torch.Tensor)):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}.")
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def settings_from_generation_config(generation_config) -> dict:
    """``add_request`` keyword arguments equivalent to a ``GenerationConfig`` (the fields the engine honours)."""
    fields = {
        "max_new_tokens": generation_config.max_new_tokens,
        "do_sample": generation_config.do_sample,
        "temperature": generation_config.temperature,
        "top_p": generation_config.top_p,
        "top_k": generation_config.top_k,
        "eos_token_id": generation_config.eos_token_id,
        "stop_strings": generation_config.stop_strings,
    }
    return {name: value for name, value in fields.items() if value is not None}


def _underflows(temperature) -> bool:
    return isinstance(temperature, (int, float)) and 0 < temperature < GREEDY_BELOW_TEMPERATURE


def make_settings(generation_config, **kwargs) -> SamplingSettings:
    """``SamplingSettings`` from ``add_request``'s keyword arguments, defaults filled from the model."""
    stop = kwargs.pop("stop_strings", None) or ()
    processors = kwargs.pop("logits_processor", None) or ()
    if isinstance(processors, Callable) and not isinstance(processors, Sequence):
        processors = (processors,)
    if not isinstance(stop, (str, Sequence)) or not isinstance(processors, Sequence):
        raise ValueError(f"stop_strings must be a string or a list of strings, logits_processor a list of callables;"
                         f" got {stop!r} and {processors!r}.")
    if kwargs.get("do_sample") is True and _underflows(kwargs.get("temperature")):
        kwargs["do_sample"] = False  # greedy: see GREEDY_BELOW_TEMPERATURE
    return SamplingSettings(
        eos_token_id=eos_ids(kwargs.pop("eos_token_id", None), generation_config),
        stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
        logits_processor=tuple(processors),
        **kwargs,
    )

"""``hf_kvspec.enable(model)`` / ``hf_kvspec.disable(model)``: ``model.generate(ids, assistant=A)`` without
passing ``custom_generate`` each time.

Boundary: wraps one model instance's ``generate`` (an instance attribute, so other instances and the class are
untouched) and restores it. Without ``assistant=`` the wrapped call is stock ``generate``, argument for
argument. Everything else goes through ``generate(custom_generate=speculative_generate)``.

Stop strings: ``generate`` refuses ``stop_strings`` without a tokenizer and drops ``tokenizer`` before calling a
``custom_generate`` function, so the wrapper turns ``stop_strings`` + ``tokenizer`` into a
``StopStringCriteria`` itself (the same criterion ``generate`` would build).
"""

from __future__ import annotations

import copy
import functools

from transformers import StoppingCriteriaList, StopStringCriteria

_MARK = "__hf_kvspec_original__"


def enable(model):
    """Let ``model.generate`` take ``assistant=``; idempotent. Returns ``model``."""
    if is_enabled(model, "enable"):
        return model
    original = model.generate

    @functools.wraps(original)
    def generate(*args, assistant=None, **kwargs):
        if assistant is None:
            return original(*args, **kwargs)
        from hf_kvspec.speculative.loop import speculative_generate

        if kwargs.get("custom_generate") is not None:
            raise ValueError("generate(assistant=...) on a model after hf_kvspec.enable() runs speculative_generate "
                             "already; drop custom_generate= (or call hf_kvspec.disable(model) to pass your own).")

        kwargs = _stop_strings_as_criteria(kwargs)
        return original(*args, custom_generate=speculative_generate, assistant=assistant, **kwargs)

    setattr(generate, _MARK, original)
    model.generate = generate
    return model


def disable(model):
    """Undo ``enable(model)``; a no-op when it was not enabled. Returns ``model``."""
    if is_enabled(model, "disable"):
        del model.generate  # the class's generate shows through again
    return model


def is_enabled(model, caller: str = "is_enabled") -> bool:
    if not (callable(getattr(model, "generate", None)) and hasattr(model, "__dict__")):
        raise TypeError(f"{caller}() needs a loaded transformers model (one with .generate), got "
                        f"{type(model).__name__}; pass the model itself, not its config or a path.")
    return hasattr(vars(model).get("generate"), _MARK)


def _stop_strings_as_criteria(kwargs: dict) -> dict:
    stop_strings = kwargs.get("stop_strings")
    if stop_strings is None and kwargs.get("generation_config") is not None:
        stop_strings = getattr(kwargs["generation_config"], "stop_strings", None)
    if not stop_strings:
        return kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: generate(..., stop_strings=[...], tokenizer=tokenizer)")
    kwargs = dict(kwargs)
    kwargs.pop("stop_strings", None)
    kwargs.pop("tokenizer")
    if getattr(kwargs.get("generation_config"), "stop_strings", None):
        kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])  # never edit the caller's config
        kwargs["generation_config"].stop_strings = None
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    return kwargs

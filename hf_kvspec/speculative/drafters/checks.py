"""Construction-time checks shared by the drafters: what an assistant can refuse before any forward, with the fix
named in the message.

Boundary: reads constructor arguments and a head's config; runs no model and keeps no state. Each assistant calls
these from ``__init__`` (what the arguments alone decide) or from ``check_target`` (what needs the target and the
call's cache, still before the prefill).
"""

from __future__ import annotations

from hf_kvspec.speculative.autok import is_count

_HEAD_KINDS = {  # assistant -> (head class name, module, how to get one, the assistant a wrong head belongs to)
    "MedusaAssistant": ("MedusaHeads", "hf_kvspec.heads.modeling_medusa", "hf_kvspec.load_bundled_heads('medusa')"),
    "EagleAssistant": ("EagleHead", "hf_kvspec.heads.modeling_eagle", "hf_kvspec.load_bundled_heads('eagle')"),
}
_OTHER = {"MedusaHeads": "MedusaAssistant(heads)", "EagleHead": "EagleAssistant(head)"}


def require_count(name: str, value, minimum: int = 1) -> None:
    """``value`` is an int >= ``minimum`` (not a bool, not a float)."""
    if not is_count(value, minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def require_head(assistant: str, head) -> None:
    """``head`` is the draft head class ``assistant`` drafts with, else a ``TypeError`` naming what to pass."""
    import importlib

    cls_name, module, how = _HEAD_KINDS[assistant]
    if isinstance(head, getattr(importlib.import_module(module), cls_name)):
        return
    got = type(head).__name__
    hint = (f" {got} drafts through {_OTHER[got]}." if got in _OTHER
            else " The target model goes to generate(); the assistant takes the trained draft head."
            if hasattr(head, "generate") else "")
    raise TypeError(f"{assistant} needs {cls_name} (e.g. {how} or {cls_name}.from_pretrained(path)), got {got}.{hint}")


def scored_tokens(head, vocab) -> int:
    """How many tokens a head ranks per step: the draft vocabulary's (``draft_vocab_size=``), the head's own
    trained one (``config.draft_vocab_size``), or the target's whole vocabulary."""
    if vocab is not None:
        return vocab.size
    if getattr(head, "has_draft_vocab", False):
        return int(head.config.draft_vocab_size)
    return int(head.config.base_vocab_size)


def require_rank_fits(what: str, needed: int, head, vocab, fix: str) -> None:
    """A tree that ranks ``needed`` tokens per step fits the ``scored_tokens`` the head ranks, else a
    ``ValueError`` naming ``fix``."""
    scored = scored_tokens(head, vocab)
    if needed > scored:
        source = ("draft_vocab_size" if vocab is not None else "the head's trained draft vocabulary"
                  if getattr(head, "has_draft_vocab", False) else "the vocabulary")
        raise ValueError(f"{what} asks for the top {needed} tokens per step, but the drafter scores only {scored} "
                         f"({source}); {fix}.")

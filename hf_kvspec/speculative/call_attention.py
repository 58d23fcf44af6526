"""The target's attention for the length of one speculative call: grouped-query attention without copies.

Boundary: decides whether a speculative ``generate`` call switches the target from transformers' ``sdpa`` to
``kvspec_gqa`` (``hf_kvspec.attention.gqa``) and scopes that switch to the call. It never changes the cache, the
mask or the math the target computes; the loop asks it once per call.

Why: with a mask and more than one query token (every verify forward: root + drafts under the buffer's mask),
transformers' sdpa path on CPU copies K and V ``G = heads / kv_heads`` times (``repeat_kv``) in every layer. Over a
long context that copy is the verify forward's largest cost (SmolLM2-135M, G = 3, 4k tokens x 4 rows: a 5-token
verify forward costs about 7 one-token steps under sdpa and about 1.6 under ``kvspec_gqa``, figures in
``docs/long_context.md``), which makes any drafter lose there. ``kvspec_gqa`` is the same SDPA call with the G
query heads of a group folded onto their shared K/V head, so it reads each K/V head once.

Rule (``switch_applies``): on when the target runs ``sdpa`` and has grouped heads (G > 1); the switch lasts for
the call and is undone in ``finally``. Other implementations are left alone: ``eager`` is a different summation
order again, flash kernels take no tree mask, hf_kvspec's own already read grouped K/V once.

An assistant that drafts through an attention of its own declares it (``Assistant.call_attention``:
``SparseKVAssistant(view="quantized")`` reads its codes through ``kvspec_quant``, which is ``kvspec_gqa`` over
any other cache); the call then switches to that one instead, from whatever the target runs.

Reference: ``generate(..., call_attention=False)`` keeps the target's attention. The two differ only in
floating-point summation order (``tests/speculative/test_call_attention.py`` checks greedy outputs equal plain
``generate`` under sdpa with the switch on and off).

Thread note: the switch is the model's attention implementation (``model.set_attn_implementation``), so another
thread running the same model during the call runs ``kvspec_gqa`` too: the same attention, in another summation
order.
"""

from __future__ import annotations

import contextlib

from hf_kvspec import _compat
from hf_kvspec.memory import num_kv_heads

SWITCHED_FROM = "sdpa"
GQA_NAME = "kvspec_gqa"  # hf_kvspec.attention.gqa.ATTN_NAME (not imported here: that module imports transformers'
#                          attention registries, needed only when a call switches)


def switch_applies(model) -> bool:
    """Whether a call on ``model`` switches to ``kvspec_gqa``: it runs ``sdpa`` with grouped heads (G > 1)."""
    config = model.config
    if _compat.attn_implementation(config) != SWITCHED_FROM:
        return False
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    heads = getattr(text, "num_attention_heads", None)
    return heads is not None and num_kv_heads(text) < int(heads)


def _enable(name: str):
    """The ``enable_*`` function that switches a model to hf_kvspec's attention ``name``."""
    if name == GQA_NAME:
        from hf_kvspec.attention.gqa import enable_gqa

        return enable_gqa
    if name == "kvspec_quant":
        from hf_kvspec.attention.quantized import enable_quantized_attention

        return enable_quantized_attention
    raise ValueError(f"an assistant asked for call attention {name!r}; hf_kvspec switches to {GQA_NAME!r} or "
                     "'kvspec_quant' only.")


@contextlib.contextmanager
def call_attention(model, enabled: bool | None = None, wanted: str | None = None):
    """The block runs ``model`` on ``wanted`` (an assistant's declared attention), else on ``kvspec_gqa`` when
    ``enabled`` (None: ``switch_applies(model)``); yields the name switched to, or None. ``enabled=False`` switches
    nothing; ``enabled=True`` on a model the rule leaves alone (and no ``wanted``) is refused, naming why."""
    current = _compat.attn_implementation(model.config)
    if wanted is not None and enabled is not False:
        if current == wanted:
            yield None
            return
        with _switched(model, wanted):
            yield wanted
        return
    if enabled is None:
        enabled = switch_applies(model)
    elif enabled and not switch_applies(model):
        raise ValueError(f"call_attention=True switches sdpa to kvspec_gqa for models with grouped heads; this "
                         f"target runs {_compat.attn_implementation(model.config)!r}"
                         f"{'' if _compat.attn_implementation(model.config) != SWITCHED_FROM else ' without groups'}"
                         ". Leave call_attention unset (None).")
    if not enabled:
        yield None
        return
    with _switched(model, GQA_NAME):
        yield GQA_NAME


@contextlib.contextmanager
def _switched(model, name: str):
    patch = _enable(name)(model)
    try:
        yield
    finally:
        patch.remove()

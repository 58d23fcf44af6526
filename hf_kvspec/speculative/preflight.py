"""What a speculative ``generate`` call must satisfy before its first forward, checked up front with errors that
name the fix.

Boundary: reads the model's config, the assistant's declared capabilities (``drafters.base.Assistant``) and the
cache's (``cache.contract``); refuses what the loop cannot do exactly, and picks the call's target forward
(``call_forward``) before anything is packed. No forwards, no state.
"""

from __future__ import annotations

from transformers import DynamicCache

from hf_kvspec import _compat
from hf_kvspec.speculative.drafters.base import Assistant, releases_rows
from hf_kvspec.speculative.rollback import check_cache, prepare_for_rollback
from hf_kvspec.speculative.rounds import check_tree_attention

# generate's model kwargs the loop consumes itself (it computes masks and positions per round)
HANDLED_KWARGS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"}


def check_entry(assistant, logits_processor, stopping_criteria, generation_config) -> None:
    """``speculative_generate`` is ``generate``'s decoding loop: ``generate`` builds these three arguments (the
    assistant may be None: plain decoding through the loop)."""
    missing = [name for name, value in (("logits_processor", logits_processor), ("stopping_criteria",
               stopping_criteria), ("generation_config", generation_config)) if value is None]
    if missing:
        raise TypeError(f"speculative_generate got {' / '.join(missing)} = None: it is generate's decoding loop, "
                        "called as model.generate(input_ids, custom_generate=hf_kvspec.speculative_generate, "
                        "assistant=..., max_new_tokens=...), which builds them.")


def check_inputs(model, assistant, generation_config) -> None:
    """The call's model, assistant and generation settings."""
    if not isinstance(assistant, Assistant):
        raise TypeError(f"assistant must be an hf_kvspec Assistant (DraftModelAssistant, NgramAssistant, ...), got "
                        f"{type(assistant).__name__}. For a bare draft model use DraftModelAssistant(model).")
    if model.config.is_encoder_decoder:
        raise NotImplementedError("speculative_generate supports decoder-only models.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("speculative_generate does not do beam search; use num_beams=1.")


def check_kwargs(model_kwargs: dict) -> None:
    unknown = {k for k, v in model_kwargs.items() if v is not None and k not in HANDLED_KWARGS}
    if unknown:
        raise ValueError(f"speculative_generate does not forward these generate kwargs to the model: "
                         f"{sorted(unknown)}. Pass input_ids/attention_mask (decoder-only text models).")


def check_call(model, cache, assistant: Assistant, batch: int, max_length: int | None = None) -> bool:
    """Before any forward: the cache rolls back, keeps a tree's path of up to ``max_draft_tokens`` nodes (+ the
    root) when the assistant proposes trees, crops layer ranges when it drafts on the target's own cache, has room
    for the last round (``check_room``); sliding windows only at batch 1 and never with trees; the assistant's own
    checks (``Assistant.check_target``). Returns whether the cache has sliding-window layers."""
    trees = assistant.proposes_trees
    check_room(cache, assistant, max_length)
    if trees:  # the model's own sliding windows first: the advice is a chain, not a cache call
        check_tree_support(model, False)
    check_cache(cache, keep_positions=trees, per_layer=assistant.shares_target_cache,
                segment=assistant.max_draft_tokens + 1 if trees else None)
    assistant.check_target(model, cache)
    sliding = prepare_for_rollback(cache)
    if batch > 1 and (sliding or has_sliding_layers(model.config)):
        raise NotImplementedError(
            "speculative_generate with batch size > 1 does not support sliding-window attention layers: rows "
            "that accept fewer draft tokens keep masked slots, which would shift each row's window. Run the "
            "rows one at a time (batch size 1).")
    if trees:
        check_tree_support(model, sliding)
    return sliding


def check_room(cache, assistant: Assistant, max_length: int | None) -> None:
    """A cache of fixed size (``get_max_length() > 0``, e.g. ``StaticCache``) holds the last round: before it up to
    ``max_length - 1`` committed columns, then the root and the drafts. A chain is cut to the tokens left, so it needs
    what plain decoding needs; a tree keeps its width (up to ``max_draft_tokens`` nodes) near the end."""
    if cache is None or max_length is None:
        return
    sizes = [layer.get_max_length() for layer in getattr(cache, "layers", ())
             if not getattr(layer, "is_sliding", False)]  # a sliding layer's size is its window, not a limit
    size = min((s for s in sizes if s is not None and s > 0), default=0)
    if size <= 0:
        return
    nodes = assistant.max_draft_tokens if assistant.proposes_trees else 0
    needed = max_length - 1 + nodes
    if size < needed:
        tree = (f" plus a tree round's {nodes} nodes (a smaller tree: EAGLE's total_tokens=, a shorter choice "
                "list, tree='chain')" if nodes else "")
        raise ValueError(f"the {type(cache).__name__} holds {size} positions, but this call needs {needed}: up to "
                         f"max_length - 1 = {max_length - 1} committed tokens{tree}. Build it with "
                         f"max_cache_len >= {needed}, or pass fewer max_new_tokens.")


def check_tree_support(model, sliding: bool) -> None:
    """Trees need a custom 4D mask through the target's attention and no sliding windows (the mask replaces them)."""
    check_tree_attention(_compat.attn_implementation(model.config))
    if sliding or has_sliding_layers(model.config):
        raise NotImplementedError("tree verification does not support sliding-window attention layers: the tree's "
                                  "4D mask would replace the window. Use a chain drafter (e.g. tree='chain').")


def has_sliding_layers(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any("sliding" in str(kind) for kind in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def rows_may_leave(cache, assistant: Assistant) -> bool:
    """Finished rows may leave the batch (``rows.py``) only from a plain ``DynamicCache`` that ``generate`` made for
    this call (a caller's cache keeps its rows; ``generate`` keeps static caches on the model for later calls;
    offloading layers prefetch across calls' layers) and with an assistant that releases rows (``releases_rows``)."""
    if not releases_rows(assistant):
        return False
    if cache is None:  # the prefill creates a DynamicCache
        return True
    return (type(cache) is DynamicCache and not getattr(cache, "offloading", False)
            and not _compat.cache_is_user_defined(cache)
            and all(callable(getattr(layer, "batch_select_indices", None)) for layer in cache.layers))


def call_forward(model, assistant: Assistant, cache, fast: bool | None):
    """The call's target forward (``hf_kvspec.forward.choose_forward``): the fast forward unless ``fast`` is False,
    it does not apply to the model or the caller's cache (a ``ValueError`` naming why when ``fast`` is True), or
    the assistant runs the target's layers itself."""
    from hf_kvspec.forward.runner import FastForward, choose_forward

    blocked = None  # decided before anything is packed: a call that cannot use the copies never makes them
    if not FastForward.supports(cache):
        blocked = (f"fast_forward=True runs on a DynamicCache (or none); got {type(cache).__name__}. Drop cache= "
                   "or pass fast_forward=None (the reference forward for this cache).")
    elif assistant.runs_verify_forward:
        blocked = (f"fast_forward=True: {type(assistant).__name__} runs the target's layers itself "
                   "(self-speculation); pass fast_forward=None or False.")
    if blocked is not None and fast is True:
        raise ValueError(blocked)
    return choose_forward(model, False if blocked is not None and fast is None else fast)

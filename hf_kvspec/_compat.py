"""The only module that touches transformers' private names (underscore attributes, internal helpers).

Boundary: thin wrappers, one per private name or piece of private knowledge, and the version gate; no logic of
hf_kvspec's own. Callers (caches, attention patches, the speculative loop, draft heads) import these helpers
and never a transformers private name directly.

Tested with transformers >=5.24,<6 (pyproject pins the same range). Each helper below names the private
API it wraps; tests/test_compat.py holds a canary per private name that fails loudly when transformers
changes under it (the name moved, or no longer behaves as relied on here).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import transformers
from packaging.version import Version

TESTED_RANGE = (Version("5.24"), Version("6"))
TRANSFORMERS_VERSION = Version(transformers.__version__)


def check_transformers_version() -> None:
    """Raise ``RuntimeError`` outside the tested range, naming the install command."""
    low, high = TESTED_RANGE
    if not (low <= Version(TRANSFORMERS_VERSION.base_version) < high):
        raise RuntimeError(
            f"hf_kvspec is tested with transformers >={low},<{high}; found {TRANSFORMERS_VERSION}. "
            f"Install a tested version: pip install 'transformers>={low},<{high}'"
        )


# --- draft heads (hf_kvspec.heads) ---------------------------------------------------------------------------------

def decoder_layer_class(config) -> type:
    """The base architecture's own decoder-layer class (e.g. ``LlamaDecoderLayer``) for ``config.model_type``.

    Private: reads ``PreTrainedModel._no_split_modules``, where every transformers model names its decoder layer.
    """
    import importlib

    from transformers import MODEL_MAPPING

    model_class = MODEL_MAPPING[type(config)]
    names = getattr(model_class, "_no_split_modules", None) or []
    module = importlib.import_module(model_class.__module__)
    for name in names:
        if name.endswith("DecoderLayer") and hasattr(module, name):
            return getattr(module, name)
    raise NotImplementedError(f"Cannot find the decoder-layer class of {config.model_type!r} "
                              f"({model_class.__name__}._no_split_modules = {names}).")


def rotary_embedding_class(config) -> type:
    """The base architecture's rotary-embedding class (``<Prefix>RotaryEmbedding`` next to its model class)."""
    import importlib

    from transformers import MODEL_MAPPING

    model_class = MODEL_MAPPING[type(config)]
    module = importlib.import_module(model_class.__module__)
    name = model_class.__name__.removesuffix("Model") + "RotaryEmbedding"
    if not hasattr(module, name):
        raise NotImplementedError(f"{config.model_type!r} has no {name}; EAGLE drafters need a RoPE architecture.")
    return getattr(module, name)


def unregister_auto_config(model_type: str) -> None:
    """Undo ``AutoConfig.register(model_type, ...)``. Private: ``CONFIG_MAPPING._extra_content``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING._extra_content.pop(model_type, None)


def unregister_auto_model(auto_class, config_class) -> None:
    """Undo ``auto_class.register(config_class, ...)``. Private: ``_model_mapping._extra_content``."""
    auto_class._model_mapping._extra_content.pop(config_class, None)


# --- attention patches (hf_kvspec.attention) -----------------------------------------------------------------------

def attn_implementation(config) -> str | None:
    """The attention implementation a loaded model dispatches to. Private: ``config._attn_implementation``."""
    return getattr(config, "_attn_implementation", None)


def attention_entries(name: str) -> tuple[object | None, object | None]:
    """``(attention function, mask function)`` globally registered under ``name``, or ``None`` each.

    Private: ``AttentionInterface._global_mapping`` / ``AttentionMaskInterface._global_mapping``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionInterface._global_mapping.get(name), AttentionMaskInterface._global_mapping.get(name)


def restore_attention_entries(name: str, function: object | None, mask_function: object | None) -> None:
    """Put back what ``attention_entries(name)`` returned; ``None`` deletes the entry (no public unregister)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for mapping, value in ((AttentionInterface._global_mapping, function),
                           (AttentionMaskInterface._global_mapping, mask_function)):
        if value is None:
            mapping.pop(name, None)
        else:
            mapping[name] = value


def generate_call_streamer():
    """The ``streamer`` passed to the enclosing ``GenerationMixin.generate`` call, or ``None``.

    transformers 5.24 ``generate(custom_generate=fn)`` puts the prompt into the streamer but does not pass the
    streamer on to ``fn`` (``_extract_generation_mode_kwargs`` keeps only ``fn``'s extra parameters). The
    speculative loop reads it back from ``generate``'s frame; tests/speculative check that streaming still works.
    """
    import inspect

    from transformers.generation.utils import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("streamer")
            frame = frame.f_back
        return None
    finally:
        del frame  # break the reference cycle through the frame


def generation_pad_token_id(generation_config) -> int:
    """The pad id ``generate`` settled on (``GenerationConfig._pad_token_tensor``, set by
    ``_prepare_special_tokens``: falls back to the EOS id), else ``pad_token_id``, else 0."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.reshape(-1)[0])
    return int(generation_config.pad_token_id or 0)


def cache_is_user_defined(cache) -> bool:
    """Whether ``generate`` received ``cache`` from its caller (transformers 5.24 ``_prepare_cache_for_generation``
    marks such caches ``_is_user_defined``) rather than creating it for this call."""
    return bool(getattr(cache, "_is_user_defined", False))


#: Logits processors whose output depends on the scores only, never on ``input_ids`` or its length (read from the
#: transformers 5.24 sources; tests/test_compat.py feeds each two different histories). The speculative loop
#: applies these once to all positions of a round and calls every other processor once per prefix length.
_SCORE_ONLY_PROCESSORS = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TopHLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "InfNanRemoveLogitsProcessor",
    "LogitNormalization", "SuppressTokensLogitsProcessor",
)


def score_only_processor_classes() -> tuple[type, ...]:
    """The installed classes among ``_SCORE_ONLY_PROCESSORS``.

    Private knowledge: how each processor uses its arguments is not part of its API. A name missing here is
    treated as path-dependent (called per prefix length): always correct, only slower.
    """
    return tuple(getattr(transformers, name) for name in _SCORE_ONLY_PROCESSORS if hasattr(transformers, name))


def eos_criterion_ids(criterion):
    """The EOS ids ``[E]`` an ``EosTokenCriteria`` stops on, else ``None``.

    Private: its ``eos_token_id`` attribute (a tensor; the constructor also takes an int or a list).
    """
    if isinstance(criterion, transformers.EosTokenCriteria):
        return criterion.eos_token_id.reshape(-1)
    return None


def max_length_criterion_limit(criterion) -> int | None:
    """The length at which a ``MaxLengthCriteria`` stops a row (prompt included), else ``None``.

    Private: its ``max_length`` attribute.
    """
    if isinstance(criterion, transformers.MaxLengthCriteria):
        return int(criterion.max_length)
    return None


# --- MLA absorb (hf_kvspec.attention.mla_weights) -----------------------------------------------------------------

def modeling_function(model_class: type, name: str):
    """A module-level function (e.g. ``apply_rotary_pos_emb``) of the modeling file that defines ``model_class``.

    Private: modeling files' helpers are not exported; MLA absorb uses the attention's own RoPE helper so its
    rotations match the stock forward bit for bit.
    """
    import importlib

    module = importlib.import_module(model_class.__module__)
    function = getattr(module, name, None)
    if not callable(function):
        raise NotImplementedError(f"{module.__name__} has no function {name!r} (hf_kvspec is tested with "
                                  f"transformers >={TESTED_RANGE[0]},<{TESTED_RANGE[1]}).")
    return function


# --- caches (hf_kvspec.cache) ---------------------------------------------------------------------------------------

def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Per-layer attention types (``"full_attention"``, ``"sliding_attention"``, ...) and the keyword arguments
    transformers would build each cache layer with (e.g. ``sliding_window``).

    Private: ``transformers.cache_utils.get_layer_types_and_kwargs`` (not exported).
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(config)


# transformers' own cache layers hf_kvspec edits in place (``cache.contract.keep_positions``): after the contract
# rewrote a layer's public ``keys`` / ``values``, these set the layer's private token count. One entry per class,
# exact types only (a subclass may carry state hf_kvspec would not edit); the table is the one place that says
# which of transformers' layers the contract can crop per layer and keep positions in.

def _dynamic_length(layer, length: int) -> None:
    """``DynamicLayer``: its length is ``keys.shape[2]``, nothing else to set."""


def _dynamic_sliding_length(layer, length: int) -> None:
    """``DynamicSlidingWindowLayer``. Private: ``cumulative_length`` (an int: every token seen), and the rule that
    ``keys`` hold only the last ``sliding_window - 1`` tokens unless ``record_past`` (``activate_past_recording``)."""
    layer.cumulative_length = length
    keep = layer.sliding_window - 1
    if not layer.record_past and layer.keys.shape[2] > keep:
        layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]


def _static_length(layer, length: int) -> None:
    """``StaticLayer``. Private: ``cumulative_length``, a 0-d tensor updated in place (a static address for
    torch.compile); the slots past it are stale, as after ``StaticLayer.crop``."""
    layer.cumulative_length.fill_(length)


def _static_sliding_length(layer, length: int) -> None:
    """``StaticSlidingWindowLayer``: as ``StaticLayer``, plus its int mirror ``cumulative_length_int`` (private)."""
    _static_length(layer, length)
    layer.cumulative_length_int = length


@functools.cache
def _layer_length_setters() -> dict[type, Callable[[object, int], None]]:
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    )

    return {DynamicLayer: _dynamic_length, DynamicSlidingWindowLayer: _dynamic_sliding_length,
            StaticLayer: _static_length, StaticSlidingWindowLayer: _static_sliding_length}


def editable_layer_types() -> tuple[type, ...]:
    """transformers' layer classes whose length ``set_layer_length`` can set (exact types)."""
    return tuple(_layer_length_setters())


def set_layer_length(layer, length: int) -> None:
    """Make a transformers cache layer hold ``length`` tokens after its ``keys`` / ``values`` were rewritten (the
    first ``length`` positions already hold the kept states). Only for ``editable_layer_types()``."""
    _layer_length_setters()[type(layer)](layer, length)


def sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention function (what ``attn_implementation="sdpa"`` dispatches to).

    Private: ``transformers.integrations.sdpa_attention.sdpa_attention_forward``; the public route,
    ``AttentionInterface()["sdpa"]``, returns the same function (checked by a canary test).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as forward

    return forward(module, query, key, value, attention_mask, **kwargs)


# --- self-speculation (hf_kvspec.speculative.partial_forward) -------------------------------------------------------

#: Architectures whose decoder runs as ``embed -> layers -> norm -> lm_head`` with no embedding scale, one rotary
#: module shared by all layers and full attention in every layer (read from the transformers 5.24 modeling files).
#: Gemma (scaled embeddings, soft-capping), sliding-window layers and MLA models are refused by name.
SELF_SPECULATION_MODEL_TYPES = ("llama", "qwen2", "mistral")


def decoder_stack(model):
    """``(embed_tokens, layers, rotary_emb, norm)`` of a supported causal LM, for running its layers one by one.

    Private knowledge: where each architecture keeps its decoder pieces (``model.model.layers`` etc.) and that
    these architectures apply no embedding scale and no extra per-layer inputs besides the shared rotary
    ``position_embeddings``. Refuses other architectures and sliding-window layers by name."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SELF_SPECULATION_MODEL_TYPES:
        raise NotImplementedError(
            f"self-speculative drafting (EarlyExitAssistant, LayerSkipAssistant) supports "
            f"{', '.join(SELF_SPECULATION_MODEL_TYPES)}; got model_type={model_type!r}. Use DraftModelAssistant or "
            f"NgramAssistant for this model.")
    layer_types, _ = layer_types_and_kwargs(model.config)
    if any("sliding" in str(kind) for kind in layer_types):
        raise NotImplementedError(
            f"self-speculative drafting builds explicit full-attention masks; this {model_type} config has "
            f"sliding-window layers ({sorted(set(layer_types))}). Load it with sliding_window=None / "
            f"use_sliding_window=False if the context fits the window, or use DraftModelAssistant.")
    decoder = model.model
    return decoder.embed_tokens, decoder.layers, decoder.rotary_emb, decoder.norm

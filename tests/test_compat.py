"""Canaries for every private transformers name in ``hf_kvspec/_compat.py``.

Each test checks that the private thing still exists *and* still behaves the way the helper relies on, so an
upgrade of transformers that moves or changes it fails here, by name, instead of silently changing what a cache,
attention patch or the speculative loop does. The tests use only tiny random models (CPU, a few seconds).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    EosTokenCriteria,
    LlamaConfig,
    MaxLengthCriteria,
    MistralConfig,
    PretrainedConfig,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
)

from hf_kvspec import _compat
from hf_kvspec.attention.mla_weights import SUPPORTED_ATTENTION
from tests.tiny_models import tiny_config, tiny_model


def test_installed_transformers_is_in_the_tested_range():
    _compat.check_transformers_version()  # raises outside TESTED_RANGE


# --- draft heads ------------------------------------------------------------------------------------------------

def test_decoder_layer_and_rotary_classes_of_llama():
    from transformers.models.llama import modeling_llama

    config = tiny_config("llama")
    assert _compat.decoder_layer_class(config) is modeling_llama.LlamaDecoderLayer
    assert _compat.rotary_embedding_class(config) is modeling_llama.LlamaRotaryEmbedding


class _CanaryConfig(PretrainedConfig):
    model_type = "hf_kvspec_compat_canary"


def test_unregister_auto_config_and_model_undo_register():
    """``register`` writes into ``_extra_content`` mappings; removing the entries undoes it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert isinstance(CONFIG_MAPPING._extra_content, dict)
    assert isinstance(AutoModelForCausalLM._model_mapping._extra_content, dict)
    model_class = type("CanaryModel", (transformers.PreTrainedModel,), {"config_class": _CanaryConfig})
    AutoConfig.register(_CanaryConfig.model_type, _CanaryConfig)
    AutoModelForCausalLM.register(_CanaryConfig, model_class)
    try:
        assert isinstance(AutoConfig.for_model(_CanaryConfig.model_type), _CanaryConfig)
        assert AutoModelForCausalLM._model_mapping[_CanaryConfig] is model_class
    finally:
        _compat.unregister_auto_model(AutoModelForCausalLM, _CanaryConfig)
        _compat.unregister_auto_config(_CanaryConfig.model_type)
    with pytest.raises(ValueError):
        AutoConfig.for_model(_CanaryConfig.model_type)
    with pytest.raises(KeyError):
        AutoModelForCausalLM._model_mapping[_CanaryConfig]


# --- attention ----------------------------------------------------------------------------------------------------

def test_attn_implementation_follows_set_attn_implementation():
    model = tiny_model("llama")
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        assert _compat.attn_implementation(model.config) == name


def test_attention_entries_read_and_restore_the_global_registries():
    from transformers.masking_utils import AttentionMaskInterface

    name = "hf_kvspec_compat_canary"
    assert _compat.attention_entries(name) == (None, None)

    def function(*args, **kwargs):
        raise AssertionError("never called")

    mask_function = AttentionMaskInterface()["sdpa"]
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, mask_function)
    try:
        assert _compat.attention_entries(name) == (function, mask_function)
        assert AttentionInterface()[name] is function  # what a model dispatches to
    finally:
        _compat.restore_attention_entries(name, None, None)
    assert _compat.attention_entries(name) == (None, None)
    assert name not in AttentionInterface() and name not in AttentionMaskInterface()


def test_sdpa_attention_forward_is_what_the_public_registry_returns():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert AttentionInterface()["sdpa"] is sdpa_attention_forward
    module = tiny_model("llama").model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 16, generator=gen)  # [B, Hq, T, D]
    key, value = torch.randn(2, 2, 2, 5, 16, generator=gen)  # [B, Hkv, S, D] each
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    ours, _ = _compat.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25, dropout=0.0)
    stock, _ = AttentionInterface()["sdpa"](module, query, key, value, mask, scaling=0.25, dropout=0.0)
    assert torch.equal(ours, stock)


# --- generate(custom_generate=...) internals ----------------------------------------------------------------------

def _capture(model, **kwargs) -> dict:
    """Run ``generate(custom_generate=fn)`` and return what ``fn`` saw, read through ``_compat``."""
    seen = {}

    def custom(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        seen["streamer"] = _compat.generate_call_streamer()
        seen["pad_tensor"] = getattr(generation_config, "_pad_token_tensor", None)
        seen["pad"] = _compat.generation_pad_token_id(generation_config)
        seen["cache"] = model_kwargs.get("cache")
        seen["criteria"] = list(stopping_criteria)
        return input_ids

    model.generate(torch.tensor([[1, 5, 6]]), custom_generate=custom, max_new_tokens=4, do_sample=False, **kwargs)
    return seen


class _Streamer:
    def put(self, value):
        pass

    def end(self):
        pass


def test_generate_frame_holds_the_streamer():
    streamer = _Streamer()
    assert _capture(tiny_model("llama"), streamer=streamer)["streamer"] is streamer
    assert _capture(tiny_model("llama"))["streamer"] is None
    assert _compat.generate_call_streamer() is None  # outside generate


def test_generate_sets_the_pad_token_tensor():
    model = tiny_model("llama")
    with_pad = _capture(model, pad_token_id=7)
    assert isinstance(with_pad["pad_tensor"], torch.Tensor) and with_pad["pad"] == 7
    model.generation_config.pad_token_id = None
    fallback = _capture(model, eos_token_id=5)  # generate falls back to the EOS id
    assert isinstance(fallback["pad_tensor"], torch.Tensor) and fallback["pad"] == 5


def test_generate_marks_a_user_cache():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    mine = _capture(model, cache=cache)["cache"]
    assert mine is cache and _compat.cache_is_user_defined(mine)
    made = _capture(model)["cache"]
    assert made is not None and not _compat.cache_is_user_defined(made)


# --- the speculative loop's processors and stopping criteria ----------------------------------------------------

def _score_only_examples() -> dict[str, object]:
    t = transformers
    return {
        "TemperatureLogitsWarper": t.TemperatureLogitsWarper(0.7), "TopKLogitsWarper": t.TopKLogitsWarper(5),
        "TopPLogitsWarper": t.TopPLogitsWarper(0.8), "MinPLogitsWarper": t.MinPLogitsWarper(0.05),
        "TopHLogitsWarper": t.TopHLogitsWarper(0.5), "TypicalLogitsWarper": t.TypicalLogitsWarper(0.8),
        "EpsilonLogitsWarper": t.EpsilonLogitsWarper(0.01), "EtaLogitsWarper": t.EtaLogitsWarper(0.01),
        "InfNanRemoveLogitsProcessor": t.InfNanRemoveLogitsProcessor(), "LogitNormalization": t.LogitNormalization(),
        "SuppressTokensLogitsProcessor": t.SuppressTokensLogitsProcessor([3, 4]),
    }


def _reads_only_scores(processor) -> bool:
    """Same scores after two different histories (other tokens, other length) -> same output."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 32, generator=gen)  # [B, V]
    short = torch.randint(0, 32, (2, 3), generator=gen)
    long = torch.randint(0, 32, (2, 9), generator=gen)
    return torch.equal(processor(short, scores.clone()), processor(long, scores.clone()))


def test_score_only_processors_exist_and_ignore_input_ids():
    examples = _score_only_examples()
    assert set(examples) == set(_compat._SCORE_ONLY_PROCESSORS)  # a new entry needs an example here
    assert _compat.score_only_processor_classes() == tuple(type(examples[n]) for n in _compat._SCORE_ONLY_PROCESSORS)
    for name, processor in examples.items():
        assert _reads_only_scores(processor), name
    assert not _reads_only_scores(RepetitionPenaltyLogitsProcessor(1.5))  # the check can fail


def test_stopping_criteria_fields():
    eos = EosTokenCriteria(eos_token_id=[2, 5])
    assert _compat.eos_criterion_ids(eos).tolist() == [2, 5]
    assert _compat.max_length_criterion_limit(eos) is None
    ids = torch.tensor([[1, 5], [1, 4], [1, 2]])
    assert eos(ids, None).tolist() == torch.isin(ids[:, -1], _compat.eos_criterion_ids(eos)).tolist()

    limit = MaxLengthCriteria(max_length=6)
    assert _compat.max_length_criterion_limit(limit) == 6 and _compat.eos_criterion_ids(limit) is None
    assert not limit(torch.ones(1, 5, dtype=torch.long), None).any()
    assert limit(torch.ones(1, 6, dtype=torch.long), None).all()


def test_generate_builds_the_criteria_the_stopper_reads_natively():
    criteria = _capture(tiny_model("llama"), eos_token_id=[2, 9])["criteria"]
    eos = [_compat.eos_criterion_ids(c) for c in criteria if _compat.eos_criterion_ids(c) is not None]
    limits = [_compat.max_length_criterion_limit(c) for c in criteria]
    assert [e.tolist() for e in eos] == [[2, 9]]
    assert 3 + 4 in limits  # prompt 3 + max_new_tokens 4


# --- MLA absorb: the modeling files' RoPE helpers -----------------------------------------------------------------

_MLA_MODULES = {
    "DeepseekV2Attention": "transformers.models.deepseek_v2.modeling_deepseek_v2",
    "DeepseekV3Attention": "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "Glm4MoeLiteAttention": "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite",
    "YoutuAttention": "transformers.models.youtu.modeling_youtu",
}


def _rotate_pairs(x, cos, sin, interleaved_in: bool, interleaved_out: bool):
    """Plain RoPE: rotate pairs (a_i, b_i) by angle theta_i; a pair is (x_i, x_{i+R/2}) or, interleaved,
    (x_2i, x_2i+1); the result is laid out the same two ways. x [B, H, T, R]; cos/sin [B, T, R] as the rotary
    embedding returns them (the R/2 angles repeated twice)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved_in else (x[..., :half], x[..., half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.stack([ra, rb], dim=-1).flatten(-2) if interleaved_out else torch.cat([ra, rb], dim=-1)


def _angles(batch: int, length: int, rope: int):
    theta = torch.rand(batch, length, rope // 2, generator=torch.Generator().manual_seed(1)) * 6.0
    return torch.cat([theta, theta], dim=-1)  # [B, T, R]


@pytest.mark.parametrize("class_name", sorted(_MLA_MODULES))
def test_mla_rope_helpers_exist_and_rotate_as_assumed(class_name):
    assert set(_MLA_MODULES) == set(SUPPORTED_ATTENTION)  # a newly supported class needs its canary
    module = importlib.import_module(_MLA_MODULES[class_name])
    cls = getattr(module, class_name)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 4, 8, generator=gen, dtype=torch.float64), torch.randn(2, 1, 4, 8, generator=gen,
                                                                                     dtype=torch.float64)
    theta = _angles(2, 4, 8).double()
    cos, sin = theta.cos(), theta.sin()
    if SUPPORTED_ATTENTION[class_name] == "complex":  # freqs_cis [B, T, R/2] complex, pairs interleaved
        freqs_cis = torch.polar(torch.ones_like(theta[..., :4]), theta[..., :4])
        got = _compat.modeling_function(cls, "apply_rotary_emb")(q, k, freqs_cis)
        expected = [_rotate_pairs(x, cos, sin, interleaved_in=True, interleaved_out=True) for x in (q, k)]
    else:
        # the interleaved helper reads interleaved pairs and writes them rotate-half style (halves)
        for interleaved, name in ((False, "apply_rotary_pos_emb"), (True, "apply_rotary_pos_emb_interleave")):
            got = _compat.modeling_function(cls, name)(q, k, cos, sin)
            expected = [_rotate_pairs(x, cos, sin, interleaved, interleaved_out=False) for x in (q, k)]
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=1e-12)  # fp64: only rounding differs
        return
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.to(g.dtype), rtol=0, atol=1e-5)  # the helper computes in complex64


def test_modeling_function_names_the_missing_helper():
    from transformers.models.llama import modeling_llama

    with pytest.raises(NotImplementedError, match="apply_rotary_emb"):
        _compat.modeling_function(modeling_llama.LlamaAttention, "apply_rotary_emb")


# --- caches -------------------------------------------------------------------------------------------------------

def test_layer_types_and_kwargs_per_layer():
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                 num_hidden_layers=3)
    types, kwargs = _compat.layer_types_and_kwargs(MistralConfig(sliding_window=8, **small))
    assert types == ["sliding_attention"] * 3
    assert [k.get("sliding_window") for k in kwargs] == [8] * 3
    types, kwargs = _compat.layer_types_and_kwargs(LlamaConfig(**small))
    assert types == ["full_attention"] * 3 and len(kwargs) == 3
    mixed = tiny_config("gemma2")  # alternating sliding / full layers
    types, kwargs = _compat.layer_types_and_kwargs(mixed)
    assert types == list(mixed.layer_types)
    assert [k.get("sliding_window") for k, t in zip(kwargs, types) if t == "sliding_attention"] == \
        [mixed.sliding_window] * types.count("sliding_attention")


# one real layer of each class set_layer_length edits: (cache factory, exact layer class, recording past, held)
_EDITED = {
    "dynamic": (lambda c: DynamicCache(config=c), "DynamicLayer", False, 6),
    "dynamic-sliding": (lambda c: DynamicCache(config=c), "DynamicSlidingWindowLayer", False, 6),
    "dynamic-sliding-past": (lambda c: DynamicCache(config=c), "DynamicSlidingWindowLayer", True, 11),
    "static": (lambda c: StaticCache(config=c, max_cache_len=16), "StaticLayer", False, 6),
    "static-sliding": (lambda c: StaticCache(config=c, max_cache_len=8), "StaticSlidingWindowLayer", False, 6),
}


def _edited_layer(kind: str, config):
    factory, class_name, record_past, _ = _EDITED[kind]
    cache = factory(config)
    if record_past:
        cache.activate_past_recording()
    layer = cache.layers[0]
    assert type(layer).__name__ == class_name  # the class the table of _compat names
    return layer


@pytest.mark.parametrize("kind", sorted(_EDITED))
def test_set_layer_length_makes_an_edited_layer_equal_one_fed_the_kept_tokens(kind):
    """Canary for the private length fields (``cumulative_length``, ``cumulative_length_int``): a layer that held
    ``n`` tokens, had its keys/values cut to the first ``n - 2`` (as keep_positions leaves them) and its length set,
    must take the next token exactly as a layer fed those ``n - 2`` tokens directly."""
    config = tiny_config("llama" if "sliding" not in kind else "mistral")  # mistral: sliding window 8
    held = _EDITED[kind][3]
    kept = held - 2
    states = torch.randn(1, 2, held + 1, 16, generator=torch.Generator().manual_seed(0))
    edited, fed = _edited_layer(kind, config), _edited_layer(kind, config)
    edited.update(states[:, :, :held], -states[:, :, :held])
    if not edited.is_compileable:  # dynamic: keys [B, H, S, D] become the kept tokens (static: stale slots stay)
        drop = held - kept
        edited.keys, edited.values = edited.keys[:, :, :-drop], edited.values[:, :, :-drop]
    assert type(edited) in _compat.editable_layer_types()
    _compat.set_layer_length(edited, kept)
    fed.update(states[:, :, :kept], -states[:, :, :kept])
    assert int(edited.get_seq_length()) == int(fed.get_seq_length()) == kept
    assert edited.get_mask_sizes(1) == fed.get_mask_sizes(1)
    new = (states[:, :, held:], -states[:, :, held:])
    for got, expected in zip(edited.update(*new), fed.update(*new)):  # static: stale slots past the length differ
        torch.testing.assert_close(got[:, :, :kept + 1], expected[:, :, :kept + 1], rtol=0, atol=0)
    assert int(edited.get_seq_length()) == kept + 1 and edited.get_mask_sizes(1) == fed.get_mask_sizes(1)


def test_dynamic_sliding_layer_keeps_the_last_window_minus_one_unless_recording():
    """Canary for the rule ``set_layer_length`` restores on a DynamicSlidingWindowLayer (window 8 here)."""
    states = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(1))
    layer = _edited_layer("dynamic-sliding", tiny_config("mistral"))
    layer.update(states, states)
    assert layer.keys.shape[2] == 7 and torch.equal(layer.keys, states[:, :, -7:])
    recording = _edited_layer("dynamic-sliding-past", tiny_config("mistral"))
    recording.update(states, states)
    assert recording.keys.shape[2] == 10
    recording.record_past = False  # as if it had stopped recording: the length setter trims to the window
    _compat.set_layer_length(recording, 10)
    assert torch.equal(recording.keys, states[:, :, -7:]) and recording.get_seq_length() == 10


def test_editable_layer_types_are_transformers_own_four():
    names = sorted(kind.__name__ for kind in _compat.editable_layer_types())
    assert names == ["DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer"]


# --- self-speculation (partial_forward, EarlyExitAssistant, LayerSkipAssistant, ExitAdapter) ----------------------

@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": None})])
def test_decoder_stack_pieces_run_one_by_one_reproduce_the_forward(kind, overrides):
    """decoder_stack's claims: embed (no scale) -> each layer (a tensor out, shared rotary position_embeddings, a 4D
    additive mask) -> norm -> lm_head is the model's forward; and hidden_states[i] for i < L is the raw output of
    layers 0..i-1 while hidden_states[L] is already normalised (what ExitAdapter's exit_layer < L relies on)."""
    from hf_kvspec.masking import additive_mask
    from hf_kvspec.speculative.partial_forward import causal_key_mask

    model = tiny_model(kind, num_hidden_layers=3, **overrides)
    embed, layers, rotary, norm = _compat.decoder_stack(model)
    assert (embed, norm) == (model.get_input_embeddings(), model.model.norm) and len(layers) == 3
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hidden = embed(ids)
        assert torch.equal(hidden, out.hidden_states[0])  # no embedding scale
        mask = additive_mask(causal_key_mask(torch.ones_like(ids), ids.shape[1]), hidden.dtype)
        rope = rotary(hidden, position_ids=positions)
        for i, layer in enumerate(layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rope)
            assert isinstance(hidden, torch.Tensor), f"{kind} decoder layers no longer return a tensor"
            if i + 1 < len(layers):  # fp32, same kernels, an explicit mask instead of the model's own: rounding
                torch.testing.assert_close(hidden, out.hidden_states[i + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norm(hidden), out.hidden_states[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.get_output_embeddings()(norm(hidden)), out.logits, atol=1e-5, rtol=1e-5)


def test_decoder_stack_refuses_other_architectures_and_sliding_layers_by_name():
    with pytest.raises(NotImplementedError, match="gemma2"):
        _compat.decoder_stack(tiny_model("gemma2"))
    with pytest.raises(NotImplementedError, match="sliding"):
        _compat.decoder_stack(tiny_model("mistral"))  # tiny mistral has sliding_window=8

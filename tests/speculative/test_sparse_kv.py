"""``SparseKVAssistant``: the target drafting over a view of its own cache is exact (greedy token identity, sampled
distribution), accepts everything when the view is the whole cache, and leaves the target's cache as a plain run
would (per round; no paged block leaks)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec import _compat
from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.memory import quantized_view_bytes
from hf_kvspec.speculative.drafters.sparse_kv import SparseKVAssistant
from tests.speculative import test_sampling as sampling_refs
from tests.tiny_models import left_padded_batch, tiny_model

PROMPTS = [list(range(3, 40)), list(range(41, 60)), list(range(61, 90))]
QUANT = dict(bits=2, group_size=4, residual_length=8)  # coarse enough to reject drafts; window >= K + G - 1


def _target(view: str):
    model = tiny_model("llama")
    if view == "quantized":
        hf_kvspec.enable_quantized_attention(model)
    return model


def _assistant(view: str, **kwargs):
    return SparseKVAssistant(view=view, **({**QUANT, **kwargs} if view == "quantized" else kwargs))


def _generate(model, ids, mask, assistant=None, cache=None, **kwargs):
    extra = dict(custom_generate=hf_kvspec.speculative_generate, assistant=assistant) if assistant else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                          cache=cache, **extra, **kwargs)


@pytest.mark.parametrize("view", ["streaming", "quantized"])
@pytest.mark.parametrize("size", [1, 3])
def test_greedy_token_identity(view, size):
    model = _target(view)
    ids, mask = left_padded_batch(PROMPTS[:size])
    expected = _generate(model, ids, mask)
    assistant = _assistant(view, sink_tokens=2, window=6, num_draft_tokens=3)
    out = _generate(model, ids, mask, assistant, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rounds > 1 and 0 < out.acceptance.mean_acceptance < 1  # drafts kept and rejected
    if view == "quantized" and size == 1:  # (bs 3: finished rows leave the shadow) the shadow holds what hf_kvspec.memory says: a draft (K=3 < G=4 tokens) may have
        # flushed one group early, which the crop does not undo (crop rule of QuantizedKVCache), so the window
        # holds between R - G and R tokens
        length, settings = assistant.last_view_tokens, dict(QUANT, residual_length=QUANT["residual_length"] - 4)
        low = quantized_view_bytes(model.config, length, size, torch.float32, sink_tokens=2, **settings)
        high = quantized_view_bytes(model.config, length, size, torch.float32, sink_tokens=2, **QUANT)
        assert low <= assistant.view_bytes() <= high


def test_greedy_identity_on_paged_cache_without_block_leaks():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(PROMPTS)
    plain_cache = PagedCache(model.config, block_size=4, num_blocks=256)
    expected = _generate(model, ids, mask, cache=plain_cache)
    cache = PagedCache(model.config, block_size=4, num_blocks=256)
    got = _generate(model, ids, mask, _assistant("streaming", sink_tokens=2, window=6), cache=cache)
    assert torch.equal(got, expected)
    # the speculative cache is longer than the plain one (holes of shorter accepted paths), but every block in
    # use holds committed columns: rows x ceil(length / block_size), nothing left from drafting
    length = cache.get_seq_length()
    assert length >= plain_cache.get_seq_length()
    assert cache.num_used_blocks() == len(PROMPTS) * -(-length // 4)
    cache.reset()
    assert cache.num_free_blocks() == cache.num_total_blocks()


@pytest.mark.parametrize("view", ["streaming", "quantized"])
def test_whole_context_view_accepts_every_draft(view):
    model = _target(view)
    ids, mask = left_padded_batch(PROMPTS)
    # streaming: the window covers the whole context; quantized: the shadow keeps everything in its
    # full-precision window (residual_length past the context), so the draft is the target
    kwargs = dict(window=4096) if view == "streaming" else dict(residual_length=256)
    assistant = _assistant(view, num_draft_tokens=4, **kwargs)
    out = _generate(model, ids, mask, assistant, return_dict_in_generate=True)
    assert out.acceptance.mean_acceptance == 1.0


class _CheckingAssistant(SparseKVAssistant):
    """Before each draft: the target's cache equals a fresh plain forward over the committed tokens; after it:
    the drafter changed nothing in it."""

    rounds_checked = 0

    def propose(self, ctx):
        cache, buffer = ctx.target_cache, ctx.buffer
        committed = buffer.width - 1
        if cache.get_seq_length() != committed:  # first round: the prompt is not in the cache yet
            return super().propose(ctx)
        self._check_equals_plain(cache, buffer, committed)
        self.rounds_checked += 1
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        proposal = super().propose(ctx)
        for (keys, values), layer in zip(before, cache.layers):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        return proposal

    def _check_equals_plain(self, cache, buffer, committed):
        fresh = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=buffer.tokens[:, :committed], attention_mask=buffer.mask[:, :committed],
                       position_ids=buffer.positions[:, :committed], cache=fresh, use_cache=True)
        real = buffer.mask[:, :committed].bool()  # holes and padding hold whatever was written there
        for ours, plain in zip(cache.layers, fresh.layers):
            # [B, H, S, D] at real columns; a verify forward over K + 1 tokens vs one forward: fp32 round-off
            torch.testing.assert_close(ours.keys.transpose(1, 2)[real], plain.keys.transpose(1, 2)[real],
                                       atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours.values.transpose(1, 2)[real], plain.values.transpose(1, 2)[real],
                                       atol=1e-5, rtol=1e-4)


def test_cache_after_each_round_equals_a_plain_run():
    model = tiny_model("llama")
    ids, mask = left_padded_batch(PROMPTS)
    assistant = _CheckingAssistant(sink_tokens=2, window=6, num_draft_tokens=3)
    assert torch.equal(_generate(model, ids, mask, assistant), _generate(model, ids, mask))
    assert assistant.rounds_checked >= 4


def test_first_round_drafts_nothing_and_refusals():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="view="):
        SparseKVAssistant(view="dense")
    with pytest.raises(ValueError, match="window"):
        SparseKVAssistant(window=0)
    ids, mask = left_padded_batch(PROMPTS[:1])
    with pytest.raises(ValueError, match="enable_quantized_attention"):  # the switch turned off: refused early
        _generate(model, ids, mask, SparseKVAssistant(view="quantized"), call_attention=False)
    quant_model = _target("quantized")
    cache = hf_kvspec.QuantizedKVCache(quant_model.config, **QUANT)
    with pytest.raises(ValueError, match="full-precision cache"):
        _generate(quant_model, ids, mask, _assistant("quantized"), cache=cache)


@pytest.mark.parametrize("view", ["streaming", "quantized"])
def test_sampling_matches_plain_sampling(view):
    """Joint (t2, t3) of 100k rows vs plain generate's exact distribution on an 8-token vocabulary; tolerance as
    in tests/speculative/test_sampling.py (expected TV of an exact sampler < 0.008)."""
    model = tiny_model("llama", vocab_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if view == "quantized":
        hf_kvspec.enable_quantized_attention(model)
    sampling = dict(temperature=0.7, top_k=0)
    exact = sampling_refs.exact_joint(model, **sampling)
    torch.manual_seed(0)
    # the draft really sees less than the target: the prompt (4 tokens) is longer than sink + window, or is
    # flushed into 2-bit codes by the first draft token (K = 1 fits a 4-token window with groups of 4)
    settings = dict(num_draft_tokens=3) if view == "streaming" else \
        dict(num_draft_tokens=1, sink_tokens=0, bits=2, group_size=4, residual_length=4)
    assistant = _assistant(view, **{"sink_tokens": 1, "window": 2, **settings})
    samples, stats = sampling_refs.speculative_samples(model, assistant, **sampling)
    assert sampling_refs._joint_tv(samples, exact) < 0.01
    assert stats.mean_acceptance < 0.999  # the view's distribution differs from the target's


def test_assistant_spec():
    from hf_kvspec.speculative.assistants import check_spec, make_assistant

    assert check_spec("sparse_kv") == ("sparse_kv", None)
    assert check_spec("sparse_kv:128") == ("sparse_kv", 128)
    for bad in ("sparse_kv:", "sparse_kv:0", "sparse_kv:x"):
        with pytest.raises(ValueError, match="sparse_kv"):
            check_spec(bad)
    model = tiny_model("llama")
    assistant = make_assistant("sparse_kv:128", model, num_draft_tokens=3)
    assert isinstance(assistant, SparseKVAssistant) and assistant.window == 128 and assistant.view == "streaming"
    assert make_assistant("sparse_kv", model).window == 256


def test_quantized_view_switches_the_target_for_the_call_only():
    """A target left on sdpa: the call runs kvspec_quant (the view reads its codes through it) and switches back;
    the output equals plain greedy on the untouched model, and the switch is recorded in the telemetry."""
    model = tiny_model("llama")
    ids, mask = left_padded_batch(PROMPTS[:2])
    plain = _generate(model, ids, mask)
    before = _compat.attn_implementation(model.config)
    seen = []
    assistant = _assistant("quantized", num_draft_tokens=3)
    propose = assistant.propose

    def recording(ctx):
        seen.append(_compat.attn_implementation(model.config))
        return propose(ctx)

    assistant.propose = recording
    out = _generate(model, ids, mask, assistant, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert seen and set(seen) == {"kvspec_quant"}
    assert _compat.attn_implementation(model.config) == before
    assert out.acceptance.attention == f"kvspec_quant (switched from {before} for this call)"

"""QuantizedKVCache inside ``model.generate``: greedy equality, logits tolerance, beams, speculative decoding."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec.cache.quantized import QuantizedKVCache, QuantizedKVLayer
from hf_kvspec.memory import quantized_token_split
from tests.tiny_models import left_padded_batch, tiny_model

PROMPT_LEN = 30


@pytest.fixture(scope="module")
def model():
    # head_dim 64 so that every group size used here divides it; GQA with 2 kv heads
    return tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 90, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


def _greedy(model, ids, cache, mask=None, new=32, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0,
                          cache=cache, **kw)


def test_int8_greedy_equals_dynamic_cache(model):
    ids, mask = left_padded_batch([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 45))])
    expected = _greedy(model, ids, DynamicCache(config=model.config), mask)
    cache = QuantizedKVCache(model.config, method="int8")  # window 0: every past token is read as int8
    assert torch.equal(_greedy(model, ids, cache, mask), expected)
    assert cache.layers[0].store.length == cache.get_seq_length()  # the whole history really went through int8


def _teacher_forced_logprobs(model, prompt, continuation, cache):
    """[T, V] next-token log-probs, feeding the continuation one token per forward (reads the stored history)."""
    rows = []
    with torch.no_grad():
        model(prompt, cache=cache)
        for t in range(continuation.shape[1]):
            rows.append(model(continuation[:, t:t + 1], cache=cache).logits[:, -1].log_softmax(-1))
    return torch.cat(rows)


def test_kivi_logits_close_to_dynamic_cache(model, prompt):
    continuation = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _teacher_forced_logprobs(model, prompt, continuation, DynamicCache(config=model.config))
    errors = {}
    for bits in (4, 2):
        cache = QuantizedKVCache(model.config, bits=bits, group_size=16, residual_length=0)
        errors[bits] = (_teacher_forced_logprobs(model, prompt, continuation, cache) - ref).abs().max().item()
    # Tolerance: measured 0.06 (4-bit) and 0.23 (2-bit) nats on this seed; 0.15 nats for 4 bits leaves 2.5x
    # margin yet fails for 2 bits, so it would catch a layout bug (wrong channel/group) that degrades to 2-bit
    # error levels or worse. Nonzero and ordered errors show the history was really read quantized.
    assert 0 < errors[4] < 0.15
    assert errors[2] > errors[4]


def _beam_scores_by_teacher_forcing(model, sequences, settings):
    """Sum of next-token log-probs of each sequence's generated part, one row at a time (no reordering)."""
    totals = []
    for seq in sequences:
        cache = QuantizedKVCache(model.config, **settings)
        with torch.no_grad():
            logits = model(seq[None, :PROMPT_LEN], cache=cache).logits[0, -1]
            total = 0.0
            for t in range(PROMPT_LEN, seq.shape[0]):
                total += logits.log_softmax(-1)[seq[t]].item()
                logits = model(seq[None, t:t + 1], cache=cache).logits[0, -1]
        totals.append(total)
    return torch.tensor(totals)


def _beam_search(model, prompt, settings):
    return model.generate(prompt, do_sample=False, num_beams=4, num_return_sequences=4, max_new_tokens=20,
                          length_penalty=0.0, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True,
                          cache=QuantizedKVCache(model.config, **settings))


BEAM_SETTINGS = [dict(method="int8"), dict(bits=4, group_size=16, residual_length=16),
                 dict(bits=2, group_size=16, residual_length=0, sink_tokens=2)]


@pytest.mark.parametrize("settings", BEAM_SETTINGS[1:], ids=["kivi4", "kivi2-sinks"])
def test_beam_search_reorders_the_quantized_history(model, prompt, settings):
    """Each returned beam's score must equal its own teacher-forced score through a fresh cache: a beam whose
    history was not reordered with it would have been scored against another beam's keys/values.
    Tolerance 1e-3 nats over 20 tokens: batched vs single-row float rounding (measured ~1e-5)."""
    out = _beam_search(model, prompt, settings)
    assert torch.allclose(out.sequences_scores, _beam_scores_by_teacher_forcing(model, out.sequences, settings),
                          atol=1e-3)


def test_beam_check_fails_without_reordering(model, prompt, monkeypatch):
    """Negative control for the test above: with reordering disabled, scores no longer match."""
    settings = BEAM_SETTINGS[0]
    monkeypatch.setattr(QuantizedKVLayer, "reorder_cache", lambda self, beam_idx: None)
    out = _beam_search(model, prompt, settings)
    monkeypatch.undo()
    expected = _beam_scores_by_teacher_forcing(model, out.sequences, settings)
    assert not torch.allclose(out.sequences_scores, expected, atol=1e-3)


def _speculative(model, prompt, cache):
    assistant = hf_kvspec.DraftModelAssistant(copy.deepcopy(model), num_draft_tokens=4)
    out = _greedy(model, prompt, cache, new=48, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                  return_dict_in_generate=True)
    assert not out.acceptance.empty  # canary: speculative rounds really ran
    return out.sequences


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("settings", [dict(method="int8"), dict(method="fp8")], ids=["int8", "fp8"])
def test_speculative_greedy_equals_plain_greedy_on_the_same_cache(model, settings, batch):
    """Copy-of-target draft (on its own DynamicCache): the target still rejects some drafts (the draft does not
    see quantization), so the loop crops this cache. Per-token methods with window 0 give every token one fixed
    representation from its first read on (read rule in quantized.py), so a verify forward over K+1 tokens
    reads exactly what K+1 single steps read. The first forward carries the prompt and the first drafts at once,
    so this also needs a token's codes to depend on that token alone (fp8 once calibrated a per-head scale on
    that first forward, drafts included: it parted from plain decoding at batch 3)."""
    prompt = torch.randint(3, 90, (batch, 12), generator=torch.Generator().manual_seed(0))
    plain = _greedy(model, prompt, QuantizedKVCache(model.config, **settings), new=48)
    assert torch.equal(_speculative(model, prompt, QuantizedKVCache(model.config, **settings)), plain)


@pytest.mark.parametrize("settings, prompt_len", [  # prompt lengths leave ~14 tokens before the next flush
    (dict(bits=4, group_size=16, residual_length=16, sink_tokens=3), 36),
    (dict(bits=2, group_size=16, residual_length=0), 33),
], ids=["kivi4", "kivi2"])
def test_speculative_kivi_equals_plain_greedy_until_a_verify_forward_straddles_a_flush(model, settings, prompt_len,
                                                                                       monkeypatch):
    """KIVI keys need a full group before they can be quantized, so a token is read exact for a while and
    quantized afterwards. A single step at position p reads ``q(p + 1)`` quantized tokens; a verify forward
    over positions [L, L + T) reads what is stored after it, for every query. Where that differs from
    ``q(p + 1)`` for some query, the two decodes may part; up to there they must agree token for token."""
    prompt = torch.randint(3, 90, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    plain = _greedy(model, prompt, QuantizedKVCache(model.config, **settings), new=48)
    cache = QuantizedKVCache(model.config, **settings)
    layer, original = cache.layers[0], QuantizedKVLayer.update
    forwards = []  # (L, T, stored after) for every forward after the prefill

    def recording_update(key_states, value_states, *args, **kwargs):
        start = layer.get_seq_length()
        out = original(layer, key_states, value_states, *args, **kwargs)
        if start:
            forwards.append((start, key_states.shape[2], layer.store.length))
        return out

    monkeypatch.setattr(layer, "update", recording_update)
    spec = _speculative(model, prompt, cache)
    unit, window, sinks = cache.settings.flush_unit, cache.settings.residual_length, cache.settings.sink_tokens

    def single_step_stored(position):  # store length after a single-token update at `position`
        return quantized_token_split(position + 1 - sinks, unit, window)[0]

    straddles = [start for start, tokens, stored in forwards
                 if any(single_step_stored(start + i) != stored for i in range(tokens))]
    agree_until = min(straddles, default=spec.shape[1]) + 1  # the query at `start` may already differ
    assert agree_until > prompt.shape[1] + 1  # the prefix checked below is not empty
    assert torch.equal(spec[:, :agree_until], plain[:, :agree_until])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_verify_forward_reads_what_single_steps_read_only_without_a_window(model, prompt, method):
    """Why speculative = plain decoding is promised for int8/fp8 with residual_length=0 only. With a window of R
    tokens, a single step at position p reads the tokens p-R+1..p exact; a forward over T tokens flushes up to T
    tokens first, so its earlier queries read quantized what single steps read exact (one K/V tensor serves all
    queries), and the difference reaches every later query through the next layers' keys. Without a window every
    token has one representation for every query. Bounds: the window-0 difference is float noise of batched vs
    single-row matmuls (measured 5e-7); with a window it is quantization error (measured 1e-4..4e-3)."""
    continuation = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(1))
    gaps = {}
    for window in (0, 4, 9):
        with torch.no_grad():
            stepped = QuantizedKVCache(model.config, method=method, residual_length=window)
            model(prompt, cache=stepped)
            single = torch.cat([model(continuation[:, t:t + 1], cache=stepped).logits[:, -1] for t in range(5)])
            verified = QuantizedKVCache(model.config, method=method, residual_length=window)
            model(prompt, cache=verified)
            gaps[window] = (model(continuation, cache=verified).logits[0] - single).abs().amax(-1)  # [T]
    assert gaps[0].max() < 1e-5
    assert (gaps[4] > 1e-4).all() and (gaps[9] > 1e-4).all()


# ---------------------------------------------------------------------------------------------- trees (#29 item 2)
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_token_codes_keep_positions_like_a_cache_that_only_saw_the_kept_tokens(method):
    """keep_positions on a segment already flushed into codes (window 0): the kept tokens' codes and scales equal
    those of a cache that was fed only the kept tokens (per-token codes move like states)."""
    generator = torch.Generator().manual_seed(3)
    config = tiny_model("llama").config
    batch, prefix, nodes = 3, 7, 6
    keys = torch.randn(batch, 2, prefix + nodes, 32, generator=generator)
    values = torch.randn(batch, 2, prefix + nodes, 32, generator=generator)
    indices = torch.tensor([[0, 2, 5], [1, 3, 3], [4, 4, 4]])  # ascending; shorter rows repeat their last index
    tree = QuantizedKVCache(config, method=method)
    tree.update(keys[:, :, :prefix], values[:, :, :prefix], 0)
    tree.update(keys[:, :, prefix:], values[:, :, prefix:], 0)
    tree.keep_positions(prefix, indices, layers=[0])
    kept = prefix + indices  # [B, 3] positions of the kept tokens in the fed states
    take = lambda x: torch.cat([x[:, :, :prefix], x.gather(2, kept[:, None, :, None].expand(-1, 2, -1, 32))], 2)  # noqa: E731
    reference = QuantizedKVCache(config, method=method)
    reference.update(take(keys), take(values), 0)
    got, want = tree.layers[0].store.state, reference.layers[0].store.state
    assert tree.get_seq_length(0) == reference.get_seq_length(0) == prefix + 3
    for name in want:
        assert torch.equal(got[name].view(torch.uint8) if got[name].element_size() == 1 else got[name],
                           want[name].view(torch.uint8) if want[name].element_size() == 1 else want[name]), name


@pytest.mark.parametrize("residual", [3, 9])
def test_per_token_keep_positions_across_store_and_window_keeps_each_token(residual):
    """With a window, kept tokens land in the store (as their own codes) or in the window (exact): each kept
    position reads its token, exact or quantized-then-dequantized, never another token."""
    from hf_kvspec.cache import quant_ops as ops

    generator = torch.Generator().manual_seed(4)
    config = tiny_model("llama").config
    keys = torch.randn(2, 2, 20, 32, generator=generator)
    values = torch.randn(2, 2, 20, 32, generator=generator)
    indices = torch.tensor([[0, 1, 4, 9, 11], [2, 3, 5, 6, 8]])
    cache = QuantizedKVCache(config, method="int8", residual_length=residual)
    cache.update(keys[:, :, :8], values[:, :, :8], 0)
    cache.update(keys[:, :, 8:], values[:, :, 8:], 0)
    cache.keep_positions(8, indices, layers=[0])
    layer = cache.layers[0]
    stored_keys, _ = layer.store.dequantize(torch.float32)
    read = torch.cat([stored_keys, layer.keys], dim=2)  # [B, H, 13, D]
    expected = torch.cat([keys[:, :, :8], keys.gather(2, (8 + indices)[:, None, :, None].expand(-1, 2, -1, 32))], 2)
    rounded = ops.dequantize_int8(*ops.quantize_int8(expected), torch.float32)
    in_store = torch.arange(13) < layer.store.length
    assert layer.store.length > 8  # the segment reached into the codes
    assert torch.equal(read[:, :, in_store], rounded[:, :, in_store])
    assert torch.equal(read[:, :, ~in_store], expected[:, :, ~in_store])


def _tree_assistant(model, kind):
    from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead
    from hf_kvspec.heads.modeling_medusa import MedusaHeads

    torch.manual_seed(5)
    if kind == "medusa":
        return hf_kvspec.MedusaAssistant(MedusaHeads(MedusaConfig.for_base_model(model, "tiny", num_heads=3)),
                                         draft_vocab_size=None)
    return hf_kvspec.EagleAssistant(EagleHead(EagleConfig.for_base_model(model, "tiny")), draft_vocab_size=None)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_trees_on_per_token_codes_without_a_window_equal_plain_greedy(model, method, kind, batch):
    """Window 0: every tree's accepted path is kept among codes; greedy output equals plain decoding on the same
    cache kind, token for token."""
    prompt = torch.randint(3, 90, (batch, 12), generator=torch.Generator().manual_seed(0))
    plain = _greedy(model, prompt, QuantizedKVCache(model.config, method=method), new=24)
    out = _greedy(model, prompt, QuantizedKVCache(model.config, method=method), new=24,
                  custom_generate=hf_kvspec.speculative_generate, assistant=_tree_assistant(model, kind),
                  return_dict_in_generate=True)
    assert out.acceptance.draft_lengths and max(out.acceptance.draft_lengths) > 1  # trees were verified
    assert torch.equal(out.sequences, plain)


def test_kivi_refusal_names_the_window_that_works_and_why(model):
    cache = QuantizedKVCache(model.config, bits=4, group_size=16, residual_length=16)
    with pytest.raises(ValueError) as info:
        _greedy(model, torch.tensor([[5, 6, 7]]), cache, new=4, custom_generate=hf_kvspec.speculative_generate,
                assistant=_tree_assistant(model, "medusa"))
    message = str(info.value)
    assert "residual_length=32" in message and "per channel" in message and "'int8'" in message

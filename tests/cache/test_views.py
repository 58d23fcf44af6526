"""``StreamingView``: the columns it reads, and its draft forward against the plain reference (the full cache with
every other column masked), on DynamicCache and PagedCache; it never writes the target's cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.cache.views import StreamingView, sink_window_columns, sink_window_keep
from tests.tiny_models import left_padded_batch, tiny_model

PROMPTS = [list(range(3, 23)), list(range(30, 44)), list(range(50, 69))]  # 20, 14, 19 tokens


def test_columns_by_hand():
    # row 0: 2 padding columns, row 1: a hole at column 3; S = 8, sinks 2, window 3 -> window columns 5, 6, 7
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1, 0, 1]])
    columns, valid = sink_window_columns(mask, sink_tokens=2, window=3)
    assert columns.tolist() == [[2, 3, 5, 6, 7], [0, 1, 5, 6, 7]]
    assert valid.tolist() == [[True, True, True, True, True], [True, True, True, False, True]]
    # a row with fewer real columns before the window than sinks gets masked sink slots
    columns, valid = sink_window_columns(torch.tensor([[0, 0, 0, 1, 1, 1]]), sink_tokens=2, window=3)
    assert columns.tolist() == [[0, 1, 3, 4, 5]] and valid.tolist() == [[False, False, True, True, True]]
    # a window covering the cache reads every column, no sinks
    columns, valid = sink_window_columns(mask, sink_tokens=2, window=8)
    assert columns.tolist() == [list(range(8))] * 2 and torch.equal(valid, mask.bool())
    assert sink_window_keep(mask, 2, 3).tolist() == [[0, 0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 0, 1, 0, 1]]


def _reference_columns(mask: torch.Tensor, sinks: int, window: int) -> list[list[int]]:
    """The column rule by hand: each row's first ``sinks`` real columns before the window (padded with the first
    non-real ones), then the window's columns."""
    length = mask.shape[1]
    start = max(0, length - window)
    sinks = min(sinks, start)
    rows = []
    for row in mask.tolist():
        real = [c for c in range(start) if row[c]]
        rest = [c for c in range(start) if not row[c]]
        rows.append((real + rest)[:sinks] + list(range(start, length)))
    return rows


@pytest.mark.parametrize("seed", range(20))
def test_columns_fast_path_and_sort_agree_with_the_rule(seed):
    """Unpadded rows take the no-sort path, padded or holed rows the sort: both must follow the rule."""
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(4, 40, (), generator=generator))
    mask = (torch.rand(3, length, generator=generator) > 0.3).long()
    if seed % 2:
        mask[:, :6] = 1  # no padding where the sinks are: the fast path
    for sinks, window in ((2, 3), (4, 8), (0, 5), (3, length)):
        columns, valid = sink_window_columns(mask, sinks, window)
        assert columns.tolist() == _reference_columns(mask, sinks, window)
        assert torch.equal(valid, mask.bool().gather(1, columns))


def _prefill(model, cache):
    ids, mask = left_padded_batch(PROMPTS)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    return ids, mask, positions


def _reference_logits(model, cache, mask, keep, new_ids, new_positions):
    """Draft logits over the full cache with every column outside the view masked (the plain reference)."""
    logits = []
    for t in range(new_ids.shape[1]):
        keys = torch.cat([keep, torch.ones(keep.shape[0], t + 1, dtype=torch.bool)], 1)[:, None, None]
        out = model(input_ids=new_ids[:, t:t + 1], attention_mask=torch.where(keys, 0.0, torch.finfo(torch.float32).min),
                    position_ids=new_positions[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)


def _view_logits(model, cache, mask, new_ids, new_positions, sinks, window):
    view = StreamingView(cache, mask, sinks, window)
    logits = [model(input_ids=new_ids[:, t:t + 1], attention_mask=view.attention_mask(1, torch.float32),
                    position_ids=new_positions[:, t:t + 1], cache=view, use_cache=True).logits
              for t in range(new_ids.shape[1])]
    return torch.cat(logits, 1), view


def _new_tokens(positions):
    return torch.tensor([[7, 8, 9]] * 3), positions[:, -1:] + torch.arange(1, 4)


@pytest.mark.parametrize("cache_kind", ["dynamic", "paged"])
@pytest.mark.parametrize("sinks,window", [(2, 5), (0, 7), (4, 100)])
def test_view_equals_masked_full_cache(cache_kind, sinks, window):
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config) if cache_kind == "dynamic" else PagedCache(model.config, block_size=4,
                                                                                          num_blocks=64)
    with torch.no_grad():
        _, mask, positions = _prefill(model, cache)
        new_ids, new_positions = _new_tokens(positions)
        keep = sink_window_keep(mask, sinks, window)
        reference_cache = DynamicCache(config=model.config)  # prefilled the same way, then read in full
        _prefill(model, reference_cache)
        expected = _reference_logits(model, reference_cache, mask, keep, new_ids, new_positions)
        lengths = [cache.get_seq_length(i) for i in range(len(cache.layers))]
        got, view = _view_logits(model, cache, mask, new_ids, new_positions, sinks, window)
    # same math in another key order / mask form: float32 round-off only
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert [cache.get_seq_length(i) for i in range(len(cache.layers))] == lengths  # target untouched
    assert view.drafted == 3
    view.crop(-2)
    assert view.drafted == 1 and view.layers[0].get_seq_length() == view.columns.shape[1] + 1


def test_view_keys_are_the_cache_columns():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        _, mask, positions = _prefill(model, cache)
        view = StreamingView(cache, mask, 2, 5)
        new_ids, new_positions = _new_tokens(positions)
        model(input_ids=new_ids[:, :1], attention_mask=view.attention_mask(1, torch.float32),
              position_ids=new_positions[:, :1], cache=view, use_cache=True)
    for target_layer, view_layer in zip(cache.layers, view.layers):
        expected = target_layer.keys[torch.arange(3)[:, None], :, view.columns].transpose(1, 2)  # [B, H, C, D]
        assert torch.equal(view_layer.keys[:, :, : view.columns.shape[1]], expected)


_RECORDED: list[tuple[int, int]] = []


def _recording_sdpa(module, query, key, value, attention_mask, **kwargs):
    _RECORDED.append((query.shape[2], key.shape[2]))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_view_reads_only_sinks_window_and_drafts():
    AttentionInterface.register("record_sdpa", _recording_sdpa)
    AttentionMaskInterface.register("record_sdpa", sdpa_mask)
    model = tiny_model("llama", attn_implementation="record_sdpa")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        _, mask, positions = _prefill(model, cache)
        _RECORDED.clear()
        new_ids, new_positions = _new_tokens(positions)
        _view_logits(model, cache, mask, new_ids, new_positions, sinks=2, window=5)
    layers = model.config.num_hidden_layers
    assert [(1, 2 + 5 + t + 1) for t in range(3) for _ in range(layers)] == _RECORDED


def test_refuses_a_cache_it_cannot_read_by_column():
    from hf_kvspec.cache.quantized import QuantizedKVCache

    model = tiny_model("llama")
    cache = QuantizedKVCache(model.config, residual_length=0, group_size=16)
    with torch.no_grad():
        _, mask, positions = _prefill(model, cache)
        view = StreamingView(cache, mask, 2, 5)
        with pytest.raises(ValueError, match="Use DynamicCache"):
            model(input_ids=torch.tensor([[7]] * 3), attention_mask=view.attention_mask(1, torch.float32),
                  position_ids=positions[:, -1:] + 1, cache=view, use_cache=True)
    with pytest.raises(ValueError, match="between rounds"):
        StreamingView(cache, mask[:, :-1], 2, 5)

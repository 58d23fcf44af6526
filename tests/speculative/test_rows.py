"""Finished rows leave the model's batch (rows.py) without changing any row's output."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from tests.speculative.helpers import batch, drafts_for

MAX_NEW = 24


@pytest.fixture(scope="module")
def models():
    return drafts_for("llama")


class _BatchSizes:
    """Forward hook on the target's embedding (which both the model's own forward and the fast forward call)
    recording the batch size of every target forward."""

    def __init__(self, model):
        self.sizes = []
        self._handle = model.get_input_embeddings().register_forward_hook(
            lambda mod, args, out: self.sizes.append(args[0].shape[0]))

    def remove(self):
        self._handle.remove()


def _speculative_batch_sizes(target, ids, mask, eos, assistant):
    """Greedy speculative output, the call's AcceptanceStats and the batch size of every target forward."""
    sizes = _BatchSizes(target)
    try:
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                              eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                              return_dict_in_generate=True)
    finally:
        sizes.remove()
    return out.sequences, out.acceptance, sizes.sizes


def _ragged_eos(target, ids, mask, **kw):
    """An EOS id that row 0 emits early under plain greedy, and plain greedy's output with it."""
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                           eos_token_id=None, **kw)
    eos = int(free[0, ids.shape[1] + 2])
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                               eos_token_id=eos, **kw)
    ended = (expected[:, ids.shape[1]:] == eos).any(dim=1)
    assert ended[0] and not ended.all(), "the test needs rows that stop at different times"
    return eos, expected


def _assistants(drafts):
    return {"draft": hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4),
            "ngram": hf_kvspec.NgramAssistant(max_ngram=2, num_draft_tokens=4)}


@pytest.mark.parametrize("name", ["draft", "ngram"])
def test_finished_rows_leave_the_batch_and_outputs_match_plain(models, name):
    target, drafts = models
    ids, mask = batch(4)
    eos, expected = _ragged_eos(target, ids, mask)
    assistant = _assistants(drafts)[name]
    out, stats, sizes = _speculative_batch_sizes(target, ids, mask, eos, assistant)
    assert torch.equal(out, expected)
    assert stats.rows_dropped >= 1
    assert sizes[0] == 4 and sizes[-1] < 4  # later verify forwards ran on fewer rows
    assert sizes == sorted(sizes, reverse=True)
    # the drafter kept each remaining row's state: the same drafts get accepted as with every row kept
    kept = _assistants(drafts)[name]
    kept_stats = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                                 eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate, assistant=kept,
                                 cache=DynamicCache(config=target.config), return_dict_in_generate=True).acceptance
    assert kept_stats.rows_dropped == 0
    assert (stats.rounds, stats.accepted) == (kept_stats.rounds, kept_stats.accepted)


def test_a_callers_cache_keeps_every_row(models):
    target, drafts = models
    ids, mask = batch(4)
    eos, expected = _ragged_eos(target, ids, mask)
    cache = DynamicCache(config=target.config)
    assistant = hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          cache=cache, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rows_dropped == 0 and out.cache is cache
    assert cache.layers[0].keys.shape[0] == 4


def test_row_indexed_processors_still_see_the_callers_rows(models):
    """``prefix_allowed_tokens_fn`` gets each row's index in the call, also after rows before it left."""
    target, drafts = models
    ids, mask = batch(4)
    vocab = target.config.vocab_size

    def allowed(batch_id, prefix):  # each row may use a different residue class of ids (plus row 0's EOS below)
        return [t for t in range(vocab) if t % 4 != batch_id] + [eos_holder[0]]

    eos_holder = [0]
    eos, _ = _ragged_eos(target, ids, mask, prefix_allowed_tokens_fn=allowed)
    eos_holder[0] = eos
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=eos,
              prefix_allowed_tokens_fn=allowed)
    expected = target.generate(ids, **kw)
    assistant = hf_kvspec.DraftModelAssistant(drafts["right"], num_draft_tokens=4)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rows_dropped >= 1
    # the draft's scores went through the same row-indexed processor: a copy of the target is never rejected
    assert out.acceptance.mean_acceptance == 1.0
    for row in range(4):  # the constraint really depended on the row
        generated = out.sequences[row, ids.shape[1]:]
        assert not ((generated % 4 == row) & (generated != eos) & (generated != 0)).any()


def test_ngram_rows_left_behind_look_up_from_their_own_first_token():
    """After ``release`` a remaining row searches its history from its own first real token (its left padding
    in the full batch differs from its index among the survivors)."""
    from hf_kvspec.speculative.buffer import TokenBuffer
    from hf_kvspec.speculative.drafters.base import DraftContext
    from hf_kvspec.speculative.positions import History, PositionwiseProcessor
    from tests.tiny_models import left_padded_batch

    ids, mask = left_padded_batch([[1, 2], [5, 6, 7, 8, 5, 6], [9, 4, 9, 3, 4, 9], [7, 3]])  # pads: 4, 0, 0, 4
    assistant = hf_kvspec.NgramAssistant(max_ngram=2, num_draft_tokens=3)
    assistant.begin(None, TokenBuffer(ids, mask, pad_token_id=0))
    keep = torch.tensor([1, 2])
    assistant.release([0, 3])
    ctx = DraftContext(TokenBuffer(ids[keep], mask[keep], 0), History(ids[keep], 32, 0), 3, False,
                       torch.ones(2, dtype=torch.bool), PositionwiseProcessor(None))
    # "5 6" was followed by 7 8 5; "4 9" by 3 4 9
    assert assistant.propose(ctx).tokens.tolist() == [[7, 8, 5], [3, 4, 9]]


def test_sampling_with_rows_leaving_keeps_each_row_consistent(models):
    """Rejection sampling over the full batch with finished rows zero-filled: every row still ends at its first
    EOS or at the length limit, and the draft's probabilities are re-indexed with the rows."""
    target, drafts = models
    ids, mask = batch(4)
    eos, _ = _ragged_eos(target, ids, mask)
    torch.manual_seed(0)
    assistant = hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4)
    out = target.generate(ids, attention_mask=mask, do_sample=True, temperature=0.7, max_new_tokens=MAX_NEW,
                          pad_token_id=0, eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate,
                          assistant=assistant, return_dict_in_generate=True)
    generated = out.sequences[:, ids.shape[1]:]
    assert out.acceptance.rows_dropped >= 1 and out.acceptance.mean_acceptance > 0.3
    for row in generated:
        hits = (row == eos).nonzero()
        if hits.numel():  # everything after the first EOS is padding
            assert (row[int(hits[0]) + 1:] == 0).all()
        else:
            assert row.shape[0] == MAX_NEW


def test_caches_that_cannot_drop_rows_keep_them(models):
    """``generate``'s static cache stays on the model for later calls and cannot select rows: never shrunk."""
    target, _ = models
    ids, mask = batch(4)
    eos, expected = _ragged_eos(target, ids, mask)
    assistant = hf_kvspec.NgramAssistant(max_ngram=2, num_draft_tokens=4)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          cache_implementation="static", max_cache_len=64, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rows_dropped == 0


def test_drafters_without_release_keep_every_row(models):
    """A drafter that does not implement ``release`` may keep per-row state the loop cannot re-index."""
    from hf_kvspec.speculative.drafters.base import Assistant

    target, _ = models
    ids, mask = batch(4)
    eos, expected = _ragged_eos(target, ids, mask)

    class RowStateNgram(Assistant):  # n-gram drafts through an inner assistant, no release of its own
        def __init__(self):
            super().__init__(num_draft_tokens=4)
            self.inner = hf_kvspec.NgramAssistant(max_ngram=2, num_draft_tokens=4)

        def begin(self, target, buffer, target_hidden=None):
            super().begin(target, buffer, target_hidden)
            self.inner.begin(target, buffer, target_hidden)

        def propose(self, ctx):
            return self.inner.propose(ctx)

    assistant = RowStateNgram()
    out, stats, sizes = _speculative_batch_sizes(target, ids, mask, eos, assistant)
    assert torch.equal(out, expected)
    assert stats.rows_dropped == 0 and set(sizes) == {4}


@pytest.mark.parametrize("bs", [1, 4])
def test_scores_of_rounds_that_drafted_nothing(models, bs):
    """n-gram rounds without a match verify no draft but still emit a token: its score is recorded in its step."""
    target, _ = models
    ids, mask = batch(bs)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=None,
              return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = target.generate(ids, **kw)
    assistant = hf_kvspec.NgramAssistant(max_ngram=2, num_draft_tokens=3)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **kw)
    assert torch.equal(out.sequences, expected.sequences)
    assert 0 in out.acceptance.draft_lengths  # the case under test happened
    assert len(out.scores) == len(expected.scores) == 8
    for ours, theirs in zip(out.scores + out.logits, expected.scores + expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_release_names_rows_by_id_across_releases():
    """``staying`` maps row ids to the current positions: after row 1 left, row 3 is at position 2."""
    from hf_kvspec.speculative.buffer import TokenBuffer

    assistant = hf_kvspec.NgramAssistant()
    assistant.begin(None, TokenBuffer(torch.ones(4, 3, dtype=torch.long), None, 0))
    assert assistant.staying([1]).tolist() == [0, 2, 3] and assistant.row_ids == [0, 2, 3]
    assert assistant.staying([3, 0]).tolist() == [1] and assistant.row_ids == [2]


def test_spawn_shares_the_models_and_keeps_call_state_apart(models):
    """``Assistant.spawn`` (one per engine request): the draft model is shared, the per-call state is not, and the
    spawn has no draft-length tuner while the original keeps its own."""
    from hf_kvspec.speculative.buffer import TokenBuffer

    target, draft = models[0], models[1]["wrong"]
    original = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens="auto")
    twin = original.spawn()
    assert twin.model is original.model and twin.auto is None and original.auto is not None
    twin.begin(target, TokenBuffer(torch.ones(1, 3, dtype=torch.long), None, 0))
    assert twin.cache is not None and original.cache is None and original.row_ids == []

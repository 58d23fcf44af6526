"""EOS, max_new_tokens, streamer, return_dict_in_generate (scores, acceptance) and the silent-fallback canary."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import hf_kvspec
from tests.speculative.helpers import batch, drafts_for


@pytest.fixture(scope="module")
def models():
    return drafts_for("llama")


def _spec(target, draft, ids, mask=None, k=4, **kw):
    assistant = hf_kvspec.DraftModelAssistant(draft, num_draft_tokens=k)
    return target.generate(ids, attention_mask=mask, pad_token_id=0, custom_generate=hf_kvspec.speculative_generate,
                           assistant=assistant, **kw)


def _plain(target, ids, mask=None, **kw):
    return target.generate(ids, attention_mask=mask, pad_token_id=0, **kw)


@pytest.mark.parametrize("eos_as_list", [False, True])
def test_eos_inside_an_accepted_draft_stops_the_row(models, eos_as_list):
    target, drafts = models
    ids, mask = batch(4)
    free = _plain(target, ids, mask, do_sample=False, max_new_tokens=12, eos_token_id=None)
    new = free[0, ids.shape[1]:].tolist()
    # the prefill emits new[0], then rounds of 4 drafts + 1 bonus (new[5], new[10]): a fresh token that is a draft
    at = next(i for i in range(5, len(new)) if new[i] not in new[:i] and i % 5 != 0)
    eos = new[at]
    eos_arg = [eos, 95] if eos_as_list else eos
    expected = _plain(target, ids, mask, do_sample=False, max_new_tokens=12, eos_token_id=eos_arg)
    out = _spec(target, drafts["right"], ids, mask, do_sample=False, max_new_tokens=12, eos_token_id=eos_arg,
                return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    row0 = out.sequences[0, ids.shape[1]:].tolist()
    assert row0.index(eos) == at and all(t == 0 for t in row0[at + 1:])  # stopped at EOS, padded after it
    assert out.acceptance.mean_acceptance == 1.0  # EOS really arrived inside an accepted draft


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 6, 11])
def test_max_new_tokens_is_exact(models, max_new_tokens):
    target, drafts = models
    ids, mask = batch(2)
    out = _spec(target, drafts["right"], ids, mask, k=4, do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=None)
    assert out.shape[1] == ids.shape[1] + max_new_tokens
    assert torch.equal(out, _plain(target, ids, mask, do_sample=False, max_new_tokens=max_new_tokens,
                                   eos_token_id=None))


class _Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("via_enable", [False, True])
def test_streamer_receives_exactly_the_returned_tokens(models, via_enable):
    target, drafts = models
    ids, _ = batch(1)
    streamer = _Recorder()
    assistant = hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4)
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0, streamer=streamer,
              assistant=assistant)
    if via_enable:
        hf_kvspec.enable(target)
        try:
            out = target.generate(ids, **kw)
        finally:
            hf_kvspec.disable(target)
    else:
        out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, **kw)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()  # generate puts the prompt first
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, ids.shape[1]:].tolist()  # only final tokens, none of the rejected drafts
    assert len(streamer.chunks) - 1 < 20  # several tokens per chunk: it streamed per round, not per token


def test_return_dict_scores_and_acceptance(models):
    target, drafts = models
    ids, mask = batch(4)
    kw = dict(do_sample=False, max_new_tokens=10, eos_token_id=None, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    expected = _plain(target, ids, mask, **kw)
    out = _spec(target, drafts["partial"], ids, mask, **kw)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 10
    for ours, theirs in zip(out.scores, expected.scores):
        # same processed scores; verifying several tokens per forward changes float rounding only
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(out.logits, expected.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert isinstance(out.acceptance, hf_kvspec.AcceptanceStats) and out.acceptance.rounds > 0
    # rows reach max_length in different rounds and leave the batch of the cache generate made for this call; a
    # cache missing rows cannot continue the returned sequences, so none is returned then
    assert out.acceptance.rows_dropped > 0 and out.cache is None


def test_each_call_returns_a_fresh_acceptance(models):
    """Two calls with one assistant: two distinct AcceptanceStats, the second not accumulating the first's rounds."""
    target, drafts = models
    ids, mask = batch(2)
    assistant = hf_kvspec.DraftModelAssistant(drafts["partial"], num_draft_tokens=4)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0,
              custom_generate=hf_kvspec.speculative_generate, assistant=assistant, return_dict_in_generate=True)
    first, second = target.generate(ids, **kw), target.generate(ids, **kw)
    assert torch.equal(first.sequences, second.sequences)
    assert isinstance(second.acceptance, hf_kvspec.AcceptanceStats) and second.acceptance is not first.acceptance
    assert first.acceptance.rounds > 0
    assert (second.acceptance.rounds, second.acceptance.accepted) == (first.acceptance.rounds, first.acceptance.accepted)


def test_canary_enable_path_really_speculates(models):
    """Fails if generate(assistant=...) silently decoded plainly (a hook stopped running): stats must be real."""
    target, drafts = models
    ids, _ = batch(1)
    assistant = hf_kvspec.DraftModelAssistant(drafts["right"], num_draft_tokens=4)
    hf_kvspec.enable(target)
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0,
                              assistant=assistant, return_dict_in_generate=True)
    finally:
        hf_kvspec.disable(target)
    stats = out.acceptance
    # the prefill emits 1 token; then 3 rounds x (4 accepted + 1 bonus) and a last round of 3 drafts + 1 (19 tokens)
    assert not stats.empty and stats.rounds == 4
    assert stats.target_forwards == 5 and stats.prefill_forwards == 1
    assert stats.tokens_per_target_forward == pytest.approx(19 / 4)
    assert stats.draft_forwards > 0 and stats.draft_time_s > 0 and stats.verify_time_s > 0
    assert stats.acceptance_rate == [1.0] * 4 and not stats.lossy


def test_no_assistant_decodes_plainly_and_a_wrong_one_is_refused_by_type(models):
    target, drafts = models
    ids, _ = batch(1)
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    out = target.generate(ids, max_new_tokens=6, do_sample=False, custom_generate=hf_kvspec.speculative_generate,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.rounds == 5 and out.acceptance.tokens_per_target_forward == 1.0
    with pytest.raises(TypeError, match="DraftModelAssistant"):
        target.generate(ids, max_new_tokens=2, custom_generate=hf_kvspec.speculative_generate,
                        assistant=drafts["right"])


class _FeatureDrafter(hf_kvspec.Assistant):
    """A hidden-state drafter stub (the Medusa/EAGLE seam): drafts a fixed token, records what it is shown."""

    wants_hidden_states = True

    def __init__(self):
        super().__init__(num_draft_tokens=2)
        self.seen = []

    def begin(self, target, buffer, target_hidden=None):
        super().begin(target, buffer, target_hidden)
        self.seen.append(("begin", tuple(target_hidden.shape)))

    def propose(self, ctx):
        rows = ctx.buffer.tokens.shape[0]
        return hf_kvspec.DraftProposal(torch.full((rows, ctx.num_draft_tokens), 7))

    def observe(self, outcome):
        super().observe(outcome)
        self.seen.append(("round", tuple(outcome.target_hidden.shape), outcome.num_draft_tokens))


def test_hidden_state_drafters_receive_target_features(models):
    target, _ = models
    ids, mask = batch(4)
    drafter = _FeatureDrafter()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0,
                          eos_token_id=None, custom_generate=hf_kvspec.speculative_generate, assistant=drafter)
    assert torch.equal(out, _plain(target, ids, mask, do_sample=False, max_new_tokens=6, eos_token_id=None))
    hidden = target.config.hidden_size
    assert drafter.seen[0] == ("begin", (4, ids.shape[1], hidden))
    assert all(kind == "round" and shape == (4, k + 1, hidden) for kind, shape, k in drafter.seen[1:])

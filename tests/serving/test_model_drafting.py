"""Draft models inside the engine (``ModelDrafters``): one packed draft forward per depth for all drafting requests,
on a paged cache of the draft's own, against each request drafted alone through ``generate``'s path
(``DraftModelAssistant.begin``/``propose``/``observe`` on a one-row buffer); the draft cache's kept prefix after
each verdict; a request the draft cache has no room for."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.cache.ragged import RaggedPagedCache
from hf_kvspec.serving.attention import register_ragged_attention
from hf_kvspec.serving.model_drafting import ModelDrafters
from hf_kvspec.serving.prompts import make_settings
from hf_kvspec.serving.request import Request
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import DraftContext, RoundOutcome
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
from hf_kvspec.speculative.positions import PositionwiseProcessor
from tests.tiny_models import tiny_model

#: per round, per request: (drafts asked, drafts accepted after it)
ROUNDS = [((4, 2), (3, 0), (0, 0)),
          ((2, 2), (4, 4), (3, 1)),
          ((4, 0), (1, 1), (4, 3))]
LENGTHS = (7, 12, 4)  # prompt tokens of each request (its first token is appended before the first round)


@pytest.fixture(scope="module")
def models():
    register_ragged_attention()
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1)


def _request(request_id: int, prompt: list[int], max_new_tokens: int = 32) -> Request:
    request = Request(request_id, prompt, make_settings(None, max_new_tokens=max_new_tokens))
    request.append_token(prompt[-1] % 50 + 1, 0.0)  # the prefill's token: the request decodes from here
    request.num_computed = request.num_tokens - 1
    return request


def _drafters(target, draft, blocks: int = 64) -> ModelDrafters:
    cache = RaggedPagedCache(target.config, blocks, block_size=4, enable_prefix_caching=False)
    return ModelDrafters(DraftModelAssistant(draft, 4), target, cache, 4, 0)


def _alone(tokens: list[int], assistant: DraftModelAssistant, count: int):
    buffer = TokenBuffer(torch.tensor([tokens]), None, 0)
    ctx = DraftContext(buffer, None, count, False, torch.ones(1, dtype=torch.bool), PositionwiseProcessor(None))
    return assistant.propose(ctx)


def test_packed_drafts_equal_each_request_drafted_alone(models):
    target, draft = models
    torch.manual_seed(0)
    requests = [_request(i, torch.randint(1, 60, (n,)).tolist()) for i, n in enumerate(LENGTHS)]
    drafters = _drafters(target, draft)
    alone = []
    for request in requests:
        drafters.start(request)
        assistant = DraftModelAssistant(draft, 4, fast_forward=False)
        assistant.begin(target, TokenBuffer(torch.tensor([request.tokens]), None, 0))
        alone.append(assistant)
    for plan in ROUNDS:
        packed = drafters.propose_rows([(request, asked) for request, (asked, _) in zip(requests, plan)])
        for request, (asked, accepted), proposal, assistant in zip(requests, plan, packed, alone):
            if asked == 0:
                assert proposal.tokens.shape[1] == 0
                continue
            reference = _alone(request.tokens, assistant, asked)
            assert proposal.tokens.tolist() == reference.tokens.tolist(), f"request {request.request_id}"
            drafted = proposal.tokens[0].tolist()
            before = request.num_tokens
            for token in [*drafted[:accepted], 50 + accepted]:  # the accepted drafts, then the target's token
                request.append_token(token, 0.0)
            request.num_computed = request.num_tokens - 1
            drafters.observe(request, request.num_computed, accepted, asked, None, None)
            assistant.observe(RoundOutcome(request.num_computed, torch.tensor([accepted]),
                                           torch.ones(1, dtype=torch.bool), asked, 0.0, 0.0))
            # the draft cache keeps the committed columns it fed: the root and the accepted drafts it fed
            assert drafters.cache.length(request.request_id) == min(before + accepted, before + asked - 1)


def test_a_request_without_room_in_the_draft_cache_drafts_nothing_and_starts_again(models):
    target, draft = models
    drafters = _drafters(target, draft, blocks=4)  # the draft cache: 8 blocks of 4 tokens
    short, long = _request(0, list(range(1, 6))), _request(1, list(range(1, 40)))
    for request in (short, long):
        drafters.start(request)
    made = drafters.propose_rows([(short, 3), (long, 3)])
    assert made[0].tokens.shape[1] == 3 and made[1].tokens.shape[1] == 0
    assert drafters.has_state(short) and drafters.cache.length(0) == short.num_tokens + 2
    drafters.drop(short)
    assert drafters.cache.num_free_blocks() == drafters.cache.num_total_blocks()


def test_a_failing_draft_forward_drops_the_drafting_requests(models, monkeypatch):
    target, draft = models
    drafters = _drafters(target, draft)
    request = _request(0, list(range(1, 9)))
    drafters.start(request)

    def broken(rows):
        raise RuntimeError("draft forward failed")

    monkeypatch.setattr(drafters.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="draft forward failed"):
        drafters.propose_rows([(request, 2)])
    assert not drafters.has_state(request)
    assert drafters.cache.num_free_blocks() == drafters.cache.num_total_blocks()


def test_draft_columns_of_an_undone_round_are_shed_before_the_next_draft(models):
    """A round that drafted and then failed (no verdict) leaves draft columns past the request's committed tokens:
    the next draft starts from the committed ones and drafts what it would have drafted first."""
    target, draft = models
    drafters = _drafters(target, draft)
    request = _request(0, list(range(3, 12)))
    drafters.start(request)
    first = drafters.propose_rows([(request, 3)])[0]  # the round then fails: no observe
    assert drafters.cache.length(0) == request.num_tokens + 2
    again = drafters.propose_rows([(request, 3)])[0]
    assert again.tokens.tolist() == first.tokens.tolist()


def test_a_request_dropped_for_room_takes_a_verdict_without_its_draft_state(models):
    """Under fixed draft lengths a request dropped for want of room still gets a (0-draft) verdict: observing it
    is a no-op, and its state begins again."""
    target, draft = models
    drafters = _drafters(target, draft, blocks=4)
    request = _request(0, list(range(1, 6)), max_new_tokens=64)
    drafters.start(request)
    drafters.propose_rows([(request, 3)])
    request.append_token(7, 0.0)
    request.num_computed = request.num_tokens - 1
    drafters.observe(request, request.num_computed, 0, 3, None, None)
    for token in range(10, 40):  # grow past what the draft cache holds
        request.append_token(token % 50 + 1, 0.0)
    request.num_computed = request.num_tokens - 1
    assert drafters.propose_rows([(request, 3)])[0].tokens.shape[1] == 0 and not drafters.has_state(request)
    drafters.observe(request, request.num_computed, 0, 0, None, None)  # the round's verdict: nothing to keep
    drafters.start(request)
    assert drafters.has_state(request)


@pytest.mark.parametrize("mixed", [False, True])
def test_the_engine_reports_the_draft_cache_alone_and_mixed_with_the_pool(models, mixed):
    from hf_kvspec import Engine
    from hf_kvspec.serving.model_drafting import draft_cache_blocks

    target, draft = models
    assistant = DraftModelAssistant(draft, 2)
    engine = Engine(target, kv_budget=64, block_size=4, assistant=["suffix", assistant] if mixed else assistant)
    engine.generate_batch([[5, 6, 7, 8, 9], [3, 4, 5]], max_new_tokens=6, progress_bar=False)
    report = engine.telemetry()["draft_cache"]
    assert report["total_blocks"] == draft_cache_blocks(engine.cache) == 64 + 8
    assert report["used_blocks"] == 0  # finished requests gave their draft K/V back

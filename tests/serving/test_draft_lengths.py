"""Draft lengths by load inside the engine (``draft_lengths="goodput"``): a drafter whose calls cost far more than
the forward stops being asked after it was timed; a free drafter that is always right drafts nearly every round;
a request at K = 0 takes the plain path (no draft call, no verify row). Outputs stay each prompt's own greedy
``generate`` throughout (the plan changes how many tokens a round verifies, never which tokens come out)."""

from __future__ import annotations

import time

import pytest
import torch

from hf_kvspec.serving.engine import Engine
from hf_kvspec.speculative.drafters.base import Assistant, DraftProposal
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end

MAX_NEW = 24


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


class KnownContinuation(Assistant):
    """Drafts each request's true greedy continuation (computed up front), after sleeping ``delay`` seconds per
    call; counts its calls."""

    def __init__(self, sequences: list[list[int]], delay: float = 0.0):
        super().__init__(num_draft_tokens=4)
        self.sequences, self.delay, self.calls = sequences, delay, 0

    def propose(self, ctx):
        self.calls += 1
        time.sleep(self.delay)
        have = ctx.history.ids[0, : int(ctx.history.lengths[0])].tolist()
        full = next(s for s in self.sequences if s[: len(have)] == have)
        drafts = full[len(have): len(have) + ctx.num_draft_tokens]
        return DraftProposal(torch.tensor([drafts], dtype=torch.long).view(1, -1))


def _run(llama, delay: float, num_draft_tokens=None):
    prompts = random_prompts([7, 12, 5], seed=11)
    expected = [greedy_reference(llama, p, MAX_NEW) for p in prompts]
    # a class per call: the engine shares measured costs between engines of one drafter type in a process
    drafter_type = type(f"Continuation{int(delay * 1000)}_{num_draft_tokens}", (KnownContinuation,), {})
    assistant = drafter_type([p + e for p, e in zip(prompts, expected)], delay)
    engine = Engine(llama, kv_budget=64, block_size=4, max_tokens_per_round=64, max_running=3,
                    assistant=assistant, num_draft_tokens=num_draft_tokens)
    ids = [engine.add_request(p, max_new_tokens=MAX_NEW) for p in prompts]
    run_to_end(engine)
    engine.outputs = [engine.get_output(i) for i in ids]
    assert [output.output_ids for output in engine.outputs] == expected
    assert_pool_full(engine)
    return engine, assistant


def test_a_drafter_dearer_than_the_forward_stops_being_asked(llama):
    engine, assistant = _run(llama, delay=0.25)  # a tiny model's round takes milliseconds
    drafting_rounds = [r for r in engine.stats.rounds if r.num_draft_tokens]
    assert assistant.calls <= 3 and len(drafting_rounds) <= 2  # the untimed first call, one timed, then none
    assert len(engine.stats.rounds) > 20  # the rest decoded plainly


def test_a_free_drafter_that_is_always_right_drafts_nearly_every_round(llama):
    engine, _ = _run(llama, delay=0.0)
    decode_rounds = [r for r in engine.stats.rounds if r.num_decode_rows]
    drafting = [r for r in decode_rounds if r.num_draft_tokens]
    assert len(drafting) >= 0.7 * len(decode_rounds)
    assert sum(r.num_accepted for r in drafting) == sum(r.num_draft_tokens for r in drafting)  # always right


def test_a_request_at_zero_drafts_takes_the_plain_path(llama):
    engine, assistant = _run(llama, delay=0.0, num_draft_tokens=0)
    assert assistant.calls == 0  # never asked
    assert all(output.metrics.num_speculative_rounds == 0 for output in engine.outputs)  # no verify row either
    assert all(r.num_draft_tokens == 0 and r.num_output_tokens == r.num_sampled for r in engine.stats.rounds)


def test_engines_of_one_model_and_drafter_share_what_they_measured(llama):
    from hf_kvspec.speculative.drafters.ngram import NgramAssistant

    first = Engine(llama, kv_budget=32, assistant=NgramAssistant())
    second = Engine(llama, kv_budget=32, assistant="ngram")
    fixed = Engine(llama, kv_budget=32, assistant="ngram", draft_lengths="fixed")
    other = Engine(llama, kv_budget=32, assistant=type("OtherDrafter", (KnownContinuation,), {})([]))
    assert first.drafts.budget.costs is second.drafts.budget.costs  # the second explores nothing again
    assert other.drafts.budget.costs is not first.drafts.budget.costs and fixed.drafts.budget is None
    assert first.drafts.budget.requests is not second.drafts.budget.requests  # acceptance stays per engine
    with pytest.raises(ValueError, match="draft_lengths must be 'goodput'"):
        Engine(llama, kv_budget=32, assistant="ngram", draft_lengths="auto")


def test_a_self_drafter_built_on_another_model_is_refused_by_name(llama):
    from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant

    other = tiny_model("llama")
    with pytest.raises(ValueError, match="build it on the engine's model"):
        Engine(llama, kv_budget=32, assistant=QuantizedSelfAssistant(other, "int8"))
    assert Engine(llama, kv_budget=32, assistant=QuantizedSelfAssistant(llama, "int8")).drafts.drafters.shared_cost

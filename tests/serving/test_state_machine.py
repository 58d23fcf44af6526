"""A hypothesis state machine over add / step / cancel / preempt: after every operation the pool and the
block tables agree (ref counts, free + used = total, running requests and only they hold rows, stored lengths
equal each request's progress); at the end every finished request equals its plain greedy run and the pool is
full."""

from __future__ import annotations

import functools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end

MAX_NEW = 6
_SYSTEM = random_prompts([9], seed=30)[0]
PROMPTS = [_SYSTEM + tail for tail in random_prompts([2, 5, 8], seed=31)] + random_prompts([3, 13], seed=32)


@functools.cache
def model():
    return tiny_model("llama")


@functools.cache
def reference(which: int) -> tuple[int, ...]:
    return tuple(greedy_reference(model(), PROMPTS[which], MAX_NEW))


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # 12 blocks of 4: the longest request (17 + 6 - 1 = 22 slots) fits alone, three do not fit together
        self.engine = Engine(model(), kv_budget=12, block_size=4, max_tokens_per_round=6, max_running=3)
        self.prompt_of: dict[int, int] = {}
        self.cancelled: set[int] = set()

    def live(self) -> list[int]:
        return [r.request_id for r in self.engine.scheduler.running + self.engine.scheduler.waiting]

    @rule(which=st.integers(0, len(PROMPTS) - 1), salt=st.sampled_from([None, None, "tenant"]))
    def add(self, which, salt):
        self.prompt_of[self.engine.add_request(PROMPTS[which], max_new_tokens=MAX_NEW, salt=salt)] = which

    @rule()
    def step(self):
        self.engine.step()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def cancel(self, data):
        request_id = data.draw(st.sampled_from(self.live()))
        self.engine.cancel(request_id)
        self.cancelled.add(request_id)

    @precondition(lambda self: self.engine.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.engine.scheduler.preempt(data.draw(st.sampled_from(self.engine.scheduler.running)))

    @invariant()
    def pool_and_tables_agree(self):
        cache, scheduler = self.engine.cache, self.engine.scheduler
        pool, tables = cache.pool, cache.tables
        assert pool.num_free() + pool.num_used() == pool.num_blocks
        holders = [0] * pool.num_blocks
        for table in tables.tables():
            for block in table:
                holders[block] += 1
        assert holders == [pool.ref_count(b) for b in range(pool.num_blocks)]  # T2
        assert sorted(cache.seq_ids) == sorted(r.request_id for r in scheduler.running)
        for request in scheduler.running:
            assert cache.length(request.request_id) == request.num_computed
            row = cache._row_of[request.request_id]
            assert tables.length(row) == request.num_computed  # R1: no reservation outlives a round

    def teardown(self):
        run_to_end(self.engine)
        for request_id, which in self.prompt_of.items():
            out = self.engine.get_output(request_id)
            expected = list(reference(which))
            if request_id in self.cancelled:
                assert out.finish_reason is FinishReason.CANCELLED
                assert out.output_ids == expected[: len(out.output_ids)]
            else:
                assert out.output_ids == expected
        assert_pool_full(self.engine)


EngineMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestEngineMachine = EngineMachine.TestCase


class SpeculatingEngineMachine(EngineMachine):
    """The same machine with an always-right draft model: drafts take the rounds' spare budget and blocks, and
    every verify row is rolled back to its accepted path before the invariants are checked."""

    def __init__(self):
        super().__init__()
        self.engine = Engine(model(), kv_budget=12, block_size=4, max_tokens_per_round=6, max_running=3,
                             assistant=DraftModelAssistant(model(), num_draft_tokens=3))


SpeculatingEngineMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
TestSpeculatingEngineMachine = SpeculatingEngineMachine.TestCase

"""Concurrent calls on one model (#29 item 8): feature capture is scoped to the calling thread, and one assistant
instance serves one call at a time.

Reference: each call's output run alone, before the threads start (greedy, so token-identical).
"""

from __future__ import annotations

import threading

import pytest
import torch

import hf_kvspec
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.speculative.drafters.base import Assistant, DraftProposal
from hf_kvspec.speculative.drafters.features import FeatureCapture
from tests.tiny_models import tiny_model

REPEATS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def _ids(batch, length, seed):
    return torch.randint(1, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                          pad_token_id=0, **kwargs)


def _run_together(jobs: list) -> list[str]:
    """Run each ``(call, reference)`` REPEATS times in its own thread; the problems seen (errors, mismatches)."""
    problems: list[str] = []

    def work(call, reference):
        for _ in range(REPEATS):
            try:
                if not torch.equal(call(), reference):
                    problems.append("output differs from the call run alone")
            except Exception as err:
                problems.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return problems


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_feature_reading_assistant_beside_a_plain_generate_on_the_same_model(target, kind):
    """The other thread's forwards (another batch size and length) must not reach this call's captured features."""
    if kind == "eagle":
        head = EagleHead(EagleConfig.for_base_model(target, "tiny"))
        make = lambda: hf_kvspec.EagleAssistant(head, draft_vocab_size=None)  # noqa: E731
    else:
        heads = MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=2))
        make = lambda: hf_kvspec.MedusaAssistant(heads, draft_vocab_size=None)  # noqa: E731
    spec_ids, plain_ids = _ids(2, 9, 1), _ids(3, 15, 2)

    def speculative():
        return _generate(target, spec_ids, custom_generate=hf_kvspec.speculative_generate, assistant=make())

    def plain():
        return _generate(target, plain_ids)

    assert _run_together([(speculative, speculative()), (plain, plain())]) == []


def test_feature_capture_ignores_forwards_of_another_thread(target):
    ids = _ids(1, 5, 3)
    with FeatureCapture(target, [-1]) as capture:
        target(ids)
        other = threading.Thread(target=lambda: target(_ids(3, 7, 4)))  # after ours: it would overwrite ours
        other.start()
        other.join()
    assert capture.features().shape == (1, 5, target.config.hidden_size)


class _SlowAssistant(Assistant):
    """Drafts nothing, but holds each round until told to go on: keeps a call running while another starts."""

    def __init__(self):
        super().__init__(num_draft_tokens=1)
        self.started, self.go = threading.Event(), threading.Event()

    def propose(self, ctx):
        self.started.set()
        self.go.wait(timeout=30)
        return DraftProposal(ctx.buffer.tokens[:, :0])


def test_one_assistant_in_two_calls_at_once_is_refused_as_in_use(target):
    assistant, ids = _SlowAssistant(), _ids(1, 6, 5)
    outputs = []
    first = threading.Thread(target=lambda: outputs.append(_generate(
        target, ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant)))
    first.start()
    try:
        assert assistant.started.wait(timeout=30)
        with pytest.raises(RuntimeError, match="in use by another generate call"):
            _generate(target, ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
    finally:
        assistant.go.set()
        first.join()
    assert torch.equal(outputs[0], _generate(target, ids))  # the first call was not disturbed
    # released when the call ended: the same instance runs again
    again = _generate(target, ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
    assert torch.equal(again, outputs[0])

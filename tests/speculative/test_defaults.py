"""The assistants' defaults: the shipped draft vocabulary (also for the exit adapter), auto sizing that falls back
to plain decoding when drafts never land (visible in the telemetry) and stays on when they always do."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec.heads.bundled import load_bundled_heads
from hf_kvspec.speculative.autotree import PLAIN, AutoTreeSize, Shape
from hf_kvspec.speculative.draft_vocab import SHIPPED_SIZE, DraftVocabulary
from hf_kvspec.speculative.drafters.early_exit import EarlyExitAssistant
from tests.speculative.helpers import batch
from tests.speculative.test_draft_vocab_autotree import _simulate
from tests.speculative.test_tree_oracle import eagle_head
from tests.tiny_models import tiny_model


def test_bundled_assistants_default_to_the_shipped_vocabulary_and_auto_size():
    eagle_v2 = hf_kvspec.EagleAssistant(load_bundled_heads("eagle_v2"))
    medusa = hf_kvspec.MedusaAssistant(load_bundled_heads("medusa"))
    early = EarlyExitAssistant(None, adapter=load_bundled_heads("early_exit"))
    for assistant in (eagle_v2, medusa, early):
        assert assistant.vocab is not None and assistant.vocab.size == SHIPPED_SIZE
        assert assistant.auto is not None
    assert medusa.tree.num_nodes == 8  # the small tree
    assert hf_kvspec.EagleAssistant(load_bundled_heads("eagle_v2"), draft_vocab_size=None).vocab is None
    # the EAGLE-3 head drafts over the vocabulary it was trained with (its own [8192, H] projection): no ranking on top
    eagle = hf_kvspec.EagleAssistant(load_bundled_heads("eagle"))
    assert eagle.vocab is None and eagle.auto is not None
    assert eagle.head.has_draft_vocab and eagle.head.draft_vocab_ids().numel() == eagle.head.config.draft_vocab_size


def test_shipped_without_a_ranking_is_the_full_vocabulary():
    target = tiny_model("llama", seed=0)
    assert DraftVocabulary.resolve(eagle_head(target), "shipped") is None  # no directory, no ranking
    assert DraftVocabulary.resolve(eagle_head(target), None) is None
    ranked = DraftVocabulary.resolve(eagle_head(target), "shipped", torch.arange(50))
    assert ranked.size == 50  # fewer ranked ids than SHIPPED_SIZE: all of them


def test_full_logits_are_the_projection_at_kept_ids_and_minus_inf_elsewhere():
    torch.manual_seed(0)
    weight, hidden = torch.randn(40, 8), torch.randn(2, 3, 8)
    vocab = DraftVocabulary(torch.tensor([5, 0, 17, 39]))
    full = vocab.full_logits(hidden, weight)  # [2, 3, 40]
    expected = hidden @ weight.T
    kept = torch.tensor([5, 0, 17, 39])
    torch.testing.assert_close(full[..., kept], expected[..., kept])
    others = torch.ones(40, dtype=torch.bool)
    others[kept] = False
    assert torch.isneginf(full[..., others]).all()


@pytest.mark.parametrize("bs", [1, 3])
def test_early_exit_with_a_draft_vocabulary_stays_greedy_identical(bs):
    target = tiny_model("llama", seed=0)
    ids, mask = batch(bs)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    ranking = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1))
    assistant = EarlyExitAssistant(1, num_draft_tokens=3, draft_vocab_size=20, draft_vocab=ranking)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **kwargs)
    assert torch.equal(out, expected) and assistant.vocab.size == 20
    with pytest.raises(ValueError, match="needs a token ranking"):
        EarlyExitAssistant(1, draft_vocab_size=20)


def test_auto_falls_back_to_plain_with_a_drafter_that_is_never_right_and_says_so(monkeypatch):
    from types import SimpleNamespace

    from hf_kvspec.speculative import loop

    ticks = iter(range(10**6))  # the loop's clock: one second per reading, so draft and verify each cost one step
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    target = tiny_model("llama", seed=0)
    ids, mask = batch(1)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    assistant = hf_kvspec.EagleAssistant(eagle_head(target))  # random weights: drafts are noise; auto by default
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    stats = out.acceptance
    assert stats.fallback_rounds >= stats.rounds // 2, stats  # mostly plain steps
    assert stats.summary()["fallback_rounds"] == stats.fallback_rounds  # in the telemetry


def _cpu_verify(nodes: int) -> float:
    return 0.010 * (1 + 0.05 * min(nodes, 8) + 0.3 * max(nodes - 8, 0))  # verify cost steps up past 8 nodes


def test_auto_stays_on_with_a_drafter_that_is_always_right_and_goes_plain_with_one_that_never_is():
    menu = [PLAIN, Shape(1, 1), Shape(2, 2), Shape(4, 3), Shape(8, 4), Shape(16, 5)]
    # one row per round (bs 1): the optimism bonus must fade on its own evidence alone
    always = _simulate(AutoTreeSize(menu), lambda s, d: 1.0, _cpu_verify, 0.0005, rows=1)
    assert PLAIN not in always  # never falls back when every draft is accepted
    never = _simulate(AutoTreeSize(menu), lambda s, d: 0.0, _cpu_verify, 0.0005, rows=1)
    assert never.count(PLAIN) >= 0.9 * len(never)  # plain steps, with a rare re-probe


def test_auto_estimates_carry_over_to_a_call_with_as_many_rows_and_restart_for_another_batch():
    menu = [PLAIN, Shape(1, 1), Shape(4, 2)]
    auto = AutoTreeSize(menu)
    auto.start_call(1)
    _simulate(auto, lambda s, d: 0.5, _cpu_verify, 0.0005, rounds=20, rows=1)
    measured = dict(auto.verify)
    assert measured
    auto.start_call(1)  # the next generate call, one row again: what was measured stays
    assert auto.verify == measured
    auto.start_call(4)  # four rows: verify costs differ, start afresh
    assert auto.verify == {} and auto.rates == {}

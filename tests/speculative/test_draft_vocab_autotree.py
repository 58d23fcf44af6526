"""Frequency-ranked draft vocabulary (rankings, projection vs the full head, exact through the loop, drafts only from
the draft vocabulary, the shipped rankings) and the automatic tree size (synthetic acceptance and costs)."""

from __future__ import annotations

import random

import pytest
import torch

import hf_kvspec
from hf_kvspec.speculative.autotree import PLAIN, AutoTreeSize, Shape, dynamic_menu, fit_tree, static_menu
from hf_kvspec.speculative.draft_vocab import (
    RANKING_FILE,
    DraftVocabulary,
    load_ranking,
    rank_tokens,
    ranking_from_counts,
    save_ranking,
)
from hf_kvspec.speculative.drafters.base import RoundOutcome
from hf_kvspec.speculative.drafters.eagle import EagleAssistant
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant
from hf_kvspec.speculative.tree import DEFAULT_CHOICES, StaticTree
from tests.speculative.helpers import batch
from tests.speculative.test_tree_oracle import eagle_head, medusa_heads
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


# ---------------------------------------------------------------------------------------------- rankings
class _CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - ord("a") for c in text]}


def test_ranking_counts_ties_and_special_ids(tmp_path):
    ranking = rank_tokens(["abca", "cab", "d"], _CharTokenizer(), vocab_size=6, always=[5], limit=5)
    assert ranking.dtype == torch.int32 and ranking.tolist() == [5, 0, 1, 2, 3]  # a, b, c = 3 each, then d
    assert ranking_from_counts(torch.tensor([0, 2, 2, 9])).tolist() == [3, 1, 2, 0]
    save_ranking(tmp_path / RANKING_FILE, ranking, sources="test")
    assert load_ranking(tmp_path / RANKING_FILE).tolist() == ranking.tolist()


def test_draft_vocabulary_logits_are_the_full_projections_columns():
    torch.manual_seed(0)
    weight, hidden = torch.randn(50, 8), torch.randn(2, 3, 8)
    vocab = DraftVocabulary(torch.tensor([7, 3, 41, 0]))
    full = torch.einsum("bth,vh->btv", hidden, weight)
    torch.testing.assert_close(vocab.logits(hidden, weight), full[..., [7, 3, 41, 0]])
    assert vocab.to_target(torch.tensor([[2, 0]])).tolist() == [[41, 7]]
    with pytest.raises(ValueError, match="distinct"):
        DraftVocabulary(torch.tensor([1, 1]))


def test_bundled_heads_ship_a_ranking_that_loads_by_itself():
    for kind in ("medusa", "eagle_v2"):  # the EAGLE-3 head ("eagle") carries a trained draft vocabulary instead
        head = hf_kvspec.load_bundled_heads(kind)
        vocab = DraftVocabulary.for_head(head, 4096)
        assert vocab.size == 4096 and int(vocab.token_ids.max()) < head.config.base_vocab_size
    with pytest.raises(FileNotFoundError, match="draft_vocab"):
        DraftVocabulary.for_head(medusa_heads(tiny_model("llama", seed=0)), 10)


# ---------------------------------------------------------------------------------------------- through the loop
def _recording(assistant):
    proposals = []
    propose = assistant.propose
    assistant.propose = lambda ctx: proposals.append(propose(ctx)) or proposals[-1]
    return proposals


@pytest.mark.parametrize("kind", ["medusa", "eagle-dynamic", "eagle-static"])
def test_draft_vocabulary_is_exact_and_drafts_only_its_ids(target, kind):
    ids, mask = batch(3)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0, repetition_penalty=1.3)
    expected = target.generate(ids, **kwargs)
    ranking = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    allowed = set(ranking[:24].tolist())
    assistant = {
        "medusa": lambda: MedusaAssistant(medusa_heads(target), draft_vocab_size=24, draft_vocab=ranking),
        "eagle-dynamic": lambda: EagleAssistant(eagle_head(target), depth=3, top_k=3, total_tokens=8,
                                                draft_vocab_size=24, draft_vocab=ranking),
        "eagle-static": lambda: EagleAssistant(eagle_head(target), tree=[(0,), (1,), (0, 0), (0, 1)],
                                               draft_vocab_size=24, draft_vocab=ranking),
    }[kind]()
    proposals = _recording(assistant)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant, **kwargs)
    assert torch.equal(out, expected)
    drafted = torch.cat([p.tokens.flatten() for p in proposals])
    assert drafted.numel() > 0 and set(drafted.tolist()) <= allowed


def test_eagle_draft_vocabulary_tree_equals_the_full_heads_tree_when_it_holds_everything(target):
    """A draft vocabulary of every id, in a shuffled order: the same tree as the full projection."""
    ids, mask = batch(3)
    # a fixed tree size: "auto" would choose sizes from measured times, which differ between the two runs
    full = EagleAssistant(eagle_head(target), depth=3, top_k=3, total_tokens=8, num_draft_tokens=None)
    shuffled = EagleAssistant(eagle_head(target), depth=3, top_k=3, total_tokens=8, num_draft_tokens=None,
                              draft_vocab_size=96,
                              draft_vocab=torch.randperm(96, generator=torch.Generator().manual_seed(1)))
    runs = []
    for assistant in (full, shuffled):
        proposals = _recording(assistant)
        target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                        custom_generate=hf_kvspec.speculative_generate, assistant=assistant)
        runs.append(proposals)
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):  # same nodes as sets per row (ties in rank may order siblings differently)
        assert [sorted(r) for r in a.tokens.tolist()] == [sorted(r) for r in b.tokens.tolist()]


# ---------------------------------------------------------------------------------------------- auto tree size
def test_fit_tree_caps_depth_then_nodes():
    tree = StaticTree.from_choices(DEFAULT_CHOICES)
    fitted = fit_tree(tree, 5, max_depth=2)
    assert fitted.max_depth <= 2 and fitted.num_nodes == 5
    assert fitted.choices == tuple(c for c in DEFAULT_CHOICES if len(c) <= 2)[:5]
    assert fit_tree(tree, 100).num_nodes == tree.num_nodes


def test_menus():
    menu = static_menu(StaticTree.from_choices(DEFAULT_CHOICES))
    assert menu[0] == PLAIN and menu[-1] == Shape(26, 4) and all(s.depth <= 4 for s in menu)
    dynamic = dynamic_menu(depth=5, total_tokens=24, top_k=4)
    assert dynamic[0] == PLAIN and dynamic[-1] == Shape(24, 5) and Shape(1, 1) in dynamic
    assert all(1 <= s.depth <= min(5, s.nodes) for s in dynamic[1:])


def _simulate(auto, accept, verify_s, draft_s_per_level, rounds=400, rows=4, seed=0):
    """Feed ``auto`` rounds of its own choices: a row keeps depth d of shape s with chance ``accept(s, d)``;
    verify costs ``verify_s(nodes)``, drafting ``draft_s_per_level * depth``. Returns the last 50 choices."""
    rng = random.Random(seed)
    choices = []
    for _ in range(rounds):
        nodes = auto.choose()
        shape = auto.shape
        accepted = []
        for _ in range(rows):
            kept = 0
            while kept < shape.depth and rng.random() < accept(shape, kept + 1):
                kept += 1
            accepted.append(kept)
        auto.update(RoundOutcome(10, torch.tensor(accepted), torch.ones(rows, dtype=torch.bool), nodes,
                                 draft_s_per_level * shape.depth, verify_s(nodes)))
        choices.append(shape)
    return choices[-50:]


def _true_rate(shape, accept, verify_s, draft_s_per_level):
    expected, reach = 1.0, 1.0
    for d in range(1, shape.depth + 1):
        reach *= accept(shape, d)
        expected += reach
    return expected / (verify_s(shape.nodes) + draft_s_per_level * shape.depth)


MENU = [PLAIN, Shape(1, 1), Shape(4, 2), Shape(8, 3), Shape(16, 4), Shape(32, 5)]
WIDTH = {Shape(1, 1): 1, Shape(4, 2): 2, Shape(8, 3): 2.5, Shape(16, 4): 3.5, Shape(32, 5): 5}
VERIFY = {
    "gpu-like": lambda n: 0.010 * (1 + 0.002 * n),  # verifying nodes is almost free: the widest tree wins
    "cpu-steps": lambda n: 0.010 * (1 + 0.1 * min(n, 8) + 0.3 * max(n - 8, 0)),  # a kernel step past 8 nodes
    "cpu-slope": lambda n: 0.010 * (1 + 0.18 * min(n, 5) + 0.06 * max(n - 5, 0)),
    "useless-drafts": lambda n: 0.010 * (1 + 0.02 * n),  # nothing is ever accepted: plain decoding wins
}


@pytest.mark.parametrize("case", sorted(VERIFY))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_tree_picks_the_known_optimum(case, seed):
    """Wider trees accept more at every depth (1 - miss ** width). Where the optimum stands out (>= 10% ahead) the
    controller settles on it; where shapes are within a few percent, on one within 5% of it (acceptance is estimated
    from ~20 decayed rounds of 4 rows, which cannot tell 3% apart)."""
    hit = 0.0 if case == "useless-drafts" else 0.55
    accept = lambda s, d: 1 - (1 - hit) ** WIDTH[s]  # noqa: E731
    rate = {s: _true_rate(s, accept, VERIFY[case], 0.0005) for s in MENU}
    best = max(MENU, key=rate.get)
    last = _simulate(AutoTreeSize(MENU), accept, VERIFY[case], 0.0005, seed=seed)
    modal = max(set(last), key=last.count)
    assert last.count(modal) >= 0.8 * len(last)
    assert rate[modal] >= 0.95 * rate[best], (best, modal, rate)
    if sorted(rate.values())[-2] < rate[best] / 1.1:
        assert modal == best
    assert best == {"gpu-like": Shape(32, 5), "useless-drafts": PLAIN}.get(case, best)


def test_auto_tree_takes_every_round_as_a_cost_sample():
    """The prompt is prefilled in a forward of its own, so the call's first round is a cost sample too."""
    auto = AutoTreeSize(MENU)
    assert auto.choose() == 32 and auto.shape == Shape(32, 5)
    auto.update(RoundOutcome(10, torch.tensor([2]), torch.tensor([True]), 32, 5.0, 50.0))
    assert auto.verify == {32: [1.0, 50.0]} and auto.draft == [5.0, 5.0]  # [weight, s]; [levels drafted, s]
    assert auto.rates[Shape(32, 5)].offered[0] == 1


def test_assistants_take_auto(target):
    ids, mask = batch(3)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    for assistant in (MedusaAssistant(medusa_heads(target), num_draft_tokens="auto"),
                      EagleAssistant(eagle_head(target), num_draft_tokens="auto")):
        assert isinstance(assistant.auto, AutoTreeSize)
        out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                              return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected)
        assert 0 in out.acceptance.draft_lengths  # the plain step it measures early on

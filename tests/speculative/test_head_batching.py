"""Head drafting for many sequences at once (the serving engine's ``HeadDrafters``): ``EagleAssistant.propose_each``
and ``MedusaAssistant.propose_each`` against each sequence drafted alone through the ``generate`` path
(``begin``/``propose``/``observe`` on a one-row buffer), over several rounds with different lengths, node counts,
depth caps, accepted paths and a sequence whose first columns have no features (a prefix-cache hit); and the
dynamic tree's pool re-ranked per row against a tree grown for that row alone."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import DraftContext, RoundOutcome
from hf_kvspec.speculative.drafters.eagle import EagleAssistant
from hf_kvspec.speculative.drafters.features import ensure_attached
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant
from hf_kvspec.speculative.tree import grow_dynamic_pool, grow_dynamic_tree
from tests.tiny_models import randomized, tiny_model

#: per round, per sequence: (nodes asked, depth cap, drafts accepted after it)
ROUNDS = [((6, 9, 2), (3, 9, 0), (6, 1, 1)),
          ((4, 9, 0), (6, 2, 2), (1, 9, 0)),
          ((6, 9, 3), (2, 9, 1), (5, 3, 0))]
LENGTHS = (7, 12, 4)  # tokens of each sequence at its start (the prompt and the first token)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)



def _one_row(tokens: list[int]) -> TokenBuffer:
    return TokenBuffer(torch.tensor([tokens]), None, 0)


def _ctx(tokens: list[int], count: int, max_depth: int) -> DraftContext:
    return DraftContext(_one_row(tokens), None, count, False, torch.ones(1, dtype=torch.bool), None,
                        max_depth=max_depth)


def _outcome(kept_width: int, accepted: int, path: torch.Tensor) -> RoundOutcome:
    nodes = torch.arange(accepted)[None]
    return RoundOutcome(kept_width, torch.tensor([accepted]), torch.ones(1, dtype=torch.bool), 0, 0.0, 0.0, path,
                        accepted_nodes=nodes)


@pytest.mark.parametrize("tree", ["dynamic", [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (2,)]])
def test_eagle_batched_proposals_equal_each_sequence_drafted_alone(target, tree):
    head = randomized(EagleHead(EagleConfig.for_base_model(target, "tiny")), 2, 0.2)
    width = head.config.base_hidden_size
    torch.manual_seed(0)
    sequences = [torch.randint(1, 60, (n,)).tolist() for n in LENGTHS]
    fed = [n - 1 for n in LENGTHS]
    fed[2] = 1  # the third sequence's cache held its first two columns: no features for them
    features = [torch.randn(1, count, width) for count in fed]
    shared = EagleAssistant(head, tree=tree, depth=3, top_k=2, total_tokens=6, num_draft_tokens=None,
                            draft_vocab_size=None)
    states = [shared.open_rows(target, len(seq), f) for seq, f in zip(sequences, features)]
    alone = []
    for seq, f in zip(sequences, features):
        assistant = EagleAssistant(head, tree=tree, depth=3, top_k=2, total_tokens=6, num_draft_tokens=None,
                                   draft_vocab_size=None)
        assistant.begin(target, _one_row(seq), f)
        alone.append(assistant)
    for plan in ROUNDS:
        counts, depths = [p[0] for p in plan], [p[1] for p in plan]
        batched = shared.propose_each(states, sequences, counts, depths)
        for i, assistant in enumerate(alone):
            reference = assistant.propose(_ctx(sequences[i], counts[i], depths[i]))
            assert batched[i].tokens.tolist() == reference.tokens.tolist(), f"sequence {i}"
            assert batched[i].parents.reshape(-1).tolist() == reference.parents.reshape(-1).tolist()
            assert batched[i].tokens.shape[1] <= counts[i]
            # the round: k drafts accepted (stand-in tokens), then the next token; the path's features
            accepted = plan[i][2]
            sequences[i] = sequences[i] + torch.randint(1, 60, (accepted + 1,)).tolist()
            path = torch.randn(1, 1 + accepted, width)
            assistant.observe(_outcome(len(sequences[i]) - 1, accepted, path))
            states[i].observe(len(sequences[i]) - 1, path)
    for state, assistant in zip(states, alone):  # the one-row states hold what the lone drafters hold
        assert state.cached == assistant.rows.cached
        torch.testing.assert_close(state.cache.layers[0].keys, assistant.rows.cache.layers[0].keys)


def test_medusa_batched_proposals_equal_each_sequence_drafted_alone(target):
    heads = randomized(MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=3)), 1, 0.3)
    tree = [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0)]
    shared = MedusaAssistant(heads, tree=tree, num_draft_tokens=None, draft_vocab_size=None)
    torch.manual_seed(0)
    features = torch.randn(3, target.config.hidden_size)
    ensure_attached(heads, target)  # the engine attaches when a request's state opens
    counts, depths = [6, 2, 4], [9, 9, 1]
    batched = shared.propose_each(features, counts, depths)
    for i in range(3):
        alone = MedusaAssistant(heads, tree=tree, num_draft_tokens=None, draft_vocab_size=None)
        alone.begin(target, _one_row([1, 2]), features[i:i + 1, None])
        reference = alone.propose(_ctx([1, 2], counts[i], depths[i]))
        assert batched[i].tokens.tolist() == reference.tokens.tolist()
        assert batched[i].parents.tolist() == reference.parents.tolist()
    assert [p.tokens.shape[1] for p in batched] == [6, 2, 3]  # depth 1 leaves the tree's three depth-1 nodes


def test_dynamic_pool_row_tree_is_the_tree_grown_for_that_row_alone():
    torch.manual_seed(3)
    vocab, top_k = 30, 3
    table = torch.randn(vocab, vocab).log_softmax(-1)  # the next token's log-probabilities after each token
    root = torch.randn(4, vocab).log_softmax(-1)

    def expand(tokens, slot):
        return table[tokens]  # [B, m, V]

    pool = grow_dynamic_pool(root, expand, 4, top_k)
    for row in range(4):
        for total, depth in ((1, 4), (5, 2), (9, 4), (20, 3), (40, 4)):
            alone = grow_dynamic_tree(root[row:row + 1], expand, depth, top_k, total)
            picked = pool.row_tree(row, total, depth)
            assert picked.tokens.tolist() == alone.tokens.tolist()
            assert picked.parents.tolist() == alone.parents.tolist()

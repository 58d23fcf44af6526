"""Tree verification inside the speculative loop: token-identical to plain greedy, the cache keeps exactly the
accepted path, sampling through a tree has the target's distribution, attention without 4D masks is refused.

The drafters here are hand-written so that what a tree proposes is known: the oracle puts the target's own greedy
continuation (read from a plain ``generate`` run) on a branch that is not the first child, the random one proposes
noise. ``rounds.py`` does the tree work; these tests treat the loop as a black box next to stock ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_kvspec
from hf_kvspec import _compat
from hf_kvspec.speculative.drafters.base import Assistant, DraftProposal
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
from hf_kvspec.speculative.rounds import check_tree_attention, path_scores, path_scores_per_node
from hf_kvspec.speculative.tree import CandidateTree
from hf_kvspec.speculative.verify import rejection_verify
from tests.speculative.helpers import batch
from tests.tiny_models import tiny_model

MAX_NEW = 20
PENALTY = 1.3  # path-dependent processor on in every greedy run

# Topologies with the target's path marked: (parents, on_path). The path is never the first child of the root
# in the first one; the second has a deeper path (rows with per-row trees accept different depths -> holes).
STATIC = ([-1, -1, 0, 1, 1, 4, 3], [False, True, False, False, True, True, False])
OTHER = ([-1, 0, -1, 0, 3, 2, 4], [True, False, False, True, True, False, True])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def _plain(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                           repetition_penalty=PENALTY, **kw)


class TreeDrafter(Assistant):
    """Proposes a fixed topology (shared, or one per row) with tokens chosen by ``kind``:
    ``"oracle"``: nodes on the marked path carry the reference continuation, the others a different token;
    ``"random"``: every node a random token."""

    proposes_trees = True

    def __init__(self, kind: str, reference: torch.Tensor, per_row: bool, vocab: int, on_round=None):
        super().__init__(num_draft_tokens=len(STATIC[0]))
        self.kind, self.reference, self.per_row, self.vocab = kind, reference, per_row, vocab
        self.on_round = on_round
        self.gen = torch.Generator().manual_seed(0)
        self.buffer = None

    def release(self, rows):  # no per-row state: finished rows may leave
        self.staying(rows)

    def propose(self, ctx) -> DraftProposal:
        self.buffer = ctx.buffer
        topologies = [OTHER if self.per_row and row % 2 else STATIC for row in range(ctx.history.ids.shape[0])]
        parents = torch.tensor([t[0] for t in topologies])  # [B, N]
        tokens = torch.stack([self._tokens(ctx.history, row, *topo) for row, topo in enumerate(topologies)])
        if not self.per_row:
            parents = parents[0]
        num = ctx.num_draft_tokens
        return DraftProposal(tokens[:, :num], parents=parents[..., :num])

    def _tokens(self, history: History, row: int, parents, on_path) -> torch.Tensor:
        if self.kind == "random":
            return torch.randint(3, self.vocab, (len(parents),), generator=self.gen)
        ref = self._reference_row(history, row)
        length = int(history.lengths[row])
        depth = []
        out = []
        for n, parent in enumerate(parents):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            at = length + depth[n] - 1
            right = int(ref[at]) if at < ref.shape[0] else 0
            out.append(right if on_path[n] else (right + 1 + n) % self.vocab)
        return torch.tensor(out)

    def _reference_row(self, history: History, row: int) -> torch.Tensor:
        # rows may have left the batch: find this row's reference by its prompt
        prompt = history.ids[row, : history.prompt_len]
        match = (self.reference[:, : history.prompt_len] == prompt).all(dim=1).nonzero()
        return self.reference[int(match[0])]

    def observe(self, outcome) -> None:
        if self.on_round is not None:
            self.on_round(self, outcome)


def _speculative(target, ids, mask, drafter, cache=None, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                           repetition_penalty=PENALTY, custom_generate=hf_kvspec.speculative_generate,
                           assistant=drafter, cache=cache, **kw)


def _cache(kind: str, target):
    if kind == "paged":
        return hf_kvspec.PagedCache(target.config, block_size=4, num_blocks=64)
    return None if kind == "generate" else DynamicCache(config=target.config)


@pytest.mark.parametrize("cache_kind", ["generate", "dynamic", "paged"])
@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_tree_greedy_matches_plain(target, kind, per_row, bs, cache_kind):
    ids, mask = batch(bs)
    expected = _plain(target, ids, mask)
    drafter = TreeDrafter(kind, expected, per_row, target.config.vocab_size)
    out = _speculative(target, ids, mask, drafter, cache=_cache(cache_kind, target), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.acceptance
    assert not stats.empty
    if kind == "oracle":  # the whole marked path (depth 3 or 4) is accepted until the end nears
        assert stats.accepted[2] >= 3 and stats.tokens_per_target_forward > 2.5
    else:
        assert stats.mean_acceptance < 0.1


@pytest.mark.parametrize("attn", ["eager", "kvspec_gqa", "kvspec_paged"])
def test_tree_greedy_through_other_attention_functions(attn):
    """The tree's 4D mask through eager (additive float mask) and our attention functions (kvspec_paged reads a
    PagedCache's pages through block tables): per-row trees, left padding, holes."""
    ids, mask = batch(3)
    expected = _plain(tiny_model("llama", seed=0), ids, mask)
    hf_kvspec.register()
    try:
        model = tiny_model("llama", seed=0, attn_implementation=attn)
        cache = hf_kvspec.PagedCache(model.config, block_size=4, num_blocks=64) if attn == "kvspec_paged" else None
        drafter = TreeDrafter("oracle", expected, True, model.config.vocab_size)
        out = _speculative(model, ids, mask, drafter, cache=cache, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.acceptance.accepted[2] >= 3
    finally:
        hf_kvspec.unregister()


def test_cache_after_each_round_equals_plain_forward(target):
    """After every round, each row's real cache columns hold what a plain forward over that row's committed
    tokens computes. fp32: the tree forward adds masked columns and a different batch layout, so sums are
    reordered; differences stay at float32 rounding of O(1) values (atol 1e-5)."""
    ids, mask = batch(3)
    expected = _plain(target, ids, mask)
    cache = DynamicCache(config=target.config)
    checked = []

    def check(drafter, outcome):
        buffer = drafter.buffer
        width = outcome.kept_width
        assert cache.get_seq_length() == width
        for row in range(buffer.tokens.shape[0]):
            real = buffer.mask[row, :width].bool()
            tokens = buffer.tokens[row, :width][real][None]
            plain = DynamicCache(config=target.config)
            with torch.no_grad():
                target(input_ids=tokens, cache=plain, use_cache=True)
            for got, want in zip(cache.layers, plain.layers):
                torch.testing.assert_close(got.keys[row][:, real], want.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got.values[row][:, real], want.values[0], atol=1e-5, rtol=1e-5)
        checked.append(width)

    drafter = TreeDrafter("oracle", expected, True, target.config.vocab_size, on_round=check)
    out = _speculative(target, ids, mask, drafter, cache=cache)
    assert torch.equal(out, expected)
    assert len(checked) >= 3 and bool((drafter.buffer.mask == 0).any())  # several rounds, holes included


def test_hidden_states_follow_the_accepted_path(target):
    """A feature drafter gets [A, 1 + longest, H] in path order: equal to the hidden states of a plain forward
    over the committed tokens at the same positions (fp32 reordering only, atol 1e-5)."""
    ids, mask = batch(1)
    expected = _plain(target, ids, mask)
    seen = []

    def check(drafter, outcome):
        seen.append((drafter.buffer.tokens[:, : outcome.kept_width + 1].clone(), outcome))

    drafter = TreeDrafter("oracle", expected, False, target.config.vocab_size, on_round=check)
    drafter.wants_hidden_states = True
    _speculative(target, ids, mask, drafter)
    tokens, outcome = seen[1]  # a round after the prefill with the full marked path accepted
    accepted = int(outcome.num_accepted[0])
    assert outcome.target_hidden.shape[1] == 1 + accepted == 4
    assert outcome.accepted_nodes[0, :accepted].tolist() == [1, 4, 5]
    with torch.no_grad():
        plain = target(input_ids=tokens[:, :-1], output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(outcome.target_hidden, plain[:, -(1 + accepted):], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- processors
def _processors():
    return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.7),
                                TopKLogitsWarper(5), TopPLogitsWarper(0.9)])


def test_path_scores_see_each_nodes_own_path():
    """Node n's scores equal HF's processors called on history + n's path (exact: same ops, same inputs)."""
    vocab = 12
    gen = torch.Generator().manual_seed(1)
    prompt = torch.tensor([[0, 3, 4], [5, 6, 7]])
    history = History(prompt, 16, 0)
    history.lengths = torch.tensor([3, 3])
    tree = CandidateTree.build(torch.tensor([[3, 8, 4, 9], [6, 1, 7, 2]]), torch.tensor([[-1, -1, 0, 2], [-1, 0, 1, 0]]))
    logits = torch.randn(2, 5, vocab, generator=gen)
    processors = _processors()
    got = path_scores(PositionwiseProcessor(processors), history, tree, logits)
    for row in range(2):
        for n in range(-1, 4):
            path = tree.paths()[row, n].tolist() if n >= 0 else []
            ids = torch.cat([prompt[row], tree.tokens[row, [m for m in path if m >= 0]]])[None]
            want = processors(ids, logits[row: row + 1, n + 1].clone())
            torch.testing.assert_close(got[row, n + 1], want[0], rtol=0, atol=0)


def test_score_only_fast_path_equals_per_node_reference():
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    history = History(torch.tensor([[3, 4, 5]]), 8, 0)
    tree = CandidateTree.build(torch.tensor([[3, 8, 4]]), torch.tensor([-1, 0, 0]))
    logits = torch.randn(1, 4, 12, generator=torch.Generator().manual_seed(2))
    fast = path_scores(PositionwiseProcessor(processors), history, tree, logits)
    reference = path_scores_per_node(PositionwiseProcessor(processors), history, tree, logits)
    torch.testing.assert_close(fast, reference, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- sampling
def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_tree_sampling_next_and_two_token_distribution():
    """Sampling through tree verification (point-mass drafts, processors along each path) gives the plain
    processed distribution for the next token and for the next two tokens. 200k samples over at most ~25
    outcomes: sampling noise in TV is about 0.005, so TV < 0.01 separates exact from a wrong rule (a verifier
    that skips the residual, or processors that ignore the path, moves TV by > 0.05 here)."""
    vocab, samples = 8, 200_000
    gen = torch.Generator().manual_seed(0)
    root_logits = torch.randn(vocab, generator=gen) * 0.6  # after the history
    next_logits = torch.randn(vocab, vocab, generator=gen) * 0.6  # [x1, V] after history + x1
    prompt = torch.tensor([[1, 2, 3]])
    processors = _processors()

    def plain(ids, logits):  # HF's processed distribution for one prefix
        return torch.softmax(processors(ids, logits[None].clone())[0], dim=-1)

    first = plain(prompt, root_logits)  # [V]
    second = torch.stack([plain(torch.cat([prompt[0], torch.tensor([x])])[None], next_logits[x])
                          for x in range(vocab)])  # [V, V]
    joint = first[:, None] * second

    # root children: the second-best token, one that top-k removed, the best; depth-2 children by rank too, so
    # that siblings are tried against the running residual at both depths
    ranked = first.argsort(descending=True).tolist()
    children = [second[x].argsort(descending=True).tolist() for x in range(vocab)]
    top = [ranked[1], ranked[6], ranked[0]]
    tokens = torch.tensor([[*top, children[top[0]][1], children[top[0]][0], children[top[2]][0]]])
    parents = torch.tensor([-1, -1, -1, 0, 0, 2])
    tree = CandidateTree.build(tokens, parents)
    logits = torch.stack([root_logits, *[next_logits[t] for t in top], *[torch.zeros(vocab)] * 3])[None]
    # (the depth-2 nodes' own rows score a third token, which this test does not look at)
    scores = path_scores(PositionwiseProcessor(processors), History(prompt, 8, 0), tree, logits)
    probs = torch.softmax(scores, dim=-1).expand(samples, -1, -1)
    result = rejection_verify(tokens.expand(samples, -1), probs, None, parents, torch.Generator().manual_seed(5))

    path = result.accepted_tokens(tokens.expand(samples, -1))  # [S, 2]
    accepted = result.num_accepted
    x1 = torch.where(accepted >= 1, path[:, 0], result.next_tokens)
    continuation = torch.multinomial(second[x1], 1, generator=torch.Generator().manual_seed(6))[:, 0]
    x2 = torch.where(accepted >= 2, path[:, 1], torch.where(accepted == 1, result.next_tokens, continuation))
    assert _tv(torch.bincount(x1, minlength=vocab).double(), first.double()) < 0.01
    pairs = torch.bincount(x1 * vocab + x2, minlength=vocab * vocab).double()
    assert _tv(pairs, joint.flatten().double()) < 0.01
    for depth in range(3):  # every outcome of the walk happens: the tree decides, and sometimes it does not
        assert float((accepted == depth).double().mean()) > 0.01


def test_tree_sampling_end_to_end_smoke(target):
    ids, mask = batch(3)
    reference = _plain(target, ids, mask)
    drafter = TreeDrafter("oracle", reference, True, target.config.vocab_size)
    torch.manual_seed(0)  # near-greedy temperature: the oracle's greedy path is sometimes accepted (the
    # distribution itself is checked at the verifier level above, where 200k samples are cheap)
    out = target.generate(ids, attention_mask=mask, do_sample=True, temperature=0.05, top_k=20, max_new_tokens=12,
                          pad_token_id=0, repetition_penalty=PENALTY, custom_generate=hf_kvspec.speculative_generate,
                          assistant=drafter, return_dict_in_generate=True)
    assert out.sequences.shape[0] == 3 and out.sequences.shape[1] <= ids.shape[1] + 12
    assert not out.acceptance.empty and sum(out.acceptance.accepted) > 0


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3", "paged|flash_attention_2"])
def test_attention_without_4d_masks_is_refused(name):
    with pytest.raises(ValueError, match="sdpa, eager"):
        check_tree_attention(name)


@pytest.mark.parametrize("declared", [True, False])
def test_flash_attention_target_is_refused(target, monkeypatch, declared):
    ids, mask = batch(1)
    monkeypatch.setattr(_compat, "attn_implementation", lambda config: "flash_attention_2")
    verified = []
    drafter = TreeDrafter("random", ids, False, target.config.vocab_size,
                          on_round=lambda _, outcome: verified.append(outcome))
    drafter.proposes_trees = declared  # undeclared trees are refused when they arrive
    with pytest.raises(ValueError, match=r"flash_attention_2.*kvspec_gqa"):
        _speculative(target, ids, mask, drafter)
    assert verified == []  # refused before any tree was verified


def test_negative_control_path_blind_processors_are_caught(target, monkeypatch):
    """Processors that see only the history (not each node's path) change greedy output under a repetition
    penalty: the equality tests above can fail."""
    from hf_kvspec.speculative import rounds

    ids, mask = batch(3)
    expected = _plain(target, ids, mask)
    monkeypatch.setattr(rounds, "path_scores",
                        lambda processor, history, tree, logits: processor(history, tree.tokens[:, :0], logits))
    out = _speculative(target, ids, mask, TreeDrafter("oracle", expected, True, target.config.vocab_size))
    assert not torch.equal(out, expected)


def test_a_window_too_small_for_the_tree_is_refused_before_any_forward(target):
    ids, mask = batch(1)
    drafter = TreeDrafter("random", _plain(target, ids, mask), per_row=False, vocab=target.config.vocab_size)
    # KIVI keeps positions only in its window (int8/fp8 keep them among codes too): 16 - 16 + 1 < 7 nodes + root
    cache = hf_kvspec.QuantizedKVCache(target.config, bits=4, group_size=16, residual_length=16)
    calls = []
    handle = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match="full-precision window"):
            _speculative(target, ids, mask, drafter, cache=cache)
    finally:
        handle.remove()
    assert calls == []  # refused up front, not at the first keep_positions after a prefill

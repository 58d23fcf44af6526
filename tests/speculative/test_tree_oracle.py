"""Medusa and EAGLE assistants through the loop with oracle heads (they propose the target's own greedy continuation,
read from a plain ``generate`` run, on a branch that is not always the first child) and random heads: token-identical
to plain greedy with repetition penalty on, chain / static / dynamic trees, bs 1 and 3 with left padding, on
DynamicCache and PagedCache. Oracle runs must also accept a lot, so a verifier that rejects everything fails here.

Also: EAGLE-3 feature fusion fed by hooks (no ``output_hidden_states``), the loop's depth cap near
``max_new_tokens`` (trees keep their width; EOS inside an accepted path stops), and typical acceptance through the
loop (recorded as lossy by name; greedy stays exact).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.speculative.drafters.eagle import EagleAssistant
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant
from tests.speculative.helpers import batch
from tests.tiny_models import randomized, tiny_model

MAX_NEW = 20
PENALTY = 1.3  # a path-dependent processor in every greedy run


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)



def medusa_heads(target, seed=1):
    return randomized(MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=4)), seed, 0.3)


def eagle_head(target, feature_layers=None, seed=2):
    config = EagleConfig.for_base_model(target, "tiny", feature_layers=feature_layers)
    return randomized(EagleHead(config), seed, 0.2)


def _reference_row(reference, history, row):
    # rows may have left the batch: find this row's reference by its prompt
    prompt = history.ids[row, : history.prompt_len]
    match = (reference[:, : history.prompt_len] == prompt).all(dim=1).nonzero()
    return reference[int(match[0])]


def _ahead(reference, history, row, steps):
    """The reference tokens right after the row's history: ``steps`` ids (0 past the end)."""
    ref = _reference_row(reference, history, row)
    start = int(history.lengths[row])
    return [int(ref[i]) if i < ref.shape[0] else 0 for i in range(start, start + steps)]


class OracleMedusa(MedusaAssistant):
    """Medusa whose head k ranks the target's token k + 1 ahead at ``ranks[k]`` (other ranks: wrong tokens)."""

    def __init__(self, heads, reference, ranks, **kwargs):
        kwargs.setdefault("tree", "default")
        kwargs.setdefault("num_draft_tokens", None)  # the whole tree every round (the default, auto, may go plain)
        super().__init__(heads, **kwargs)
        self.reference, self.ranks, self.history = reference, ranks, None

    def propose(self, ctx):
        self.history = ctx.history
        return super().propose(ctx)

    def ranked(self, feature, depth, width):
        vocab = self.heads.config.base_vocab_size
        out = torch.zeros(feature.shape[0], depth, width, dtype=torch.long)
        for row in range(feature.shape[0]):
            ahead = _ahead(self.reference, self.history, row, depth)
            for k in range(depth):
                out[row, k] = torch.tensor([(ahead[k] + 1 + r) % vocab for r in range(width)])
                out[row, k, min(self.ranks[k], width - 1)] = ahead[k]
        return out


class _RecordingHead:
    """Forwards everything to an ``EagleHead``; remembers the token ids of each tree level it is fed."""

    def __init__(self, head):
        self.head, self.levels = head, []

    def __call__(self, input_ids, **kwargs):
        if kwargs.get("draft_hidden") is not None:
            self.levels.append(input_ids)
        return self.head(input_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.head, name)


class OracleEagle(EagleAssistant):
    """EAGLE whose draft distribution puts a decoy first and the target's next token second after every node whose
    token is the target's at its depth (``second=False``: the target's token first)."""

    def __init__(self, head, reference, second=True, **kwargs):
        kwargs.setdefault("num_draft_tokens", None)  # the whole tree every round (the default, auto, may go plain)
        super().__init__(head, **kwargs)
        self.head = _RecordingHead(self.head)
        self.reference, self.second, self.history = reference, second, None

    def propose(self, ctx):
        self.history, self.head.levels = ctx.history, []
        return super().propose(ctx)

    def _logprobs(self, draft_hidden):
        batch, fed, vocab = draft_hidden.shape[0], draft_hidden.shape[1], self.head.config.base_vocab_size
        level = len(self.head.levels)  # 0: the root's children, then one level per tree call
        gen = torch.Generator().manual_seed(level)
        logits = torch.randn(batch, fed, vocab, generator=gen)
        for row in range(batch):
            ahead = _ahead(self.reference, self.history, row, level + 1)
            for j in range(fed):
                on_path = level == 0 or int(self.head.levels[-1][row, j]) == ahead[level - 1]
                if on_path:
                    logits[row, j, ahead[level]] = 10.0
                    if self.second:
                        logits[row, j, (ahead[level] + 7) % vocab] = 12.0
        return torch.log_softmax(logits, dim=-1)


def _plain(target, ids, mask, max_new=MAX_NEW, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                           repetition_penalty=PENALTY, **kw)


def _speculative(target, ids, mask, assistant, cache=None, max_new=MAX_NEW, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                           repetition_penalty=PENALTY, custom_generate=hf_kvspec.speculative_generate,
                           assistant=assistant, cache=cache, **kw)


def _cache(kind, target):
    if kind == "paged":
        return hf_kvspec.PagedCache(target.config, block_size=4, num_blocks=64)
    return None if kind == "generate" else DynamicCache(config=target.config)


# kind -> (assistant factory (target, reference or None for random heads), least tau of an oracle run)
ASSISTANTS = {
    "medusa-chain": (lambda t, ref: OracleMedusa(medusa_heads(t), ref, (0, 0, 0, 0), tree="chain") if ref is not None
                     else MedusaAssistant(medusa_heads(t), tree="chain"), 3.0),
    "medusa-default": (lambda t, ref: OracleMedusa(medusa_heads(t), ref, (1, 0, 0, 0)) if ref is not None
                       else MedusaAssistant(medusa_heads(t)), 2.5),
    "eagle-chain": (lambda t, ref: OracleEagle(eagle_head(t), ref, second=False, tree="chain", depth=4)
                    if ref is not None else EagleAssistant(eagle_head(t), tree="chain", depth=4), 3.0),
    "eagle-static": (lambda t, ref: OracleEagle(eagle_head(t), ref, tree=[(0,), (1,), (1, 1), (1, 1, 1), (0, 0)])
                     if ref is not None else EagleAssistant(eagle_head(t), tree=[(0,), (1,), (1, 0), (0, 0)]), 2.5),
    "eagle-dynamic": (lambda t, ref: OracleEagle(eagle_head(t), ref, depth=4, top_k=2, total_tokens=10)
                      if ref is not None else EagleAssistant(eagle_head(t), depth=4, top_k=2, total_tokens=10), 2.5),
}


@pytest.mark.parametrize("cache_kind", ["generate", "paged"])
@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("heads", ["oracle", "random"])
@pytest.mark.parametrize("kind", sorted(ASSISTANTS))
def test_heads_through_the_loop_match_plain_greedy(target, kind, heads, bs, cache_kind):
    ids, mask = batch(bs)
    expected = _plain(target, ids, mask)
    make, least_tau = ASSISTANTS[kind]
    assistant = make(target, expected if heads == "oracle" else None)
    out = _speculative(target, ids, mask, assistant, cache=_cache(cache_kind, target), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.acceptance
    if heads == "oracle":  # whole oracle paths accepted (the last rounds are cut short by max_new_tokens)
        assert stats.tokens_per_target_forward >= least_tau and stats.acceptance_rate[0] > 0.9
    else:  # a few lucky depth-1 hits among the tree's candidates (96-token vocabulary)
        assert stats.tokens_per_target_forward < 1.6


def _forward_kwargs(model):
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("heads", ["oracle", "random"])
def test_eagle3_fused_features_come_from_hooks(target, heads):
    """A two-layer-fusion EAGLE-3 head (embedding-side layer 1 + final norm): greedy identical, and the target's
    own forward (the reference: ``fast_forward=False``) is never asked for ``output_hidden_states`` (hooks keep
    only the two layers; the fast forward returns those two without hooks)."""
    ids, mask = batch(3)
    expected = _plain(target, ids, mask)
    head = eagle_head(target, feature_layers=[1, -1])
    assistant = OracleEagle(head, expected, depth=4, top_k=2, total_tokens=10) if heads == "oracle" else \
        EagleAssistant(head, depth=4, top_k=2, total_tokens=10)
    seen, handle = _forward_kwargs(target)
    try:
        out = _speculative(target, ids, mask, assistant, return_dict_in_generate=True, fast_forward=False)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, expected)
    assert seen and not any(kwargs.get("output_hidden_states") for kwargs in seen)
    if heads == "oracle":
        assert out.acceptance.tokens_per_target_forward >= 2.5


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 8])
def test_trees_near_max_new_tokens_keep_their_width_and_never_overshoot(target, max_new):
    ids, mask = batch(3)
    expected = _plain(target, ids, mask, max_new=max_new)
    assistant = OracleEagle(eagle_head(target), expected, depth=4, top_k=3, total_tokens=9)
    out = _speculative(target, ids, mask, assistant, max_new=max_new, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and out.sequences.shape[1] == ids.shape[1] + max_new
    # the prefill emits one token; a round with room for one more draft still verifies a whole level (3 nodes), not
    # one node; a round with no room drafts nothing
    lengths = out.acceptance.draft_lengths
    assert all(n == 0 or n >= 3 for n in lengths)
    assert (max(lengths, default=0) >= 3) == (max_new > 2)


@pytest.mark.parametrize("kind", ["medusa-default", "eagle-dynamic"])
def test_eos_inside_an_accepted_path_stops(target, kind):
    ids, mask = batch(3)
    free = _plain(target, ids, mask)
    eos = int(free[0, ids.shape[1] + 5])  # row 0's sixth new token: inside an accepted oracle path
    expected = _plain(target, ids, mask, eos_token_id=eos)
    assistant = ASSISTANTS[kind][0](target, free)
    out = _speculative(target, ids, mask, assistant, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert out.shape[1] < free.shape[1] or (out[:, ids.shape[1]:] == eos).any()


# ---------------------------------------------------------------------------------------------- typical acceptance
def test_typical_acceptance_through_the_loop_is_recorded_lossy(target):
    ids, mask = batch(3)
    reference = _plain(target, ids, mask)
    calls = []
    assistant = OracleMedusa(medusa_heads(target), reference, (1, 0, 0, 0), acceptance="typical")
    typical = assistant.verify
    assistant.verify = lambda *args: calls.append(1) or typical(*args)
    torch.manual_seed(0)
    out = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True)
    assert calls and out.acceptance.lossy and "typical" in out.acceptance.lossy_rules[0]
    assert out.acceptance.summary()["lossy"] is True and "lossy=True" in str(out.acceptance)
    # greedy never uses the lossy rule: exact and not flagged
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                             custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                             return_dict_in_generate=True)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(greedy.sequences, plain) and not greedy.acceptance.lossy
    exact = MedusaAssistant(medusa_heads(target))
    sampled = target.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=4, pad_token_id=0,
                              custom_generate=hf_kvspec.speculative_generate, assistant=exact,
                              return_dict_in_generate=True)
    assert not sampled.acceptance.lossy

"""Medusa and EAGLE assistants standalone on a tiny random Llama: proposals against plain references (no cache,
no tree masks), valid topologies, the EAGLE cache after a round against a fresh drafter's, row selection, feature
capture, attaching and pairing, and typical acceptance flagged lossy (and shown not exact)."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.heads.pairing import BaseModelMismatchError
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.drafters.base import DraftContext, RoundOutcome
from hf_kvspec.speculative.drafters.eagle import EagleAssistant, next_real_tokens
from hf_kvspec.speculative.drafters.features import FeatureCapture
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant, typical_verify
from hf_kvspec.speculative.tree import grow_dynamic_tree, tree_depth
from hf_kvspec.speculative.verify import rejection_verify
from tests.tiny_models import left_padded_batch, randomized, tiny_model

PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 4, 30], [8, 8, 17, 40, 2, 19, 6, 12]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)



def _medusa(target, seed=1):
    return randomized(MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=3)), seed, 0.3)


def _eagle(target, feature_layers=None, seed=2):
    return randomized(EagleHead(EagleConfig.for_base_model(target, "tiny", feature_layers=feature_layers)), seed,
                      0.2)


def _prefill(target, prompts, layers=(-1,)):
    """Prompt forward as the loop runs it: features [B, P, F] and a buffer holding the prompt + first token."""
    ids, mask = left_padded_batch(prompts)
    buffer = TokenBuffer(ids, mask, 0)
    with torch.no_grad(), FeatureCapture(target, layers) as capture:
        logits = target(ids, attention_mask=mask, position_ids=buffer.positions).logits
    alive = torch.ones(len(prompts), dtype=torch.bool)
    buffer.append_round(ids[:, :0], torch.zeros(len(prompts), dtype=torch.long), logits[:, -1].argmax(-1), alive)
    return buffer, capture.features()


def _ctx(buffer, count):
    batch = buffer.tokens.shape[0]
    return DraftContext(buffer, None, count, False, torch.ones(batch, dtype=torch.bool), None)


# ---------------------------------------------------------------------------------------------- Medusa
@pytest.mark.parametrize("tree", ["chain", [(0,), (2,), (0, 1), (0, 1, 0)],
                                  [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (2,)]])
def test_medusa_proposal_is_the_heads_top_k(target, tree):
    heads = _medusa(target)
    assistant = MedusaAssistant(heads, tree=tree)
    buffer, hidden = _prefill(target, PROMPTS)
    assistant.begin(target, buffer, hidden)
    proposal = assistant.propose(_ctx(buffer, 99))
    reference = heads(hidden[:, -1:]).logits[:, :, 0]  # [K, B, V] plain MedusaHeads.forward
    order = reference.argsort(dim=-1, descending=True)
    for n, choice in enumerate(assistant.tree.choices):
        assert proposal.tokens[:, n].tolist() == order[len(choice) - 1, :, choice[-1]].tolist()
    assert proposal.probs is None and proposal.parents.tolist() == assistant.tree.parents.tolist()
    tree_depth(proposal.parents)  # topological


def test_medusa_follows_the_feature_of_the_accepted_path_and_selects_rows(target):
    heads = _medusa(target)
    assistant = MedusaAssistant(heads, tree="chain")
    buffer, hidden = _prefill(target, PROMPTS)
    assistant.begin(target, buffer, hidden)
    round_hidden = torch.randn(3, 4, target.config.hidden_size)  # [B, 1 + K, H] kept columns of a round
    accepted = torch.tensor([2, 0, 3])
    assistant.observe(RoundOutcome(buffer.width + 3, accepted, torch.ones(3, dtype=torch.bool), 3, 0.0, 0.0,
                                   round_hidden))
    expected = heads(round_hidden[torch.arange(3), accepted][:, None]).logits[:, :, 0].argmax(-1)  # [K, B]
    assert assistant.propose(_ctx(buffer, 3)).tokens.tolist() == expected.T.tolist()
    assistant.release([1])
    assert assistant.propose(_ctx(buffer, 3)).tokens.tolist() == expected.T[[0, 2]].tolist()


def test_medusa_refuses_a_tree_deeper_than_its_heads(target):
    with pytest.raises(ValueError, match="deep"):
        MedusaAssistant(_medusa(target), tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match="acceptance"):
        MedusaAssistant(_medusa(target), tree="chain", acceptance="fast")


# ---------------------------------------------------------------------------------------------- EAGLE references
def _reference_expand(head, features, ids, root_hidden):
    """``expand`` that recomputes every fed node from scratch over one unpadded row: committed pairs + the node's
    path, plain causal attention, no cache."""
    fused = head.fuse_features(features)  # [1, L, H]
    paths = [([], [])]  # per fed row of the previous call: (tokens, draft inputs) along its path

    def expand(tokens, parent_slot):
        nonlocal paths
        new_paths, outputs = [], []
        for j in range(tokens.shape[1]):
            slot = max(int(parent_slot[0, j]), 0)
            path_tokens, path_inputs = paths[slot]
            parent_out = root_hidden if not path_tokens else path_inputs[-1][1]
            toks = [*path_tokens, int(tokens[0, j])]
            inputs = [*path_inputs, (parent_out, None)]
            seq_ids = torch.cat([ids, torch.tensor([toks])], dim=1)
            seq_fused = torch.cat([fused] + [h[None, None] for h, _ in inputs], dim=1)
            positions = torch.arange(seq_ids.shape[1])[None]
            out = head.step(seq_ids, seq_fused, positions)[0, -1]  # [H]
            inputs[-1] = (parent_out, out)
            new_paths.append((toks, inputs))
            outputs.append(out)
        paths = new_paths
        return torch.log_softmax(head.logits(torch.stack(outputs)[None]).float(), dim=-1)
    return expand


def _reference_tree(head, target, prompt, depth, top_k, total):
    buffer, features = _prefill(target, [prompt], tuple(head.config.feature_layers))
    ids = next_real_tokens(buffer.tokens, buffer.mask)[:, : buffer.width - 1]  # x_{t+1} for every committed t
    with torch.no_grad():
        g = head.step(ids, head.fuse_features(features), torch.arange(ids.shape[1])[None])[0, -1]
        root = torch.log_softmax(head.logits(g[None, None]).float(), dim=-1)[:, 0]
        return grow_dynamic_tree(root, _reference_expand(head, features, ids, g), depth, top_k, total)


@pytest.mark.parametrize("feature_layers", [None, [1, -1]])
def test_eagle_dynamic_tree_matches_a_cache_free_reference(target, feature_layers):
    head = _eagle(target, feature_layers)
    assistant = EagleAssistant(head, depth=3, top_k=3, total_tokens=10)
    buffer, features = _prefill(target, PROMPTS, assistant.feature_layers)
    assistant.begin(target, buffer, features)
    proposal = assistant.propose(_ctx(buffer, 99))
    assert proposal.tokens.shape == (3, 10) and proposal.parents.shape == (3, 10) and proposal.probs is None
    assert proposal.draft_forwards == 3
    assert assistant.rows.cache.get_seq_length() == buffer.width - 1  # tree rows rolled back
    for row, prompt in enumerate(PROMPTS):
        reference = _reference_tree(head, target, prompt, 3, 3, 10)
        assert proposal.tokens[row].tolist() == reference.tokens[0].tolist()
        assert proposal.parents[row].tolist() == reference.parents[0].tolist()


def test_eagle_chain_and_choice_list(target):
    head = _eagle(target)
    buffer, features = _prefill(target, PROMPTS)
    chain = EagleAssistant(head, tree="chain", depth=4)
    chain.begin(target, buffer, features)
    tokens = chain.propose(_ctx(buffer, 99))
    assert tokens.parents.tolist() == [-1, 0, 1, 2]
    dynamic_chain = EagleAssistant(head, depth=4, top_k=1, total_tokens=4)  # top-1 dynamic growth is the chain
    dynamic_chain.begin(target, buffer, features)
    assert torch.equal(dynamic_chain.propose(_ctx(buffer, 99)).tokens, tokens.tokens)
    static = EagleAssistant(head, tree=[(0,), (1,), (0, 0), (0, 1)])
    static.begin(target, buffer, features)
    proposal = static.propose(_ctx(buffer, 3))  # capped: the first three nodes
    assert proposal.parents.tolist() == [-1, -1, 0] and proposal.tokens[:, [0, 2]].tolist() == \
        tokens.tokens[:, :2].tolist()


def _commit_round(buffer, accepted_tokens, num_accepted, next_tokens):
    buffer.append_round(accepted_tokens, num_accepted, next_tokens, torch.ones(len(num_accepted), dtype=torch.bool))


def test_eagle_cache_after_a_round_equals_a_fresh_drafters(target):
    head = _eagle(target)
    hidden_size = target.config.hidden_size
    buffer, features = _prefill(target, PROMPTS)
    assistant = EagleAssistant(head, depth=3, top_k=2, total_tokens=6)
    assistant.begin(target, buffer, features)
    assistant.propose(_ctx(buffer, 99))
    # a round: rows accept 2, 0, 1 of a 3-node chain; the kept columns' features come back root first
    torch.manual_seed(3)
    round_features = torch.randn(3, 4, hidden_size)  # [B, 1 + K, H]
    num_accepted = torch.tensor([2, 0, 1])
    _commit_round(buffer, torch.tensor([[31, 32], [0, 0], [33, 0]]), num_accepted, torch.tensor([41, 42, 43]))
    assistant.observe(RoundOutcome(buffer.width - 1, num_accepted, torch.ones(3, dtype=torch.bool), 3, 0.0, 0.0,
                                   round_features))
    proposal = assistant.propose(_ctx(buffer, 99))

    fresh = EagleAssistant(head, depth=3, top_k=2, total_tokens=6)
    all_features = torch.cat([features, round_features[:, :3]], dim=1)  # every committed column's feature
    fresh.begin(target, buffer, all_features)
    fresh_proposal = fresh.propose(_ctx(buffer, 99))
    real = buffer.mask[:, : buffer.width - 1].bool()  # [B, W - 1]
    for ours, theirs in ((assistant.rows.cache.layers[0].keys, fresh.rows.cache.layers[0].keys),
                         (assistant.rows.cache.layers[0].values, fresh.rows.cache.layers[0].values)):
        assert ours.shape == theirs.shape
        for row in range(3):  # holes hold junk; real columns agree (fp32, different row batching)
            torch.testing.assert_close(ours[row][:, real[row]], theirs[row][:, real[row]], atol=1e-5, rtol=1e-5)
    assert torch.equal(proposal.tokens, fresh_proposal.tokens)
    assert torch.equal(proposal.parents, fresh_proposal.parents)


def test_eagle_release_keeps_the_remaining_rows_proposals(target):
    head = _eagle(target)
    buffer, features = _prefill(target, PROMPTS)
    everyone = EagleAssistant(head, depth=3, top_k=2, total_tokens=5)
    everyone.begin(target, buffer, features)
    full = everyone.propose(_ctx(buffer, 99))
    fewer = EagleAssistant(head, depth=3, top_k=2, total_tokens=5)
    fewer.begin(target, buffer, features)
    fewer.propose(_ctx(buffer, 99))
    index = torch.tensor([0, 2])
    fewer.release([1])
    buffer.select_rows(index)
    again = fewer.propose(_ctx(buffer, 99))
    assert torch.equal(again.tokens, full.tokens[index]) and torch.equal(again.parents, full.parents[index])


def test_eagle_refuses_last_layer_features_for_a_fused_head(target):
    assistant = EagleAssistant(_eagle(target, [1, -1]))
    buffer, hidden = _prefill(target, PROMPTS)  # only the final layer
    with pytest.raises(ValueError, match="FeatureCapture"):
        assistant.begin(target, buffer, hidden)


# ---------------------------------------------------------------------------------------------- shared
def test_feature_capture_equals_output_hidden_states(target):
    ids = torch.randint(3, 90, (2, 7))
    capture = FeatureCapture(target, [0, 1, -1])
    with torch.no_grad():
        reference = target(ids, output_hidden_states=True).hidden_states
        hooks_before = [dict(module._forward_hooks) for module in capture.modules]  # transformers installs its own
        with capture:
            target(ids)
    assert torch.equal(capture.features(), torch.cat([reference[0], reference[1], reference[-1]], dim=-1))
    assert [dict(module._forward_hooks) for module in capture.modules] == hooks_before  # ours removed


def test_heads_attach_on_first_call_and_refuse_another_base(target):
    heads = MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=2))  # attach() never called
    assistant = MedusaAssistant(heads, tree="chain")
    buffer, hidden = _prefill(target, PROMPTS)
    assistant.begin(target, buffer, hidden)
    assert heads.is_attached and heads.borrowed().lm_head is target.get_output_embeddings()
    other = tiny_model("llama", seed=7)
    with pytest.raises(BaseModelMismatchError):
        EagleAssistant(EagleHead(EagleConfig.for_base_model(target, "tiny"))).begin(other, buffer, hidden)


def test_public_names():
    assert hf_kvspec.MedusaAssistant is MedusaAssistant and hf_kvspec.EagleAssistant is EagleAssistant


def test_typical_acceptance_is_flagged_lossy_and_is_not_exact():
    assert MedusaAssistant.__init__.__defaults__[1] == "exact"  # exact unless asked for by name
    torch.manual_seed(0)
    vocab, samples = 4, 100_000
    target_probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draft = torch.full((samples, 1), 1)  # always draft token 1: p = 0.3 > min(0.09, ...) -> always accepted
    probs = target_probs.expand(samples, 2, vocab)
    typical = typical_verify(draft, probs)
    exact = rejection_verify(draft, probs, None)
    first = lambda r: torch.where(r.num_accepted > 0, draft[:, 0], r.next_tokens)  # noqa: E731
    tv = lambda r: 0.5 * float((torch.bincount(first(r), minlength=vocab) / samples - target_probs).abs().sum())  # noqa: E731
    assert tv(exact) < 0.01 and tv(typical) > 0.5  # typical emits token 1 every time


# ---------------------------------------------------------------------------------------------- through today's loop
@pytest.mark.parametrize("kind", ["medusa-chain", "eagle-chain", "medusa-tree", "eagle-dynamic"])
def test_assistants_through_the_loop_are_token_identical_to_greedy(target, kind):
    """Through ``speculative_generate`` (bs 3, left padding): the features each assistant keeps across rounds
    (holes, rows accepting different counts, trees' accepted paths) against plain greedy ``generate``."""
    ids, mask = left_padded_batch(PROMPTS)
    assistant = {
        "medusa-chain": lambda: MedusaAssistant(_medusa(target), tree="chain"),
        "eagle-chain": lambda: EagleAssistant(_eagle(target), tree="chain", depth=3),
        "medusa-tree": lambda: MedusaAssistant(_medusa(target), tree=[(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0)]),
        "eagle-dynamic": lambda: EagleAssistant(_eagle(target), depth=3, top_k=3, total_tokens=8),
    }[kind]()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    out = target.generate(ids, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rounds > 0

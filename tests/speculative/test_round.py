"""The round's decisions shared by ``generate``'s loop and the engine (``speculative/round.py``), on the worked
example of ``rounds.py``'s docstring: tree ``a -> {b, c}``, ``b -> {d}`` after the prefix ``x y``; the target's
greedy choices accept the path a, b, d. ``accept`` must emit a b d and the next token, score each from the row
of the node before it, and keep the columns root, a, b, d; ``keep_columns`` must leave a cache holding x y a b d."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
from hf_kvspec.speculative.round import accept, keep_columns
from hf_kvspec.speculative.rounds import plan_round
from tests.tiny_models import tiny_model

A, B, C, D, NEXT, V = 5, 6, 7, 8, 9, 12


def _logits(choices: list[int]) -> torch.Tensor:
    logits = torch.zeros(1, len(choices), V)
    for row, token in enumerate(choices):
        logits[0, row, token] = 1.0
    return logits


def _cache_with(columns: int) -> tuple[DynamicCache, torch.Tensor]:
    """A one-layer cache whose column c holds the value c (keys [1, 1, columns, 2])."""
    config = tiny_model("llama", seed=0).config
    config.num_hidden_layers = 1
    cache = DynamicCache(config=config)
    keys = torch.arange(columns, dtype=torch.float32).view(1, 1, columns, 1).expand(1, 1, columns, 2).contiguous()
    cache.update(keys, keys.clone(), 0)
    return cache, keys


def test_accept_emits_the_accepted_path_and_next_token_scored_along_it():
    plan = plan_round(DraftProposal(torch.tensor([[A, B, C, D]]), parents=torch.tensor([-1, 0, 0, 1])))
    # score rows: after the root -> a, after a -> b, after b -> d, after c -> (anything), after d -> the next token
    logits = _logits([A, B, D, A, NEXT])
    history = History(torch.tensor([[1, 2]]), 16, 0)
    verdict = accept(plan, PositionwiseProcessor(None), history, logits, do_sample=False)
    assert verdict.counts.tolist() == [4]
    assert verdict.emitted[0].tolist() == [A, B, D, NEXT]
    assert verdict.score_rows[0].tolist() == [0, 1, 2, 4]  # root, node 0, node 1, node 3
    assert verdict.kept[0].tolist() == [0, 1, 2, 4]


def test_a_chain_rejected_at_its_first_draft_emits_the_target_token_only():
    plan = plan_round(DraftProposal(torch.tensor([[A, B, C]])))
    verdict = accept(plan, PositionwiseProcessor(None), History(torch.tensor([[1, 2]]), 16, 0),
                     _logits([NEXT, B, C, D]), do_sample=False)
    assert verdict.counts.tolist() == [1]
    assert verdict.emitted[0, :1].tolist() == [NEXT]
    assert verdict.kept[0, :1].tolist() == [0]


def test_keep_columns_keeps_the_root_and_the_path_of_a_tree():
    cache, _ = _cache_with(6)  # x | y a b c d: the prefix x, then the round's root and four nodes from column 1
    keep_columns(cache, 1, torch.tensor([[0, 1, 2, 4]]), new=5, tree=True)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5]  # x y a b d


def test_keep_columns_crops_a_chain_to_its_longest_kept_path():
    cache, _ = _cache_with(6)  # x | y a b c d as a chain; a kept, b rejected
    keep_columns(cache, 1, torch.tensor([[0, 1]]), new=5, tree=False)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2]

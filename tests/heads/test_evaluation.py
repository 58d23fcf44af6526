"""Held-out evaluation alignment: an oracle that drafts the target's own greedy text is always accepted."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.heads import evaluation
from hf_kvspec.heads.configuration import MedusaConfig
from hf_kvspec.heads.distill import Conversation, DistillSettings, self_distill
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from tests.heads.tiny_base import char_tokenizer
from tests.tiny_models import tiny_model


def _setup(tmp_path):
    tokenizer = char_tokenizer()
    target = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = None  # always the full max_new_tokens
    convs = self_distill(target, tokenizer, ["hello there", "abc"], tmp_path / "d.jsonl", "fp",
                         DistillSettings(max_new_tokens=12, batch_size=1), progress=False)
    heads = MedusaHeads(MedusaConfig.for_base_model(target, "t", num_heads=3)).attach(target)
    return target, convs, heads


def test_oracle_drafts_from_the_greedy_text_are_all_accepted(tmp_path, monkeypatch):
    target, convs, heads = _setup(tmp_path)

    def oracle(head, features, input_ids, depth, start=0):  # draft k at row t = text token t+k+2 (independent of target)
        size = input_ids.shape[1]
        padded = torch.cat([input_ids[0], torch.full((depth + 2,), -1)])
        return torch.stack([padded[torch.arange(size) + k + 2] for k in range(depth)])

    monkeypatch.setattr(evaluation, "draft_tokens", oracle)
    result = evaluation.evaluate_head(heads, target, convs, depth=3)
    assert result["per_head_top1"] == [1.0, 1.0, 1.0]
    assert result["positions"] == [2 * 11, 2 * 10, 2 * 9]  # 12 response tokens: head k has 11 - k rows inside
    # each response: 12 tokens, 4 per forward (3 drafts + the target's own) -> 3 forwards
    assert (result["emitted_tokens"], result["target_forwards"]) == (24, 6) and result["tau"] == 4.0


def test_never_right_drafts_give_tau_one(tmp_path, monkeypatch):
    target, convs, heads = _setup(tmp_path)
    monkeypatch.setattr(evaluation, "draft_tokens", lambda h, f, ids, depth, start=0: torch.full((depth, ids.shape[1]), -1))
    result = evaluation.evaluate_head(heads, target, convs, depth=3)
    assert result["per_head_top1"] == [0.0, 0.0, 0.0] and result["tau"] == 1.0


def test_real_heads_run_through_evaluation(tmp_path):
    target, convs, heads = _setup(tmp_path)
    result = evaluation.evaluate_head(heads, target, convs)
    assert len(result["per_head_top1"]) == 3 and 1.0 <= result["tau"] <= 4.0


def test_skipping_prompt_rows_changes_nothing_after_them():
    target = tiny_model("llama", seed=0)
    heads = MedusaHeads(MedusaConfig.for_base_model(target, "t", num_heads=2)).attach(target)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(3, 96, (1, 10))
    features = target(ids, output_hidden_states=True).hidden_states[-1]
    full, partial = (evaluation.draft_tokens(heads, features, ids, 2, start) for start in (0, 4))
    assert torch.equal(full[:, 4:], partial[:, 4:]) and (partial[:, :4] == -1).all()


def test_nothing_to_score_is_an_error_that_says_why(tmp_path):
    target, _, heads = _setup(tmp_path)
    with pytest.raises(ValueError, match="2 or more tokens"):
        evaluation.evaluate_head(heads, target, [Conversation([1, 5, 6], [7])])

"""Training objectives: label alignment, restricted-vocabulary cross-entropy vs an explicit reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_kvspec.heads.configuration import MedusaConfig
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.heads.objectives import TrainingVocabulary, head_cross_entropy, medusa_loss, shifted_labels
from tests.tiny_models import tiny_model


def _batch():
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    target_tokens = ids + 50
    return {"input_ids": ids, "valid": valid, "target_tokens": target_tokens}


def test_shifted_labels_target_and_data():
    batch = _batch()
    labels, mask = shifted_labels(batch, 1, "target")  # row t -> target_tokens[t+1] (predicts token t+2)
    assert labels[0].tolist()[:4] == [56, 57, 58, 59] and mask[0].tolist() == [1, 1, 1, 1, 0]
    assert mask[1].tolist() == [1, 1, 0, 0, 0]
    labels, mask = shifted_labels(batch, 1, "data")    # row t -> input_ids[t+2]
    assert labels[0].tolist()[:3] == [7, 8, 9] and mask[0].tolist() == [1, 1, 1, 0, 0]
    assert mask[1].tolist() == [1, 0, 0, 0, 0]


def test_restricted_vocabulary_is_cross_entropy_over_the_kept_columns():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 4, 8), torch.randn(30, 8)
    labels = torch.tensor([[1, 3, 5, 29], [3, 3, 1, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    kept = torch.tensor([1, 3, 5, 7, 11])
    loss, hits, count = head_cross_entropy(hidden, weight, labels, mask, TrainingVocabulary(30, kept))
    # reference: explicit sub-matrix logits, label 29 (outside the kept set) dropped
    rows = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (1, 3)]
    logits = torch.stack([hidden[b, t] @ weight[kept].T for b, t in rows])
    targets = torch.tensor([(kept == labels[b, t]).nonzero().item() for b, t in rows])
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets, reduction="sum"))
    assert count.item() == 6 and hits.item() == (logits.argmax(-1) == targets).sum().item()
    full_loss, _, full_count = head_cross_entropy(hidden, weight, labels, mask, TrainingVocabulary(30))
    full_rows = [*rows, (0, 3)]
    reference = F.cross_entropy(torch.stack([hidden[b, t] @ weight.T for b, t in full_rows]),
                                torch.tensor([labels[b, t].item() for b, t in full_rows]), reduction="sum")
    torch.testing.assert_close(full_loss, reference)
    assert full_count.item() == 7


def test_medusa_loss_trains_toward_its_labels():
    base = tiny_model("llama", seed=0)
    heads = MedusaHeads(MedusaConfig.for_base_model(base, "t", num_heads=2)).attach(base)
    ids = torch.randint(3, 96, (4, 12))
    out = base(ids, output_hidden_states=True)
    batch = {"input_ids": ids, "valid": torch.ones_like(ids, dtype=torch.bool),
             "features": out.hidden_states[-1].detach(), "target_tokens": out.logits.argmax(-1)}
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        result = medusa_loss(heads, batch, TrainingVocabulary(96))
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(result.loss.item())
    assert losses[-1] < 0.6 * losses[0]  # 8.8 -> ~4.8 after 30 steps, lower after 50
    assert result.counts.tolist() == [4 * 11, 4 * 10]  # head k labels rows t with t+k+1 inside the sequence


def test_answers_only_scores_rows_whose_label_is_an_answer_token():
    batch = {**_batch(), "prompt_length": torch.tensor([3, 1])}
    # row t predicts token t+offset+1; row 0 is prompt for offset 1 (token 2 < 3), rows 1.. are answer tokens
    _, mask = shifted_labels(batch, 1, "target", answers_only=True)
    assert mask[0].tolist() == [0, 1, 1, 1, 0] and mask[1].tolist() == [1, 1, 0, 0, 0]
    _, everything = shifted_labels(batch, 1, "target")
    assert torch.equal(mask, everything & torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool))
    _, mask = shifted_labels(batch, 0, "data", answers_only=True)   # row t -> token t+1
    assert mask[0].tolist() == [0, 0, 1, 1, 0]
    text = _batch()                                                   # no prompt_length (text windows): all rows
    assert torch.equal(shifted_labels(text, 1, "target", answers_only=True)[1], shifted_labels(text, 1, "target")[1])

"""Training objectives of the heads: next-next-token cross-entropy (Medusa, EAGLE) + feature regression (EAGLE-1).

Boundary: a collated batch (see ``features.collate``) with target features in, a scalar loss and per-head top-1
counts out. The training loop (``scripts/train_drafter.py``) owns optimisation; the held-out metric is
``hf_kvspec/metrics/draft_acceptance.py`` (``hf_kvspec.load_metric("draft_acceptance")``).

Shapes: B batch, T positions, H hidden, V vocabulary, V' training vocabulary, K heads / unrolled steps.

Labels. Head k (Medusa) and unrolled step k (EAGLE) at row t predict token t+k+2. With ``label_source="target"``
the label is ``target_tokens[t+k+1]``: the target's own greedy choice at that point (distillation; on the target's
greedy text this equals the text). With ``"data"`` it is ``input_ids[t+k+2]``.

Answers only. A chat example's ``prompt_length`` covers the system prompt and every earlier turn; with
``answers_only`` (the default of ``TrainingObjective``) a row is scored only when the token it predicts lies in the
answer, the only text a head drafts at inference. Earlier rows still feed attention (EAGLE) as context.

Training vocabulary. The LM head (V x H, 49152 x 576 for SmolLM2) dominates the cost of a step. Passing
``vocab_ids`` (the tokens that occur as labels) restricts the softmax to those V' columns for *training only*: the
loss is the cross-entropy among the tokens that can be right, the heads at inference still project onto the full
vocabulary (exact), and held-out accuracy is measured there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    loss: torch.Tensor                 # scalar
    correct: torch.Tensor              # [K] top-1 hits per head / step (training vocabulary)
    counts: torch.Tensor               # [K] labelled positions per head / step


class TrainingVocabulary:
    """Maps full-vocabulary ids to columns of a restricted projection; ``None`` ids means the full vocabulary."""

    def __init__(self, vocab_size: int, vocab_ids: torch.Tensor | None = None):
        self.vocab_ids = None if vocab_ids is None else torch.unique(vocab_ids.long())
        self.column = None
        if self.vocab_ids is not None:
            self.column = torch.full((vocab_size,), -1, dtype=torch.long)
            self.column[self.vocab_ids] = torch.arange(len(self.vocab_ids))

    @classmethod
    def from_label_counts(cls, dataset, vocab_size: int, max_size: int | None = None) -> TrainingVocabulary:
        """The tokens that occur as labels in ``dataset`` (data tokens and target predictions), optionally only the
        ``max_size`` most frequent ones."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for item in dataset:
            counts += torch.bincount(torch.as_tensor(item["input_ids"]), minlength=vocab_size)
            if "target_tokens" in item:
                counts += torch.bincount(item["target_tokens"], minlength=vocab_size)
        seen = counts.nonzero().flatten()
        if max_size is not None and len(seen) > max_size:
            seen = counts.topk(max_size).indices
        return cls(vocab_size, seen)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], weight [V, H] -> logits [..., V'] (V' = V without restriction)."""
        if self.vocab_ids is not None:
            weight = weight[self.vocab_ids.to(weight.device)]
        return torch.einsum("...h,vh->...v", hidden, weight.to(hidden.dtype))

    def columns(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary labels -> columns of ``logits`` (-1 where the label is outside the training vocabulary)."""
        return labels if self.column is None else self.column.to(labels.device)[labels]


def shifted_labels(batch: dict, offset: int, label_source: str = "target",
                   answers_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [B, T] for predicting token t+offset+1 at row t, and their mask [B, T] (inside the sequence; with
    ``answers_only``, also at or after ``batch["prompt_length"]`` [B])."""
    ids, valid = batch["input_ids"], batch["valid"]
    if label_source == "target":
        source, shift = batch["target_tokens"], offset
    elif label_source == "data":
        source, shift = ids, offset + 1
    else:
        raise ValueError(f"label_source must be 'target' or 'data', got {label_source!r}.")
    labels = torch.zeros_like(ids)
    mask = torch.zeros_like(valid)
    if shift < ids.shape[1]:
        labels[:, :-shift] = source[:, shift:]
        mask[:, :-shift] = valid[:, shift:]
    return labels, (mask & answer_rows(batch, offset) if answers_only else mask)


def answer_rows(batch: dict, offset: int) -> torch.Tensor:
    """[B, T] bool: row t predicts token t+offset+1 and that token lies in the answer (at or after
    ``batch["prompt_length"]`` [B]); all True for a batch without prompts (text windows)."""
    ids = batch["input_ids"]
    if "prompt_length" not in batch:
        return torch.ones_like(ids, dtype=torch.bool)
    predicted = torch.arange(ids.shape[1], device=ids.device) + offset + 1                # [T] token index scored
    return predicted[None] >= batch["prompt_length"].to(ids.device)[:, None]


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                       vocab: TrainingVocabulary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, T, H] -> (summed CE, top-1 hits, count) over labelled rows.

    Only rows that have a label inside the training vocabulary go through the projection [N, H] x [V', H].
    """
    columns = vocab.columns(labels)
    keep = mask & (columns >= 0)
    targets = columns[keep]                                              # [N]
    if targets.numel() == 0:
        zero = hidden.sum() * 0.0
        return zero, zero.detach(), torch.zeros((), device=hidden.device)
    logits = vocab.logits(hidden[keep], weight)                          # [N, V']
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    hits = (logits.argmax(-1) == targets).sum()
    return loss, hits, keep.sum()


def medusa_loss(heads, batch: dict, vocab: TrainingVocabulary, label_source: str = "target",
                head_decay: float = 1.0, answers_only: bool = False) -> LossOutput:
    """Sum over heads of ``head_decay**k`` x mean CE (Medusa-1 weights later heads less: 0.8**k in the paper)."""
    head_hidden = heads.head_hidden_states(batch["features"].to(heads.dtype))        # [K, B, T, H]
    total, correct, counts = 0.0, [], []
    for k in range(head_hidden.shape[0]):
        labels, mask = shifted_labels(batch, k + 1, label_source, answers_only)
        loss, hits, count = head_cross_entropy(head_hidden[k], heads.projection_weight(k), labels, mask, vocab)
        total = total + head_decay ** k * loss / count.clamp(min=1)
        correct.append(hits)
        counts.append(count)
    return LossOutput(total, torch.stack(correct).detach(), torch.stack(counts))


def eagle_loss(drafter, batch: dict, vocab: TrainingVocabulary, steps: int = 1, label_source: str = "target",
               feature_loss_weight: float = 1.0, step_decay: float = 1.0, answers_only: bool = False) -> LossOutput:
    """EAGLE loss over ``steps`` unrolled draft steps (training-time test; steps=1 is plain EAGLE-1 teacher forcing).

    Per step: CE on token t+j+2 and, when the drafter uses the single final feature, SmoothL1 between the draft
    hidden state and the target feature f_{t+j+1} (EAGLE-1's regression target; EAGLE-3 fuses layers and drops it).
    """
    features = batch["features"].to(drafter.dtype)
    next_ids, _ = shifted_labels(batch, 0, "data")                                 # [B, T]: x_{t+1} at row t
    draft_hidden = drafter.unrolled(next_ids, features, batch["valid"], steps)
    regress = feature_loss_weight > 0 and drafter.fuse is None
    weight = drafter.borrowed().lm_head.weight
    total, correct, counts = 0.0, [], []
    for j, hidden in enumerate(draft_hidden):
        labels, mask = shifted_labels(batch, j + 1, label_source, answers_only)
        loss, hits, count = head_cross_entropy(drafter.norm(hidden), weight, labels, mask, vocab)
        step_loss = loss / count.clamp(min=1)
        if regress:
            step_loss = step_loss + feature_loss_weight * _feature_loss(hidden, features, mask, j + 1)
        total = total + step_decay ** j * step_loss
        correct.append(hits)
        counts.append(count)
    return LossOutput(total, torch.stack(correct).detach(), torch.stack(counts))


def _feature_loss(hidden: torch.Tensor, features: torch.Tensor, mask: torch.Tensor, shift: int) -> torch.Tensor:
    """SmoothL1 between g_t [B, T, H] and f_{t+shift} over rows where that feature exists."""
    target = torch.zeros_like(features)
    target[:, :-shift] = features[:, shift:]
    keep = mask.clone()
    keep[:, -shift:] = False
    if not keep.any():
        return hidden.sum() * 0.0
    return F.smooth_l1_loss(hidden[keep], target[keep])


class TrainingObjective(torch.nn.Module):
    """The head plus its loss, as one module for ``accelerator.prepare`` (DDP only syncs what runs in ``forward``).

    The target model is *not* inside: it is frozen and borrowed; only the head's parameters train.
    """

    def __init__(self, head, vocab: TrainingVocabulary, label_source: str = "target", unroll_steps: int = 1,
                 feature_loss_weight: float = 1.0, decay: float = 1.0, answers_only: bool = True):
        super().__init__()
        if label_source not in ("target", "data"):
            raise ValueError(f"label_source must be 'target' or 'data', got {label_source!r}.")
        if not isinstance(unroll_steps, int) or isinstance(unroll_steps, bool) or unroll_steps < 1:
            raise ValueError(f"unroll_steps must be a positive int, got {unroll_steps!r}.")
        if hasattr(head, "heads") and unroll_steps != 1:
            raise ValueError(f"unroll_steps={unroll_steps} is an EAGLE setting (training-time test); Medusa heads "
                             "train on one step, so leave unroll_steps=1.")
        self.head = head
        self.vocab, self.label_source = vocab, label_source
        self.unroll_steps, self.feature_loss_weight, self.decay = unroll_steps, feature_loss_weight, decay
        self.answers_only = answers_only

    def forward(self, batch: dict) -> LossOutput:
        if hasattr(self.head, "heads"):  # MedusaHeads
            return medusa_loss(self.head, batch, self.vocab, self.label_source, self.decay, self.answers_only)
        return eagle_loss(self.head, batch, self.vocab, self.unroll_steps, self.label_source,
                          self.feature_loss_weight, self.decay, self.answers_only)

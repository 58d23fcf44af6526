"""Training a head's own draft vocabulary (EAGLE-3, Li et al. arXiv 2503.01840 §3): pick the N most frequent target
tokens of the training data, give the head an ``[N, H]`` projection over them, and train it.

Boundary: choosing the ids (label counts of the training set), initialising the head's ``lm_head`` rows from the
base LM head, and a ``TrainingVocabulary`` whose projection is the head's own. The buffers and the id maps live on
the head (``modeling_common``: ``d2t``, ``t2d``, ``draft_to_target``); the losses are ``objectives.py``'s.

Cost (per scored row, H hidden, V target vocabulary, N draft vocabulary): the LM projection takes ``2·H·V`` FLOPs
and reads ``V·H`` weights; the draft vocabulary cuts both by ``V / N`` in training (forward and backward) and at
every draft step. SmolLM2-135M (H = 576, V = 49,152) with N = 8,192: 56.6 → 9.4 MFLOP per row, 56.6 → 9.4 MB of
fp16 weights read. Exact at inference (the target verifies); a token outside the N is never proposed.

Shapes: V target vocabulary, N draft vocabulary, H hidden.
"""

from __future__ import annotations

import torch

from hf_kvspec.heads.objectives import TrainingVocabulary


def projection_cost(hidden: int, vocab: int, draft_vocab: int | None, bytes_per_weight: int = 2) -> dict:
    """FLOPs per scored row and weight bytes of the LM projection, full vs draft vocabulary."""
    rows = draft_vocab or vocab
    return {"flops_per_row": 2 * hidden * rows, "full_flops_per_row": 2 * hidden * vocab,
            "weight_bytes": rows * hidden * bytes_per_weight, "full_weight_bytes": vocab * hidden * bytes_per_weight,
            "saving": vocab / rows}


def most_frequent_labels(dataset, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent label tokens of ``dataset`` (data tokens and target predictions; ties and unseen
    ids by ascending id), int64 [N]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for item in dataset:
        counts += torch.bincount(torch.as_tensor(item["input_ids"]), minlength=vocab_size)
        if "target_tokens" in item:
            counts += torch.bincount(torch.as_tensor(item["target_tokens"]), minlength=vocab_size)
    return torch.sort(-counts, stable=True).indices[:size]


@torch.no_grad()
def init_draft_vocab(head, token_ids: torch.Tensor) -> None:
    """Set the head's draft vocabulary to ``token_ids`` and start its ``lm_head`` as the base LM head's rows."""
    head.set_draft_vocab(token_ids)
    base = head.borrowed().lm_head.weight
    head.lm_head.weight.copy_(base[head.draft_vocab_ids().to(base.device)].to(head.lm_head.weight.dtype))


class HeadVocabulary(TrainingVocabulary):
    """Training vocabulary = the head's draft vocabulary; ``logits`` project onto the head's own ``lm_head``
    (the ``weight`` the loss passes, the borrowed base head, is not used).

    The ids follow the head: loading a state into it (``accelerator.load_state`` on resume) replaces ``lm_head``
    and ``d2t`` together, and the label columns are taken from the ``d2t`` the head holds at each use, never from
    the one it held when this object was made."""

    def __init__(self, head):
        self.head = head
        self._synced: torch.Tensor | None = None
        self._sync()

    def _sync(self) -> None:
        ids = self.head.draft_vocab_ids().cpu()
        if self._synced is None or not torch.equal(ids, self._synced):
            super().__init__(self.head.config.base_vocab_size, ids)
            self._synced = ids

    def columns(self, labels: torch.Tensor) -> torch.Tensor:
        self._sync()
        return super().columns(labels)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # hidden [..., H] -> [..., N]; columns are draft ids (ascending target ids, as self.columns maps)
        return torch.einsum("...h,nh->...n", hidden, self.head.lm_head.weight.to(hidden.dtype))

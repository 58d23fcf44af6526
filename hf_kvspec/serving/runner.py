"""One forward over ragged rows: packs a round's scheduled rows into a single sequence (batch 1, per-token
``position_ids``), runs the unmodified transformers model on it and returns the logits the round samples from.

Boundary: input building and the forward only. What to run comes from ``scheduler.py``; K/V storage and the
packed layout's bookkeeping are ``RaggedPagedCache``'s; attention over the rows is ``attention.py``
(``kvspec_ragged``), to which the model is switched for the duration of the forward only, so the model stays
usable by ``generate`` and everything else between rounds. Committing or rolling back the round's K/V is the
caller's (``cache.end_forward``), once the round's tokens are chosen.

Layout of a round with rows a (decode), b (prefill chunk of 3), c (decode):

    input_ids     [[ a5 | b0 b1 b2 | c9 ]]     T = 5 packed columns
    position_ids  [[  5 |  0  1  2 |  9 ]]     each row's own positions
    logits rows      a5 (col 0), b2 (col 3) if b's chunk ends its prompt, c9 (col 4)

Speculation seam: a row's ``draft_tokens`` extra columns (with a tree mask and depth positions via
``RaggedRow.new_token_mask``) ride in the same packed run; their logits columns are requested the same way.

Shape legend: T packed tokens of the round · K logits rows kept · V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from hf_kvspec import _compat
from hf_kvspec.cache.ragged import RaggedPagedCache, RaggedRow

from .attention import ATTN_NAME
from .scheduler import ScheduledRow


@contextmanager
def ragged_attention_switched(model):
    """The model attends with ``kvspec_ragged`` inside the block and with what it had before, after."""
    previous = _compat.attn_implementation(model.config)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class ForwardRunner:
    """Builds the packed inputs of a round and runs the model over them."""

    def __init__(self, model, cache: RaggedPagedCache):
        self.model, self.cache = model, cache
        self.device = model.device

    def pack(self, rows: Sequence[ScheduledRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [1, T], position_ids [1, T], logits_columns [K])`` of the rows, in row order."""
        ids, positions, logits_columns, column = [], [], [], 0
        for row in rows:
            ids += row.request.tokens[row.start: row.start + row.num_tokens]
            positions += range(row.start, row.start + row.num_tokens)
            column += row.num_tokens
            if row.samples:
                logits_columns.append(column - 1)
        return self._long([ids]), self._long([positions]), self._long(logits_columns)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def run(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:  # [K, V]
        """Forward the rows; their new K/V are written (uncommitted). Logits of the rows that sample, in order."""
        input_ids, position_ids, logits_columns = self.pack(rows)
        self.cache.begin_forward([RaggedRow(r.request.request_id, r.start, r.num_tokens) for r in rows],
                                 self.device)
        # no_grad, not inference_mode: pages made inside inference mode could not be copied (copy-on-write) outside it
        with torch.no_grad(), ragged_attention_switched(self.model):
            out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True,
                             logits_to_keep=logits_columns)
        return out.logits[0]

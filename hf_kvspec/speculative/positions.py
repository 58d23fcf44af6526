"""Logits processors and stopping criteria applied at many positions at once, each with its own prefix.

Boundary: wraps the ``LogitsProcessorList`` / ``StoppingCriteriaList`` that ``generate`` built, so that p and q are
the same *processed* distributions plain ``generate`` would sample from, and stops land on the same token. Knows
nothing about models or caches.

Plain ``generate`` calls each processor with ``input_ids`` = left-padded prompt + tokens generated so far. A
speculative round scores T positions per row in one go; position j of row i must see row i's history plus the
first j draft tokens, never the draft tokens after it (path-dependent processors: repetition penalty, no-repeat
n-gram, min-length, ...). Processors that look only at the scores are applied once to all positions; the others
are called once per distinct prefix length, on the whole batch in row order (processors may keep per-row
state), so each row at its position sees exactly the ``input_ids`` row ``generate`` would have given it.

Shapes: ``B`` rows, ``T`` positions per row, ``V`` vocabulary, ``S`` history capacity.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from hf_kvspec import _compat


class History:
    """Every row as ``generate`` sees it: left-padded prompt followed by the tokens generated so far.

    Row i is ``ids[i, :lengths[i]]``; rows grow at different speeds (per-row acceptance), and slots past a row's
    length hold ``pad_token_id`` so that a finished row reads as ``generate``'s padded output.
    """

    def __init__(self, prompt: torch.Tensor, capacity: int, pad_token_id: int):
        batch, prompt_len = prompt.shape  # [B, P]
        self.ids = torch.full((batch, capacity), pad_token_id, dtype=torch.long, device=prompt.device)  # [B, S]
        self.ids[:, :prompt_len] = prompt
        self.lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=prompt.device)  # [B]
        self.prompt_len = prompt_len
        self.pad_token_id = pad_token_id

    def extended(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, max_len + T]``: each row followed by ``tokens`` [B, T] (not committed)."""
        width = int(self.lengths.max()) + tokens.shape[1]
        self._reserve(width)
        ids = self.ids[:, :width].clone()
        if tokens.shape[1]:
            cols = self.lengths[:, None] + torch.arange(tokens.shape[1], device=ids.device)
            ids.scatter_(1, cols, tokens)
        return ids

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first ``counts[i]`` of ``tokens[i]`` ([B, T]) to row i."""
        if not tokens.shape[1]:
            return
        self._reserve(int(self.lengths.max()) + tokens.shape[1])
        cols = self.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
        keep = cols < (self.lengths + counts)[:, None]
        self.ids.scatter_(1, cols, torch.where(keep, tokens, self.ids.gather(1, cols)))
        self.lengths += counts

    def select_rows(self, index: torch.Tensor) -> History:
        """A new ``History`` holding rows ``index`` [A] of this one (copies; this one is unchanged)."""
        out = History.__new__(History)
        out.ids, out.lengths = self.ids[index], self.lengths[index]  # [A, S], [A]
        out.prompt_len, out.pad_token_id = self.prompt_len, self.pad_token_id
        return out

    def merged(self, rows: History, index: torch.Tensor) -> History:
        """A copy of this history whose rows ``index`` [A] are replaced by ``rows`` (an ``[A, *]`` history, e.g. a
        node's path appended to the active rows); the other rows are kept as stand-ins."""
        width = max(self.ids.shape[1], rows.ids.shape[1])
        out = History.__new__(History)
        out.ids = self.ids.new_full((self.ids.shape[0], width), self.pad_token_id)
        out.ids[:, : self.ids.shape[1]] = self.ids
        out.ids[index, : rows.ids.shape[1]] = rows.ids
        out.lengths = self.lengths.clone()
        out.lengths[index] = rows.lengths
        out.prompt_len, out.pad_token_id = self.prompt_len, self.pad_token_id
        return out

    def along(self, path: torch.Tensor, depth: torch.Tensor) -> History:
        """A history whose row b is this row b followed by ``path[b, :depth[b]]`` (``path`` [B, D], ``depth`` [B])."""
        ids = self.extended(path)  # [B, max_len + D]
        out = History(ids, ids.shape[1], self.pad_token_id)
        out.lengths = self.lengths + depth
        return out

    def sequences(self) -> torch.Tensor:
        """``[B, max_len]`` the output of ``generate``: rows that stopped early are padded on the right."""
        return self.ids[:, : int(self.lengths.max())]

    def _reserve(self, width: int) -> None:
        if width > self.ids.shape[1]:  # only when a caller appends past the planned capacity
            grow = max(width - self.ids.shape[1], self.ids.shape[1])
            extra = self.ids.new_full((self.ids.shape[0], grow), self.pad_token_id)
            self.ids = torch.cat([self.ids, extra], dim=1)


def _length_groups(prefix_lengths: torch.Tensor):
    """For each distinct prefix length L in ``prefix_lengths`` [B, T] yield ``(L, rows, position)``: ``rows`` [B]
    bool, the rows that have a position with prefix length L, and ``position`` [B] that position (clamped into
    0..T-1 for the other rows, whose results are discarded)."""
    positions = prefix_lengths.shape[1]
    first = prefix_lengths[:, 0]
    for length in torch.unique(prefix_lengths).tolist():
        offset = length - first
        yield length, (offset >= 0) & (offset < positions), offset.clamp(0, positions - 1)


class PositionwiseProcessor:
    """``generate``'s logits processors applied at T positions per row, each with its own prefix."""

    def __init__(self, processors: LogitsProcessorList | None):
        self.processors = list(processors or [])
        score_only = _compat.score_only_processor_classes()  # scores only, never input_ids
        self.score_only = [isinstance(proc, score_only) for proc in self.processors]

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, history: History, draft_tokens: torch.Tensor, logits: torch.Tensor,
                 start: int = 0) -> torch.Tensor:
        """Processed float32 scores ``[B, T, V]`` for ``logits`` [B, T, V]; position t follows each row's history
        and ``draft_tokens[:, :start + t]`` (extra columns of ``draft_tokens`` are ignored)."""
        batch, positions, vocab = logits.shape
        scores = logits.reshape(batch * positions, vocab).to(dtype=torch.float32, copy=True)
        if not self.processors:
            return scores.view(batch, positions, vocab)
        prefixes = history.extended(draft_tokens[:, : start + positions - 1])  # [B, max_len + start + T - 1]
        prefix_lengths = history.lengths[:, None] + start + torch.arange(positions, device=logits.device)  # [B, T]
        groups = None
        for proc, score_only in zip(self.processors, self.score_only):
            if score_only:  # input_ids is not read; any [rows, *] tensor will do
                scores = proc(prefixes[:, :1].repeat_interleave(positions, 0), scores)
                continue
            groups = groups if groups is not None else list(_length_groups(prefix_lengths))
            scores = _per_length(proc, prefixes, scores.view(batch, positions, vocab), groups).view(-1, vocab)
        return scores.view(batch, positions, vocab)


def _per_length(proc, prefixes: torch.Tensor, scores: torch.Tensor, groups) -> torch.Tensor:
    """Apply a path-dependent processor once per prefix length, always to the whole batch in row order.

    Processors may hold per-row state (``RepetitionPenaltyLogitsProcessor.prompt_ignore_length`` is [B];
    ``PrefixConstrainedLogitsProcessor`` passes the row index to its callback), so a call must see all B rows.
    Rows without a position of that length get a stand-in prefix; their results are dropped.
    """
    out = scores.clone()  # [B, T, V]
    rows = torch.arange(scores.shape[0], device=scores.device)
    for length, wanted, position in groups:
        processed = proc(prefixes[:, :length], scores[rows, position])  # [B, V]
        out[rows[wanted], position[wanted]] = processed[wanted]
    return out


class PositionwiseStopper:
    """``generate``'s stopping criteria checked after each of T candidate tokens per row.

    End-of-sequence ids and the length limit are evaluated natively (vectorised); any other criterion (stop
    strings, max time, user criteria) is called once per distinct prefix length.
    """

    def __init__(self, criteria: StoppingCriteriaList | None):
        self.eos = None
        self.max_length = None
        self.others = []
        for criterion in criteria or []:
            ids, limit = _compat.eos_criterion_ids(criterion), _compat.max_length_criterion_limit(criterion)
            if ids is not None:
                self.eos = ids if self.eos is None else torch.cat([self.eos, ids])
            elif limit is not None:
                self.max_length = limit if self.max_length is None else min(limit, self.max_length)
            else:
                self.others.append(criterion)

    def keep(self, history: History, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """How many of the first ``counts`` of ``tokens`` [B, T] each row keeps, and whether the row stopped.

        A row stops at the first token that ends it (EOS, stop string, ...) or that reaches ``max_length``;
        that token is kept, the ones after it are dropped.
        """
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        valid = positions[None, :] < counts[:, None]  # [B, T]
        hits = torch.zeros_like(valid)
        if self.eos is not None:
            hits |= torch.isin(tokens, self.eos.to(tokens.device))
        if self.others:
            hits |= self._other_hits(history, tokens, counts)
        if self.max_length is not None:
            hits |= (history.lengths[:, None] + positions[None, :] + 1) >= self.max_length
        hits &= valid
        stopped = hits.any(dim=1)
        first = hits.long().argmax(dim=1)  # index of the first hit (0 when none)
        keep = torch.where(stopped, first + 1, counts)
        return keep, stopped

    def _other_hits(self, history: History, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        positions = tokens.shape[1]
        prefixes = history.extended(tokens)
        prefix_lengths = history.lengths[:, None] + torch.arange(1, positions + 1, device=tokens.device)
        hits = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)  # [B, T]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        for length, wanted, position in _length_groups(prefix_lengths):
            done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            for criterion in self.others:  # whole batch, in row order (criteria may keep per-row state)
                done |= criterion(prefixes[:, :length], None).to(tokens.device).reshape(-1).bool()
            hits[rows[wanted], position[wanted]] = done[wanted]
        return hits

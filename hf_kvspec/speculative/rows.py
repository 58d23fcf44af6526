"""Which rows of a ``generate`` call the model still sees, and which of those still generate: the per-call row state.

Boundary: the one owner of the mapping between the *call's* rows (``B``: the output, generate's logits processors and
stopping criteria, always in the caller's order) and the *active* rows (``A``: the model batch, the token buffer,
the caches, the drafter). Everything a round touches takes and returns active-row tensors; the conversions to and
from the call's rows happen here and nowhere else. No model calls.

Two sets of rows:
    active  rows in the model batch (``index`` [A], ascending call-row indices).
    alive   active rows still generating (``alive`` [A] bool). A finished row stays active (fed holes, results
            discarded) until it may leave: when the loop owns the cache, rows leave after the round that finished
            them (``leave``), as continuous-batching servers do; a caller's cache keeps its rows.

Why processors and criteria still see all ``B`` rows: they may keep per-row state or pass row indices to callbacks
(``PrefixConstrainedLogitsProcessor``, repetition penalty's ``prompt_ignore_length``), so this module scatters the
active rows' logits and drafts into full-size tensors (rows that left get stand-ins, their results are dropped) and
hands the active rows' results back.

Shapes: ``B`` rows of the call, ``A`` active rows, ``T`` positions, ``V`` vocabulary, ``S`` history capacity.
"""

from __future__ import annotations

import torch

from hf_kvspec.speculative.positions import History, PositionwiseProcessor, PositionwiseStopper


class ActiveRows:
    """The row state of one call: the full ``history`` plus which rows are active and alive (module docstring).

    ``processor`` and ``stopper`` are generate's, wrapped position by position (``positions.py``); the methods below
    call them with active-row tensors."""

    def __init__(self, history: History, processor: PositionwiseProcessor, stopper: PositionwiseStopper,
                 may_leave: bool):
        self.full = history  # [B, S]
        self.batch = history.ids.shape[0]
        device = history.ids.device
        self.index = torch.arange(self.batch, device=device)  # [A]
        self.alive = torch.ones(self.batch, dtype=torch.bool, device=device)  # [A]
        self.may_leave = may_leave  # finished rows may leave the model batch (the loop owns the cache)
        self.process = _ActiveProcessor(processor, self)
        self.stopper = stopper
        self._view: History | None = None

    # ------------------------------------------------------------------------------------------ queries
    @property
    def complete(self) -> bool:
        """Whether every row of the call is active (the call's rows and the active rows coincide)."""
        return self.index.shape[0] == self.batch

    @property
    def any_alive(self) -> bool:
        return bool(self.alive.any())

    @property
    def history(self) -> History:
        """The active rows' history ``[A, S]`` (the full one itself while every row is active)."""
        if self._view is None:
            self._view = self.full if self.complete else self.full.select_rows(self.index)
        return self._view

    def call_alive(self) -> torch.Tensor:
        """``[B]`` rows of the call still generating (rows that left are done)."""
        return self._expand(self.alive, False)

    def room(self, max_length: int | None) -> int:
        """Most tokens any alive row may still add before ``max_length`` (which counts the prompt, as in generate)."""
        if max_length is None:
            return 1 << 30
        return int((max_length - self.history.lengths[self.alive]).max())

    # ------------------------------------------------------------------------------------------ a round's results
    def keep(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stopping criteria over the first ``counts`` [A] of ``tokens`` [A, T]: kept counts [A] and stopped [A]
        (``PositionwiseStopper.keep``, evaluated on the call's rows)."""
        keep, stopped = self.stopper.keep(self.full, self._expand(tokens), self._expand(counts))
        return self._take(keep), self._take(stopped)

    def commit(self, tokens: torch.Tensor, counts: torch.Tensor, stopped: torch.Tensor) -> None:
        """Append the first ``counts`` [A] of ``tokens`` [A, T] to the history; rows that ``stopped`` [A] stop."""
        self.full.append(self._expand(tokens), self._expand(counts))
        self.alive = self.alive & ~stopped
        self._view = None

    def leave(self, buffer, cache, drafter) -> int:
        """Take the active rows that are no longer alive out of the model batch (buffer, cache, drafter) when rows
        may leave and some row still generates; returns how many left."""
        if not self.may_leave or bool(self.alive.all()) or not self.any_alive:
            return 0
        local = self.alive.nonzero().reshape(-1)  # [A'] positions among the old active rows
        finished = self.index[~self.alive].tolist()  # call-row ids of the rows that leave
        self.index, self.alive, self._view = self.index[local], self.alive[local], None
        buffer.select_rows(local)
        cache.batch_select_indices(local.cpu())  # a CPU index selects on any device (offloaded or split caches)
        drafter.release(finished)
        return len(finished)

    # ------------------------------------------------------------------------------------------ conversions
    def call_rows(self) -> list[int]:
        """The call-row index of each active row (for per-row outputs)."""
        return self.index.tolist()

    def _take(self, full: torch.Tensor) -> torch.Tensor:
        # [B, ...] -> [A, ...]
        return full if self.complete else full[self.index]

    def _expand(self, active: torch.Tensor, fill=0) -> torch.Tensor:
        # [A, ...] -> [B, ...], ``fill`` in the rows that left
        if self.complete:
            return active
        full = active.new_full((self.batch, *active.shape[1:]), fill)
        full[self.index] = active
        return full


class _ActiveProcessor:
    """Generate's processors called with active-row tensors: ``(history [A], drafts [A, *], logits [A, T, V], start)
    -> scores [A, T, V]``, evaluated on all ``B`` rows (the active rows' ``history`` in place of theirs)."""

    def __init__(self, processor: PositionwiseProcessor, rows: ActiveRows):
        self.inner, self.rows = processor, rows

    def __bool__(self) -> bool:
        return bool(self.inner)

    @property
    def score_only(self) -> list[bool]:
        return self.inner.score_only

    def __call__(self, history: History, draft_tokens: torch.Tensor, logits: torch.Tensor, start: int = 0):
        rows = self.rows
        if rows.complete or not self.inner:  # nothing to scatter, or no processor reads the history
            return self.inner(history, draft_tokens, logits, start)
        full = rows.full.merged(history, rows.index)  # history may extend the active rows (a tree node's path)
        scores = self.inner(full, rows._expand(draft_tokens), rows._expand(logits), start)
        return rows._take(scores)

"""The lookahead branch of Lookahead decoding (Fu et al. 2402.02057): a window of Jacobi guesses, its attention mask,
and the combined 4D mask of one forward that carries the window beside the round's verification tree.

Boundary: pure tensor bookkeeping. No model, no cache, no sampling; the assistant (``lookahead.py``) runs the
forward, the pool (``ngram_pool.py``) keeps what the window yields.

The window holds, per row, ``N - 1`` levels of ``W`` guesses (level 0 the oldest). Guess ``(l, j)`` (level l,
column j) sits at position ``root + 1 + j + l`` and sees the committed prefix, the root, level 0's guesses
``0..j`` and its own column's guesses at levels ``1..l``: the sequence ``level0[0..j], level1[j], ..., levell[j]``
at consecutive positions. The target's argmax at ``(N - 2, j)`` is therefore its guess for the token after that
sequence: the new level's column j. Column j's trajectory ``level0[j], ..., level(N-2)[j], new[j]`` is the n-gram
the round harvests (``N`` consecutive tokens of one sequence); the window then drops level 0 and appends the new
level (one Jacobi step per target forward). Until ``N - 1`` levels exist (warm-up), the new level is appended and
nothing is harvested.

Worked example, W = 3, N = 3: levels ``a`` (level 0) and ``b`` (level 1); the root r at position p; the
verification tree has nodes ``x -> y`` and ``x -> z`` (one row, the cache holds the prefix ``s``)::

    forward ids   = [r, x, y, z, a0, a1, a2, b0, b1, b2]
    positions     = [p, p+1, p+2, p+2, p+1, p+2, p+3, p+2, p+3, p+4]
    mask (True = attend; keys: prefix | r x y z | a0 a1 a2 b0 b1 b2)
        r:   s | 1 . . . | . . . . . .        a0:  s | 1 . . . | 1 . . . . .
        x:   s | 1 1 . . | . . . . . .        a1:  s | 1 . . . | 1 1 . . . .
        y:   s | 1 1 1 . | . . . . . .        a2:  s | 1 . . . | 1 1 1 . . .
        z:   s | 1 1 . 1 | . . . . . .        b0:  s | 1 . . . | 1 . . 1 . .
                                              b1:  s | 1 . . . | 1 1 . . 1 .
                                              b2:  s | 1 . . . | 1 1 1 . . 1
    logits kept: r, x, y, z (verification) and b0, b1, b2 (the new level c0 c1 c2)
    harvested:   (a0, b0, c0), (a1, b1, c1), (a2, b2, c2); then the window is b / c

The verification rows never see a window column and the window rows never see a node, so the root's and the
nodes' logits are those of a forward without the window, and dropping the window's ``W (N - 1)`` cache columns
(the last ones written) leaves the cache a plain verify forward would.

Shapes: ``A`` rows, ``W`` window width, ``N`` n-gram length, ``L`` window tokens (levels x width), ``Q`` verified
columns (root + nodes), ``S`` cached columns.
"""

from __future__ import annotations

import torch


def window_mask(levels: int, width: int, device=None) -> torch.Tensor:
    """``[L, L]`` bool (True = attend), ``L = levels * width``, level-major order (index ``l * width + j``):
    ``(l, j)`` sees level 0's columns ``0..j`` and its own column at levels ``1..l``."""
    level = torch.arange(levels, device=device).repeat_interleave(width)
    column = torch.arange(width, device=device).repeat(levels)
    lq, jq, lk, jk = level[:, None], column[:, None], level[None], column[None]
    return ((lk == 0) & (jk <= jq)) | ((lk >= 1) & (jk == jq) & (lk <= lq))


def window_offsets(levels: int, width: int, device=None) -> torch.Tensor:
    """``[L]`` position of each window token after the root: ``1 + j + l``."""
    level = torch.arange(levels, device=device).repeat_interleave(width)
    return 1 + level + torch.arange(width, device=device).repeat(levels)


def verify_block(attention_mask: torch.Tensor | None, rows: int, held: int, count: int,
                 device=None) -> torch.Tensor:
    """The mask of a plain verify forward as bool ``[A, Q, S + Q]`` (True = attend), from the loop's
    ``attention_mask``: ``None`` (nothing masked, causal), 2D ``[A, S + Q]`` (a chain: padding and holes, causal)
    or 4D ``[A, 1, Q, >= S + Q]`` (a tree; additive float or bool, key columns past ``S + Q`` are a static
    cache's free slots)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        block = attention_mask[:, 0, :, : held + count]
        return block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min / 2
    if attention_mask is None:
        prefix = torch.ones(rows, held, dtype=torch.bool, device=device)
    else:
        prefix = attention_mask[:, :held].bool()
    causal = torch.ones(count, count, dtype=torch.bool, device=prefix.device).tril()
    return torch.cat([prefix[:, None].expand(rows, count, held), causal.expand(rows, count, count)], dim=2)


def combined_mask(block: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """``block`` [A, Q, S + Q] (a verify forward's mask; row 0 is the root's) and ``window`` [L, L] -> bool
    ``[A, 1, Q + L, S + Q + L]`` for one forward over the root, the nodes and the window, in that order: the
    verification rows see no window column; the window rows see what the root sees (the real prefix and the
    root), no node, and the window as ``window`` says."""
    rows, count, keys = block.shape
    held, size = keys - count, window.shape[0]
    top = torch.cat([block, block.new_zeros(rows, count, size)], dim=2)
    seen = block[:, :1, : held + 1].expand(rows, size, held + 1)  # prefix (padding, holes masked) and the root
    bottom = torch.cat([seen, block.new_zeros(rows, size, count - 1), window.expand(rows, size, size)], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


class JacobiWindow:
    """Each row's window of Jacobi guesses ``[A, l, W]`` (``l <= N - 1`` levels; module docstring).

    ``feed(width)`` gives the tokens, mask and offsets of the first ``width`` columns (column j depends on
    columns ``<= j`` only, so a narrower feed is the window of that width); ``advance(new, width)`` takes the
    target's argmax at the last level of those columns and returns the harvested n-grams ``[A, width, N]`` once
    the window is full (None during warm-up)."""

    def __init__(self, first_level: torch.Tensor, ngram: int):
        if ngram < 2:
            raise ValueError(f"lookahead needs n-grams of at least 2 tokens, got ngram={ngram}")
        self.levels = first_level[:, None].clone()  # [A, 1, W]
        self.ngram = ngram

    @property
    def width(self) -> int:
        return self.levels.shape[2]

    @property
    def depth(self) -> int:
        """Levels held now (``N - 1`` once warmed up)."""
        return self.levels.shape[1]

    def feed(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens [A, L], mask [L, L], offsets [L])`` of the first ``width`` columns, level-major."""
        tokens = self.levels[:, :, :width].flatten(1)
        device = tokens.device
        return tokens, window_mask(self.depth, width, device), window_offsets(self.depth, width, device)

    def advance(self, new: torch.Tensor, width: int) -> torch.Tensor | None:
        """One Jacobi step on columns ``0..width-1`` with ``new`` [A, width] (the argmax at the last level)."""
        if self.depth < self.ngram - 1:  # warm-up: a new level; unfed columns repeat their last guess
            level = self.levels[:, -1].clone()
            level[:, :width] = new
            self.levels = torch.cat([self.levels, level[:, None]], dim=1)
            return None
        grams = torch.cat([self.levels[:, :, :width].transpose(1, 2), new[:, :, None]], dim=2)  # [A, width, N]
        self.levels[:, :, :width] = torch.cat([self.levels[:, 1:, :width], new[:, None]], dim=1)
        return grams

    def select_rows(self, index: torch.Tensor) -> None:
        self.levels = self.levels[index.to(self.levels.device)]

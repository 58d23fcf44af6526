"""The cache-aligned token buffer of the speculative loop: column c of every row is cache slot c.

Boundary: bookkeeping of token ids, attention mask and position ids for the target's (and a draft model's)
cache. No model calls, no sampling.

Why holes: rows of a batch accept different numbers of draft tokens, but a ``Cache`` holds one length for all
rows. After a round the cache is cropped to the longest accepted path; a row that accepted fewer tokens keeps
the rejected draft tokens' slots as *holes*: masked out (attention mask 0) exactly like left padding, and skipped
by position ids, so every row attends to, and is positioned by, its own real tokens only.

Invariant between rounds: the target cache holds ``width - 1`` columns; the last column is every row's newest
token, not yet fed to the target.

Shapes: ``B`` rows, ``W`` buffer width, ``K`` draft tokens.
"""

from __future__ import annotations

import torch


class TokenBuffer:
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int):
        self.tokens = input_ids  # [B, W]
        self.mask = (attention_mask.long() if attention_mask is not None
                     else torch.ones_like(input_ids))  # [B, W] 1 = real token
        self.positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 0)  # [B, W] as generate builds them
        self.has_holes = bool((self.mask == 0).any())
        self.pad_token_id = pad_token_id

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def attention_mask(self, new_tokens: int) -> torch.Tensor | None:
        """``[B, W + new_tokens - 1]`` mask for a forward that feeds the last column plus ``new_tokens - 1`` more;
        ``None`` when nothing is masked (cheaper, and what ``generate`` passes)."""
        if not self.has_holes:
            return None
        return torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], new_tokens - 1)], dim=1)

    def next_positions(self, count: int) -> torch.Tensor:
        """``[B, count]`` position ids of the last column and the ``count - 1`` tokens that would follow it."""
        return self.positions[:, -1:] + torch.arange(count, device=self.positions.device)

    def append_round(self, accepted: torch.Tensor, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
                     alive: torch.Tensor) -> None:
        """Append a round: ``accepted`` [B, m] (row i's first ``num_accepted[i]`` are real, the rest become holes),
        then ``next_tokens`` [B]. Rows not ``alive`` get holes only."""
        width = accepted.shape[1]
        cols = torch.arange(width, device=accepted.device)
        real = (cols[None, :] < num_accepted[:, None]) & alive[:, None]  # [B, m]
        new_tokens = torch.cat([torch.where(real, accepted, self.pad_token_id), next_tokens[:, None]], dim=1)
        new_mask = torch.cat([real, alive[:, None]], dim=1).long()  # [B, m + 1]
        # holes get position 0 like left padding (they are masked); the last column of a live row is real,
        # so positions[:, -1] is always that row's newest real position
        new_positions = (self.positions[:, -1:] + new_mask.cumsum(-1)).masked_fill(new_mask == 0, 0)
        self.has_holes = self.has_holes or not bool(new_mask.all())
        self.tokens = torch.cat([self.tokens, new_tokens], dim=1)
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        self.positions = torch.cat([self.positions, new_positions], dim=1)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [A] (finished rows leaving the batch; see ``rows.py``)."""
        self.tokens, self.mask, self.positions = self.tokens[index], self.mask[index], self.positions[index]

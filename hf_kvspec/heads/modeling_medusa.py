"""Medusa heads (Cai et al., arXiv 2401.10774, "Medusa-1": frozen backbone) as a ``PreTrainedModel``.

Boundary: maps the base model's last hidden state to K next-next-... token distributions. Tree construction and
verification live in ``hf_kvspec.speculative``; training in ``scripts/train_drafter.py``.

Shapes: B batch, T positions, H hidden size, V vocabulary, K heads.
Head k (0-based) at position t predicts token t+k+2, i.e. the token after the one the base LM head predicts
(the paper's "head k predicts t+k+1" counts the base head as head 0).

Deviation from the reference code: the paper's repo builds ``[ResBlock(h)] * n``, which repeats *one* module n
times; here every block is its own module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.utils import ModelOutput

from hf_kvspec.heads.configuration import MedusaConfig
from hf_kvspec.heads.modeling_common import DraftHeadModel


class ResidualBlock(nn.Module):
    """``x + SiLU(W x + b)``; W and b start at zero so an untrained head reproduces the base model's next token."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.linear.zero_init = True  # read by MedusaHeads._init_weights (Linear layers are initialised one by one)
        self.act = nn.SiLU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.act(self.linear(hidden))


class MedusaHead(nn.Module):
    """``num_layers`` distinct residual blocks, then (optionally) the head's own vocabulary projection."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(config.base_hidden_size) for _ in range(config.num_layers))
        self.lm_head = (None if config.share_lm_head
                        else nn.Linear(config.base_hidden_size, config.base_vocab_size, bias=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


@dataclass
class MedusaOutput(ModelOutput):
    """logits: [K, B, T, V]; head_hidden_states: [K, B, T, H] (before the vocabulary projection)."""

    logits: torch.Tensor | None = None
    head_hidden_states: torch.Tensor | None = None


class MedusaHeads(DraftHeadModel):
    """K Medusa heads over a frozen base model's last hidden state.

    Example::

        heads = MedusaHeads.from_pretrained(path).attach(base_model)   # checks the pairing
        hidden = base_model(ids, output_hidden_states=True).hidden_states[-1]     # [B, T, H]
        logits = heads(hidden).logits                                              # [K, B, T, V]
    """

    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(MedusaHead(config) for _ in range(config.num_heads))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            init.zeros_(module.weight)
            init.zeros_(module.bias)
        else:
            super()._init_weights(module)

    def projection_weight(self, head_index: int) -> torch.Tensor:
        """[V, H] vocabulary projection of one head (its own, or the borrowed base LM head)."""
        own = self.heads[head_index].lm_head
        return own.weight if own is not None else self.borrowed().lm_head.weight

    def head_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [K, B, T, H]: every head's residual blocks applied to the same hidden state."""
        return torch.stack([head(hidden_states) for head in self.heads])

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> MedusaOutput:
        """hidden_states: [B, T, H] last hidden state of the base model (after its final norm)."""
        head_hidden = self.head_hidden_states(hidden_states)
        logits = torch.stack([
            torch.einsum("bth,vh->btv", head_hidden[k], self.projection_weight(k)) for k in range(len(self.heads))
        ])
        return MedusaOutput(logits=logits, head_hidden_states=head_hidden)

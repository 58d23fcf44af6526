"""The early-exit adapter (Kangaroo, Liu et al. arXiv 2404.18911) as a ``PreTrainedModel``, and its training loss.

Boundary: maps the base model's layer-E hidden states to hidden states for the base model's own final norm and LM
head (both borrowed, frozen). Drafting with it is ``hf_kvspec.speculative.drafters.early_exit.EarlyExitAssistant``;
training is ``scripts/train_drafter.py --head early_exit``.

Shapes: B batch, T positions, H hidden size, I adapter width, V vocabulary, V' training vocabulary.

Design: ``h + down(silu(gate(n(h))) * up(n(h)))`` with ``n`` an RMSNorm, i.e. one pre-norm gated MLP block with a
residual, ``down`` zero-initialised so an untrained adapter is the identity (plain early exit).

Why position-wise (deviation from Kangaroo, whose adapter is one attention layer + norms): the adapter sees only
its own column, so drafting keeps no K/V for it. ``EarlyExitAssistant`` then needs no second cache to grow, crop
and roll back with the target's, and the kept layer-E states it hands to the verify pass stay the adapter's only
input. An attention adapter would need its own cache per row, cropped after every round.

Why cross-entropy on the target's greedy tokens (not KL to its full distribution): greedy verification accepts a
draft exactly when it is the target's argmax, so the argmax is the quantity to match; the labels are the
``target_tokens`` the feature cache already stores (one int per position instead of top-k logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init

from hf_kvspec import _compat
from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
from hf_kvspec.heads.modeling_common import DraftHeadModel
from hf_kvspec.heads.objectives import LossOutput, TrainingVocabulary, answer_rows, head_cross_entropy


@dataclass
class BorrowedNorm:
    """The base model's final norm; a plain dataclass so ``nn.Module`` does not adopt it (nor save it)."""

    norm: nn.Module


class ExitAdapter(DraftHeadModel):
    """Position-wise adapter from the base model's layer-E states to its final norm + LM head.

    Example::

        adapter = ExitAdapter.from_pretrained(path).attach(base_model)           # checks the pairing
        assistant = hf_kvspec.EarlyExitAssistant(adapter.config.exit_layer, adapter=adapter)
        hidden = base_model(ids, output_hidden_states=True).hidden_states[adapter.config.exit_layer]   # [B, T, H]
        logits = adapter.logits(hidden)                                                             # [B, T, V]
    """

    config_class = ExitAdapterConfig
    main_input_name = "hidden_states"

    def __init__(self, config: ExitAdapterConfig):
        super().__init__(config)
        hidden, width = config.base_hidden_size, config.intermediate_size
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj.zero_init = True  # read by _init_weights: the untrained adapter is the identity
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            init.zeros_(module.weight)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)
        else:
            super()._init_weights(module)

    def attach(self, base_model: nn.Module, strict: bool = True) -> ExitAdapter:
        """Pairing check (``DraftHeadModel.attach``), depth check, and borrow the final norm too."""
        super().attach(base_model, strict=strict)
        depth = base_model.config.get_text_config().num_hidden_layers
        if depth != self.config.base_num_layers:
            raise ValueError(f"This exit adapter was trained for a {self.config.base_num_layers}-layer base model; "
                             f"this one has {depth} layers. Train one for it with scripts/train_drafter.py --head "
                             f"early_exit --exit_layer E.")
        self._final_norm = BorrowedNorm(_compat.decoder_stack(base_model)[3])
        return self

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """hidden_states [B, T, H] after base layers 0..E-1 -> [B, T, H] for the base model's final norm."""
        normed = self.norm(hidden_states)
        return hidden_states + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def final_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Layer-E states [B, T, H] -> normalised states [B, T, H] for the LM head (adapter, borrowed final norm)."""
        self.borrowed()  # refuses an unattached adapter by name
        return self._final_norm.norm(self(hidden_states))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Layer-E states [B, T, H] -> draft logits [B, T, V] through the borrowed LM head."""
        return self.borrowed().lm_head(self.final_hidden(hidden_states))


def exit_loss(adapter: ExitAdapter, batch: dict, vocab: TrainingVocabulary, answers_only: bool = False) -> LossOutput:
    """Mean CE of the adapter's exit logits at row t against the target's greedy token at row t (its prediction of
    token t+1), over every real position (``answers_only``: those whose token t+1 is an answer token, as in
    ``objectives``). batch: ``features`` [B, T, H] layer-E states, ``target_tokens`` [B, T], ``valid`` [B, T]."""
    hidden = adapter.final_hidden(batch["features"].to(adapter.dtype))                      # [B, T, H]
    weight = adapter.borrowed().lm_head.weight                                              # [V, H]
    mask = batch["valid"] & answer_rows(batch, 0) if answers_only else batch["valid"]        # [B, T]
    loss, hits, count = head_cross_entropy(hidden, weight, batch["target_tokens"], mask, vocab)
    return LossOutput(loss / count.clamp(min=1), hits.detach()[None], count[None])


class ExitObjective(nn.Module):
    """The adapter plus ``exit_loss``, one module for ``accelerator.prepare`` (the frozen base is not inside)."""

    def __init__(self, head: ExitAdapter, vocab: TrainingVocabulary, answers_only: bool = True):
        super().__init__()
        self.head, self.vocab, self.answers_only = head, vocab, answers_only

    def forward(self, batch: dict) -> LossOutput:
        return exit_loss(self.head, batch, self.vocab, self.answers_only)

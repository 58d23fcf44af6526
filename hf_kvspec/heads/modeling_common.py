"""What every draft head shares: a ``PreTrainedModel`` that borrows its base model's embedding and LM head.

Boundary: attaching a head to a base model (after the pairing check) and pushing it to the Hub with a model card.
The heads' own computations live in ``modeling_medusa.py`` / ``modeling_eagle.py``.

The base model's embedding and LM head are *borrowed*, never registered as submodules: they stay out of the head's
``state_dict`` (so checkpoints hold only the head, a few MB) and out of its optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_kvspec.heads.configuration import DraftHeadConfig
from hf_kvspec.heads.pairing import check_base_model


@dataclass
class BorrowedModules:
    """The base model's modules a head uses; a plain dataclass so ``nn.Module`` does not adopt them."""

    embed_tokens: nn.Module
    lm_head: nn.Module


class HeadNotAttachedError(RuntimeError):
    """A head was run before ``head.attach(base_model)``."""


class DraftHeadModel(PreTrainedModel):
    """Base class of ``MedusaHeads`` and ``EagleHead``."""

    config_class = DraftHeadConfig
    base_model_prefix = "head"
    main_input_name = "hidden_states"
    _supports_sdpa = True
    _supports_attention_backend = True

    def attach(self, base_model: nn.Module, strict: bool = True) -> DraftHeadModel:
        """Check that ``base_model`` is the one this head was trained for and borrow its embedding and LM head.

        Raises ``BaseModelMismatchError`` (see ``hf_kvspec.heads.pairing``) for the wrong base model.
        """
        check_base_model(self.config, base_model, strict=strict)
        self._borrowed = BorrowedModules(base_model.get_input_embeddings(), base_model.get_output_embeddings())
        return self

    @property
    def is_attached(self) -> bool:
        return getattr(self, "_borrowed", None) is not None

    def borrowed(self) -> BorrowedModules:
        if not self.is_attached:
            trained_for = self.config.base_model_name_or_path or "an unnamed base model"
            raise HeadNotAttachedError(
                f"{type(self).__name__} uses its base model's embedding and LM head; call "
                f"head.attach(base_model) first (trained for {trained_for})."
            )
        return self._borrowed

    # ---- draft vocabulary (EAGLE-3, arXiv 2503.01840 §3) --------------------------------------------------------
    # Draft id i stands for target id ``i + d2t[i]``; ``t2d[v]`` is True for target ids in the draft vocabulary.
    # Draft ids follow ascending target ids, so ``t2d`` alone fixes the map (the convention of EAGLE-3, vLLM
    # ``speculators`` and SGLang, whose checkpoints carry the same two buffers).
    def _init_draft_vocab(self, size: int | None) -> None:
        """Register ``d2t`` int64 [N] and ``t2d`` bool [V] (identity map until ``set_draft_vocab``)."""
        if size is None:
            self.d2t = self.t2d = None
            return
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        t2d = torch.zeros(self.config.base_vocab_size, dtype=torch.bool)
        t2d[:size] = True
        self.register_buffer("t2d", t2d)

    @property
    def has_draft_vocab(self) -> bool:
        return getattr(self, "d2t", None) is not None

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Make the draft vocabulary the target ids ``token_ids`` [N] (any order; stored ascending)."""
        if not self.has_draft_vocab:
            raise ValueError(f"{type(self).__name__} was built without a draft vocabulary; set "
                             "config.draft_vocab_size=N first.")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        size, vocab = self.d2t.numel(), self.t2d.numel()
        if ids.numel() != size or torch.unique(ids).numel() != size or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"set_draft_vocab needs {size} distinct target ids in 0..{vocab - 1}, got "
                             f"{ids.numel()} ({torch.unique(ids).numel()} distinct).")
        self.d2t.copy_(ids - torch.arange(size))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def draft_vocab_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, int64 [N] ascending (``arange(N) + d2t``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids; the identity for a head without a draft vocabulary."""
        return draft_ids if not self.has_draft_vocab else draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, -1 where the draft vocabulary lacks the token (identity without)."""
        if not self.has_draft_vocab:
            return target_ids
        t2d = self.t2d.to(target_ids.device)
        index = torch.cumsum(t2d.long(), 0) - 1                                   # [V] draft id of each kept id
        return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))

    def get_input_embeddings(self):
        return self.borrowed().embed_tokens if self.is_attached else None

    def get_output_embeddings(self):
        return None  # the LM head is borrowed, never tied into or saved with the head

    def push_to_hub(self, repo_id: str, *, card: str | None = None, commit_message: str | None = None,
                    private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                    **card_fields) -> str:
        """Upload weights, config and a model card (rendered from ``model_cards/`` unless ``card`` is given).

        ``card_fields`` go to ``hf_kvspec.hub.CardFields`` (e.g. ``held_out=`` the ``evaluate_head`` result plus
        ``prompts`` and ``source``, ``speedup="..."``, ``datasets=[...]``). Returns the commit URL.
        """
        from hf_kvspec import hub

        unknown = sorted(set(card_fields) - set(hub.CardFields.__dataclass_fields__))
        if unknown:
            raise TypeError(f"push_to_hub: {unknown} are not card fields; CardFields takes "
                            f"{sorted(hub.CardFields.__dataclass_fields__)} (measured acceptance goes in held_out=).")
        if card is not None and card_fields:
            raise TypeError(f"push_to_hub got card= and card fields {sorted(card_fields)}: the fields only render a "
                            "card, so pass one or the other.")
        card = card if card is not None else hub.render_model_card(self.config, hub.CardFields(**card_fields))
        return hub.push_head(self, repo_id, card, commit_message=commit_message, private=private, token=token,
                             revision=revision)

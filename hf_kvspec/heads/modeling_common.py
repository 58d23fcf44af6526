"""What every draft head shares: a ``PreTrainedModel`` that borrows its base model's embedding and LM head.

Boundary: attaching a head to a base model (after the pairing check) and pushing it to the Hub with a model card.
The heads' own computations live in ``modeling_medusa.py`` / ``modeling_eagle.py``.

The base model's embedding and LM head are *borrowed*, never registered as submodules: they stay out of the head's
``state_dict`` (so checkpoints hold only the head, a few MB) and out of its optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Base class of ``MedusaHeads`` and ``EagleDrafter``."""

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

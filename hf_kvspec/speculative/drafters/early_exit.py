"""Early-exit self-speculation on the target's own cache (LayerSkip, Elhoushi et al. 2404.16710, section 4).

Boundary: drafts with the target's first E layers (+ an optional exit adapter, the final norm and the shared LM
head) and runs the round's verify forward itself (``verify_forward``), reusing what drafting computed. Owns one
piece of state between ``propose`` and ``verify_forward``: the layer-E hidden states of the drafted positions
(the exit-query cache). The loop owns acceptance and the roll back; ``partial_forward.py`` the layer calls.

One round, a row whose cache holds S columns, root r (the newest committed token) and N drafts d1..dN::

    draft    layers 0..E-1 over r, d1, ..., d(N-1), one column at a time, writing their K/V to the target's cache;
             the layer-E states of those N columns are kept, and head(state) gives d1..dN
    verify   layers 0..E-1 over dN only (the one column they have not seen), then layers E..L-1 over r, d1..dN
             from the kept states + dN's; logits [N + 1] for the verifier
    accept   the loop crops every layer to the accepted length (all layers hold S + N + 1 columns here)

Why it is exact: the K/V layers 0..E-1 write while drafting is what the full model computes for those columns in
those layers (same inputs: the committed prefix and the drafted tokens), and the kept layer-E states are the
inputs layers E..L-1 would get; so verify computes the full model's logits over r, d1..dN, with every column
processed once per layer. transformers' ``assistant_early_exit`` instead runs layers 0..E-1 in a separate cache
and then all L layers again in the verify pass.

Shapes: ``B`` rows, ``N`` drafts, ``S`` cached columns, ``W`` buffer width, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from hf_kvspec.cache.contract import crop_layers
from hf_kvspec.speculative.draft_vocab import DraftVocabulary
from hf_kvspec.speculative.drafters.base import Assistant, ChainDraft, DraftContext, DraftProposal
from hf_kvspec.speculative.partial_forward import PartialForward


class EarlyExitAssistant(Assistant):
    """Draft with the target's layers ``0..exit_layer-1``; verify with the rest, on one shared cache.

    ``adapter``: optional module mapping layer-E hidden states [B, T, H] to hidden states [B, T, H] for the final
    norm and LM head, position by position (e.g. ``hf_kvspec.ExitAdapter``, which is attached to the target at
    ``begin``: pairing checked); None = exit straight into the final norm (works when the model was trained for
    early exit). ``exit_layer=None`` takes the adapter's own ``config.exit_layer``.

    ``draft_vocab_size`` (FR-Spec, ``draft_vocab.py``; exact, the target verifies): the default ``"shipped"`` scores
    ``draft_vocab.SHIPPED_SIZE`` ids of the ranking shipped beside a trained adapter (the bundled one has one), so a
    draft step reads that many rows of the LM head instead of all; an int takes that many ids of ``draft_vocab``
    (ids tensor or file) or of the shipped ranking; ``None`` the full vocabulary."""

    shares_target_cache = True
    runs_verify_forward = True

    def __init__(self, exit_layer: int | None, num_draft_tokens: int | str = "auto", adapter=None,
                 max_draft_tokens: int = 16, draft_vocab_size: int | str | None = "shipped", draft_vocab=None):
        super().__init__(num_draft_tokens, max_draft_tokens)
        exit_layer = _adapter_exit_layer(exit_layer, adapter)
        self.vocab = _exit_vocabulary(adapter, draft_vocab_size, draft_vocab)
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or exit_layer < 1:
            raise ValueError(f"exit_layer must be a positive int (the number of layers that draft), got "
                             f"{exit_layer!r}")
        self.exit_layer = exit_layer
        self.adapter = adapter
        self.stack: PartialForward | None = None
        self.kept: torch.Tensor | None = None  # [B, N, H] layer-E states of this round's drafted columns

    def check_target(self, target, cache) -> None:
        """Before the first forward: the exit layer exists, a trained adapter pairs with the target (attached here:
        another base model is refused, its head borrowed) and the adapter maps the target's hidden states."""
        layers = PartialForward(target).num_layers
        if self.exit_layer > layers:
            raise ValueError(f"exit_layer={self.exit_layer} but the target has {layers} layers; pass 1..{layers}")
        if hasattr(self.adapter, "attach"):
            self.adapter.attach(target)
        if self.adapter is not None:
            _check_adapter_width(self.adapter, target)

    def release(self, rows: list[int]) -> None:
        self.staying(rows)  # no per-row state survives a round: finished rows may leave

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        self.stack = PartialForward(target)
        self.check_target(target, None)
        self.kept = None

    def kernel_modules(self) -> tuple:
        return () if self.adapter is None else (self.adapter,)

    # ------------------------------------------------------------------------------------------ draft
    def propose(self, ctx: DraftContext) -> DraftProposal:
        cache = ctx.target_cache
        held = _verified_length(cache, self.stack.num_layers)
        self.kept = None
        early = range(self.exit_layer)
        try:
            return self._draft(ctx, early)
        except BaseException:
            crop_layers(cache, held, early)  # the cache as the loop left it
            self.kept = None
            raise

    def _draft(self, ctx: DraftContext, early: range) -> DraftProposal:
        buffer, count = ctx.buffer, ctx.num_draft_tokens
        ids = buffer.tokens[:, -1:]  # [B, 1] the root
        chain, kept = ChainDraft(ctx, ids[:, :0]), []
        for step in range(count):
            positions = buffer.next_positions(step + 1)[:, -1:]  # [B, 1]
            state = self.stack.run(self.stack.embed(ids), early, buffer.attention_mask(step + 1), positions,
                                   ctx.target_cache)  # [B, 1, H] layer-E input
            kept.append(state)
            ids = chain.next(self.exit_logits(state))[:, None]
        self.kept = torch.cat(kept, dim=1)  # [B, N, H]
        return chain.proposal()

    def exit_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Layer-E states [B, T, H] -> draft logits [B, T, V] (adapter, final norm, shared LM head)."""
        if self.adapter is not None:
            state = self.adapter(state)
        if self.vocab is not None:  # draft vocabulary: only its rows of the LM head are read
            return self.vocab.full_logits(self.stack.norm(state), self.stack.lm_head.weight)
        return self.stack.logits(state)

    # ------------------------------------------------------------------------------------------ verify
    def verify_forward(self, model, inputs: dict, cache, feature_layers=None):
        """The round's target forward from the kept states (module docstring); logits [B, N + 1, V]."""
        if feature_layers is not None:
            raise ValueError("EarlyExitAssistant does not capture target features (wants_hidden_states is False)")
        kept, self.kept = self.kept, None
        if kept is None:  # a round that drafted nothing: a plain decode step
            return model(**inputs, cache=cache, use_cache=True).logits, None
        held = _verified_length(cache, self.stack.num_layers)
        try:
            return self._verify(inputs, cache, kept), None
        except BaseException:
            crop_layers(cache, held)  # every layer back to the verified columns
            raise

    def _verify(self, inputs: dict, cache, kept: torch.Tensor) -> torch.Tensor:
        ids, positions = inputs["input_ids"], inputs["position_ids"]  # [B, N + 1] root + drafts
        if ids.shape[1] != kept.shape[1] + 1:
            raise RuntimeError(f"verify forward over {ids.shape[1]} columns after drafting {kept.shape[1]}")
        key_mask = inputs.get("attention_mask")  # [B, S + N + 1] or None
        last = self.stack.run(self.stack.embed(ids[:, -1:]), range(self.exit_layer), key_mask, positions[:, -1:],
                              cache)  # [B, 1, H] the last draft through layers 0..E-1
        states = torch.cat([kept, last], dim=1)  # [B, N + 1, H]
        states = self.stack.run(states, range(self.exit_layer, self.stack.num_layers), key_mask, positions, cache)
        return self.stack.logits(states[:, -inputs["logits_to_keep"]:])

    def end(self) -> None:
        self.kept = None
        self.stack = None


def _exit_vocabulary(adapter, size: int | str | None, ranking) -> DraftVocabulary | None:
    """The draft vocabulary of an exit (``DraftVocabulary.resolve``): the adapter's shipped ranking or ``ranking``;
    without either, the full vocabulary, or an error when a size was asked for."""
    if adapter is None and ranking is None and size not in (None, "shipped"):
        raise ValueError(f"draft_vocab_size={size} needs a token ranking: pass draft_vocab=<ids tensor or file> "
                         "(e.g. a head directory's token_ranking.safetensors) or a trained adapter that ships one.")
    return DraftVocabulary.resolve(adapter, size, ranking)


@torch.no_grad()
def _check_adapter_width(adapter, target) -> None:
    """The adapter maps [1, 1, H] states of ``target`` to [1, 1, H] (tried on zeros), else a ``ValueError``."""
    hidden = target.get_output_embeddings().weight.shape[1]
    weight = next(adapter.parameters(), None) if isinstance(adapter, torch.nn.Module) else None
    probe = torch.zeros(1, 1, hidden) if weight is None else weight.new_zeros(1, 1, hidden)
    try:
        shape = tuple(adapter(probe).shape)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f"the exit adapter cannot take the target's hidden states [B, T, {hidden}] ({err}); pass an "
                         f"adapter built for this target (hidden size {hidden}).") from err
    if shape != (1, 1, hidden):
        raise ValueError(f"the exit adapter maps [1, 1, {hidden}] states to {list(shape)}; it must return the target's "
                         f"hidden size {hidden} (it feeds the final norm and LM head).")


def _adapter_exit_layer(exit_layer: int | None, adapter) -> int | None:
    """The exit layer to use: the one passed, checked against a trained adapter's ``config.exit_layer``."""
    trained = getattr(getattr(adapter, "config", None), "exit_layer", None)
    if exit_layer is None and trained is None:
        raise ValueError("EarlyExitAssistant needs exit_layer=E (or an adapter whose config names its exit_layer)")
    if trained is not None and exit_layer is not None and exit_layer != trained:
        raise ValueError(f"this adapter was trained on layer-{trained} states; pass exit_layer={trained} or None, "
                         f"or train one for E={exit_layer} (scripts/train_drafter.py --head early_exit "
                         f"--exit_layer {exit_layer})")
    return trained if exit_layer is None else exit_layer


def _verified_length(cache, num_layers: int) -> int:
    # between rounds every layer holds the verified columns; the last layer is never written while drafting
    return int(cache.get_seq_length(num_layers - 1))

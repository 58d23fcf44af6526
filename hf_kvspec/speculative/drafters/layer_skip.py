"""Layer-skipping self-speculation (Draft & Verify, Zhang et al. 2309.08168; SWIFT, Xia et al. 2410.06916).

Boundary: drafts with the target minus a set of skipped decoder layers, attending over the target's own cache for
the committed prefix (no second cache); chooses the skip set on request (``search``). The loop's ordinary verify
forward (all layers) checks the drafts; ``partial_forward.py`` runs the layers.

Why the draft columns are cropped before verify: a kept layer after a skipped one sees different inputs while
drafting than in the full model, so the K/V it writes at the draft columns are not the target's. ``propose``
crops them (``contract.crop_layers``) before returning; the verify forward writes the exact ones. The prefix
columns, written by the full model, are the target's: drafting reads them as they are (the draft model is "the
target with layers skipped, attending over the target's K/V", as in both papers).

``skip_layers="search"`` (SWIFT-style, a ranking instead of Bayesian optimisation): on the first call, the target
continues the first prompt row greedily for ``calibration_tokens`` tokens; each layer is scored by the
teacher-forced agreement (the skipping model's argmax equals the target's next token) with that layer alone
skipped; then the n best-ranked layers are skipped together, n = 1, 2, ... up to half of the layers or until
``patience`` steps bring no better set; the set with the best estimated speed
``tau(alpha) / (1 + N * kept_fraction)``, ``tau(alpha) = (1 - alpha^(N + 1)) / (1 - alpha)``, wins. Cost: one
calibration generation plus at most ``L + L / 2 - 1`` teacher-forced forwards over prompt + continuation
(measured for the bundled model: docs/self_speculative.md). Deviation from the drafting it scores: the
teacher-forced forward computes the skipping model's own K/V for the prefix, not the target's (one forward per
candidate instead of one per position).

The search runs once per model: its result is kept per model object and search settings
(``skip_search_store.py``), so a second ``LayerSkipAssistant("search")`` on the same model reuses it
(``search_reused``) unless built with ``reuse_search=False``. ``save_skip_layers`` writes it to a JSON file and
``LayerSkipAssistant.from_search`` reads one back, refusing a file searched on a model with another config.

Shapes: ``B`` rows, ``N`` drafts, ``T`` calibration columns, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_kvspec.cache.contract import crop_layers
from hf_kvspec.speculative.drafters import skip_search_store as store
from hf_kvspec.speculative.drafters.base import Assistant, ChainDraft, DraftContext, DraftProposal
from hf_kvspec.speculative.drafters.checks import require_count
from hf_kvspec.speculative.drafters.skip_search_store import ModelFingerprint, SearchResult, SearchSettings
from hf_kvspec.speculative.partial_forward import PartialForward


class LayerSkipAssistant(Assistant):
    """Draft with the target's layers except ``skip_layers`` (a list of layer indices, or ``"search"``).

    ``"search"`` chooses the set on the first ``generate`` call (module docstring) and keeps it for later calls.
    An earlier search on the same model object with the same ``calibration_tokens``, ``patience`` and draft length
    is reused instead (``search_reused`` is then True); ``reuse_search=False`` searches again and replaces it.

    Saving and loading a searched set (``search_result``: the set, its settings, the search log, the model's config
    fingerprint)::

        assistant.save_skip_layers("skip_layers.json")      # after a generate call that searched
        assistant = LayerSkipAssistant.from_search("skip_layers.json", model)

    ``from_search`` refuses (ValueError) a file searched on a model whose model_type, num_hidden_layers,
    hidden_size or vocab_size differ; without ``model`` the check runs at the start of ``generate``.
    """

    shares_target_cache = True

    def __init__(self, skip_layers: list[int] | str = "search", num_draft_tokens: int | str = 4,
                 max_draft_tokens: int = 16, calibration_tokens: int = 16, patience: int = 3,
                 reuse_search: bool = True):
        super().__init__(num_draft_tokens, max_draft_tokens)
        require_count("calibration_tokens", calibration_tokens)
        require_count("patience", patience, minimum=0)
        if skip_layers != "search":
            if isinstance(skip_layers, (str, bytes)) or not isinstance(skip_layers, Iterable) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in skip_layers):
                raise ValueError(f"skip_layers must be a list of layer indices (e.g. [{skip_layers}] for one layer) "
                                 f"or 'search' (a saved search: LayerSkipAssistant.from_search(path)), got "
                                 f"{skip_layers!r}")
            skip_layers = sorted(set(skip_layers))
        self.skip_layers = skip_layers
        self.calibration_tokens = calibration_tokens
        self.patience = patience  # search steps without a better set before it stops
        self.reuse_search = reuse_search  # take an earlier search's result on the same model (skip_search_store)
        self.search_log: list[tuple[tuple[int, ...], float, float]] = []  # (skip set, agreement, estimated speed)
        self.search_result: SearchResult | None = None  # the searched or loaded set, what save_skip_layers writes
        self.search_reused = False  # the set came from an earlier search on the same model, not a search of ours
        self.search_file: Path | None = None  # where from_search read the set
        self.stack: PartialForward | None = None

    @classmethod
    def from_search(cls, path: str | Path, model=None, num_draft_tokens: int | str | None = None,
                    max_draft_tokens: int = 16) -> LayerSkipAssistant:
        """An assistant with the skip set saved in ``path`` by ``save_skip_layers``; checked against ``model``'s
        config now when given, else against the target's at the start of ``generate``. ``num_draft_tokens=None``
        drafts as many tokens as the search scored."""
        result = store.load(path)
        if model is not None:
            store.check_fingerprint(result, model, str(path))
        settings = result.settings
        if num_draft_tokens is None:
            num_draft_tokens = settings.num_draft_tokens
        assistant = cls(list(result.skip_layers), num_draft_tokens, max_draft_tokens, settings.calibration_tokens,
                        settings.patience)
        assistant.search_result, assistant.search_file = result, Path(path)
        assistant.search_log = list(result.log)
        return assistant

    def save_skip_layers(self, path: str | Path) -> Path:
        """Write the searched skip set, its settings, the search log and the model's fingerprint to ``path`` (JSON)."""
        if self.search_result is None:
            raise ValueError("save_skip_layers saves a searched skip set: build LayerSkipAssistant('search') and run "
                             "generate with it once first (an explicit skip_layers list needs no file)")
        return store.save(self.search_result, path)

    def search_settings(self) -> SearchSettings:
        """The settings that change the search's result (part of the reuse key and of a saved file)."""
        draft_len = self.num_draft_tokens if isinstance(self.num_draft_tokens, int) else 4
        return SearchSettings(self.calibration_tokens, self.patience, draft_len)

    def release(self, rows: list[int]) -> None:
        self.staying(rows)  # no per-row state survives a round: finished rows may leave

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        self.stack = PartialForward(target)
        if self.skip_layers == "search":
            prompt = buffer.tokens[:1, :-1][:, buffer.mask[0, :-1].bool()]  # the first row's prompt (no padding)
            self.search_result = self._searched_or_reused(target, prompt)
            self.skip_layers, self.search_log = list(self.search_result.skip_layers), list(self.search_result.log)
        elif self.search_result is not None:  # a set searched or loaded before: made for this config?
            where = str(self.search_file) if self.search_file else "this LayerSkipAssistant (searched earlier)"
            store.check_fingerprint(self.search_result, target, where)
        bad = [i for i in self.skip_layers if i >= self.stack.num_layers]
        if bad or len(self.skip_layers) >= self.stack.num_layers:
            raise ValueError(f"skip_layers={self.skip_layers} for a {self.stack.num_layers}-layer target: skip "
                             f"indices 0..{self.stack.num_layers - 1}, keeping at least one layer")
        self.kept_layers = [i for i in range(self.stack.num_layers) if i not in self.skip_layers]

    def _searched_or_reused(self, target, prompt: torch.Tensor) -> SearchResult:
        settings = self.search_settings()
        earlier = store.remembered(target, settings) if self.reuse_search else None
        self.search_reused = earlier is not None
        if earlier is not None:
            return earlier
        skip = self.search(prompt)
        result = SearchResult(tuple(skip), tuple(self.search_log), settings, ModelFingerprint.of(target),
                              target.config.name_or_path)
        store.remember(target, result)
        return result

    # ------------------------------------------------------------------------------------------ draft
    def propose(self, ctx: DraftContext) -> DraftProposal:
        cache = ctx.target_cache
        held = int(cache.get_seq_length(self.stack.num_layers - 1))
        try:
            return self._draft(ctx)
        finally:
            crop_layers(cache, held, self.kept_layers)  # the draft columns' K/V are not the target's

    def _draft(self, ctx: DraftContext) -> DraftProposal:
        buffer, count = ctx.buffer, ctx.num_draft_tokens
        ids = buffer.tokens[:, -1:]  # [B, 1] the root
        chain = ChainDraft(ctx, ids[:, :0])
        for step in range(count):
            positions = buffer.next_positions(step + 1)[:, -1:]  # [B, 1]
            state = self.stack.run(self.stack.embed(ids), self.kept_layers, buffer.attention_mask(step + 1),
                                   positions, ctx.target_cache)  # [B, 1, H]
            ids = chain.next(self.stack.logits(state))[:, None]
        return chain.proposal()

    # ------------------------------------------------------------------------------------------ search
    @torch.no_grad()
    def search(self, prompt: torch.Tensor) -> list[int]:
        """The skip set for ``prompt`` [1, P] (module docstring); records each step in ``search_log``."""
        sequence = self._calibration_sequence(prompt)  # [1, T]
        targets = sequence[:, prompt.shape[1]:]  # the tokens the target chose
        every = list(range(self.stack.num_layers))
        draft_len = self.search_settings().num_draft_tokens
        # rank the layers once by the agreement without each of them alone (L forwards) ...
        alone = sorted(((self._agreement(sequence, targets, [i]), i) for i in every), reverse=True)
        best, best_speed = [], 1.0  # plain decoding; skipping nothing drafts right at a full forward per token
        self.search_log = []
        # ... then skip the n best-ranked ones together, n = 1 .. L / 2 (one forward each, stopped by patience)
        for count in range(1, self.stack.num_layers // 2 + 1):
            skipped = sorted(i for _, i in alone[:count])
            agreement = alone[0][0] if count == 1 else self._agreement(sequence, targets, skipped)
            speed = _estimated_speed(agreement, draft_len, 1 - len(skipped) / len(every))
            self.search_log.append((tuple(skipped), agreement, speed))
            if speed > best_speed:
                best, best_speed = list(skipped), speed
            elif count - len(best) >= self.patience:  # no better set in the last few steps: stop
                break
        return best

    def _calibration_sequence(self, prompt: torch.Tensor) -> torch.Tensor:
        # prompt [1, P] -> prompt + the target's greedy continuation [1, P + calibration_tokens]
        cache, ids, sequence = DynamicCache(config=self.stack.model.config), prompt, prompt
        for _ in range(self.calibration_tokens):
            logits = self.stack.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            ids = logits[:, -1].argmax(dim=-1, keepdim=True)
            sequence = torch.cat([sequence, ids], dim=1)
        return sequence

    def _agreement(self, sequence: torch.Tensor, targets: torch.Tensor, skipped: list[int]) -> float:
        """Fraction of the continuation where the model without ``skipped`` predicts the target's token."""
        layers = [i for i in range(self.stack.num_layers) if i not in skipped]
        positions = torch.arange(sequence.shape[1], device=sequence.device)[None]
        cache = DynamicCache(config=self.stack.model.config)
        state = self.stack.run(self.stack.embed(sequence), layers, None, positions, cache)
        predicted = self.stack.logits(state[:, -targets.shape[1] - 1:-1]).argmax(dim=-1)  # [1, T_new]
        return float((predicted == targets).float().mean())

    def end(self) -> None:
        self.stack = None


def _estimated_speed(agreement: float, draft_len: int, kept_fraction: float) -> float:
    """Expected tokens per target-forward cost: tau / (1 + N * kept_fraction), alpha i.i.d. (Leviathan et al.)."""
    alpha = min(agreement, 1 - 1e-6)
    tau = (1 - alpha ** (draft_len + 1)) / (1 - alpha)
    return tau / (1 + draft_len * kept_fraction)

"""Lookahead decoding (Fu et al. 2402.02057) as an exact assistant: the target is the only model.

Boundary: owns each row's Jacobi window (``lookahead_window.py``), n-gram pool and context lookup
(``ngram_pool.py``) and the round's target forward (``verify_forward``), which carries the lookahead branch beside
the verification tree under one combined 4D mask. The loop owns verification (``rounds.py`` TreeRound: the
candidates are point masses, so greedy and sampling stay exact), the roll back and the output.

One round, per row::

    propose          candidates after the root (the last committed token): the context continuation (prompt
                     lookup over prompt + committed text, when ``prompt_ngrams``) and the tails of the ``G`` most
                     recent pool n-grams keyed by the root, merged into a tree where they share prefixes
    verify_forward   one target forward over [root, nodes, window] (``combined_mask``); logits of the root and
                     the nodes go to the verifier, the argmax at the window's last level is the new level; the
                     window's cache columns (written last) are cropped, so the cache holds what a plain forward
                     over [root, nodes] leaves, and the loop keeps the accepted path as for any tree
    after            the window advances one Jacobi step; full columns' trajectories (n-grams) enter the pool

Deviations from the paper: the window starts from random prompt tokens and fills its levels one per round
(warm-up) as in the reference implementation; the prompt is not copied into the pool: the context continuation
matches the last 1..3 committed tokens against the prompt and the committed text (prompt lookup), a more
specific key than the pool's one token; lookahead-branch argmax is taken on raw logits under sampling too
(the window only proposes; every candidate is verified against the processed target distribution). Batch > 1:
each row its own window and pool; rows may leave the batch.

Shapes: ``A`` rows, ``W`` window width, ``N`` n-gram length, ``G`` guesses, ``Q`` verified columns (root +
nodes), ``L`` window tokens, ``S`` cached columns, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from hf_kvspec.masking import additive_mask, pad_keys
from hf_kvspec.speculative.autok import is_count
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal
from hf_kvspec.speculative.drafters.lookahead_sizing import PLAIN, AutoLookahead, Shape, lookahead_menu
from hf_kvspec.speculative.drafters.lookahead_window import JacobiWindow, combined_mask, verify_block
from hf_kvspec.speculative.drafters.ngram_pool import NgramPool, context_continuation, merge_candidates

_MAX_MATCH = 3  # context lookup matches the last 1..3 tokens (NgramAssistant's default)
_CONTEXT_TOKENS = 8  # drafts of the context continuation (NgramAssistant's default)


class LookaheadAssistant(Assistant):
    """``LookaheadAssistant(window=W, ngram=N, guesses=G, prompt_ngrams=True)``: Lookahead decoding, exact.

    ``window`` W columns of Jacobi guesses in ``ngram - 1`` levels ride along every target forward;
    ``guesses`` G pool n-grams (``ngram - 1`` drafts each) are verified per round, plus, with ``prompt_ngrams``,
    the context continuation of up to ``context_tokens`` drafts (default 8, as ``NgramAssistant``), verified
    first: a node cap keeps whole candidates in that order. ``pool_size``: n-grams kept
    per row (oldest evicted). ``num_draft_tokens="auto"`` sizes each round (window width, guesses, or plain
    decoding) from the measured forward cost (``lookahead_sizing.py``); an int runs the full shape every round with
    at most that many verified nodes. ``seed`` fixes the window's random start (outputs never depend on it).
    """

    proposes_trees = True
    runs_verify_forward = True

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, prompt_ngrams: bool = True,
                 num_draft_tokens: int | str = "auto", pool_size: int = 512, context_tokens: int | None = None,
                 seed: int = 0):
        _check_options(window, ngram, guesses, pool_size, context_tokens)
        self.window, self.ngram, self.guesses, self.prompt_ngrams = window, ngram, guesses, bool(prompt_ngrams)
        self.context_tokens = (_CONTEXT_TOKENS if context_tokens is None else context_tokens) if prompt_ngrams else 0
        most = guesses * (ngram - 1) + self.context_tokens
        super().__init__(num_draft_tokens, max_draft_tokens=max(most, 1))
        self.auto = None  # sized by shape below, not by draft length
        menu = lookahead_menu(window, guesses, self.prompt_ngrams)
        self.sizing = (AutoLookahead(menu, ngram, {s: self._most_nodes(s) for s in menu})
                       if num_draft_tokens == "auto" else None)
        self.pool_size, self.seed = pool_size, seed
        self.shape = Shape(window, guesses, self.prompt_ngrams)
        self.jacobi: JacobiWindow | None = None
        self.pool: NgramPool | None = None
        self.first_real: torch.Tensor | None = None  # [A] left padding of each row's history
        self.fed = 1  # tokens the last forward fed (for the sizing)

    def _most_nodes(self, shape: Shape) -> int:
        return shape.guesses * (self.ngram - 1) + (self.context_tokens if shape.context else 0)

    # ------------------------------------------------------------------------------------------ call state
    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        rows, device = buffer.tokens.shape[0], buffer.tokens.device
        real = buffer.mask.sum(dim=1)  # [A] prompt + first token, left padded
        self.first_real = buffer.mask.shape[1] - real
        gen = torch.Generator().manual_seed(self.seed)
        pick = (torch.rand(rows, self.window, generator=gen).to(device) * real[:, None]).long()
        self.jacobi = JacobiWindow(buffer.tokens.gather(1, self.first_real[:, None] + pick), self.ngram)
        self.pool = NgramPool(rows, self.pool_size, self.ngram, device)
        if self.sizing is not None:
            self.sizing.start_call(rows)

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        self.jacobi.select_rows(index)
        self.pool.select_rows(index)
        self.first_real = self.first_real[index.to(self.first_real.device)]

    def end(self) -> None:
        self.jacobi = self.pool = self.first_real = None

    # ------------------------------------------------------------------------------------------ draft
    def draft_length(self) -> int:
        if self.sizing is not None:
            self.shape = self.sizing.choose()
            return self._most_nodes(self.shape) if self.shape != PLAIN else 0
        return self.num_draft_tokens

    def propose(self, ctx: DraftContext) -> DraftProposal:
        root = ctx.buffer.tokens[:, -1]  # [A]
        candidates = self.candidates(ctx, root)  # [A, C, D]
        candidates = torch.where(ctx.alive[:, None, None], candidates, -1)
        if ctx.max_depth is not None:
            candidates = candidates[:, :, : ctx.max_depth]
        tokens, parents = merge_candidates(candidates, root, ctx.num_draft_tokens)
        if tokens.shape[1] == 0:
            return DraftProposal(tokens)
        return DraftProposal(tokens, parents=parents)

    def candidates(self, ctx: DraftContext, root: torch.Tensor) -> torch.Tensor:
        """``[A, C, D]`` candidate paths after ``root``: the context continuation first, then pool tails, most
        recent first; ``-1`` padded."""
        parts = []
        if self.shape.context:
            history = ctx.history
            found = context_continuation(history.ids, history.lengths.to(history.ids.device),
                                         self.first_real.to(history.ids.device), _MAX_MATCH, self.context_tokens)
            parts.append(found[:, None])
        if self.shape.guesses:
            parts.append(self.pool.lookup(root, self.shape.guesses))
        if not parts:
            return root.new_full((root.shape[0], 0, 1), -1)
        depth = max(part.shape[2] for part in parts)
        return torch.cat([torch.nn.functional.pad(part, (0, depth - part.shape[2]), value=-1) for part in parts], 1)

    # ------------------------------------------------------------------------------------------ verify
    def verify_forward(self, model, inputs: dict, cache, feature_layers=None):
        """One forward over the root, the nodes and the window: logits ``[A, Q, V]`` of the root and the nodes
        (those a forward without the window gives); the window advances and the cache keeps the ``Q`` columns."""
        if feature_layers is not None:
            raise ValueError("LookaheadAssistant does not capture target features (wants_hidden_states is False)")
        width = self.shape.window if self.shape != PLAIN else 0
        if width == 0 or cache is None:
            self.fed = inputs["input_ids"].shape[1]
            return model(**inputs, cache=cache, use_cache=True).logits, None
        combined, keep, size = self.branch_inputs(inputs, cache, width, model.dtype)
        out = model(**combined, cache=cache, use_cache=True, logits_to_keep=keep)
        cache.crop(-size)  # the window's columns came last: the cache now holds S + Q columns
        logits = out.logits  # [A, k + width, V]
        verified = logits[:, : keep.shape[0] - width]
        grams = self.jacobi.advance(logits[:, -width:].argmax(dim=-1), width)
        if grams is not None:
            self.pool.add(grams)
        self.fed = combined["input_ids"].shape[1]
        return verified, None

    def branch_inputs(self, inputs: dict, cache, width: int, dtype) -> tuple[dict, torch.Tensor, int]:
        """The forward's kwargs over [root, nodes, window], the logits it keeps (the loop's columns of the
        verified ones, then the window's last level) and the window's token count ``L``."""
        ids, positions = inputs["input_ids"], inputs["position_ids"]  # [A, Q]
        rows, count = ids.shape
        window, wmask, offsets = self.jacobi.feed(width)  # [A, L], [L, L], [L]
        size = window.shape[1]
        held = int(cache.get_seq_length())
        block = verify_block(inputs.get("attention_mask"), rows, held, count, ids.device)  # [A, Q, S + Q]
        mask = additive_mask(combined_mask(block, wmask), dtype)  # [A, 1, Q + L, S + Q + L]
        mask = pad_keys(mask, cache.get_mask_sizes(count + size, 0)[0])
        kept = inputs.get("logits_to_keep") or count
        keep = torch.cat([torch.arange(count - kept, count), torch.arange(count + size - width, count + size)])
        return (dict(input_ids=torch.cat([ids, window.to(ids.device)], dim=1), attention_mask=mask,
                     position_ids=torch.cat([positions, positions[:, :1] + offsets], dim=1)),
                keep.to(ids.device), size)

    # ------------------------------------------------------------------------------------------ after
    def observe(self, outcome) -> None:
        if self.sizing is None:
            return
        alive = outcome.alive
        rows = max(int(alive.sum()), 1)
        emitted = float((outcome.num_accepted[alive] + 1).sum()) / rows
        self.sizing.update(self.shape, self.fed, outcome.num_draft_tokens, emitted, outcome.verify_time_s,
                           outcome.draft_time_s)


def _check_options(window, ngram, guesses, pool_size, context_tokens) -> None:
    for name, value, minimum in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 0),
                                 ("pool_size", pool_size, 1)):
        if not is_count(value, minimum):
            raise ValueError(f"LookaheadAssistant: {name} must be an int >= {minimum}, got {value!r}")
    if context_tokens is not None and not is_count(context_tokens, 1):
        raise ValueError(f"LookaheadAssistant: context_tokens must be a positive int or None, got {context_tokens!r}")

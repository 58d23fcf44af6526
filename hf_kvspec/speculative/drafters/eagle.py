"""EAGLE drafting (Li et al. 2401.15077; EAGLE-2 dynamic trees 2406.16858; EAGLE-3 feature fusion 2503.01840).

Boundary: owns the ``EagleHead``'s own KV cache (a ``DynamicCache`` over its one decoder layer) and the target
features it has not fed yet; drafts a tree per round through ``tree.py``'s growers. Never touches the target's cache.

Alignment with the loop's ``TokenBuffer`` (column c of the drafter cache is buffer column c, holes included):
column c holds the pair (target feature after token c, the next real token after c) at token c's position -- the
shifted pairing the drafter was trained on. The buffer's last column (the newest token, the tree's root) has no
target feature yet, so the cache holds ``width - 1`` columns between rounds.

One round:
    catch-up   feed the columns committed since the last round with the target's own features; the output at
               each row's last real column scores the root's children.
    grow       each level feeds the expanded nodes with their parent's draft output in place of a feature,
               at position root + depth - 1, each seeing the committed columns, its ancestors and itself.
    roll back  crop the tree rows off the cache. Accepted nodes come back next round in the catch-up with the
               target's true features (EAGLE re-feeds them too), so no keep-positions step is needed here.

Shapes: ``B`` rows, ``W`` buffer width, ``m`` fed rows, ``H`` hidden, ``F`` feature width, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from hf_kvspec.masking import additive_mask
from hf_kvspec.speculative.autotree import AutoTreeSize, dynamic_menu, fit_tree, static_menu
from hf_kvspec.speculative.draft_vocab import DraftVocabulary
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.drafters.checks import require_count, require_head, require_rank_fits
from hf_kvspec.speculative.drafters.features import begin_with_features
from hf_kvspec.speculative.tree import grow_dynamic_tree, grow_static_tree, static_tree


class EagleAssistant(Assistant):
    """``EagleAssistant(head, tree="dynamic", depth=5, top_k=4, total_tokens=24)``.

    ``tree="dynamic"``: EAGLE-2, per-row trees of ``total_tokens`` nodes grown ``depth`` levels deep with ``top_k``
    children per expanded node; ``"chain"``: ``depth`` tokens; a choice list: a static tree whose node
    ``(r_1, .., r_d)`` takes the drafter's rank-``r_d`` token after its parent's path. ``num_draft_tokens`` caps
    the nodes (``None`` = the tree's size; ``"auto"``, the default = node count and depth chosen each round from
    measured acceptance and verify cost, ``autotree.AutoTreeSize``, plain decoding when no tree pays). Near ``max_new_tokens`` the loop caps the depth, not
    the width. Defaults are sized for CPU verification, where every extra verified node costs (EAGLE-2's GPU
    defaults are 60 nodes, depth 7, top-k 10).
    ``draft_vocab_size``: the drafter scores only the most frequent target tokens (FR-Spec, ``draft_vocab.py``),
    ranked by ``draft_vocab`` (ids tensor or file; default: the ranking shipped in the head's directory); the tree
    is grown in draft-vocabulary columns and mapped back to target ids. Still exact (the target verifies). The
    default ``"shipped"`` takes ``draft_vocab.SHIPPED_SIZE`` ids of a shipped ranking when the head has one (the
    bundled heads do); ``None`` scores the full vocabulary.

    The drafter reads the target features of ``config.feature_layers``; the loop must pass exactly those,
    concatenated (``features.FeatureCapture``). A head that is not attached yet is attached on the first call.
    """

    wants_hidden_states = True
    can_drop_rows = True
    proposes_trees = True  # the loop checks up front that the target's attention takes a 4D tree mask

    def __init__(self, head, tree: str | Sequence[Sequence[int]] = "dynamic", depth: int = 5,
                 top_k: int = 4, total_tokens: int = 24, num_draft_tokens: int | str | None = "auto",
                 draft_vocab_size: int | str | None = "shipped", draft_vocab=None):
        require_head("EagleAssistant", head)
        for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            require_count(name, value)
        self.static = None if tree == "dynamic" else static_tree(tree, depth)
        size = total_tokens if self.static is None else self.static.num_nodes
        super().__init__(size if num_draft_tokens is None else num_draft_tokens, max_draft_tokens=size)
        if num_draft_tokens == "auto":
            self.auto = AutoTreeSize(dynamic_menu(depth, total_tokens, top_k) if self.static is None
                                     else static_menu(self.static))
        self.head = head.eval()
        if draft_vocab_size not in (None, "shipped") and getattr(head, "has_draft_vocab", False):
            raise ValueError("this head was trained with its own draft vocabulary (config.draft_vocab_size="
                             f"{head.config.draft_vocab_size}): its projection is already restricted; leave "
                             "draft_vocab_size unset.")
        self.vocab = DraftVocabulary.resolve(head, draft_vocab_size, draft_vocab)
        if self.static is None:
            require_rank_fits(f"top_k={top_k}", top_k, head, self.vocab, "pass a smaller top_k")
        else:
            require_rank_fits(f"the tree (a node of rank {self.static.max_rank - 1})", self.static.max_rank, head,
                              self.vocab, "use a tree of lower ranks or a larger draft_vocab_size")
        self._fitted: dict[tuple, object] = {}
        self.feature_layers = tuple(head.config.feature_layers)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.cache = None
        self.cached = 0  # buffer columns in the drafter cache
        self.pending = None  # [B, m, F] target features of buffer columns cached .. cached + m - 1
        self.root_hidden = None  # [B, H] draft output that scores the root's children

    # ------------------------------------------------------------------------------------------ state
    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        begin_with_features(self, self.head, target, target_hidden)
        width = len(self.feature_layers) * self.head.config.base_hidden_size
        if target_hidden.shape[-1] != width:
            raise ValueError(f"the drafter reads target layers {list(self.feature_layers)} ({width} features per "
                             f"token) but got {target_hidden.shape[-1]}; pass FeatureCapture(target, "
                             f"{list(self.feature_layers)}).features() as the target's hidden states.")
        self.cache, self.cached, self.root_hidden = DynamicCache(), 0, None
        missing = buffer.width - 1 - target_hidden.shape[1]  # prompt columns a caller's cache held already
        self.pending = torch.nn.functional.pad(target_hidden, (0, 0, max(missing, 0), 0))  # zeros: still exact

    def observe(self, outcome: RoundOutcome) -> None:
        super().observe(outcome)
        new = outcome.kept_width - self.cached - self.pending.shape[1]  # columns committed this round
        self.pending = torch.cat([self.pending, outcome.target_hidden[:, :new].to(self.pending.dtype)], dim=1)

    def select_rows(self, index: torch.Tensor) -> None:
        if self.cache is not None and self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(index)
        device_index = index.to(self.pending.device)
        self.pending = self.pending[device_index]
        if self.root_hidden is not None:
            self.root_hidden = self.root_hidden[device_index]

    def kernel_modules(self) -> tuple:
        return (self.head,)

    def end(self) -> None:
        self.cache = self.pending = self.root_hidden = None

    # ------------------------------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        buffer, count = ctx.buffer, ctx.num_draft_tokens
        root_hidden = self._catch_up(buffer)  # [B, H]
        root_logprobs = self._logprobs(root_hidden[:, None])[:, 0]  # [B, V] (V': draft vocabulary columns)
        expand = _TreeRows(self, root_hidden, buffer)
        max_depth = ctx.max_depth or count  # the loop's cap near max_new_tokens
        if self.static is None:
            depth = self.auto.shape.depth if isinstance(self.auto, AutoTreeSize) else self.depth
            tree = grow_dynamic_tree(root_logprobs, expand, max(1, min(depth, count, max_depth)), self.top_k,
                                     min(self.total_tokens, count))
            parents = tree.parents  # [B, N] per row
        else:
            key = (count, max_depth)
            if key not in self._fitted:
                self._fitted[key] = fit_tree(self.static, count, max_depth)
            static = self._fitted[key]
            tree, parents = grow_static_tree(root_logprobs, expand, static), static.parents.to(root_hidden.device)
        tree_rows = self.cache.get_seq_length() - self.cached
        if tree_rows:
            self.cache.crop(-tree_rows)  # roll back the tree rows
        return DraftProposal(self.target_ids(tree.tokens), None, parents, draft_forwards=1 + expand.calls)

    def target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns -> target token ids: the ranking's (``draft_vocab_size=``), the head's own trained
        vocabulary (``d2t``, EAGLE-3), or the identity."""
        return self.head.draft_to_target(tokens) if self.vocab is None else self.vocab.to_target(tokens)

    def _catch_up(self, buffer) -> torch.Tensor:
        """Feed buffer columns ``cached .. width - 2`` with their target features -> ``[B, H]`` the output at each
        row's last real column (kept from the last call when nothing new was committed)."""
        start, end = self.cached, buffer.width - 1
        if end == start:
            return self.root_hidden
        positions = buffer.positions[:, start:end]  # [B, m]
        mask = additive_mask(_catch_up_mask(buffer.mask[:, :end], start), self.head.dtype)  # [B, 1, m, end]
        out = self.head(next_real_tokens(buffer.tokens, buffer.mask)[:, start:end],
                        features=self.pending.to(self.head.dtype), position_ids=positions, attention_mask=mask,
                        cache=self.cache, return_logits=False)
        last = _last_real(buffer.mask[:, :end]).clamp_min(start) - start  # [B]
        rows = torch.arange(last.shape[0], device=last.device)
        self.cached, self.pending = end, self.pending[:, :0]
        self.root_hidden = out.hidden_states[rows, last]
        return self.root_hidden

    def _logprobs(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        # [B, m, H] -> [B, m, V] float32 log-probabilities of the next token ([B, m, V'] over the draft vocabulary)
        if self.vocab is None:
            logits = self.head.logits(draft_hidden)
        else:
            logits = self.vocab.logits(self.head.norm(draft_hidden), self.head.borrowed().lm_head.weight)
        return torch.log_softmax(logits.float(), dim=-1)


class _TreeRows:
    """The ``expand`` callback of ``tree.py``: feeds one level of nodes into the drafter cache (after the committed
    columns), each seeing its ancestors among the earlier tree rows; remembers outputs and visibility."""

    def __init__(self, assistant: EagleAssistant, root_hidden: torch.Tensor, buffer):
        self.assistant = assistant
        self.prefix = buffer.mask[:, : assistant.cached].bool()  # [B, S] real committed columns
        self.root_position = buffer.positions[:, -1:]  # [B, 1]
        self.hidden = root_hidden[:, None]  # [B, 1, H] outputs of the previous call's rows (first: the root's)
        self.visible = root_hidden.new_zeros(root_hidden.shape[0], 1, 0, dtype=torch.bool)  # [B, m, F] tree rows
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
        # tokens, parent_slot [B, m] -> log-probs [B, m, V] of each fed node's children
        batch, count = tokens.shape
        slot = parent_slot.clamp_min(0)[..., None]  # [B, m, 1]; level-1 nodes read the root's slot 0
        parent_hidden = self.hidden.gather(1, slot.expand(-1, -1, self.hidden.shape[-1]))  # [B, m, H]
        inherited = self.visible.gather(1, slot.expand(-1, -1, self.visible.shape[-1]))  # [B, m, F]
        own = torch.eye(count, dtype=torch.bool, device=tokens.device).expand(batch, count, count)
        self.visible = torch.cat([inherited, own], dim=2)  # [B, m, F + m]
        allowed = torch.cat([self.prefix[:, None].expand(-1, count, -1), self.visible], dim=2)[:, None]
        head = self.assistant.head
        positions = (self.root_position + self.calls).expand(batch, count)  # depth d sits at root + d - 1
        out = head(self.assistant.target_ids(tokens), draft_hidden=parent_hidden, position_ids=positions,
                   attention_mask=additive_mask(allowed, head.dtype), cache=self.assistant.cache, return_logits=False)
        self.hidden = out.hidden_states
        self.calls += 1
        return self.assistant._logprobs(self.hidden)


def next_real_tokens(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` -> ``[B, W]`` the token of the first real column after each column (the last column's own token
    where none follows): the token EAGLE pairs with column c's feature, skipping holes."""
    width = tokens.shape[1]
    cols = torch.arange(width, device=tokens.device).expand_as(tokens)
    real = torch.where(mask.bool(), cols, width)
    after = torch.cat([real[:, 1:], real.new_full((real.shape[0], 1), width)], dim=1)
    following = after.flip(1).cummin(dim=1).values.flip(1).clamp_max(width - 1)
    return tokens.gather(1, following)


def _last_real(mask: torch.Tensor) -> torch.Tensor:
    # [B, W] -> [B] index of the last real column (0 when none)
    cols = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask.bool(), cols, 0).max(dim=1).values


def _catch_up_mask(mask: torch.Tensor, start: int) -> torch.Tensor:
    """Bool ``[B, 1, W - start, W]`` (True = attend): query column q sees real columns up to q, and itself (a hole
    query then attends somewhere, so no row is fully masked)."""
    width = mask.shape[1]
    queries = torch.arange(start, width, device=mask.device)[:, None]
    keys = torch.arange(width, device=mask.device)[None, :]
    allowed = (mask.bool()[:, None, :] & (keys <= queries)) | (keys == queries)  # [B, m, W]
    return allowed[:, None]
